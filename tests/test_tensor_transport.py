"""The tensor transport (llmserve.tensor_transport, issue 22) between real processes: data that
arrives as it was sent on every path, negotiation by identity, one mapping per region, and
nothing left in /dev/shm (or on the GPU) when a peer closes, exits or is killed mid-transfer."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
import subprocess
import sys

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from llmserve.tensor_transport import TensorConsumer, TensorProducer, TransportPath, choose_path, local_identity
from llmserve.tensor_transport.cuda_ipc import CudaExport
from llmserve.tensor_transport.identity import CPU, SHM_DIR, PeerIdentity
from llmserve.tensor_transport.views import to_bytes
from tests.transport_peers import (
    Peer, is_running, random_tensor, run_consumer, run_producer, segments_of, wait_until, wait_until_gone,
)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"
HOST = PeerIdentity(boot_id="boot-1", hostname="node-1", shm_device=21, ipc_namespace=4026531839, device_uuid=CPU)
ON_GPU_A = dataclasses.replace(HOST, device_uuid=GPU_A, readable_device_uuids=(GPU_A,))


def other(identity: PeerIdentity, **changes) -> PeerIdentity:
    return dataclasses.replace(identity, **changes)


# --- negotiation (pure) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "producer, consumer, path",
    [
        (HOST, HOST, TransportPath.SHM),
        (HOST, other(HOST, hostname="another-pod"), TransportPath.SHM),  # one node, one /dev/shm
        (HOST, ON_GPU_A, TransportPath.SHM),  # host tensors to a GPU process: it maps, then copies up
        (HOST, other(HOST, boot_id="boot-2"), TransportPath.INLINE),  # another host
        (HOST, other(HOST, shm_device=22), TransportPath.INLINE),  # another container's /dev/shm
        (HOST, other(HOST, boot_id=""), TransportPath.INLINE),  # unknown never matches
        (other(HOST, shm_device=0), other(HOST, shm_device=0), TransportPath.INLINE),
        (ON_GPU_A, ON_GPU_A, TransportPath.CUDA_IPC),  # the same GPU
        (ON_GPU_A, other(ON_GPU_A, device_uuid=GPU_B, readable_device_uuids=(GPU_B, GPU_A)), TransportPath.CUDA_IPC),
        (ON_GPU_A, other(ON_GPU_A, device_uuid=GPU_B, readable_device_uuids=(GPU_B,)), TransportPath.INLINE),
        (ON_GPU_A, other(ON_GPU_A, ipc_namespace=1), TransportPath.INLINE),  # no shared IPC namespace
        (ON_GPU_A, other(ON_GPU_A, boot_id="boot-2"), TransportPath.INLINE),
        (ON_GPU_A, HOST, TransportPath.INLINE),  # a CPU consumer cannot map device memory
    ],
)
def test_the_path_follows_the_identities(producer, consumer, path):
    assert choose_path(producer, consumer) is path


def test_this_process_knows_its_host():
    identity = local_identity()
    assert identity.boot_id and identity.shm_device and identity.device_uuid == CPU
    assert choose_path(identity, local_identity()) is TransportPath.SHM


# --- data across processes -------------------------------------------------------------------

# (dtype, shape, offset_bytes): offsets that are not 8-aligned, a scalar, an empty tensor.
LAYOUTS = [
    ("float32", (64, 33), 0),
    ("float16", (7, 5, 3), 8452),
    ("bfloat16", (1000,), 20002),
    ("int64", (17, 3), 30000),
    ("int32", (), 40004),
    ("uint8", (255,), 40009),
    ("int8", (4, 4), 41001),
    ("bool", (9, 2), 42001),
    ("float8_e4m3fn", (128,), 43001),
    ("float64", (0, 5), 44000),
]


def fill(producer: TensorProducer, region, seed: int = 0) -> list:
    """Random tensors at LAYOUTS's places in region; their refs."""
    refs = []
    for i, (dtype, shape, offset) in enumerate(LAYOUTS):
        ref = region.ref(offset, shape, dtype)
        region.view(ref).copy_(random_tensor(seed + i, ref.torch_dtype, shape))
        refs.append(ref)
    producer.mark_written(region)
    return refs


