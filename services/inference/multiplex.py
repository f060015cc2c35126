"""One Multiplex stream: many requests of one gateway on one gRPC call.

    gateway ──MultiplexRequest (generate | abort)──▶ read_commands ──▶ engine.submit / abort
    gateway ◀──MultiplexResponse (all outputs since the last one)── responses ◀── on_output

Why: one GenerateTokens call per request costs a gRPC stream, a handler task and one message
per token; at 256 streams that is ~50k messages a second through Python on both ends. Here
the engine's outputs of a step land in one list (`on_output` is a list append on the event
loop) and the writer sends all of it as one message: while the gateway reads as fast as the
engine steps, a message per step; when it falls behind, the next message carries more steps,
each sequence's tokens merged into one output.

A request refused at the door (bad input, admission) gets one output carrying the status a
GenerateTokens call would have ended with. When the gateway ends the stream, or it breaks, every
request still on it is aborted, freeing its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from llmserve.errors import ServiceError, check_decoded, rich_status_for
from llmserve.inference.async_engine import coalesced
from llmserve.inference.engine.types import EngineOutput
from llmserve.inference.wire import deadline_ns, output_to_pb, request_from_pb
from llmserve.request_context import serving_request
from llmserve.v1 import inference_pb2

log = logging.getLogger(__name__)


class MultiplexedStream:
    """The state of one Multiplex call; `engine` is the servicer's ServingEngine."""

    def __init__(self, engine):
        self._engine = engine
        self._outputs: list[EngineOutput] = []  # produced, not yet sent
        self._refusals: list[inference_pb2.RequestOutput] = []
        self._has_news = asyncio.Event()
        self._unfinished: dict[str, int] = {}  # request id → its sequences without a final output
        self._is_reading = True
        self._bad_command: ServiceError | None = None  # what ended the reading early

    async def read_commands(self, commands: AsyncIterator[inference_pb2.MultiplexRequest]) -> None:
        """Apply every command the gateway sends, until it ends its side of the stream."""
        try:
            async for command in commands:
                check_decoded(command)  # an unparsable or oversized command ends the stream
                if command.HasField("generate"):
                    with serving_request(command.generate.request_id):
                        self._start(command.generate)
                elif command.HasField("abort"):
                    with serving_request(command.abort.request_id):
                        self._engine.abort(command.abort.request_id)
        except ServiceError as error:
            self._bad_command = error  # responses() raises it: the stream ends now, not after its requests
        finally:
            self._is_reading = False
            self._has_news.set()

    async def responses(self) -> AsyncIterator[inference_pb2.MultiplexResponse]:
        """Everything produced since the previous message, until the gateway has ended its side
        and every request has finished. Raises what a bad command ended the reading with."""
        while self._is_reading or self._unfinished or self._outputs or self._refusals:
            await self._has_news.wait()
            self._has_news.clear()
            if self._bad_command is not None:
                raise self._bad_command
            if self._outputs or self._refusals:
                yield self._take_response()

    def close(self) -> None:
        """The stream ended: abort what is still running (their outputs are no longer wanted)."""
        for request_id in list(self._unfinished):
            self._engine.detach(request_id)
        self._unfinished.clear()

    def _start(self, pb_request: inference_pb2.GenerateTokensRequest) -> None:
        arrival_ns = time.monotonic_ns()
        request_id = pb_request.request_id
        try:
            deadline = deadline_ns(pb_request, arrival_ns, None)
            request = request_from_pb(pb_request, self._engine.model_info, arrival_ns, deadline)
            self._engine.submit(request, self._on_output)
        except ServiceError as error:
            self._refuse(request_id, error)
            return
        except Exception as exc:  # noqa: BLE001 — our bug: fail this request, keep the stream
            log.exception("starting %r on a Multiplex stream failed", request_id)
            self._refuse(request_id, ServiceError(f"internal error: {type(exc).__name__}: {exc}"))
            return
        self._unfinished[request_id] = request.sampling.n

    def _refuse(self, request_id: str, error: ServiceError) -> None:
        status = rich_status_for(error)
        self._refusals.append(inference_pb2.RequestOutput(request_id=request_id, error_status=status.SerializeToString()))
        self._has_news.set()

    def _on_output(self, output: EngineOutput) -> None:
        self._outputs.append(output)
        self._has_news.set()
        if output.is_finished:
            remaining = self._unfinished.get(output.request_id, 1) - 1
            if remaining:
                self._unfinished[output.request_id] = remaining
            else:
                self._unfinished.pop(output.request_id, None)

    def _take_response(self) -> inference_pb2.MultiplexResponse:
        outputs, self._outputs = self._outputs, []
        refusals, self._refusals = self._refusals, []
        response = inference_pb2.MultiplexResponse(outputs=refusals)
        response.outputs.extend(
            inference_pb2.RequestOutput(request_id=output.request_id, output=output_to_pb(output))
            for output in coalesced(outputs)
        )
        return response
