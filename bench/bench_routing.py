"""KV-aware routing against round-robin: several inference replicas behind one gateway (issue 10).

    python bench/bench_routing.py                                  # H200: 4 replicas of the 1.5B shape on one GPU
    python bench/bench_routing.py --policies kv,round-robin,least-loaded --concurrency 96
    python bench/bench_routing.py --smoke                          # CPU, tiny model: that it runs
    python bench/bench_routing.py --policies kv-pull,kv,round-robin   # issue 22: kv routing with KV pull
    python bench/bench_routing.py --gpu-per-replica                # issue 23: replica k on GPU k (4 GPUs)

For each routing policy, a fresh stack (preprocess, --replicas inference replicas on the same
device, a gateway with `--routing POLICY` over all of them) serves the same seeded workload:
--conversations conversations of --turns turns (llmserve bench's conversations: each turn's
prompt is the conversation so far plus a new message), each opening with one of --prefix-groups
system prompts of --prefix-tokens tokens, sent as token ids (exact reuse: the ideal is known),
--concurrency turns in flight. Each replica's KV pool is capped (--num-kv-blocks) below the
system prompts' total, so no one replica can hold every prefix: round-robin spreads each prefix
over every replica and evicts, KV-aware routing keeps each prefix where it is cached.

Per policy: output tok/s, TTFT p50/p90/p99, cached prompt tokens against the ideal (every turn
finds its whole history cached, and a conversation's first turn its system prompt once another
conversation of its group ran), requests per replica, and the mean requests in flight on each
replica (running + waiting, sampled every 20 ms while at least half of --concurrency is) with
their max over min [kv <= 1.5x: the imbalance bound and the load weight keep the holder of a
popular prefix from becoming a hot spot]. Ratios against round-robin, measured in the same run:
p90 TTFT [kv <= 0.3x], output tok/s [kv >= 1.5x]. Table + --out-dir/routing-<time>.json.

`kv-pull` (issue 22) is kv routing with KV pull: every replica runs --kv-pull and the gateway
--routing-kv-pull, so a request whose prefix's holder is busy goes to a quieter replica that
pulls the prefix (CUDA IPC on one GPU, /dev/shm on CPU) instead of recomputing it. When kv runs
in the same invocation, kv-pull's ratios to it are reported too: p90 TTFT [<= 0.5x], output
tok/s [>= 1.1x]; and to round-robin [p90 <= 0.3x, tok/s >= 1.5x].

The CPU routing show of tests/test_routing.py (3 replicas, 18 clients) measured its loads the
same way; they depend on how a loaded CPU shares its cores between the replicas, so they are
measured here, not asserted there:

    python bench/bench_routing.py --shape tiny --device cpu --replicas 3 --num-kv-blocks 512 \
        --prefix-groups 3 --prefix-tokens 32 --conversations 54 --turns 2 --prompt-tokens 80 \
        --output-tokens 8 --concurrency 18 --client-processes 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

import bench_stack
from llmserve.tools.loadgen.runner import RunConfig, run_workload
from llmserve.tools.loadgen.stats import summarize
from llmserve.tools.loadgen.workload import LengthDistribution, PromptBuilder, PromptForm, WorkloadConfig, plan_requests
from llmserve.tools.service_process import launch_service, start_service, stop_service
from llmserve.v1 import inference_pb2, inference_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
LOAD_SAMPLE_INTERVAL_S = 0.02


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_stack.add_model_arguments(parser)
    parser.add_argument("--policies", default="kv,round-robin")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--gpu-per-replica", action="store_true",
                        help="replica k on GPU k (cuda:k), not every replica on --device (issue 23: a multi-GPU host)")
    parser.add_argument("--num-kv-blocks", type=int, default=1536, help="KV blocks per replica (16 tokens each): below the system prompts plus what is in flight")
    parser.add_argument("--prefix-groups", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--conversations", type=int, default=192)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="new tokens per turn")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag (repeatable)")
    parser.add_argument("--inference-arg", action="append", default=[], help="extra inference flag (repeatable)")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few conversations")
    args = parser.parse_args(argv)
    if args.gpu_per_replica and not args.device.startswith("cuda"):
        parser.error("--gpu-per-replica places replicas on GPUs: give --device cuda")
    if args.smoke:
        args.shape, args.device, args.replicas, args.num_kv_blocks = "tiny", "cpu", 3, 64
        args.prefix_groups, args.prefix_tokens, args.conversations, args.turns = 3, 96, 12, 2
        args.prompt_tokens, args.output_tokens, args.concurrency, args.client_processes = 16, 4, 6, 1
    return args


def workload(args) -> WorkloadConfig:
    return WorkloadConfig(
        num_requests=args.conversations * args.turns, prompt_tokens=LengthDistribution.parse(str(args.prompt_tokens)),
        output_tokens=LengthDistribution.parse(str(args.output_tokens)), seed=args.seed,
        num_prefix_groups=args.prefix_groups, prefix_tokens=args.prefix_tokens, prompt_form=PromptForm.TOKEN_IDS,
        num_turns=args.turns,
    )


def ideal_cached_tokens(planned, output_tokens: int, prefix_lengths: dict[int, int]) -> int:
    """Cached prompt tokens if every turn found everything reusable: its history's full blocks
    (the last answer token is never computed), and for a first turn its system prompt's full
    blocks (`prefix_lengths`: tokens per group) once an earlier conversation of the group was sent."""
    total, history, seen_groups = 0, 0, set()
    for request in planned:
        if request.turn == 0:
            history = 0
        prompt = history + len(request.prompt_token_ids)
        if request.turn == 0:
            if request.prefix_group in seen_groups:
                total += min(prompt - 1, prefix_lengths[request.prefix_group]) // BLOCK_SIZE * BLOCK_SIZE
            seen_groups.add(request.prefix_group)
        else:
            total += min(history - 1, prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
        history = prompt + output_tokens
    return total


# A policy name → (the gateway's --routing, extra gateway flags, extra inference flags).
POLICY_FLAGS = {"kv-pull": ("kv", ["--routing-kv-pull"], ["--kv-pull"])}


def replica_device(args, k: int) -> str:
    """Replica k's --device: its own GPU with --gpu-per-replica, else the one every replica shares."""
    return f"cuda:{k}" if args.gpu_per_replica else args.device


