"""ShmSegment: a POSIX shared-memory segment (a file in /dev/shm) mapped into this process, and
the uint8 tensor over it.

Created by its producer (which alone unlinks it: close, or its reaper when it dies) and attached
by consumers, which never unlink and never register with any tracker (shm_reaper.py says why we
do not use multiprocessing.shared_memory). Unlinking removes the name at once; the memory lives
until the last process that maps it unmaps it, so a consumer's mapping stays readable after its
producer is gone, and nothing of it is left in /dev/shm.

The tensor keeps the mapping alive (torch.frombuffer holds the mmap object): dropping the last
tensor over it unmaps it. The file descriptor is closed right after mapping (mmap keeps its own).
"""

from __future__ import annotations

import mmap
import os
import secrets

from llmserve.tensor_transport.identity import SHM_DIR
from llmserve.tensor_transport.shm_reaper import ShmReaper

NAME_PREFIX = "llmserve-tt-"


def new_segment_name() -> str:
    """Names carry the producer's pid, so a leftover is traceable to whoever made it."""
    return f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def create_mapping(name: str, num_bytes: int, reaper: ShmReaper) -> mmap.mmap:
    """A new zero-filled segment `name`, mapped. Its pages are reserved now (posix_fallocate), so
    a full /dev/shm fails here with ENOSPC, not later with SIGBUS at the first write that finds no
    page. Registered with `reaper` before it exists: a death in between leaks nothing."""
    reaper.register(name)
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, num_bytes)
        return mmap.mmap(fd, num_bytes)
    except BaseException:
        os.unlink(path)
        reaper.unregister(name)
        raise
    finally:
        os.close(fd)


def unlink_segment(name: str, reaper: ShmReaper) -> None:
    """Remove segment `name` made by create_mapping (gone already is fine) and stop its reaper
    from unlinking it again."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
    reaper.unregister(name)


class ShmSegment:
    def __init__(self, name: str, mapping: mmap.mmap, reaper: ShmReaper | None):
        import torch  # here: create_mapping serves the CPU-only services too (llmserve.prompt_ids_region)

        self.name = name
        self.num_bytes = len(mapping)
        self.data = torch.frombuffer(mapping, dtype=torch.uint8)  # [num_bytes], over the mapping
        self._reaper = reaper  # set on the producer's side only: it owns the unlink
        self._is_unlinked = reaper is None

    @classmethod
    def create(cls, num_bytes: int, reaper: ShmReaper) -> ShmSegment:
        """A new zero-filled segment (create_mapping)."""
        if num_bytes <= 0:
            raise ValueError(f"a segment needs at least one byte, got {num_bytes}")
        name = new_segment_name()
        return cls(name, create_mapping(name, num_bytes, reaper), reaper)

    @classmethod
    def attach(cls, name: str, num_bytes: int) -> ShmSegment:
        """Map an existing segment of `num_bytes` (its producer's offer says how many)."""
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            found = os.fstat(fd).st_size
            if found != num_bytes:
                raise ValueError(f"shared-memory segment {name} has {found} bytes, the offer says {num_bytes}")
            mapping = mmap.mmap(fd, num_bytes)
        finally:
            os.close(fd)
        return cls(name, mapping, None)

    def unlink(self) -> None:
        """The producer's: remove the name (idempotent); mappings stay valid until dropped."""
        if self._is_unlinked:
            return
        unlink_segment(self.name, self._reaper)
        self._is_unlinked = True
