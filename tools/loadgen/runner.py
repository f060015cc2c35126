"""Runs a planned workload over one or more client processes, with a live progress bar.

    coordinator                          client k (spawned)
    plan_requests → shares [k::W] ──▶   take a share (a queue), report ready
    all ready: start_at = now + 0.2 s ─▶ send its share (client.run_plan)
    progress bar ◀── one event per finished request
    records      ◀── its RequestRecords, then exit

Every client starts on the same `start_at`, so a Poisson schedule split round-robin over the
clients is still the planned schedule, and a fixed concurrency is split as evenly as it goes.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from llmserve.tools.loadgen.client import RequestRecord, ClientPlan, run_plan
from llmserve.tools.loadgen.workload import PlannedRequest, WorkloadConfig

_START_DELAY_S = 0.2  # after every client is ready: time to hand out the start time
_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class RunConfig:
    address: str
    concurrency: int  # requests in flight at most, over all clients
    num_client_processes: int = 1
    timeout_s: float = 600.0  # per-request gRPC deadline
    ignore_eos: bool = True
    model: str = ""
    show_progress: bool = True
    send: Callable | None = None  # ClientPlan.send: None sends to the gateway
    connect: Callable | None = None  # ClientPlan.connect: None opens a gRPC channel
    connections_per_client: int = 1  # ClientPlan.num_connections


@dataclass(frozen=True, slots=True)
class RunResult:
    records: list[RequestRecord]
    start_s: float  # when sending began, on the records' clock
    end_s: float  # when the last request ended
    # CPU (user + system, every thread) the client processes spent sending and reading, summed:
    # what shows whether the client, not the server, was the bottleneck.
    client_cpu_s: float = 0.0


def client_plans(planned: list[PlannedRequest], workload: WorkloadConfig, config: RunConfig) -> list[ClientPlan]:
    num_conversations = len({p.conversation for p in planned})
    num_client_processes = max(1, min(config.num_client_processes, num_conversations, config.concurrency))
    plans = []
    for k in range(num_client_processes):
        # Whole conversations per client: a conversation's turns go one after the other.
        share = tuple(p for p in planned if p.conversation % num_client_processes == k)
        max_in_flight = config.concurrency // num_client_processes + (1 if k < config.concurrency % num_client_processes else 0)
        plans.append(ClientPlan(config.address, share, workload, max_in_flight, config.timeout_s,
                                config.ignore_eos, config.model, config.send, config.connect,
                                config.connections_per_client))
    return plans


def run_workload(planned: list[PlannedRequest], workload: WorkloadConfig, config: RunConfig) -> RunResult:
    plans = client_plans(planned, workload, config)
    context = mp.get_context("spawn")  # no fork: grpc's threads do not survive one
    events, plans_to_take = context.Queue(), context.Queue()
    start_at = context.Value("d", 0.0)
    # A plan is not a Process argument: spawn writes the arguments into the child's pipe, and
    # a write above the pipe's 64 KB blocks start() until that child has imported the main
    # module (torch, for a bench): the clients started one after another, 70 s for 16 with
    # 256 streams of 512-token text on the H200. From a queue, all import at once.
    clients = [context.Process(target=_client_main, args=(plans_to_take, start_at, events), daemon=True) for _ in plans]
    for client in clients:
        client.start()
    for plan in plans:
        plans_to_take.put(plan)
    try:
        return _collect(clients, events, start_at, len(planned), config.show_progress)
    finally:
        for client in clients:
            client.join(timeout=5)
            if client.is_alive():
                client.kill()


def _collect(clients, events, start_at, num_requests: int, show_progress: bool) -> RunResult:
    num_ready, records, num_finished_clients, client_cpu_s = 0, [], 0, 0.0
    bar = tqdm(total=num_requests, unit="req", desc="bench", disable=not show_progress, dynamic_ncols=True)
    errors = 0
    with bar:
        while num_finished_clients < len(clients):
            try:
                kind, payload = events.get(timeout=_POLL_S)
            except queue.Empty:
                _check_alive(clients)
                continue
            if kind == "ready":
                num_ready += 1
                if num_ready == len(clients):
                    start_at.value = time.monotonic() + _START_DELAY_S
            elif kind == "done":
                errors += payload != "OK"
                bar.update(1)
                bar.set_postfix(errors=errors, refresh=False)
            elif kind == "records":
                records.extend(payload[0])
                client_cpu_s += payload[1]
                num_finished_clients += 1
            elif kind == "failed":
                raise RuntimeError(f"a load-generator client process failed: {payload}")
    records.sort(key=lambda record: record.index)
    end_s = max((record.end_s for record in records), default=start_at.value)
    return RunResult(records, start_at.value, end_s, client_cpu_s)


def _check_alive(clients) -> None:
    dead = [w for w in clients if not w.is_alive() and w.exitcode not in (0, None)]
    if dead:
        raise RuntimeError(f"a load-generator client process exited with code {dead[0].exitcode}")


def _client_main(plans_to_take, start_at, events) -> None:
    try:
        plan: ClientPlan = plans_to_take.get()
        events.put(("ready", None))
        while start_at.value == 0.0:
            time.sleep(0.005)
        cpu_before_s = time.process_time()  # after the imports and the spawn: the run's own CPU
        records = asyncio.run(run_plan(plan, start_at.value, lambda r: events.put(("done", r.status))))
        events.put(("records", (records, time.process_time() - cpu_before_s)))
    except BaseException as exc:  # noqa: BLE001 — reported to the coordinator, which raises
        events.put(("failed", f"{type(exc).__name__}: {exc}"))
