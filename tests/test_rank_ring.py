"""Rank 0's messages to the other tensor-parallel ranks (models/rank_ring.py, models/rank_group.py).

The ring is tested on its own with each end on a thread (the real shared file and FIFOs, a
thread barrier standing in for gloo's), then through RankGroup in real gloo processes, where a
message larger than a slot goes over the host group in its turn.
"""

from __future__ import annotations

import os
import pickle
import threading
from pathlib import Path

import pytest

from llmserve.inference.models.rank_group import RankGroup
from llmserve.inference.models.rank_ring import SLOT_BYTES, TOO_LARGE, RankRing
from tests.rank_runs import run_ranks

TIMEOUT_S = 120


def open_rings(size: int, directory: Path, **options) -> list[RankRing]:
    """Every rank's end of one ring, each opened on its own thread as the ranks would."""
    barrier = threading.Barrier(size, timeout=TIMEOUT_S)
    box: dict[str, object] = {}
    rings: dict[int, RankRing] = {}

    def broadcast(rank):
        def broadcast_object(obj=None):
            if rank == 0:
                box["value"] = obj
            barrier.wait()
            return box["value"]
        return broadcast_object

    def open_one(rank):
        rings[rank] = RankRing.open(rank, size, directory, broadcast(rank), barrier.wait, **options)

    threads = [threading.Thread(target=open_one, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    return [rings[rank] for rank in range(size)]


def read_all(ring: RankRing, count: int, into: list) -> threading.Thread:
    def run():
        for _ in range(count):
            message = ring.receive(bytes)
            into.append(message)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def ring_files(directory: Path) -> list[str]:
    """What the ring left with a name: files in `directory`, and this process's ring mappings
    whose file still exists (an unlinked one is listed "(deleted)" in /proc/self/maps)."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    mapped = [line for line in maps if "llmserve-rank-ring-" in line and not line.endswith("(deleted)")]
    return [p.name for p in directory.iterdir()] + mapped


@pytest.mark.parametrize("spin_s", [0.0, 0.001])
def test_every_reader_takes_every_message_in_order_through_a_ring_that_wraps(tmp_path, spin_s):
    writer, *readers = open_rings(3, tmp_path, spin_s=spin_s, num_slots=2, slot_bytes=64)
    assert ring_files(tmp_path) == []  # unlinked once every end is open
    assert "llmserve-rank-ring-" in Path("/proc/self/maps").read_text()  # (and still mapped)
    messages = [bytes([i % 251]) * (i % 60) for i in range(200)]
    received = [[] for _ in readers]
    threads = [read_all(ring, len(messages), into) for ring, into in zip(readers, received)]
    for message in messages:
        assert writer.send(message)
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert received == [messages, messages]
    for ring in (writer, *readers):
        ring.close()


def test_a_reader_asleep_on_its_fifo_is_woken_by_the_next_message(tmp_path):
    writer, reader = open_rings(2, tmp_path, spin_s=0.0)
    received: list = []
    thread = read_all(reader, 1, received)
    thread.join(0.2)  # it has checked, found nothing, and sleeps (or is about to)
    assert thread.is_alive() and received == []
    writer.send(b"step")
    thread.join(TIMEOUT_S)
    assert received == [b"step"]


def test_the_writer_runs_ahead_of_readers_by_the_ring_and_no_more(tmp_path):
    writer, reader = open_rings(2, tmp_path, spin_s=0.0, num_slots=3, send_timeout_s=0.5)
    for i in range(3):  # nobody is reading: each send returns once written
        assert writer.send(b"%d" % i)
    with pytest.raises(TimeoutError, match="took no message"):
        writer.send(b"3")  # its slot still holds message 0
    assert reader.receive(bytes) == b"0"
    assert writer.send(b"3")  # message 0's slot is free again
    assert [reader.receive(bytes) for _ in range(3)] == [b"1", b"2", b"3"]


def test_a_message_larger_than_a_slot_is_marked_for_the_caller_to_send_another_way(tmp_path):
    writer, reader = open_rings(2, tmp_path, spin_s=0.0, slot_bytes=16)
    assert not writer.send(b"x" * 17)
    assert writer.send(b"y" * 16)
    assert reader.receive(bytes) is TOO_LARGE
    assert reader.receive(bytes) == b"y" * 16


def _send_or_receive(group: RankGroup, messages: list):
    if group.is_leader:
        for message in messages:
            group.send_to_ranks(message)
        return None
    return [group.receive_from_leader() for _ in messages]


def test_ranks_receive_what_rank_0_sends_in_order_a_message_too_large_for_a_slot_included(tmp_path):
    large = os.urandom(SLOT_BYTES + 1)  # goes over gloo, between two ring messages
    messages = [{"step": 0}, None, large, list(range(1000)), "last"]
    gathered = run_ranks(_send_or_receive, 3, str(tmp_path / "rendezvous"), messages)
    assert gathered[1] == messages and gathered[2] == messages
    assert pickle.dumps(gathered[1][2]) == pickle.dumps(large)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rendezvous"]  # no ring file or FIFO left