@pytest.fixture
def producer():
    producer = TensorProducer(local_identity())
    yield producer
    producer.close()


@pytest.fixture
def consumer_peer():
    peer = Peer.start(run_consumer)
    yield peer
    peer.stop()


def test_shm_tensors_arrive_as_written_and_the_region_is_mapped_once(producer, consumer_peer):
    consumer_identity, consumer_pid = consumer_peer.hello
    region = producer.allocate(1 << 16)
    refs = fill(producer, region)
    offer = producer.offer(region, consumer_identity)
    assert offer.path is TransportPath.SHM and offer.shm_name == region.segment.name
    consumer_peer.ask("open", offer)
    for ref in refs:
        message = producer.message_for(offer, ref)
        assert message is ref  # only region id, offset, shape and dtype cross
        assert consumer_peer.ask("read", message) == to_bytes(region.view(ref)), ref
        assert consumer_peer.ask("copy", message) == to_bytes(region.view(ref)), ref
    for round_ in range(1, 50):  # the producer rewrites, the consumer sees it through the same mapping
        refs = fill(producer, region, seed=round_ * 100)
        assert consumer_peer.ask("read", refs[round_ % len(refs)]) == to_bytes(region.view(refs[round_ % len(refs)]))
    consumer_peer.ask("open", offer)  # again: still the one mapping
    stats = consumer_peer.ask("stats")
    assert stats["num_regions_opened"] == 1 and stats["opened_shm"] == 1
    assert stats["transfers_shm"] == 2 * len(LAYOUTS) + 49 and stats["transfers_inline"] == 0
    assert stats["bytes_shm"] > 0
    assert segments_of([consumer_pid]) == []  # a consumer creates nothing in /dev/shm


def test_a_kv_pool_block_is_addressed_by_offset_and_strides(producer, consumer_peer):
    """The layout of the KV pool ([2, layers, blocks, block_size, kv_heads, head_dim]): one
    block is one index of dim 2 across every layer, not contiguous; one ref names it in place."""
    consumer_identity, _ = consumer_peer.hello
    shape = (2, 3, 6, 4, 2, 8)
    num_bytes = torch.Size(shape).numel() * 2
    region = producer.allocate(num_bytes)
    pool = region.view(region.ref(0, shape, torch.float16))
    pool.copy_(random_tensor(7, torch.float16, shape))
    offer = producer.offer(region, consumer_identity)
    consumer_peer.ask("open", offer)
    for block_id in (0, 3, 5):
        block = pool[:, :, block_id : block_id + 1]
        ref = region.ref_of(block)
        assert ref.offset_bytes == block_id * 4 * 2 * 8 * 2 and ref.strides == pool.stride()
        assert consumer_peer.ask("copy", ref) == to_bytes(block)


def test_inline_when_the_identities_differ(producer, consumer_peer):
    consumer_identity, _ = consumer_peer.hello
    elsewhere = dataclasses.replace(consumer_identity, boot_id="another-host")
    region = producer.allocate(1 << 16)
    refs = fill(producer, region)
    offer = producer.offer(region, elsewhere)
    assert offer.path is TransportPath.INLINE and not offer.shm_name
    consumer_peer.ask("open", offer)
    for ref in refs:
        message = producer.message_for(offer, ref)
        assert message.inline_bytes == to_bytes(region.view(ref))
        assert consumer_peer.ask("copy", message) == to_bytes(region.view(ref))
    stats = consumer_peer.ask("stats")
    assert stats["transfers_inline"] == len(LAYOUTS) and stats["transfers_shm"] == 0
    assert stats["bytes_inline"] == sum(ref.num_bytes for ref in refs)


