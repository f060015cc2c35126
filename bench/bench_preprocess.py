"""Preprocess at scale (issue 10): tokens/s per core against raw `tokenizers`, single-request added
latency, and throughput with 1, 2 and 4 replicas, all in one run.

    python bench/bench_preprocess.py                        # Qwen3 tokenizer ($LLMSERVE_SHARED_ASSETS)
    python bench/bench_preprocess.py --tokenizer DIR --seconds 5 --replicas 1,2,4
    python bench/bench_preprocess.py --via pool         # through the gateway's PreprocessPool

Workload: --num-prompts distinct prompts of about --prompt-tokens tokens (words drawn from this
repo's docs, seeded), sent as `Preprocess` requests (text prompts, max_tokens 16), pre-serialized.
  - baseline (same run, same prompts): raw `tokenizers` in this process: `encode_batch` over all
    prompts for --seconds (tokens per CPU-second of the process, its threads included), and one
    prompt's `encode` / `encode_batch([prompt])` latency;
  - latency: one request at a time to one replica: the gRPC round trip as the client sees it, and
    the service's own `preprocess_time_ns` (handler start to response built);
  - throughput: N replicas (processes, --tokenizer-threads left at its default, the cores), driven for
    --seconds by --client-processes processes with --concurrency calls in flight each; CPU of
    the replicas from /proc over the window. Per core = tokens / replica CPU-seconds, the ratio
    is to the baseline's tokens per CPU-second. Requests/s and tokens/s are also given as a
    ratio to the 1-replica row. How a client spreads its calls (--via):
      channel  pre-serialized requests on one raw channel per replica, round-robin (the
               service's own cost, the least client CPU);
      pool     the gateway's client: services/gateway/preprocess_pool.PreprocessPool over the
               replicas (least in flight, health-aware), typed requests and responses built
               and parsed as the gateway does. What the gateway gets from N preprocess servers,
               without an inference hop in the way.
Prints a table and writes JSON to --results-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import tokenizers

from proc_cpu import CLOCK_TICKS_PER_S, snapshot
from llmserve.gateway.preprocess_pool import PreprocessPool
from llmserve.tools.service_process import ServiceProcess, stop_services
from llmserve.v1 import preprocess_pb2

REPO_ROOT = Path(__file__).resolve().parent.parent
METHOD = "/llmserve.v1.PreprocessService/Preprocess"
SHARED_ASSETS = Path(os.environ.get("LLMSERVE_SHARED_ASSETS", REPO_ROOT.parent / "shared/assets"))
TARGET_PER_CORE_RATIO = 0.8
TARGET_ADDED_LATENCY_MS = 0.3
STARTUP_TIMEOUT_S = 120.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=SHARED_ASSETS / "tokenizers/qwen3",
                        help="directory with tokenizer.json and tokenizer_config.json (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0, help="per slice (baseline or service)")
    parser.add_argument("--replicas", default="1,2,4", help="replica counts, comma-separated")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16, help="calls in flight per client process")
    parser.add_argument("--via", choices=("channel", "pool"), default="channel",
                        help="how clients reach the replicas (see above; default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating baseline/service rounds per cell")
    parser.add_argument("--latency-requests", type=int, default=200, help="requests per latency round")
    parser.add_argument("--service-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment of the replicas (repeatable), e.g. TOKENIZERS_PARALLELISM=true")
    parser.add_argument("--service-arg", action="append", default=[], metavar="FLAG",
                        help="extra flag for the replicas (repeatable), e.g. --service-arg=--tokenizer-threads=1")
    parser.add_argument("--results-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    return parser.parse_args()


def model_dir(tokenizer_dir: Path, out: Path) -> Path:
    """A checkpoint directory preprocess can load: the tokenizer files and a config.json."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 32768, "architectures": ["Bench"]}))
    return out


