"""`llmserve serve`: run preprocess, inference and the gateway as three local processes.

Start-up, in order:
  1. resolve the model (the default one is fetched and converted on first use);
  2. start preprocess and `--replicas` inference replicas on free loopback ports (`--port 0
     --port-file`), all at once, and wait until all serve (llmserve.tools.service_process);
  3. start the gateway on the public address, pointed at them (`--gateway-workers` processes
     on that one port; with several replicas it routes by their KV events, in memory);
  4. print where to connect, then forward the children's logs until Ctrl-C / SIGTERM or until
     a child dies.
Shutdown: SIGTERM to the gateway first (it stops taking requests and drains), then to
preprocess and inference; whoever has not exited after the timeout gets SIGKILL. A second
Ctrl-C skips the waiting.
"""

from __future__ import annotations

import logging
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Sequence

from llmserve.call_balancing import balanced_target
from llmserve.gateway.slow_reader_flags import slow_reader_argv
from llmserve.gateway.stream_interval import stream_interval_argv
from llmserve.gateway.worker_ports import read_worker_ports
from llmserve.inference.engine_flags import engine_argv
from llmserve.tools.model_store import DEFAULT_MODEL_NAME, ModelResolutionError, is_default_model_spec, resolve_model
from llmserve.tools.serve_config import ServeConfig
from llmserve.tools.service_process import LOOPBACK, ServiceProcess, ServiceStartError, stop_services

log = logging.getLogger("llmserve.tools.launcher")

# Engine options preprocess must share: it hashes prompt blocks of the engine's block size
# (the engine ignores hashes of another size), validates lengths against the same context and
# counts prompts by the same length buckets (the flags have the same names on both).
PREPROCESS_ENGINE_OPTIONS = ("block_size_tokens", "max_context_tokens", "length_buckets")


# --- each child's command line (after `python -m llmserve.<service>`) ---------------------------


def common_argv(config: ServeConfig, model_dir: Path, model_name: str | None) -> list[str]:
    """The flags every service gets from `serve`: the model, logging, the grace period."""
    args = [
        "--model", str(model_dir), "--log-level", config.log_level, "--grace-period-s", str(config.grace_period_s),
        *(["--log-format", config.log_format] if config.log_format != "text" else []),
        *(["--log-prompts"] if config.log_prompts else []),
    ]
    if model_name:
        args += ["--model-name", model_name]
    return args


def _metrics_args(config: ServeConfig, offset: int) -> list[str]:
    """--metrics-port for the service at `offset` (gateway 0, preprocess 1, replica i 2 + i)."""
    return [] if config.metrics_port is None else ["--metrics-port", str(config.metrics_port + offset)]


def preprocess_argv(config: ServeConfig, common: list[str]) -> list[str]:
    """Preprocess's flags: loopback port 0, `common` (common_argv), the engine options it shares
    (PREPROCESS_ENGINE_OPTIONS), its metrics port and the output-token cap."""
    args = [
        "--host", LOOPBACK, "--port", "0", *common, *engine_argv(config.engine, PREPROCESS_ENGINE_OPTIONS),
        *_metrics_args(config, 1),
    ]
    if config.max_output_tokens is not None:
        args += ["--max-output-tokens", str(config.max_output_tokens)]
    return args


def inference_argv(config: ServeConfig, common: list[str], replica: int) -> list[str]:
    """Inference replica `replica`'s flags: loopback port 0, `common` (common_argv), its engine
    options (replica_engine_options), its metrics port, and a replica id when there are several."""
    args = [
        "--host", LOOPBACK, "--port", "0", *common, *engine_argv(replica_engine_options(config, replica)),
        *_metrics_args(config, 2 + replica),
    ]
    if config.num_replicas > 1:
        args += ["--replica-id", f"replica-{replica}"]
    return args


