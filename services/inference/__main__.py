"""`python -m llmserve.inference`: serve one engine replica over gRPC.

Start-up: load the engine (weights, KV pool) → bind → start the engine thread → health SERVING
→ write --port-file. SIGTERM/SIGINT: health NOT_SERVING → stop accepting → running streams
finish for up to --grace-period-s (then they are aborted) → exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from pathlib import Path

from llmserve.block_hash import DEFAULT_BLOCK_SIZE
from llmserve.inference.backends import BackendUnavailable, ServingEngine, create_engine
from llmserve.inference.config import DEFAULT_GRACE_PERIOD_S, InferenceConfig
from llmserve.inference.engine.config import BACKENDS, EngineConfig
from llmserve.inference.kernel_args import add_kernel_arguments
from llmserve.inference.servicer import SERVICE_NAME, InferenceServicer
from llmserve.model_files import ModelFiles
from llmserve.server import (
    add_server_arguments,
    configure_logging,
    create_server,
    exit_with_parent,
    serve_until_signal,
    write_port_file,
)
from llmserve.v1 import inference_pb2_grpc

log = logging.getLogger("llmserve.inference")

DTYPES = ("float32", "bfloat16", "float16")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" where a flag has a real default and its help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return help_text
        if "default" in help_text:
            return help_text
        return f"{help_text} (default: %(default)s)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = EngineConfig(model_path=Path("."), model_name="")
    p = argparse.ArgumentParser(
        prog="python -m llmserve.inference",
        description="Inference service: token ids in, token ids out (llmserve.v1.InferenceService).",
        formatter_class=_DefaultsFormatter,
    )
    server = add_server_arguments(p, default_grace_period_s=DEFAULT_GRACE_PERIOD_S)
    server.add_argument("--replica-id", help="stable routing key of this replica (default: <hostname>-<bound port>)")

    model = p.add_argument_group("model")
    model.add_argument("--model", required=True, help="local HF checkpoint directory (config.json, *.safetensors)")
    model.add_argument("--model-name", help="served model name (default: the name the checkpoint gives itself)")
    model.add_argument(
        "--backend", choices=BACKENDS, default="torch",
        help="engine: torch (ours: paged KV, continuous batching), hf (transformers baseline) or trtllm",
    )
    model.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    model.add_argument(
        "--dtype", choices=DTYPES, help="weights and activations (default: float32 on cpu, bfloat16 on cuda)"
    )
    model.add_argument(
        "--max-context-tokens", "--max-model-len", type=int,
        help="largest prompt + output in tokens (default: the model's context; --max-model-len is vLLM's name)",
    )
    model.add_argument("--seed", type=int, default=defaults.seed, help="engine seed for requests that bring none")

    engine = p.add_argument_group("engine (torch backend; hf ignores what it has no use for)")
    engine.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    engine.add_argument(
        "--num-kv-blocks", type=int,
        help="KV pool size in blocks (default: --kv-memory-fraction on CUDA, a byte budget on CPU)",
    )
    engine.add_argument(
        "--kv-memory-fraction", type=float, default=defaults.kv_memory_fraction,
        help="CUDA: share of the GPU memory free after loading the weights that the KV pool takes",
    )
    engine.add_argument(
        "--max-num-seqs", type=int, default=defaults.max_num_seqs, help="most sequences running at once"
    )
    engine.add_argument(
        "--max-batched-tokens", type=int, default=defaults.max_batched_tokens,
        help="per-step token budget: prefill chunks plus decodes",
    )
    engine.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prefixes")
    engine.add_argument("--enforce-eager", action="store_true", help="CUDA: skip CUDA-graph capture")
    engine.add_argument(
        "--no-async-scheduling", action="store_true",
        help="run one step at a time: by default the CPU work of the next step (scheduling, input "
        "staging, streaming this step's tokens) overlaps the device's compute of this one; off is "
        "slower on CUDA but simpler to debug",
    )
    add_kernel_arguments(p)
    return p.parse_args(argv)


def default_dtype(device: str) -> str:
    return "bfloat16" if device.startswith("cuda") else "float32"


def config_from_args(args: argparse.Namespace) -> InferenceConfig:
    model_path = Path(args.model).expanduser().resolve()
    engine = EngineConfig(
        model_path=model_path,
        model_name=args.model_name or ModelFiles.load(model_path).model_name,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype or default_dtype(args.device),
        block_size_tokens=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_memory_fraction=args.kv_memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        max_context_tokens=args.max_context_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        async_scheduling=not args.no_async_scheduling,
        seed=args.seed,
    )
    return InferenceConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        grace_period_s=args.grace_period_s,
        replica_id=args.replica_id,
        log_level=args.log_level,
    )


async def serve(config: InferenceConfig) -> None:
    try:
        engine = create_engine(config.engine)  # loads the weights and sizes the KV pool
    except ValueError as exc:  # a model or a flag combination this engine cannot run: say why
        log.error("cannot start the engine: %s", exc)
        raise SystemExit(1) from None
    await engine.start()
    servicer = InferenceServicer(engine, replica_id=config.replica_id or "")
    running = await create_server(
        config.address,
        lambda server: inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
    )
    if not servicer.replica_id:
        servicer.replica_id = f"{socket.gethostname()}-{running.port}"
    _log_startup(engine, servicer.replica_id, running.port)
    await running.set_serving(True)
    write_port_file(config.port_file, running.port)
    await serve_until_signal(
        running,
        grace_s=config.grace_period_s,
        on_drain=lambda: engine.shutdown(drain_timeout_s=config.grace_period_s),
    )


def _log_startup(engine: ServingEngine, replica_id: str, port: int) -> None:
    info = engine.model_info
    load = engine.load()
    log.info(
        "serving %s (%s) on port %d: backend=%s device=%s dtype=%s max_context=%d vocab=%d "
        "kv_blocks=%d x %d tokens replica_id=%s",
        info.model_name, info.architecture, port, info.backend, info.device, info.dtype,
        info.max_context_tokens, info.vocab_size, load.kv_blocks_total, info.block_size_tokens, replica_id,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging("inference", args.log_level)
    exit_with_parent()
    try:
        asyncio.run(serve(config_from_args(args)))
    except (BackendUnavailable, FileNotFoundError) as exc:  # a wrong flag: say why, no traceback
        log.error("%s", exc)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
