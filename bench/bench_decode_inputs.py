"""Host time of a decode step's inputs on the decode-graph path (issue 19): the flat inputs built
from the batch (batch_inputs.build_step_inputs over the persistent decode batch,
engine/decode_batch.py) and DecodeGraphs.run's staging (the changed table entries, the padded
int rows, the copies), with a forward that does nothing, so that only the host's work per step
is timed.

    python bench/bench_decode_inputs.py                      # CPU: the graphs' path uncaptured
    python bench/bench_decode_inputs.py --device cuda        # the same staging into the GPU

--streams sequences decode together for --steps steps from contexts of --context tokens and
up; each step appends a token to each, and a block when one fills (a new block_ids list, as the
BlockManager does), so ~1 in block_size rows is re-sent each step. bench_host_step.py cannot
time this path on the CPU (the portable attention backend runs without decode graphs).
Prints the median µs per step of each part and per sequence, min / median / max over --repeat,
and writes JSON to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from llmserve.inference.engine.batch_inputs import build_step_inputs
from llmserve.inference.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from llmserve.inference.engine.decode_batch import DecodeBatch
from llmserve.inference.engine.scheduler import ScheduledBatch
from llmserve.inference.engine.sequence import PLACEHOLDER_TOKEN, Sequence
from llmserve.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--context", type=int, default=700, help="tokens of the shortest context at the start (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=300, help="(default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="(default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    return parser.parse_args()


def decoding_sequences(args) -> list[Sequence]:
    """Sequences mid-decode, each with a placeholder last token (async scheduling's steady state)."""
    sampling = SamplingParams(max_tokens=args.context + args.streams + args.steps + 16)
    seqs = []
    for i in range(args.streams):
        num_tokens = args.context + i
        width = num_tokens // BLOCK_SIZE + 1
        seqs.append(Sequence(
            i, f"r{i}", 0, list(range(num_tokens - 1)) + [PLACEHOLDER_TOKEN], args.context // 2, sampling,
            block_ids=list(range(i * 1000, i * 1000 + width)), num_computed_tokens=num_tokens - 1, placeholder_row=i,
        ))  # fmt: skip
    return seqs


def run(args, device: torch.device) -> dict:
    seqs = decoding_sequences(args)
    max_blocks = (args.context + args.streams + args.steps) // BLOCK_SIZE + 2
    logits = torch.zeros(args.streams, 8, device=device)
    graphs = DecodeGraphs(lambda ids, positions, meta: logits[: ids.shape[0]], graph_batch_sizes(args.streams),
                          max_blocks, lambda *tensors: None, device, None)
    decodes = DecodeBatch(args.streams, max_blocks, BLOCK_SIZE)
    next_block = args.streams * 1000
    launched = torch.arange(args.streams, device=device)
    inputs_s, staging_s = [], []
    for _ in range(args.steps):
        batch = ScheduledBatch(list(seqs), [1] * args.streams, num_decodes=args.streams)  # as the scheduler marks them
        start = time.perf_counter()
        step = build_step_inputs(batch, decodes)
        built = time.perf_counter()
        graphs.run(step, lambda input_ids: input_ids[: args.streams].copy_(launched))
        staged = time.perf_counter()
        inputs_s.append(built - start)
        staging_s.append(staged - built)
        for seq in seqs:  # the step recorded: its token known, the next one a placeholder
            seq.token_ids[-1] = 5
            seq.token_ids.append(PLACEHOLDER_TOKEN)
            seq.num_computed_tokens += 1
            if seq.num_computed_tokens >= len(seq.block_ids) * BLOCK_SIZE:
                seq.block_ids = seq.block_ids + [next_block]
                next_block += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"inputs": statistics.median(inputs_s) * 1e6, "staging": statistics.median(staging_s) * 1e6}


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    runs = [run(args, device) for _ in range(args.repeat)]
    report = {"device": args.device, "streams": args.streams, "context": args.context, "steps": args.steps, "runs": runs}
    print(f"{args.streams} decoding sequences on {args.device}, µs per step (min / median / max of {args.repeat} runs)")
    print("| part | µs per step | µs per sequence |")
    print("| --- | --- | --- |")
    for part in ("inputs", "staging"):
        values = sorted(run_[part] for run_ in runs)
        median = statistics.median(values)
        print(f"| {part} | {values[0]:,.0f} / {median:,.0f} / {values[-1]:,.0f} | {median / args.streams:.2f} |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"decode-inputs-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