def replica_engine_options(config: ServeConfig, replica: int) -> dict:
    """Replica `replica`'s engine options: device "cuda" means GPUs of its own, one per rank
    (tensor parallel size k: replica i on cuda:i*k, its ranks on cuda:i*k .. i*k+k-1, rank r on
    its device's index + r); any other device (cpu, an explicit cuda:N) is shared by every
    replica. All GPUs stay visible to every replica: a KV pull between replicas maps the other
    GPU's memory (CUDA IPC with peer access), which hiding it would forbid."""
    if config.num_replicas > 1 and config.engine["device"] == "cuda":
        ranks = config.engine.get("tensor_parallel_size") or 1
        return {**config.engine, "device": f"cuda:{replica * ranks}"}
    return config.engine


def gateway_argv(
    config: ServeConfig, common: list[str], preprocess: ServiceProcess, replicas: Sequence[ServiceProcess],
    run_dir: Path | None = None,
) -> list[str]:
    """The gateway's flags: the public address, its workers, `common` (common_argv), its metrics
    port, and the addresses of `preprocess` and every replica (all serving already); with
    --gateway-worker-ports, where in `run_dir` it writes its workers' ports."""
    args = [
        "--host", config.host, "--port", str(config.port), "--workers", str(config.gateway_workers), *common,
        "--preprocess", preprocess.address, *_metrics_args(config, 0), *slow_reader_argv(config.slow_readers),
        *stream_interval_argv(config.stream_interval),
    ]
    if config.http_port is not None:
        args += ["--http-port", str(config.http_port)]
    if config.gateway_worker_ports is not None:
        args += ["--worker-ports", str(config.gateway_worker_ports)]
        if run_dir is not None:
            args += ["--worker-ports-file", str(worker_ports_file(run_dir))]
    for replica in replicas:
        args += ["--inference", replica.address]
    return args


def worker_ports_file(run_dir: Path) -> Path:
    """Where the gateway writes its workers' own ports (--gateway-worker-ports; bench_stack's --balance-calls)."""
    return run_dir / "gateway.worker-ports"


def connect_host(bind_host: str) -> str:
    """Where a local client reaches a server bound to `bind_host` (wildcards → loopback)."""
    return LOOPBACK if bind_host in ("0.0.0.0", "::", "[::]", "") else bind_host


def print_banner(config: ServeConfig, port: int, model_dir: Path, out: IO[str], run_dir: Path) -> None:
    address = f"{connect_host(config.host)}:{port}"
    # The first line is stable: scripts and tests parse it.
    out.write(
        f"gateway listening on {config.host}:{port}\n"
        f"  model:   {model_dir} (backend {config.engine['backend']}, device {config.engine['device']})\n"
        f"  try:     llmserve chat --address {address} \"Hello! Who are you?\"\n"
        f"           llmserve generate --address {address} \"The capital of France is\" --max-tokens 32\n"
        f"           llmserve models --address {address}\n"
        f"  grpcurl: grpcurl -plaintext -d '{{\"params\": {{\"prompt\": \"Hi\"}}}}' {address} llmserve.v1.GatewayService/GenerateStream\n"
        f"{_worker_ports_banner(config, run_dir)}"
        f"{_http_banner(config)}"
        f"{_metrics_banner(config)}"
        f"  Ctrl-C stops all services.\n"
    )
    out.flush()


def _worker_ports_banner(config: ServeConfig, run_dir: Path) -> str:
    if config.gateway_worker_ports is None:
        return ""
    target = balanced_target(connect_host(config.host), read_worker_ports(worker_ports_file(run_dir)))
    return f"  by call: llmserve bench --address {target}   (grpc round_robin over each gateway worker's own port)\n"


def _http_banner(config: ServeConfig) -> str:
    if config.http_port is None:
        return ""
    url = f"http://{connect_host(config.host)}:{config.http_port}/v1"
    return (
        f"  openai:  curl {url}/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'\n"
        f"           (any OpenAI client: base_url={url})\n"
    )


