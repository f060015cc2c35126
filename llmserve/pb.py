"""Conversions between protobuf messages and internal types, with edge validation.

Protobuf objects stop at the servicers: they call these functions and hand internal dataclasses
to the rest of the code. Validation errors name the field and the limit.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

from llmserve.block_hash import HashNamespace
from llmserve.engine_output import EngineOutput
from llmserve.errors import InvalidArgument
from llmserve.prompt_ids_region import RegionIds, SharedMemoryScope
from llmserve.prompt_input import Chat, PromptInput, PromptTokenIds
from llmserve.response_format import FIELD as RESPONSE_FORMAT_FIELD
from llmserve.response_format import check_response_format
from llmserve.sampling import ChatMessage, FinishReason, ResponseFormat, SamplingParams, TokenLogprob, TopLogprob
from llmserve.v1 import common_pb2, inference_pb2

# Call metadata a Multiplex client sends to get plain tokens as a message's TokenColumns
# (inference.proto; the inference server's multiplex.py, the gateway's replica_stream.py).
MULTIPLEX_COLUMNS_METADATA = ("llmserve-multiplex-columns", "1")

MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64

_FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


def finish_reason_to_pb(reason: FinishReason | None) -> int:
    if reason is FinishReason.DEADLINE:
        # A deadline ends the RPC with DEADLINE_EXCEEDED (inference.wire.split_at_deadline):
        # reaching here means a caller skipped that split, which a client must never see as OK.
        raise ValueError("FinishReason.DEADLINE is sent as the DEADLINE_EXCEEDED status, not as a finish reason")
    return _FINISH_TO_PB[reason]


def finish_reason_from_pb(value: int) -> FinishReason | None:
    return _FINISH_FROM_PB.get(value)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not math.isfinite(value) or not (low <= value <= high):
        raise InvalidArgument(f"sampling.{name}", f"must be in [{low:g}, {high:g}], got {value:g}")


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Validate and resolve defaults; max_tokens stays None when unset (preprocess resolves it)."""
    if pb.HasField("max_tokens") and pb.max_tokens < 1:
        raise InvalidArgument("sampling.max_tokens", f"must be at least 1, got {pb.max_tokens}")
    max_tokens = pb.max_tokens if pb.HasField("max_tokens") else None
    temperature = pb.temperature if pb.HasField("temperature") else 1.0
    _check_range("temperature", temperature, 0.0, 100.0)
    top_p = pb.top_p if pb.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not (0.0 < top_p <= 1.0):
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {top_p:g}")
    min_p = pb.min_p if pb.HasField("min_p") else 0.0
    _check_range("min_p", min_p, 0.0, 1.0)
    repetition_penalty = pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0
    if not math.isfinite(repetition_penalty) or not (0.0 < repetition_penalty <= 10.0):
        raise InvalidArgument(
            "sampling.repetition_penalty", f"must be in (0, 10], got {repetition_penalty:g}"
        )
    presence_penalty = pb.presence_penalty if pb.HasField("presence_penalty") else 0.0
    _check_range("presence_penalty", presence_penalty, -2.0, 2.0)
    frequency_penalty = pb.frequency_penalty if pb.HasField("frequency_penalty") else 0.0
    _check_range("frequency_penalty", frequency_penalty, -2.0, 2.0)
    if pb.HasField("logprobs") and pb.logprobs > MAX_LOGPROBS:
        raise InvalidArgument("sampling.logprobs", f"at most {MAX_LOGPROBS}, got {pb.logprobs}")
    n = pb.n if pb.HasField("n") else 1
    if not (1 <= n <= MAX_N):
        raise InvalidArgument("sampling.n", f"must be in [1, {MAX_N}], got {n}")
    if len(pb.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("sampling.stop", f"at most {MAX_STOP_STRINGS} strings, got {len(pb.stop)}")
    for i, s in enumerate(pb.stop):
        if not s or len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(
                f"sampling.stop[{i}]", f"must be 1 to {MAX_STOP_STRING_CHARS} characters, got {len(s)}"
            )
    if len(pb.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            "sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}, got {len(pb.stop_token_ids)}"
        )
    min_tokens = pb.min_tokens if pb.HasField("min_tokens") else 0
    check_min_tokens(min_tokens, max_tokens)
    response_format = response_format_from_pb(pb.response_format) if pb.HasField("response_format") else None
    if response_format is not None and min_tokens:
        raise InvalidArgument(
            "sampling.min_tokens", "cannot be combined with response_format: the grammar decides where the output ends"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=pb.top_k if pb.HasField("top_k") else 0,
        min_p=min_p,
        seed=pb.seed if pb.HasField("seed") else None,
        stop=tuple(pb.stop),
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        min_tokens=min_tokens,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        n=n,
        response_format=response_format,
    )


def response_format_from_pb(pb: common_pb2.ResponseFormat) -> ResponseFormat:
    """Validated (llmserve.response_format.check_response_format)."""
    which = pb.WhichOneof("format")
    if which is None:
        raise InvalidArgument(RESPONSE_FORMAT_FIELD, "set json_object or json_schema (or leave response_format unset for text)")
    if which == "json_object":
        response_format = ResponseFormat()
    else:
        response_format = ResponseFormat(json_schema=pb.json_schema.schema, name=pb.json_schema.name)
    check_response_format(response_format)
    return response_format


def response_format_to_pb(response_format: ResponseFormat) -> common_pb2.ResponseFormat:
    if response_format.json_schema is None:
        return common_pb2.ResponseFormat(json_object=common_pb2.JsonObjectFormat())
    return common_pb2.ResponseFormat(
        json_schema=common_pb2.JsonSchemaFormat(name=response_format.name, schema=response_format.json_schema)
    )


def check_min_tokens(min_tokens: int, max_tokens: int | None) -> None:
    """min_tokens can be met only within max_tokens (it would be cut to it in silence). When
    max_tokens is not set, preprocess resolves it and inference checks against what it
    resolved to (the gateway checks it against the context first)."""
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidArgument(
            "sampling.min_tokens", f"{min_tokens} exceeds max_tokens {max_tokens}; must be at most max_tokens"
        )


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        n=params.n,
    )
    if params.max_tokens is not None:
        pb.max_tokens = params.max_tokens
    if params.seed is not None:
        pb.seed = params.seed
    if params.logprobs is not None:
        pb.logprobs = params.logprobs
    if params.response_format is not None:
        pb.response_format.CopyFrom(response_format_to_pb(params.response_format))
    return pb