def test_a_ref_outside_its_region_is_refused(producer, consumer_peer):
    consumer_identity, _ = consumer_peer.hello
    region = producer.allocate(4096)
    consumer_peer.ask("open", producer.offer(region, consumer_identity))
    unknown_dtype = dataclasses.replace(region.ref(0, (1,), "uint8"), dtype="complex64")
    for ref in (region.ref(4000, (25,), "float32"), region.ref(2, (1,), "float32"), region.ref(0, (-1,), "uint8"), unknown_dtype):
        with pytest.raises(ValueError):
            consumer_peer.ask("read", ref)
    with pytest.raises(KeyError, match="not mapped here"):
        consumer_peer.ask("read", dataclasses.replace(region.ref(0, (1,), "uint8"), region_id="nobody/0"))


# --- lifetimes: nothing left behind ----------------------------------------------------------


def test_close_unlinks_and_the_consumers_mapping_outlives_the_name(consumer_peer):
    consumer_identity, _ = consumer_peer.hello
    producer = TensorProducer(local_identity())
    region = producer.allocate(1 << 16)
    refs = fill(producer, region)
    expected = to_bytes(region.view(refs[0]))
    consumer_peer.ask("open", producer.offer(region, consumer_identity))
    path = os.path.join(SHM_DIR, region.segment.name)
    assert os.path.exists(path)
    producer.close()
    assert not os.path.exists(path) and segments_of([os.getpid()]) == []
    assert consumer_peer.ask("read", refs[0]) == expected  # unlinking removes the name, not the memory


def test_a_consumer_killed_mid_transfer_leaves_nothing(producer):
    peer = Peer.start(run_consumer)
    consumer_identity, consumer_pid = peer.hello
    region = producer.allocate(8 << 20)
    ref = region.ref(0, (2 << 20,), "float32")
    offer = producer.offer(region, consumer_identity)
    peer.ask("open", offer)
    assert peer.ask("copy_forever", producer.message_for(offer, ref)) == "copying"
    peer.kill()
    producer.withdraw(offer)
    producer.free(region)
    assert segments_of([consumer_pid, os.getpid()]) == []


def test_a_producer_killed_mid_transfer_leaves_nothing():
    """The producer dies (SIGKILL) with a message sent and not acknowledged: its reaper unlinks
    the segment, and the consumer still reads what the message names (its mapping is its own)."""
    peer = Peer.start(run_producer, "cpu", 1 << 20)
    producer_pid, segment, reaper_pid, _ = peer.hello
    consumer = TensorConsumer()
    index, offer = peer.ask("offer", local_identity())
    consumer.open(offer)
    message = peer.ask("write", index, 11, "bfloat16", (512, 3), 4096)
    peer.kill()
    assert to_bytes(consumer.view(message)) == to_bytes(random_tensor(11, torch.bfloat16, (512, 3)))
    assert wait_until_gone(os.path.join(SHM_DIR, segment)), f"{segment} left in /dev/shm"
    assert segments_of([producer_pid]) == []
    assert wait_until(lambda: not is_running(reaper_pid)), "the reaper outlived its producer"
    consumer.close_all()


