"""`--workers N`: N gateway processes on one port (SO_REUSEPORT), run by this one.

Why: the gateway is stateless, and one gateway process is one event loop under one GIL (measured
on the H200: ~100% of a core at 256 streams, 8.3k of the engine's 28k tokens/s). Workers add
cores. Each is a full gateway (gateway.worker: its own hop channels and event loop); the kernel
spreads *connections* over their listening sockets, so one client channel stays on one worker,
and many channels spread.

Start-up: reserve the port (a SO_REUSEPORT socket bound here and held, never listening, so port
0 resolves once and the port stays ours) → spawn the workers (multiprocessing "spawn": grpc does
not survive fork), each binding host:port (grpc sets SO_REUSEPORT by default on Linux), and with
--worker-ports a port of its own (gateway.worker_ports) → wait until each reports SERVING through
its pipe → write the worker ports file, then the port file. A worker that exits during start-up
fails the gateway with its exit code.

Serving: a worker that dies takes the gateway down (exit 1, a log line naming the worker); the
others drain first. Workers are not restarted: a crash should reach whoever runs the gateway (the
launcher stops the stack, an orchestrator restarts the pod) instead of hiding in a restart loop.

Metrics (--metrics-port): served here, summed over the workers. They are spawned with
PROMETHEUS_MULTIPROC_DIR set to a fresh directory (llmserve.metrics_endpoint.shared_metrics),
each writes its values there, and the directory is removed once they have exited.

SIGTERM/SIGINT: forwarded to every worker, which drains as a single gateway does (health
NOT_SERVING, in-flight streams finish within the grace period). Workers get SIGTERM if this
process dies (server.exit_with_parent).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.worker import run_worker
from llmserve.metrics_endpoint import shared_metrics, start_metrics_endpoint
from llmserve.server import PARENT_PID_ENV, configure_logging, exit_with_parent, write_port_file

log = logging.getLogger("llmserve.gateway")

# After the grace period, how long a draining worker may take to exit before it is killed; less
# than the launcher allows this process (ServeConfig.stop_timeout_s), so the kill is ours.
_EXIT_MARGIN_S = 3.0
# How often the waits look at the stop flag (signals do not interrupt them).
_POLL_S = 0.2


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: any free port) with SO_REUSEPORT; holding it keeps the port."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _worker_main(config: GatewayConfig, worker_id: int, parent_pid: int, ready: Connection) -> None:
    """A worker process: serve, telling the parent through `ready` once SERVING."""
    os.environ[PARENT_PID_ENV] = str(parent_pid)  # whom exit_with_parent watches
    configure_logging(f"gateway/{worker_id}", config.log_level, config.observability)
    exit_with_parent()
    sys.exit(run_worker(config, worker_id, on_serving=lambda port, own_port: ready.send((port, own_port))))


@dataclass
class _Worker:
    worker_id: int
    process: BaseProcess
    ready: Connection  # the parent's end: the worker sends its ports once SERVING
    is_serving: bool = False
    own_port: int | None = None  # --worker-ports: the worker's own

    @classmethod
    def start(cls, config: GatewayConfig, worker_id: int) -> "_Worker":
        context = multiprocessing.get_context("spawn")
        ready, worker_end = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker_main, args=(config, worker_id, os.getpid(), worker_end), name=f"gateway-worker-{worker_id}"
        )
        process.start()
        log.info("gateway worker %d started (pid %d)", worker_id, process.pid)
        worker_end.close()  # the child holds its own copy; EOF here then means it exited
        return cls(worker_id, process, ready)

    def receive_ready(self) -> None:
        try:
            _, self.own_port = self.ready.recv()
            self.is_serving = True
        except EOFError:  # it exited before serving; process.exitcode says how
            self.process.join()


def _wait_until_serving(workers: list[_Worker], stop: threading.Event) -> int | None:
    """None once every worker serves; else the exit code to leave with."""
    while not all(w.is_serving for w in workers):
        if stop.is_set():
            return 0
        starting = {w.ready: w for w in workers if not w.is_serving}
        for ready in wait(list(starting), timeout=_POLL_S):
            starting[ready].receive_ready()
        for worker in workers:
            if worker.process.exitcode is not None:
                log.error("gateway worker %d exited with code %d during start-up", worker.worker_id,
                          worker.process.exitcode)
                return max(worker.process.exitcode, 1)
    return None


def _supervise(workers: list[_Worker], stop: threading.Event) -> int:
    """Block until a stop signal (0) or a worker's death (1)."""
    while not stop.is_set():
        for worker in workers:
            if worker.process.exitcode is not None:
                log.error(
                    "gateway worker %d (pid %d) exited with code %d; stopping the gateway",
                    worker.worker_id, worker.process.pid, worker.process.exitcode,
                )
                return 1
        wait([w.process.sentinel for w in workers], timeout=_POLL_S)
    return 0


def _stop_workers(workers: list[_Worker], timeout_s: float) -> bool:
    """SIGTERM every worker, wait up to `timeout_s`, kill the rest; whether all exited 0."""
    for worker in workers:
        if worker.process.exitcode is None:
            worker.process.terminate()
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
        if worker.process.exitcode is None:
            log.warning("gateway worker %d did not exit within %.0fs: killing it", worker.worker_id, timeout_s)
            worker.process.kill()
            worker.process.join()
    return all(w.process.exitcode == 0 for w in workers)


def _stop_flag() -> threading.Event:
    """An event set by SIGTERM or SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    return stop


def _announce_ports(config: GatewayConfig, port: int, workers: list[_Worker]) -> None:
    """Write the worker ports file (--worker-ports) and the port file, and log both."""
    log.info("gateway serving on %s:%d with %d workers", config.host, port, len(workers))
    if config.worker_base_port is not None:
        own_ports = [worker.own_port for worker in workers]
        write_port_file(config.worker_ports_file, own_ports)
        log.info("workers' own ports (a client spreads its calls over them with round_robin): %s",
                 " ".join(map(str, own_ports)))
    write_port_file(config.port_file, port)


def run_worker_group(config: GatewayConfig) -> int:
    """Run `config.num_workers` gateway workers on `config.port` until a signal; the exit code."""
    stop = _stop_flag()
    try:
        reservation = reserve_port(config.host, config.port)
    except OSError as error:  # socket.gaierror included
        log.error("cannot bind %s: %s", config.address, error)
        return 1
    with reservation, shared_metrics() as metrics:
        start_metrics_endpoint(config.observability, config.host, metrics.registry)
        port = reservation.getsockname()[1]
        worker_config = replace(config, port=port, port_file=None)
        workers = [_Worker.start(worker_config, worker_id) for worker_id in range(config.num_workers)]
        try:
            exit_code = _wait_until_serving(workers, stop)
            if exit_code is None:
                _announce_ports(config, port, workers)
                exit_code = _supervise(workers, stop)
        finally:
            log.info("stopping %d gateway workers (grace %.1fs)", len(workers), config.grace_period_s)
            all_clean = _stop_workers(workers, config.grace_period_s + _EXIT_MARGIN_S)
            for worker in workers:
                metrics.mark_process_dead(worker.process.pid)
        return exit_code if exit_code != 0 or all_clean else 1
