"""Host time of one engine step, by part, at a full decode batch (issue 19): where the engine-core
process spends a step besides the device's work.

    python bench/bench_host_step.py                          # CPU, tiny random Llama, 256 sequences
    python bench/bench_host_step.py --device cuda --model DIR  # a checkpoint on the GPU

Runs --streams requests of --prompt-tokens tokens asking for --output-tokens each (greedy,
ignore_eos) on a TorchEngineCore with its step stats on (engine/step_stats.py), and takes the
steps whose batch holds every sequence. Per part (schedule, inputs, execute_launch,
sampler_launch, result_wait, update, record; and emit: the engine-core process's wire message
of the step's outputs, pickled as engine_process sends it) the median µs per step, and each
part's share of the step. On CPU `execute_launch` is the forward itself (the kernels run on the
host); on CUDA, with --measure-gpu, the device time per step from CUDA events is the baseline
the host parts are compared with. Prints a table and writes JSON to --out-dir.

Timing depends on the machine and on what else runs on it: compare runs of one machine.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from llmserve.inference.engine.config import EngineConfig, default_dtype
from llmserve.inference.engine.cores import create_engine_core
from llmserve.inference.engine.engine_process import to_wire
from llmserve.inference.engine.step_stats import HOST_PARTS, StepStatsLog
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import SamplingParams
from llmserve.tools.tiny_model import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: a tiny random Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=256, help="sequences decoding at once (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=60, help="(default: %(default)s)")
    parser.add_argument("--measure-gpu", action="store_true", help="CUDA events around each step's device work")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # the engine-core process's own thread; the kernels do not hide host time
    model_dir = args.model or build_tiny_model(Path(tempfile.mkdtemp(prefix="host-step-")), "llama")
    context = args.prompt_tokens + args.output_tokens + 16
    core = create_engine_core(EngineConfig(
        model_path=model_dir, model_name="bench", device=args.device, dtype=default_dtype(args.device),
        max_num_seqs=args.streams,
        max_batched_tokens=max(2048, args.streams * args.prompt_tokens), max_context_tokens=context,
        num_kv_blocks=args.streams * (context // 16 + 2),
    ))  # fmt: skip
    rng = random.Random(0)
    vocab = core.model_info.vocab_size
    sampling = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True, temperature=0.0)
    for i in range(args.streams):
        prompt = [rng.randrange(5, vocab) for _ in range(args.prompt_tokens)]
        core.add_request(EngineRequest(f"{i:032x}", prompt, sampling, arrival_ns=time.monotonic_ns()))
    for _ in range(3):  # the prompts, and the first steps' one-time work
        core.step()
    core.step_stats = StepStatsLog(measure_gpu=args.measure_gpu)
    emit_s = []
    while core.has_requests_in_flight():
        outputs = core.step()
        start = time.perf_counter()
        pickle.dumps(to_wire(outputs))
        emit_s.append(time.perf_counter() - start)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    full = [(stats, emit) for stats, emit in zip(core.step_stats.steps, emit_s) if stats.num_seqs == args.streams]
    report = summarize(full, args)
    print_table(report)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"host-step-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


def summarize(full: list, args) -> dict:
    parts_us = {part: statistics.median(getattr(s, f"{part}_s") for s, _ in full) * 1e6 for part in HOST_PARTS}
    parts_us["emit"] = statistics.median(emit for _, emit in full) * 1e6
    step_us = statistics.median(s.step_s for s, _ in full) * 1e6 + parts_us["emit"]
    report = {
        "device": args.device, "streams": args.streams, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "full_steps": len(full),
        "host_us_per_step": {part: round(us, 1) for part, us in parts_us.items()},
        "step_us": round(step_us, 1),
    }  # fmt: skip
    if args.measure_gpu:
        report["gpu_us_per_step"] = round(statistics.median(s.gpu_busy_ms() for s, _ in full) * 1e3, 1)
    return report


def print_table(report: dict) -> None:
    step_us = report["step_us"]
    print(f"{report['full_steps']} steps of {report['streams']} sequences on {report['device']}")
    print("| part | µs per step | share of the step |")
    print("| --- | --- | --- |")
    for part, us in report["host_us_per_step"].items():
        print(f"| {part} | {us:,.0f} | {us / step_us:.1%} |")
    print(f"| step (with emit) | {step_us:,.0f} | 100% |")
    if "gpu_us_per_step" in report:
        print(f"| device time (CUDA events) | {report['gpu_us_per_step']:,.0f} | {report['gpu_us_per_step'] / step_us:.2f}x the step |")


if __name__ == "__main__":
    main()
