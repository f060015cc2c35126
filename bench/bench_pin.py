"""A KV pin at a busy source: answered mid-step (the default) against between two steps
(`--no-mid-step-calls`), in one run (issue 22; engine/mid_step_calls.py).

    python bench/bench_pin.py                                        # CPU, the default model's shape
    python bench/bench_pin.py --device cuda --shape qwen2.5-1.5b     # a GPU

Two source replicas with --kv-pull, alike but for that flag, on one device. Each holds a
--prefix-tokens prefix in its cache and runs a background request all along (a
--busy-prompt-tokens prompt, --busy-output-tokens tokens, sent again when it ends), so its
engine is always in a step: what a puller meets at the replica the router pulls from. Then
--pins PinKvBlocks calls per replica, the replicas in turn, each timed at the client and
released at once. Per setting: pin ms min / p50 / p90 / max, and p50 as a ratio to
between-steps'. Every pin must return the prefix's blocks. Writes JSON to --out-dir.

--block-hashes: every pin is also made with the prefix's block hashes, as a puller forwards its
request's (the source's core then does not hash the prompt), in turn with one without them;
each setting gets a row per kind and the ratio of their p50s. --settings picks the settings.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import bench_stack
from results_file import write_results
from bench_kv_pull import BLOCK_SIZE, RPC_TIMEOUT_S, Busy, Replica, fresh_tokens, request, set_block_hashes
from llmserve.block_hash import HashNamespace
from llmserve.inference.kv_pull_wire import identity_to_pb
from llmserve.tensor_transport import local_identity
from llmserve.v1 import inference_pb2

REPO_ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"mid-step": [], "between steps": ["--no-mid-step-calls"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_stack.add_model_arguments(parser)
    parser.set_defaults(device="cpu", shape="smollm2-135m")
    parser.add_argument("--prefix-tokens", type=int, default=512, help="(default: %(default)s)")
    parser.add_argument("--busy-prompt-tokens", type=int, default=1024, help="(default: %(default)s)")
    parser.add_argument("--busy-output-tokens", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--pins", type=int, default=30, help="per replica (default: %(default)s)")
    parser.add_argument("--num-kv-blocks", type=int, default=512, help="per replica (default: %(default)s)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    parser.add_argument("--block-hashes", action="store_true",
                        help="also pin with the prefix's block hashes, in turn with pins without")
    parser.add_argument("--inference-arg", action="append", default=[], help="extra inference flag (repeatable)")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results", metavar="DIR")
    return parser.parse_args(argv)


def pin_ms(replica: Replica, prefix: list[int], expected_blocks: int, namespace: HashNamespace | None = None) -> float:
    """One pin, timed at the client, then released; with the prompt's block hashes when given
    their namespace."""
    pin_request = inference_pb2.PinKvBlocksRequest(
        prompt_token_ids=prefix + [1], puller=identity_to_pb(local_identity("cpu")), lease_ms=10_000
    )  # fmt: skip
    if namespace is not None:
        set_block_hashes(pin_request, prefix + [1], "", namespace)
    started_s = time.perf_counter()
    pinned = replica.stub.PinKvBlocks(pin_request, timeout=RPC_TIMEOUT_S)
    elapsed_ms = (time.perf_counter() - started_s) * 1000
    replica.stub.ReleaseKvBlocks(inference_pb2.ReleaseKvBlocksRequest(pin_id=pinned.pin_id), timeout=RPC_TIMEOUT_S)
    if len(pinned.block_ids) != expected_blocks:
        raise SystemExit(f"a pin returned {len(pinned.block_ids)} blocks, not the prefix's {expected_blocks} "
                         "(evicted: raise --num-kv-blocks)")
    return elapsed_ms


def main() -> None:
    args = parse_args()
    num_ids = 400 if args.shape == "tiny" else 10_000
    prefix = fresh_tokens(args.prefix_tokens, 1, num_ids)
    expected_blocks = args.prefix_tokens // BLOCK_SIZE
    settings = {name: SETTINGS[name] for name in args.settings.split(",")}
    kinds = ["no hashes", "hashes"] if args.block_hashes else ["no hashes"]
    times: dict[tuple[str, str], list[float]] = {(name, kind): [] for name in settings for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-pin-") as scratch:
        model_dir = bench_stack.build_model(args, Path(scratch) / "model")
        namespaces = {"no hashes": None, "hashes": HashNamespace.of_model_dir(model_dir, BLOCK_SIZE)}
        replicas = {}
        for name, flags in settings.items():
            replica_args = argparse.Namespace(**{**vars(args), "inference_arg": [*args.inference_arg, *flags]})
            replicas[name] = Replica(name.replace(" ", "-"), replica_args, model_dir, Path(scratch) / "logs")
        busy = []
        try:
            for replica in replicas.values():
                replica.service.wait_until_serving(args.startup_timeout_s)
                replica.connect()
                replica.first_token(request("hold", prefix + [1]))  # the prefix, cached
                pin_ms(replica, prefix, expected_blocks)  # warm-up: the first offer of the pool
            busy = [Busy(replica, args.busy_prompt_tokens, args.busy_output_tokens, num_ids) for replica in replicas.values()]
            time.sleep(1.0)  # both busy
            for _ in range(args.pins):
                for (name, kind), values in times.items():
                    # The busy prompts churn the pool (a GPU runs several a second): the prefix
                    # asked again, so that what the pin finds is cached, not evicted. Not timed.
                    replicas[name].first_token(request("hold", prefix + [1]))
                    values.append(pin_ms(replicas[name], prefix, expected_blocks, namespaces[kind]))
        finally:
            for work in busy:
                work.stop()
            for replica in replicas.values():
                replica.stop()
    rows = []
    for (name, kind), values in times.items():
        ordered = sorted(values)
        rows.append({"setting": name, "kind": kind, "min_ms": ordered[0], "p50_ms": statistics.median(ordered),
                     "p90_ms": statistics.quantiles(ordered, n=10)[-1], "max_ms": ordered[-1]})
    p50 = {(row["setting"], row["kind"]): row["p50_ms"] for row in rows}
    print(f"{args.device}, {args.shape}, pins of a {args.prefix_tokens}-token prefix at a replica busy with "
          f"{args.busy_prompt_tokens}-token prompts x {args.busy_output_tokens} tokens, {args.pins} each")
    print("| setting | pin | ms min / p50 / p90 / max | p50 vs between steps | p50 vs no hashes |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        between, plain = p50.get(("between steps", row["kind"])), p50[(row["setting"], "no hashes")]
        row["p50_vs_between_steps"] = row["p50_ms"] / between if between else None
        row["p50_vs_no_hashes"] = row["p50_ms"] / plain
        ratio = "-" if between is None else f"{row['p50_vs_between_steps']:.2f}"
        print(f"| {row['setting']} | {row['kind']} | {row['min_ms']:.2f} / {row['p50_ms']:.2f} / {row['p90_ms']:.2f} / "
              f"{row['max_ms']:.2f} | {ratio} | {row['p50_vs_no_hashes']:.2f} |")
    write_results(args, "pin", {"rows": rows, "times": {f"{name} / {kind}": values for (name, kind), values in times.items()}})


if __name__ == "__main__":
    main()