def test_a_producer_that_exits_without_closing_leaves_nothing():
    code = (
        "from llmserve.tensor_transport import TensorProducer, local_identity\n"
        "region = TensorProducer(local_identity()).allocate(1 << 20)\n"
        "print(region.segment.name, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert wait_until_gone(os.path.join(SHM_DIR, done.stdout.strip()))


def test_the_reaper_waits_for_its_producer_to_exit_not_for_its_pipe_to_close():
    """At a normal exit Python closes the reaper's pipe before the C++ destructors run, and one
    of them (torch's CUDA IPC counter file) unlinks a segment itself: the reaper must not unlink
    before the process is gone, or that unlink fails and torch aborts the exit."""
    code = (
        "import os, sys, time\n"
        "from llmserve.tensor_transport.shm_reaper import SHM_DIR, process_reaper\n"
        "name = f'llmserve-test-late-{os.getpid()}'\n"
        "path = os.path.join(SHM_DIR, name)\n"
        "reaper = process_reaper()\n"
        "reaper.register(name)\n"
        "open(path, 'wb').close()\n"
        "reaper._process.stdin.close()  # what finalization does, while this process still runs\n"
        "time.sleep(0.5)\n"
        "print(name, os.path.exists(path), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    name, still_there = done.stdout.split()
    assert still_there == "True", "the reaper unlinked a segment while its producer was still running"
    assert wait_until_gone(os.path.join(SHM_DIR, name)), "the reaper did not unlink it after the exit"


# --- CUDA IPC (the H200) ---------------------------------------------------------------------


def test_torch_s_cuda_export_has_the_arguments_we_read():
    """cuda_ipc.py reads torch's export by argument name (the counter file for the reaper, the
    device to rebuild on): this fails on the CPU, in CI, if torch renames them."""
    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert {"storage_device", "ref_counter_handle", "ref_counter_offset"} <= set(names)
    export = CudaExport(tuple(b"/torch_12_34" if name == "ref_counter_handle" else 0 for name in names))
    assert export.ref_counter_name == "torch_12_34"



@pytest.mark.gpu
@needs_cuda
def test_cuda_ipc_between_two_processes_on_one_gpu():
    """A producer process on the GPU and this process as its consumer: the data arrives on every
    write, the handle is opened once, and the producer's memory is released after its consumer
    closed, and after a second consumer was killed mid-copy; a killed producer leaves nothing
    in /dev/shm (torch's reference-counter file included)."""
    device = "cuda:0"
    num_bytes = 64 << 20
    peer = Peer.start(run_producer, device, num_bytes)
    producer_pid, _, _, baseline_bytes = peer.hello
    consumer = TensorConsumer()
    index, offer = peer.ask("offer", local_identity(device))
    assert offer.path is TransportPath.CUDA_IPC
    consumer.open(offer)
    for seed, (dtype, shape, offset) in enumerate(LAYOUTS * 5):
        message = peer.ask("write", index, seed, dtype, shape, offset)
        assert message.inline_bytes is None
        out = torch.empty(shape, dtype=message.torch_dtype, device=device)
        consumer.copy_into(message, out)
        assert to_bytes(out) == to_bytes(random_tensor(seed, message.torch_dtype, shape)), (dtype, shape, offset)
    big = peer.ask("write", index, 99, "bfloat16", (num_bytes // 2,), 0)
    checksum = hashlib.sha256(to_bytes(consumer.view(big))).digest()
    assert checksum == hashlib.sha256(to_bytes(random_tensor(99, torch.bfloat16, (num_bytes // 2,)))).digest()
    consumer.open(offer)
    assert consumer.num_regions_opened == 1

    killed = Peer.start(run_consumer, device)
    killed_identity, killed_pid = killed.hello
    killed_index, killed_offer = peer.ask("offer", killed_identity)
    killed.ask("open", killed_offer)
    assert killed.ask("copy_forever", big) == "copying"
    killed.kill()

    consumer.close_all()
    torch.cuda.synchronize()
    # The closed consumer gave its reference back, the killed one could not: withdraw gives back
    # only the latter's (giving back both left the region in torch's limbo, never freed).
    assert (peer.ask("references_held", index), peer.ask("references_held", killed_index)) == (0, 1)
    peer.ask("withdraw", index)
    peer.ask("withdraw", killed_index)
    peer.ask("free")
    assert peer.ask("memory_allocated") == baseline_bytes  # the region's memory is back
    peer.kill()
    for name in segments_of([producer_pid]):  # torch's counter file, until the reaper has run
        assert wait_until_gone(os.path.join(SHM_DIR, name)), f"{name} left in /dev/shm"
    assert segments_of([producer_pid, killed_pid, os.getpid()]) == []
