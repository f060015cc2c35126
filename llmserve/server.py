"""Server bootstrap shared by the three services.

`create_server` registers health and reflection on every server and binds the address (port 0
picks a free port, which it returns). `serve_until_signal` runs the server until SIGTERM/SIGINT
and then drains: health NOT_SERVING → stop accepting → wait for in-flight RPCs → exit.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from llmserve.errors import ErrorMappingInterceptor
from llmserve.log_format import log_formatter
from llmserve.log_rate_limit import LogRateLimit
from llmserve.observability import ObservabilityConfig
from llmserve.request_context import RequestIdFilter

log = logging.getLogger(__name__)

# Message size limit of the channels between our services and of what servers send: peers are
# our own services, whose receive limits (llmserve.message_limits) bound what they send.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


@dataclass
class RunningServer:
    """A started gRPC server, the port it bound and its health servicer; with more accept loops
    (create_server's `num_accept_loops`), the servers beside it on the same port."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    more_servers: tuple[grpc.aio.Server, ...] = ()
    second_port: int | None = None  # create_server's `second_address`, bound

    async def stop(self, grace_s: float | None) -> None:
        """Stop accepting on every accept loop; in-flight RPCs get `grace_s` to finish."""
        await asyncio.gather(*(server.stop(grace_s) for server in (self.server, *self.more_servers)))

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)


async def create_server(
    address: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    *,
    max_receive_bytes: int,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    options: Iterable[tuple[str, int]] = (),
    num_accept_loops: int = 1,
    second_address: str | None = None,
) -> RunningServer:
    """Build, register and start a server on `address` ("host:port"; port 0 = any free port).

    `register` adds the service's servicers; `service_names` are their full names (for health
    and reflection). A request over `max_receive_bytes` (llmserve.message_limits) is refused with
    RESOURCE_EXHAUSTED before it is parsed (llmserve.undecodable; grpc's own limit is a backstop
    above it). `options`: more of grpc's channel arguments. The server starts NOT_SERVING; call
    `set_serving(True)` once ready.

    `num_accept_loops` > 1 starts that many servers on the one port, all registered alike and
    sharing one health servicer. Why: grpc's asyncio server accepts RPCs one at a time, each
    acceptance a few trips through the event loop (AioServer._server_main_loop keeps one
    request_call outstanding), so on a loop kept busy streaming tokens a burst of new RPCs waits
    in line before any handler runs. grpc sets SO_REUSEPORT, so the kernel spreads connections
    over the servers, and each accepts its own connections' RPCs (bench/bench_accept.py).

    `second_address`: another "host:port" every accept loop also listens on (port 0: one free
    port, the first loop's), as a gateway worker's own port (gateway.worker_ports).
    """
    options = (
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max(max_receive_bytes, MAX_MESSAGE_BYTES)),
        *options,
    )
    interceptors = (ErrorMappingInterceptor(max_request_bytes=max_receive_bytes), *interceptors)
    health_servicer = health.aio.HealthServicer()
    names = tuple(service_names)
    servers: list[grpc.aio.Server] = []
    port, second_port = 0, None
    try:
        for loop_index in range(num_accept_loops):
            server = _build_server(register, names, health_servicer, interceptors, options)
            # The first binds `address`; the others the port it got (port 0 picks one).
            port = _bind(server, address if loop_index == 0 else _with_port(address, port))
            if second_address is not None:
                second_bind = second_address if loop_index == 0 else _with_port(second_address, second_port)
                second_port = _bind(server, second_bind)
            await server.start()
            servers.append(server)
    except BaseException:
        await asyncio.gather(*(server.stop(None) for server in servers))
        raise
    running = RunningServer(servers[0], port, health_servicer, names, tuple(servers[1:]), second_port)
    await running.set_serving(False)
    return running


class BindError(OSError):
    """An address a server cannot listen on: held by a socket without SO_REUSEPORT (grpc sets
    it, so our own servers share a port), or not an address of this host. The services say it
    in one line and exit 1."""


def _bind(server: grpc.aio.Server, address: str) -> int:
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind to address ..."
        port = 0
    if port == 0:
        raise BindError(f"cannot bind {address}: the port is held by another program, or the host is not this machine's")
    return port


def _with_port(address: str, port: int) -> str:
    return f"{address.rsplit(':', 1)[0]}:{port}"


def _build_server(
    register: Callable[[grpc.aio.Server], None],
    names: tuple[str, ...],
    health_servicer: health.aio.HealthServicer,
    interceptors: tuple[grpc.aio.ServerInterceptor, ...],
    options: tuple[tuple[str, int], ...],
) -> grpc.aio.Server:
    server = grpc.aio.server(interceptors=interceptors, options=options)
    register(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    return server


def write_port_file(path: str | None, ports: int | Sequence[int]) -> None:
    """Tell a launcher which port was bound, or which ports (space-separated; a gateway's
    --worker-ports-file), written atomically."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(str(ports) if isinstance(ports, int) else " ".join(map(str, ports)))
    os.replace(tmp, path)


async def serve_until_signal(
    running: RunningServer,
    *,
    grace_s: float,
    on_drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain in-flight RPCs for up to `grace_s` seconds."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: draining (grace %.1fs)", grace_s)
    await running.set_serving(False)
    stop_task = asyncio.create_task(running.stop(grace_s))
    if on_drain is not None:
        await on_drain()
    await stop_task
    log.info("stopped")


# Set by the launcher on its children: the pid they must not outlive.
PARENT_PID_ENV = "LLMSERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def exit_with_parent() -> None:
    """When started by the launcher, get SIGTERM if the launcher dies (even by SIGKILL).

    Runs in the service itself after exec — never as a Popen preexec_fn, which can deadlock
    when the parent has other threads (a lock held at fork time, e.g. the dynamic loader's).
    Linux delivers the signal when the launcher *thread* that spawned this process exits.
    """
    parent_pid = os.environ.get(PARENT_PID_ENV)
    if not parent_pid or sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent_pid):  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def configure_logging(service: str, level: str, observability: ObservabilityConfig) -> None:
    """Log `service`'s lines to stderr in `observability.log_format` (llmserve.log_format, which
    caps each line), each line logged while serving a request labelled with its id
    (llmserve.request_context), and each kind of line rate-limited (llmserve.log_rate_limit)."""
    handler = logging.StreamHandler()
    handler.setFormatter(log_formatter(observability.log_format, service, log_prompts=observability.log_prompts))
    handler.addFilter(LogRateLimit())
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.captureWarnings(True)  # a library's warning becomes a line of this format, not raw stderr
    # grpc's own loggers print a line per RPC at DEBUG; keep them quiet unless asked directly.
    logging.getLogger("grpc").setLevel(max(logging.INFO, logging.getLogger().level))
