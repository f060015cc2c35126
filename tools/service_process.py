"""One llmserve service run as a child process: start it, wait until it serves, stop it.

`llmserve serve` runs its three services with it, and tests and benchmarks start services on
loopback with start_service / launch_service / stop_service. A child is ready when it wrote its
port file (`--port 0 --port-file PATH`) and grpc health says SERVING; one that exits during
start-up fails at once, with the tail of its log.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.server import PARENT_PID_ENV

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
NUM_LOG_TAIL_LINES = 40
# start_service's defaults: the tiny test model serves in seconds, a real one on a loaded CPU in
# minutes; a draining service exits within its grace period.
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0
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
                is_forced = force is not None and force.is_set()
                why = "a second stop signal" if is_forced else f"not exited within {timeout_s:.0f}s"
                log.warning("%s: killing it (%s)", service.name, why)
            service.kill()


# --- one service on loopback, for tests and benchmarks ------------------------------------------


def launch_service(name: str, args: Sequence[str], log_dir: Path, *, module: str | None = None) -> ServiceProcess:
    """Start `python -m llmserve.<name> --host 127.0.0.1 --port 0 ARGS` (`module` to run another
    module), its log in `<log_dir>/<name>.log`. Not yet SERVING: start several, then wait for
    each, and they load at once."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    service = ServiceProcess(
        name,
        module or f"llmserve.{name}",
        ["--host", LOOPBACK, "--port", "0", *args],
        port_file=log_dir / f"{name}.port",
        log_path=log_dir / f"{name}.log",
    )
    service.start()
    return service


def start_service(
    name: str, args: Sequence[str], log_dir: Path, *, module: str | None = None, timeout_s: float = STARTUP_TIMEOUT_S
) -> ServiceProcess:
    """launch_service, then wait until SERVING (stopped again if it does not get there)."""
    service = launch_service(name, args, log_dir, module=module)
    try:
        service.wait_until_serving(timeout_s)
    except BaseException:
        stop_service(service)
        raise
    return service


def stop_service(service: ServiceProcess, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """SIGTERM, wait, SIGKILL if needed; the exit code after SIGTERM (None if it had to be killed)."""
    service.send_signal(signal.SIGTERM)
    exit_code = service.wait(timeout_s)
    service.kill()
    return exit_code
