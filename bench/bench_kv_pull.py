"""KV pull against recomputing (issue 22): the first token of a request whose prefix another
co-located replica holds, pulled from it or computed again.

    python bench/bench_kv_pull.py                                # H200: the 1.5B shape, 2k and 8k prefixes
    python bench/bench_kv_pull.py --shape llama-3.1-8b           # the 8B shape (8k: 8064 + 64 fits its 8192)
    python bench/bench_kv_pull.py --smoke                        # CPU, tiny model: that it runs

Two inference replicas, A and B, on one device, each with --kv-pull (CUDA IPC between them on
a GPU, /dev/shm on CPU). For each --prefix-tokens length, a warm-up pair, then --repeats pairs,
each on a fresh prefix:
  pull       A runs prefix + 1 token (max_tokens 1), so A holds the prefix; then B gets prefix +
             --suffix-tokens fresh tokens with a KvPullHint naming A. Its TTFT, at the client,
             from sending to the first token: pin at A, copy, release, then the suffix's prefill;
  recompute  B gets the same prompt under a cache salt nothing else uses: it computes it all;
  cached     B gets the same prompt again, now in its own cache: the floor a pull approaches
             (what is left is the pull's pin, copy and round trips).
With --busy-source-prompt-tokens A runs a long request all along, as the replica a router
pulls from does (its pins are answered mid-step: bench_pin.py). Every request carries its
prompt's block hashes, as the gateway sends them from preprocess (B forwards them with the pin,
so neither core hashes the prompt); --no-block-hashes leaves them out (each core hashes).
Ratio: pull / recompute TTFT, median over the repeats [target <= 0.3x]. Each pull's greedy first
token must equal the recomputed one's, and its usage must report the prefix's blocks as pulled.
Bandwidth, from B's /metrics around each timed pull (medians over the repeats, as every phase
below): bytes / the copies' time
(llmserve_kv_pull_copy_seconds: device to device, synchronized) [target >= 1 TB/s for >= 100 MB],
bytes / the copy kernel's own device time (llmserve_kv_pull_copy_device_seconds, CUDA events; CUDA only),
and bytes / the whole pull (the pin and import round trips, llmserve_kv_pull_duration_seconds);
and ms per pull of its phases at B (llmserve_kv_pull_phase_seconds): the pin's round trip to A,
the import's to B's engine core, the core's own work in it, the copies in that.

Prints a table and writes --out-dir/kv-pull-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

import bench_stack
from metrics_scrape import metric_families
from llmserve.block_hash import HASH_VERSION, HashNamespace
from stack_services import free_port
from llmserve.tools.service_process import launch_service, stop_service
from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
RPC_TIMEOUT_S = 600.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_stack.add_model_arguments(parser)
    parser.add_argument("--prefix-tokens", default="2048,8064", help="comma-separated prefix lengths")
    parser.add_argument("--suffix-tokens", type=int, default=64, help="fresh tokens after the prefix")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="KV blocks per replica (16 tokens each)")
    parser.add_argument("--busy-source-prompt-tokens", type=int, default=0, metavar="N",
                        help="keep A busy all along with a request of N prompt tokens (sent again when it ends): "
                        "the replica a router pulls from is the busy one (default: 0, A idle)")
    parser.add_argument("--busy-source-output-tokens", type=int, default=128, metavar="N", help="(default: %(default)s)")
    parser.add_argument("--no-block-hashes", dest="block_hashes", action="store_false",
                        help="send requests without their block hashes (the replicas' cores hash the prompts)")
    parser.add_argument("--inference-arg", action="append", default=[], help="extra inference flag (repeatable)")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, short prefixes")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.device, args.prefix_tokens, args.suffix_tokens = "tiny", "cpu", "96,160", 16
        args.repeats, args.num_kv_blocks = 2, 128
    return args


class Replica:
    def __init__(self, name: str, args, model_dir: Path, log_dir: Path):
        self.metrics_port = free_port()
        self.service = launch_service("inference", [
            "--model", str(model_dir), "--device", args.device, "--num-kv-blocks", str(args.num_kv_blocks),
            "--block-size", str(BLOCK_SIZE), "--kv-pull", "--replica-id", name,
            "--metrics-port", str(self.metrics_port), *args.inference_arg,
        ], log_dir / name)
        self._channel: grpc.Channel | None = None
        self.stub: inference_pb2_grpc.InferenceServiceStub | None = None

    def connect(self) -> None:
        self._channel = grpc.insecure_channel(self.service.address)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self._channel)

    def first_token(self, request: inference_pb2.GenerateTokensRequest) -> tuple[float, int, common_pb2.Usage]:
        """(TTFT in ms at the client, the first token, the usage) of a max_tokens 1 request."""
        started_s = time.perf_counter()
        responses = self.stub.GenerateTokens(request, timeout=RPC_TIMEOUT_S)
        first = next(responses)
        ttft_ms = (time.perf_counter() - started_s) * 1000
        last = first
        for last in responses:
            pass
        return ttft_ms, first.token_ids[0], last.usage

    def metric_sums(self) -> dict[str, float]:
        sums: dict[str, float] = {}
        for family in metric_families(self.metrics_port):
            if family.name.startswith("llmserve_kv_pull"):
                for sample in family.samples:  # by phase where there is one, else summed over labels
                    name = f"{sample.name}/{sample.labels['phase']}" if "phase" in sample.labels else sample.name
                    sums[name] = sums.get(name, 0.0) + sample.value
        return sums

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        stop_service(self.service)


class Busy:
    """A request always running on `replica`, sent again when it ends, until stopped."""

    def __init__(self, replica: Replica, prompt_tokens: int, output_tokens: int, num_ids: int):
        self._replica, self._num_ids = replica, num_ids
        self._prompt_tokens, self._output_tokens = prompt_tokens, output_tokens
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seed = 0
        while not self._stopped.is_set():
            seed += 1
            pb = request(f"busy-{seed}", fresh_tokens(self._prompt_tokens, 7_000_000 + seed, self._num_ids))
            pb.sampling.CopyFrom(common_pb2.SamplingParams(
                max_tokens=self._output_tokens, temperature=0.0, ignore_eos=True
            ))  # fmt: skip
            for _ in self._replica.stub.GenerateTokens(pb, timeout=RPC_TIMEOUT_S):
                if self._stopped.is_set():
                    break

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(RPC_TIMEOUT_S)


def request(name: str, prompt: list[int], *, salt: str = "", source: Replica | None = None, num_blocks: int = 0,
            namespace: HashNamespace | None = None):
    """A request of `prompt`, with its block hashes for `salt` when given a namespace (as the
    gateway sends it)."""
    pb = inference_pb2.GenerateTokensRequest(
        request_id=name, prompt_token_ids=prompt, cache_salt=salt,
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    )
    if namespace is not None:
        set_block_hashes(pb, prompt, salt, namespace)
    if source is not None:
        pb.kv_pull.CopyFrom(inference_pb2.KvPullHint(source_address=source.service.address, num_blocks=num_blocks))
    return pb


def set_block_hashes(pb, prompt: list[int], salt: str, namespace: HashNamespace) -> None:
    """Fill a GenerateTokensRequest's or PinKvBlocksRequest's block hash fields for `prompt`."""
    pb.block_hashes[:] = namespace.block_hashes(prompt, salt)
    pb.block_size_tokens, pb.block_hash_version = namespace.block_size_tokens, HASH_VERSION


def fresh_tokens(count: int, seed: int, num_ids: int) -> list[int]:
    """Seeded random ids in 10 .. 10 + num_ids: no two seeds' prompts share a block."""
    rng = random.Random(seed)
    return [10 + rng.randrange(num_ids) for _ in range(count)]


