"""AsyncEngine: the asyncio face of one engine, whatever runs it behind a CoreClient: an
EngineThread (a core on a thread of this process), an EngineProcess (a core in a process of its
own) or a backend's own engine (trtllm_engine.TrtllmClient).

    event loop (servicer)                            core client
    submit(request, on_output) ──admit──▶ add_request ──▶ the core
    abort()/detach()           ─────────▶ abort_request (its outputs end CANCELLED)
    each request's on_output ◀── _deliver(CoreUpdate), per engine step ◀──┘
    the kv-event sink        ◀──┘ (the step's prefix-cache changes, when it made any)
    admission, metrics       ◀──┘ (its StepReport, the tokens routed, refusals at submit)

One consumer API: `submit(request, on_output)` calls `on_output(output, is_last)` for every
output as it is delivered, the final one of every sequence included; `is_last` marks the
request's last output. The servicer's OutputStream (output_stream.py) serves both generating
RPCs on it.

AsyncEngine is the one owner of request liveness in the server process: a request is *in
flight* from submit() until every one of its sequences has had its final output delivered, even
when its consumer left early: its request id stays taken until the core has let go of it, so a
new request reusing the id never receives the old one's outputs. Admission and the consumers
follow its `is_last`; nothing else in this process keeps a table of requests. The core client
guarantees each sequence exactly one final output (engine_loop.py), and when the core is gone
(CoreUpdate.core_failure) this class ends every sequence still open with ERROR itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from llmserve.engine_output import EngineOutput, StepOutputs
from llmserve.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable
from llmserve.client_text import quoted
from llmserve.inference import metrics
from llmserve.inference.admission import AdmissionConfig, AdmissionController, Admitted
from llmserve.inference.engine.engine_loop import CallCore, CoreReply, CoreUpdate, Deliver
from llmserve.inference.engine.types import EngineLoad, EngineRequest, ModelInfo
from llmserve.inference.kv_event_coalescer import DEFAULT_INTERVAL_S, KvEventCoalescer, KvEventSink
from llmserve.sampling import FinishReason

log = logging.getLogger(__name__)

# on_output(output, is_last): `is_last` once every sequence of the request has its final output.
OnOutput = Callable[[EngineOutput, bool], None]
# Gets every batch of prefix-cache changes, on the loop, before the outputs delivered with it.


class CoreClient(Protocol):
    """Runs an engine off the event loop. Its methods are called on the loop."""

    model_info: ModelInfo

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None: ...

    @property
    def is_running(self) -> bool: ...

    async def stop(self) -> None:
        """Cancel what is in flight (its CANCELLED outputs still delivered) and end."""
        ...

    def add_request(self, request: EngineRequest) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...


class CallingCoreClient(CoreClient, Protocol):
    """A core client whose core answers calls (EngineThread, EngineProcess: engine_loop.CallCore)."""

    def call_core(self, call: CallCore) -> None: ...


@dataclass(slots=True)
class _InFlight:
    """The loop-side state of one in-flight request."""

    on_output: OnOutput | None  # None once the consumer left: outputs are counted, not passed on
    unfinished_sequences: set[int]  # indexes of its sequences without a final output yet
    admitted: Admitted  # what admission charged it with
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
        )
        self._requests: dict[str, _InFlight] = {}  # request_id → its state, for each in-flight request
        self._kv_events: KvEventCoalescer | None = None
        self._is_accepting = False
        self._none_in_flight = asyncio.Event()
        self._on_core_failure: list[Callable[[str], None]] = []
        self._none_in_flight.set()
        self._calls: dict[int, asyncio.Future] = {}  # call_id → the caller's future (call_core)
        self._num_calls = 0

    def on_core_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(message)` on the loop once the core is gone (its process, or a
        tensor-parallel rank's, died): the service then reports NOT_SERVING."""
        self._on_core_failure.append(callback)

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._client.start(asyncio.get_running_loop(), self._deliver)
        self._is_accepting = True

    def forward_kv_events(self, sink: KvEventSink, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        """Hand the core's prefix-cache changes to `sink` from now on (before: dropped), a
        batch at most every `interval_s`, and at once with a request's final output
        (kv_event_coalescer.py)."""
        self._kv_events = KvEventCoalescer(sink, interval_s)

    async def shutdown(self, drain_timeout_s: float) -> None:
        """Stop accepting (Unavailable), let in-flight requests finish for up to
        `drain_timeout_s`, abort the rest, then stop the core client."""
        self._is_accepting = False
        if not self._client.is_running:
            return
        if self._requests:
            try:
                await asyncio.wait_for(self._none_in_flight.wait(), timeout=drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("drain timeout (%.1fs): aborting %d requests", drain_timeout_s, len(self._requests))
                for request_id in list(self._requests):
                    self.abort(request_id)
        await self._client.stop()

    # --- requests ---------------------------------------------------------------------------

    def submit(self, request: EngineRequest, on_output: OnOutput) -> None:
        """Start the request; `on_output` gets each of its outputs on the loop, the final one of
        every sequence included. Raises (Unavailable, InvalidArgument, and the refusals of
        admission.py: ResourceExhausted, DeadlineExceeded) before anything is queued."""
        if not self._is_accepting or not self._client.is_running:
            raise Unavailable("the inference engine is shutting down")
        if request.request_id in self._requests:
            raise InvalidArgument("request_id", f"{quoted(request.request_id)} is already in flight")
        try:
            admitted = self._admission.admit(request)
        except (ResourceExhausted, DeadlineExceeded, InvalidArgument) as refusal:
            metrics.record_refused(refusal)
            raise
        log.debug(
            "admitted: %d prompt tokens, n=%d, max_tokens=%d",
            len(request.prompt_token_ids), request.sampling.n, request.sampling.max_tokens,
            extra={"prompt_token_ids": request.prompt_token_ids},
        )
        self._requests[request.request_id] = _InFlight(
            on_output=on_output, unfinished_sequences=set(range(request.sampling.n)), admitted=admitted,
            num_prompt_tokens=len(request.prompt_token_ids),
        )  # fmt: skip
        self._none_in_flight.clear()
        self._client.add_request(request)

    def detach(self, request_id: str) -> None:
        """The consumer left: stop passing outputs on, and abort the request."""
        in_flight = self._requests.get(request_id)
        if in_flight is not None:
            in_flight.on_output = None
            self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request; True if it was in flight and not already being aborted. Idempotent.

        Its consumer (if still there) gets a CANCELLED final output for each unfinished sequence.
        """
        in_flight = self._requests.get(request_id)
        if in_flight is None or in_flight.is_aborting:
            return False
        in_flight.is_aborting = True
        self._client.abort_request(request_id)
        return True

    def load(self) -> EngineLoad:
        """The core client's latest snapshot; no call into the core."""
        return self._client.load()

    async def call_core(self, method: str, *args):
        """Call the core's `method` (engine_loop.CORE_CALLS) between two of its steps and return
        what it returned; raises what it raised, NotImplementedError for a core that takes no
        calls, Unavailable when the core is gone. Cancelling the wait does not undo the call."""
        return await self.call_core_soon(method, *args)

    def call_core_soon(self, method: str, *args) -> asyncio.Future:
        """`call_core`, sent now: the core applies it before any command sent after this returns
        (a submit included), and the future gets what it returned or raised. Raises
        NotImplementedError and Unavailable at once."""
        return self._send_call(getattr(self._client, "call_core", None), method, args)

    async def call_core_mid_step(self, method: str, *args):
        """As `call_core`, for a call the core can answer while a step runs
        (engine/mid_step_calls.py: a pin): answered in the loop's next window where the core
        runs in a process of its own, between two steps otherwise. No order with commands."""
        send = getattr(self._client, "call_core_mid_step", None) or getattr(self._client, "call_core", None)
        return await self._send_call(send, method, args)

    def _send_call(self, send, method: str, args: tuple) -> asyncio.Future:
        if send is None:
            raise NotImplementedError(f"the {self.model_info.backend} backend's engine takes no core calls")
        if not self._client.is_running:
            raise Unavailable("the inference engine is not running")
        self._num_calls += 1
        call = CallCore(self._num_calls, method, args)
        future = self._calls[call.call_id] = asyncio.get_running_loop().create_future()
        send(call)
        return future

    # --- outputs ----------------------------------------------------------------------------

    def _deliver(self, update: CoreUpdate) -> None:
        """Runs on the loop: cache changes to the sink first (a client that reads a final
        output and sends the next turn finds its blocks already announced), then outputs to
        admission and to their consumers; a request whose every sequence has its final output
        is no longer in flight."""
        metrics.record_steps(update.steps)
        self._answer(update.replies, update.core_failure)
        self._admission.observe_steps(update.steps)
        if self._kv_events is not None:
            self._kv_events.add(update.kv_events, flush_now=bool(update.core_failure) or _has_final(update.outputs))
        outputs = update.outputs
        if update.core_failure:
            outputs = outputs + self._failed_outputs(outputs, update.core_failure)
            for callback in self._on_core_failure:
                callback(update.core_failure)
        if not outputs:
            return  # admission measures its rates per delivery of outputs
        deliveries = self._account(outputs)
        self._admission.observe([(in_flight.admitted, output, is_last) for in_flight, output, is_last in deliveries])
        for in_flight, output, is_last in deliveries:
            if in_flight.on_output is not None:
                in_flight.on_output(output, is_last)
        if not self._requests:
            self._none_in_flight.set()

    def _answer(self, replies: list[CoreReply], core_failure: str) -> None:
        for reply in replies:
            future = self._calls.pop(reply.call_id, None)
            if future is None or future.done():
                continue  # its caller stopped waiting
            if reply.error is not None:
                future.set_exception(reply.error)
            else:
                future.set_result(reply.result)
        if core_failure:
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(Unavailable(core_failure))
            self._calls.clear()

    def _account(self, outputs: list[EngineOutput]) -> list[tuple[_InFlight, EngineOutput, bool]]:
        """Each output with its request's state and whether it is the request's last; the
        token metrics; a request whose last output this is leaves the table."""
        deliveries = []
        num_prompt_tokens, num_generation_tokens = 0, 0
        for output in outputs:
            in_flight = self._requests.get(output.request_id)
            if in_flight is None:
                log.error("output for unknown request %r dropped", output.request_id)
                continue
            num_generation_tokens += len(output.new_token_ids)
            if output.new_token_ids and not in_flight.is_started:
                in_flight.is_started = True
                num_prompt_tokens += in_flight.num_prompt_tokens
            if output.is_finished:
                in_flight.unfinished_sequences.discard(output.sequence_index)
            is_last = output.is_finished and not in_flight.unfinished_sequences
            if is_last:
                del self._requests[output.request_id]
            deliveries.append((in_flight, output, is_last))
        metrics.record_tokens(num_prompt_tokens, num_generation_tokens)
        return deliveries

    def _failed_outputs(self, delivered: list[EngineOutput], message: str) -> list[EngineOutput]:
        """An ERROR final output for every sequence still open after `delivered` (the core is gone)."""
        finished = {(output.request_id, output.sequence_index) for output in delivered if output.is_finished}
        failed = [
            EngineOutput(request_id, index, [], finish_reason=FinishReason.ERROR, error_message=message)
            for request_id, in_flight in self._requests.items()
            for index in sorted(in_flight.unfinished_sequences)
            if (request_id, index) not in finished
        ]
        if failed:
            log.error("%s: failing %d requests", message, len({output.request_id for output in failed}))
        return failed


def _has_final(outputs: list[EngineOutput] | StepOutputs) -> bool:
    """Whether a sequence ends in `outputs` (a final output is never a plain token column)."""
    objects = outputs.outputs if isinstance(outputs, StepOutputs) else outputs
    return any(output.is_finished for output in objects)
