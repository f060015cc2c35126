"""RankRing: rank 0's messages to the other ranks of one engine, through shared memory.

Every step rank 0 schedules goes to the other ranks before the forward they run together
(engine/step_broadcast.py). Over gloo that was two collectives on loopback TCP per step (the
pickled size, then the bytes), and rank 0's send returned only once every rank was in its
receive: the leader's host loop ran at the pace of the slowest follower's. Here rank 0 writes the
bytes once into a slot of a ring in a shared file and goes on as soon as the slot is written; it
may be up to `num_slots` messages ahead of the slowest rank.

    header  word 0: messages published; reader r: word 8r consumed, word 8r+1 sleeping
            (each reader on its own 64-byte line)
    slots   num_slots x [length (8 bytes) | payload, up to slot_bytes]

A reader waits by polling the published count for `spin_s` (under load the next step is there
within a step's time), then by blocking on its own FIFO, which the writer writes one byte to
only when that reader says it sleeps. The reader sets its flag then re-checks the count; the
writer publishes then reads the flags; a full fence sits between each write and read, so either
the reader sees the message or the writer sees the flag: a wake-up cannot be lost, and a spare
one costs a re-check. The blocking wait also times out every WAKE_CHECK_S, so that should a
memory model weaker than x86's defeat the fences, a lost wake-up costs that long, not a hang.

A message larger than a slot is marked so in its slot and its bytes go over the gloo host group
(RankGroup): rare (a prefill chunk's lists are ~100 KB), and in order with the ring's messages.
The shared file and the FIFOs are unlinked as soon as every rank has opened them: ranks that
die leave nothing behind.
"""

from __future__ import annotations

import mmap
import os
import select
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

NUM_SLOTS = 4
SLOT_BYTES = 4 << 20  # a 256-sequence decode step pickles to tens of KB; a long prefill chunk to ~100s of KB
WAKE_CHECK_S = 0.01
SEND_TIMEOUT_S = 600.0  # as RankGroup's collectives: a rank that hangs, not one that died (the server sees that)
TOO_LARGE = object()  # `receive`'s answer for a message that follows on the host group
_TOO_LARGE_LENGTH = (1 << 64) - 1
_WORDS_PER_READER = 8  # 64 bytes: a reader's words on a cache line of their own
_SHARED_MEMORY_DIR = Path("/dev/shm")

