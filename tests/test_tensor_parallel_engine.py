"""The torch engine split over 2 tensor-parallel ranks (gloo, two real processes) against the same
engine on one process, on the tiny float32 model of every supported architecture.

Rank 0 is a TorchEngineCore built by create_engine_core with the rendezvous, in a process of its
own; rank 1 is the real rank process (engine/rank_processes.py, engine/rank_worker.py). One run
covers chunked prefill (8-token budget), preemption (an 8-block pool for 4 sequences that need
15), n = 2 (forked blocks) and prefix reuse (a prompt sent again and one sharing 36 tokens), with
async scheduling (the placeholder tokens follow each step to rank 1). Greedy tokens must be
identical and logprobs within 1e-4; the pool must be free at the end.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.cores import create_engine_core
from llmserve.inference.engine.rank_processes import RankProcesses
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.observability import ObservabilityConfig
from llmserve.tools.tiny_model import ARCHITECTURES
from tests.rank_runs import put_result_and_exit
from tests.test_torch_engine import drain, greedy, make_prompt, request

LOGPROB_TOLERANCE = 1e-4
RANK_TIMEOUT_S = 300


def engine_config(model_dir: Path, tensor_parallel_size: int) -> EngineConfig:
    return EngineConfig(
        model_path=model_dir, model_name="tiny", num_kv_blocks=8, max_batched_tokens=8, max_num_seqs=8,
        tensor_parallel_size=tensor_parallel_size,
    )  # fmt: skip


def scenario(engine: TorchEngineCore) -> dict:
    """Token ids and logprobs by (request id, sequence index), and what the engine counted."""
    results = {}
    chunked = [make_prompt(n, seed=300 + n) for n in (30, 5, 19, 18)]
    engine.add_request(request("c0", chunked[0], greedy()))
    engine.step()  # c0's first chunk; the others arrive while it is still prefilling
    for i, prompt in enumerate(chunked[1:], start=1):
        engine.add_request(request(f"c{i}", prompt, greedy(n=2) if i == 1 else greedy()))
    drain(engine, results)
    prompt = make_prompt(40, seed=7)
    engine.add_request(request("cold", prompt, greedy()))
    drain(engine, results)
    engine.add_request(request("same", prompt, greedy()))
    engine.add_request(request("shared", prompt[:36] + make_prompt(6, seed=8), greedy()))
    drain(engine, results)
    load = engine.load()
    return {
        "tokens": {(rid, i): ids for rid, result in results.items() for i, ids in result.token_ids.items()},
        "logprobs": {(rid, i): lps for rid, result in results.items() for i, lps in result.logprobs.items()},
        "cached": {rid: result.finals[0].num_cached_tokens for rid, result in results.items()},
        "preemptions": load.num_preemptions_total,
        "blocks_used": load.kv_blocks_used,
    }


def _rank_0_main(config: EngineConfig, store_path: str, job, job_args: tuple, results) -> None:
    core = create_engine_core(config, store_path)
    put_result_and_exit(results, lambda: job(core, *job_args), core.stop_ranks)


def split_run(config: EngineConfig, job=None, *job_args):
    """`job(core, *job_args)` (default: `scenario`) on rank 0 of a split engine, the other ranks in
    their real processes; what it returned, once every rank has left by itself."""
    context = multiprocessing.get_context("spawn")
    ranks = RankProcesses(config, context, "WARNING", ObservabilityConfig())
    results = context.Queue()
    rank_0 = context.Process(target=_rank_0_main, args=(config, ranks.store_path, job or scenario, job_args, results))
    rank_0.start()
    try:
        return results.get(timeout=RANK_TIMEOUT_S)
    finally:
        rank_0.join(RANK_TIMEOUT_S)
        ranks.join(RANK_TIMEOUT_S)
        assert (rank_0.exitcode, ranks.exit_codes) == (0, [0] * (config.tensor_parallel_size - 1))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_two_ranks_generate_what_one_process_generates(arch, tiny_model_dirs):
    split = split_run(engine_config(tiny_model_dirs[arch], 2))
    single = scenario(TorchEngineCore(engine_config(tiny_model_dirs[arch], 1)))
    assert split["tokens"] == single["tokens"]
    assert len(split["tokens"]) == 8  # c0, c1 (n = 2), c2, c3, cold, same, shared
    for key, logprobs in single["logprobs"].items():
        assert split["logprobs"][key] == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE), key
    assert split["preemptions"] > 0  # the pool held 8 of the 15 blocks the first wave needs
    assert split["cached"]["same"] == split["cached"]["shared"] == 32  # two full blocks reused
    assert split["blocks_used"] == 0


def test_a_split_core_without_its_ranks_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs its rank processes"):
        TorchEngineCore(engine_config(tiny_model_dir, 2))


def greedy_tokens(engine: TorchEngineCore, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(request(f"p{i}", prompt, greedy(24)))
    results = drain(engine)
    return [results[f"p{i}"].token_ids[0] for i in range(len(prompts))]


@pytest.mark.slow
def test_three_ranks_of_the_real_default_model_generate_what_one_process_does(default_model_dir):
    """SmolLM2-135M's trained weights (9 heads, 3 KV heads, tied 49152-row vocabulary) split 3 ways."""
    prompts = [make_prompt(n, seed=700 + n) for n in (12, 57, 100)]
    split = split_run(EngineConfig(model_path=default_model_dir, model_name="smol", tensor_parallel_size=3),
                      greedy_tokens, prompts)
    assert split == greedy_tokens(TorchEngineCore(EngineConfig(model_path=default_model_dir, model_name="smol")), prompts)
