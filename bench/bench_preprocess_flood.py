"""Oversized prompts at the door: how fast they are refused, and what they do to a normal request
sent beside them (issue 9's target: four 10 MB prompts refused in <= 50 ms each, a concurrent
normal request <= 2x its idle latency, both measured in this run).

    python bench/bench_preprocess_flood.py                       # the default model (SmolLM2-135M)
    python bench/bench_preprocess_flood.py --model DIR --rounds 10 --configs receive-limit,byte-cap

Each configuration starts real servers (subprocesses) once:
  receive-limit: preprocess with default flags; a 10 MB message is over its receive limit (the
                 derived prompt byte cap + 64 KiB), refused unparsed (RESOURCE_EXHAUSTED);
  byte-cap:      preprocess with --max-prompt-bytes 10 MiB - 1: the message is parsed and the
                 byte cap refuses it on the event loop, untokenized (INVALID_ARGUMENT);
  gateway:       the full stack (preprocess, inference on the torch backend, gateway), as a
                 client sees it: the gateway's receive limit refuses the 10 MB prompts, and the
                 normal request generates --normal-max-tokens tokens (greedy, ignore_eos).
Per configuration: the normal request's idle latency (median of --idle-requests), then --rounds
rounds of four 10 MB prompts sent at once while normal requests go back to back until the four
are answered (every one of them is a normal request concurrent with the flood). Each sender has
its own channel, the four huge ones a process of their own (five clients), all pre-serialized, so
the client's own work is not what is measured. Also the peak RSS (VmHWM) of the process the flood
hits. Prints a table and writes JSON to --results-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import queue
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from llmserve.tools.service_process import ServiceProcess, start_service, stop_service
from llmserve.v1 import common_pb2, gateway_pb2, preprocess_pb2

REPO_ROOT = Path(__file__).resolve().parent.parent
TEN_MB = 10 * 1024 * 1024
NUM_HUGE = 4
CONFIGS = ("receive-limit", "byte-cap", "gateway")
TARGET_REFUSAL_MS = 50.0
TARGET_NORMAL_RATIO = 2.0
NORMAL_PROMPT = "The capital of France is Paris, and the capital of Italy is Rome. " * 6
STARTUP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Target:
    """Where the flood goes: the address, the method and the two pre-serialized requests."""

    address: str
    method: str
    normal: bytes
    huge: bytes
    pid: int  # the process the flood hits (its peak RSS is reported)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the default model)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of %(default)s")
    parser.add_argument("--rounds", type=int, default=5, help="flood rounds per configuration (default: %(default)s)")
    parser.add_argument("--idle-requests", type=int, default=20, help="normal requests for the idle latency")
    parser.add_argument("--normal-max-tokens", type=int, default=16,
                        help="tokens the gateway's normal request generates (default: %(default)s)")
    parser.add_argument("--results-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    return parser.parse_args()


def start(name: str, args: list[str], log_dir: Path, stack: contextlib.ExitStack) -> ServiceProcess:
    service = start_service(name, args, log_dir, timeout_s=STARTUP_TIMEOUT_S)
    stack.callback(stop_service, service)
    return service


def preprocess_target(service: ServiceProcess) -> Target:
    normal = preprocess_pb2.PreprocessRequest(request_id="normal", prompt=NORMAL_PROMPT, max_tokens=16)
    huge = preprocess_pb2.PreprocessRequest(request_id="huge", prompt="a" * TEN_MB)
    return Target(service.address, "/llmserve.v1.PreprocessService/Preprocess", normal.SerializeToString(),
                  huge.SerializeToString(), service.process.pid)


def gateway_target(service: ServiceProcess, max_tokens: int) -> Target:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    normal = gateway_pb2.GenerateRequest(params=gateway_pb2.GenerateParams(prompt=NORMAL_PROMPT, sampling=sampling))
    huge = gateway_pb2.GenerateRequest(params=gateway_pb2.GenerateParams(prompt="a" * TEN_MB, sampling=sampling))
    return Target(service.address, "/llmserve.v1.GatewayService/Generate", normal.SerializeToString(),
                  huge.SerializeToString(), service.process.pid)


def start_config(name: str, model: Path, args: argparse.Namespace, log_dir: Path, stack) -> Target:
    flags = ["--model", str(model)]
    if name == "receive-limit":
        return preprocess_target(start("preprocess", flags, log_dir, stack))
    if name == "byte-cap":
        return preprocess_target(start("preprocess", [*flags, "--max-prompt-bytes", str(TEN_MB - 1)], log_dir, stack))
    preprocess = start("preprocess", flags, log_dir, stack)
    inference = start("inference", flags, log_dir, stack)
    hops = ["--preprocess", preprocess.address, "--inference", inference.address]
    return gateway_target(start("gateway", [*flags, *hops], log_dir, stack), args.normal_max_tokens)


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def timed_call(call, payload: bytes) -> tuple[float, str]:
    """(milliseconds, status name) of one pre-serialized call."""
    start_s = time.perf_counter()
    try:
        await call(payload, timeout=300)
        status = "OK"
    except grpc.aio.AioRpcError as error:
        status = error.code().name
    return (time.perf_counter() - start_s) * 1000, status


def _channel_calls(target: Target, num: int) -> tuple[list[grpc.aio.Channel], list]:
    channels = [grpc.aio.insecure_channel(target.address) for _ in range(num)]
    calls = [c.unary_unary(target.method, request_serializer=None, response_deserializer=None) for c in channels]
    return channels, calls


async def _flood(target: Target, rounds: int, barrier, results) -> None:
    channels, calls = _channel_calls(target, NUM_HUGE)
    try:
        for _ in range(rounds):
            await asyncio.to_thread(barrier.wait)
            results.put(await asyncio.gather(*(timed_call(call, target.huge) for call in calls)))
    finally:
        for channel in channels:
            await channel.close()


def flood_process(target: Target, rounds: int, barrier, results) -> None:
    """The four senders of 10 MB prompts: a process of their own, so that pushing 40 MB does not
    slow the normal request's client (in production they are other machines)."""
    asyncio.run(_flood(target, rounds, barrier, results))


