"""Protobuf ↔ engine types for the inference service: validation at the edge included.

GenerateTokens and Multiplex both convert here, so a request is checked and an output encoded
the same way on either. A request whose deadline passed in the engine (FinishReason.DEADLINE)
ends with the DEADLINE_EXCEEDED status on either, as any RPC past its deadline does: no finish
reason on the wire means "deadline".
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from llmserve import pb, token_id_bytes
from llmserve.block_hash import HASH_VERSION
from llmserve.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from llmserve.block_hash import check_cache_salt
from llmserve.pb import region_ids_from_pb
from llmserve.prompt_ids_region import BadReference, EntryGone, shared_reader
from llmserve.request_context import check_request_id
from llmserve.response_format import FIELD as RESPONSE_FORMAT_FIELD
from llmserve.response_format import require_grammar_library
from llmserve.engine_output import EngineOutput
from llmserve.sampling import FinishReason, SamplingParams
from llmserve.inference import metrics
from llmserve.inference.engine.types import EngineRequest, ModelInfo
from llmserve.inference.kv_puller import KvPullHint
from llmserve.v1 import inference_pb2


def deadline_ns(pb_request: inference_pb2.GenerateTokensRequest, arrival_ns: int, call_time_remaining_s: float | None) -> int:
    """The request's deadline on time.monotonic_ns(): its timeout_ms, else the call's own
    deadline, else none (0)."""
    if pb_request.timeout_ms:
        return arrival_ns + pb_request.timeout_ms * 1_000_000
    if call_time_remaining_s is not None:
        return arrival_ns + max(1, int(call_time_remaining_s * 1e9))
    return 0


def request_from_pb(
    pb_request: inference_pb2.GenerateTokensRequest, info: ModelInfo, arrival_ns: int, deadline_ns: int = 0
) -> EngineRequest:
    """Validate a GenerateTokensRequest against the model and convert it.

    `arrival_ns` is time.monotonic_ns() (engines measure queue and first-token times from it);
    `deadline_ns` is on the same clock, 0 = none.
    """
    if not pb_request.request_id:
        raise InvalidArgument("request_id", "must not be empty")
    check_request_id(pb_request.request_id)
    check_cache_salt(pb_request.cache_salt)
    prompt_token_ids = _prompt_token_ids(pb_request, info)
    sampling = pb.sampling_from_pb(pb_request.sampling)  # min_tokens ≤ max_tokens among its checks
    _check_max_tokens(sampling.max_tokens, len(prompt_token_ids), info)
    _check_logprobs(sampling.logprobs, info)
    for i, token_id in enumerate(sampling.stop_token_ids):
        if token_id >= info.vocab_size:
            raise InvalidArgument(
                f"sampling.stop_token_ids[{i}]", f"token id {token_id} is not below the vocab size {info.vocab_size}"
            )
    _check_block_hashes(pb_request, len(prompt_token_ids), info)
    if sampling.response_format is not None:
        _check_structured_output(info)
    return EngineRequest(
        request_id=pb_request.request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        arrival_ns=arrival_ns,
        block_hashes=list(pb_request.block_hashes),
        block_size_tokens=pb_request.block_size_tokens,
        block_hash_version=pb_request.block_hash_version,
        cache_salt=pb_request.cache_salt,
        priority=pb_request.priority,
        deadline_ns=deadline_ns,
    )


def _prompt_token_ids(pb_request: inference_pb2.GenerateTokensRequest, info: ModelInfo) -> list[int]:
    """The prompt's ids, from whichever field carries them, checked against the model."""
    if pb_request.HasField("prompt_token_ids_in_region"):
        return _prompt_token_ids_in_region(pb_request, info)
    if not pb_request.prompt_token_id_bytes:
        metrics.PROMPTS_AS_TOKEN_IDS.inc()
        prompt_token_ids = list(pb_request.prompt_token_ids)
        _check_prompt("prompt_token_ids", prompt_token_ids, info)
        return prompt_token_ids
    metrics.PROMPTS_AS_TOKEN_ID_BYTES.inc()
    field = "prompt_token_id_bytes"
    if pb_request.prompt_token_ids:
        raise InvalidArgument(field, "set either it or prompt_token_ids, not both")
    token_id_bytes.check_length(pb_request.prompt_token_id_bytes, field)
    ids = token_id_bytes.as_array(pb_request.prompt_token_id_bytes)
    _check_prompt(field, ids, info)
    return ids.tolist()