def start_stack(args, policy: str, model_dir: Path, log_dir: Path) -> list:
    model = ["--model", str(model_dir)]
    routing, gateway_flags, inference_flags = POLICY_FLAGS.get(policy, (policy, [], []))
    engine = ["--num-kv-blocks", str(args.num_kv_blocks), "--block-size", str(BLOCK_SIZE),
              *inference_flags, *args.inference_arg]
    services = []
    try:
        services.append(start_service("preprocess", [*model, "--block-size", str(BLOCK_SIZE)], log_dir / "preprocess",
                                      timeout_s=args.startup_timeout_s))
        # The replicas load and capture their CUDA graphs at once: all started, then waited for
        # (from this thread: a service dies with the thread that started it, PR_SET_PDEATHSIG).
        for k in range(args.replicas):
            services.append(launch_service("inference", [*model, "--device", replica_device(args, k), *engine,
                                                         "--replica-id", f"replica-{k}"], log_dir / f"inference-{k}"))
        for service in services[1:]:
            service.wait_until_serving(args.startup_timeout_s)
        replicas = [arg for service in services[1:] for arg in ("--inference", service.address)]
        services.append(start_service("gateway", [*model, "--preprocess", services[0].address, *replicas,
                                                  "--routing", routing, *gateway_flags, *args.gateway_arg],
                                      log_dir / "gateway", timeout_s=args.startup_timeout_s))
    except BaseException:
        for service in reversed(services):
            stop_service(service)
        raise
    return services


