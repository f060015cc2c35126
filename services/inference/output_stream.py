"""OutputStream: the requests one RPC started on the engine, and their outputs not yet written.

Both generating RPCs are served by it, the same way: Multiplex (many requests of one gateway,
for as long as it keeps the stream) and GenerateTokens (one request, for a direct caller).

    start(request) ──AsyncEngine.submit──▶ engine
    on_output (on the loop) ──▶ outputs since the last take ──take()──▶ the RPC's writer

Why buffer: the engine hands over a whole step's outputs at once, and the writer may be slower
than the engine (the reader on the other end behind): `take` returns everything produced since
the last write, each sequence's tokens merged into one output (llmserve.engine_output.coalesced),
so a slow reader gets fewer, larger messages and never a backlog of one-token ones.

Which requests are still open here follows the engine's own `is_last`: AsyncEngine owns the
request state, this keeps only the ids to detach when the RPC ends early.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Coroutine

from llmserve.engine_output import EngineOutput, coalesced
from llmserve.errors import Cancelled, ServiceError
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.types import EngineRequest
from llmserve.inference.kv_puller import PendingImport


class OutputStream:
    def __init__(self, engine: AsyncEngine):
        self._engine = engine
        self._outputs: list[EngineOutput] = []  # produced, not yet taken
        self._refusals: list[tuple[str, ServiceError]] = []  # (request id, why), not yet taken
        self._open_request_ids: set[str] = set()  # started here, their last output not yet produced
        self._has_news = asyncio.Event()
        self._pulls: dict[str, asyncio.Task] = {}  # request id → its prefix pull, before it is started
        self._pulled: dict[str, PendingImport] = {}  # request id → the import of its prefix, until its last output

    @property
    def has_open_requests(self) -> bool:
        return bool(self._open_request_ids)

    @property
    def has_news(self) -> bool:
        """Outputs or refusals wait to be taken."""
        return bool(self._outputs or self._refusals)

    def start(self, request: EngineRequest, pulled: PendingImport | None = None) -> None:
        """Submit the request; raises the engine's refusal (nothing started then). `pulled`:
        the import of its prefix from another replica, sent to the core just before."""
        self._engine.submit(request, self._on_output)
        self._open_request_ids.add(request.request_id)
        if pulled is not None:
            self._pulled[request.request_id] = pulled

    def start_after_pull(self, request: EngineRequest, pull: Coroutine[Any, Any, PendingImport | None]) -> None:
        """Start the request once `pull` (KvPuller.pull: never raises) has pinned its prefix at
        the source and sent the import; it is open here from now on. A refusal then is reported
        as by `refuse`."""
        self._open_request_ids.add(request.request_id)
        self._pulls[request.request_id] = asyncio.ensure_future(self._pull_then_start(request, pull))

    async def _pull_then_start(self, request: EngineRequest, pull: Coroutine[Any, Any, PendingImport | None]) -> None:
        try:
            pulled = await pull
        finally:
            self._pulls.pop(request.request_id, None)  # abort and close take it out first
        try:
            self.start(request, pulled)  # no await since the import was sent: the core takes it first
        except ServiceError as error:
            self._open_request_ids.discard(request.request_id)
            self.refuse(request.request_id, error)

    def refuse(self, request_id: str, error: ServiceError) -> None:
        """A request that never reached the engine: the writer reports `error` for it."""
        self._refusals.append((request_id, error))
        self._has_news.set()

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent): it ends with CANCELLED outputs (one still pulling its
        prefix is never submitted, and ends CANCELLED here)."""
        pull = self._pulls.pop(request_id, None)
        if pull is not None:
            pull.cancel()
            self._open_request_ids.discard(request_id)
            self.refuse(request_id, Cancelled("aborted while pulling its prefix KV"))
            return
        self._engine.abort(request_id)

    async def wait(self) -> None:
        """Until something was produced, or `wake` was called, since the last wait."""
        await self._has_news.wait()
        self._has_news.clear()

    def wake(self) -> None:
        self._has_news.set()

    def take(self) -> tuple[list[tuple[str, ServiceError]], list[EngineOutput]]:
        """The refusals and the outputs (coalesced per sequence) since the last take."""
        refusals, self._refusals = self._refusals, []
        outputs, self._outputs = self._outputs, []
        return refusals, coalesced(outputs)

    async def outputs(self) -> AsyncIterator[EngineOutput]:
        """The outputs, coalesced per sequence as they accumulated between reads, until every
        request started here has ended (refusals are Multiplex's and are not included)."""
        while self.has_open_requests or self.has_news:
            await self.wait()
            for output in self.take()[1]:
                yield output

    def close(self) -> None:
        """The RPC ended: detach what is still open (its outputs are no longer wanted)."""
        for request_id, pull in list(self._pulls.items()):
            pull.cancel()
            self._open_request_ids.discard(request_id)
        self._pulls.clear()
        for request_id in list(self._open_request_ids):
            self._engine.detach(request_id)
        self._open_request_ids.clear()

    def _on_output(self, output: EngineOutput, is_last: bool) -> None:
        if output.is_finished and output.request_id in self._pulled:
            # The core answered the import before this output (AsyncEngine delivers replies
            # first). Pulled blocks evicted before the request's prefill were recomputed: at
            # most what was cached counts.
            num_pulled = self._pulled[output.request_id].num_tokens()
            output.num_pulled_tokens = min(num_pulled, output.num_cached_tokens)
            if is_last:
                del self._pulled[output.request_id]
        self._outputs.append(output)
        self._has_news.set()
        if is_last:
            self._open_request_ids.discard(output.request_id)
