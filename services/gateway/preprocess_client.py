"""The gateway's typed async client for preprocess.

Protobuf stops here: callers pass and receive the dataclasses below. Every call takes the time
left on the client's deadline (`timeout_s`, None = no deadline) so a deadline set at the gateway
bounds the whole chain; a gRPC error becomes a ServiceError (`hop_errors`). Preprocess goes over
one PreprocessStream call per server (preprocess_stream.py), unary where the server lacks it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc

from llmserve import token_id_bytes
from llmserve.gateway.block_layout import BlockLayout
from llmserve.gateway.health import wait_until_serving
from llmserve.errors import ServiceError, Unavailable
from llmserve.gateway.hop_errors import call_hop
from llmserve.gateway.preprocess_stream import PreprocessStreamClient
from llmserve.gateway.request_id import request_metadata
from llmserve.pb import region_ids_from_pb, scope_from_pb, set_prompt_input_pb
from llmserve.prompt_ids_region import BadReference, EntryGone, RegionIds, SharedMemoryScope, shared_reader
from llmserve.prompt_input import PromptInput
from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import preprocess_pb2, preprocess_pb2_grpc

log = logging.getLogger(__name__)

# Preprocess fields that the gateway's clients know under another name: a field violation from
# preprocess is re-labelled so that the error names the field the client actually set.
PREPROCESS_FIELDS_AS_CLIENT_FIELDS = {"max_tokens": "sampling.max_tokens"}
# gRPC's reconnect backoff grows to 120 s; a preprocess server restarted at its address (or a
# pool's server back from a crash) is then found within a second instead.
_CHANNEL_OPTIONS = (*CHANNEL_OPTIONS, ("grpc.max_reconnect_backoff_ms", 1000))


@dataclass(frozen=True, slots=True)
class PreprocessCard:
    """What the gateway needs to know of preprocess at start-up."""

    block_layout: BlockLayout
    max_context_tokens: int
    max_prompt_bytes: int  # larger prompts are refused (the gateway sizes its receive limit by it)
    max_output_tokens: int  # the largest max_tokens accepted
    chat_template_fingerprint: int  # of its template's text and special tokens; 0: none (chats are refused)
    # Where its prompt ids ring can be mapped (None: it has none). Not compared: servers on other
    # hosts serve alike.
    shared_memory: SharedMemoryScope | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """A validated, tokenized prompt and the max_tokens preprocess resolved for it."""

    # The ids as preprocess answers them and inference takes them (llmserve.token_id_bytes):
    # the gateway relays them, and reads only their count and the last few. Empty when they are
    # in preprocess's ring (ids_in_region).
    token_id_bytes: bytes = field(repr=False)
    block_hashes: list[int]  # chained from the namespace seed of cache_salt
    block_size_tokens: int
    block_hash_version: int
    cache_salt: str = field(repr=False)  # never logged
    max_tokens: int
    preprocess_time_ns: int
    # A long prompt's ids in preprocess's shared-memory ring (llmserve.prompt_ids_region),
    # answered at `answered_s` (monotonic): relayed by reference while young enough.
    ids_in_region: RegionIds | None = None
    answered_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        if self.ids_in_region is not None:
            return self.ids_in_region.num_ids
        return token_id_bytes.count(self.token_id_bytes)

    def last_token_ids(self, num_ids: int) -> list[int]:
        if self.ids_in_region is not None:
            return _read_region(shared_reader().last, self.ids_in_region, num_ids)
        return token_id_bytes.last(self.token_id_bytes, num_ids)

    def can_relay_region(self) -> bool:
        """The ring's entry is young enough to send by reference: less than half its lease has
        passed (the replica reads it on arrival, milliseconds later)."""
        ref = self.ids_in_region
        return ref is not None and time.monotonic() - self.answered_s < ref.valid_for_s / 2

    def inline_token_id_bytes(self) -> bytes:
        """The ids as bytes, read out of the ring when they are there."""
        if self.ids_in_region is None:
            return self.token_id_bytes
        return _read_region(shared_reader().read, self.ids_in_region).tobytes()


def _read_region(read, ref: RegionIds, *args):
    """`read(ref, *args)`, an entry gone (held past its lease) or unreadable as UNAVAILABLE."""
    try:
        return read(ref, *args)
    except (BadReference, EntryGone) as error:
        raise Unavailable(f"the prompt's ids are no longer in preprocess's ring: {error}") from None


def _request_to_pb(
    request_id: str, prompt_input: PromptInput, max_tokens: int | None, cache_salt: str, ids_in_region_from: int
) -> preprocess_pb2.PreprocessRequest:
    request = preprocess_pb2.PreprocessRequest(
        request_id=request_id, cache_salt=cache_salt, token_ids_as_bytes=True,
        token_ids_in_region_from=ids_in_region_from,
    )
    set_prompt_input_pb(request, prompt_input)
    if max_tokens is not None:
        request.max_tokens = max_tokens
    return request


class PreprocessClient:
    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = preprocess_pb2_grpc.PreprocessServiceStub(self._channel)
        self._stream = PreprocessStreamClient(self._stub, PREPROCESS_FIELDS_AS_CLIENT_FIELDS)

    async def wait_until_serving(self, timeout_s: float) -> None:
        await wait_until_serving(self._channel, f"preprocess at {self.address}", timeout_s)

    async def get_info(self, timeout_s: float | None = 10.0) -> PreprocessCard:
        response = await call_hop(
            "preprocess", self._stub.GetPreprocessInfo, preprocess_pb2.GetPreprocessInfoRequest(), timeout=timeout_s
        )
        return PreprocessCard(
            block_layout=BlockLayout.of_model_info(response.model),
            max_context_tokens=response.model.max_context_tokens,
            max_prompt_bytes=response.max_prompt_bytes,
            max_output_tokens=response.max_output_tokens,
            chat_template_fingerprint=response.chat_template_fingerprint,
            shared_memory=scope_from_pb(response.shared_memory) if response.HasField("shared_memory") else None,
        )

    async def preprocess(
        self,
        request_id: str,
        prompt_input: PromptInput,
        *,
        max_tokens: int | None,
        cache_salt: str,
        timeout_s: float | None,
        ids_in_region_from: int = 0,
    ) -> PreparedPrompt:
        """Template, tokenize, validate and hash for `cache_salt` ("" = none); preprocess
        resolves `max_tokens` (None: unset). A prompt of at least `ids_in_region_from` tokens
        (0: none) comes back in the server's shared-memory ring when it has room."""
        request = _request_to_pb(request_id, prompt_input, max_tokens, cache_salt, ids_in_region_from)
        response = None
        if not self._stream.is_unsupported:
            try:
                response = await self._stream.preprocess(request, timeout_s)
            except ServiceError:
                if not self._stream.is_unsupported:
                    raise
                log.info("preprocess at %s has no PreprocessStream: unary calls from now on", self.address)
        if response is None:
            response = await call_hop(
                "preprocess", self._stub.Preprocess, request, PREPROCESS_FIELDS_AS_CLIENT_FIELDS,
                timeout=timeout_s, metadata=request_metadata(request_id),
            )
        return PreparedPrompt(
            # token_ids: a preprocess release before token_ids_as_bytes
            token_id_bytes=response.token_id_bytes or token_id_bytes.pack(response.token_ids),
            block_hashes=list(response.block_hashes),
            block_size_tokens=response.block_size_tokens,
            block_hash_version=response.block_hash_version,
            cache_salt=cache_salt,
            max_tokens=response.max_tokens,
            preprocess_time_ns=response.preprocess_time_ns,
            **_ids_in_region(response),
        )

    async def close(self) -> None:
        await self._stream.close()
        await self._channel.close()


def _ids_in_region(response: preprocess_pb2.PreprocessResponse) -> dict:
    """PreparedPrompt's ids_in_region and answered_s, when the ids are in preprocess's ring."""
    if not response.HasField("token_ids_in_region"):
        return {}
    return {"ids_in_region": region_ids_from_pb(response.token_ids_in_region), "answered_s": time.monotonic()}
