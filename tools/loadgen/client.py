"""One load-generator client process: sends its share of the planned requests to the gateway's
streaming RPC on an asyncio loop and records when each message arrived.

A client process has its own event loop and gRPC channel, so the client side of a benchmark
scales past one core (at tens of thousands of messages per second one Python loop would be the
bottleneck it claims to measure). Times are `time.monotonic()`, one clock for every process of
the machine, so the coordinator can put every client's records on one time line.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from llmserve.call_balancing import WORKER_METADATA_KEY, balancing_options, reach_every_worker
from llmserve.tools.loadgen.conversation import Conversation
from llmserve.tools.loadgen.workload import PlannedRequest, WorkloadConfig
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

_MAX_MESSAGE_BYTES = 64 << 20  # a long prompt sent as text must not hit gRPC's 4 MiB default


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; times are seconds on the shared monotonic clock."""

    index: int
    prefix_group: int
    num_prompt_tokens: int  # planned; the server's count replaces it when the request succeeds
    max_tokens: int
    start_s: float = 0.0
    end_s: float = 0.0
    message_times_s: list[float] = field(default_factory=list)  # each message carrying tokens
    message_num_tokens: list[int] = field(default_factory=list)  # tokens in that message
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    num_pulled_tokens: int = 0  # of the cached ones, pulled from another replica (KV pull)
    # The serving engine's own report of the request's wait before its first step (Timings'
    # queue_time_ns on the last message); None where the server sent none (HTTP, a failure).
    queue_ms: float | None = None
    status: str = "OK"  # a grpc.StatusCode name; over HTTP also HTTP_<status> (openai_client.py)
    error: str = ""
    # The gateway worker that served it (its `x-gateway-worker` metadata); "" where none said.
    worker: str = ""
    # The answer, kept only in multi-turn runs (the next turn's prompt includes it).
    answer_text: str = ""
    answer_token_ids: list[int] = field(default_factory=list)

    @property
    def is_ok(self) -> bool:
        return self.status == "OK"

    @property
    def first_token_s(self) -> float | None:
        return self.message_times_s[0] if self.message_times_s else None


@dataclass(frozen=True, slots=True)
class ClientPlan:
    """A client's share of the run."""

    address: str  # gRPC HOST:PORT, or the OpenAI base URL (http://HOST:PORT/v1) with openai_client's connect
    requests: tuple[PlannedRequest, ...]
    workload: WorkloadConfig
    max_in_flight: int
    timeout_s: float
    ignore_eos: bool
    model: str = ""
    # Sends one request (the conversation's next turn) on the connection and records it. None: the
    # gateway's GenerateStream (send_one); bench/bench_stack.py sends to an inference replica,
    # openai_client.send_one to the OpenAI HTTP API. Module-level functions: the plan is pickled
    # into a spawned client, which imports them by name.
    send: Callable[[Any, PlannedRequest, "ClientPlan", Conversation], Awaitable[RequestRecord]] | None = None
    # Opens a connection `send` uses, num_connections times per client process. None: a gRPC
    # channel (grpc_connection).
    connect: Callable[["ClientPlan"], AbstractAsyncContextManager[Any]] | None = None
    # Connections this client spreads its conversations over, round robin. A multi-process
    # server (the gateway's --workers) is balanced by connection, so how many a load has
    # decides how evenly it spreads (docs/benchmarks.md, issue 19).
    num_connections: int = 1


