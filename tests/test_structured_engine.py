"""Structured outputs in the torch engine (engine/grammar.py): grammar-constrained decoding on a
tiny random model. Outputs parse and validate against their schema (jsonschema); the
unconstrained sequences of the same steps come out token for token as they do alone; preemption,
async scheduling, n > 1 and seeded sampling keep every output valid; compiled grammars are cached.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from llmserve.inference.engine.sampler import Sampler  # noqa: E402
from llmserve.inference.engine.torch_engine import TorchEngineCore  # noqa: E402
from llmserve.sampling import FinishReason, ResponseFormat, SamplingParams  # noqa: E402
from tests.test_torch_engine import assert_pool_full, greedy, make_engine, make_prompt, request, run  # noqa: E402

# Bounded strings and numbers: a random model inside an unbounded string could write it until
# max_tokens, so every field here has an end the grammar forces.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tier": {"type": "string", "enum": ["gold", "silver", "bronze"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "tier", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = ResponseFormat(json_schema=json.dumps(SCHEMA), name="person")
MAX_TOKENS = 120  # far more than any document of SCHEMA takes in the tiny tokenizer


def constrained(response_format: ResponseFormat = JSON_SCHEMA, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=MAX_TOKENS, response_format=response_format, **kwargs)


def assert_valid(engine: TorchEngineCore, token_ids: list[int], schema: dict = SCHEMA) -> dict:
    text = engine_tokenizer(engine).decode(token_ids, skip_special_tokens=True)
    document = json.loads(text)
    jsonschema.validate(document, schema)
    return document


def engine_tokenizer(engine: TorchEngineCore):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(engine.config.model_path / "tokenizer.json"))


def test_json_schema_outputs_validate_and_free_text_beside_them_is_unchanged(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    free = [request(f"free{i}", make_prompt(9 + i, seed=i), greedy(24)) for i in range(2)]
    alone = run(make_engine(model_dir), free)
    engine = make_engine(model_dir)
    structured = [request(f"json{i}", make_prompt(7 + 3 * i, seed=50 + i), constrained()) for i in range(4)]
    together = run(engine, [*structured[:2], *free, *structured[2:]])
    for i in range(2):  # the same tokens and logprobs as without constrained rows in their steps
        assert together[f"free{i}"].token_ids == alone[f"free{i}"].token_ids
        assert together[f"free{i}"].logprobs[0] == pytest.approx(alone[f"free{i}"].logprobs[0], abs=1e-5)
    documents = []
    for i in range(4):
        result = together[f"json{i}"]
        assert result.finals[0].finish_reason is FinishReason.STOP and result.finals[0].stop_token_id is None
        documents.append(assert_valid(engine, result.token_ids[0]))
    assert len({json.dumps(d) for d in documents}) > 1  # the model chose, within the grammar
    stats = engine.grammar_stats()
    assert (stats.num_compiled, stats.num_cache_hits) == (1, 3)  # one schema: compiled once
    assert_pool_full(engine)


class PreferringSampler(Sampler):
    """The tiny random model with a taste for closing quotes and braces (a bias on two tokens'
    logits): any-JSON-object decoding then ends, where the random model alone may write one
    string until max_tokens. The grammar is applied to these logits as to a model's own."""

    def __init__(self, eos_token_ids, bias: dict[int, float]):
        super().__init__(eos_token_ids)
        self._bias = bias

    def launch(self, logits, seqs):
        biased = logits.clone()
        for token_id, value in self._bias.items():
            biased[:, token_id] += value
        return super().launch(biased, seqs)