def _prompt_token_ids_in_region(pb_request: inference_pb2.GenerateTokensRequest, info: ModelInfo) -> list[int]:
    """The ids copied out of preprocess's shared-memory ring (llmserve.prompt_ids_region)."""
    metrics.PROMPTS_IN_REGION.inc()
    field = "prompt_token_ids_in_region"
    if pb_request.prompt_token_ids or pb_request.prompt_token_id_bytes:
        raise InvalidArgument(field, "set either it, prompt_token_ids or prompt_token_id_bytes, not two")
    ref = region_ids_from_pb(pb_request.prompt_token_ids_in_region)
    _check_prompt_length(field, ref.num_ids, info)  # before any copy
    try:
        ids = shared_reader().read(ref)
    except BadReference as error:
        raise InvalidArgument(field, str(error)) from None
    except EntryGone as error:
        raise FailedPrecondition(f"{field}: {error} (its lease ran out before it was read)") from None
    _check_in_vocabulary(field, ids, info)
    return ids.tolist()


def _check_prompt(field: str, ids: Sequence[int] | np.ndarray, info: ModelInfo) -> None:
    _check_prompt_length(field, len(ids), info)
    _check_in_vocabulary(field, ids, info)


def _check_in_vocabulary(field: str, ids: Sequence[int] | np.ndarray, info: ModelInfo) -> None:
    largest = int(ids.max()) if isinstance(ids, np.ndarray) else max(ids)  # one C-speed pass
    if largest >= info.vocab_size:  # find the index only on error
        i = next(i for i, token_id in enumerate(ids) if token_id >= info.vocab_size)
        raise InvalidArgument(
            f"{field}[{i}]", f"token id {int(ids[i])} is not below the vocab size {info.vocab_size}"
        )


def _check_prompt_length(field: str, num_ids: int, info: ModelInfo) -> None:
    if not num_ids:
        raise InvalidArgument(field, "must not be empty")
    if num_ids >= info.max_context_tokens:
        raise InvalidArgument(
            field,
            f"{num_ids} tokens leave no room to generate: the context is "
            f"{info.max_context_tokens} tokens, so at most {info.max_context_tokens - 1}",
        )


def _check_max_tokens(max_tokens: int | None, num_prompt_tokens: int, info: ModelInfo) -> None:
    """An invariant, not a default: preprocess resolved max_tokens; a direct caller must set one
    that fits."""
    num_room_tokens = info.max_context_tokens - num_prompt_tokens
    if max_tokens is None:
        raise InvalidArgument(
            "sampling.max_tokens",
            f"must be set (preprocess resolves it for the prompt); at most {num_room_tokens} for this prompt",
        )
    if max_tokens > num_room_tokens:
        raise InvalidArgument(
            "sampling.max_tokens",
            f"{max_tokens} tokens do not fit: the prompt has {num_prompt_tokens} tokens "
            f"and the context is {info.max_context_tokens}, so at most {num_room_tokens}",
        )


def _check_logprobs(logprobs: int | None, info: ModelInfo) -> None:
    """More alternatives than the vocabulary has cannot be ranked (a small model's vocabulary
    may be below pb.MAX_LOGPROBS)."""
    if logprobs is not None and logprobs > info.vocab_size:
        raise InvalidArgument("sampling.logprobs", f"{logprobs} exceeds the vocab size {info.vocab_size}")


def _check_structured_output(info: ModelInfo) -> None:
    """Our engines (torch, and hf through the same sampler) constrain decoding, with the grammar
    library installed; TensorRT-LLM's is not ours."""
    if info.backend not in ("torch", "hf"):
        raise InvalidArgument(
            RESPONSE_FORMAT_FIELD, f"structured outputs need the torch or hf backend; this replica runs {info.backend}"
        )
    require_grammar_library()