def measure(a: Replica, b: Replica, prefix_tokens: int, args, seed: int, namespace: HashNamespace | None) -> dict:
    """One pull and one recompute of a fresh prefix of `prefix_tokens`."""
    num_ids = 400 if args.shape == "tiny" else 10_000  # below every vocabulary the shapes have
    prefix = fresh_tokens(prefix_tokens, seed, num_ids)
    prompt = prefix + fresh_tokens(args.suffix_tokens, seed + 1_000_003, num_ids)
    a.first_token(request(f"hold-{seed}", prefix + [1], namespace=namespace))
    num_blocks = prefix_tokens // BLOCK_SIZE
    pull_ms, pulled_token, usage = b.first_token(
        request(f"pull-{seed}", prompt, source=a, num_blocks=num_blocks, namespace=namespace))
    recompute_ms, recomputed_token, plain = b.first_token(
        request(f"recompute-{seed}", prompt, salt=f"fresh-{seed}", namespace=namespace))
    cached_ms, cached_token, own = b.first_token(request(f"cached-{seed}", prompt, namespace=namespace))
    return {
        "pull_ms": pull_ms, "recompute_ms": recompute_ms, "cached_ms": cached_ms,
        "cached_tokens_own": own.cached_tokens, "same_cached_token": cached_token == recomputed_token,
        "pulled_tokens": usage.pulled_tokens,
        "expected_pulled_tokens": min(num_blocks, (len(prompt) - 1) // BLOCK_SIZE) * BLOCK_SIZE,
        "recompute_cached_tokens": plain.cached_tokens, "same_first_token": pulled_token == recomputed_token,
    }


def run_length(a: Replica, b: Replica, prefix_tokens: int, args, namespace: HashNamespace | None) -> dict:
    measure(a, b, prefix_tokens, args, prefix_tokens * 1000, namespace)  # warm-up: shapes, the first mapping
    runs = []
    for i in range(args.repeats):
        before = b.metric_sums()
        run = measure(a, b, prefix_tokens, args, prefix_tokens * 1000 + 1 + i, namespace)
        run["at_b"] = _pull_at_b(before, b.metric_sums())
        runs.append(run)
    # Medians over the runs, the phases included: one slow first pull (62 ms of 21-23 ms on the
    # H200) made the mean copy time 14 ms and its bandwidth 16 GB/s.
    at_b = {name: statistics.median(run["at_b"][name] for run in runs) for name in runs[0]["at_b"]}
    pull_ms = statistics.median(run["pull_ms"] for run in runs)
    recompute_ms = statistics.median(run["recompute_ms"] for run in runs)
    cached_ms = statistics.median(run["cached_ms"] for run in runs)
    pulled_bytes = at_b["bytes"]
    return {
        "prefix_tokens": prefix_tokens, "runs": runs, "pull_ttft_ms": round(pull_ms, 3),
        "recompute_ttft_ms": round(recompute_ms, 3), "pull_over_recompute": round(pull_ms / recompute_ms, 4),
        "cached_ttft_ms": round(cached_ms, 3), "cached_over_recompute": round(cached_ms / recompute_ms, 4),
        "bytes_per_pull": pulled_bytes,
        "copy_gb_per_s": round(pulled_bytes / at_b["copy_ms"] / 1e6, 2) if at_b["copy_ms"] else None,
        # The copy kernel alone (CUDA events; none on CPU): what the copy moves at, without the
        # ids' upload, the launch and the wait for the engine's queued work.
        "kernel_gb_per_s": round(pulled_bytes / at_b["copy_device_ms"] / 1e6, 2) if at_b["copy_device_ms"] else None,
        "pull_gb_per_s": round(pulled_bytes / at_b["pull_ms"] / 1e6, 2) if at_b["pull_ms"] else None,
        "phase_ms": {phase: round(at_b[phase], 3) for phase in ("pin", "import", "import_work")}
        | {"copy": round(at_b["copy_ms"], 3)},
        "all_pulled": all(run["pulled_tokens"] == run["expected_pulled_tokens"] for run in runs),
        "all_same_first_token": all(run["same_first_token"] and run["same_cached_token"] for run in runs),
        "recompute_cached_nothing": all(run["recompute_cached_tokens"] == 0 for run in runs),
    }


def _pull_at_b(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """One pull as B's metrics saw it: bytes, the whole pull's ms, and each phase's ms
    (llmserve_kv_pull_phase_seconds; copy: the copies alone)."""
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    return {
        "bytes": delta.get("llmserve_kv_pull_bytes_total", 0.0),
        "pull_ms": delta.get("llmserve_kv_pull_duration_seconds_sum", 0.0) * 1000,
        "copy_ms": delta.get("llmserve_kv_pull_copy_seconds_sum", 0.0) * 1000,
        "copy_device_ms": delta.get("llmserve_kv_pull_copy_device_seconds_sum", 0.0) * 1000,
    } | {phase: delta.get(f"llmserve_kv_pull_phase_seconds_sum/{phase}", 0.0) * 1000
         for phase in ("pin", "import", "import_work")}


def _phases_cell(phase_ms: dict) -> str:
    return f"{phase_ms['pin']} / {phase_ms['import']} ({phase_ms['import_work']}, {phase_ms['copy']})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = args.out_dir / f"kv-pull-{stamp}-logs"
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-kv-pull-") as tmp:
        model_dir = bench_stack.build_model(args, Path(tmp) / "model")
        namespace = HashNamespace.of_model_dir(model_dir, BLOCK_SIZE) if args.block_hashes else None
        replicas = [Replica(name, args, model_dir, log_dir) for name in ("a", "b")]
        busy = None
        try:
            for replica in replicas:  # started together, then waited for (both load at once)
                replica.service.wait_until_serving(args.startup_timeout_s)
                replica.connect()
            if args.busy_source_prompt_tokens:
                num_ids = 400 if args.shape == "tiny" else 10_000
                busy = Busy(replicas[0], args.busy_source_prompt_tokens, args.busy_source_output_tokens, num_ids)
            for prefix_tokens in (int(length) for length in args.prefix_tokens.split(",")):
                rows.append(run_length(*replicas, prefix_tokens, args, namespace))
                print(f"{prefix_tokens} tokens: pull {rows[-1]['pull_ttft_ms']:.2f} ms, "
                      f"recompute {rows[-1]['recompute_ttft_ms']:.2f} ms", flush=True)
        finally:
            if busy is not None:
                busy.stop()
            for replica in replicas:
                replica.stop()
    print(f"| prefix tokens | MB pulled | TTFT pull ms | TTFT recompute ms | TTFT cached on B ms | pull / recompute "
          f"| cached / recompute | copy GB/s | kernel GB/s | pull GB/s (with round trips) "
          f"| ms per pull: pin / import (work, copy) | checks |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        checks = row["all_pulled"] and row["all_same_first_token"] and row["recompute_cached_nothing"]
        print(f"| {row['prefix_tokens']} | {row['bytes_per_pull'] / 1e6:.1f} | {row['pull_ttft_ms']:.2f} | "
              f"{row['recompute_ttft_ms']:.2f} | {row['cached_ttft_ms']:.2f} | {row['pull_over_recompute']} | "
              f"{row['cached_over_recompute']} | {row['copy_gb_per_s']} | {row['kernel_gb_per_s'] or '-'} | "
              f"{row['pull_gb_per_s']} | {_phases_cell(row['phase_ms'])} | {'ok' if checks else 'FAILED'} |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"kv-pull-{stamp}.json"
    out.write_text(json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    print(f"wrote {out}")
    ok = all(row["all_pulled"] and row["all_same_first_token"] and row["recompute_cached_nothing"] for row in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