_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier: an uncontended lock's acquire and release are atomic
    read-modify-writes (LOCK-prefixed on x86), which no load or store crosses."""
    with _fence_lock:
        pass


class RankRing:
    """One end of the ring: rank 0 `send`s, every other rank `receive`s each message in order."""

    def __init__(self, buffer: mmap.mmap, rank: int, size: int, num_slots: int, slot_bytes: int,
                 wake_fds: dict[int, int], spin_s: float, send_timeout_s: float = SEND_TIMEOUT_S):
        self._buffer = buffer
        self._bytes = memoryview(buffer)
        self._words = self._bytes.cast("Q")
        self._rank = rank
        self._size = size
        self._num_slots = num_slots
        self._slot_bytes = slot_bytes
        self._header_bytes = 8 * _WORDS_PER_READER * size
        self._wake_fds = wake_fds  # rank 0: every reader's FIFO (write end); a reader: its own (read end)
        self._spin_s = spin_s
        self._send_timeout_s = send_timeout_s
        self._next = 0  # the next message this end sends or receives

    @classmethod
    def open(
        cls, rank: int, size: int, directory: Path, broadcast_object: Callable, barrier: Callable[[], None], *,
        spin_s: float, num_slots: int = NUM_SLOTS, slot_bytes: int = SLOT_BYTES, send_timeout_s: float = SEND_TIMEOUT_S,
    ) -> "RankRing":
        """Every rank at once (a collective): rank 0 makes the shared file, each reader its FIFO
        in `directory` (private to this engine's ranks), then both are unlinked."""
        slot_bytes = -(-slot_bytes // 8) * 8
        num_bytes = 8 * _WORDS_PER_READER * size + num_slots * (8 + slot_bytes)
        path = None
        if rank == 0:
            shared = _SHARED_MEMORY_DIR if os.access(_SHARED_MEMORY_DIR, os.W_OK) else Path(tempfile.gettempdir())
            path = str(shared / f"llmserve-rank-ring-{uuid.uuid4().hex}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, num_bytes)
        path = broadcast_object(path)
        fifo = lambda reader: directory / f"rank-ring-wake-{reader}"  # noqa: E731
        wake_fds: dict[int, int] = {}
        if rank != 0:
            fd = os.open(path, os.O_RDWR)
            os.mkfifo(fifo(rank), 0o600)
            # Read-write: the open does not wait for a writer, and the read end never sees EOF.
            wake_fds[rank] = os.open(fifo(rank), os.O_RDWR | os.O_NONBLOCK)
        barrier()
        if rank == 0:
            wake_fds = {reader: os.open(fifo(reader), os.O_WRONLY | os.O_NONBLOCK) for reader in range(1, size)}
        barrier()  # every end is open: nothing needs the names any more
        if rank == 0:
            os.unlink(path)
            for reader in range(1, size):
                os.unlink(fifo(reader))
        buffer = mmap.mmap(fd, num_bytes)
        os.close(fd)
        return cls(buffer, rank, size, num_slots, slot_bytes, wake_fds, spin_s, send_timeout_s)

    def send(self, payload: bytes) -> bool:
        """Rank 0: publish `payload` as the next message; False when it is larger than a slot
        (the slot says so: the caller sends the bytes another way, in this message's turn)."""
        sequence = self._next
        self._wait_for_free_slot(sequence)
        start = self._slot_start(sequence)
        fits = len(payload) <= self._slot_bytes
        self._words[start // 8] = len(payload) if fits else _TOO_LARGE_LENGTH
        if fits:
            self._bytes[start + 8 : start + 8 + len(payload)] = payload
        _fence()  # the slot is written before the count says so
        self._words[0] = sequence + 1
        self._next = sequence + 1
        _fence()  # the count is out before the flags are read
        for reader, fd in self._wake_fds.items():
            if self._words[self._sleeping_word(reader)]:
                try:
                    os.write(fd, b"\0")
                except BlockingIOError:  # its FIFO is full of wake-ups already
                    pass
        return fits

    def receive(self, decode: Callable[[memoryview], T]) -> T | object:
        """A reader: `decode` of the next message's bytes (a view into the slot, valid only during
        the call), waiting for it; TOO_LARGE when it follows on the host group."""
        sequence = self._next
        self._wait_for_message(sequence)
        start = self._slot_start(sequence)
        length = self._words[start // 8]
        if length == _TOO_LARGE_LENGTH:
            message = TOO_LARGE
        else:
            with self._bytes[start + 8 : start + 8 + length] as view:
                message = decode(view)
        self._next = sequence + 1
        _fence()  # the slot is read before it is handed back
        self._words[self._consumed_word(self._rank)] = sequence + 1
        return message

    def close(self) -> None:
        for fd in self._wake_fds.values():
            os.close(fd)
        self._wake_fds = {}
        self._words.release()
        self._bytes.release()
        self._buffer.close()

    def _slot_start(self, sequence: int) -> int:
        return self._header_bytes + (sequence % self._num_slots) * (8 + self._slot_bytes)

    def _consumed_word(self, reader: int) -> int:
        return _WORDS_PER_READER * reader

    def _sleeping_word(self, reader: int) -> int:
        return _WORDS_PER_READER * reader + 1

    def _wait_for_free_slot(self, sequence: int) -> None:
        """Until every reader has consumed the message that last used this sequence's slot."""
        needed = sequence - self._num_slots + 1
        if needed <= 0 or self._slowest_reader() >= needed:
            return
        deadline_s = time.monotonic() + self._send_timeout_s
        pause_s = 1e-5
        while self._slowest_reader() < needed:
            if time.monotonic() > deadline_s:
                raise TimeoutError(
                    f"tensor-parallel ranks took no message for {self._send_timeout_s:.0f} s "
                    f"({self._num_slots} unread, consumed per rank: {self._consumed()})"
                )
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, 1e-3)

    def _slowest_reader(self) -> int:
        return min(self._words[self._consumed_word(reader)] for reader in range(1, self._size))

    def _consumed(self) -> list[int]:
        return [self._words[self._consumed_word(reader)] for reader in range(1, self._size)]

    def _wait_for_message(self, sequence: int) -> None:
        if self._words[0] > sequence:
            return
        if self._spin_s > 0:
            deadline_s = time.monotonic() + self._spin_s
            while time.monotonic() < deadline_s:
                if self._words[0] > sequence:
                    return
                os.sched_yield()
        sleeping, fd = self._sleeping_word(self._rank), self._wake_fds[self._rank]
        while True:
            self._words[sleeping] = 1
            _fence()  # the flag is out before the count is read
            if self._words[0] > sequence:
                break
            select.select([fd], [], [], WAKE_CHECK_S)
            try:
                os.read(fd, 4096)  # every wake-up waiting: one re-check covers them all
            except BlockingIOError:
                pass
        self._words[sleeping] = 0
