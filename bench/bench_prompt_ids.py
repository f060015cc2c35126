"""Prompt token ids on their way preprocess → gateway → inference (issue 22): what each encoding
costs each process, the gateway's event loop above all.

    python bench/bench_prompt_ids.py                      # 512 to 1M tokens
    python bench/bench_prompt_ids.py --tokens 2048,32768 --repeats 100

Three encodings, each timed as the three processes handle it with the real messages and code,
from the tokenizer's list of ids to the engine's (in one process, so only the work each
encoding adds is timed, not the transport's copies of the bytes):
  token_ids       repeated uint32, as the hops carried them before token_id_bytes: preprocess
                  sets and serializes them; the gateway parses them, lists them and sets them
                  on the GenerateTokensRequest it serializes; inference parses that and converts
                  it (services/inference/wire.py, its checks included);
  token_id_bytes  what the hops carry now (llmserve.token_id_bytes): preprocess packs them; the
                  gateway relays the bytes field; inference parses and converts as above;
  region          the ids in preprocess's shared-memory ring (llmserve.prompt_ids_region), as the
                  services handle a long prompt: preprocess packs them, puts them in its ring and
                  answers the reference; the gateway relays the reference; inference (wire.py)
                  copies the ids out of the ring, checks the entry's key, the ids, and lists them.
Per size: median µs per process and in all for each encoding, the ratios, and the wire bytes of
the inference request's ids. Prints a table and writes JSON to --results-dir.
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

from llmserve import token_id_bytes  # noqa: E402
from llmserve.block_hash import HashNamespace  # noqa: E402
from llmserve.inference.engine.types import ModelInfo  # noqa: E402
from llmserve.inference.wire import request_from_pb  # noqa: E402
from llmserve.pb import region_ids_to_pb  # noqa: E402
from llmserve.prompt_ids_region import PromptIdsRing  # noqa: E402
from llmserve.v1 import common_pb2, inference_pb2, preprocess_pb2  # noqa: E402

VOCAB_SIZE = 151_936  # Qwen's: ids of up to 3 varint bytes, as in the real prompts
DEFAULT_TOKENS = "512,2048,8192,32768,131072,1048576"
ENCODINGS = ("token_ids", "token_id_bytes", "region")
PROCESSES = ("preprocess", "gateway", "inference")
WARMUP = 3
SAMPLING = common_pb2.SamplingParams(max_tokens=16)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help=f"prompt lengths (default {DEFAULT_TOKENS})")
    parser.add_argument("--repeats", type=int, default=30, help="timed repeats per cell (default 30)")
    parser.add_argument("--results-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args()
    args.tokens = [int(n) for n in args.tokens.split(",")]
    return args


def model_info(max_context_tokens: int) -> ModelInfo:
    return ModelInfo(
        "bench", "LlamaForCausalLM", max_context_tokens, VOCAB_SIZE, (2,), 16, "bfloat16", "torch", "cpu",
        HashNamespace(1, 2, 16),
    )


class Hops:
    """Each process's part of one prompt's way, per encoding; each returns what the next takes."""

    def __init__(self, ring: PromptIdsRing, info: ModelInfo):
        self.ring = ring
        self.info = info

    # --- preprocess: the tokenizer's list in, its answer's bytes out
    def preprocess_token_ids(self, ids: list[int]) -> bytes:
        return preprocess_pb2.PreprocessResponse(token_ids=ids, max_tokens=16).SerializeToString()

    def preprocess_token_id_bytes(self, ids: list[int]) -> bytes:
        packed = token_id_bytes.pack(ids)
        return preprocess_pb2.PreprocessResponse(token_id_bytes=packed, max_tokens=16).SerializeToString()

    def preprocess_region(self, ids: list[int]) -> bytes:  # as preprocess's servicer answers a long prompt
        packed = token_id_bytes.pack(ids)
        ref = self.ring.put(packed)
        response = preprocess_pb2.PreprocessResponse(token_ids_in_region=region_ids_to_pb(ref), max_tokens=16)
        return response.SerializeToString()

    # --- gateway: preprocess's answer in, the inference request's bytes out
    def gateway_token_ids(self, answer: bytes) -> bytes:
        response = preprocess_pb2.PreprocessResponse.FromString(answer)
        ids = list(response.token_ids)
        request = inference_pb2.GenerateTokensRequest(request_id="r", prompt_token_ids=ids, sampling=SAMPLING)
        return request.SerializeToString()

    def gateway_token_id_bytes(self, answer: bytes) -> bytes:
        response = preprocess_pb2.PreprocessResponse.FromString(answer)
        return inference_pb2.GenerateTokensRequest(
            request_id="r", prompt_token_id_bytes=response.token_id_bytes, sampling=SAMPLING
        ).SerializeToString()

    def gateway_region(self, answer: bytes) -> bytes:
        response = preprocess_pb2.PreprocessResponse.FromString(answer)
        request = inference_pb2.GenerateTokensRequest(request_id="r", sampling=SAMPLING)
        request.prompt_token_ids_in_region.CopyFrom(response.token_ids_in_region)
        return request.SerializeToString()

    # --- inference: the request's bytes in, the engine's list of ids out
    def inference_token_ids(self, request: bytes, num_ids: int) -> list[int]:
        return self._convert(inference_pb2.GenerateTokensRequest.FromString(request))

    inference_token_id_bytes = inference_token_ids

    inference_region = inference_token_ids  # wire.py copies the ids out of the ring

    def _convert(self, message: inference_pb2.GenerateTokensRequest) -> list[int]:
        return request_from_pb(message, self.info, time.monotonic_ns()).prompt_token_ids


def median_us(work, repeats: int) -> float:
    for _ in range(WARMUP):
        work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(hops: Hops, encoding: str, ids: list[int], repeats: int) -> dict[str, float]:
    preprocess = getattr(hops, f"preprocess_{encoding}")
    gateway = getattr(hops, f"gateway_{encoding}")
    inference = getattr(hops, f"inference_{encoding}")
    preprocess_us = median_us(lambda: preprocess(ids), repeats)
    answer = preprocess(ids)  # the ring's newest entry: intact until the next put
    request = gateway(answer)
    assert inference(request, len(ids)) == ids, encoding
    times = {
        "preprocess": preprocess_us,
        "gateway": median_us(lambda: gateway(answer), repeats),
        "inference": median_us(lambda: inference(request, len(ids)), repeats),
    }
    return {**times, "total": sum(times.values()), "request_bytes": len(request)}


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(0)
    # Lease 0: an entry may be reused at the next put, which the timing loops make many of.
    ring = PromptIdsRing(2 * (16 + 4 * max(args.tokens)) + 64, lease_s=0.0)
    hops = Hops(ring, model_info(max(args.tokens) + SAMPLING.max_tokens))
    rows = []
    try:
        for num_tokens in args.tokens:
            ids = rng.integers(0, VOCAB_SIZE, num_tokens, dtype=np.uint32).tolist()
            cells = {encoding: measure(hops, encoding, ids, args.repeats) for encoding in ENCODINGS}
            before, now, region = (cells[encoding] for encoding in ENCODINGS)
            rows.append({
                "tokens": num_tokens, "us": cells,
                "total_bytes_over_ids": now["total"] / before["total"],
                "gateway_bytes_over_ids": now["gateway"] / before["gateway"],
                "total_region_over_bytes": region["total"] / now["total"],
            })
    finally:
        ring.close()
    print_table(rows)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"prompt-ids-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2))
    print(f"wrote {out}")


def print_table(rows: list[dict]) -> None:
    print("median µs per process (preprocess / gateway / inference = total); request bytes: the inference request's")
    print(f"{'tokens':>9} | {'token_ids':>34} | {'token_id_bytes':>34} | {'region':>30} | "
          f"{'bytes/ids':>9} {'gateway':>8} {'region/bytes':>12} | {'request bytes ids/bytes/region':>30}")
    for row in rows:
        cells = [row["us"][encoding] for encoding in ENCODINGS]
        parts = [" / ".join(f"{cell[p]:.0f}" for p in PROCESSES) + f" = {cell['total']:.0f}" for cell in cells]
        ratios = (f"{row['total_bytes_over_ids']:>9.2f} {row['gateway_bytes_over_ids']:>8.3f} "
                  f"{row['total_region_over_bytes']:>12.2f}")
        print(f"{row['tokens']:>9} | {parts[0]:>34} | {parts[1]:>34} | {parts[2]:>30} | {ratios} | "
              f"{cells[0]['request_bytes']:>11} / {cells[1]['request_bytes']:>9} / {cells[2]['request_bytes']:>6}")


if __name__ == "__main__":
    main()
