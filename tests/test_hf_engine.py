"""HFEngineCore against transformers itself, on the tiny real Llama checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.hf_engine import HFEngineCore
from llmserve.engine_output import EngineOutput
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import FinishReason
from tests.engine_objects import PROMPT, make_request


def run(core: HFEngineCore, *requests: EngineRequest) -> list[EngineOutput]:
    for request in requests:
        core.add_request(request)
    outputs = []
    while core.has_requests_in_flight():
        outputs += core.step()
    return outputs


def tokens(outputs: list[EngineOutput], request_id: str = "r", sequence_index: int = 0) -> list[int]:
    return [
        t for o in outputs if o.request_id == request_id and o.sequence_index == sequence_index for t in o.new_token_ids
    ]


def final(outputs: list[EngineOutput], request_id: str = "r", sequence_index: int = 0) -> EngineOutput:
    [last] = [o for o in outputs if o.request_id == request_id and o.sequence_index == sequence_index and o.is_finished]
    return last


def hf_config(model_dir: Path, **overrides) -> EngineConfig:
    return EngineConfig(model_path=model_dir, model_name="tiny", backend="hf", **overrides)


@pytest.fixture(scope="module")
def core(tiny_model_dir) -> HFEngineCore:
    return HFEngineCore(hf_config(tiny_model_dir))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def first_greedy_token(core) -> int:
    return tokens(run(core, make_request(temperature=0.0, max_tokens=1)))[0]


def test_model_info(core, tiny_model_dir):
    info = core.model_info
    assert (info.model_name, info.architecture, info.backend, info.device, info.dtype) == (
        "tiny", "LlamaForCausalLM", "hf", "cpu", "float32",
    )
    assert info.max_context_tokens == 256
    assert info.vocab_size == json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    assert info.eos_token_ids == (2,)


def test_greedy_matches_transformers_generate(core, hf_model):
    # min_tokens / min_new_tokens mask EOS identically on both sides, so 32 tokens come out.
    outputs = run(core, make_request(temperature=0.0, max_tokens=32, min_tokens=32))
    expected = hf_model.generate(
        torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False
    )[0, len(PROMPT):].tolist()
    assert tokens(outputs) == expected
    assert len(outputs) == 32  # one output per token
    last = final(outputs)
    assert (last.finish_reason, last.num_prompt_tokens, last.num_completion_tokens) == (FinishReason.LENGTH, 8, 32)


def test_repetition_penalty_matches_transformers_generate(core, hf_model):
    outputs = run(core, make_request(temperature=0.0, max_tokens=24, min_tokens=24, repetition_penalty=1.3))
    expected = hf_model.generate(
        torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24, do_sample=False, repetition_penalty=1.3
    )[0, len(PROMPT):].tolist()
    assert tokens(outputs) == expected


def test_logprobs_equal_log_softmax_of_transformers_logits(core, hf_model):
    outputs = run(core, make_request(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5))
    generated = tokens(outputs)
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + generated])).logits[0].float()
    expected = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)  # [8, vocab]
    reported = [lp for o in outputs for lp in o.logprobs]
    assert [lp.token_id for lp in reported] == generated
    for position, lp in enumerate(reported):
        assert lp.logprob == pytest.approx(expected[position, lp.token_id].item(), abs=1e-4)
        top_values, top_ids = torch.topk(expected[position], 5)
        assert [t.token_id for t in lp.top_logprobs] == top_ids.tolist()
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert lp.top_logprobs[0].token_id == lp.token_id  # greedy picks the most likely


def test_logprobs_zero_gives_only_the_chosen_token(core):
    outputs = run(core, make_request(temperature=0.0, max_tokens=3, logprobs=0))
    assert all(len(o.logprobs) == 1 and o.logprobs[0].top_logprobs == () for o in outputs)


def test_no_logprobs_unless_asked(core):
    assert all(o.logprobs is None for o in run(core, make_request(temperature=0.0, max_tokens=3)))


def test_seeded_sampling_is_reproducible(core):
    sampling = dict(temperature=0.9, top_p=0.95, top_k=100, max_tokens=16, ignore_eos=True)
    first = tokens(run(core, make_request(seed=1234, **sampling)))
    second = tokens(run(core, make_request(seed=1234, **sampling)))
    other = tokens(run(core, make_request(seed=4321, **sampling)))
    assert first == second
    assert first != other


def test_unseeded_requests_follow_the_engine_seed(tiny_model_dir):
    sampling = dict(temperature=1.0, max_tokens=12, ignore_eos=True)

    def two_unseeded(core):
        outputs = run(core, make_request("a", **sampling), make_request("b", **sampling))
        return tokens(outputs, "a"), tokens(outputs, "b")

    a1, b1 = two_unseeded(HFEngineCore(hf_config(tiny_model_dir, seed=7)))
    a2, b2 = two_unseeded(HFEngineCore(hf_config(tiny_model_dir, seed=7)))
    assert (a1, b1) == (a2, b2)
    assert a1 != b1  # seed + counter: each request its own stream


@pytest.mark.parametrize("truncation", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_truncation_to_one_token_equals_greedy(core, truncation):
    greedy = tokens(run(core, make_request(temperature=0.0, max_tokens=12, ignore_eos=True)))
    sampled = tokens(run(core, make_request(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, **truncation)))
    assert sampled == greedy


def test_frequency_and_presence_penalties_follow_their_definition(core, hf_model):
    frequency, presence = 0.7, 0.4
    outputs = run(core, make_request(
        temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=frequency, presence_penalty=presence,
    ))
    expected: list[int] = []
    with torch.no_grad():
        for _ in range(12):
            logits = hf_model(torch.tensor([PROMPT + expected])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(expected, dtype=torch.long), minlength=logits.shape[0]).float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            expected.append(int(torch.argmax(logits)))
    assert tokens(outputs) == expected


def test_stop_token_id_stops_with_stop(core, first_greedy_token):
    outputs = run(core, make_request(temperature=0.0, stop_token_ids=(first_greedy_token,)))
    assert tokens(outputs) == [first_greedy_token]
    last = final(outputs)
    assert (last.finish_reason, last.stop_token_id, last.num_completion_tokens) == (
        FinishReason.STOP, first_greedy_token, 1,
    )


@pytest.mark.parametrize("min_tokens", [1, 3])
def test_min_tokens_defers_stop_tokens_as_transformers_does(core, hf_model, first_greedy_token, min_tokens):
    stop_ids = (first_greedy_token,)
    outputs = run(core, make_request(temperature=0.0, max_tokens=40, min_tokens=min_tokens, stop_token_ids=stop_ids))
    # transformers masks eos_token_id for the first min_new_tokens tokens and stops on it after.
    expected = hf_model.generate(
        torch.tensor([PROMPT]), max_new_tokens=40, min_new_tokens=min_tokens, do_sample=False,
        eos_token_id=[*stop_ids, *core.model_info.eos_token_ids], pad_token_id=0,
    )[0, len(PROMPT):].tolist()
    generated = tokens(outputs)
    assert generated == expected
    assert first_greedy_token not in generated[:min_tokens]
    last = final(outputs)
    if generated[-1] in stop_ids:
        assert last.finish_reason is FinishReason.STOP
    else:
        assert (last.finish_reason, len(generated)) == (FinishReason.LENGTH, 40)


def test_max_tokens_gives_length(core):
    outputs = run(core, make_request(temperature=0.0, max_tokens=5, ignore_eos=True))
    last = final(outputs)
    assert (len(tokens(outputs)), last.finish_reason, last.stop_token_id) == (5, FinishReason.LENGTH, None)
    assert last.total_time_ns >= last.time_to_first_token_ns >= last.queue_time_ns >= 0


def test_context_limit_gives_length(tiny_model_dir):
    core = HFEngineCore(hf_config(tiny_model_dir, max_context_tokens=len(PROMPT) + 4))
    assert core.model_info.max_context_tokens == len(PROMPT) + 4
    outputs = run(core, make_request(temperature=0.0, max_tokens=100, ignore_eos=True))
    assert (len(tokens(outputs)), final(outputs).finish_reason) == (4, FinishReason.LENGTH)


@pytest.fixture(scope="module")
def eos_model_dir(tiny_model_dir, first_greedy_token, tmp_path_factory) -> Path:
    """The tiny checkpoint with its EOS id set to the first token greedy decoding produces."""
    out = tmp_path_factory.mktemp("tiny-eos")
    for path in tiny_model_dir.iterdir():
        shutil.copy(path, out / path.name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [first_greedy_token]}))
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = None  # keep ModelFiles from adding <|im_end|> back
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return out


def test_eos_stops_unless_ignore_eos(eos_model_dir, first_greedy_token):
    core = HFEngineCore(hf_config(eos_model_dir))
    assert core.model_info.eos_token_ids == (first_greedy_token,)
    stopped = run(core, make_request(temperature=0.0, max_tokens=6))
    assert tokens(stopped) == [first_greedy_token]
    assert (final(stopped).finish_reason, final(stopped).stop_token_id) == (FinishReason.STOP, first_greedy_token)
    ignored = run(core, make_request(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert tokens(ignored)[0] == first_greedy_token
    assert (len(tokens(ignored)), final(ignored).finish_reason) == (6, FinishReason.LENGTH)


def test_n_sequences_run_one_after_another(core):
    outputs = run(core, make_request(temperature=1.0, seed=11, n=3, max_tokens=4, ignore_eos=True))
    assert [o.sequence_index for o in outputs] == [0] * 4 + [1] * 4 + [2] * 4
    assert [final(outputs, sequence_index=i).num_completion_tokens for i in range(3)] == [4, 4, 4]
    # The request's one random stream continues across its sequences: they differ.
    assert len({tuple(tokens(outputs, sequence_index=i)) for i in range(3)}) == 3


def test_abort_running_and_waiting_requests(tiny_model_dir):
    core = HFEngineCore(hf_config(tiny_model_dir))
    for request_id in ("a", "b", "c"):
        core.add_request(make_request(request_id, temperature=0.0, max_tokens=8, ignore_eos=True))
    [first] = core.step()
    assert first.request_id == "a"
    load = core.load()
    assert (load.num_running, load.num_waiting, load.kv_blocks_total, load.kv_blocks_used) == (1, 2, 0, 0)
    assert core.abort_request("a") is True
    assert core.abort_request("c") is True
    assert core.abort_request("a") is False  # idempotent
    assert core.abort_request("unknown") is False
    outputs = []
    while core.has_requests_in_flight():
        outputs += core.step()
    assert {o.request_id for o in outputs} == {"b"}
    load = core.load()
    assert (load.num_running, load.num_waiting) == (0, 0)
