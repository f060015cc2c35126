"""Tensor parallelism against one process, in one run (issue 23's targets; docs/parallelism.md):

    python bench/bench_tensor_parallel.py --shape llama-3.1-8b --sizes 1,2            # 2 GPUs
    python bench/bench_tensor_parallel.py --shape llama-3.1-70b --sizes 4,8 \\
        --prompt-tokens 1000 --output-tokens 1000 --streams 1,256                     # 8 GPUs
    python bench/bench_tensor_parallel.py --smoke                                     # CPU, gloo

For each size in --sizes, in turn, one engine as the inference service builds it (create_engine:
the engine-core process is rank 0 and the other ranks run in their own processes, one GPU each)
on the same random-weight checkpoint (bench_stack.build_model, --shape), driven in process
through AsyncEngine (bench_stack's `async` path) with the same prompts at each --streams count:
fixed --prompt-tokens and --output-tokens, greedy, ignore_eos, that many requests in flight.

Per (size, streams): output tok/s and TTFT/ITL p50; the ratio of each to the first size's at
the same streams (the baseline: put 1 first to compare with one GPU). The batch-1 decode step is
the ITL p50 at 1 stream; beside it the weight-bytes floor of that step per GPU: the checkpoint's
bytes / size / --hbm-gbps (H200: 4800 GB/s), and the step's ratio to it. Prints one markdown
table; writes --out-dir/tensor-parallel-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import bench_stack
import stack_drivers
import stack_report
from llmserve.inference.engine_flags import engine_config
from llmserve.tools.loadgen.stats import summarize
from llmserve.tools.loadgen.workload import PromptBuilder
from llmserve.model_files import ModelFiles

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOKE = dict(shape="tiny", device="cpu", sizes="1,2", streams="1,4", prompt_tokens=24, output_tokens=16,
             warmup_output_tokens=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help=f"CPU, tiny model, gloo ranks: {SMOKE}")
    bench_stack.add_model_arguments(parser)
    parser.add_argument("--model", type=Path, metavar="DIR", help="a checkpoint to serve instead of random weights")
    parser.add_argument("--sizes", default="1,2", metavar="N,N,...", help="tensor-parallel sizes; the first is the "
                        "baseline (default: %(default)s)")
    parser.add_argument("--streams", default="1,256", metavar="N,N,...", help="(default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=512, metavar="N", help="(default: %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=256, metavar="N", help="(default: %(default)s)")
    parser.add_argument("--requests-per-stream", type=float, default=2.0, metavar="K", help="(default: %(default)s)")
    parser.add_argument("--min-requests", type=int, default=4, metavar="N", help="(default: %(default)s)")
    parser.add_argument("--warmup-output-tokens", type=int, default=16, metavar="N", help="(default: %(default)s)")
    parser.add_argument("--hbm-gbps", type=float, default=4800.0, help="device memory bandwidth for the weight-bytes "
                        "floor (default: %(default)s, the H200's)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="FLAGS",
                        help="engine flags for every size (repeatable, shell-split)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results", metavar="DIR")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.sizes = [int(size) for size in str(args.sizes).split(",")]
    args.streams = [int(streams) for streams in str(args.streams).split(",")]
    args.engine_arg = [flag for flags in args.engine_arg for flag in flags.split()]
    args.prompt_form, args.repeat = "token_ids", 1  # what stack_drivers.Plans reads
    return args


def run_size(options: dict, model_dir: Path, plans: stack_drivers.Plans, streams: list[int]) -> list[dict]:
    """One engine split `options["tensor_parallel_size"]` ways: a measurement per cell."""
    from llmserve.inference.backends import create_engine

    async def main() -> list[dict]:
        engine = create_engine(engine_config(options, model_dir, ModelFiles.load(model_dir).model_name))
        await engine.start()
        try:
            await stack_drivers.drive_async_engine(engine, plans.warmup.requests, max(streams), "warmup")
            cells = []
            for _, cell in plans.in_order():
                start_s = time.monotonic()
                records = await stack_drivers.drive_async_engine(engine, cell.requests, cell.streams, f"c{cell.streams}")
                summary = summarize(records, start_s, max(record.end_s for record in records))
                cells.append({"streams": cell.streams, **stack_report.measurement(summary, {})})
            return cells
        finally:
            await engine.shutdown(drain_timeout_s=0.0)

    return asyncio.run(main())


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """The bytes of every checkpoint tensor in the engine's dtype (not the file's: a checkpoint
    written in float32 is served in bfloat16 on CUDA)."""
    import torch
    from safetensors import safe_open

    from llmserve.inference.models.loader import safetensors_files, torch_dtype

    element_bytes = torch.empty(0, dtype=torch_dtype(dtype)).element_size()
    num_elements = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            num_elements += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return num_elements * element_bytes


def rows_with_ratios(rows: list[dict], baseline_size: int, bytes_total: int, hbm_gbps: float) -> list[dict]:
    base = {row["streams"]: row for row in rows if row["size"] == baseline_size}
    out = []
    for row in rows:
        floor_ms = bytes_total / row["size"] / (hbm_gbps * 1e9) * 1e3
        same = base.get(row["streams"], {})
        out.append({
            **row,
            "output_ratio": stack_report.ratio(row["output_tokens_per_s"], same.get("output_tokens_per_s")),
            "itl_ratio": stack_report.ratio(row["itl_p50_ms"], same.get("itl_p50_ms")),
            "ttft_ratio": stack_report.ratio(row["ttft_p50_ms"], same.get("ttft_p50_ms")),
            "weight_floor_ms_per_gpu": stack_report.significant(floor_ms),
            "itl_over_floor": stack_report.ratio(row["itl_p50_ms"], floor_ms) if row["streams"] == 1 else None,
        })
    return out


def format_table(rows: list[dict], baseline_size: int) -> str:
    columns = ("size", "streams", "output_tokens_per_s", "output_ratio", "ttft_p50_ms", "ttft_ratio", "itl_p50_ms",
               "itl_ratio", "weight_floor_ms_per_gpu", "itl_over_floor", "num_succeeded", "num_requests")
    lines = [f"ratios: to tensor-parallel size {baseline_size} at the same streams",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if row.get(c) is None else str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = bench_stack.bench_engine_options(args)
    rows, errors = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        model_dir = args.model or bench_stack.build_model(args, Path(tmp) / f"random-{args.shape}")
        plans = stack_drivers.Plans(args, PromptBuilder.from_path(model_dir))
        bytes_total = weight_bytes(model_dir, options["dtype"])
        for size in args.sizes:
            print(f"tensor-parallel size {size}: starting", flush=True)
            try:
                for cell in run_size({**options, "tensor_parallel_size": size}, model_dir, plans, args.streams):
                    rows.append({"size": size, **cell})
                    print(f"    {cell['streams']:>4} streams: {cell['output_tokens_per_s']} out tok/s, "
                          f"ITL p50 {cell['itl_p50_ms']} ms", flush=True)
            except Exception as error:  # noqa: BLE001 — one size failing must not lose the others
                errors[size] = f"{type(error).__name__}: {error}"
                print(f"    FAILED: {errors[size]}", file=sys.stderr, flush=True)
            bench_stack.free_device_memory()
    rows = rows_with_ratios(rows, args.sizes[0], bytes_total, args.hbm_gbps)
    print()
    print(format_table(rows, args.sizes[0]))
    settings = {k: v if isinstance(v, (int, float, bool, list, type(None))) else str(v) for k, v in vars(args).items()}
    out = args.out_dir / time.strftime("tensor-parallel-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": settings, "engine_options": options, "weight_bytes": bytes_total,
                               "rows": rows, "errors": errors}, indent=2) + "\n")
    print(f"wrote {out}")
    incomplete = [row for row in rows if row["num_succeeded"] < row["num_requests"]]
    return 1 if errors or incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
