"""KV pull between two torch engine cores (issue 22, second part), on CPU through /dev/shm.

Replica A computes a prompt; replica B pins A's blocks of it, copies them into its own pool
and prefix cache (TorchEngineCore.kv_pin / kv_import / kv_release), and then runs the prompt
computing only the rest. B's greedy tokens must equal those of a replica that recomputed the
whole prompt, the blocks' bytes must equal A's, every block must be free again afterwards, and
nothing must be left in /dev/shm once the cores close.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from prometheus_client import REGISTRY

from llmserve.inference.engine.kv_block_import import KvPullRefused
from llmserve.inference.engine.kv_pool_export import KvPoolLayout
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.tensor_transport import TransportPath, local_identity
from tests.test_torch_engine import assert_pool_full, greedy, make_engine, make_prompt, request, run
from tests.transport_peers import segments_of

BLOCK_SIZE = 16
PROMPT_TOKENS = 100  # 6 full blocks, (100 - 1) // 16 of them reusable
NUM_NEW_TOKENS = 12
CPU_IDENTITY = local_identity("cpu")


@pytest.fixture
def pull_engines(tiny_model_dir):
    """(A, B, plain): two replicas with --kv-pull and one without, each its own pool."""
    engines = [make_engine(tiny_model_dir, kv_pull=True), make_engine(tiny_model_dir, kv_pull=True),
               make_engine(tiny_model_dir)]
    yield engines
    for engine in engines:
        engine.close()
    assert segments_of([os.getpid()]) == []


def generate(engine: TorchEngineCore, name: str, prompt: list[int]):
    result = run(engine, [request(name, prompt, greedy(NUM_NEW_TOKENS))])[name]
    return result.token_ids[0], result.finals[0].num_cached_tokens


def pull(source: TorchEngineCore, target: TorchEngineCore, prompt: list[int], max_blocks: int = 0) -> int:
    """B pins at A, imports, A releases: the tokens pulled."""
    req = request("pull", prompt, greedy(NUM_NEW_TOKENS))
    pinned = source.kv_pin(req, max_blocks, CPU_IDENTITY)
    assert source.load().kv_blocks_used == len(pinned.block_ids)  # held while B copies
    try:
        imported = target.kv_import(req, pinned)
    finally:
        source.kv_release(list(pinned.block_ids))
    assert imported.path is TransportPath.SHM
    assert imported.num_bytes == imported.num_blocks * pinned.layout.bytes_per_block
    return imported.num_blocks * BLOCK_SIZE


def pool_blocks(engine: TorchEngineCore, prompt: list[int]) -> torch.Tensor:
    """The KV of `prompt`'s cached blocks in `engine`'s pool, in prompt order."""
    seq = engine._sequences.prefix_probe(request("look", prompt, greedy()))
    block_ids = engine.block_manager.find_cached_blocks(seq)
    return engine.runner.kv_cache.data[:, :, block_ids].clone()


def test_pulled_prefix_gives_the_same_tokens_as_recomputing(pull_engines):
    a, b, plain = pull_engines
    prompt = make_prompt(PROMPT_TOKENS, seed=3)
    generate(a, "on-a", prompt)
    assert a.runner.kv_cache.export is not None
    bytes_before = REGISTRY.get_sample_value("llmserve_transport_bytes_total", {"path": "shm"}) or 0.0
    num_pulled = pull(a, b, prompt)
    assert num_pulled == 6 * BLOCK_SIZE
    # The transport counts the blocks read, not the source's whole pool that they were read from.
    bytes_read = REGISTRY.get_sample_value("llmserve_transport_bytes_total", {"path": "shm"}) - bytes_before
    assert bytes_read == 6 * KvPoolLayout.of(a.runner.kv_cache.data).bytes_per_block
    assert torch.equal(pool_blocks(b, prompt), pool_blocks(a, prompt))
    pulled_tokens, num_cached = generate(b, "on-b", prompt)
    recomputed_tokens, num_cached_plain = generate(plain, "recomputed", prompt)
    assert (num_cached, num_cached_plain) == (num_pulled, 0)  # B computed only the rest
    assert pulled_tokens == recomputed_tokens
    for engine in pull_engines:
        assert_pool_full(engine)


def test_only_the_blocks_the_target_lacks_are_pulled(pull_engines):
    a, b, plain = pull_engines
    shared = make_prompt(2 * BLOCK_SIZE, seed=4)
    prompt = shared + make_prompt(PROMPT_TOKENS - len(shared), seed=5)
    generate(a, "on-a", prompt)
    generate(b, "b-has-the-start", shared + [7, 8, 9])  # B caches the first 2 blocks itself
    assert pull(a, b, prompt) == 4 * BLOCK_SIZE
    assert pull(a, b, prompt) == 0  # all there now
    assert generate(b, "on-b", prompt) == (generate(plain, "recomputed", prompt)[0], 6 * BLOCK_SIZE)


def test_a_source_that_evicted_part_of_the_prefix_gives_what_it_has(pull_engines):
    """Fewer blocks pinned (an evicted tail) → fewer pulled, the rest recomputed, same tokens."""
    a, b, plain = pull_engines
    prompt = make_prompt(PROMPT_TOKENS, seed=6)
    generate(a, "on-a", prompt)
    assert pull(a, b, prompt, max_blocks=2) == 2 * BLOCK_SIZE
    assert generate(b, "on-b", prompt) == (generate(plain, "recomputed", prompt)[0], 2 * BLOCK_SIZE)
    other = make_prompt(PROMPT_TOKENS, seed=7)  # never computed on A: nothing to pin
    assert pull(a, b, other) == 0
    assert_pool_full(a)
    assert_pool_full(b)


def test_pinned_blocks_are_not_reused_until_released(tiny_model_dir):
    """A pool of 8 blocks: 6 pinned, a 4-block prompt cannot be admitted until the release."""
    a = make_engine(tiny_model_dir, kv_pull=True, num_kv_blocks=8)
    try:
        prompt = make_prompt(PROMPT_TOKENS, seed=8)
        generate(a, "on-a", prompt)
        pinned = a.kv_pin(request("pull", prompt, greedy()), 0, CPU_IDENTITY)
        assert len(pinned.block_ids) == 6
        a.add_request(request("other", make_prompt(60, seed=9), greedy(4)))
        a.step()
        assert a.load().num_waiting == 1  # 2 free blocks, 4 needed: it waits
        a.kv_release(list(pinned.block_ids))
        assert len(run(a, [])["other"].token_ids[0]) == 4
        assert_pool_full(a)
    finally:
        a.close()


def test_refusals_name_their_reason(tiny_model_dir, pull_engines):
    a, b, plain = pull_engines
    prompt = make_prompt(PROMPT_TOKENS, seed=10)
    req = request("pull", prompt, greedy())
    with pytest.raises(KvPullRefused) as refused:
        plain.kv_pin(req, 0, CPU_IDENTITY)
    assert refused.value.reason == "not_enabled"
    crossed = pickle.loads(pickle.dumps(refused.value))  # as it crosses the engine-core pipe
    assert (type(crossed), crossed.reason, str(crossed)) == (KvPullRefused, "not_enabled", str(refused.value))
    generate(a, "on-a", prompt)
    pinned = a.kv_pin(req, 0, CPU_IDENTITY)
    try:
        assert pinned.offer.path is TransportPath.SHM
        other_layout = KvPoolLayout(**{**_fields(pinned.layout), "num_kv_heads": pinned.layout.num_kv_heads * 2})
        with pytest.raises(KvPullRefused) as refused:
            b.kv_import(req, type(pinned)(pinned.offer, other_layout, pinned.block_ids))
        assert refused.value.reason == "layout_mismatch"
        inline = a.kv_pin(req, 0, local_identity("cpu").__class__(**{**_fields(CPU_IDENTITY), "shm_device": 1}))
        a.kv_release(list(inline.block_ids))
        with pytest.raises(KvPullRefused) as refused:
            b.kv_import(req, inline)
        assert refused.value.reason == "no_shared_memory"
    finally:
        a.kv_release(list(pinned.block_ids))
    assert_pool_full(a)
    assert_pool_full(b)


def _fields(instance) -> dict:
    return {name: getattr(instance, name) for name in instance.__dataclass_fields__}


def test_a_source_whose_segment_is_gone_is_refused_as_gone(pull_engines):
    """The source died after pinning (its reaper unlinked the pool's segment) before the
    target mapped it: nothing pulled, nothing held on the target."""
    a, b, _ = pull_engines
    prompt = make_prompt(PROMPT_TOKENS, seed=11)
    generate(a, "on-a", prompt)
    req = request("pull", prompt, greedy())
    pinned = a.kv_pin(req, 0, CPU_IDENTITY)
    a.kv_release(list(pinned.block_ids))
    a.close()  # unlinks the segment, as the reaper does for a dead source
    with pytest.raises(KvPullRefused) as refused:
        b.kv_import(req, pinned)
    assert refused.value.reason == "source_gone"
    assert_pool_full(b)
    assert b.block_manager.find_cached_blocks(b._sequences.prefix_probe(req)) == []


def test_a_cuda_export_crosses_the_wire_argument_for_argument():
    """CudaIpcExport carries rebuild_cuda_tensor's arguments as reduce_tensor gives them for a
    region (checked on CPU with the values' types; the GPU test maps a real one)."""
    from llmserve.inference.kv_pull_wire import cuda_export_from_pb, cuda_export_to_pb, offer_from_pb, offer_to_pb
    from llmserve.tensor_transport import RegionOffer

    args = (
        torch.Tensor, torch.Size([4096]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 1, b"\x01handle",
        8192, 512, False, b"/torch_123_456", 3, b"\x02event", True,
    )
    assert cuda_export_from_pb(cuda_export_to_pb(args)) == args
    offer = RegionOffer("host/1/ab/0", TransportPath.CUDA_IPC, 4096, cuda_export=args, device_uuid="GPU-1", event_handle=b"e")
    assert offer_from_pb(offer_to_pb(offer)) == offer
    shm = RegionOffer("host/1/ab/1", TransportPath.SHM, 4096, shm_name="llmserve-tt-1-ab")
    assert offer_from_pb(offer_to_pb(shm)) == shm


def test_blocks_land_in_scattered_free_blocks_intact(pull_engines):
    """B's free blocks interleaved with held ones: each pulled block is its own run."""
    a, b, plain = pull_engines
    prompt = make_prompt(PROMPT_TOKENS, seed=12)
    generate(a, "on-a", prompt)
    odd = list(range(1, 13, 2))
    b.block_manager.hold(odd)  # the free queue now starts 0, 2, 4, ...
    try:
        assert pull(a, b, prompt) == 6 * BLOCK_SIZE
        seq = b._sequences.prefix_probe(request("look", prompt, greedy()))
        assert b.block_manager.find_cached_blocks(seq) == [0, 2, 4, 6, 8, 10]
        assert torch.equal(pool_blocks(b, prompt), pool_blocks(a, prompt))
    finally:
        b.block_manager.release(odd)
    assert generate(b, "on-b", prompt) == (generate(plain, "recomputed", prompt)[0], 6 * BLOCK_SIZE)


def test_a_gather_in_chunks_lands_every_block_where_its_run_would(pull_engines):
    """Scattered targets with a gather budget of two blocks: three chunks, the same bytes."""
    from llmserve.inference.engine.kv_block_import import KvBlockImporter

    a, b, plain = pull_engines
    prompt = make_prompt(PROMPT_TOKENS, seed=13)
    generate(a, "on-a", prompt)
    b._kv_importer = KvBlockImporter(b.runner.kv_cache, b.block_manager, gather_bytes=2 * a.runner.kv_cache.data[:, :, 0].nbytes)
    odd = list(range(1, 13, 2))
    b.block_manager.hold(odd)
    try:
        assert pull(a, b, prompt) == 6 * BLOCK_SIZE
        assert torch.equal(pool_blocks(b, prompt), pool_blocks(a, prompt))
    finally:
        b.block_manager.release(odd)


def test_runs_follow_both_sides_block_ids():
    from llmserve.inference.engine.kv_block_import import _consecutive_runs

    assert _consecutive_runs([(3, 10), (4, 11), (5, 20), (9, 21), (10, 22)]) == [(0, 2), (2, 1), (3, 2)]
    assert _consecutive_runs([]) == []
