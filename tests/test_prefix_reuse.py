"""Prefix reuse through the torch engine: prompts that share a prefix and are prefilled in the
same step (many users of one system prompt arriving together) cache as much as the same
prompts sent one after another, and the prefix-cache counters add up; a cache salt shares
blocks only with requests of the same salt; preprocess's hashes are the engine's own.

A tiny random Llama (llmserve.tools.tiny_model) with a 512-token context; block size 16.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.preprocess.config import PreprocessConfig
from llmserve.preprocessing.preprocessor import TOKEN_IDS_FIELD, Preprocessor
from tests.factories import with_context
from tests.test_torch_engine import Result, assert_pool_full, drain, greedy, make_engine, make_prompt, request, run

NUM_NEW_TOKENS = 4


@pytest.fixture(scope="module")
def long_context_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny Llama with room for 300-token prompts (its weights do not depend on it)."""
    return with_context(tiny_model_dir, tmp_path_factory.mktemp("tiny-llama-512"), 512)


def long_engine(model_dir: Path, **overrides) -> TorchEngineCore:
    """Room for every prompt of a test in one step, so twins are prefilled together."""
    settings = dict(num_kv_blocks=512, max_batched_tokens=8192, max_num_seqs=32)
    settings.update(overrides)
    return make_engine(model_dir, **settings)


def send(engine: TorchEngineCore, prompts: dict[str, list[int]], **fields) -> dict[str, tuple[int, list[int]]]:
    """Run `prompts` together (with EngineRequest `fields`): (cached tokens, generated ids) by
    request id."""
    requests = [request(name, prompt, greedy(NUM_NEW_TOKENS), **fields) for name, prompt in prompts.items()]
    results = run(engine, requests)
    return {name: (result.finals[0].num_cached_tokens, result.token_ids[0]) for name, result in results.items()}


def send_one_by_one(engine: TorchEngineCore, prompts: dict[str, list[int]]) -> dict[str, tuple[int, list[int]]]:
    return {name: send(engine, {name: prompt})[name] for name, prompt in prompts.items()}


def cached_tokens(results: dict[str, tuple[int, list[int]]]) -> dict[str, int]:
    return {name: num_cached for name, (num_cached, _) in results.items()}