class ServedModel(Protocol):
    """What both services know of the model they serve: inference's ModelInfo, preprocess's
    PreprocessInfo."""

    @property
    def model_name(self) -> str: ...
    @property
    def max_context_tokens(self) -> int: ...
    @property
    def eos_token_ids(self) -> Sequence[int]: ...
    @property
    def block_size_tokens(self) -> int: ...
    @property
    def hash_namespace(self) -> HashNamespace: ...


def model_info_to_pb(model: ServedModel, block_hash_version: int, **service_fields) -> common_pb2.ModelInfo:
    """The ModelInfo both services report (GetModelInfo, GetPreprocessInfo): the model, its
    context, and the block layout its prefix hashes are cut and namespaced by, which the gateway
    checks agree across the two; `service_fields` are the ModelInfo fields only one service sets."""
    namespace = model.hash_namespace
    return common_pb2.ModelInfo(
        model_name=model.model_name,
        max_context_tokens=model.max_context_tokens,
        eos_token_ids=list(model.eos_token_ids),
        block_size_tokens=model.block_size_tokens,
        block_hash_version=block_hash_version,
        model_fingerprint=namespace.model_fingerprint,
        tokenizer_fingerprint=namespace.tokenizer_fingerprint,
        **service_fields,
    )


def chat_from_pb(messages) -> list[ChatMessage]:
    return [ChatMessage(role=m.role, content=m.content) for m in messages]


def chat_to_pb(messages: list[ChatMessage]) -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(role=m.role, content=m.content) for m in messages]


def logprobs_to_pb(items: list[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_logprobs=[common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top_logprobs],
        )
        for lp in items
    ]


def logprobs_from_pb(items) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_logprobs=tuple(TopLogprob(t.token_id, t.logprob) for t in lp.top_logprobs),
        )
        for lp in items
    ]


