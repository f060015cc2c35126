"""Peers of the tensor-transport tests, each a real process (spawned: a CUDA context is never
forked) driven by commands over a pipe. Tensors cross the pipe only as bytes: a tensor sent as it
is would take torch's own sharing, not ours.

    peer = Peer.start(run_consumer)          # or run_producer, with its device and region size
    peer.ask("open", offer) -> the answer
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from prometheus_client import REGISTRY

from llmserve.tensor_transport import TensorConsumer, TensorProducer, local_identity
from llmserve.tensor_transport.cuda_ipc import references_held
from llmserve.tensor_transport.identity import SHM_DIR
from llmserve.tensor_transport.messages import DTYPES, TensorRef, TransportPath
from llmserve.tensor_transport.shm_reaper import process_reaper
from llmserve.tensor_transport.views import to_bytes

STARTUP_TIMEOUT_S = 120.0
ANSWER_TIMEOUT_S = 120.0
GONE_TIMEOUT_S = 30.0


def random_tensor(seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The same tensor for the same arguments in every process."""
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    low, high = (0, 256) if dtype is torch.uint8 else (-100, 100)
    return torch.randint(low, high, shape, generator=generator).to(dtype)


def segments_of(pids: list[int]) -> list[str]:
    """Entries in /dev/shm made by these processes: our segments and torch's CUDA IPC counters."""
    prefixes = tuple(f"llmserve-tt-{pid}-" for pid in pids) + tuple(f"torch_{pid}_" for pid in pids)
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefixes))


def wait_until(condition: Callable[[], bool]) -> bool:
    """Whether `condition` came true within GONE_TIMEOUT_S (a hang guard, not a timing)."""
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def wait_until_gone(path: str) -> bool:
    return wait_until(lambda: not Path(path).exists())


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


@dataclass
class Peer:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    hello: tuple

    @classmethod
    def start(cls, target: Callable, *args) -> Peer:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=target, args=(theirs, *args), daemon=True)
        process.start()
        theirs.close()
        peer = cls(process, ours, ())
        peer.hello = peer.answer(STARTUP_TIMEOUT_S)
        return peer

    def ask(self, *command):
        self.conn.send(command)
        return self.answer(ANSWER_TIMEOUT_S)

    def answer(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"peer {self.process.pid} did not answer in {timeout_s} s")
        answer = self.conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join()

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(("exit",))
            self.process.join(ANSWER_TIMEOUT_S)
        if self.process.is_alive():
            self.kill()


def _serve(conn: Connection, handlers: dict[str, Callable]) -> None:
    while True:
        command, *args = conn.recv()
        if command == "exit":
            return
        try:
            conn.send(handlers[command](*args))
        except Exception as error:  # noqa: BLE001 — the test raises it
            conn.send(error)


# --- consumer -------------------------------------------------------------------------------


def run_consumer(conn: Connection, device: str = "cpu") -> None:
    consumer = TensorConsumer()
    identity = local_identity(device)

    def read(message: TensorRef) -> bytes:
        return to_bytes(consumer.view(message))

    def copy(message: TensorRef) -> bytes:
        out = torch.empty(message.shape, dtype=message.torch_dtype, device=device)
        consumer.copy_into(message, out)
        return to_bytes(out)  # to the host: a synchronizing copy

    def copy_forever(message: TensorRef) -> None:
        """Say so after the first copy, then copy until killed."""
        out = torch.empty(message.shape, dtype=message.torch_dtype, device=device)
        consumer.copy_into(message, out)
        conn.send("copying")
        while True:
            consumer.copy_into(message, out)
            if out.is_cuda:
                torch.cuda.synchronize(out.device)

    def stats() -> dict:
        return {
            "num_regions_opened": consumer.num_regions_opened,
            **{f"transfers_{path.value}": _metric("llmserve_transport_transfers_total", path) for path in TransportPath},
            **{f"bytes_{path.value}": _metric("llmserve_transport_bytes_total", path) for path in TransportPath},
            **{f"opened_{path.value}": _metric("llmserve_transport_regions_opened_total", path) for path in TransportPath},
        }

    conn.send((identity, os.getpid()))
    _serve(conn, {
        "open": lambda offer: consumer.open(offer),
        "read": read,
        "copy": copy,
        "copy_forever": copy_forever,
        "stats": stats,
        "close": lambda region_id: consumer.close(region_id),
    })


def _metric(name: str, path: TransportPath) -> float:
    return REGISTRY.get_sample_value(name, {"path": path.value}) or 0.0


# --- producer -------------------------------------------------------------------------------


def run_producer(conn: Connection, device: str, num_bytes: int) -> None:
    _ProducerPeer(conn, device, num_bytes).serve()


class _ProducerPeer:
    def __init__(self, conn: Connection, device: str, num_bytes: int):
        self.conn, self.device = conn, device
        self.producer = TensorProducer(local_identity(device))
        self.baseline_bytes = self.memory_allocated()
        self.region = self.producer.allocate(num_bytes)
        self.offers = {}

    def serve(self) -> None:
        segment = self.region.segment.name if self.region.segment is not None else ""
        self.conn.send((os.getpid(), segment, process_reaper().pid, self.baseline_bytes))
        _serve(self.conn, {
            "offer": self.offer,
            "write": self.write,
            "withdraw": lambda index: self.producer.withdraw(self.offers.pop(index)),
            "references_held": lambda index: references_held(self.producer._cuda_offers[self.offers[index]]),
            "free": self.free,
            "memory_allocated": self.memory_allocated,
        })

    def offer(self, consumer_identity) -> tuple[int, object]:
        index = len(self.offers)
        self.offers[index] = self.producer.offer(self.region, consumer_identity)
        return index, self.offers[index]

    def write(self, offer_index: int, seed: int, dtype: str, shape: tuple[int, ...], offset_bytes: int) -> TensorRef:
        """New random data into the region at offset_bytes; the message that sends it."""
        ref = self.region.ref(offset_bytes, shape, dtype)
        self.region.view(ref).copy_(random_tensor(seed, DTYPES[dtype], shape))
        self.producer.mark_written(self.region)
        return self.producer.message_for(self.offers[offer_index], ref)

    def free(self) -> None:
        self.producer.free(self.region)
        self.region = None  # the last reference to its memory
        self.producer.close()

    def memory_allocated(self) -> int:
        """Device memory held by tensors here (0 on the CPU)."""
        if self.device == "cpu":
            return 0
        torch.cuda.ipc_collect()
        return torch.cuda.memory_allocated(self.device)
