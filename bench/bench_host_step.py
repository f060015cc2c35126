"""Host time of one engine step, by part, at a full decode batch (issue 19): where the engine-core
process spends a step besides the device's work.

    python bench/bench_host_step.py                          # CPU, tiny random Llama, 256 sequences
    python bench/bench_host_step.py --device cuda --model DIR  # a checkpoint on the GPU

Runs --streams requests of --prompt-tokens tokens asking for --output-tokens each (greedy,
ignore_eos) on a TorchEngineCore with its step stats on (engine/step_stats.py), driven as the
engine-core process drives it: an EngineLoop iteration, then its message sent down a real pipe
to a process that reads and drops it. Takes the iterations whose batch holds every sequence.
Per part the median µs per iteration, and each part's share of it:
  schedule, inputs, execute_launch, sampler_launch, result_wait, update, record  the core's step;
  loop   the loop's own work around the step (commands, deadlines, the load, the cache events);
  pickle the message: to the wire form, pickled as Connection.send pickles it (engine_process);
  write  the pickled message written into the pipe;
and the process's CPU time per iteration (every thread: on CUDA the driver's too) beside the
iteration's wall time, whose ratio is the engine-core process's busy share in bench_stack,
and the CPU no part accounts for. On CPU `execute_launch` is the forward itself (the kernels run
on the host); on CUDA, with --measure-gpu, the device time per step from CUDA events is the
baseline the host parts are compared with. Prints a table and writes JSON to --out-dir.

Timing depends on the machine and on what else runs on it: compare runs of one machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.inference.engine.config import EngineConfig, default_dtype
from llmserve.inference.engine.cores import create_engine_core
from llmserve.inference.engine.engine_loop import AddRequest, EngineLoop
from llmserve.inference.engine.engine_process import to_wire
from multiprocessing.reduction import ForkingPickler
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


@dataclass(slots=True)
class Timed:
    """One loop iteration, seconds: the iteration, its message pickled and written, all of it,
    and the process's CPU meanwhile."""

    iterate_s: float
    pickle_s: float
    write_s: float
    wall_s: float
    cpu_s: float


def drop_messages(reader, writer) -> None:
    """The server's end of the pipe: read every message, keep none, until the pipe closes (the
    writer's copy this fork inherited closed first, so the bench's close is the last)."""
    writer.close()
    try:
        while True:
            reader.recv_bytes()
    except EOFError:
        pass


def main() -> None:
    args = parse_args()
    # Started before torch touches a device: the child only reads the pipe.
    reader, pipe = multiprocessing.get_context("fork").Pipe(duplex=False)
    server = multiprocessing.get_context("fork").Process(target=drop_messages, args=(reader, pipe), daemon=True)
    server.start()
    reader.close()
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
    loop = EngineLoop(core)
    loop.iterate([
        AddRequest(EngineRequest(f"{i:032x}", [rng.randrange(5, vocab) for _ in range(args.prompt_tokens)], sampling,
                                 arrival_ns=time.monotonic_ns()))
        for i in range(args.streams)
    ])
    for _ in range(2):  # the prompts, and the first steps' one-time work
        loop.iterate([])
    core.step_stats = StepStatsLog(measure_gpu=args.measure_gpu)
    iterations = []
    while loop.has_work:
        started_s, started_cpu_s = time.perf_counter(), time.process_time()
        iteration = loop.iterate([])
        stepped_s = time.perf_counter()
        message = ForkingPickler.dumps(
            (to_wire(iteration.outputs), iteration.load, iteration.kv_events, iteration.step, iteration.replies)
        )
        pickled_s = time.perf_counter()
        pipe.send_bytes(message)
        ended_s = time.perf_counter()
        iterations.append(Timed(stepped_s - started_s, pickled_s - stepped_s, ended_s - pickled_s,
                                ended_s - started_s, time.process_time() - started_cpu_s))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    pipe.close()
    server.join(timeout=30)
    full = [(stats, timed) for stats, timed in zip(core.step_stats.steps, iterations) if stats.num_seqs == args.streams]
    report = summarize(full, args)
    print_table(report)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"host-step-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


def summarize(full: list, args) -> dict:
    parts_us = {part: statistics.median(getattr(s, f"{part}_s") for s, _ in full) * 1e6 for part in HOST_PARTS}
    parts_us["loop"] = statistics.median(timed.iterate_s - s.step_s for s, timed in full) * 1e6
    parts_us["pickle"] = statistics.median(timed.pickle_s for _, timed in full) * 1e6
    parts_us["write"] = statistics.median(timed.write_s for _, timed in full) * 1e6
    step_us = statistics.median(timed.wall_s for _, timed in full) * 1e6
    cpu_us = statistics.median(timed.cpu_s for _, timed in full) * 1e6
    # per iteration, the CPU beyond its measured parts (each part is wall time on this thread)
    outside_us = statistics.median(
        timed.cpu_s - sum(getattr(s, f"{part}_s") for part in HOST_PARTS) - (timed.wall_s - s.step_s)
        for s, timed in full
    ) * 1e6
    report = {
        "device": args.device, "streams": args.streams, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "full_steps": len(full),
        "host_us_per_step": {part: round(us, 1) for part, us in parts_us.items()},
        "step_us": round(step_us, 1),
        # every thread of the process; what the parts do not account for is CPU outside them
        "cpu_us_per_step": round(cpu_us, 1),
        "cpu_share_of_wall": round(cpu_us / step_us, 3),
        "cpu_us_outside_parts": round(outside_us, 1),
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
    print(f"| iteration (wall, with emit) | {step_us:,.0f} | 100% |")
    print(f"| process CPU, every thread | {report['cpu_us_per_step']:,.0f} | {report['cpu_share_of_wall']:.1%} |")
    print(f"| CPU outside the parts | {report['cpu_us_outside_parts']:,.0f} | "
          f"{report['cpu_us_outside_parts'] / step_us:.1%} |")
    if "gpu_us_per_step" in report:
        print(f"| device time (CUDA events) | {report['gpu_us_per_step']:,.0f} | {report['gpu_us_per_step'] / step_us:.2f}x the step |")


if __name__ == "__main__":
    main()
