"""`llmserve serve`: run preprocess, inference and the gateway as three local processes.

Start-up, in order:
  1. resolve the model (the default one is fetched and converted on first use);
  2. start preprocess and inference on free loopback ports (`--port 0 --port-file`), both at
     once; each is ready when it wrote its port file and grpc health says SERVING. A child that
     exits during start-up fails the launch at once, with the tail of its log;
  3. start the gateway on the public address, pointed at the two;
  4. print where to connect, then forward the children's logs until Ctrl-C / SIGTERM or until
     a child dies.
Shutdown: SIGTERM to the gateway first (it stops taking requests and drains), then to
preprocess and inference; whoever has not exited after the timeout gets SIGKILL. A second
Ctrl-C skips the waiting.

`ServiceProcess` (one child service) is reusable on its own; tests start services with it.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.model_store import DEFAULT_MODEL_NAME, ModelResolutionError, is_default_model_spec, resolve_model
from llmserve.server import PARENT_PID_ENV

log = logging.getLogger("llmserve.launcher")

LOOPBACK = "127.0.0.1"
NUM_LOG_TAIL_LINES = 40
_POLL_INTERVAL_S = 0.1


class ServiceStartError(RuntimeError):
    """A child service exited or timed out before it was ready; the message has its log tail."""


class ServiceProcess:
    """One llmserve service run as `python -m <module> ... --port-file PATH`.

    Its stdout and stderr are read by a thread that keeps the last lines (for error messages)
    and forwards every line to `log_sink` and/or appends it to the file `log_path`.
    """

    def __init__(
        self,
        name: str,
        module: str,
        args: Sequence[str],
        *,
        port_file: str | Path,
        log_sink: IO[str] | None = None,
        log_path: str | Path | None = None,
        connect_host: str = LOOPBACK,
        env: dict[str, str] | None = None,
    ):
        self.name = name
        self.module = module
        self.args = list(args)
        self.port_file = Path(port_file)
        self.port: int | None = None
        self.connect_host = connect_host  # where the launcher reaches it (health checks, address)
        self.log_path = Path(log_path) if log_path is not None else None
        self._log_sink = log_sink
        self._env = env
        self._log_tail: collections.deque[str] = collections.deque(maxlen=NUM_LOG_TAIL_LINES)
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.args, "--port-file", str(self.port_file)]

    @property
    def is_started(self) -> bool:
        return self._process is not None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def process(self) -> subprocess.Popen:
        if self._process is None:
            raise RuntimeError(f"{self.name} was not started")
        return self._process

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name} is not ready yet")
        return f"{self.connect_host}:{self.port}"

    def start(self) -> "ServiceProcess":
        """Spawn the child (it dies with the thread that calls this: call from a long-lived one)."""
        self.port_file.unlink(missing_ok=True)
        env = dict(os.environ if self._env is None else self._env)
        env["PYTHONUNBUFFERED"] = "1"  # log lines arrive as they are written
        env[PARENT_PID_ENV] = str(os.getpid())  # the child exits with us (server.exit_with_parent)
        self._process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            # Own process group: a Ctrl-C in the terminal reaches only the launcher, which then
            # stops the services in order (gateway first).
            process_group=0,
        )
        self._reader = threading.Thread(target=self._forward_logs, name=f"{self.name}-logs", daemon=True)
        self._reader.start()
        return self

    def _forward_logs(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        log_file = open(self.log_path, "a") if self.log_path is not None else contextlib.nullcontext()
        with log_file:
            for raw_line in self._process.stdout:
                line = raw_line.decode("utf-8", errors="replace")
                self._log_tail.append(line)
                if self.log_path is not None:
                    log_file.write(line)
                    log_file.flush()
                if self._log_sink is not None:
                    try:
                        self._log_sink.write(line)
                        self._log_sink.flush()
                    except (OSError, ValueError):  # sink closed (e.g. the terminal went away)
                        self._log_sink = None

    def log_tail(self) -> str:
        if self._reader is not None and self.poll() is not None:
            self._reader.join(timeout=2.0)  # the last lines of a dead child are worth waiting for
        return "".join(self._log_tail)

    def poll(self) -> int | None:
        return self.process.poll()

    def wait_until_serving(self, timeout_s: float, *, stop: threading.Event | None = None) -> int:
        """Wait for the port file, then for health SERVING; return the port.

        Raises ServiceStartError if the child exits, `timeout_s` passes or `stop` is set.
        """
        deadline = time.monotonic() + timeout_s
        while self.port is None:
            self._check_still_starting(deadline, timeout_s, stop)
            if self.port_file.exists():
                self.port = int(self.port_file.read_text().strip())
            else:
                time.sleep(_POLL_INTERVAL_S)
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not _is_serving(stub):
                self._check_still_starting(deadline, timeout_s, stop)
                time.sleep(_POLL_INTERVAL_S)
        return self.port

    def _check_still_starting(self, deadline: float, timeout_s: float, stop: threading.Event | None) -> None:
        if stop is not None and stop.is_set():
            raise ServiceStartError(f"{self.name}: start-up interrupted")
        exit_code = self.poll()
        if exit_code is not None:
            raise ServiceStartError(
                f"{self.name} exited with code {exit_code} during start-up; last log lines:\n{self.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise ServiceStartError(
                f"{self.name} not ready after {timeout_s:.0f}s; last log lines:\n{self.log_tail()}"
            )

    def send_signal(self, sig: int) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(sig)

    def wait(self, timeout_s: float, *, force: threading.Event | None = None) -> int | None:
        """Wait up to `timeout_s` for exit (less if `force` gets set); the exit code or None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.poll() is not None or (force is not None and force.is_set()):
                break
            time.sleep(_POLL_INTERVAL_S)
        return self.poll()

    def kill(self) -> None:
        """SIGKILL and reap."""
        self.send_signal(signal.SIGKILL)
        if self._process is not None:
            self._process.wait()
        if self._reader is not None:
            self._reader.join(timeout=2.0)


