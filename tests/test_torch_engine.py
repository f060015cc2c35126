"""TorchEngineCore against transformers (the oracle), on tiny float32 models of every family.

Greedy generations must match `generate(do_sample=False)` token for token and logprobs must be
within 1e-4 of transformers' log_softmax - alone, batched with mixed lengths, with chunked
prefill, with a warm prefix cache and after preemption. Every test ends with the whole KV
pool free again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.kv_cache import KVCacheSpec
from llmserve.inference.engine.step_stats import StepStatsLog
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.engine_output import EngineOutput
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import FinishReason, SamplingParams
from llmserve.tools.tiny_model import ARCHITECTURES

NUM_NEW_TOKENS = 32
LOGPROB_TOLERANCE = 1e-4
EOS_TOKEN_ID = 2  # <|im_end|> in the tiny tokenizer


def make_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (length,), generator=generator).tolist()


def greedy(max_tokens: int = NUM_NEW_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1, **kwargs)


def make_engine(model_dir: Path, **overrides) -> TorchEngineCore:
    settings = dict(model_path=model_dir, model_name="tiny", num_kv_blocks=64, max_batched_tokens=256, max_num_seqs=8)
    settings.update(overrides)
    return TorchEngineCore(EngineConfig(**settings))


def request(request_id: str, prompt: list[int], sampling: SamplingParams, **kwargs) -> EngineRequest:
    return EngineRequest(request_id, prompt, sampling, arrival_ns=time.monotonic_ns(), **kwargs)


@dataclass
class Result:
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # by sequence index
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    finals: dict[int, EngineOutput] = field(default_factory=dict)

    def add(self, output: EngineOutput) -> None:
        self.token_ids.setdefault(output.sequence_index, []).extend(output.new_token_ids)
        if output.logprobs:
            self.logprobs.setdefault(output.sequence_index, []).extend(lp.logprob for lp in output.logprobs)
        if output.is_finished:
            assert output.sequence_index not in self.finals, "two final outputs for one sequence"
            self.finals[output.sequence_index] = output


def drain(engine: TorchEngineCore, results: dict[str, Result] | None = None, max_steps: int = 2000):
    results = {} if results is None else results
    for _ in range(max_steps):
        if not engine.has_requests_in_flight():
            return results
        for output in engine.step():
            results.setdefault(output.request_id, Result()).add(output)
    raise AssertionError("the engine did not finish")


def run(engine: TorchEngineCore, requests: list[EngineRequest]) -> dict[str, Result]:
    for req in requests:
        engine.add_request(req)
    return drain(engine)


def assert_pool_full(engine: TorchEngineCore) -> None:
    load = engine.load()
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
    assert not engine.has_requests_in_flight()


class Oracle:
    """transformers' greedy generate, EOS disabled, with the log-probabilities of its choices."""

    def __init__(self, model_dirs: dict[str, Path]):
        self.model_dirs = model_dirs
        self._models = {}
        self._cache = {}

    def generate(self, arch: str, prompt: list[int], num_tokens: int = NUM_NEW_TOKENS) -> tuple[list[int], list[float]]:
        key = (arch, tuple(prompt), num_tokens)
        if key not in self._cache:
            model = self._model(arch)
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]),
                    do_sample=False,
                    max_new_tokens=num_tokens,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            token_ids = out.sequences[0, len(prompt) :].tolist()
            logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, token_ids)]
            self._cache[key] = (token_ids, logprobs)
        return self._cache[key]

    def _model(self, arch: str):
        if arch not in self._models:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_dirs[arch], dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # compare full-length generations
            self._models[arch] = model
        return self._models[arch]


@pytest.fixture(scope="module")
def oracle(tiny_model_dirs) -> Oracle:
    return Oracle(tiny_model_dirs)


