"""Proto ↔ internal conversions and edge validation of sampling parameters."""

from __future__ import annotations

import pytest

from llmserve.errors import InvalidArgument
from llmserve.pb import (
    MAX_LOGPROBS,
    chat_from_pb,
    chat_to_pb,
    finish_reason_from_pb,
    finish_reason_to_pb,
    logprobs_from_pb,
    logprobs_to_pb,
    sampling_from_pb,
    sampling_to_pb,
)
from llmserve.response_format import MAX_SCHEMA_BYTES
from llmserve.sampling import ChatMessage, FinishReason, ResponseFormat, SamplingParams, TokenLogprob, TopLogprob
from llmserve.v1 import common_pb2


def test_unset_fields_take_server_defaults_not_proto_zeros():
    params = sampling_from_pb(common_pb2.SamplingParams())
    assert params == SamplingParams(max_tokens=None)  # unset: preprocess resolves it
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.repetition_penalty == 1.0
    assert params.seed is None and params.logprobs is None and params.n == 1


def test_explicit_zeros_are_kept():
    pb = common_pb2.SamplingParams(temperature=0.0, seed=0, logprobs=0, top_k=0)
    params = sampling_from_pb(pb)
    assert params.temperature == 0.0 and params.is_greedy
    assert params.seed == 0 and params.logprobs == 0


def _schema_format(schema: str, name: str = "") -> common_pb2.ResponseFormat:
    return common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(name=name, schema=schema))


def test_sampling_round_trip():
    params = SamplingParams(
        max_tokens=9, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=123,
        stop=("END", "\n\n"), stop_token_ids=(2, 7), ignore_eos=True, min_tokens=3,
        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, logprobs=3, n=2,
    )
    back = sampling_from_pb(sampling_to_pb(params))
    assert back.max_tokens == 9 and back.stop == ("END", "\n\n") and back.seed == 123
    assert back.n == 2 and back.logprobs == 3 and back.ignore_eos and back.top_k == 40
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert getattr(back, name) == pytest.approx(getattr(params, name), rel=1e-6)
    assert back.response_format is None


@pytest.mark.parametrize("response_format", [ResponseFormat(), ResponseFormat(json_schema='{"type": "object"}', name="thing-1")])
def test_a_response_format_round_trips(response_format):
    params = SamplingParams(max_tokens=9, response_format=response_format)
    assert sampling_from_pb(sampling_to_pb(params)) == params


@pytest.mark.parametrize(
    "pb, field, fragment",
    [
        (common_pb2.SamplingParams(max_tokens=0), "sampling.max_tokens", "at least 1, got 0"),
        (common_pb2.SamplingParams(temperature=-1), "sampling.temperature", "[0, 100], got -1"),
        (common_pb2.SamplingParams(top_p=0), "sampling.top_p", "(0, 1], got 0"),
        (common_pb2.SamplingParams(top_p=1.5), "sampling.top_p", "(0, 1], got 1.5"),
        (common_pb2.SamplingParams(min_p=2), "sampling.min_p", "[0, 1], got 2"),
        (common_pb2.SamplingParams(repetition_penalty=0), "sampling.repetition_penalty", "(0, 10], got 0"),
        (common_pb2.SamplingParams(presence_penalty=3), "sampling.presence_penalty", "[-2, 2], got 3"),
        (common_pb2.SamplingParams(frequency_penalty=float("nan")), "sampling.frequency_penalty", "got nan"),
        (common_pb2.SamplingParams(logprobs=MAX_LOGPROBS + 1), "sampling.logprobs", f"at most {MAX_LOGPROBS}"),
        (common_pb2.SamplingParams(n=0), "sampling.n", "got 0"),
        (common_pb2.SamplingParams(stop=[""]), "sampling.stop[0]", "1 to 256 characters, got 0"),
        (common_pb2.SamplingParams(stop=["x"] * 17), "sampling.stop", "at most 16 strings, got 17"),
        (common_pb2.SamplingParams(response_format=common_pb2.ResponseFormat()), "sampling.response_format", "json_object or json_schema"),
        (common_pb2.SamplingParams(response_format=_schema_format("{nope")), "sampling.response_format.json_schema.schema", "not valid JSON"),
        (common_pb2.SamplingParams(response_format=_schema_format("[]")), "sampling.response_format.json_schema.schema", "got list"),
        (common_pb2.SamplingParams(response_format=_schema_format("[" * 5000)), "sampling.response_format.json_schema.schema", "nested too deeply"),
        (common_pb2.SamplingParams(response_format=_schema_format(" " * (MAX_SCHEMA_BYTES + 1))),
         "sampling.response_format.json_schema.schema", f"{MAX_SCHEMA_BYTES + 1} bytes exceeds the limit of {MAX_SCHEMA_BYTES}"),
        (common_pb2.SamplingParams(response_format=_schema_format("{}", name="x" * 65)), "sampling.response_format.json_schema.name", "'xxxx"),
        (common_pb2.SamplingParams(min_tokens=1, response_format=common_pb2.ResponseFormat(json_object=common_pb2.JsonObjectFormat())),
         "sampling.min_tokens", "cannot be combined with response_format"),
    ],
)
def test_invalid_sampling_names_field_and_limit(pb, field, fragment):
    with pytest.raises(InvalidArgument) as info:
        sampling_from_pb(pb)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert fragment in str(info.value)


def test_finish_reason_mapping_is_total_and_reversible():
    wire_reasons = [reason for reason in FinishReason if reason is not FinishReason.DEADLINE]
    for reason in (None, *wire_reasons):
        assert finish_reason_from_pb(finish_reason_to_pb(reason)) is reason
    assert finish_reason_to_pb(None) == common_pb2.FINISH_REASON_UNSPECIFIED


def test_a_deadline_is_never_a_wire_finish_reason():
    with pytest.raises(ValueError, match="DEADLINE_EXCEEDED"):
        finish_reason_to_pb(FinishReason.DEADLINE)


def test_chat_and_logprobs_round_trip():
    chat = [ChatMessage("system", "be brief"), ChatMessage("user", "héllo 🙂")]
    assert chat_from_pb(chat_to_pb(chat)) == chat
    items = [TokenLogprob(5, -0.25, (TopLogprob(5, -0.25), TopLogprob(9, -1.5))), TokenLogprob(7, -2.0)]
    assert logprobs_from_pb(logprobs_to_pb(items)) == items
