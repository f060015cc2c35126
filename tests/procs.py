"""Start llmserve services as subprocesses for tests.

    with running_service("preprocess", ["--model", str(model_dir)], tmp_path) as svc:
        channel = grpc.insecure_channel(svc.address)

Each service binds 127.0.0.1 port 0, writes the port to a port file once SERVING, and is
stopped on exit (SIGTERM, then SIGKILL if it does not exit in time). Its log goes to
`<log_dir>/<name>.log`; start-up failures raise with the log's last lines.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Iterator, Sequence

from llmserve.tools.service_process import ServiceProcess

STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0


def start_service(
    name: str, args: Sequence[str], log_dir: Path, *, module: str | None = None, timeout_s: float = STARTUP_TIMEOUT_S
) -> ServiceProcess:
    """Start `python -m llmserve.<name> --host 127.0.0.1 --port 0 ARGS` and wait until SERVING.

    `name` is also the log file's name; pass `module` to run a different module.
    """
    service = launch_service(name, args, log_dir, module=module)
    try:
        service.wait_until_serving(timeout_s)
    except BaseException:
        stop_service(service)
        raise
    return service


def launch_service(name: str, args: Sequence[str], log_dir: Path, *, module: str | None = None) -> ServiceProcess:
    """start_service without the wait: the process is started, not yet SERVING (start several, then
    wait for each, and they load at once)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    service = ServiceProcess(
        name,
        module or f"llmserve.{name}",
        ["--host", "127.0.0.1", "--port", "0", *args],
        port_file=log_dir / f"{name}.port",
        log_path=log_dir / f"{name}.log",
    )
    service.start()
    return service


def stop_service(service: ServiceProcess, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """SIGTERM, wait, SIGKILL if needed; the exit code after SIGTERM (None if it had to be killed)."""
    service.send_signal(signal.SIGTERM)
    exit_code = service.wait(timeout_s)
    service.kill()
    return exit_code


@contextlib.contextmanager
def running_service(
    name: str, args: Sequence[str], log_dir: Path, *, module: str | None = None, timeout_s: float = STARTUP_TIMEOUT_S
) -> Iterator[ServiceProcess]:
    service = start_service(name, args, log_dir, module=module, timeout_s=timeout_s)
    try:
        yield service
    finally:
        stop_service(service)


@contextlib.contextmanager
def running_stack(
    model_dir: Path,
    log_dir: Path,
    *,
    backend: str = "torch",
    gateway_args: Sequence[str] = (),
    service_args: Sequence[str] = (),
) -> Iterator[dict[str, ServiceProcess]]:
    """Preprocess, inference (on `backend`) and a gateway (with `gateway_args`) in front of them, on one
    model; every one of them also gets `service_args` (flags all services take, e.g. --log-format)."""
    model = ["--model", str(model_dir), *service_args]
    with running_service("preprocess", model, log_dir) as preprocess, \
            running_service("inference", [*model, "--backend", backend], log_dir) as inference, \
            running_service("gateway", [*model, "--preprocess", preprocess.address, "--inference", inference.address,
                                        *gateway_args], log_dir) as gateway:
        yield {"preprocess": preprocess, "inference": inference, "gateway": gateway}
