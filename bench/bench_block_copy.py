"""The KV pull's copy kernel alone (issue 22; kernels/block_copy.py) against the device's own copy
rate: where a pull's copy time goes once the servers are taken away.

    python bench/bench_block_copy.py                         # CUDA: 1.5B and 8B pool layouts
    python bench/bench_block_copy.py --sweep                 # and every tile x warps setting
    python bench/bench_block_copy.py --smoke                 # that it runs (on CPU: Triton's interpreter)

Two pools laid out as the engine's KV cache ([2, layers, blocks, 16, kv heads, head dim],
bfloat16), --pool-blocks each, on one GPU. For each shape and --blocks count, source and target
block ids drawn at random (a pull's ids: the source's and this replica's free blocks are
scattered), then, CUDA events around each, median of --repeats:
  roofline  one contiguous `copy_` of the same number of bytes: the device's copy rate
  kernel    copy_blocks with its ids already on the device: the kernel alone
  import    what KvBlockImporter does per pull, timed on the host: the ids to the device (its
            own function), the kernel, and the synchronize the source's release waits for
GB/s = bytes copied / time (10^9 bytes; read + write would be twice that). Ratios: kernel /
roofline rate, and import / kernel time (the fixed part a whole pull adds). The kernel's and
the import's copies are each checked block by block once. Prints a table and writes
--out-dir/block-copy-<time>.json.
Without CUDA (--smoke only) the kernel runs under Triton's interpreter, timed on the host: the
figures then say nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: the kernel runs interpreted on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from results_file import write_results

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
# num_layers, num_kv_heads, head_dim of the configs bench_stack.py builds
SHAPES = {"qwen2.5-1.5b": (28, 2, 128), "llama-3.1-8b": (32, 8, 128), "tiny": (2, 1, 16)}
SWEEP_TILES = (1024, 2048, 4096, 8192, 16384)
SWEEP_WARPS = (4, 8, 16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2.5-1.5b,llama-3.1-8b", help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--blocks", default="128,504,1536",
                        help="blocks per copy, comma-separated (16 tokens each: 2k, 8k, 24k tokens)")
    parser.add_argument("--pool-blocks", type=int, default=2048, help="blocks in each of the two pools")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time the kernel at every tile x warps")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape, small pools, few repeats")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.blocks, args.pool_blocks, args.repeats = "tiny", "4,8", 16, 2
    return args


def timed_on_device(work, repeats: int) -> list[float]:
    """Seconds of `work` on the current stream, by CUDA events, once per repeat (one warm-up)."""
    if DEVICE == "cpu":
        return timed_on_host(work, repeats)
    work()
    times = []
    for _ in range(repeats):
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        work()
        ended.record()
        ended.synchronize()
        times.append(began.elapsed_time(ended) / 1000)
    return times


def timed_on_host(work, repeats: int) -> list[float]:
    """Seconds of `work` by the host's clock, the device synchronized before each (one warm-up)."""
    work()
    times = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return times


def significant(value: float) -> float:
    """Three significant digits: a rate on a slow host must not round to 0."""
    return float(f"{value:.3g}")


