"""The service paths of bench_stack.py (`grpc`: the inference service; `gateway`: preprocess,
inference and the gateway; `http`: the same stack driven through the gateway's OpenAI HTTP API):
start the processes as the tests do (llmserve.tools.service_process: port 0, wait for SERVING,
SIGTERM at the end), drive them with llmserve.tools.loadgen's spawned workers, and sample the CPU
of every process (the bench process and its workers, each service) over each cell's window.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import engine_steps
import proc_cpu
import stack_drivers
import stack_hops
import stack_report
from llmserve.call_balancing import balanced_target
from llmserve.gateway.worker_ports import read_worker_ports
from llmserve.inference.engine_flags import engine_argv
from llmserve.tools.launcher import PREPROCESS_ENGINE_OPTIONS, worker_ports_file
from llmserve.tools.loadgen import openai_client
from llmserve.tools.loadgen.runner import RunConfig, run_workload
from llmserve.tools.loadgen.stats import summarize
from llmserve.tools.service_process import start_service, stop_service

STACK_PATHS = ("gateway", "http")  # the paths that run the whole stack


def free_port() -> int:
    """A port free on loopback now (for a server whose flag takes a port, not 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_services(path: str, args, options, model_dir: Path, log_dir: Path, http_port: int | None = None,
                   gateway_metrics_port: int | None = None, inference_metrics_port: int | None = None) -> dict:
    """The services of a path, started in order; role → ServiceProcess. `http_port`: the
    gateway's OpenAI HTTP API there (the http path); `..._metrics_port`: their /metrics."""
    model = ["--model", str(model_dir)]
    started: dict = {}
    try:
        if path in STACK_PATHS:
            shared = engine_argv(options, PREPROCESS_ENGINE_OPTIONS)  # block size and context, as `serve` does
            started["preprocess"] = start_service("preprocess", [*model, *shared], log_dir,
                                                  timeout_s=args.startup_timeout_s)
        metrics = ["--metrics-port", str(inference_metrics_port)] if inference_metrics_port is not None else []
        started["inference"] = start_service(
            "inference", [*model, *engine_argv(options), *metrics, *args.inference_arg], log_dir,
            timeout_s=args.startup_timeout_s)
        if path in STACK_PATHS:
            flags = ["--http-port", str(http_port)] if http_port is not None else []
            if gateway_metrics_port is not None:
                flags += ["--metrics-port", str(gateway_metrics_port)]
            if args.balance_calls:
                flags += ["--worker-ports", "0", "--worker-ports-file", str(worker_ports_file(log_dir))]
            started["gateway"] = start_service(
                "gateway", [*model, "--preprocess", started["preprocess"].address, "--inference",
                            started["inference"].address, *flags, *args.gateway_arg],
                log_dir, timeout_s=args.startup_timeout_s)
    except BaseException:
        stop_services(started)
        raise
    return started


def start_stack(model_dir: Path, log_dir: Path, *, inference_flags=(), gateway_flags=(), timeout_s: float) -> dict:
    """Preprocess, inference and a gateway in front of them, on one model, started in order
    (role → ServiceProcess; stop_services stops them)."""
    model = ["--model", str(model_dir)]
    started: dict = {}
    try:
        started["preprocess"] = start_service("preprocess", model, log_dir, timeout_s=timeout_s)
        started["inference"] = start_service("inference", [*model, *inference_flags], log_dir, timeout_s=timeout_s)
        started["gateway"] = start_service(
            "gateway", [*model, "--preprocess", started["preprocess"].address, "--inference",
                        started["inference"].address, *gateway_flags], log_dir, timeout_s=timeout_s)
    except BaseException:
        stop_services(started)
        raise
    return started


def gateway_target(gateway, args, log_dir: Path) -> str:
    """The clients' target: the gateway's port, or with --balance-calls every worker's own port."""
    if not args.balance_calls:
        return gateway.address
    return balanced_target("127.0.0.1", read_worker_ports(worker_ports_file(log_dir)))


def stop_services(services: dict) -> None:
    for service in reversed(list(services.values())):  # the gateway first, as the launcher does
        stop_service(service)


def run_services(path: str, args, options, model_dir: Path, plans: stack_drivers.Plans, on_cell, log_dir: Path) -> None:
    http_port = free_port() if path == "http" else None
    metrics_port = free_port() if path in STACK_PATHS else None  # the first token's hops (stack_hops.py)
    inference_metrics_port = free_port()  # the engine's steps (engine_steps.py)
    services = start_services(path, args, options, model_dir, log_dir, http_port, metrics_port, inference_metrics_port)
    on_cell("startup", None)
    service_pids = {role: [service.process.pid] for role, service in services.items()}
    server_pids = {pid for pids in service_pids.values() for pid in pids}

    def role_pids() -> dict[str, list[int]]:
        clients = [pid for pid in proc_cpu.child_pids(os.getpid()) if pid not in server_pids]
        # the inference server's engine-core process (absent with --no-core-process)
        engine_core = [pid for server in service_pids["inference"] for pid in proc_cpu.child_pids(server)]
        roles = {"bench": [os.getpid(), *clients], "engine-core": engine_core, **service_pids}
        if "gateway" in roles:  # with --workers N the gateway's children serve (not multiprocessing's tracker)
            workers = [pid for pid in proc_cpu.child_pids(roles["gateway"][0])
                       if "resource_tracker" not in proc_cpu.command_line(pid)]
            roles["gateway"] = [*roles["gateway"], *workers]
        return roles

    front = services["gateway" if path in STACK_PATHS else "inference"]
    driver: dict = {"address": gateway_target(front, args, log_dir) if path == "gateway" else front.address}
    if path == "grpc":
        driver["send"] = stack_drivers.send_to_inference
    elif path == "http":
        base_url = f"http://127.0.0.1:{http_port}/v1"
        driver = {"address": base_url, "send": openai_client.send_one, "connect": openai_client.connect,
                  "model": openai_client.served_model(base_url)}

    def run(cell: stack_drivers.PlannedCell):
        config = RunConfig(concurrency=cell.streams, num_client_processes=args.client_processes, show_progress=False,
                           connections_per_client=args.connections_per_client, **driver)
        return run_workload(cell.requests, cell.workload, config)

    try:
        run(plans.warmup)
        with proc_cpu.CpuSampler(role_pids) as sampler:
            for repeat, cell in plans.in_order():
                hops_before = stack_hops.scrape_hops(metrics_port) if metrics_port else None
                steps_before = engine_steps.scrape_steps(inference_metrics_port)
                result = run(cell)
                steps = engine_steps.scrape_steps(inference_metrics_port).since(steps_before)
                summary = summarize(result.records, result.start_s, result.end_s)
                time.sleep(1.5 * proc_cpu.SAMPLE_INTERVAL_S)  # a sample after the window: usage() brackets it
                measured = stack_report.measurement(summary, sampler.usage(result.start_s, result.end_s))
                measured["engine_steps"] = steps.summary(result.end_s - result.start_s)
                if hops_before is not None:
                    hops_after = stack_hops.scrape_hops(metrics_port)
                    measured["first_token_hops_ms"] = stack_hops.hop_means_ms(hops_before, hops_after, result.records)
                on_cell(cell.streams, measured, repeat)
    finally:
        stop_services(services)
