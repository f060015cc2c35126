"""`python -m llmserve.inference`: serve one engine replica over gRPC.

Start-up: load the engine (weights, KV pool) → bind → start the engine thread → health SERVING
→ write --port-file. SIGTERM/SIGINT: health NOT_SERVING → stop accepting → WatchKvEvents
streams end at once (subscribers stop routing here) → running streams finish for up to
--grace-period-s (then they are aborted) → exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from collections.abc import Callable
from pathlib import Path

from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.backends import create_engine
from llmserve.inference.engine.cores import BackendUnavailable
from llmserve.inference.config import DEFAULT_KV_EVENTS_HEARTBEAT_MS, InferenceConfig
from llmserve.inference.engine.config import MODEL_GROUP
from llmserve.inference.engine_flags import add_engine_arguments, engine_config, engine_options
from llmserve.inference.kv_event_log import KvEventLog
from llmserve.inference.kv_pull_endpoints import KvPullEndpoints
from llmserve.inference.metrics import register_load
from llmserve.inference.servicer import SERVICE_NAME, InferenceServicer
from llmserve.message_limits import token_ids_request_bytes
from llmserve.model_files import ModelFiles
from llmserve.prefix_index.redis_config import add_redis_arguments, redis_config_from_args
from llmserve.server import (
    BindError, RunningServer, configure_logging, create_server, exit_with_parent, serve_until_signal,
    write_port_file,
)
from llmserve.metrics_endpoint import start_metrics_endpoint
from llmserve.server_flags import add_server_arguments, observability_options, server_options
from llmserve.v1 import inference_pb2_grpc

log = logging.getLogger("llmserve.inference")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m llmserve.inference",
        description="Inference service: token ids in, token ids out (llmserve.v1.InferenceService).",
    )
    server = add_server_arguments(p)
    server.add_argument("--replica-id", help="stable routing key of this replica (default: <hostname>-<bound port>)")
    server.add_argument(
        "--kv-events-heartbeat-ms", type=int, default=DEFAULT_KV_EVENTS_HEARTBEAT_MS, metavar="MS",
        help="WatchKvEvents: a heartbeat (with the load) after this many quiet milliseconds, for "
        "subscribers that ask for no interval of their own (default: %(default)s)",
    )
    add_redis_arguments(
        server, "publish this replica's KV events to the Redis routing index at URL (redis://host:port/db), "
        "for gateways started with the same --redis-url; unset: gateways read the events themselves",
    )
    model = p.add_argument_group(MODEL_GROUP)
    model.add_argument("--model", required=True, help="local HF checkpoint directory (config.json, *.safetensors)")
    model.add_argument("--model-name", help="served model name (default: the name the checkpoint gives itself)")
    add_engine_arguments(p, {MODEL_GROUP: model})
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> InferenceConfig:
    model_path = Path(args.model).expanduser().resolve()
    model_name = args.model_name or ModelFiles.load(model_path).model_name
    return InferenceConfig(
        engine=engine_config(engine_options(args), model_path, model_name),
        **server_options(args),
        replica_id=args.replica_id,
        kv_events_heartbeat_ms=args.kv_events_heartbeat_ms,
        redis=redis_config_from_args(args),
        log_level=args.log_level,
    )


async def serve(config: InferenceConfig) -> None:
    start_metrics_endpoint(config.observability, config.host)
    try:
        # Loads the weights and sizes the KV pool.
        engine = create_engine(config.engine, log_level=config.log_level, observability=config.observability)
    except ValueError as exc:  # a model or a flag combination this engine cannot run: say why
        log.error("cannot start the engine: %s", exc)
        raise SystemExit(1) from None
    register_load(engine.load)
    kv_events = KvEventLog.of(
        engine, replica_id=config.replica_id or "", default_heartbeat_interval_s=config.kv_events_heartbeat_ms / 1000
    )
    await engine.start()
    kv_pull = KvPullEndpoints.of(engine) if config.engine.kv_pull else None
    servicer = InferenceServicer(engine, kv_events, kv_pull)
    running = await create_server(
        config.address,
        lambda server: inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        max_receive_bytes=token_ids_request_bytes(
            engine.model_info.max_context_tokens, engine.model_info.block_size_tokens
        ),
    )
    if not kv_events.replica_id:
        kv_events.replica_id = f"{socket.gethostname()}-{running.port}"
    _log_startup(engine, kv_events.replica_id, running.port)
    publisher = _start_redis_publisher(config, kv_events)
    engine.on_core_failure(_not_serving_on_failure(running))
    await running.set_serving(True)
    write_port_file(config.port_file, running.port)
    await serve_until_signal(
        running, grace_s=config.grace_period_s, on_drain=lambda: _drain(engine, kv_events, config, kv_pull)
    )
    if publisher is not None:
        await publisher  # ended by kv_events.close(), having dropped this replica's entries


def _not_serving_on_failure(running: RunningServer) -> Callable[[str], None]:
    """Health NOT_SERVING once the engine is gone (its requests already failed with the reason):
    the replica stays up to say so, and its orchestrator replaces it."""
    tasks: set[asyncio.Task] = set()

    def on_failure(message: str) -> None:
        log.error("the engine failed: %s; health NOT_SERVING", message)
        task = asyncio.ensure_future(running.set_serving(False))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return on_failure


def _start_redis_publisher(config: InferenceConfig, kv_events: KvEventLog) -> asyncio.Task | None:
    if config.redis is None:
        return None
    from llmserve.prefix_index.redis_publisher import start_publishing  # redis-py: only with --redis-url

    return start_publishing(config.redis, lambda: kv_events.subscribe(False, kv_events.default_heartbeat_interval_s))


async def _drain(
    engine: AsyncEngine, kv_events: KvEventLog, config: InferenceConfig, kv_pull: KvPullEndpoints | None
) -> None:
    # A draining replica refuses new requests, so its watchers had better stop routing here
    # now; their streams, which never end by themselves, must not hold the drain either.
    kv_events.close()
    if kv_pull is not None:
        await kv_pull.pins.release_all()  # pullers still copying fall back to recomputing
    await engine.shutdown(drain_timeout_s=config.grace_period_s)
    if kv_pull is not None:
        await kv_pull.puller.close()  # the engine's process exits: its reaper unlinks the pool


def _log_startup(engine: AsyncEngine, replica_id: str, port: int) -> None:
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
    configure_logging("inference", args.log_level, observability_options(args))
    exit_with_parent()
    try:
        asyncio.run(serve(config_from_args(args)))
    except (BackendUnavailable, FileNotFoundError, BindError) as exc:  # a wrong flag or port: say why, no traceback
        log.error("%s", exc)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