def assert_matches_oracle(oracle: Oracle, arch: str, prompt: list[int], result: Result, index: int = 0) -> None:
    expected_ids, expected_logprobs = oracle.generate(arch, prompt)
    assert result.token_ids[index] == expected_ids
    assert result.logprobs[index] == pytest.approx(expected_logprobs, abs=LOGPROB_TOLERANCE)
    assert result.finals[index].finish_reason is FinishReason.LENGTH


# --- greedy against transformers ----------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers_alone_and_batched(arch, tiny_model_dirs, oracle):
    engine = make_engine(tiny_model_dirs[arch])
    prompt = make_prompt(11, seed=1)
    results = run(engine, [request("alone", prompt, greedy())])
    assert_matches_oracle(oracle, arch, prompt, results["alone"])
    prompts = [make_prompt(n, seed=n) for n in (5, 17, 40, 2, 16)]
    results = run(engine, [request(f"r{i}", p, greedy()) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert_matches_oracle(oracle, arch, prompt, results[f"r{i}"])
    assert_pool_full(engine)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_matches(arch, tiny_model_dirs, oracle):
    engine = make_engine(tiny_model_dirs[arch], max_batched_tokens=8)
    prompts = [make_prompt(n, seed=100 + n) for n in (30, 5, 19)]
    engine.add_request(request("r0", prompts[0], greedy()))
    engine.step()  # r0's first chunk; the others arrive while it is still prefilling
    results = run(engine, [request(f"r{i}", p, greedy()) for i, p in enumerate(prompts) if i])
    for i, prompt in enumerate(prompts):
        assert_matches_oracle(oracle, arch, prompt, results[f"r{i}"])
    assert_pool_full(engine)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_warm_prefix_cache_serves_cached_tokens_and_still_matches(arch, tiny_model_dirs, oracle):
    engine = make_engine(tiny_model_dirs[arch])
    prompt = make_prompt(40, seed=7)
    cold = run(engine, [request("cold", prompt, greedy())])["cold"]
    assert cold.finals[0].num_cached_tokens == 0
    assert_matches_oracle(oracle, arch, prompt, cold)
    shared = prompt[:36] + make_prompt(6, seed=8)
    results = run(engine, [request("same", prompt, greedy()), request("shared", shared, greedy())])
    assert results["same"].finals[0].num_cached_tokens == 32
    assert results["shared"].finals[0].num_cached_tokens == 32
    assert_matches_oracle(oracle, arch, prompt, results["same"])
    assert_matches_oracle(oracle, arch, shared, results["shared"])
    assert_pool_full(engine)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_preemption_recomputes_and_still_matches(arch, tiny_model_dirs, oracle):
    # 4 sequences of up to 20 + 32 tokens need 16 blocks; the pool has 8.
    engine = make_engine(tiny_model_dirs[arch], num_kv_blocks=8)
    prompts = [make_prompt(n, seed=200 + n) for n in (20, 14, 9, 18)]
    results = run(engine, [request(f"r{i}", p, greedy()) for i, p in enumerate(prompts)])
    assert engine.load().num_preemptions_total > 0
    for i, prompt in enumerate(prompts):
        assert_matches_oracle(oracle, arch, prompt, results[f"r{i}"])
    assert_pool_full(engine)


def test_sliding_window_matches(tiny_model_dirs, tmp_path):
    """Mistral with a window of 8, checked against transformers' forward without a cache."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "mistral-window"
    shutil.copytree(tiny_model_dirs["mistral"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 8
    (model_dir / "config.json").write_text(json.dumps(config))
    engine = make_engine(model_dir, max_batched_tokens=8)  # chunks and decodes cross the window
    prompts = [make_prompt(n, seed=300 + n) for n in (33, 6)]
    results = run(engine, [request(f"r{i}", p, greedy()) for i, p in enumerate(prompts)])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        generated = results[f"r{i}"].token_ids[0]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + generated]), use_cache=False).logits[0]
        expected_logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        assert generated == expected_logprobs.argmax(dim=-1).tolist()
        chosen = expected_logprobs.gather(1, torch.tensor(generated)[:, None])[:, 0].tolist()
        assert results[f"r{i}"].logprobs[0] == pytest.approx(chosen, abs=LOGPROB_TOLERANCE)
    assert_pool_full(engine)


def test_sharded_checkpoint_loads(tiny_model_dirs, oracle, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"], dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dirs["qwen2"] / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    prompt = make_prompt(11, seed=1)
    result = run(make_engine(sharded), [request("sharded", prompt, greedy())])["sharded"]
    assert_matches_oracle(oracle, "qwen2", prompt, result)


def test_unsupported_architecture_is_refused(tiny_model_dirs, tmp_path):
    import json
    import shutil

    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        make_engine(model_dir)


# --- requests with n > 1, seeds, stops ---------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_sequences_share_the_prompt_blocks(tiny_model_dirs, oracle, async_scheduling):
    engine = make_engine(tiny_model_dirs["llama"], async_scheduling=async_scheduling)
    prompt = make_prompt(21, seed=3)  # one full block + 5 tokens
    engine.add_request(request("n3", prompt, greedy(n=3)))
    first = engine.step()
    if async_scheduling:
        assert first == []  # the prompt step's tokens are processed while the next step runs
        first = engine.step()
    assert [(o.sequence_index, len(o.new_token_ids)) for o in first] == [(0, 1), (1, 1), (2, 1)]
    assert engine.load().kv_blocks_used == 4  # 1 shared full block + 3 own partial blocks
    results = {"n3": Result()}
    for output in first:
        results["n3"].add(output)
    drain(engine, results)
    for index in range(3):
        assert_matches_oracle(oracle, "llama", prompt, results["n3"], index)
    assert_pool_full(engine)


def test_seeded_sampling_is_the_same_in_any_batch(tiny_model_dirs):
    sampling = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    prompt = make_prompt(13, seed=9)
    alone = run(make_engine(tiny_model_dirs["llama"]), [request("s", prompt, sampling)])["s"].token_ids[0]
    engine = make_engine(tiny_model_dirs["llama"], max_batched_tokens=8)
    others = [
        request(f"o{i}", make_prompt(n, seed=n), SamplingParams(max_tokens=20, seed=i)) for i, n in enumerate((30, 4, 9))
    ]
    engine.add_request(others[0])
    engine.step()
    batched = run(engine, [request("s", prompt, sampling), *others[1:]])["s"].token_ids[0]
    assert batched == alone
    greedy_engine = make_engine(tiny_model_dirs["llama"])
    greedy_ids = run(greedy_engine, [request("g", prompt, greedy(max_tokens=24))])["g"].token_ids[0]
    assert alone != greedy_ids


def test_seeded_n_sequences_differ_and_sequence_0_matches_n_1(tiny_model_dirs):
    sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=99)
    prompt = make_prompt(10, seed=10)
    engine = make_engine(tiny_model_dirs["llama"])
    single = run(engine, [request("one", prompt, sampling)])["one"].token_ids[0]
    many = run(engine, [request("many", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=99, n=3))])["many"]
    assert many.token_ids[0] == single
    assert len({tuple(many.token_ids[i]) for i in range(3)}) == 3
    assert_pool_full(engine)


def test_stop_token_ids_max_tokens_and_min_tokens(tiny_model_dirs, oracle):
    engine = make_engine(tiny_model_dirs["llama"])
    prompt = make_prompt(12, seed=11)
    expected, _ = oracle.generate("llama", prompt)
    stop_id = expected[5]
    stop_at = expected.index(stop_id)
    stopped = run(engine, [request("stop", prompt, greedy(stop_token_ids=(stop_id,)))])["stop"]
    assert stopped.token_ids[0] == expected[: stop_at + 1]  # the stop token is included
    assert (stopped.finals[0].finish_reason, stopped.finals[0].stop_token_id) == (FinishReason.STOP, stop_id)
    assert stopped.finals[0].num_completion_tokens == stop_at + 1
    short = run(engine, [request("short", prompt, greedy(max_tokens=3))])["short"]
    assert short.token_ids[0] == expected[:3] and short.finals[0].finish_reason is FinishReason.LENGTH
    late = run(engine, [request("late", prompt, greedy(stop_token_ids=(stop_id,), min_tokens=stop_at + 2))])["late"]
    assert stop_id not in late.token_ids[0][: stop_at + 2]
    assert len(late.token_ids[0]) >= stop_at + 2
    assert_pool_full(engine)


def test_eos_stops_unless_ignored(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs["llama"], max_num_seqs=48)
    prompts = [make_prompt(6, seed=s) for s in range(48)]
    probe = run(engine, [request(f"p{s}", p, greedy(max_tokens=16)) for s, p in enumerate(prompts)])
    with_eos = [s for s in range(48) if EOS_TOKEN_ID in probe[f"p{s}"].token_ids[0]]
    assert with_eos, "no probe prompt reaches EOS"
    seed = with_eos[0]
    ids = probe[f"p{seed}"].token_ids[0]
    sampling = SamplingParams(max_tokens=16, temperature=0.0)
    result = run(engine, [request("eos", prompts[seed], sampling)])["eos"]
    assert result.token_ids[0] == ids[: ids.index(EOS_TOKEN_ID) + 1]
    assert (result.finals[0].finish_reason, result.finals[0].stop_token_id) == (FinishReason.STOP, EOS_TOKEN_ID)
    assert_pool_full(engine)


def test_context_limit_ends_with_length(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs["llama"], max_context_tokens=40)
    assert engine.model_info.max_context_tokens == 40
    result = run(engine, [request("ctx", make_prompt(30, seed=12), greedy(max_tokens=100))])["ctx"]
    assert len(result.token_ids[0]) == 10 and result.finals[0].finish_reason is FinishReason.LENGTH


# --- resources: abort, rejection, load ---------------------------------------------------------


def test_abort_frees_blocks_at_once(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs["llama"], max_num_seqs=2)
    for i, n in enumerate((20, 33, 7)):
        engine.add_request(request(f"r{i}", make_prompt(n, seed=i), greedy(max_tokens=50)))
    engine.step()
    engine.step()
    load = engine.load()
    assert (load.num_running, load.num_waiting, load.kv_blocks_used) == (2, 1, 5)
    assert engine.abort_request("r1") is True  # running
    assert engine.load().kv_blocks_used == 2
    assert engine.abort_request("r2") is True  # waiting
    assert engine.abort_request("r2") is False
    assert engine.abort_request("nope") is False
    results = drain(engine)
    assert set(results) == {"r0"}
    assert_pool_full(engine)


def test_a_prompt_larger_than_the_pool_fails_with_an_error(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs["llama"], num_kv_blocks=2)
    results = run(engine, [request("big", make_prompt(40, seed=1), greedy(n=2))])
    finals = results["big"].finals
    assert sorted(finals) == [0, 1]
    assert all(f.finish_reason is FinishReason.ERROR for f in finals.values())
    assert finals[0].error_message == (
        "prompt has 40 tokens but a sequence can hold at most 32 (context limit and KV pool of 2 blocks x 16 tokens)"
    )
    engine.add_request(request("big-aborted", make_prompt(40, seed=2), greedy()))
    assert engine.abort_request("big-aborted") is True
    assert engine.step() == []
    assert_pool_full(engine)


def test_load_reports_pool_and_prefix_cache_numbers(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs["llama"], num_kv_blocks=20)
    prompt = make_prompt(40, seed=5)
    engine.add_request(request("a", prompt, greedy(max_tokens=4)))
    engine.step()
    load = engine.load()
    assert (load.kv_blocks_total, load.kv_blocks_used, load.num_running, load.num_waiting) == (20, 3, 1, 0)
    drain(engine)
    shared = prompt[:20] + [3] * 20
    run(engine, [request("b", prompt, greedy(max_tokens=4)), request("c", shared, greedy(max_tokens=4))])
    load = engine.load()
    assert load.prefix_cache_queried_tokens_total == 120
    assert load.prefix_cache_hit_tokens_total == 32 + 16
    assert load.num_preemptions_total == 0
    assert_pool_full(engine)


def test_prefix_caching_off_reports_no_hits(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs["llama"], enable_prefix_caching=False)
    prompt = make_prompt(40, seed=5)
    run(engine, [request("a", prompt, greedy(max_tokens=2))])
    result = run(engine, [request("b", prompt, greedy(max_tokens=2))])["b"]
    assert result.finals[0].num_cached_tokens == 0
    assert engine.load().prefix_cache_hit_tokens_total == 0


def test_pool_size_from_the_cpu_memory_budget(tiny_model_dirs):
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    assert spec.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    budget_bytes = 10 * spec.bytes_per_block + 5
    engine = make_engine(tiny_model_dirs["llama"], num_kv_blocks=None, kv_cpu_memory_bytes=budget_bytes)
    assert engine.load().kv_blocks_total == 10
    # A big budget is capped at every sequence slot at full context: 8 x 256 / 16.
    engine = make_engine(tiny_model_dirs["llama"], num_kv_blocks=None, kv_cpu_memory_bytes=2**30)
    assert engine.load().kv_blocks_total == 8 * 16


def test_model_info(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs["qwen3"], dtype="bfloat16")
    info = engine.model_info
    assert (info.architecture, info.max_context_tokens, info.vocab_size) == ("Qwen3ForCausalLM", 256, 492)
    assert (info.eos_token_ids, info.block_size_tokens, info.dtype, info.backend, info.device) == (
        (2,), 16, "bfloat16", "torch", "cpu"
    )
    result = run(engine, [request("bf16", make_prompt(9, seed=1), greedy(max_tokens=4))])["bf16"]
    assert len(result.token_ids[0]) == 4


# --- async scheduling ----------------------------------------------------------------------------


def mixed_requests(stop_id: int) -> list[EngineRequest]:
    """Everything async scheduling must not change: greedy, seeded sampling, penalties (which
    read the history), logprobs, n > 1 forks, a stop token mid-stream, max_tokens, min_tokens."""
    return [
        request("greedy", make_prompt(19, seed=1), greedy(max_tokens=20)),
        request("seeded", make_prompt(7, seed=2), SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7)),
        request("penalty", make_prompt(12, seed=3), SamplingParams(
            max_tokens=12, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)),
        request("n2", make_prompt(21, seed=4), SamplingParams(max_tokens=10, n=2, temperature=1.0, seed=5)),
        request("logprobs", make_prompt(9, seed=5), SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)),
        request("stop", make_prompt(12, seed=11), greedy(stop_token_ids=(stop_id,))),
        request("late", make_prompt(12, seed=11), greedy(max_tokens=12, stop_token_ids=(stop_id,), min_tokens=9)),
    ]


def outcome(results: dict[str, Result]) -> dict:
    return {
        request_id: (
            result.token_ids,
            {i: [round(v, 4) for v in values] for i, values in result.logprobs.items()},
            {i: (f.finish_reason, f.stop_token_id, f.num_completion_tokens, f.num_prompt_tokens) for i, f in result.finals.items()},
        )
        for request_id, result in results.items()
    }


@pytest.mark.parametrize("num_kv_blocks", [64, 9])  # 9: preemption while tokens are in flight
def test_async_scheduling_changes_no_output(tiny_model_dirs, oracle, num_kv_blocks):
    expected, _ = oracle.generate("llama", make_prompt(12, seed=11))
    stop_id = expected[5]
    outcomes = {}
    for async_scheduling in (False, True):
        engine = make_engine(tiny_model_dirs["llama"], num_kv_blocks=num_kv_blocks, async_scheduling=async_scheduling)
        outcomes[async_scheduling] = outcome(run(engine, mixed_requests(stop_id)))
        assert_pool_full(engine)
        if num_kv_blocks == 9:
            assert engine.load().num_preemptions_total > 0
    assert outcomes[True] == outcomes[False]
    stop_tokens, _, stop_finals = outcomes[True]["stop"]
    assert stop_tokens[0] == expected[: expected.index(stop_id) + 1]  # the token launched after it is dropped
    assert stop_finals[0][:2] == (FinishReason.STOP, stop_id)


def test_async_scheduling_overlaps_one_step(tiny_model_dirs):
    """A step's tokens come out of the next call to step(), whose batch already holds their
    sequences; a sequence whose in-flight token is its last is not scheduled again."""
    engine = make_engine(tiny_model_dirs["llama"])
    engine.add_request(request("r", make_prompt(10, seed=1), greedy(max_tokens=3)))
    assert engine.step() == []  # prompt launched; its first token is in flight
    seq = engine.scheduler.running[0]
    assert seq.has_placeholder and seq.num_tokens == 11
    assert [o.new_token_ids for o in engine.step()] == [[seq.token_ids[10]]]  # decode 1 launched
    assert [o.finish_reason for o in engine.step()] == [None]  # decode 2 launched: token 3 is the last
    assert seq.is_finishing and seq.has_placeholder
    final = engine.step()  # nothing left to launch: only processes
    assert [o.finish_reason for o in final] == [FinishReason.LENGTH] and final[0].num_completion_tokens == 3
    assert_pool_full(engine)


def test_given_weights_and_step_stats(tiny_model_dirs, oracle):
    """TorchEngineCore(weights=...) serves (HF name, tensor) pairs instead of the safetensors
    files; step_stats gets one record per step() call: the batch it launched and host times."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    log = StepStatsLog()
    config = EngineConfig(model_path=tiny_model_dirs["llama"], model_name="tiny", num_kv_blocks=64)
    engine = TorchEngineCore(config, weights=hf_model.state_dict().items(), step_stats=log)
    prompt = make_prompt(12, seed=3)
    results = run(engine, [request("w", prompt, greedy(max_tokens=4))])
    expected, _ = oracle.generate("llama", prompt)
    assert results["w"].token_ids[0] == expected[:4]
    # prompt + 3 decodes launched; the 4th token was a placeholder and ended it: a last call only processes
    assert [(stats.num_seqs, stats.num_tokens) for stats in log.steps] == [(1, 12), (1, 1), (1, 1), (1, 1), (0, 0)]
    assert all(stats.result_wait_s > 0 for stats in log.steps[1:]) and log.steps[0].result_wait_s == 0
    assert all(stats.step_s >= stats.schedule_s + stats.execute_launch_s + stats.sampler_launch_s > 0
               for stats in log.steps[:4])
    assert all(stats.gpu_busy_ms() == 0.0 for stats in log.steps)  # no CUDA events asked for


# --- quantized weights -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_engine_runs_every_layer_quantized(tiny_model_dirs, oracle, method):
    """The engine serves with quantized linears (the CPU reference of each format) and frees
    everything; its first greedy tokens are transformers' fp32 ones on this model (the
    quantization error, ~1-10% of the logits here, stays below the top-2 margins)."""
    from llmserve.inference.models.quantization import QuantizedLinear

    engine = make_engine(tiny_model_dirs["llama"], quantization=method)
    layers = engine.runner.model.model.layers
    quantized = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                 layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(isinstance(m, QuantizedLinear) for m in quantized) and len(quantized) == 4 * len(layers)
    prompts = [make_prompt(n, seed=300 + n) for n in (9, 23)]
    results = run(engine, [request(f"q{i}", p, greedy(max_tokens=6)) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        expected, _ = oracle.generate("llama", prompt)
        assert results[f"q{i}"].token_ids[0][:2] == expected[:2]
        assert len(results[f"q{i}"].token_ids[0]) == 6
    assert_pool_full(engine)