async def measure(target: Target, rounds: int, idle_requests: int) -> dict:
    context = mp.get_context("spawn")  # grpc must not be forked
    barrier, results = context.Barrier(2), context.Queue()
    flooder = context.Process(target=flood_process, args=(target, rounds, barrier, results), daemon=True)
    flooder.start()
    channels, (normal_call,) = _channel_calls(target, 1)
    try:
        for _ in range(3):  # warm-up: connections, caches
            await timed_call(normal_call, target.normal)
        idle = [(await timed_call(normal_call, target.normal))[0] for _ in range(idle_requests)]
        rss_before_mb = peak_rss_mb(target.pid)
        refusals, flooded, statuses = [], [], {}
        for _ in range(rounds):
            await asyncio.to_thread(barrier.wait)
            refused = None
            while refused is None:  # normal requests back to back while the flood lasts
                normal_ms, normal_status = await timed_call(normal_call, target.normal)
                assert normal_status == "OK", f"the normal request failed: {normal_status}"
                flooded.append(normal_ms)
                with contextlib.suppress(queue.Empty):
                    refused = results.get_nowait()
            for ms, status in refused:
                refusals.append(ms)
                statuses[status] = statuses.get(status, 0) + 1
    finally:
        await channels[0].close()
        flooder.join(timeout=60)
    idle_ms = statistics.median(idle)
    return {
        "idle_normal_ms_p50": idle_ms,
        "refusal_ms_p50": statistics.median(refusals),
        "refusal_ms_max": max(refusals),
        "refusal_statuses": statuses,
        "num_flooded_normal": len(flooded),
        "flooded_normal_ms_p50": statistics.median(flooded),
        "flooded_normal_ms_max": max(flooded),
        "normal_ratio_p50": statistics.median(flooded) / idle_ms,
        "normal_ratio_max": max(flooded) / idle_ms,
        "peak_rss_mb_before": rss_before_mb,
        "peak_rss_mb_after": peak_rss_mb(target.pid),
    }


def run_config(name: str, model: Path, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"flood-{name}-") as log_dir, contextlib.ExitStack() as stack:
        target = start_config(name, model, args, Path(log_dir), stack)
        result = asyncio.run(measure(target, args.rounds, args.idle_requests))
    result["meets_target"] = (
        result["refusal_ms_max"] <= TARGET_REFUSAL_MS and result["normal_ratio_max"] <= TARGET_NORMAL_RATIO
    )
    return {"config": name, **result}


def print_table(rows: list[dict]) -> None:
    header = (f"{'config':<14} {'refused as':<22} {'refusal p50/max ms':>19} {'idle ms':>8} "
              f"{'flooded p50/max ms':>19} {'ratio p50/max':>14} {'peak RSS MB':>12} {'target':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        statuses = ",".join(f"{k} x{v}" for k, v in r["refusal_statuses"].items())
        print(f"{r['config']:<14} {statuses:<22} {r['refusal_ms_p50']:>9.1f}/{r['refusal_ms_max']:<9.1f} "
              f"{r['idle_normal_ms_p50']:>8.1f} {r['flooded_normal_ms_p50']:>9.1f}/{r['flooded_normal_ms_max']:<9.1f} "
              f"{r['normal_ratio_p50']:>6.2f}/{r['normal_ratio_max']:<7.2f} "
              f"{r['peak_rss_mb_before']:>5.0f}->{r['peak_rss_mb_after']:<5.0f} "
              f"{'met' if r['meets_target'] else 'MISSED':>7}")


def main() -> None:
    args = parse_args()
    configs = [name for name in args.configs.split(",") if name]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.model:
        model = Path(args.model).expanduser()
    else:
        from llmserve.tools.model_store import resolve_model

        model = resolve_model(None)
    rows = [run_config(name, model, args) for name in configs]
    print_table(rows)
    report = {
        "model": str(model), "num_huge_prompts": NUM_HUGE, "huge_prompt_bytes": TEN_MB, "rounds": args.rounds,
        "targets": {"refusal_ms_max": TARGET_REFUSAL_MS, "normal_ratio_max": TARGET_NORMAL_RATIO}, "configs": rows,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"preprocess-flood-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