def test_seventeen_prompts_on_one_system_prompt_sent_together_are_all_cached(long_context_model_dir):
    system = make_prompt(16, seed=1)  # one block shared by all
    prompts = {f"user{i}": system + make_prompt(284, seed=100 + i) for i in range(17)}  # 300 tokens each
    engine = long_engine(long_context_model_dir)
    first = send(engine, prompts)
    assert set(cached_tokens(first).values()) == {0}
    resent = send(engine, prompts)
    assert cached_tokens(resent) == {name: 288 for name in prompts}  # (300 - 1) // 16 blocks each
    assert {name: ids for name, (_, ids) in resent.items()} == {name: ids for name, (_, ids) in first.items()}
    load = engine.load()
    assert load.prefix_cache_queried_tokens_total == 2 * 17 * 300
    assert load.prefix_cache_hit_tokens_total == 17 * 288
    assert_pool_full(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_twins_sent_together_cache_as_much_as_sent_one_after_another(long_context_model_dir, async_scheduling):
    shared = make_prompt(32, seed=2)
    prompts = {"A": shared + make_prompt(20, seed=3), "B": shared + make_prompt(20, seed=4)}  # 52 tokens each
    together = long_engine(long_context_model_dir, async_scheduling=async_scheduling)
    in_turn = long_engine(long_context_model_dir, async_scheduling=async_scheduling)
    first_together, first_in_turn = send(together, prompts), send_one_by_one(in_turn, prompts)
    assert cached_tokens(first_together) == {"A": 0, "B": 0}
    assert cached_tokens(first_in_turn) == {"A": 0, "B": 32}
    rerun_b_together, rerun_b_in_turn = send(together, {"B": prompts["B"]}), send(in_turn, {"B": prompts["B"]})
    assert cached_tokens(rerun_b_together) == cached_tokens(rerun_b_in_turn) == {"B": 48}
    # B ran on A's blocks after its step: its output is the one it has alone.
    assert first_together["B"][1] == first_in_turn["B"][1] == rerun_b_together["B"][1]
    assert together.load().prefix_cache_hit_tokens_total == 48
    assert in_turn.load().prefix_cache_hit_tokens_total == 32 + 48
    for engine in (together, in_turn):
        assert engine.load().prefix_cache_queried_tokens_total == 3 * 52
        assert_pool_full(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_freed_duplicate_is_reused_at_once_and_changes_no_output(long_context_model_dir, async_scheduling):
    """B swaps onto A's blocks as their prefill step is launched; C, admitted by the very next
    schedule (the prefill maybe still running on the device), computes into B's duplicates."""
    shared = make_prompt(32, seed=2)
    prompts = {"A": shared + make_prompt(20, seed=3), "B": shared + make_prompt(20, seed=4)}
    prompts["C"] = make_prompt(40, seed=5)
    alone = {name: send(long_engine(long_context_model_dir), {name: p})[name][1] for name, p in prompts.items()}
    engine = long_engine(long_context_model_dir, async_scheduling=async_scheduling)
    for name in ("A", "B"):
        engine.add_request(request(name, prompts[name], greedy(NUM_NEW_TOKENS)))
    results: dict[str, Result] = {}
    for output in engine.step():
        results.setdefault(output.request_id, Result()).add(output)
    a, b = sorted((seq for seq in engine.scheduler.running), key=lambda seq: seq.request_id)
    assert b.block_ids[:2] == a.block_ids[:2]
    duplicates = engine.block_manager.free_block_ids()[:2]  # B's own first blocks, freed by the swap
    assert engine.block_manager.blocks[duplicates[0]].registration_id == 0
    engine.add_request(request("C", prompts["C"], greedy(NUM_NEW_TOKENS)))
    for output in engine.step():
        results.setdefault(output.request_id, Result()).add(output)
    (c,) = [seq for seq in engine.scheduler.running if seq.request_id == "C"]
    assert c.block_ids[:2] == duplicates
    drain(engine, results)
    assert {name: result.token_ids[0] for name, result in results.items()} == alone
    assert_pool_full(engine)

def test_a_cache_salt_shares_cached_blocks_only_with_the_same_salt(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = {"p": make_prompt(40, seed=5)}  # 2 full blocks the re-runs may hit
    assert cached_tokens(send(engine, prompt, cache_salt="tenant-a")) == {"p": 0}
    assert cached_tokens(send(engine, prompt)) == {"p": 0}
    assert cached_tokens(send(engine, prompt, cache_salt="tenant-b")) == {"p": 0}
    assert cached_tokens(send(engine, prompt, cache_salt="tenant-a")) == {"p": 32}
    assert cached_tokens(send(engine, prompt)) == {"p": 32}
    assert_pool_full(engine)


def test_preprocess_hashes_like_the_engine_for_the_same_prompt_and_salt(tiny_model_dir):
    """The engine computes the hashes of a request sent without them; the same prompt sent
    with preprocess's hashes then hits every block, for the same salt only."""
    preprocessor = Preprocessor.load(tiny_model_dir, PreprocessConfig(model_path=tiny_model_dir).preprocessor_settings)
    engine = make_engine(tiny_model_dir)
    prompt = make_prompt(40, seed=6)

    def preprocessed(cache_salt: str) -> dict:
        """The EngineRequest fields the gateway sends for `prompt` with `cache_salt`."""
        return dict(
            block_hashes=preprocessor.finish(list(prompt), TOKEN_IDS_FIELD, NUM_NEW_TOKENS, cache_salt).block_hashes,
            block_size_tokens=preprocessor.info.block_size_tokens,
            block_hash_version=preprocessor.info.block_hash_version,
            cache_salt=cache_salt,
        )

    assert preprocessor.info.hash_namespace == engine.model_info.hash_namespace
    send(engine, {"engine-hashed": prompt}, cache_salt="t")
    assert cached_tokens(send(engine, {"other-salt": prompt}, **preprocessed(""))) == {"other-salt": 0}
    assert cached_tokens(send(engine, {"same-salt": prompt}, **preprocessed("t"))) == {"same-salt": 32}
    assert_pool_full(engine)
