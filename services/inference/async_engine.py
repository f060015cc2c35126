"""AsyncEngine: the asyncio face of one EngineCore, which runs behind a CoreClient: an
EngineThread (a thread of this process) or an EngineProcess (a process of its own).

    event loop (servicer)                             core client
    submit()/generate() ──add_request──▶   ──▶ core.add_request
    abort()             ──abort_request─▶  ──▶ core.abort_request (+ CANCELLED outputs)
                                               core.step() → [EngineOutput]
    each request's on_output ◀── _deliver(outputs, kv_events, steps), per engine step ◀──┘
    the kv-event sink       ◀──┘ (the step's prefix-cache changes, when it made any)
    metrics.record_*        ◀──┘ (its StepReport, the tokens routed, refusals at submit)

Two ways to consume a request: `submit(request, on_output)` calls `on_output` for every
output as it is delivered (the multiplexed stream hands a whole step to its writer this way);
`generate(request)` is an async iterator over the same outputs, coalesced: an output carries
every token its sequence produced since the consumer last read, so a slow reader gets fewer,
larger outputs and never a backlog of one-token ones.

A request is *in flight* from submit() until every one of its sequences has had its final
output delivered, even when its consumer left early: its request id stays taken until the
core has let go of it, so a new request reusing the id never receives the old one's outputs.
The engine loop guarantees each sequence exactly one final output (see engine_loop.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

from llmserve.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from llmserve.inference import metrics
from llmserve.inference.admission import AdmissionConfig, AdmissionController
from llmserve.inference.engine.engine_loop import Deliver
from llmserve.inference.engine.types import CacheEvent, EngineLoad, EngineOutput, EngineRequest, ModelInfo, StepReport

log = logging.getLogger(__name__)

OnOutput = Callable[[EngineOutput], None]
# Gets every batch of prefix-cache changes, on the loop, before the outputs delivered with it.
KvEventSink = Callable[[list[CacheEvent]], None]


class CoreClient(Protocol):
    """Runs a core off the event loop: engine_thread.EngineThread or engine_process.EngineProcess."""

    model_info: ModelInfo

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None: ...

    @property
    def is_running(self) -> bool: ...

    def stop(self) -> None:
        """Cancel what is unfinished and end; blocks (call it off the loop)."""
        ...

    def add_request(self, request: EngineRequest) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...


@dataclass(slots=True)
class _Stream:
    """The loop-side state of one in-flight request."""

    on_output: OnOutput | None  # None once the consumer left: outputs are counted, not passed on
    num_unfinished_sequences: int
    num_prompt_tokens: int  # counted in the metrics once the request has produced a token
    is_started: bool = False  # a token was produced
    is_aborting: bool = False


class AsyncEngine:
    """Owns a CoreClient. Every public method runs on the event loop."""

    def __init__(self, client: CoreClient, admission: AdmissionConfig = AdmissionConfig()):
        self.model_info: ModelInfo = client.model_info
        self._client = client
        self._admission = AdmissionController(
            admission,
            kv_blocks_total=client.load().kv_blocks_total,
            hash_namespace=self.model_info.hash_namespace,
            max_context_tokens=self.model_info.max_context_tokens,
            step_grows_with_batch=self.model_info.device == "cpu",
        )
        self._streams: dict[str, _Stream] = {}  # request_id → stream, for each in-flight request
        self._kv_event_sink: KvEventSink | None = None
        self._is_accepting = False
        self._none_in_flight = asyncio.Event()
        self._none_in_flight.set()

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._client.start(asyncio.get_running_loop(), self._deliver)
        self._is_accepting = True

    def forward_kv_events(self, sink: KvEventSink) -> None:
        """Hand the core's prefix-cache changes to `sink` from now on (before: dropped)."""
        self._kv_event_sink = sink

    async def shutdown(self, drain_timeout_s: float) -> None:
        """Stop accepting (Unavailable), let in-flight requests finish for up to
        `drain_timeout_s`, abort the rest, then stop the core client."""
        self._is_accepting = False
        if not self._client.is_running:
            return
        if self._streams:
            try:
                await asyncio.wait_for(self._none_in_flight.wait(), timeout=drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("drain timeout (%.1fs): aborting %d requests", drain_timeout_s, len(self._streams))
                for request_id in list(self._streams):
                    self.abort(request_id)
        await asyncio.to_thread(self._client.stop)

    # --- requests ---------------------------------------------------------------------------

    def submit(self, request: EngineRequest, on_output: OnOutput) -> None:
        """Start the request; `on_output` gets each of its outputs on the loop, the final one of
        every sequence included. Raises (Unavailable, InvalidArgument, and the refusals of
        admission.py: ResourceExhausted, DeadlineExceeded) before anything is queued."""
        if not self._is_accepting or not self._client.is_running:
            raise Unavailable("the inference engine is shutting down")
        if request.request_id in self._streams:
            raise InvalidArgument("request_id", f"{request.request_id!r} is already in flight")
        try:
            self._admission.admit(request)
        except (ResourceExhausted, DeadlineExceeded, InvalidArgument) as refusal:
            metrics.record_refused(refusal)
            raise
        log.debug(
            "admitted: %d prompt tokens, n=%d, max_tokens=%d",
            len(request.prompt_token_ids), request.sampling.n, request.sampling.max_tokens,
            extra={"prompt_token_ids": request.prompt_token_ids},
        )
        self._streams[request.request_id] = _Stream(
            on_output=on_output, num_unfinished_sequences=request.sampling.n,
            num_prompt_tokens=len(request.prompt_token_ids),
        )  # fmt: skip
        self._none_in_flight.clear()
        self._client.add_request(request)

    def detach(self, request_id: str) -> None:
        """The consumer left: stop passing outputs on, and abort the request."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.on_output = None
            self.abort(request_id)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream the request's outputs, coalesced per sequence, until every sequence has
        finished. Leaving early (break + aclose, cancellation, an exception in the consumer)
        aborts the request in the core, which frees its KV blocks."""
        pending: list[EngineOutput] = []
        has_pending = asyncio.Event()

        def on_output(output: EngineOutput) -> None:
            pending.append(output)
            has_pending.set()

        self.submit(request, on_output)
        num_finished_sequences = 0
        try:
            while num_finished_sequences < request.sampling.n:
                await has_pending.wait()
                has_pending.clear()
                taken, pending[:] = list(pending), []
                for output in coalesced(taken):
                    num_finished_sequences += int(output.is_finished)
                    yield output
        finally:
            if num_finished_sequences < request.sampling.n:
                self.detach(request.request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request; True if it was in flight and not already being aborted. Idempotent.

        Its stream (if still read) ends with a CANCELLED output for each unfinished sequence.
        """
        stream = self._streams.get(request_id)
        if stream is None or stream.is_aborting:
            return False
        stream.is_aborting = True
        self._client.abort_request(request_id)
        return True

    def load(self) -> EngineLoad:
        """The core client's latest snapshot; no call into the core."""
        return self._client.load()

    def _deliver(self, outputs: list[EngineOutput], kv_events: list[CacheEvent], steps: list[StepReport]) -> None:
        """Runs on the loop: cache changes to the sink first (a client that reads a final
        output and sends the next turn finds its blocks already announced), then route outputs
        to their streams; a request whose every sequence has its final output is no longer in
        flight."""
        metrics.record_steps(steps)
        if kv_events and self._kv_event_sink is not None:
            self._announce(kv_events)
        if not outputs:
            return  # admission measures its rates per delivery of outputs
        self._admission.observe(outputs)
        num_prompt_tokens, num_generation_tokens = 0, 0
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                log.error("output for unknown request %r dropped", output.request_id)
                continue
            num_generation_tokens += len(output.new_token_ids)
            if output.new_token_ids and not stream.is_started:
                stream.is_started = True
                num_prompt_tokens += stream.num_prompt_tokens
            if stream.on_output is not None:
                stream.on_output(output)
            if output.is_finished:
                stream.num_unfinished_sequences -= 1
                if stream.num_unfinished_sequences == 0:
                    del self._streams[output.request_id]
        metrics.record_tokens(num_prompt_tokens, num_generation_tokens)
        if not self._streams:
            self._none_in_flight.set()

    def _announce(self, kv_events: list[CacheEvent]) -> None:
        try:
            self._kv_event_sink(kv_events)
        except Exception:  # noqa: BLE001 — routing's view may suffer, the requests must not
            log.exception("the kv-event sink failed")


def coalesced(outputs: list[EngineOutput]) -> list[EngineOutput]:
    """One output per sequence: its tokens and logprobs appended in order, the finish fields of
    its last output (only a sequence's last output can be final)."""
    by_sequence: dict[tuple[str, int], EngineOutput] = {}
    for output in outputs:
        key = (output.request_id, output.sequence_index)
        earlier = by_sequence.get(key)
        by_sequence[key] = output if earlier is None else _joined(earlier, output)
    return list(by_sequence.values())


def _joined(earlier: EngineOutput, later: EngineOutput) -> EngineOutput:
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    later.new_token_ids = earlier.new_token_ids + later.new_token_ids
    later.logprobs = logprobs
    return later
