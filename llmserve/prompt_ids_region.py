"""Long prompts' token ids in preprocess's shared-memory ring, so that the hops preprocess →
gateway → inference carry a reference instead of the ids (issue 22, docs/transport.md "Prompt
token ids").

    preprocess  ring = PromptIdsRing(capacity_bytes, lease_s)      # one /dev/shm segment
                ref = ring.put(ids)                                # None: the ring is full
    gateway     relays ref (PromptIdsInRegion) to a replica of the same SharedMemoryScope, or
                reader.read(ref) as bytes to any other
    inference   ids = reader.read(ref)                             # a copy, checked

The ring is a segment of fixed size holding entries one after another, wrapping at its end:

    [magic 8 | capacity 8] [key 8 | num_ids 4 | 0 4 | ids 4 each ...] [entry] ... [entry]

Lifetime by lease, not acknowledgement: an entry is reused no sooner than `lease_s` after it was
written (a ring whose live entries are all younger is full, and preprocess answers the ids
inline), and the gateway relays a reference only while less than half of the lease has passed
(it sends the ids inline after). So nobody needs to say when it is done with an entry; a
gateway that dies between the hops leaks nothing. Each entry holds a random 64-bit key that the
reference carries: a reader copies the ids out and checks the key before and after, and refuses
an entry reused since (or a guessed reference) instead of reading another prompt's ids. The lease
is what keeps entries intact; the key check is the second line (exact where stores become
visible in program order, as on x86; with weaker ordering, a reader racing a reuse could miss
it, which the lease already rules out).

Only the ring's owner writes and unlinks (its reaper unlinks the segment if it dies:
tensor_transport/shm_reaper.py); readers map it read-only, once per segment.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llmserve import token_id_bytes
from llmserve.tensor_transport.identity import SHM_DIR, boot_id, shm_device
from llmserve.tensor_transport.shm_reaper import process_reaper
from llmserve.tensor_transport.shm_segment import create_mapping, unlink_segment

_MAGIC = b"LLMSIDS1"
_HEADER_BYTES = 16  # magic, capacity
_ENTRY_HEADER_BYTES = 16  # key, num_ids, zero
_ALIGN = 8
log = logging.getLogger(__name__)

_KEY = struct.Struct("<Q")
_ENTRY_HEADER = struct.Struct("<QII")  # key, num_ids, zero
_RING_HEADER = struct.Struct("<8sQ")  # magic, capacity
NAME_PREFIX = "llmserve-ids-"
_NAME_PATTERN = re.compile(r"llmserve-ids-[0-9]{1,10}-[0-9a-f]{12}")
# A reader keeps this many rings mapped: a preprocess restarted is a new ring, and a mapping keeps
# its dead owner's pages allocated until it is dropped.
_MAX_MAPPED = 4


class EntryGone(Exception):
    """The entry a reference names was reused (or never existed): its key differs."""


class BadReference(ValueError):
    """A reference no ring of ours can hold: the name, bounds or size are wrong, or the
    segment is missing or not a ring."""


@dataclass(frozen=True, slots=True)
class SharedMemoryScope:
    """Where this process's shared memory can be mapped: one host and boot, one /dev/shm."""

    boot_id: str
    shm_device: int

    def shares_with(self, other: SharedMemoryScope | None) -> bool:
        """Equal and known (an unreadable value, empty or 0, shares with nothing)."""
        return (
            other is not None and bool(self.boot_id) and bool(self.shm_device)
            and (self.boot_id, self.shm_device) == (other.boot_id, other.shm_device)
        )


def local_scope() -> SharedMemoryScope:
    return SharedMemoryScope(boot_id(), shm_device())


@dataclass(frozen=True, slots=True)
class RegionIds:
    """Where a prompt's ids lie in a ring (the wire's PromptIdsInRegion)."""

    region_name: str
    offset_bytes: int
    num_ids: int
    key: int
    valid_for_s: float  # unchanged at least this long after the ring answered


@dataclass(slots=True)
class _Entry:
    offset: int
    size: int
    written_s: float