def _check_block_hashes(
    pb_request: inference_pb2.GenerateTokensRequest | inference_pb2.PinKvBlocksRequest, num_prompt_tokens: int,
    info: ModelInfo,
) -> None:
    """Hashes are optional hints, but hashes cut or computed unlike this replica's would miss the
    prefix cache in silence, and more hashes than full blocks is a bug upstream."""
    num_hashes = len(pb_request.block_hashes)
    if not num_hashes:
        return
    block_size = pb_request.block_size_tokens
    if block_size != info.block_size_tokens:
        raise InvalidArgument(
            "block_size_tokens",
            f"must be this replica's block size of {info.block_size_tokens} tokens when block_hashes "
            f"are given, got {block_size}",
        )
    if pb_request.block_hash_version != HASH_VERSION:
        raise InvalidArgument(
            "block_hash_version",
            f"must be this replica's version {HASH_VERSION} when block_hashes are given, "
            f"got {pb_request.block_hash_version}",
        )
    num_full_blocks = num_prompt_tokens // block_size
    if num_hashes > num_full_blocks:
        raise InvalidArgument(
            "block_hashes",
            f"{num_hashes} hashes but the prompt has only {num_full_blocks} full blocks of {block_size} tokens",
        )


def split_at_deadline(output: EngineOutput) -> tuple[EngineOutput | None, DeadlineExceeded | None]:
    """The output as the wire carries it, and the status its request ends with when its
    deadline passed in the engine (the tokens that came with that final output, if any, go
    first, as an output of their own)."""
    if output.finish_reason is not FinishReason.DEADLINE:
        return output, None
    error = DeadlineExceeded(
        f"deadline exceeded: the replica aborted the request at an engine step boundary, "
        f"{output.total_time_ns / 1e6:.0f} ms after it arrived"
    )
    if not output.new_token_ids:
        return None, error
    return EngineOutput(output.request_id, output.sequence_index, output.new_token_ids, output.logprobs), error


def hint_from_pb(pb_request: inference_pb2.GenerateTokensRequest) -> KvPullHint | None:
    """The request's KvPullHint, checked; None when it names no source."""
    if not pb_request.HasField("kv_pull"):
        return None
    address = pb_request.kv_pull.source_address
    if not address:
        raise InvalidArgument("kv_pull.source_address", "must name the source replica (host:port)")
    if len(address) > MAX_SOURCE_ADDRESS_CHARS:
        raise InvalidArgument("kv_pull.source_address", f"{len(address)} characters exceed the limit of {MAX_SOURCE_ADDRESS_CHARS}")
    return KvPullHint(pb_request.kv_pull.source_address, pb_request.kv_pull.num_blocks)


# A host:port: a DNS name is at most 253 characters.
MAX_SOURCE_ADDRESS_CHARS = 260
# A pin's lease: what a puller may ask for (ms); 0 asks for the default.
DEFAULT_PIN_LEASE_MS = 10_000
MAX_PIN_LEASE_MS = 60_000


def pin_request_from_pb(pb_request: inference_pb2.PinKvBlocksRequest, info: ModelInfo) -> tuple[EngineRequest, int]:
    """The prompt to look the pinned blocks up by, as a request of it, and the lease in ms."""
    check_cache_salt(pb_request.cache_salt)
    prompt_token_ids = list(pb_request.prompt_token_ids)
    if not prompt_token_ids:
        raise InvalidArgument("prompt_token_ids", "must not be empty")
    if len(prompt_token_ids) > info.max_context_tokens:
        raise InvalidArgument("prompt_token_ids", f"{len(prompt_token_ids)} tokens exceed the context of {info.max_context_tokens}")
    if pb_request.lease_ms > MAX_PIN_LEASE_MS:
        raise InvalidArgument("lease_ms", f"{pb_request.lease_ms} exceeds the limit of {MAX_PIN_LEASE_MS}")
    if not pb_request.HasField("puller"):
        raise InvalidArgument("puller", "must describe the puller (its PeerIdentity)")
    _check_block_hashes(pb_request, len(prompt_token_ids), info)
    request = EngineRequest(
        "kv-pin", prompt_token_ids, SamplingParams(max_tokens=1), time.monotonic_ns(),
        block_hashes=list(pb_request.block_hashes), block_size_tokens=pb_request.block_size_tokens,
        block_hash_version=pb_request.block_hash_version, cache_salt=pb_request.cache_salt,
    )
    return request, pb_request.lease_ms or DEFAULT_PIN_LEASE_MS