def output_to_pb(output: EngineOutput) -> inference_pb2.GenerateTokensResponse:
    """An inference output on the wire. A DEADLINE finish never gets here: the inference
    servicer ends such a request with its status instead (inference.wire.split_at_deadline)."""
    response = inference_pb2.GenerateTokensResponse(
        sequence_index=output.sequence_index,
        token_ids=output.new_token_ids,
        finish_reason=finish_reason_to_pb(output.finish_reason),
        error_message=output.error_message,
    )
    if output.logprobs:
        response.logprobs.extend(logprobs_to_pb(output.logprobs))
    if output.stop_token_id is not None:
        response.stop_token_id = output.stop_token_id
    if output.is_finished:
        response.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=output.num_prompt_tokens,
                completion_tokens=output.num_completion_tokens,
                cached_tokens=output.num_cached_tokens,
                pulled_tokens=output.num_pulled_tokens,
            )
        )
        response.timings.CopyFrom(
            common_pb2.Timings(
                queue_time_ns=output.queue_time_ns,
                time_to_first_token_ns=output.time_to_first_token_ns,
                total_time_ns=output.total_time_ns,
            )
        )
    return response


def output_from_pb(request_id: str, response: inference_pb2.GenerateTokensResponse) -> EngineOutput:
    """What the gateway reads of an inference output: tokens, logprobs, how it ended, and the
    usage and timings of the last one."""
    if not response.finish_reason and not response.logprobs:
        # The common case, a step's tokens mid-sequence: the rest is unset (read per token).
        return EngineOutput(request_id, response.sequence_index, list(response.token_ids))
    return EngineOutput(
        request_id=request_id,
        sequence_index=response.sequence_index,
        new_token_ids=list(response.token_ids),
        logprobs=logprobs_from_pb(response.logprobs) if response.logprobs else None,
        finish_reason=finish_reason_from_pb(response.finish_reason),
        stop_token_id=response.stop_token_id if response.HasField("stop_token_id") else None,
        error_message=response.error_message,
        num_prompt_tokens=response.usage.prompt_tokens,
        num_completion_tokens=response.usage.completion_tokens,
        num_cached_tokens=response.usage.cached_tokens,
        num_pulled_tokens=response.usage.pulled_tokens,
        queue_time_ns=response.timings.queue_time_ns,
        time_to_first_token_ns=response.timings.time_to_first_token_ns,
        total_time_ns=response.timings.total_time_ns,
    )


def prompt_input_from_pb(message, text_field: str = "prompt") -> PromptInput | None:
    """A request's `oneof input` (GenerateParams, PreprocessRequest, TokenizeRequest) as internal
    types: its text field, a Chat, token ids, or None when none is set."""
    which = message.WhichOneof("input")
    if which == text_field:
        return getattr(message, text_field)
    if which == "chat":
        chat = message.chat
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return Chat(tuple(chat_from_pb(chat.messages)), add_generation_prompt)
    if which == "prompt_token_ids":
        return PromptTokenIds(list(message.prompt_token_ids.token_ids))
    return None


def set_prompt_input_pb(message, prompt_input: PromptInput, text_field: str = "prompt") -> None:
    """Set `message`'s `oneof input` from `prompt_input` (the inverse of prompt_input_from_pb)."""
    if isinstance(prompt_input, Chat):
        message.chat.messages.extend(chat_to_pb(list(prompt_input.messages)))
        message.chat.add_generation_prompt = prompt_input.add_generation_prompt
    elif isinstance(prompt_input, PromptTokenIds):
        message.prompt_token_ids.token_ids.extend(prompt_input.token_ids)
    else:
        setattr(message, text_field, prompt_input)


def region_ids_to_pb(ref: RegionIds) -> common_pb2.PromptIdsInRegion:
    return common_pb2.PromptIdsInRegion(
        region_name=ref.region_name, offset_bytes=ref.offset_bytes, num_ids=ref.num_ids, key=ref.key,
        valid_for_ms=int(ref.valid_for_s * 1000),
    )


def region_ids_from_pb(pb: common_pb2.PromptIdsInRegion) -> RegionIds:
    return RegionIds(pb.region_name, pb.offset_bytes, pb.num_ids, pb.key, pb.valid_for_ms / 1000)


def scope_to_pb(scope: SharedMemoryScope) -> common_pb2.SharedMemoryScope:
    return common_pb2.SharedMemoryScope(boot_id=scope.boot_id, shm_device=scope.shm_device)


def scope_from_pb(pb: common_pb2.SharedMemoryScope) -> SharedMemoryScope:
    return SharedMemoryScope(pb.boot_id, pb.shm_device)
