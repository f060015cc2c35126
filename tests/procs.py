"""Start llmserve services as subprocesses for tests.

    with running_service("preprocess", ["--model", str(model_dir)], tmp_path) as svc:
        channel = grpc.insecure_channel(svc.address)

Each service binds 127.0.0.1 port 0, writes the port to a port file once SERVING, and is
stopped on exit (SIGTERM, then SIGKILL if it does not exit in time); the starting and stopping
is llmserve.tools.service_process's (benchmarks start services with it too). Its log goes to
`<log_dir>/<name>.log`; start-up failures raise with the log's last lines.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Sequence

from llmserve.tools.service_process import STARTUP_TIMEOUT_S, ServiceProcess, start_service, stop_service


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