def _metrics_banner(config: ServeConfig) -> str:
    if config.metrics_port is None:
        return ""
    host, port = connect_host(config.host), config.metrics_port
    return f"  metrics: http://{host}:{port}/metrics (gateway), :{port + 1} (preprocess), :{port + 2}.. (inference)\n"


class _Signals:
    """SIGINT/SIGTERM as events: the first asks to stop, a second asks not to wait."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.force = threading.Event()
        self._previous = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.stop.is_set():
            self.force.set()
        self.stop.set()


def serve(config: ServeConfig, *, out: IO[str] | None = None, log_sink: IO[str] | None = None) -> int:
    """Run the three services until a signal or a child's death; the process exit code."""
    out = out or sys.stdout
    log_sink = log_sink or sys.stderr
    try:
        model_dir = resolve_model(config.model, cache_dir=config.cache_dir, progress=True)
    except ModelResolutionError as error:
        log.error("%s", error)
        return 2
    model_name = config.model_name or (DEFAULT_MODEL_NAME if is_default_model_spec(config.model) else None)
    # Signals are ours only once children exist; before that Ctrl-C simply interrupts.
    signals = _Signals()
    signals.install()
    try:
        with tempfile.TemporaryDirectory(prefix="llmserve-serve-") as run_dir:
            return _run_services(config, model_dir, model_name, Path(run_dir), signals, out, log_sink)
    finally:
        signals.restore()


def _run_services(
    config: ServeConfig,
    model_dir: Path,
    model_name: str | None,
    run_dir: Path,
    signals: _Signals,
    out: IO[str],
    log_sink: IO[str],
) -> int:
    common = common_argv(config, model_dir, model_name)
    preprocess = ServiceProcess(
        "preprocess", "llmserve.preprocess", preprocess_argv(config, common),
        port_file=run_dir / "preprocess.port", log_sink=log_sink,
    )
    replicas = [
        ServiceProcess(
            _replica_name(config, i), "llmserve.inference", inference_argv(config, common, i),
            port_file=run_dir / f"{_replica_name(config, i)}.port", log_sink=log_sink,
        )
        for i in range(config.num_replicas)
    ]
    gateway: ServiceProcess | None = None
    try:
        log.info(
            "starting preprocess and %d inference replica(s) (%s on %s) for %s",
            config.num_replicas, config.engine["backend"], config.engine["device"], model_dir,
        )
        for service in (preprocess, *replicas):
            service.start()
        for service in (preprocess, *replicas):
            service.wait_until_serving(config.startup_timeout_s, stop=signals.stop)
        gateway = ServiceProcess(
            "gateway", "llmserve.gateway", gateway_argv(config, common, preprocess, replicas, run_dir),
            port_file=run_dir / "gateway.port", log_sink=log_sink, connect_host=connect_host(config.host),
        )
        gateway.start()
        port = gateway.wait_until_serving(config.startup_timeout_s, stop=signals.stop)
        print_banner(config, port, model_dir, out, run_dir)
        return _supervise((gateway, preprocess, *replicas), signals)
    except ServiceStartError as error:
        if signals.stop.is_set():
            return 0
        log.error("%s", error)
        return 1
    finally:
        log.info("stopping services")
        stop_services(
            ([gateway] if gateway is not None else [], [preprocess, *replicas]),
            config.stop_timeout_s,
            force=signals.force,
        )
        log.info("all services stopped")


def _replica_name(config: ServeConfig, replica: int) -> str:
    return "inference" if config.num_replicas == 1 else f"inference-{replica}"


def _supervise(services: Sequence[ServiceProcess], signals: _Signals) -> int:
    """Block until a stop signal (exit code 0) or a child's death (1)."""
    while not signals.stop.wait(0.5):
        for service in services:
            exit_code = service.poll()
            if exit_code is not None:
                log.error(
                    "%s exited unexpectedly with code %d; last log lines:\n%s",
                    service.name, exit_code, service.log_tail(),
                )
                return 1
    return 0
