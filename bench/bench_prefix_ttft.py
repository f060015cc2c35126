"""Time to first token with a cached prefix, against the same prompt cold (issue 10).

    python bench/bench_prefix_ttft.py                       # H200: Qwen2.5-1.5B shape, 4096 tokens, 90% cached
    python bench/bench_prefix_ttft.py --smoke               # CPU, tiny model: that it runs

One engine core (TorchEngineCore, bfloat16 on CUDA, CUDA graphs as served), one request at a
time, max_tokens 1, each timed from add_request to its first token's output (the engine's
async scheduling hands the token out one step() later, as it would to the service):
  cold     a fresh --prompt-tokens prompt (no block of it cached);
  warm     the first --cached-fraction of a prompt that ran cold just before, then fresh tokens
           up to --prompt-tokens: the cached blocks are reused, the rest is computed;
  off      a fresh prompt on an engine with the prefix cache off (the cost of caching at 0%
           hits is cold / off).
Ratios: warm / cold [target <= 0.2], cold / off [>= 0.99 as throughput, i.e. cold <= 1.01x off].
For the warm path also the CUDA time of its steps (torch.profiler) and its top kernels, so the
host share and the slowest kernel are named, and how many of its steps ran a CUDA graph
(prefill graphs: engine/prefill_graphs.py; none with --enforce-eager or off CUDA).

Prints a table and writes --out-dir/prefix-ttft-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bench_stack
from bench_gpu import random_prompts, synchronize, top_kernels
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.step_stats import StepStatsLog
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_stack.add_model_arguments(parser)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--cached-fraction", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=5, help="timed requests per kind (after one warm-up)")
    parser.add_argument("--engine-max-batched-tokens", type=int, default=None,
                        help="per-step token budget (default: the engine's)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the eager warm path)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, short prompts")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.device, args.prompt_tokens, args.repeats = "tiny", "cpu", 96, 2
    return args


def engine_for(args, model_dir: Path, prefix_caching: bool) -> TorchEngineCore:
    settings = dict(
        model_path=model_dir, model_name=model_dir.name, device=args.device,
        dtype="bfloat16" if args.device.startswith("cuda") else "float32",
        max_context_tokens=max(2 * args.prompt_tokens, 256), enable_prefix_caching=prefix_caching,
        enforce_eager=args.enforce_eager,
    )
    if args.engine_max_batched_tokens:
        settings["max_batched_tokens"] = args.engine_max_batched_tokens
    return TorchEngineCore(EngineConfig(**settings))


def time_to_first_token_ms(engine: TorchEngineCore, request_id: str, prompt: list[int]) -> float:
    device = engine.runner.device
    synchronize(device)
    start = time.perf_counter()
    engine.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                                         ignore_eos=True), time.monotonic_ns()))
    while not any(output.new_token_ids for output in engine.step()):
        pass
    elapsed_ms = (time.perf_counter() - start) * 1e3
    while engine.has_requests_in_flight():
        engine.step()
    return elapsed_ms


def graph_steps(engine: TorchEngineCore) -> dict[str, int]:
    """Steps the runner has run on each CUDA-graph path so far (replays, on CUDA)."""
    runner = engine.runner
    graphs = {"prefill": runner.prefill_graphs, "decode": runner.decode_graphs}
    return {kind: graph.num_steps if graph is not None else 0 for kind, graph in graphs.items()}


def counted_ttft_ms(engine: TorchEngineCore, request_id: str, prompt: list[int]) -> tuple[float, dict[str, int]]:
    """time_to_first_token_ms, and the request's forward steps: all, and those on each graph path."""
    before, engine.step_stats = graph_steps(engine), StepStatsLog()
    elapsed_ms = time_to_first_token_ms(engine, request_id, prompt)
    after, steps, engine.step_stats = graph_steps(engine), engine.step_stats.steps, None
    counts = {f"{kind}_graph_steps": after[kind] - before[kind] for kind in after}
    return elapsed_ms, {"steps": sum(1 for step in steps if step.num_tokens), **counts}


