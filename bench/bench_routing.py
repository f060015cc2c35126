"""KV-aware routing against round-robin: several inference replicas behind one gateway (issue 10).

    python bench/bench_routing.py                                  # H200: 4 replicas of the 1.5B shape on one GPU
    python bench/bench_routing.py --policies kv,round-robin,least-loaded --concurrency 96
    python bench/bench_routing.py --smoke                          # CPU, tiny model: that it runs

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
conversation of its group ran), requests per replica. Ratios against round-robin, measured in the
same run: p90 TTFT [kv <= 0.3x], output tok/s [kv >= 1.5x]. Table + --out-dir/routing-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import bench_stack
from llmserve.tools.loadgen.runner import RunConfig, run_workload
from llmserve.tools.loadgen.stats import summarize
from llmserve.tools.loadgen.workload import LengthDistribution, PromptBuilder, PromptForm, WorkloadConfig, plan_requests
from llmserve.tools.service_process import launch_service, start_service, stop_service

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=(*bench_stack.SHAPES, "tiny"))
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--policies", default="kv,round-robin")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--num-kv-blocks", type=int, default=1536, help="KV blocks per replica (16 tokens each): below the system prompts plus what is in flight")
    parser.add_argument("--prefix-groups", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--conversations", type=int, default=192)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="new tokens per turn")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--client-workers", type=int, default=4)
    parser.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag (repeatable)")
    parser.add_argument("--inference-arg", action="append", default=[], help="extra inference flag (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few conversations")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.device, args.replicas, args.num_kv_blocks = "tiny", "cpu", 3, 64
        args.prefix_groups, args.prefix_tokens, args.conversations, args.turns = 3, 96, 12, 2
        args.prompt_tokens, args.output_tokens, args.concurrency, args.client_workers = 16, 4, 6, 1
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


def start_stack(args, policy: str, model_dir: Path, log_dir: Path) -> list:
    model = ["--model", str(model_dir)]
    engine = ["--device", args.device, "--num-kv-blocks", str(args.num_kv_blocks), "--block-size", str(BLOCK_SIZE),
              *args.inference_arg]
    services = []
    try:
        services.append(start_service("preprocess", [*model, "--block-size", str(BLOCK_SIZE)], log_dir / "preprocess",
                                      timeout_s=args.startup_timeout_s))
        # The replicas load and capture their CUDA graphs at once: all started, then waited for
        # (from this thread: a service dies with the thread that started it, PR_SET_PDEATHSIG).
        for k in range(args.replicas):
            services.append(launch_service("inference", [*model, *engine, "--replica-id", f"replica-{k}"],
                                           log_dir / f"inference-{k}"))
        for service in services[1:]:
            service.wait_until_serving(args.startup_timeout_s)
        replicas = [arg for service in services[1:] for arg in ("--inference", service.address)]
        services.append(start_service("gateway", [*model, "--preprocess", services[0].address, *replicas,
                                                  "--routing", policy, *args.gateway_arg],
                                      log_dir / "gateway", timeout_s=args.startup_timeout_s))
    except BaseException:
        for service in reversed(services):
            stop_service(service)
        raise
    return services


def run_policy(args, policy: str, model_dir: Path, planned, log_dir: Path) -> dict:
    services = start_stack(args, policy, model_dir, log_dir / policy)
    try:
        config = RunConfig(address=services[-1].address, concurrency=args.concurrency,
                           num_workers=args.client_workers, show_progress=sys.stderr.isatty())
        result = run_workload(planned, workload(args), config)
    finally:
        for service in reversed(services):
            stop_service(service)
    return summarize(result.records, result.start_s, result.end_s)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = args.out_dir / f"routing-{stamp}-logs"
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        model_dir = bench_stack.build_model(argparse.Namespace(shape=args.shape, tokenizer=args.tokenizer,
                                                               device=args.device, seed=args.seed), Path(tmp) / "model")
        builder = PromptBuilder.from_path(model_dir)
        planned = plan_requests(workload(args), builder)
        prefix_lengths = {r.prefix_group: len(builder.token_ids(r.prefix_text)) for r in planned if r.turn == 0}
        ideal = ideal_cached_tokens(planned, args.output_tokens, prefix_lengths)
        results = {}
        for policy in args.policies.split(","):
            print(f"{policy}: starting {args.replicas} replicas", flush=True)
            results[policy] = run_policy(args, policy, model_dir, planned, log_dir)
            print(f"{policy}: {results[policy]['output_tokens_per_s']:.1f} out tok/s, "
                  f"TTFT p90 {results[policy]['ttft_ms']['p90']:.1f} ms", flush=True)
    baseline = results.get("round-robin")
    print("| policy | out tok/s | vs round-robin | TTFT p50 ms | TTFT p90 ms | p90 vs round-robin | cached / ideal | ok |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = {}
    for policy, summary in results.items():
        row = {
            "output_tokens_per_s": summary["output_tokens_per_s"], "ttft_ms": summary["ttft_ms"],
            "cached_over_ideal": round(summary["num_cached_tokens"] / max(1, ideal), 3),
            "num_succeeded": summary["num_succeeded"], "num_requests": summary["num_requests"],
        }
        if baseline:
            row["throughput_vs_round_robin"] = round(summary["output_tokens_per_s"] / baseline["output_tokens_per_s"], 3)
            row["ttft_p90_vs_round_robin"] = round(summary["ttft_ms"]["p90"] / baseline["ttft_ms"]["p90"], 3)
        rows[policy] = row
        print(f"| {policy} | {row['output_tokens_per_s']:.1f} | {row.get('throughput_vs_round_robin', '-')} | "
              f"{summary['ttft_ms']['p50']:.1f} | {summary['ttft_ms']['p90']:.1f} | {row.get('ttft_p90_vs_round_robin', '-')} | "
              f"{row['cached_over_ideal']} | {row['num_succeeded']}/{row['num_requests']} |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"routing-{stamp}.json"
    out.write_text(json.dumps({"rows": rows, "summaries": results, "ideal_cached_tokens": ideal,
                               "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    print(f"wrote {out}")
    return 0 if all(r["num_succeeded"] == r["num_requests"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
