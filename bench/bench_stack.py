"""The data plane against the engine: one workload through four paths, on one device and model.

    python bench/bench_stack.py                        # H200: Qwen2.5-1.5B shape, 1/64/256 streams
    python bench/bench_stack.py --streams 256 --paths core,gateway --engine-arg "--max-batched-tokens 4096"
    python bench/bench_stack.py --smoke                # CPU, tiny model: that every path runs

Paths (each on a fresh engine: the same weights, the same engine flags):
  core     engine core loop: the EngineCore (create_engine_core) stepped by a plain
           `while core.has_requests_in_flight(): core.step()` loop in this process; the
           baseline of every ratio;
  async    AsyncEngine in process: create_engine(config), what the inference service wraps
           (engine thread + event loop), one asyncio task per stream;
  grpc     inference over gRPC: `python -m llmserve.inference` (token ids in), driven by
           llmserve.tools.loadgen's workers calling GenerateTokens;
  http     the same stack driven through the gateway's OpenAI HTTP API (`llmserve bench
           --http`'s driver: /v1/completions, SSE, usage), the same prompts (text or token ids);
           opt-in (not in the default --paths);
  gateway  full stack: preprocess + inference + gateway processes, driven by llmserve.tools.loadgen
           (`llmserve bench`'s load generator) with the same prompts, sent as token ids or, with
           --prompt-form text, as text that tokenizes to them (preprocess's whole work; the
           server's prompt count is in the JSON as prompt_tokens_per_request).

Workload: fixed --prompt-tokens, fixed --output-tokens with ignore_eos, greedy; at each of
--streams, that many requests in flight (a new one starts as one finishes) until
max(--min-requests, --requests-per-stream x streams) have finished; every cell gets its own
prompts (seeded by --seed and the stream count: no prefix-cache hits across cells; the same
prompts on every path). Before its cells, each path runs a warm-up of max(--streams) requests
with --warmup-output-tokens tokens (first-use compilation; CUDA graphs are captured at
start-up). Time: the defaults run 2x the streams per cell (4 requests at 1 stream), estimated
at ~5 minutes in all on an H200 (model build and four engine start-ups included: under 8); raise
--requests-per-stream for steadier numbers. On a CPU, compare paths with OMP_NUM_THREADS=1: the
core loop runs torch's CPU kernels on the main thread, whose OpenMP team crawls on a small shared
machine.

--repeat K runs every cell K times on the same engine or stack (new prompts each time, the
stream counts in turn), compares each path's repeat k with the core loop's repeat k, and adds a
table of min/median/max over the repeats (a GPU result counts when it holds in 3 runs).

Per (path, streams): output tok/s and its ratio to `core` at the same streams, TTFT p50/p99,
ITL p50 and its ratio to `core` (llmserve.tools.loadgen.stats definitions, measured where the
client sees tokens), tokens per message (above 1: the stack merged steps, because a reader or
a hop fell behind), and the CPU% of each process over the measured window (bench process:
the client, and for core/async the engine too; gateway; preprocess; inference), with its
busiest threads; gateway output tok/s per gateway CPU core (tok/s / (gateway CPU% / 100)); on
the stack paths, the first token's mean ms per hop from the gateway's histograms (the preprocess
hop, the replica's queue, the gateway's own TTFT) beside the client's (bench/stack_hops.py);
on every path but async, the engine's steps in the cell: how many, their mean ms, the mean
sequences in one and the share of the cell spent in steps (bench/engine_steps.py).

Model: random weights with a real config (--shape, default Qwen2.5-1.5B: 28 layers, hidden 1536,
12/2 heads, vocab 151936, tied; or llama-3.1-8b), written once per run to a temp checkpoint with the
Qwen tokenizer from $LLMSERVE_SHARED_ASSETS/tokenizers/qwen3 (default: shared/assets in the
nearest folder above the repo, e.g. ../shared/assets); --model serves a checkpoint instead.
Rows of the lm_head (tied: the embedding) past the tokenizer's vocabulary are zeroed, so greedy
decoding never picks an id the gateway cannot detokenize.

Flags for variants, each repeatable and shell-split (`--engine-arg "--max-batched-tokens 4096"`,
`--engine-arg=--enforce-eager`): --engine-arg goes to every path's engine (parsed by the
inference service's own engine flags); --inference-arg only to the inference service (grpc,
gateway); --gateway-arg only to the gateway.

Prints a progress line per path and cell, then one table (markdown) and the threads; writes
--out-dir/stack-<time>.json (rewritten after each path, so a run cut short keeps what it
measured), service logs to --out-dir/stack-<time>-logs/, and with --plot a PNG. A path that
fails is reported and the others still run; the exit code is 1 if a path failed or a request
did not succeed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

# Loadgen's workers are spawned: they re-import this script, so its top level stays light
# (torch and the engine are imported where a path needs them).
import engine_steps
import proc_cpu
import stack_drivers
import stack_report
import stack_services
from llmserve.inference.engine.config import default_dtype
from llmserve.inference.engine_flags import add_engine_arguments, engine_config, engine_options
from llmserve.tools.loadgen.stats import summarize
from llmserve.tools.loadgen.workload import PromptBuilder
from llmserve.model_files import ModelFiles

REPO_ROOT = Path(__file__).resolve().parent.parent
PATHS = {
    "core": "engine core loop",
    "async": "AsyncEngine in process",
    "grpc": "inference over gRPC",
    "gateway": "gateway (full stack)",
    "http": "gateway over OpenAI HTTP",
}
DEFAULT_PATHS = ("core", "async", "grpc", "gateway")
SHAPES = {
    "qwen2.5-1.5b": dict(  # Qwen/Qwen2.5-1.5B's config.json
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False, bos_token_id=151643,
        eos_token_id=151643,
    ),
    # Llama-3.1-8B's body (meta-llama/Llama-3.1-8B config.json) with the Qwen tokenizer's
    # vocabulary, the only tokenizer here: its lm_head is 1.2% of the weight bytes larger.
    "llama-3.1-8b": dict(
        architecture="LlamaForCausalLM", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=151936, tie_word_embeddings=False,
        rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=151643,
        eos_token_id=151643,
    ),
    # Llama-3.1-70B's body (meta-llama/Llama-3.1-70B config.json), Qwen tokenizer vocabulary as
    # above: ~141 GB in bf16, built on --device, so a tensor-parallel run of it (bench_tensor_parallel)
    # needs a checkpoint made elsewhere (--model) or a host that builds it on the CPU.
    "llama-3.1-70b": dict(
        architecture="LlamaForCausalLM", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=151936, tie_word_embeddings=False,
        rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=151643,
        eos_token_id=151643,
    ),
    # The default model's body (HuggingFaceTB/SmolLM2-135M-Instruct's config.json), for runs where
    # its 538 MB of weights cannot travel; pass its tokenizer (shared/assets/tokenizers/smollm2).
    "smollm2-135m": dict(
        architecture="LlamaForCausalLM", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
        rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    ),
}
SMOKE = dict(shape="tiny", device="cpu", streams="1,4", prompt_tokens=24, output_tokens=16, warmup_output_tokens=2,
             client_processes=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help=f"CPU smoke preset (flags given explicitly still win): {SMOKE}")
    model = parser.add_argument_group("model")
    model.add_argument("--shape", default="qwen2.5-1.5b", choices=(*SHAPES, "tiny"),
                       help="random-weight model shape; tiny = the tests' tiny Qwen2 and tokenizer "
                       "(default: %(default)s)")
    model.add_argument("--model", type=Path, metavar="DIR", help="a checkpoint to serve instead of random weights")
    model.add_argument("--tokenizer", type=Path, metavar="DIR", help="tokenizer directory for --shape qwen2.5-1.5b "
                       "(default: $LLMSERVE_SHARED_ASSETS/tokenizers/qwen3)")
    model.add_argument("--device", default="cuda", help="every path's engine device (default: %(default)s)")
    load = parser.add_argument_group("workload")
    load.add_argument("--streams", default="1,64,256", metavar="N,N,...",
                      help="concurrent streams of each cell (default: %(default)s)")
    load.add_argument("--paths", default=",".join(DEFAULT_PATHS), metavar="PATH,...",
                      help=f"which paths, in order, of {', '.join(PATHS)} (default: {','.join(DEFAULT_PATHS)})")
    load.add_argument("--prompt-tokens", type=int, default=512, metavar="N", help="(default: %(default)s)")
    load.add_argument("--output-tokens", type=int, default=512, metavar="N", help="(default: %(default)s)")
    load.add_argument("--requests-per-stream", type=float, default=2.0, metavar="K",
                      help="requests per cell = this x streams, at least --min-requests (default: %(default)s)")
    load.add_argument("--min-requests", type=int, default=4, metavar="N", help="(default: %(default)s)")
    load.add_argument("--repeat", type=int, default=1, metavar="K",
                      help="run every cell K times on the same engine (new prompts each time), the stream counts "
                      "in turn; with K >= 2 the report adds min/median/max per (path, streams) (default: %(default)s)")
    load.add_argument("--prompt-form", choices=("token_ids", "text"), default="token_ids",
                      help="how the gateway path sends prompts: token ids, or text that tokenizes to the same "
                      "ids (preprocess tokenizes it: the served path's full work) (default: %(default)s)")
    load.add_argument("--warmup-output-tokens", type=int, default=16, metavar="N", help="(default: %(default)s)")
    load.add_argument("--client-processes", type=int, default=4, metavar="N",
                      help="loadgen worker processes for the grpc and gateway paths (default: %(default)s)")
    load.add_argument("--connections-per-client", type=int, default=1, metavar="N",
                      help="connections each client process spreads its streams over: the gateway's workers are "
                      "balanced by connection (default: %(default)s)")
    load.add_argument("--balance-calls", action="store_true",
                      help="gateway path: start the gateway with --worker-ports and send to every worker's own "
                      "port with grpc's round_robin, so calls, not connections, are spread over its workers")
    load.add_argument("--seed", type=int, default=0)
    variants = parser.add_argument_group("variants (repeatable, shell-split)")
    for name, help in (("--engine-arg", "engine flag(s) for every path"),
                       ("--inference-arg", "flag(s) for the inference service"),
                       ("--gateway-arg", "flag(s) for the gateway")):
        variants.add_argument(name, action="append", default=[], metavar="FLAGS", help=help)
    out = parser.add_argument_group("output")
    out.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results", metavar="DIR")
    out.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    out.add_argument("--startup-timeout-s", type=float, default=300.0, metavar="S",
                     help="per service (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    args.paths = args.paths.split(",")
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown path(s) {unknown}; choose from {', '.join(PATHS)}")
    for name in ("engine_arg", "inference_arg", "gateway_arg"):
        setattr(args, name, [flag for value in getattr(args, name) for flag in shlex.split(value)])
    return args


def qwen_tokenizer_dir() -> Path:
    """$LLMSERVE_SHARED_ASSETS/tokenizers/qwen3, else shared/assets/ in the nearest folder above
    the repo that has one (../shared beside a checkout, ../../shared beside a worktree)."""
    if "LLMSERVE_SHARED_ASSETS" in os.environ:
        candidates = [Path(os.environ["LLMSERVE_SHARED_ASSETS"])]
    else:
        candidates = [folder / "shared" / "assets" for folder in (REPO_ROOT, *REPO_ROOT.parents)]
    for assets in candidates:
        if (assets / "tokenizers" / "qwen3" / "tokenizer.json").is_file():
            return assets / "tokenizers" / "qwen3"
    raise SystemExit(f"no Qwen tokenizer in {candidates[0]}/tokenizers/qwen3: "
                     "set LLMSERVE_SHARED_ASSETS or pass --tokenizer")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags build_model reads, for a bench that builds its model as this one does."""
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=(*SHAPES, "tiny"))
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir (default: the Qwen one)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)