def build_request(planned: PlannedRequest, workload: WorkloadConfig, ignore_eos: bool, model: str,
                  conversation: Conversation | None = None):
    """The gateway request for a planned one: greedy, exactly max_tokens when ignore_eos; its
    prompt is the conversation so far (none: a first turn) and the planned text."""
    sampling = common_pb2.SamplingParams(max_tokens=planned.max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    params = gateway_pb2.GenerateParams(model=model, sampling=sampling, return_token_ids=True)
    (conversation or Conversation(planned.prefix_text)).fill_prompt(params, planned, workload.prompt_form)
    return gateway_pb2.GenerateStreamRequest(params=params)


async def send_one(channel: grpc.aio.Channel, planned: PlannedRequest, plan: ClientPlan,
                   conversation: Conversation) -> RequestRecord:
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    record = RequestRecord(planned.index, planned.prefix_group, planned.num_prompt_tokens, planned.max_tokens)
    request = build_request(planned, plan.workload, plan.ignore_eos, plan.model, conversation)
    record.start_s = time.monotonic()
    stream = stub.GenerateStream(request, timeout=plan.timeout_s)
    await record_stream(record, stream, _result, keep_answer=plan.workload.num_turns > 1)
    record.worker = await _worker(stream)
    return record


async def _worker(stream) -> str:
    """The gateway worker that served `stream` (ended), from its initial metadata."""
    try:
        metadata = await stream.initial_metadata()
    except grpc.aio.AioRpcError:  # it failed before any headers
        return ""
    return dict(metadata or ()).get(WORKER_METADATA_KEY, "")


def _result(message: gateway_pb2.GenerateStreamResponse):
    return message.result if message.HasField("result") else None


async def record_stream(record: RequestRecord, stream, result_of, keep_answer: bool = False) -> RequestRecord:
    """Read a server stream into `record`: when each message carrying `token_ids` arrived, the
    usage and timings of the message for which `result_of(message)` gives a part holding them
    (`usage`, `timings`), a gRPC error as the status; with `keep_answer`, the streamed text and
    token ids too."""
    try:
        async for message in stream:
            now = time.monotonic()
            if message.token_ids:
                record.message_times_s.append(now)
                record.message_num_tokens.append(len(message.token_ids))
                if keep_answer:
                    record.answer_token_ids.extend(message.token_ids)
            if keep_answer:
                record.answer_text += message.text
            result = result_of(message)
            if result is not None:
                usage = result.usage
                if result.HasField("timings"):
                    record.queue_ms = result.timings.queue_time_ns / 1e6
                record.num_prompt_tokens = usage.prompt_tokens
                record.num_completion_tokens = usage.completion_tokens
                record.num_cached_tokens = usage.cached_tokens
                record.num_pulled_tokens = usage.pulled_tokens
    except grpc.aio.AioRpcError as error:
        record.status = error.code().name
        record.error = error.details() or ""
    record.end_s = time.monotonic()
    return record


async def run_plan(plan: ClientPlan, start_at_s: float, on_done=None) -> list[RequestRecord]:
    """Send every request of the plan (closed loop, or at its send time), at most
    `max_in_flight` at once, a conversation's turns one after the other (a failed turn ends its
    conversation: the later turns are recorded as not sent); `on_done(record)` after each."""
    send, connect = plan.send or send_one, plan.connect or grpc_connection
    async with AsyncExitStack() as connections:
        channels = [await connections.enter_async_context(connect(plan)) for _ in range(max(1, plan.num_connections))]
        in_flight = asyncio.Semaphore(plan.max_in_flight)

        async def converse(turns: list[PlannedRequest], channel) -> list[RequestRecord]:
            delay = start_at_s + turns[0].send_at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            conversation, records = Conversation(turns[0].prefix_text), []
            for planned in turns:
                if records and not records[-1].is_ok:
                    record = _not_sent(planned, records[-1])
                else:
                    async with in_flight:
                        record = await send(channel, planned, plan, conversation)
                    conversation.add(planned, record.answer_text, tuple(record.answer_token_ids))
                records.append(record)
                if on_done is not None:
                    on_done(record)
            return records

        conversations: dict[int, list[PlannedRequest]] = {}
        for planned in plan.requests:
            conversations.setdefault(planned.conversation, []).append(planned)
        done = await asyncio.gather(*(converse(turns, channels[i % len(channels)])
                                      for i, turns in enumerate(conversations.values())))
        return [record for records in done for record in records]


def grpc_channel(plan: ClientPlan) -> grpc.aio.Channel:
    # A local subchannel pool: a process's channels to one address with the same options would
    # otherwise share one connection (grpc's global pool), and num_connections would be one.
    # An `ipv4:A:P0,A:P1,...` address (a gateway's --worker-ports): round_robin, each call on the
    # next worker's connection (llmserve.call_balancing).
    options = [("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
               ("grpc.use_local_subchannel_pool", 1), *balancing_options(plan.address)]
    return grpc.aio.insecure_channel(plan.address, options=options)


@asynccontextmanager
async def grpc_connection(plan: ClientPlan):
    """grpc_channel, open; one that spreads calls over several addresses first reaches every one
    (llmserve.call_balancing: else the first burst goes where a connection was ready first)."""
    async with grpc_channel(plan) as channel:
        if balancing_options(plan.address):
            await reach_every_worker(channel, plan.address)
        yield channel


def _not_sent(planned: PlannedRequest, failed: RequestRecord) -> RequestRecord:
    """A turn after a failed one: not sent, reported with the failure that ended its conversation."""
    record = RequestRecord(planned.index, planned.prefix_group, planned.num_prompt_tokens, planned.max_tokens,
                           start_s=failed.end_s, end_s=failed.end_s, status=failed.status)
    record.error = f"not sent: turn {planned.turn - 1} of its conversation failed ({failed.error})"
    return record
