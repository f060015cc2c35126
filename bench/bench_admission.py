"""The replica's admission on its event loop: what admitting a burst costs (issue 19: the served
replica's 256-stream first tokens waited 0.5-1.6 s on average in its queue).

    python bench/bench_admission.py                      # bursts of 64 and 256, 512 + 512 tokens
    python bench/bench_admission.py --burst 256 --rounds 5

An AdmissionController as the inference server builds it (pool, prefix cache, max-num-seqs 256)
with a step-time fit learnt from GPU-like steps (3 ms + 3 us per sequence + 2 us per prompt token),
then --burst requests admitted one after another, as a burst reaches a replica, without a
deadline (the baseline) and with --deadline-s (a client's timeout becomes the request's
deadline: each admission then checks that it breaks no promise made to those admitted before
it). Per burst size and setting, over --rounds fresh controllers: the mean us per admission,
its mean over the burst's last eighth, and the burst's total ms (min / median / max), with the
deadline setting's total as a ratio to the baseline's. Prints a table, writes
--out-dir/admission-<time>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from results_file import write_results
from llmserve.block_hash import HashNamespace
from llmserve.inference.admission import AdmissionConfig, AdmissionController
from llmserve.inference.engine.types import EngineRequest, StepReport
from llmserve.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
KV_BLOCKS = 65_536  # an H200's pool of the 1.5B shape holds more: the KV budget never refuses here
CONTEXT_TOKENS = 32_768
NAMESPACE = HashNamespace(model_fingerprint=1, tokenizer_fingerprint=2, block_size_tokens=16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", default="64,256", help="comma-separated burst sizes (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--deadline-s", type=float, default=600.0, help="(default: %(default)s: loadgen's timeout)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    args.burst = [int(size) for size in args.burst.split(",")]
    return args


def gpu_like_controller() -> AdmissionController:
    admission = AdmissionController(
        AdmissionConfig(max_waiting_requests=1024, max_num_seqs=256), kv_blocks_total=KV_BLOCKS,
        hash_namespace=NAMESPACE, max_context_tokens=CONTEXT_TOKENS,
    )  # fmt: skip
    admission.observe_steps([
        StepReport(0.003 + 3e-6 * batch + 2e-6 * (tokens - batch), batch, tokens)
        for batch in (1, 64, 128, 256) for tokens in (batch, batch + 1000, batch + 2000)
    ] * 3)  # fmt: skip
    return admission


def admit_burst(size: int, args, deadline_s: float) -> list[float]:
    """Seconds per admission of a burst of `size` distinct prompts, in order."""
    admission, seconds = gpu_like_controller(), []
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for index in range(size):
        prompt = [10 + (index * 7919 + position) % 50_000 for position in range(args.prompt_tokens)]
        deadline_ns = time.monotonic_ns() + int(deadline_s * 1e9) if deadline_s else 0
        request = EngineRequest(f"r{index}", prompt, sampling, arrival_ns=0, deadline_ns=deadline_ns)
        started = time.perf_counter()
        admission.admit(request)
        seconds.append(time.perf_counter() - started)
    return seconds


def measure(size: int, args, deadline_s: float) -> dict:
    rounds = [admit_burst(size, args, deadline_s) for _ in range(args.rounds)]
    tail = max(1, size // 8)
    spread = lambda values: [round(min(values), 3), round(statistics.median(values), 3), round(max(values), 3)]
    return {
        "mean_us": spread([1e6 * statistics.fmean(r) for r in rounds]),
        "last_eighth_mean_us": spread([1e6 * statistics.fmean(r[-tail:]) for r in rounds]),
        "total_ms": spread([1e3 * sum(r) for r in rounds]),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    print("| burst | deadline | us per admission (min / median / max) | last eighth, us | burst total ms | total vs no deadline |")
    print("| --- | --- | --- | --- | --- | --- |")
    for size in args.burst:
        baseline = measure(size, args, 0.0)
        timed = measure(size, args, args.deadline_s)
        for deadline, result in (("none", baseline), (f"{args.deadline_s:g} s", timed)):
            ratio = round(result["total_ms"][1] / baseline["total_ms"][1], 2)
            rows.append({"burst": size, "deadline": deadline, **result, "total_vs_no_deadline": ratio})
            print(f"| {size} | {deadline} | {' / '.join(map(str, result['mean_us']))} | {result['last_eighth_mean_us'][1]} "
                  f"| {' / '.join(map(str, result['total_ms']))} | {ratio} |", flush=True)
    write_results(args, "admission", {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
