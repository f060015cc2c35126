"""A mixed step's cost, eager against piecewise CUDA graphs (issue 19): the step in which an
arriving prompt joins a decoding batch, which no whole-forward graph takes.

    python bench/bench_mixed_step.py --device cuda --model DIR   # a checkpoint on the GPU
    python bench/bench_mixed_step.py                             # CPU smoke run: the Triton interpreter,
                                                                 # pieces uncaptured (numbers mean nothing)

One engine core (triton attention backend, piecewise graphs on, one step at a time). Per cell
(--decodes D, --chunk-tokens C): D requests decode, and before each step a new request arrives
with a C-token prompt asking for one token, so every step computes D decodes and one C-token
chunk. The steps alternate between the pieces and the eager forward (the same engine, the same
batch state: the baseline in the same run), --steps of each. Per cell and mode: the median host
µs to queue the forward (`execute_launch`), the median step's wall time (launch, device, sampling,
update: the step waits for its tokens), and with --measure-gpu the device time between the
forward's start and the sampling's end (CUDA events). min / median / max over --repeat runs of
the cell; prints a table and writes JSON to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: a tiny random Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--decodes", default="64,256", help="decoding sequences per cell, comma-separated (default: %(default)s)")
    parser.add_argument("--chunk-tokens", default="32,128,512", help="the arriving prompt's tokens, comma-separated (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="mixed steps per mode per repeat (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="(default: %(default)s)")
    parser.add_argument("--measure-gpu", action="store_true", help="CUDA events around each step's device work")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.device == "cpu":  # the Triton interpreter, set up before any kernel module is imported
        sys.path.insert(0, str(REPO_ROOT))
        import tests.triton_cpu  # noqa: F401

    import torch

    from llmserve.inference.engine.config import EngineConfig, default_dtype
    from llmserve.inference.engine.step_stats import StepStatsLog
    from llmserve.inference.engine.torch_engine import TorchEngineCore
    from llmserve.inference.engine.types import EngineRequest
    from llmserve.sampling import SamplingParams
    from llmserve.tools.tiny_model import build_tiny_model

    decodes = [int(n) for n in args.decodes.split(",")]
    chunks = [int(n) for n in args.chunk_tokens.split(",")]
    steps_per_cell = 2 * args.steps + 4
    model_dir = args.model or build_tiny_model(Path(tempfile.mkdtemp(prefix="mixed-step-")), "llama")
    context = 64 + steps_per_cell
    max_seqs = max(decodes) + 2
    core = TorchEngineCore(EngineConfig(
        model_path=model_dir, model_name="bench", device=args.device, dtype=default_dtype(args.device),
        attention_backend="triton", piecewise_graphs=True, async_scheduling=False,
        max_num_seqs=max_seqs, max_batched_tokens=max(2048, max(decodes) + max(chunks)),
        max_context_tokens=max(context, max(chunks) + 16), num_kv_blocks=max_seqs * (max(context, max(chunks)) // 16 + 3),
    ))  # fmt: skip
    pieces = core.runner.piecewise_graphs
    rng = random.Random(0)
    vocab = core.model_info.vocab_size
    counter = iter(range(10**9))

    def prompt(length: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(length)]

    def add(length: int, max_tokens: int) -> str:
        request_id = f"r{next(counter)}"
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        core.add_request(EngineRequest(request_id, prompt(length), sampling, arrival_ns=time.monotonic_ns()))
        return request_id

    def run_cell(num_decodes: int, chunk_tokens: int) -> dict:
        decoding = [add(16, steps_per_cell + 8) for _ in range(num_decodes)]
        for _ in range(3):  # their prompts, and every one of them decoding
            core.step()
        core.step_stats = StepStatsLog(measure_gpu=args.measure_gpu)
        modes = []
        for index in range(2 * args.steps):
            piecewise = index % 2 == 0
            core.runner.piecewise_graphs = pieces if piecewise else None
            add(chunk_tokens, 1)
            core.step()
            modes.append("piecewise" if piecewise else "eager")
        core.runner.piecewise_graphs = pieces
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        stats = core.step_stats.steps
        core.step_stats = None
        for request_id in decoding:
            core.abort_request(request_id)
        while core.has_requests_in_flight():
            core.step()
        cell = {}
        for mode in ("eager", "piecewise"):
            mine = [s for s, m in zip(stats, modes) if m == mode and s.num_tokens == num_decodes + chunk_tokens]
            cell[mode] = {
                "steps": len(mine),
                "launch_us": statistics.median(s.execute_launch_s for s in mine) * 1e6,
                "step_us": statistics.median(s.step_s for s in mine) * 1e6,
            }
            if args.measure_gpu:
                cell[mode]["gpu_us"] = statistics.median(s.gpu_busy_ms() for s in mine) * 1e3
        return cell

    rows = []
    for num_decodes in decodes:
        for chunk_tokens in chunks:
            runs = [run_cell(num_decodes, chunk_tokens) for _ in range(args.repeat)]
            rows.append(summarize(num_decodes, chunk_tokens, runs))
    report = {"device": args.device, "model": str(args.model or "tiny llama"), "steps": args.steps,
              "repeat": args.repeat, "piecewise_sizes": list(pieces.sizes), "cells": rows}
    print_table(report)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"mixed-step-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


def summarize(num_decodes: int, chunk_tokens: int, runs: list[dict]) -> dict:
    """min / median / max over the repeats of each mode's medians, and of piecewise / eager."""
    row = {"decodes": num_decodes, "chunk_tokens": chunk_tokens, "runs": runs}
    for key in runs[0]["eager"]:
        if key == "steps":
            continue
        for mode in ("eager", "piecewise"):
            row[f"{mode}_{key}"] = _spread([run[mode][key] for run in runs])
        row[f"ratio_{key}"] = _spread([run["piecewise"][key] / run["eager"][key] for run in runs if run["eager"][key]])
    return row


def _spread(values: list[float]) -> list[float]:
    return [round(min(values), 3), round(statistics.median(values), 3), round(max(values), 3)]


def print_table(report: dict) -> None:
    has_gpu = "eager_gpu_us" in report["cells"][0]
    header = "| decodes | chunk | launch µs eager | launch µs piecewise | piecewise / eager | step µs eager | step µs piecewise | piecewise / eager |"
    if has_gpu:
        header += " device µs eager | device µs piecewise |"
    print(f"{report['device']}, {report['model']}: {report['steps']} steps per mode, min / median / max of {report['repeat']}")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for row in report["cells"]:
        line = (f"| {row['decodes']} | {row['chunk_tokens']} | {_text(row['eager_launch_us'])} | "
                f"{_text(row['piecewise_launch_us'])} | {_text(row['ratio_launch_us'], 2)} | {_text(row['eager_step_us'])} | "
                f"{_text(row['piecewise_step_us'])} | {_text(row['ratio_step_us'], 2)} |")
        if has_gpu:
            line += f" {_text(row['eager_gpu_us'])} | {_text(row['piecewise_gpu_us'])} |"
        print(line)


def _text(spread: list[float], digits: int = 0) -> str:
    return " / ".join(f"{value:,.{digits}f}" for value in spread)


if __name__ == "__main__":
    main()