def pools(shape: str, pool_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_layers, num_kv_heads, head_dim = SHAPES[shape]
    dims = (2, num_layers, pool_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    source = torch.randn(dims, device=DEVICE, dtype=torch.bfloat16)
    return source, torch.zeros_like(source)


def check_copied(source: torch.Tensor, target: torch.Tensor, source_ids: list[int], target_ids: list[int]) -> None:
    if not torch.equal(source[:, :, source_ids], target[:, :, target_ids]):
        raise SystemExit("the kernel's copy differs from its source")


def measure(shape: str, num_blocks: int, args: argparse.Namespace) -> dict:
    from llmserve.inference.engine.kv_block_import import ids_on_device
    from llmserve.inference.kernels.block_copy import copy_blocks

    source, target = pools(shape, args.pool_blocks)
    chooser = random.Random(num_blocks)
    source_ids = chooser.sample(range(args.pool_blocks), num_blocks)
    target_ids = chooser.sample(range(args.pool_blocks), num_blocks)
    device_ids = torch.tensor([source_ids, target_ids], dtype=torch.int64, device=DEVICE)
    num_bytes = num_blocks * source[:, :, 0].nbytes
    flat_source, flat_target = source.view(-1).view(torch.uint8), target.view(-1).view(torch.uint8)

    def kernel(tile: int | None = None, num_warps: int | None = None):
        settings = {key: value for key, value in (("tile", tile), ("num_warps", num_warps)) if value}
        return lambda: copy_blocks(source, target, device_ids[0], device_ids[1], **settings)

    def import_as_the_engine_does():  # KvBlockImporter._copy_by_kernel, without the pool view
        ids = ids_on_device(tuple(source_ids), target_ids, torch.device(DEVICE))
        copy_blocks(source, target, ids[0], ids[1])
        synchronize()

    for copy in (kernel(), import_as_the_engine_does):
        target.zero_()
        copy()
        check_copied(source, target, source_ids, target_ids)
    seconds = {
        "roofline": timed_on_device(lambda: flat_target[:num_bytes].copy_(flat_source[:num_bytes]), args.repeats),
        "kernel": timed_on_device(kernel(), args.repeats),
        "import": timed_on_host(import_as_the_engine_does, args.repeats),
    }
    row = {"shape": shape, "blocks": num_blocks, "tokens": num_blocks * BLOCK_SIZE, "mb": significant(num_bytes / 1e6)}
    for name, times in seconds.items():
        row[f"{name}_ms"] = [significant(t * 1000) for t in (min(times), statistics.median(times), max(times))]
        row[f"{name}_gb_per_s"] = significant(num_bytes / statistics.median(times) / 1e9)
    row["kernel_over_roofline_rate"] = significant(statistics.median(seconds["roofline"]) / statistics.median(seconds["kernel"]))
    row["import_fixed_ms"] = round((statistics.median(seconds["import"]) - statistics.median(seconds["kernel"])) * 1000, 4)
    if args.sweep:
        row["sweep_gb_per_s"] = {
            f"{tile}x{warps}": significant(num_bytes / statistics.median(timed_on_device(kernel(tile, warps), args.repeats)) / 1e9)
            for tile in SWEEP_TILES for warps in SWEEP_WARPS
        }
    del source, target
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def print_table(rows: list[dict]) -> None:
    print(f"| shape | blocks | tokens | MB | roofline ms (min/med/max) | roofline GB/s | kernel ms (min/med/max) "
          f"| kernel GB/s | **kernel / roofline** | import ms (min/med/max) | import GB/s | fixed ms (import - kernel) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        spread = lambda key: " / ".join(f"{value:.3f}" for value in row[key])  # noqa: E731
        print(f"| {row['shape']} | {row['blocks']} | {row['tokens']} | {row['mb']} | {spread('roofline_ms')} | "
              f"{row['roofline_gb_per_s']} | {spread('kernel_ms')} | {row['kernel_gb_per_s']} | "
              f"{row['kernel_over_roofline_rate']} | {spread('import_ms')} | {row['import_gb_per_s']} | "
              f"{row['import_fixed_ms']} |")
    for row in rows:
        if "sweep_gb_per_s" in row:
            best = max(row["sweep_gb_per_s"], key=row["sweep_gb_per_s"].get)
            print(f"sweep {row['shape']} {row['blocks']} blocks (tile x warps: GB/s), best {best}: {row['sweep_gb_per_s']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if DEVICE == "cpu" and not args.smoke:
        print("bench_block_copy measures a CUDA device; on CPU only --smoke runs (interpreted)", file=sys.stderr)
        return 2
    rows = [measure(shape, int(blocks), args) for shape in args.shapes.split(",") for blocks in args.blocks.split(",")]
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton's interpreter)"
    print(f"device: {device_name}, torch {torch.__version__}")
    print_table(rows)
    write_results(args, "block-copy", {"device": device_name, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