def add_served_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What a bench that starts the stack serves: a checkpoint, the default model, or random
    weights of a shape (served_model)."""
    parser.add_argument("--model", type=Path, help="HF checkpoint directory (default: the default model, SmolLM2-135M)")
    parser.add_argument("--shape", choices=SHAPES, help="serve random weights of this shape instead (built once per run)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory for --shape (default: the Qwen one)")
    parser.add_argument("--device", default="cpu", help="the inference engine's device (default: %(default)s)")


def served_model(args, work_dir: Path) -> Path:
    """The checkpoint add_served_model_arguments' flags name: random weights of --shape built
    under `work_dir` (seed 0), --model, or the default model."""
    if args.shape:
        args.seed = 0
        return build_model(args, work_dir / f"random-{args.shape}")
    if args.model is not None:
        return args.model
    from llmserve.tools.model_store import resolve_model

    return resolve_model(None)


def build_model(args, out_dir: Path) -> Path:
    """A checkpoint of --shape with random weights (see the module docstring), from args.shape,
    args.tokenizer, args.device and args.seed."""
    if args.shape == "tiny":
        from llmserve.tools.tiny_model import build_tiny_model

        return build_tiny_model(out_dir, "qwen2")
    import shutil

    import torch
    from tokenizers import Tokenizer
    import transformers

    tokenizer_dir = args.tokenizer or qwen_tokenizer_dir()
    out_dir.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    shape = dict(SHAPES[args.shape])
    architecture = shape.pop("architecture", "Qwen2ForCausalLM")
    model_class = getattr(transformers, architecture)
    config = model_class.config_class(**shape)
    config.architectures = [architecture]
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    num_known = Tokenizer.from_file(str(out_dir / "tokenizer.json")).get_vocab_size()
    with torch.no_grad():
        model.get_output_embeddings().weight[num_known:] = 0
    model.to("cpu").save_pretrained(out_dir)
    del model
    free_device_memory()
    return out_dir


def free_device_memory() -> None:
    """After dropping an engine: the next one sizes its KV pool from the free device memory."""
    gc.collect()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.empty_cache()


def device_memory_note() -> str:
    """Free device memory before a path: each engine sizes its KV pool from it, so a path that
    finds less than the one before it would show here."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return ""
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    return f" (device memory free: {free_bytes / 2**30:.1f} of {total_bytes / 2**30:.1f} GiB)"