class LoadSampler:
    """Each replica's requests in flight (running + waiting, from GetLoad) every
    LOAD_SAMPLE_INTERVAL_S, kept while at least `min_in_flight` are in flight over all of them
    (the run's ramp-up and its tail, when clients run out of turns, are left out).

    Load, not requests served: a replica that runs slower for a while rightly gets fewer."""

    def __init__(self, replicas, min_in_flight: int):
        self._channels = [grpc.insecure_channel(replica.address) for replica in replicas]
        self._stubs = [inference_pb2_grpc.InferenceServiceStub(channel) for channel in self._channels]
        self._min_in_flight = min_in_flight
        self.samples: list[list[int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for channel in self._channels:
            channel.close()

    def _sample(self) -> None:
        while not self._stop.wait(LOAD_SAMPLE_INTERVAL_S):
            loads = [stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=5) for stub in self._stubs]
            sample = [load.num_running + load.num_waiting for load in loads]
            if sum(sample) >= self._min_in_flight:
                self.samples.append(sample)

    def mean_loads(self) -> list[float] | None:
        if not self.samples:
            return None
        return [round(sum(sample[i] for sample in self.samples) / len(self.samples), 3) for i in range(len(self._stubs))]


def run_policy(args, policy: str, model_dir: Path, planned, log_dir: Path) -> tuple[dict, list[float] | None]:
    """The run's summary, and each replica's mean requests in flight (LoadSampler)."""
    services = start_stack(args, policy, model_dir, log_dir / policy)
    try:
        config = RunConfig(address=services[-1].address, concurrency=args.concurrency,
                           num_client_processes=args.client_processes, show_progress=sys.stderr.isatty())
        with LoadSampler(services[1:-1], min_in_flight=(args.concurrency + 1) // 2) as loads:
            result = run_workload(planned, workload(args), config)
    finally:
        for service in reversed(services):
            stop_service(service)
    return summarize(result.records, result.start_s, result.end_s), loads.mean_loads()


def load_max_over_min(mean_loads: list[float] | None) -> float | None:
    """The busiest replica's mean load over the quietest's (None: no samples, or an idle replica)."""
    if not mean_loads or min(mean_loads) == 0:
        return None
    return round(max(mean_loads) / min(mean_loads), 3)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = args.out_dir / f"routing-{stamp}-logs"
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        model_dir = bench_stack.build_model(args, Path(tmp) / "model")
        builder = PromptBuilder.from_path(model_dir)
        planned = plan_requests(workload(args), builder)
        prefix_lengths = {r.prefix_group: len(builder.token_ids(r.prefix_text)) for r in planned if r.turn == 0}
        ideal = ideal_cached_tokens(planned, args.output_tokens, prefix_lengths)
        results, mean_loads = {}, {}
        for policy in args.policies.split(","):
            print(f"{policy}: starting {args.replicas} replicas", flush=True)
            results[policy], mean_loads[policy] = run_policy(args, policy, model_dir, planned, log_dir)
            print(f"{policy}: {results[policy]['output_tokens_per_s']:.1f} out tok/s, "
                  f"TTFT p90 {results[policy]['ttft_ms']['p90']:.1f} ms", flush=True)
    baseline = results.get("round-robin")
    print("| policy | out tok/s | vs round-robin | vs kv | TTFT p50 ms | TTFT p90 ms | p90 vs round-robin | p90 vs kv "
          "| cached / ideal | pulled tokens | load max / min | ok |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = {}
    for policy, summary in results.items():
        row = {
            "output_tokens_per_s": summary["output_tokens_per_s"], "ttft_ms": summary["ttft_ms"],
            "cached_over_ideal": round(summary["num_cached_tokens"] / max(1, ideal), 3),
            "num_succeeded": summary["num_succeeded"], "num_requests": summary["num_requests"],
            "mean_load_per_replica": mean_loads[policy], "load_max_over_min": load_max_over_min(mean_loads[policy]),
        }
        if baseline:
            row["throughput_vs_round_robin"] = round(summary["output_tokens_per_s"] / baseline["output_tokens_per_s"], 3)
            row["ttft_p90_vs_round_robin"] = round(summary["ttft_ms"]["p90"] / baseline["ttft_ms"]["p90"], 3)
        if "kv" in results and policy != "kv":
            row["throughput_vs_kv"] = round(summary["output_tokens_per_s"] / results["kv"]["output_tokens_per_s"], 3)
            row["ttft_p90_vs_kv"] = round(summary["ttft_ms"]["p90"] / results["kv"]["ttft_ms"]["p90"], 3)
        row["num_pulled_tokens"] = summary.get("num_pulled_tokens")
        rows[policy] = row
        print(f"| {policy} | {row['output_tokens_per_s']:.1f} | {row.get('throughput_vs_round_robin', '-')} | "
              f"{row.get('throughput_vs_kv', '-')} | {summary['ttft_ms']['p50']:.1f} | {summary['ttft_ms']['p90']:.1f} | "
              f"{row.get('ttft_p90_vs_round_robin', '-')} | {row.get('ttft_p90_vs_kv', '-')} | {row['cached_over_ideal']} | "
              f"{row['num_pulled_tokens']} | {row['load_max_over_min'] or '-'} | {row['num_succeeded']}/{row['num_requests']} |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"routing-{stamp}.json"
    out.write_text(json.dumps({"rows": rows, "summaries": results, "ideal_cached_tokens": ideal,
                               "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    print(f"wrote {out}")
    return 0 if all(r["num_succeeded"] == r["num_requests"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