def make_prompts(tokenizer: tokenizers.Tokenizer, num_prompts: int, num_tokens: int) -> list[str]:
    words = " ".join(p.read_text() for p in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]).split()
    rng = random.Random(10)
    prompts = []
    for _ in range(num_prompts):
        chosen = [rng.choice(words) for _ in range(num_tokens // 3)]
        while len(tokenizer.encode(" ".join(chosen)).ids) < num_tokens:
            chosen += [rng.choice(words) for _ in range(16)]
        prompts.append(" ".join(chosen))
    return prompts


def baseline_slice(tokenizer: tokenizers.Tokenizer, prompts: list[str], seconds: float) -> dict:
    """Raw `encode_batch` over all prompts, repeatedly for `seconds`, in this process."""
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    num_tokens, rounds = 0, 0
    start_cpu, start_s = time.process_time(), time.perf_counter()
    while time.perf_counter() - start_s < seconds or rounds == 0:
        num_tokens += sum(len(e.ids) for e in encode_batch(prompts))
        rounds += 1
    wall_s, cpu_s = time.perf_counter() - start_s, time.process_time() - start_cpu
    return {"tokens_per_s": num_tokens / wall_s, "tokens_per_cpu_s": num_tokens / cpu_s, "cpu_pct": 100 * cpu_s / wall_s}


def raw_latency(tokenizer: tokenizers.Tokenizer, prompt: str, repeats: int) -> dict:
    """One prompt's raw `encode` and `encode_batch([prompt])`, each at its faster of this process's
    main thread and a worker thread (on this machine a worker thread was up to 2x faster, and the
    service encodes on one: the baseline gets the better of the two)."""
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    calls = {"encode_ms_p50": lambda: tokenizer.encode(prompt), "encode_batch_one_ms_p50": lambda: encode_batch([prompt])}
    with ThreadPoolExecutor(max_workers=1) as thread:
        return {key: min(_p50_ms(call, repeats), thread.submit(_p50_ms, call, repeats).result())
                for key, call in calls.items()}


def _p50_ms(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start_s) * 1000)
    return statistics.median(samples)


def requests_bytes(prompts: list[str]) -> list[bytes]:
    return [preprocess_pb2.PreprocessRequest(prompt=p, max_tokens=16).SerializeToString() for p in prompts]


def service_latency(address: str, payload: bytes, repeats: int) -> dict:
    """One request at a time: the client's round trip and the service's own time, p50."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        for _ in range(20):
            call(payload, timeout=30)
        round_trip_ms, service_ms = [], []
        for _ in range(repeats):
            start_s = time.perf_counter()
            response = call(payload, timeout=30)
            round_trip_ms.append((time.perf_counter() - start_s) * 1000)
            service_ms.append(preprocess_pb2.PreprocessResponse.FromString(response).preprocess_time_ns / 1e6)
    return {"grpc_ms_p50": statistics.median(round_trip_ms), "service_ms_p50": statistics.median(service_ms)}


def latency(address: str, tokenizer: tokenizers.Tokenizer, prompt: str, args) -> dict:
    """Raw and service latency measured in alternating rounds (the machine's load drifts), each
    the median over the rounds."""
    rounds = []
    for _ in range(args.rounds):
        rounds.append({**raw_latency(tokenizer, prompt, args.latency_requests),
                       **service_latency(address, requests_bytes([prompt])[0], args.latency_requests)})
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


class _ChannelSender:
    """Pre-serialized requests, round-robin over one raw channel per replica."""

    def __init__(self, addresses: list[str], payloads: list[bytes]):
        self._channels = [grpc.aio.insecure_channel(a, options=[("grpc.use_local_subchannel_pool", 1)])
                          for a in addresses]
        self._calls = [c.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
                       for c in self._channels]
        self._payloads = payloads

    async def warm_up(self) -> None:
        for call in self._calls:
            await call(self._payloads[0], timeout=30)

    async def send(self, index: int) -> None:
        await self._calls[index % len(self._calls)](self._payloads[index % len(self._payloads)], timeout=30)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class _PoolSender:
    """Text prompts through the gateway's PreprocessPool (it picks the replica)."""

    def __init__(self, addresses: list[str], prompts: list[str]):
        self._pool = PreprocessPool(lambda: addresses)
        self._inputs = list(prompts)
        self._num_replicas = len(addresses)

    async def warm_up(self) -> None:
        # Concurrent, so that least-in-flight reaches every replica's channel.
        await asyncio.gather(*(self.send(i) for i in range(2 * self._num_replicas)))

    async def send(self, index: int) -> None:
        await self._pool.preprocess(f"bench-{index}", self._inputs[index % len(self._inputs)], max_tokens=16,
                                    cache_salt="", timeout_s=30)

    async def close(self) -> None:
        await self._pool.close()


async def _drive(via: str, addresses: list[str], prompts: list[str], concurrency: int, commands, results) -> None:
    """Run a slice per command (start time, seconds), reporting each prompt's completed count."""
    sender = _PoolSender(addresses, prompts) if via == "pool" else _ChannelSender(addresses, requests_bytes(prompts))
    await sender.warm_up()  # connect before the first slice
    results.put("ready")
    while (command := await asyncio.to_thread(commands.get)) is not None:
        start_at, seconds = command
        counts = [0] * len(prompts)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = start_at + seconds

        async def loop(index: int) -> None:
            while time.time() < deadline:
                await sender.send(index)
                counts[index % len(prompts)] += 1
                index += concurrency

        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        results.put((counts, time.time()))
    await sender.close()


def client_process(via, addresses, prompts, concurrency, commands, results) -> None:
    asyncio.run(_drive(via, addresses, prompts, concurrency, commands, results))


class Clients:
    """--client-processes load generators spread over the replicas (--via), driven in slices."""

    def __init__(self, services: list[ServiceProcess], prompts: list[str], args):
        context = mp.get_context("spawn")  # grpc must not be forked
        self._results = context.Queue()
        self._commands = [context.Queue() for _ in range(args.client_processes)]
        addresses = [s.address for s in services]
        self._processes = [
            context.Process(target=client_process, daemon=True, args=(
                args.via, addresses[i:] + addresses[:i], prompts, args.concurrency, self._commands[i], self._results))
            for i in range(args.client_processes)
        ]
        for process in self._processes:
            process.start()
        for _ in self._processes:  # spawned, importing and connecting can outlast a slice's 1 s lead
            assert self._results.get(timeout=STARTUP_TIMEOUT_S) == "ready"
        self.role_pids = {"preprocess": [s.process.pid for s in services], "clients": [p.pid for p in self._processes]}

    def run_slice(self, seconds: float, tokens_per_prompt: list[int]) -> dict:
        start_at = time.time() + 1.0
        for commands in self._commands:
            commands.put((start_at, seconds))
        time.sleep(max(0.0, start_at - time.time()))
        before = snapshot(self.role_pids)
        outcomes = [self._results.get(timeout=seconds + 120) for _ in self._processes]
        after = snapshot(self.role_pids)
        window_s = max(end for _, end in outcomes) - start_at
        num_tokens = sum(n * tokens_per_prompt[i] for counts, _ in outcomes for i, n in enumerate(counts))
        num_requests = sum(sum(counts) for counts, _ in outcomes)
        cpu_s = {role: sum(after.process_ticks[pid][1] - before.process_ticks[pid][1] for pid in pids) / CLOCK_TICKS_PER_S
                 for role, pids in self.role_pids.items()}
        return {
            "requests": num_requests, "window_s": window_s, "requests_per_s": num_requests / window_s,
            "tokens_per_s": num_tokens / window_s, "preprocess_cpu_pct": 100 * cpu_s["preprocess"] / window_s,
            "client_cpu_pct": 100 * cpu_s["clients"] / window_s,
            "tokens_per_preprocess_cpu_s": num_tokens / cpu_s["preprocess"],
        }

    def close(self) -> None:
        for commands in self._commands:
            commands.put(None)
        for process in self._processes:
            process.join(timeout=30)


def throughput(services, tokens_per_prompt, tokenizer, prompts, args) -> dict:
    """Alternating slices of the baseline and of the service; the ratio is the median of the
    per-round ratios, so that a change in the machine's load hits both sides of each."""
    clients = Clients(services, prompts, args)
    try:
        rounds = []
        for _ in range(args.rounds):
            raw = baseline_slice(tokenizer, prompts, args.seconds)
            served = clients.run_slice(args.seconds, tokens_per_prompt)
            served["per_core_ratio"] = served["tokens_per_preprocess_cpu_s"] / raw["tokens_per_cpu_s"]
            rounds.append({"baseline": raw, "service": served})
    finally:
        clients.close()
    median = statistics.median
    return {
        "replicas": len(services),
        "requests": sum(r["service"]["requests"] for r in rounds),
        "per_core_ratio": median(r["service"]["per_core_ratio"] for r in rounds),
        "requests_per_s": median(r["service"]["requests_per_s"] for r in rounds),
        "tokens_per_s": median(r["service"]["tokens_per_s"] for r in rounds),
        "preprocess_cpu_pct": median(r["service"]["preprocess_cpu_pct"] for r in rounds),
        "client_cpu_pct": median(r["service"]["client_cpu_pct"] for r in rounds),
        "tokens_per_preprocess_cpu_s": median(r["service"]["tokens_per_preprocess_cpu_s"] for r in rounds),
        "baseline_tokens_per_s": median(r["baseline"]["tokens_per_s"] for r in rounds),
        "baseline_tokens_per_cpu_s": median(r["baseline"]["tokens_per_cpu_s"] for r in rounds),
        "baseline_cpu_pct": median(r["baseline"]["cpu_pct"] for r in rounds),
        "rounds": rounds,
    }


def check_answers(address: str, prompts: list[str], tokenizer: tokenizers.Tokenizer) -> None:
    """The service's ids equal the raw tokenizer's on every prompt (with special tokens)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        for prompt, payload in zip(prompts, requests_bytes(prompts)):
            response = preprocess_pb2.PreprocessResponse.FromString(call(payload, timeout=30))
            assert list(response.token_ids) == tokenizer.encode(prompt).ids, "the service's ids differ"


def start_replicas(model: Path, count: int, log_dir: Path, stack: contextlib.ExitStack, args) -> list[ServiceProcess]:
    env = {**os.environ, **dict(item.split("=", 1) for item in args.service_env)}
    services = []
    for i in range(count):
        service = ServiceProcess(
            f"preprocess-{i}", "llmserve.preprocess",
            ["--host", "127.0.0.1", "--port", "0", "--model", str(model), *args.service_arg],
            port_file=log_dir / f"preprocess-{i}.port", log_path=log_dir / f"preprocess-{i}.log", env=env,
        )
        stack.callback(stop_services, [[service]], 20.0)
        service.start()
        services.append(service)
    for service in services:
        service.wait_until_serving(STARTUP_TIMEOUT_S)
    return services


def add_ratios(rows: list[dict]) -> None:
    """Each row's requests/s and tokens/s over the 1-replica row's (the first row's without one)."""
    base = next((row for row in rows if row["replicas"] == 1), rows[0])
    for row in rows:
        for key in ("requests_per_s", "tokens_per_s"):
            row[f"{key}_ratio"] = row[key] / base[key]


def report(result: dict) -> str:
    lat = result["latency"]
    lines = [
        f"{result['num_prompts']} prompts x {result['prompt_tokens']} tokens (mean), {result['cores']} cores, "
        f"{result['rounds']} alternating rounds of {result['seconds']} s per cell (medians), clients --via {result['via']}",
        "",
        "| replicas | requests/s | preprocess tokens/s | vs 1 replica (requests/s, tokens/s) | preprocess CPU % | tokens per preprocess CPU-s | raw encode_batch tokens per CPU-s (same rounds) | per-core ratio | clients CPU % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["throughput"]:
        lines.append(
            f"| {row['replicas']} | {row['requests_per_s']:,.0f} | {row['tokens_per_s']:,.0f} | "
            f"**{row['requests_per_s_ratio']:.2f}x**, {row['tokens_per_s_ratio']:.2f}x | {row['preprocess_cpu_pct']:.0f} | "
            f"{row['tokens_per_preprocess_cpu_s']:,.0f} | {row['baseline_tokens_per_cpu_s']:,.0f} "
            f"({row['baseline_tokens_per_s']:,.0f}/s at {row['baseline_cpu_pct']:.0f}% CPU) | "
            f"**{row['per_core_ratio']:.2f}** | {row['client_cpu_pct']:.0f} |"
        )
    raw = {"raw `encode`": lat["encode_ms_p50"], "raw `encode_batch([prompt])`": lat["encode_batch_one_ms_p50"]}
    lines += [
        "",
        "| one request at a time, p50 | ms | added over raw `encode` | added over raw `encode_batch([prompt])` |",
        "| --- | --- | --- | --- |",
        *(f"| {name} | {ms:.3f} | | |" for name, ms in raw.items()),
        *(f"| {name} | {lat[key]:.3f} | {lat[key] - lat['encode_ms_p50']:+.3f} | {lat[key] - lat['encode_batch_one_ms_p50']:+.3f} |"
          for name, key in (("inside the service (`preprocess_time_ns`)", "service_ms_p50"),
                            ("through gRPC (client round trip)", "grpc_ms_p50"))),
    ]
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    if not (args.tokenizer / "tokenizer.json").is_file():
        print(f"no tokenizer.json in {args.tokenizer} (set LLMSERVE_SHARED_ASSETS or --tokenizer)", file=sys.stderr)
        return 2
    tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    prompts = make_prompts(tokenizer, args.num_prompts, args.prompt_tokens)
    tokens_per_prompt = [len(e.ids) for e in tokenizer.encode_batch(prompts)]
    result = {
        "num_prompts": len(prompts), "prompt_tokens": round(statistics.mean(tokens_per_prompt)),
        "cores": os.cpu_count(), "tokenizer": str(args.tokenizer), "rounds": args.rounds, "seconds": args.seconds,
        "service_env": args.service_env, "service_args": args.service_arg, "via": args.via, "throughput": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args.tokenizer, Path(tmp))
        for count in (int(n) for n in args.replicas.split(",")):
            with contextlib.ExitStack() as replicas:
                services = start_replicas(model, count, Path(tmp), replicas, args)
                check_answers(services[0].address, prompts[:8], tokenizer)
                if "latency" not in result:
                    result["latency"] = latency(services[0].address, tokenizer, prompts[0], args)
                    print(f"latency: {result['latency']}", flush=True)
                row = throughput(services, tokens_per_prompt, tokenizer, prompts, args)
                result["throughput"].append(row)
                print(f"throughput: { {k: v for k, v in row.items() if k != 'rounds'} }", flush=True)
    add_ratios(result["throughput"])
    table = report(result)
    print(table)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"preprocess-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({**result, "table": table}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
