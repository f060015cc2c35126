"""How bench_stack.py drives each path: the same planned requests, `concurrency` in flight (a new
one starts as one finishes), greedy, ignore_eos; every request recorded as a loadgen
RequestRecord (monotonic times of each message that carried tokens), so one set of statistics
(llmserve.tools.loadgen.stats) measures every path the same way.

  drive_core          an EngineCore stepped by a plain loop on this thread;
  drive_async_engine  an AsyncEngine (engine thread + this event loop), one task per stream;
  send_to_inference   one request to an inference replica's GenerateTokens, for loadgen's
                      workers (ClientPlan.send); the gateway path uses loadgen's own send_one.
The requests (`Plans`) are planned once by loadgen's planner, token ids and text alike, and sent
on every path.

This module is imported by spawned loadgen workers: it must not import torch.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from llmserve.engine_output import EngineOutput
from llmserve.inference.output_stream import OutputStream
from llmserve.inference.engine.types import EngineCore, EngineRequest
from llmserve.tools.loadgen.client import RequestRecord, ClientPlan, record_stream
from llmserve.tools.loadgen.workload import (
    LengthDistribution, PlannedRequest, PromptBuilder, PromptForm, WorkloadConfig, plan_requests,
)
from llmserve.sampling import SamplingParams
from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc


WARMUP_SEED_OFFSET = 1_000_003  # far from any cell's seed (--seed + streams)
REPEAT_SEED_STRIDE = 100_003  # a repeat's cells: seeds this far from the previous repeat's


@dataclass(frozen=True, slots=True)
class PlannedCell:
    streams: int  # requests in flight
    workload: WorkloadConfig
    requests: list[PlannedRequest]


class Plans:
    """Every cell's requests and the warm-up's (max streams in flight, short outputs), by
    (streams, repeat). A cell's seed is --seed + its streams + REPEAT_SEED_STRIDE x (repeat - 1):
    its own prompts (no prefix-cache hits across cells or repeats), the same on every path. The
    gateway path sends them as --prompt-form says (token ids, or text that tokenizes to them)."""

    def __init__(self, args, builder: PromptBuilder):
        prompt_form = PromptForm(args.prompt_form)

        def cell(streams: int, num_requests: int, output_tokens: int, seed: int) -> PlannedCell:
            workload = WorkloadConfig(num_requests, LengthDistribution("fixed", args.prompt_tokens),
                                      LengthDistribution("fixed", output_tokens), seed=seed, prompt_form=prompt_form)
            return PlannedCell(streams, workload, plan_requests(workload, builder))

        most = max(args.streams)
        self.warmup = cell(most, most, args.warmup_output_tokens, args.seed + WARMUP_SEED_OFFSET)
        self.cells = {
            (streams, repeat): cell(streams, max(args.min_requests, round(args.requests_per_stream * streams)),
                                    args.output_tokens, args.seed + streams + REPEAT_SEED_STRIDE * (repeat - 1))
            for streams in args.streams for repeat in range(1, args.repeat + 1)
        }

    def in_order(self) -> list[tuple[int, PlannedCell]]:
        """(repeat, cell): every stream count once per repeat, repeats one after the other."""
        return [(repeat, planned) for (_, repeat), planned in sorted(self.cells.items(), key=lambda item: item[0][::-1])]


def engine_request(planned: PlannedRequest, request_id: str) -> EngineRequest:
    sampling = SamplingParams(max_tokens=planned.max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id, list(planned.prompt_token_ids), sampling, time.monotonic_ns())


def new_record(planned: PlannedRequest) -> RequestRecord:
    record = RequestRecord(planned.index, planned.prefix_group, planned.num_prompt_tokens, planned.max_tokens)
    record.start_s = time.monotonic()
    return record


def record_output(record: RequestRecord, output: EngineOutput, now_s: float) -> None:
    if output.new_token_ids:
        record.message_times_s.append(now_s)
        record.message_num_tokens.append(len(output.new_token_ids))
    if output.error_message:
        record.status, record.error = "INTERNAL", output.error_message
    if output.is_finished:
        record.end_s = now_s
        record.num_prompt_tokens = output.num_prompt_tokens
        record.num_completion_tokens = output.num_completion_tokens
        record.num_cached_tokens = output.num_cached_tokens
        record.queue_ms = output.queue_time_ns / 1e6


def drive_core(core: EngineCore, planned: list[PlannedRequest], concurrency: int, tag: str,
               on_step: Callable[[float, int], None] | None = None) -> list[RequestRecord]:
    """`while core.has_requests_in_flight(): core.step()`, topping the batch up to
    `concurrency` after each step: the baseline every other path is compared with.
    `on_step(seconds, sequences)` after each step: its wall time and the batch it ran."""
    waiting = collections.deque(planned)
    records: dict[str, RequestRecord] = {}

    def add_next() -> None:
        request = waiting.popleft()
        request_id = f"{tag}-{request.index}"
        records[request_id] = new_record(request)
        core.add_request(engine_request(request, request_id))

    for _ in range(min(concurrency, len(waiting))):
        add_next()
    while core.has_requests_in_flight():
        started_s = time.monotonic()
        outputs = core.step()
        now_s = time.monotonic()
        if on_step is not None:
            on_step(now_s - started_s, core.scheduled_batch()[0])
        for output in outputs:
            record_output(records[output.request_id], output, now_s)
            if output.is_finished and waiting:
                add_next()
    return sorted(records.values(), key=lambda record: record.index)


async def drive_async_engine(engine, planned: list[PlannedRequest], concurrency: int, tag: str) -> list[RequestRecord]:
    """`concurrency` tasks, each streaming one request at a time through an OutputStream (the
    machinery GenerateTokens serves a request with)."""
    waiting = iter(planned)
    records: list[RequestRecord] = []

    async def stream() -> None:
        for request in waiting:  # one iterator shared by the tasks: each request is taken once
            record = new_record(request)
            outputs = OutputStream(engine)
            outputs.start(engine_request(request, f"{tag}-{request.index}"))
            async for output in outputs.outputs():
                record_output(record, output, time.monotonic())
            records.append(record)

    await asyncio.gather(*(stream() for _ in range(concurrency)))
    return sorted(records, key=lambda record: record.index)


async def send_to_inference(channel: grpc.aio.Channel, planned: PlannedRequest, plan: ClientPlan,
                            conversation) -> RequestRecord:
    """One GenerateTokens call with the planned prompt's token ids (ClientPlan.send; single turns
    only: `conversation` is always empty)."""
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    sampling = common_pb2.SamplingParams(max_tokens=planned.max_tokens, temperature=0.0, ignore_eos=plan.ignore_eos)
    request = inference_pb2.GenerateTokensRequest(
        request_id=f"bench-{planned.index}-{time.monotonic_ns()}", prompt_token_ids=planned.prompt_token_ids,
        sampling=sampling,
    )
    record = new_record(planned)
    stream = stub.GenerateTokens(request, timeout=plan.timeout_s)
    return await record_stream(record, stream, _final)


def _final(message: inference_pb2.GenerateTokensResponse):
    return message if message.HasField("usage") else None  # usage and timings: the last message only