def warm_prompt(cold: list[int], args, fresh: list[int]) -> list[int]:
    num_cached = int(args.prompt_tokens * args.cached_fraction)
    return cold[:num_cached] + fresh[: args.prompt_tokens - num_cached]


def measure_cached_engine(args, model_dir: Path, vocab_size: int) -> dict:
    engine = engine_for(args, model_dir, prefix_caching=True)
    prompts = random_prompts(2 * (args.repeats + 1), args.prompt_tokens, vocab_size, seed=args.seed + 1)
    cold_ms, warm_ms, hits, warm_steps = [], [], [], []
    for i in range(args.repeats + 1):
        cold, fresh = prompts[2 * i], prompts[2 * i + 1]
        cold_time = time_to_first_token_ms(engine, f"cold{i}", cold)
        before = engine.load().prefix_cache_hit_tokens_total
        warm_time, steps = counted_ttft_ms(engine, f"warm{i}", warm_prompt(cold, args, fresh))
        if i:  # the first pair warms up the shapes
            cold_ms.append(cold_time)
            warm_ms.append(warm_time)
            hits.append(engine.load().prefix_cache_hit_tokens_total - before)
            warm_steps.append(steps)
    # One more pair, profiled: the warm request's steps only.
    cold, fresh = random_prompts(2, args.prompt_tokens, vocab_size, seed=args.seed + 99)
    time_to_first_token_ms(engine, "cold-profiled", cold)
    kernels = top_kernels(lambda: time_to_first_token_ms(engine, "warm-profiled", warm_prompt(cold, args, fresh)),
                          engine.runner.device, num_rows=8)
    return {"cold_ms": cold_ms, "warm_ms": warm_ms, "cached_tokens": hits, "warm_steps": warm_steps,
            "warm_top_kernels": kernels}


def measure_uncached_engine(args, model_dir: Path, vocab_size: int) -> dict:
    engine = engine_for(args, model_dir, prefix_caching=False)
    prompts = random_prompts(args.repeats + 1, args.prompt_tokens, vocab_size, seed=args.seed + 2)
    times = [time_to_first_token_ms(engine, f"off{i}", prompt) for i, prompt in enumerate(prompts)]
    return {"off_ms": times[1:]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="prefix-ttft-") as tmp:
        model_dir = bench_stack.build_model(args, Path(tmp) / "model")
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        result = measure_cached_engine(args, model_dir, vocab_size)
        bench_stack.free_device_memory()
        result |= measure_uncached_engine(args, model_dir, vocab_size)
    cold, warm, off = (statistics.median(result[k]) for k in ("cold_ms", "warm_ms", "off_ms"))
    kernel_us = sum(row.get("total_us", 0.0) for row in result["warm_top_kernels"])
    summary = {
        "shape": args.shape, "device": args.device, "prompt_tokens": args.prompt_tokens,
        "cached_tokens_median": statistics.median(result["cached_tokens"]),
        "cold_ms": round(cold, 3), "warm_ms": round(warm, 3), "off_ms": round(off, 3),
        "warm_over_cold": round(warm / cold, 3), "cold_over_off": round(cold / off, 3),
        "warm_top_kernels_us": round(kernel_us, 1),
        # over the timed warm requests: forward steps, and those that ran a prefill / decode graph
        **{f"warm_{key}": sum(steps[key] for steps in result["warm_steps"]) for key in result["warm_steps"][0]},
    }
    print("| shape | prompt | cached | cold ms | warm ms | warm/cold | caching off ms | cold/off |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {args.shape} | {args.prompt_tokens} | {summary['cached_tokens_median']} | {cold:.2f} | {warm:.2f} | "
          f"{warm / cold:.3f} | {off:.2f} | {cold / off:.3f} |")
    print(f"  warm requests: {summary['warm_steps']} forward steps, {summary['warm_prefill_graph_steps']} on a "
          f"prefill graph, {summary['warm_decode_graph_steps']} on a decode graph")
    for row in result["warm_top_kernels"]:
        print(f"  warm kernel: {row}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"prefix-ttft-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"summary": summary, "runs": result, "args": {k: str(v) for k, v in vars(args).items()}},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