class InProcessWindow:
    """The measured window of a cell driven on this process's own threads: CPU snapshots of this
    process at its start (construction) and end (`measurement`), its threads by Python name."""

    def __init__(self):
        self._names = {t.native_id: t.name for t in threading.enumerate()}
        # this process, and the engine-core process AsyncEngine runs (absent with --no-core-process)
        self._roles = {"bench": [os.getpid()], "engine-core": proc_cpu.child_pids(os.getpid())}
        self._before = proc_cpu.snapshot(self._roles, names=self._names)
        self._start_s = time.monotonic()

    def measurement(self, records, steps: engine_steps.StepTally | None = None) -> dict:
        """The cell's row; with `steps`, the engine's steps in it too (engine_steps.py)."""
        end_s = max(r.end_s for r in records)
        after = proc_cpu.snapshot(self._roles, names=self._names)
        usage = proc_cpu.cpu_usage(self._before, after, end_s - self._start_s)
        measured = stack_report.measurement(summarize(records, self._start_s, end_s), usage)
        if steps is not None:
            measured["engine_steps"] = steps.summary(end_s - self._start_s)
        return measured


def run_core(args, options, model_dir: Path, plans: stack_drivers.Plans, on_cell) -> None:
    from llmserve.inference.engine.cores import create_engine_core

    core = create_engine_core(engine_config(options, model_dir, ModelFiles.load(model_dir).model_name))
    on_cell("startup", None)
    stack_drivers.drive_core(core, plans.warmup.requests, max(args.streams), "warmup")
    for repeat, cell in plans.in_order():
        window, steps = InProcessWindow(), engine_steps.StepTally()
        records = stack_drivers.drive_core(core, cell.requests, cell.streams, f"cell{cell.streams}", steps.add)
        on_cell(cell.streams, window.measurement(records, steps), repeat)


