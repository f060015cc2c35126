"""Prompt token ids at the preprocess → inference hop (issue 22): inline in the protobuf message
that carries the request anyway, against a shared-memory region beside it. Where is the crossover?

    python bench/bench_prompt_ids.py                      # 512 to 1M tokens
    python bench/bench_prompt_ids.py --tokens 2048,32768 --repeats 100

Both paths start where preprocess has them (the tokenizer's Python list of ids) and end where the
inference server wants them (a Python list for the engine's request), in one process, so only the
work each path adds is timed, not the hop's own message:
  inline   the ids set on a GenerateTokensRequest, serialized, parsed back, listed (what the
           request's own gRPC message costs for them; the transport's copies of the bytes are
           not counted, which favours inline);
  bytes    the ids as little-endian uint32 bytes (what a `bytes` field would carry instead of
           the repeated uint32 varints): converted to bytes, back to an array, listed; the
           message's own encoding of a bytes field is a copy, not counted;
  shm      the ids written into a shared-memory region the two sides have mapped (the list
           converted into it), copied out of it by the reader and listed; the ref that names
           them and the region's reuse (a ring, an acknowledgement) are not counted, which
           favours shm.
Per size: median µs of each (after a warm-up), bytes / inline, shm / inline, and the wire bytes of the ids
inline. Prints a table and writes JSON to --results-dir.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from llmserve.tensor_transport.shm_reaper import process_reaper  # noqa: E402
from llmserve.tensor_transport.shm_segment import ShmSegment  # noqa: E402
from llmserve.v1 import inference_pb2  # noqa: E402

VOCAB_SIZE = 151_936  # Qwen's: ids of up to 3 varint bytes, as in the real prompts
DEFAULT_TOKENS = "512,2048,8192,32768,131072,1048576"
WARMUP = 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help=f"prompt lengths (default {DEFAULT_TOKENS})")
    parser.add_argument("--repeats", type=int, default=30, help="timed repeats per cell (default 30)")
    parser.add_argument("--results-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args()
    args.tokens = [int(n) for n in args.tokens.split(",")]
    return args


def median_us(work, repeats: int) -> float:
    for _ in range(WARMUP):
        work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def inline(ids: list[int]) -> list[int]:
    encoded = inference_pb2.GenerateTokensRequest(request_id="r", prompt_token_ids=ids).SerializeToString()
    decoded = inference_pb2.GenerateTokensRequest()
    decoded.ParseFromString(encoded)
    return list(decoded.prompt_token_ids)


def as_bytes(ids: list[int]) -> list[int]:
    encoded = np.asarray(ids, dtype="<u4").tobytes()
    return np.frombuffer(encoded, dtype="<u4").tolist()


def through_region(ids: list[int], region: np.ndarray) -> list[int]:
    written = region[: len(ids)]
    written[:] = ids
    return np.array(written).tolist()


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(0)
    segment = ShmSegment.create(4 * max(args.tokens), process_reaper())
    region = np.frombuffer(segment.data.numpy(), dtype=np.uint32)
    rows = []
    try:
        for num_tokens in args.tokens:
            ids = rng.integers(0, VOCAB_SIZE, num_tokens, dtype=np.uint32).tolist()
            assert inline(ids) == ids == as_bytes(ids) == through_region(ids, region)
            inline_us = median_us(lambda: inline(ids), args.repeats)
            bytes_us = median_us(lambda: as_bytes(ids), args.repeats)
            shm_us = median_us(lambda: through_region(ids, region), args.repeats)
            wire_bytes = inference_pb2.GenerateTokensRequest(prompt_token_ids=ids).ByteSize()
            rows.append({
                "tokens": num_tokens, "inline_us": inline_us, "bytes_us": bytes_us, "shm_us": shm_us,
                "bytes_over_inline": bytes_us / inline_us, "shm_over_inline": shm_us / inline_us,
                "inline_wire_bytes": wire_bytes,
            })
    finally:
        del region
        segment.unlink()
    print(f"{'tokens':>9} {'inline µs':>11} {'bytes µs':>10} {'shm µs':>10} {'bytes/inline':>13} {'shm/inline':>11} {'wire bytes':>11}")
    for row in rows:
        print(f"{row['tokens']:>9} {row['inline_us']:>11.1f} {row['bytes_us']:>10.1f} {row['shm_us']:>10.1f} "
              f"{row['bytes_over_inline']:>13.2f} {row['shm_over_inline']:>11.2f} {row['inline_wire_bytes']:>11}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"prompt-ids-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
