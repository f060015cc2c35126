"""One Multiplex stream: many requests of one gateway on one gRPC call.

    gateway ──MultiplexRequest (generate | abort)──▶ read_commands ──▶ OutputStream.start / abort
    gateway ◀──MultiplexResponse (all outputs since the last one)── responses ◀── OutputStream

Why: one GenerateTokens call per request costs a gRPC stream, a handler task and one message
per token; at 256 streams that is ~50k messages a second through Python on both ends. Here
the engine's outputs of a step land in the stream's OutputStream (a list append on the event
loop) and the writer sends all of it as one message: while the gateway reads as fast as the
engine steps, a message per step; when it falls behind, the next message carries more steps,
each sequence's tokens merged into one output.

A gateway that asks for it (call metadata llmserve.pb.MULTIPLEX_COLUMNS_METADATA)
gets the plain outputs of a message, those without a finish, logprobs or an error, as the
message's TokenColumns (issue 19): request ids, sequence indexes, token counts and token ids,
four flat lists, instead of a RequestOutput with a GenerateTokensResponse each. Measured for one
step's message of 256 streams (4 calls), built and serialized: ~820 µs as RequestOutputs, ~100
µs as columns. A client that does not ask (an older gateway, a test) gets every output as a
RequestOutput.

A request refused at the door (bad input, admission) gets one output carrying the status a
GenerateTokens call would have ended with, and so does one whose deadline passed in the engine
(DEADLINE_EXCEEDED, after any tokens that came with it). When the gateway ends the stream, or
it breaks, every request still on it is aborted, freeing its KV blocks.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator

from llmserve.client_text import quoted
from llmserve.bidi_stream import read_requests
from llmserve.engine_output import EngineOutput
from llmserve.errors import ServiceError, rich_status_for
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.output_stream import OutputStream
from llmserve.inference.kv_puller import KvPuller
from llmserve.inference.wire import deadline_ns, hint_from_pb, request_from_pb, split_at_deadline
from llmserve.pb import output_to_pb
from llmserve.request_context import serving_request
from llmserve.v1 import inference_pb2

log = logging.getLogger(__name__)


class MultiplexedStream:
    """The state of one Multiplex call; `token_columns`: its client asked for TokenColumns."""

    def __init__(self, engine: AsyncEngine, puller: KvPuller | None = None, *, token_columns: bool = False):
        self._engine = engine
        self._puller = puller  # --kv-pull: requests with a KvPullHint pull their prefix first
        self._token_columns = token_columns
        self._outputs = OutputStream(engine)
        self._is_reading = True
        self._bad_command: ServiceError | None = None  # what ended the reading early

    async def read_commands(self, commands: AsyncIterator[inference_pb2.MultiplexRequest]) -> None:
        """Apply every command the gateway sends, until it ends its side of the stream."""
        try:
            # responses() raises a bad command's error: the stream ends now, not after its requests
            self._bad_command = await read_requests(commands, self._apply)
        finally:
            self._is_reading = False
            self._outputs.wake()

    def _apply(self, command: inference_pb2.MultiplexRequest) -> None:
        if command.HasField("generate"):
            with serving_request(command.generate.request_id):
                self._start(command.generate)
        elif command.HasField("abort"):
            with serving_request(command.abort.request_id):
                self._outputs.abort(command.abort.request_id)

    async def responses(self) -> AsyncIterator[inference_pb2.MultiplexResponse]:
        """Everything produced since the previous message, until the gateway has ended its side
        and every request has finished. Raises what a bad command ended the reading with."""
        while self._is_reading or self._outputs.has_open_requests or self._outputs.has_news:
            await self._outputs.wait()
            if self._bad_command is not None:
                raise self._bad_command
            if self._outputs.has_news:
                yield _response(*self._outputs.take(), token_columns=self._token_columns)
        if self._bad_command is not None:  # read while the last response was being written
            raise self._bad_command

    def close(self) -> None:
        """The stream ended: abort what is still running (its outputs are no longer wanted)."""
        self._outputs.close()

    def _start(self, pb_request: inference_pb2.GenerateTokensRequest) -> None:
        arrival_ns = time.monotonic_ns()
        request_id = pb_request.request_id
        try:
            deadline = deadline_ns(pb_request, arrival_ns, None)
            request = request_from_pb(pb_request, self._engine.model_info, arrival_ns, deadline)
            hint = hint_from_pb(pb_request)
            if hint is not None and self._puller is not None:
                self._outputs.start_after_pull(request, self._puller.pull(request, hint))
            else:
                self._outputs.start(request)
        except ServiceError as error:
            self._outputs.refuse(request_id, error)
        except Exception as exc:  # noqa: BLE001 — our bug: fail this request, keep the stream
            log.exception("starting %s on a Multiplex stream failed", quoted(request_id))
            self._outputs.refuse(request_id, ServiceError(f"internal error: {type(exc).__name__}: {exc}"))


def _response(refusals, outputs, *, token_columns: bool = False) -> inference_pb2.MultiplexResponse:
    response = inference_pb2.MultiplexResponse(
        outputs=[_error_output(request_id, error) for request_id, error in refusals]
    )
    if token_columns:
        outputs = _add_token_columns(response.tokens, outputs)
    for output in outputs:
        tokens, deadline_error = split_at_deadline(output)
        if tokens is not None:
            response.outputs.append(inference_pb2.RequestOutput(request_id=output.request_id, output=output_to_pb(tokens)))
        if deadline_error is not None:
            response.outputs.append(_error_output(output.request_id, deadline_error))
    return response


def _add_token_columns(columns: inference_pb2.TokenColumns, outputs: list[EngineOutput]) -> list[EngineOutput]:
    """The plain outputs (coalesced: one per sequence) into `columns`; returns the others."""
    others, request_ids, sequence_indexes, num_tokens, token_ids = [], [], [], [], []
    for output in outputs:
        if output.finish_reason is None and output.logprobs is None:
            request_ids.append(output.request_id)
            sequence_indexes.append(output.sequence_index)
            num_tokens.append(len(output.new_token_ids))
            token_ids += output.new_token_ids
        else:
            others.append(output)
    if request_ids:
        columns.request_ids.extend(request_ids)
        columns.sequence_indexes.extend(sequence_indexes)
        columns.num_tokens.extend(num_tokens)
        columns.token_ids.extend(token_ids)
    return others


def _error_output(request_id: str, error: ServiceError) -> inference_pb2.RequestOutput:
    return inference_pb2.RequestOutput(request_id=request_id, error_status=rich_status_for(error).SerializeToString())
