"""What async scheduling gives and costs, per device: the engine core with it and without, one
stream at a time, in one run (issue 19's first token; the CPU default in engine/config.py).

    python bench/bench_async_scheduling.py                          # CPU, the default model
    python bench/bench_async_scheduling.py --device cuda --shape qwen2.5-1.5b

With async scheduling `step()` launches step N+1 before it processes step N, so step N's tokens
leave the core after N+1's launch: on a GPU the launch only queues work (the host's schedule,
inputs and launch time), on a CPU it is N+1's whole forward. Each round sends one request per
setting, the settings interleaved, on two engine cores built alike (--model, else the default
model on CPU and a random-weight --shape on CUDA): a --prompt-tokens prompt, --output-tokens
greedy tokens, EOS ignored, the prefix cache off (every prefill computed). Per setting: TTFT
(add_request to the first token out of step()) and ITL p50 per round, min / median / max over
--rounds, and each as a ratio to async scheduling's in the same round. Writes JSON to --out-dir.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import bench_stack
from results_file import write_results
from llmserve.block_hash import DEFAULT_BLOCK_SIZE
from llmserve.inference.engine.config import EngineConfig, default_dtype
from llmserve.inference.engine.cores import create_engine_core
from llmserve.inference.engine.types import EngineRequest
from llmserve.model_files import ModelFiles
from llmserve.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"async": True, "one step at a time": False}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_stack.add_model_arguments(parser)
    parser.set_defaults(device="cpu")
    parser.add_argument("--model", type=Path, metavar="DIR", help="a checkpoint (default: the default model on "
                        "CPU, random weights of --shape on CUDA)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="(default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results", metavar="DIR")
    return parser.parse_args(argv)


def model_dir(args: argparse.Namespace, scratch: Path) -> Path:
    if args.model is not None:
        return args.model
    if args.device == "cpu" and args.shape != "tiny":
        from llmserve.tools.model_store import resolve_model

        return resolve_model(None)
    return bench_stack.build_model(args, scratch / "model")


def time_request(core, request_id: str, prompt: list[int], output_tokens: int) -> tuple[float, float]:
    """(TTFT s, ITL p50 s) of one request alone in `core`."""
    sampling = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    core.add_request(EngineRequest(request_id, prompt, sampling, time.monotonic_ns()))
    token_times: list[float] = []
    while core.has_requests_in_flight():
        outputs = core.step()
        now = time.perf_counter()
        token_times += [now] * (len(outputs.outputs) + (len(outputs.tokens.request_ids) if outputs.tokens else 0))
    gaps = [later - earlier for earlier, later in zip(token_times, token_times[1:]) if later > earlier]
    return token_times[0] - start, statistics.median(gaps) if gaps else 0.0


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-async-") as scratch:
        directory = model_dir(args, Path(scratch))
        files = ModelFiles.load(directory)
        # Both cores live in this process: sized for the one request each runs, not for a share
        # of the device's memory (the first would take it all).
        num_kv_blocks = 2 * -(-(args.prompt_tokens + args.output_tokens) // DEFAULT_BLOCK_SIZE)
        cores = {
            name: create_engine_core(EngineConfig(
                model_path=directory, model_name=files.model_name, device=args.device, dtype=default_dtype(args.device),
                async_scheduling=overlaps, enable_prefix_caching=False, num_kv_blocks=num_kv_blocks,
            ))  # fmt: skip
            for name, overlaps in SETTINGS.items()
        }
        vocab = min(files.config.get("vocab_size", 32000), 32000)
        for name, core in cores.items():  # warm-up
            time_request(core, f"warm-{name}", [5 + k for k in range(args.prompt_tokens)], 4)
        rounds = []
        for round_index in range(args.rounds):
            prompt = [(31 * k + 7 * round_index) % (vocab - 10) + 5 for k in range(args.prompt_tokens)]
            rounds.append({
                name: dict(zip(("ttft_ms", "itl_ms"), (1e3 * s for s in time_request(core, f"r{round_index}", prompt,
                                                                                   args.output_tokens))))
                for name, core in cores.items()
            })  # fmt: skip
    rows = []
    for name in SETTINGS:
        row = {"setting": name}
        for metric in ("ttft_ms", "itl_ms"):
            values = sorted(r[name][metric] for r in rounds)
            ratios = sorted(r[name][metric] / r["async"][metric] for r in rounds)
            row[metric] = [values[0], statistics.median(values), values[-1]]
            row[f"{metric}_vs_async"] = [ratios[0], statistics.median(ratios), ratios[-1]]
        rows.append(row)
    triple = lambda values, digits: " / ".join(f"{v:.{digits}f}" for v in values)  # noqa: E731
    print(f"{args.device}, {files.model_name}, {args.prompt_tokens}-token prompt, {args.output_tokens} tokens, "
          f"{args.rounds} rounds (min / median / max)")
    print("| setting | TTFT ms | TTFT vs async | ITL p50 ms | ITL vs async |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['setting']} | {triple(r['ttft_ms'], 1)} | {triple(r['ttft_ms_vs_async'], 2)} "
              f"| {triple(r['itl_ms'], 2)} | {triple(r['itl_ms_vs_async'], 2)} |")
    write_results(args, "async-scheduling", {"rows": rows, "rounds": rounds})


if __name__ == "__main__":
    main()
