"""PeerIdentity: what a process says about itself so that two peers can tell which transport
reaches between them (negotiation.choose_path decides).

Every field is read from the kernel or the driver, none from configuration: two processes
agree on a value only if they really share what it names. A value that cannot be read is
empty (or 0), and an empty value never matches, so an unknown peer gets the inline path.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CPU = "cpu"
SHM_DIR = "/dev/shm"
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_IPC_NAMESPACE_PATH = "/proc/self/ns/ipc"


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    # The kernel's boot id: the same for every process (and container) of one host and boot.
    boot_id: str
    # For logs only: pods of one node have hostnames of their own yet can share IPC (hostIPC),
    # so the hostname decides nothing.
    hostname: str
    # st_dev of /dev/shm: equal only where the very same tmpfs is mounted (one container, the
    # containers of one pod with a shared /dev/shm, or the host's). Different containers on one
    # host usually each have their own.
    shm_device: int
    # The inode of /proc/self/ns/ipc: CUDA IPC needs both processes in one IPC namespace.
    ipc_namespace: int
    # Where this peer's tensors live: "cpu", or the UUID of its CUDA device.
    device_uuid: str
    # CUDA devices this peer can read from its device: its own and those with peer access,
    # by UUID (a device's index differs between processes with different visible devices).
    readable_device_uuids: tuple[str, ...] = ()

    @property
    def is_cuda(self) -> bool:
        return self.device_uuid != CPU


def local_identity(device: torch.device | str = CPU) -> PeerIdentity:
    """This process's identity, its tensors on `device`. Reads /proc and, for a CUDA device,
    the driver (which initializes CUDA in this process)."""
    import torch  # here: the CPU-only services (gateway, preprocess) read boot_id and shm_device without it

    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device_uuid, readable = cuda_device_uuid(index), _readable_device_uuids(index)
    elif device.type == "cpu":
        device_uuid, readable = CPU, ()
    else:
        raise ValueError(f"the tensor transport supports cpu and cuda devices, not {device.type}")
    return PeerIdentity(
        boot_id=boot_id(),
        hostname=socket.gethostname(),
        shm_device=shm_device(),
        ipc_namespace=_stat_or_zero(_IPC_NAMESPACE_PATH, "st_ino"),
        device_uuid=device_uuid,
        readable_device_uuids=readable,
    )


def boot_id() -> str:
    """The kernel's boot id ("" when unreadable)."""
    return _read_text(_BOOT_ID_PATH)


def shm_device() -> int:
    """st_dev of /dev/shm (0 when unreadable)."""
    return _stat_or_zero(SHM_DIR, "st_dev")


def cuda_device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def cuda_device_index(device_uuid: str) -> int:
    """This process's index of the CUDA device `device_uuid` (raises when it does not see it)."""
    import torch

    for index in range(torch.cuda.device_count()):
        if cuda_device_uuid(index) == device_uuid:
            return index
    raise LookupError(f"CUDA device {device_uuid} is not visible to this process")


def _readable_device_uuids(index: int) -> tuple[str, ...]:
    import torch

    return tuple(
        cuda_device_uuid(other)
        for other in range(torch.cuda.device_count())
        if other == index or torch.cuda.can_device_access_peer(index, other)
    )


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return ""


def _stat_or_zero(path: str, field: str) -> int:
    try:
        return getattr(os.stat(path), field)
    except OSError:
        return 0