def test_json_object_output_is_a_json_object(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    engine = make_engine(model_dir)
    token_id = engine_tokenizer(engine).convert_tokens_to_ids
    engine.sampler = PreferringSampler(engine.sampler.eos_token_ids, {token_id('"'): 4.0, token_id("}"): 2.0})
    results = run(engine, [request(f"r{i}", make_prompt(10, seed=70 + i), constrained(ResponseFormat())) for i in range(3)])
    for result in results.values():
        assert result.finals[0].finish_reason is FinishReason.STOP
        assert isinstance(assert_valid(engine, result.token_ids[0], {"type": "object"}), dict)
    assert_pool_full(engine)


@pytest.mark.parametrize("num_kv_blocks", [64, 9])  # 9: preemption while tokens are in flight
def test_preemption_and_async_scheduling_change_no_structured_output(tiny_model_dirs, num_kv_blocks):
    model_dir = tiny_model_dirs["llama"]
    requests = lambda: [  # noqa: E731
        request("greedy", make_prompt(20, seed=1), constrained()),
        request("seeded", make_prompt(14, seed=2), constrained(temperature=1.0, top_p=0.9, seed=7)),
        request("pair", make_prompt(18, seed=3), constrained(n=2, temperature=0.8, seed=11)),
        request("free", make_prompt(9, seed=4), greedy(40)),
    ]
    outcomes = {}
    for async_scheduling in (False, True):
        engine = make_engine(model_dir, num_kv_blocks=num_kv_blocks, async_scheduling=async_scheduling)
        results = run(engine, requests())
        outcomes[async_scheduling] = {rid: r.token_ids for rid, r in results.items()}
        if num_kv_blocks == 9:
            assert engine.load().num_preemptions_total > 0
        for rid in ("greedy", "seeded", "pair"):
            for index, token_ids in results[rid].token_ids.items():
                assert results[rid].finals[index].finish_reason is FinishReason.STOP
                assert_valid(engine, token_ids)
        assert_pool_full(engine)
    assert outcomes[True] == outcomes[False]
    assert outcomes[True]["pair"][0] != outcomes[True]["pair"][1]


def test_the_grammar_ends_the_sequence_whatever_ignore_eos_says(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs["llama"])
    results = run(engine, [request("r", make_prompt(12, seed=5), constrained(ignore_eos=True))])
    assert results["r"].finals[0].finish_reason is FinishReason.STOP
    assert_valid(engine, results["r"].token_ids[0])


def test_max_tokens_cuts_a_structured_output_with_length(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs["llama"])
    results = run(engine, [request("r", make_prompt(12, seed=5), SamplingParams(max_tokens=3, temperature=0.0, response_format=JSON_SCHEMA))])
    assert results["r"].finals[0].finish_reason is FinishReason.LENGTH and len(results["r"].token_ids[0]) == 3
    assert_pool_full(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_structured_outputs_on_cuda_match_the_cpu(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    structured = lambda: [request(f"r{i}", make_prompt(8 + i, seed=90 + i), constrained()) for i in range(3)]  # noqa: E731
    cpu = run(make_engine(model_dir), structured())
    engine = make_engine(model_dir, device="cuda", dtype="float32")
    cuda = run(engine, structured())
    for rid, result in cuda.items():
        assert_valid(engine, result.token_ids[0])
        assert result.token_ids == cpu[rid].token_ids
    assert_pool_full(engine)


def test_a_replica_refuses_a_response_format_it_cannot_decode(tiny_model_dirs, monkeypatch):
    """At the inference edge (wire.request_from_pb): trtllm, or no grammar library, is
    INVALID_ARGUMENT naming sampling.response_format, before the engine sees it."""
    import dataclasses

    from llmserve import pb, response_format
    from llmserve.errors import InvalidArgument
    from llmserve.inference import wire
    from llmserve.v1 import inference_pb2

    info = make_engine(tiny_model_dirs["llama"]).model_info
    sampling = SamplingParams(max_tokens=4, response_format=ResponseFormat())
    pb_request = inference_pb2.GenerateTokensRequest(request_id="r", prompt_token_ids=[5, 6], sampling=pb.sampling_to_pb(sampling))
    assert wire.request_from_pb(pb_request, info, arrival_ns=0).sampling == sampling
    with pytest.raises(InvalidArgument, match="^sampling.response_format: structured outputs need the torch or hf backend; this replica runs trtllm"):
        wire.request_from_pb(pb_request, dataclasses.replace(info, backend="trtllm"), arrival_ns=0)
    monkeypatch.setattr(response_format, "_grammar_library", lambda: None)
    with pytest.raises(InvalidArgument, match=r"^sampling.response_format: .*pip install 'llmserve\[structured\]'"):
        wire.request_from_pb(pb_request, info, arrival_ns=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_hf_backend_decodes_the_same_structured_outputs(arch, tiny_model_dirs):
    """The oracle: transformers' model under the same sampler and grammar gives the same tokens."""
    from llmserve.inference.engine.config import EngineConfig
    from llmserve.inference.engine.hf_engine import HFEngineCore

    model_dir = tiny_model_dirs[arch]
    structured = lambda: [  # noqa: E731
        request("greedy", make_prompt(11, seed=21), constrained()),
        request("seeded", make_prompt(13, seed=22), constrained(temperature=0.8, seed=5)),
    ]
    ours = run(make_engine(model_dir), structured())
    hf = HFEngineCore(EngineConfig(model_path=model_dir, model_name="tiny", backend="hf"))
    theirs = run(hf, structured())
    assert {rid: r.token_ids for rid, r in theirs.items()} == {rid: r.token_ids for rid, r in ours.items()}
    for result in theirs.values():
        for index, token_ids in result.token_ids.items():
            assert result.finals[index].finish_reason is FinishReason.STOP
            assert_valid(make_engine(model_dir), token_ids)