class PromptIdsRing:
    """The writer: one segment of `capacity_bytes`, owned by this process. Thread-safe."""

    def __init__(self, capacity_bytes: int, lease_s: float, *, clock: Callable[[], float] = time.monotonic):
        if capacity_bytes < _HEADER_BYTES + _ENTRY_HEADER_BYTES + _ALIGN:
            raise ValueError(f"a ring needs at least {_HEADER_BYTES + _ENTRY_HEADER_BYTES + _ALIGN} bytes")
        self.capacity_bytes = capacity_bytes - capacity_bytes % _ALIGN
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._reaper = process_reaper()
        self.name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self._mapping = create_mapping(self.name, self.capacity_bytes, self._reaper)
        _RING_HEADER.pack_into(self._mapping, 0, _MAGIC, self.capacity_bytes)
        self._live: collections.deque[_Entry] = collections.deque()  # oldest first
        self._head = _HEADER_BYTES  # where the newest entry ends
        self._closed = False

    def put(self, packed_ids: bytes) -> RegionIds | None:
        """Copy the ids, packed as llmserve.token_id_bytes packs them (little-endian uint32s),
        into a new entry; None when it cannot take them now (live entries younger than the lease
        fill the place it needs, or they exceed the ring)."""
        num_ids = token_id_bytes.count(packed_ids)
        size = _entry_size(num_ids)
        with self._lock:
            if self._closed:
                return None
            offset = self._place(size)
            if offset is None:
                return None
            key = secrets.randbits(64) or 1  # 0 marks a free entry
            self._write(offset, packed_ids, num_ids, key)
            self._live.append(_Entry(offset, size, self._clock()))
            self._head = offset + size
        return RegionIds(self.name, offset, num_ids, key, self.lease_s)

    def close(self) -> None:
        """Unlink the segment (readers' mappings stay readable until they drop them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            unlink_segment(self.name, self._reaper)

    def _place(self, size: int) -> int | None:
        while True:
            offset = self._free_offset(size)
            if offset is not None:
                return offset
            if not self._live or self._clock() - self._live[0].written_s < self.lease_s:
                return None
            self._reclaim(self._live.popleft())

    def _free_offset(self, size: int) -> int | None:
        """Where `size` bytes fit between the live entries, the newest's end first."""
        end = self.capacity_bytes
        if not self._live:
            return _HEADER_BYTES if _HEADER_BYTES + size <= end else None
        tail = self._live[0].offset
        if tail < self._head:  # live entries in [tail, head): room after head, or from the start
            if self._head + size <= end:
                return self._head
            return _HEADER_BYTES if _HEADER_BYTES + size <= tail else None
        return self._head if self._head + size <= tail else None  # wrapped: room in [head, tail)

    def _reclaim(self, entry: _Entry) -> None:
        _KEY.pack_into(self._mapping, entry.offset, 0)  # readers holding it now fail

    def _write(self, offset: int, packed_ids: bytes, num_ids: int, key: int) -> None:
        """No key, the ids and the count, then the key: an entry is readable once its key is set."""
        _ENTRY_HEADER.pack_into(self._mapping, offset, 0, num_ids, 0)
        start = offset + _ENTRY_HEADER_BYTES
        self._mapping[start : start + len(packed_ids)] = packed_ids
        _KEY.pack_into(self._mapping, offset, key)


class PromptIdsReader:
    """Maps rings read-only by name (at most a few at once) and copies entries out of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: collections.OrderedDict[str, mmap.mmap] = collections.OrderedDict()

    def read(self, ref: RegionIds) -> np.ndarray:
        """The entry's ids, copied out (a read-only view of the copy, as
        token_id_bytes.as_array gives). BadReference or EntryGone."""
        return self._copy(ref, 0)

    def last(self, ref: RegionIds, num_ids: int) -> list[int]:
        """The entry's last `num_ids` ids (all when fewer), without copying the rest."""
        return self._copy(ref, max(0, ref.num_ids - num_ids)).tolist()

    def _copy(self, ref: RegionIds, first: int) -> np.ndarray:
        """Ids [first, num_ids) of the entry, checked against its key before and after the copy."""
        ring = self._ring(ref.region_name)
        start = _check_bounds(ref, len(ring))
        key, num_ids, _ = _ENTRY_HEADER.unpack_from(ring, ref.offset_bytes)
        if ref.key == 0 or key != ref.key or num_ids != ref.num_ids:
            raise EntryGone(f"the entry at {ref.offset_bytes} of {ref.region_name} holds another prompt now")
        ids = token_id_bytes.as_array(ring[start + _ids_bytes(first) : start + _ids_bytes(ref.num_ids)])
        if _KEY.unpack_from(ring, ref.offset_bytes)[0] != ref.key:
            raise EntryGone(f"the entry at {ref.offset_bytes} of {ref.region_name} was reused while it was read")
        return ids

    def _ring(self, name: str) -> mmap.mmap:
        with self._lock:
            data = self._mapped.get(name)
            if data is not None:
                self._mapped.move_to_end(name)
                return data
            data = _map_ring(name)
            self._mapped[name] = data
            if len(self._mapped) > _MAX_MAPPED:
                self._mapped.popitem(last=False)
            return data


