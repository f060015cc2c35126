"""The client's side of a GenerateStream: a bounded buffer between the pipeline and the client.

Reading the pipeline and writing to the client are decoupled. A producer task reads the
pipeline's deltas into a per-stream buffer as fast as inference makes them; the writer takes
*everything buffered* since its last write and sends it as one delta (text concatenated, token ids
and logprobs appended, the result on the last). At light load each write carries one token; a
reader slower than generation gets fewer, larger messages instead of a queue of tiny ones, so a
busy gateway spends less CPU per token exactly when it is behind.

Why a bound: grpc.aio's `yield` from a server-streaming handler returns once the message is
inside the client's HTTP/2 receive window (grpc's default window starts at 64 KiB and grows with
BDP probing, to about 1 MiB measured on loopback with grpc 1.85), and then blocks until the client
reads. Without a bound, a client that never reads keeps its sequence generating to max_tokens and
its KV blocks held. So when more than `max_unsent_tokens` tokens wait in the buffer, the request
is aborted: the producer stops reading, which closes the pipeline (its `finally` cancels inference
and sends Abort, freeing the KV blocks at once), and the stream ends with ClientNotReading as soon as
grpc lets the writer run again (when the client reads what its window holds, or cancels).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from llmserve.errors import ServiceError
from llmserve.gateway.generation import GenerationDelta

log = logging.getLogger(__name__)

# A sequence decodes at up to a few hundred tokens/s, so this is several seconds of a client not
# reading: long enough for a GC pause or a slow link, short enough to free a stalled client's KV.
DEFAULT_MAX_UNSENT_TOKENS = 2048


class ClientNotReading(ServiceError):
    """The client left more than the limit of tokens unsent: its request was aborted.

    RESOURCE_EXHAUSTED, not ABORTED: the stream exhausted its per-stream buffer quota and the
    client is the cause (ABORTED means a concurrency conflict that a retry resolves; retrying
    this request without reading faster fails the same way, so no RetryInfo is attached either).
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, num_unsent_tokens: int, max_unsent_tokens: int):
        super().__init__(
            f"client is not reading: {num_unsent_tokens} tokens unsent (limit {max_unsent_tokens})"
        )


def merge_deltas(deltas: list[GenerationDelta]) -> GenerationDelta:
    """One delta carrying all of `deltas` in order (the result is the last one's)."""
    if len(deltas) == 1:
        return deltas[0]
    logprobs = [lp for d in deltas if d.logprobs for lp in d.logprobs]
    return GenerationDelta(
        text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        logprobs=logprobs or None,
        result=deltas[-1].result,
    )


class _DeltaBuffer:
    """Deltas read from the pipeline and not yet taken by the writer."""

    def __init__(self, request_id: str, max_unsent_tokens: int):
        self._request_id = request_id
        self._max_unsent_tokens = max_unsent_tokens  # 0: unbounded
        self._deltas: list[GenerationDelta] = []
        self._num_unsent_tokens = 0
        # Set when a delta arrives or the producer ends; the writer clears it before taking.
        self.changed = asyncio.Event()

    async def fill(self, deltas: AsyncIterator[GenerationDelta]) -> None:
        """The producer: read every delta; raise ClientNotReading once over the bound."""
        try:
            async with aclosing(deltas):
                async for delta in deltas:
                    self._deltas.append(delta)
                    self._num_unsent_tokens += len(delta.token_ids)
                    if 0 < self._max_unsent_tokens < self._num_unsent_tokens:
                        error = ClientNotReading(self._num_unsent_tokens, self._max_unsent_tokens)
                        log.warning("request %s aborted: %s", self._request_id, error.message)
                        raise error
                    self.changed.set()
        finally:
            self.changed.set()

    def take(self) -> GenerationDelta | None:
        """Everything buffered, as one delta (None when empty)."""
        if not self._deltas:
            return None
        delta = merge_deltas(self._deltas)
        self._deltas = []
        self._num_unsent_tokens = 0
        return delta


async def coalesced(
    deltas: AsyncIterator[GenerationDelta], request_id: str, max_unsent_tokens: int
) -> AsyncIterator[GenerationDelta]:
    """Yield `deltas` merged by what accumulated during each write; the last one has the result.

    Raises what the pipeline raised, or ClientNotReading when more than `max_unsent_tokens`
    (0: no bound) waited unsent. Closing this generator (client cancel, deadline) cancels the
    producer, which closes the pipeline and so aborts inference.
    """
    buffer = _DeltaBuffer(request_id, max_unsent_tokens)
    producer = asyncio.create_task(buffer.fill(deltas))
    try:
        while True:
            await buffer.changed.wait()
            buffer.changed.clear()
            if producer.done() and producer.exception() is not None:
                raise producer.exception()  # an error outranks what is still buffered
            delta = buffer.take()
            if delta is not None:
                yield delta
                if delta.result is not None:
                    return
            elif producer.done():
                raise ServiceError("the generation ended without a result")
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