def _is_serving(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError:
        return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def stop_services(
    groups: Sequence[Sequence[ServiceProcess]], timeout_s: float, *, force: threading.Event | None = None
) -> None:
    """Stop services group by group: SIGTERM a group, wait up to `timeout_s`, SIGKILL the rest."""
    for group in groups:
        started = [s for s in group if s.is_started]
        for service in started:
            service.send_signal(signal.SIGTERM)
        for service in started:
            if service.wait(timeout_s, force=force) is None:
                log.warning("%s did not exit within %.0fs: killing it", service.name, timeout_s)
            service.kill()


# ---------------------------------------------------------------------------------------------
# `llmserve serve`


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str | None = None  # None/"default": the default model; else a checkpoint dir or .gguf
    model_name: str | None = None
    cache_dir: Path | None = None  # converted-model cache (None: model_store's default)
    backend: str = "torch"
    device: str = "cpu"
    dtype: str | None = None  # None: the inference service's default
    host: str = "127.0.0.1"
    port: int = 50051  # the gateway's public port; 0 picks a free one
    log_level: str = "INFO"
    grace_period_s: float = 10.0
    startup_timeout_s: float = 900.0  # per service: weight loading and CUDA graphs take a while
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_output_tokens: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    # Kernels and precision of the torch engine: see `python -m llmserve.inference --help`.
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str = "none"
    async_scheduling: bool = True

    @property
    def stop_timeout_s(self) -> float:
        """How long a child may take to drain after SIGTERM before it is killed."""
        return self.grace_period_s + 5.0


def choose_backend(requested: str) -> str:
    """The torch engine is the default; while it is not installed, fall back to hf."""
    if requested == "torch" and importlib.util.find_spec("llmserve.inference.engine.torch_engine") is None:
        log.warning("the torch engine (llmserve.inference.engine.torch_engine) is not available: using --backend hf")
        return "hf"
    return requested


def _common_args(config: ServeConfig, model_dir: Path, model_name: str | None) -> list[str]:
    args = ["--model", str(model_dir), "--log-level", config.log_level, "--grace-period-s", str(config.grace_period_s)]
    if model_name:
        args += ["--model-name", model_name]
    return args


def _preprocess_args(config: ServeConfig, common: list[str]) -> list[str]:
    args = ["--host", LOOPBACK, "--port", "0", *common]
    if config.max_output_tokens is not None:
        args += ["--max-output-tokens", str(config.max_output_tokens)]
    return args


def _inference_args(config: ServeConfig, common: list[str], backend: str) -> list[str]:
    args = ["--host", LOOPBACK, "--port", "0", *common, "--backend", backend, "--device", config.device]
    if config.dtype is not None:
        args += ["--dtype", config.dtype]
    if config.num_kv_blocks is not None:
        args += ["--num-kv-blocks", str(config.num_kv_blocks)]
    if config.max_num_seqs is not None:
        args += ["--max-num-seqs", str(config.max_num_seqs)]
    if not config.enable_prefix_caching:
        args.append("--no-prefix-caching")
    if config.enforce_eager:
        args.append("--enforce-eager")
    if not config.async_scheduling:
        args.append("--no-async-scheduling")
    # Only what differs from the service's defaults, so its own defaults stay the single source.
    if config.attention_backend != "auto":
        args += ["--attention-backend", config.attention_backend]
    if config.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", config.kv_cache_dtype]
    if config.quantization != "none":
        args += ["--quantization", config.quantization]
    return args


def _gateway_args(
    config: ServeConfig, common: list[str], preprocess: ServiceProcess, inference: ServiceProcess
) -> list[str]:
    return [
        "--host", config.host, "--port", str(config.port), *common,
        "--preprocess", preprocess.address, "--inference", inference.address,
    ]


def connect_host(bind_host: str) -> str:
    """Where a local client reaches a server bound to `bind_host` (wildcards → loopback)."""
    return LOOPBACK if bind_host in ("0.0.0.0", "::", "[::]", "") else bind_host


def print_banner(config: ServeConfig, port: int, model_dir: Path, backend: str, out: IO[str]) -> None:
    address = f"{connect_host(config.host)}:{port}"
    # The first line is stable: scripts and tests parse it.
    out.write(
        f"gateway listening on {config.host}:{port}\n"
        f"  model:   {model_dir} (backend {backend}, device {config.device})\n"
        f"  try:     llmserve chat --address {address} \"Hello! Who are you?\"\n"
        f"           llmserve generate --address {address} \"The capital of France is\" --max-tokens 32\n"
        f"           llmserve models --address {address}\n"
        f"  grpcurl: grpcurl -plaintext -d '{{\"params\": {{\"prompt\": \"Hi\"}}}}' {address} llmserve.v1.GatewayService/GenerateStream\n"
        f"  Ctrl-C stops all services.\n"
    )
    out.flush()


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
    backend = choose_backend(config.backend)
    # Signals are ours only once children exist; before that Ctrl-C simply interrupts.
    signals = _Signals()
    signals.install()
    try:
        with tempfile.TemporaryDirectory(prefix="llmserve-serve-") as run_dir:
            return _run_services(config, model_dir, model_name, backend, Path(run_dir), signals, out, log_sink)
    finally:
        signals.restore()


def _run_services(
    config: ServeConfig,
    model_dir: Path,
    model_name: str | None,
    backend: str,
    run_dir: Path,
    signals: _Signals,
    out: IO[str],
    log_sink: IO[str],
) -> int:
    common = _common_args(config, model_dir, model_name)
    preprocess = ServiceProcess(
        "preprocess", "llmserve.preprocess", _preprocess_args(config, common),
        port_file=run_dir / "preprocess.port", log_sink=log_sink,
    )
    inference = ServiceProcess(
        "inference", "llmserve.inference", _inference_args(config, common, backend),
        port_file=run_dir / "inference.port", log_sink=log_sink,
    )
    gateway: ServiceProcess | None = None
    try:
        log.info("starting preprocess and inference (%s on %s) for %s", backend, config.device, model_dir)
        preprocess.start()
        inference.start()
        preprocess.wait_until_serving(config.startup_timeout_s, stop=signals.stop)
        inference.wait_until_serving(config.startup_timeout_s, stop=signals.stop)
        gateway = ServiceProcess(
            "gateway", "llmserve.gateway", _gateway_args(config, common, preprocess, inference),
            port_file=run_dir / "gateway.port", log_sink=log_sink, connect_host=connect_host(config.host),
        )
        gateway.start()
        port = gateway.wait_until_serving(config.startup_timeout_s, stop=signals.stop)
        print_banner(config, port, model_dir, backend, out)
        return _supervise((gateway, preprocess, inference), signals)
    except ServiceStartError as error:
        if signals.stop.is_set():
            return 0
        log.error("%s", error)
        return 1
    finally:
        log.info("stopping services")
        stop_services(
            ([gateway] if gateway is not None else [], [preprocess, inference]),
            config.stop_timeout_s,
            force=signals.force,
        )
        log.info("all services stopped")


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