_SHARED_READER = PromptIdsReader()  # maps nothing until it reads


def shared_reader() -> PromptIdsReader:
    """This process's reader: its mappings serve every request."""
    return _SHARED_READER


def _ids_bytes(num_ids: int) -> int:
    return token_id_bytes.BYTES_PER_ID * num_ids


def _entry_size(num_ids: int) -> int:
    size = _ENTRY_HEADER_BYTES + _ids_bytes(num_ids)
    return size + (-size) % _ALIGN


def _check_bounds(ref: RegionIds, ring_bytes: int) -> int:
    """Where the entry's ids start; BadReference unless the entry lies inside the ring."""
    if ref.num_ids <= 0:
        raise BadReference("num_ids must be at least 1")
    if ref.offset_bytes % _ALIGN or ref.offset_bytes < _HEADER_BYTES:
        raise BadReference(f"offset_bytes {ref.offset_bytes} is not an entry's start (a multiple of {_ALIGN}, "
                           f"at least {_HEADER_BYTES})")
    end = ref.offset_bytes + _entry_size(ref.num_ids)
    if end > ring_bytes:
        raise BadReference(f"an entry of {ref.num_ids} ids at {ref.offset_bytes} ends past the ring's {ring_bytes} bytes")
    return ref.offset_bytes + _ENTRY_HEADER_BYTES


def _map_ring(name: str) -> mmap.mmap:
    """The ring `name`, mapped read-only; BadReference unless it is one of ours."""
    if not _NAME_PATTERN.fullmatch(name):
        raise BadReference(f"{name[:40]!r} is not a prompt-ids ring's name ({NAME_PREFIX}<pid>-<12 hex digits>)")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except OSError as error:
        raise BadReference(f"ring {name} cannot be opened here: {error.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER_BYTES:
            raise BadReference(f"ring {name} is not a ring ({size} bytes)")
        ring = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    if _RING_HEADER.unpack_from(ring, 0) != (_MAGIC, size):
        raise BadReference(f"segment {name} is not a prompt-ids ring")
    return ring


class RingOnDemand:
    """The owner's ring, made at the first `put` (a process that is never asked makes none);
    `capacity_bytes` 0: never. A ring that cannot be made (a full /dev/shm) is logged once and
    not tried again: the ids then travel inline, as they would without it."""

    def __init__(self, capacity_bytes: int, lease_s: float):
        self._capacity_bytes = capacity_bytes
        self._lease_s = lease_s
        self._ring: PromptIdsRing | None = None
        self._failed = capacity_bytes <= 0
        self._lock = threading.Lock()

    @property
    def is_enabled(self) -> bool:
        return not self._failed

    def put(self, packed_ids: bytes) -> RegionIds | None:
        ring = self._ring or self._make()
        return ring.put(packed_ids) if ring is not None else None

    def close(self) -> None:
        with self._lock:
            self._failed = True
            if self._ring is not None:
                self._ring.close()

    def _make(self) -> PromptIdsRing | None:
        with self._lock:
            if self._ring is None and not self._failed:
                try:
                    self._ring = PromptIdsRing(self._capacity_bytes, self._lease_s)
                except OSError as error:
                    self._failed = True
                    log.warning("no shared-memory ring for prompt ids (%d bytes in %s): %s; ids travel inline",
                                self._capacity_bytes, SHM_DIR, error)
                else:
                    log.info("prompt ids ring %s: %d bytes in %s, entries kept %.0f s",
                             self._ring.name, self._capacity_bytes, SHM_DIR, self._lease_s)
            return self._ring