def run_async(args, options, model_dir: Path, plans: stack_drivers.Plans, on_cell) -> None:
    from llmserve.inference.backends import create_engine

    async def main() -> None:
        engine = create_engine(engine_config(options, model_dir, ModelFiles.load(model_dir).model_name))
        await engine.start()
        on_cell("startup", None)
        try:
            await stack_drivers.drive_async_engine(engine, plans.warmup.requests, max(args.streams), "warmup")
            for repeat, cell in plans.in_order():
                window = InProcessWindow()
                records = await stack_drivers.drive_async_engine(engine, cell.requests, cell.streams, f"cell{cell.streams}")
                on_cell(cell.streams, window.measurement(records), repeat)
        finally:
            await engine.shutdown(drain_timeout_s=0.0)

    asyncio.run(main())


def bench_engine_options(args) -> dict:
    """The engine options of every path: --device, room for the most streams, then --engine-arg."""
    parser = argparse.ArgumentParser(prog="--engine-arg")
    add_engine_arguments(parser)
    base = ["--device", args.device, "--max-num-seqs", str(max(256, *args.streams))]
    options = engine_options(parser.parse_args(base + args.engine_arg))
    options["dtype"] = options["dtype"] or default_dtype(options["device"])  # explicit in the JSON
    return options


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = bench_engine_options(args)
    stem = time.strftime("stack-%Y%m%d-%H%M%S")
    report = stack_report.Report(args.out_dir / f"{stem}.json", settings=vars(args), engine_options=options)
    with tempfile.TemporaryDirectory(prefix="bench-stack-") as tmp:
        model_dir = args.model or build_model(args, Path(tmp) / f"random-{args.shape}")
        plans = stack_drivers.Plans(args, PromptBuilder.from_path(model_dir))
        for number, path in enumerate(args.paths, 1):
            print(f"[{number}/{len(args.paths)}] {PATHS[path]}: starting{device_memory_note()}", flush=True)
            on_cell = report.cell_recorder(path, PATHS[path])
            try:
                if path == "core":
                    run_core(args, options, model_dir, plans, on_cell)
                elif path == "async":
                    run_async(args, options, model_dir, plans, on_cell)
                else:
                    log_dir = args.out_dir / f"{stem}-logs" / path
                    stack_services.run_services(path, args, options, model_dir, plans, on_cell, log_dir)
            except Exception as error:  # one failed path must not lose the others' numbers
                report.failed(path, error)
            free_device_memory()  # outside `except`: its traceback would keep a failed engine alive
    report.finish(args.plot)
    incomplete = [row for row in report.rows if row["num_succeeded"] < row["num_requests"]]
    return 1 if report.errors or incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
