"""The data plane against the engine: one workload through four paths, on one device and model.

    python bench/bench_stack.py                        # H200: Qwen2.5-1.5B shape, 1/64/256 streams
    python bench/bench_stack.py --streams 256 --paths core,gateway --gateway-arg "--workers 4"
    python bench/bench_stack.py --smoke                # CPU, tiny model: that every path runs

Paths (each on a fresh engine: the same weights, the same engine flags):
  core     engine core loop: the EngineCore (create_engine_core) stepped by a plain
           `while core.has_unfinished_requests(): core.step()` loop in this process; the
           baseline of every ratio;
  async    AsyncEngine in process: create_engine(config), what the inference service wraps
           (engine thread + event loop), one asyncio task per stream;
  grpc     inference over gRPC: `python -m llmserve.inference` (token ids in), driven by
           llmserve.loadgen's workers calling GenerateTokens;
  gateway  full stack: preprocess + inference + gateway processes, driven by llmserve.loadgen
           (`llmserve bench`'s load generator) with text prompts of exactly --prompt-tokens
           tokens (the server's prompt count is in the JSON as prompt_tokens_per_request).

Workload: fixed --prompt-tokens, fixed --output-tokens with ignore_eos, greedy; at each of
--streams, that many requests in flight (a new one starts as one finishes) until
max(--min-requests, --requests-per-stream x streams) have finished; every cell gets its own
prompts (seeded by --seed and the stream count: no prefix-cache hits across cells; the same
prompts on every path). Before its cells, each path runs a warm-up of max(--streams) requests
with --warmup-output-tokens tokens (first-use compilation; CUDA graphs are captured at
start-up). Time: the defaults run 2x the streams per cell, ~4-5 minutes in all on an H200
(start-up of each engine included); raise --requests-per-stream for steadier numbers.

Per (path, streams): output tok/s and its ratio to `core` at the same streams, TTFT p50/p99,
ITL p50 and its ratio to `core` (llmserve.loadgen.stats definitions, measured where the
client sees tokens), and the CPU% of each process over the measured window (bench process:
the client, and for core/async the engine too; gateway; preprocess; inference), with its
busiest threads; gateway output tok/s per gateway CPU core (tok/s / (gateway CPU% / 100)).

Model: random weights with a real config (--shape, default Qwen2.5-1.5B: 28 layers, hidden
1536, 12/2 heads, vocab 151936, tied), written once per run to a temp checkpoint with the
Qwen tokenizer from $LLMSERVE_SHARED_ASSETS/tokenizers/qwen3 (default ../shared/assets next
to the repo); --model uses a checkpoint instead. Rows of the lm_head (tied: the embedding)
past the tokenizer's vocabulary are zeroed, so greedy decoding never picks an id the gateway
cannot detokenize.

Flags for variants, each repeatable and shell-split (`--engine-arg "--max-batched-tokens 4096"`,
`--engine-arg=--enforce-eager`): --engine-arg goes to every path's engine (parsed by the
inference service's own engine flags); --inference-arg only to the inference service (grpc,
gateway); --gateway-arg only to the gateway.

Prints a progress line per path and cell, then one table (markdown) and the threads; writes
--out-dir/stack-<time>.json (rewritten after each path, so a run cut short keeps what it
measured), service logs to --out-dir/stack-<time>-logs/, and with --plot a PNG.
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

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
# Loadgen's workers are spawned: they re-import this script, so its top level stays light
# (torch and the engine are imported where a path needs them).

import proc_cpu  # noqa: E402
import stack_drivers  # noqa: E402
import stack_report  # noqa: E402
from llmserve.inference.engine.config import default_dtype  # noqa: E402
from llmserve.inference.engine_flags import add_engine_arguments, engine_argv, engine_config, engine_options  # noqa: E402
from llmserve.launcher import PREPROCESS_ENGINE_OPTIONS  # noqa: E402
from llmserve.loadgen.runner import RunConfig, run_workload  # noqa: E402
from llmserve.loadgen.stats import summarize  # noqa: E402
from llmserve.loadgen.workload import LengthDistribution, PromptBuilder, WorkloadConfig, plan_requests  # noqa: E402
from llmserve.model_files import ModelFiles  # noqa: E402
from tests.procs import start_service, stop_service  # noqa: E402

PATHS = {
    "core": "engine core loop",
    "async": "AsyncEngine in process",
    "grpc": "inference over gRPC",
    "gateway": "gateway (full stack)",
}
SHAPES = {
    "qwen2.5-1.5b": dict(  # Qwen/Qwen2.5-1.5B's config.json
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False, bos_token_id=151643,
        eos_token_id=151643,
    ),
}
SMOKE = dict(shape="tiny", device="cpu", streams="1,4", prompt_tokens=24, output_tokens=16, warmup_output_tokens=2,
             client_workers=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help=f"CPU smoke preset (flags given explicitly still win): {SMOKE}")
    model = parser.add_argument_group("model")
    model.add_argument("--shape", default="qwen2.5-1.5b", choices=(*SHAPES, "tiny"),
                       help="random-weight model shape; tiny = the tests' tiny Qwen2 and tokenizer (default: %(default)s)")
    model.add_argument("--model", type=Path, help="a checkpoint directory to serve instead of random weights")
    model.add_argument("--tokenizer", type=Path, help="tokenizer directory for --shape qwen2.5-1.5b "
                       "(default: $LLMSERVE_SHARED_ASSETS/tokenizers/qwen3)")
    model.add_argument("--device", default="cuda", help="every path's engine device (default: %(default)s)")
    load = parser.add_argument_group("workload")
    load.add_argument("--streams", default="1,64,256", help="comma-separated concurrent streams (default: %(default)s)")
    load.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {', '.join(PATHS)}")
    load.add_argument("--prompt-tokens", type=int, default=512, help="(default: %(default)s)")
    load.add_argument("--output-tokens", type=int, default=512, help="(default: %(default)s)")
    load.add_argument("--requests-per-stream", type=float, default=2.0,
                      help="requests per cell = this x streams, at least --min-requests (default: %(default)s)")
    load.add_argument("--min-requests", type=int, default=4, help="(default: %(default)s)")
    load.add_argument("--warmup-output-tokens", type=int, default=16, help="(default: %(default)s)")
    load.add_argument("--client-workers", type=int, default=4,
                      help="loadgen worker processes for the grpc and gateway paths (default: %(default)s)")
    load.add_argument("--seed", type=int, default=0)
    variants = parser.add_argument_group("variants (repeatable, shell-split)")
    variants.add_argument("--engine-arg", action="append", default=[], help="engine flag(s) for every path")
    variants.add_argument("--inference-arg", action="append", default=[], help="flag(s) for the inference service")
    variants.add_argument("--gateway-arg", action="append", default=[], help="flag(s) for the gateway")
    out = parser.add_argument_group("output")
    out.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    out.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    out.add_argument("--startup-timeout-s", type=float, default=300.0, help="per service (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    args.paths = args.paths.split(",")
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown path(s) {unknown}; choose from {', '.join(PATHS)}")
    return args


def split_flags(values: list[str]) -> list[str]:
    return [flag for value in values for flag in shlex.split(value)]


def shared_assets() -> Path:
    default = REPO_ROOT.parent / "shared" / "assets"
    return Path(os.environ.get("LLMSERVE_SHARED_ASSETS", default))


def build_model(args, out_dir: Path) -> Path:
    """A checkpoint of --shape with random weights (see the module docstring)."""
    if args.shape == "tiny":
        from tests.factories import build_tiny_model

        return build_tiny_model(out_dir, "qwen2")
    import shutil

    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer_dir = args.tokenizer or shared_assets() / "tokenizers" / "qwen3"
    out_dir.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    config = Qwen2Config(**SHAPES[args.shape])
    config.architectures = ["Qwen2ForCausalLM"]
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    num_known = Tokenizer.from_file(str(out_dir / "tokenizer.json")).get_vocab_size()
    with torch.no_grad():
        model.get_output_embeddings().weight[num_known:] = 0
    model.save_pretrained(out_dir)
    del model
    free_device_memory()
    return out_dir


def free_device_memory() -> None:
    """After dropping an engine: the next one sizes its KV pool from the free device memory."""
    gc.collect()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.empty_cache()


class Plans:
    """The workload of every cell (and the warm-up), planned once and sent on every path."""

    def __init__(self, args, builder: PromptBuilder):
        def workload(num_requests: int, output_tokens: int, seed: int) -> WorkloadConfig:
            return WorkloadConfig(num_requests=num_requests, prompt_tokens=LengthDistribution("fixed", args.prompt_tokens),
                                  output_tokens=LengthDistribution("fixed", output_tokens), seed=seed)

        num_warmup = max(args.streams)
        self.warmup = workload(num_warmup, args.warmup_output_tokens, args.seed + 1_000_003)
        self.cells = {s: workload(max(args.min_requests, round(args.requests_per_stream * s)), args.output_tokens,
                                  args.seed + s) for s in args.streams}
        self.requests = {id(w): plan_requests(w, builder) for w in (self.warmup, *self.cells.values())}

    def planned(self, workload: WorkloadConfig):
        return self.requests[id(workload)]


class InProcessWindow:
    """The measured window of a cell driven on this process's own threads: CPU snapshots of this
    process at its start (construction) and end (`measurement`), its threads by Python name."""

    def __init__(self):
        self._names = {t.native_id: t.name for t in threading.enumerate()}
        self._roles = {"bench": [os.getpid()]}
        self._before = proc_cpu.snapshot(self._roles, names=self._names)
        self._start_s = time.monotonic()

    def measurement(self, records) -> dict:
        end_s = max(r.end_s for r in records)
        after = proc_cpu.snapshot(self._roles, names=self._names)
        usage = proc_cpu.cpu_usage(self._before, after, end_s - self._start_s)
        return stack_report.measurement(summarize(records, self._start_s, end_s), usage)


def run_core(args, options, model_dir: Path, plans: Plans, on_cell) -> None:
    from llmserve.inference.backends import create_engine_core

    core = create_engine_core(engine_config(options, model_dir, ModelFiles.load(model_dir).model_name))
    on_cell("startup", None)
    stack_drivers.drive_core(core, plans.planned(plans.warmup), max(args.streams), "warmup")
    for streams in args.streams:
        window = InProcessWindow()
        records = stack_drivers.drive_core(core, plans.planned(plans.cells[streams]), streams, f"cell{streams}")
        on_cell(streams, window.measurement(records))
    del core
    free_device_memory()


def run_async(args, options, model_dir: Path, plans: Plans, on_cell) -> None:
    from llmserve.inference.backends import create_engine

    async def main() -> None:
        engine = create_engine(engine_config(options, model_dir, ModelFiles.load(model_dir).model_name))
        await engine.start()
        on_cell("startup", None)
        try:
            await stack_drivers.drive_async_engine(engine, plans.planned(plans.warmup), max(args.streams), "warmup")
            for streams in args.streams:
                window = InProcessWindow()
                records = await stack_drivers.drive_async_engine(
                    engine, plans.planned(plans.cells[streams]), streams, f"cell{streams}")
                on_cell(streams, window.measurement(records))
        finally:
            await engine.shutdown(drain_timeout_s=0.0)

    asyncio.run(main())
    free_device_memory()


def start_services(path: str, args, options, model_dir: Path, log_dir: Path) -> dict:
    """The services of a path, started in order; role → ServiceProcess."""
    model = ["--model", str(model_dir)]
    started: dict = {}
    try:
        if path == "gateway":
            started["preprocess"] = start_service("preprocess", [*model, *engine_argv(options, PREPROCESS_ENGINE_OPTIONS)],
                                                  log_dir, timeout_s=args.startup_timeout_s)
        started["inference"] = start_service(
            "inference", [*model, *engine_argv(options), *split_flags(args.inference_arg)], log_dir,
            timeout_s=args.startup_timeout_s)
        if path == "gateway":
            started["gateway"] = start_service(
                "gateway", [*model, "--preprocess", started["preprocess"].address, "--inference",
                            started["inference"].address, *split_flags(args.gateway_arg)],
                log_dir, timeout_s=args.startup_timeout_s)
    except BaseException:
        stop_services(started)
        raise
    return started


def stop_services(services: dict) -> None:
    for service in reversed(list(services.values())):  # the gateway first, as the launcher does
        stop_service(service)


def run_services(path: str, args, options, model_dir: Path, plans: Plans, on_cell, log_dir: Path) -> None:
    services = start_services(path, args, options, model_dir, log_dir)
    on_cell("startup", None)
    service_pids = {role: [service.process.pid] for role, service in services.items()}
    server_pids = {pid for pids in service_pids.values() for pid in pids}

    def role_pids() -> dict[str, list[int]]:
        clients = [pid for pid in proc_cpu.child_pids(os.getpid()) if pid not in server_pids]
        return {"bench": [os.getpid(), *clients], **service_pids}

    front = services["gateway" if path == "gateway" else "inference"]
    send = stack_drivers.send_to_inference if path == "grpc" else None

    def run(workload: WorkloadConfig, streams: int):
        config = RunConfig(address=front.address, concurrency=streams, num_workers=args.client_workers,
                           show_progress=False, send=send)
        return run_workload(plans.planned(workload), workload, config)

    try:
        run(plans.warmup, max(args.streams))
        with proc_cpu.CpuSampler(role_pids) as sampler:
            for streams in args.streams:
                result = run(plans.cells[streams], streams)
                summary = summarize(result.records, result.start_s, result.end_s)
                time.sleep(0.15)  # one more sample after the window (CpuSampler.usage brackets it)
                on_cell(streams, stack_report.measurement(summary, sampler.usage(result.start_s, result.end_s)))
    finally:
        stop_services(services)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parser = argparse.ArgumentParser(prog="--engine-arg")
    add_engine_arguments(parser)
    base = ["--device", args.device, "--max-num-seqs", str(max(256, *args.streams))]
    options = engine_options(parser.parse_args(base + split_flags(args.engine_arg)))
    options["dtype"] = options["dtype"] or default_dtype(options["device"])  # explicit in the JSON
    stem = time.strftime("stack-%Y%m%d-%H%M%S")
    report = stack_report.Report(args.out_dir / f"{stem}.json", settings=vars(args), engine_options=options)
    with tempfile.TemporaryDirectory(prefix="bench-stack-") as tmp:
        model_dir = args.model or build_model(args, Path(tmp) / f"random-{args.shape}")
        plans = Plans(args, PromptBuilder.from_path(model_dir))
        for number, path in enumerate(args.paths, 1):
            print(f"[{number}/{len(args.paths)}] {PATHS[path]}: starting", flush=True)
            on_cell = report.cell_recorder(path, PATHS[path])
            try:
                if path == "core":
                    run_core(args, options, model_dir, plans, on_cell)
                elif path == "async":
                    run_async(args, options, model_dir, plans, on_cell)
                else:
                    run_services(path, args, options, model_dir, plans, on_cell, args.out_dir / f"{stem}-logs" / path)
            except Exception as error:  # one failed path must not lose the others' numbers
                report.failed(path, error)
                free_device_memory()
    report.finish(args.plot)
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
