"""Start llmserve services as subprocesses for tests.

    with running_service("preprocess", ["--model", str(model_dir)], tmp_path) as svc:
        channel = grpc.insecure_channel(svc.address)

    stack = stack_fixture(gateway_args=["--workers", "2"])  # a module's preprocess + inference + gateway

Each service binds 127.0.0.1 port 0, writes the port to a port file once SERVING, and is
stopped on exit (SIGTERM, then SIGKILL if it does not exit in time); the starting and stopping
is llmserve.tools.service_process's (benchmarks start services with it too). Its log goes to
`<log_dir>/<name>.log`; start-up failures raise with the log's last lines.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping, Sequence

import pytest

from llmserve.tools.service_process import STARTUP_TIMEOUT_S, ServiceProcess, start_service, stop_service


def free_port() -> int:
    """A port free on 127.0.0.1 now, for what cannot bind port 0 itself and say which it got (a
    --metrics-port, redis-server, a container port of the Helm runs)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
    inference_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    service_args: Sequence[str] = (),
    preprocess: ServiceProcess | None = None,
    clean_exit: Collection[str] = (),
) -> Iterator[dict[str, ServiceProcess]]:
    """Preprocess, inference (on `backend`, with `inference_args`) and a gateway (with
    `gateway_args`) in front of them, on one model; every one of them also gets `service_args`
    (flags all services take, e.g. --log-format). A `preprocess` given is used, not started.

    Yields {"preprocess", "inference", "gateway": ServiceProcess}; each logs to
    `<log_dir>/<name>.log` (its log_path). Stopped gateway first; each service named in
    `clean_exit` must then have exited with 0 on SIGTERM."""
    model = ["--model", str(model_dir), *service_args]
    started: dict[str, ServiceProcess] = {}
    try:
        if preprocess is None:
            started["preprocess"] = preprocess = start_service("preprocess", model, log_dir)
        started["inference"] = inference = start_service(
            "inference", [*model, "--backend", backend, *inference_args], log_dir
        )
        started["gateway"] = start_service(
            "gateway",
            [*model, "--preprocess", preprocess.address, "--inference", inference.address, *gateway_args],
            log_dir,
        )
        yield {"preprocess": preprocess, **started}
    finally:
        exit_codes = {name: stop_service(service) for name, service in reversed(started.items())}
    for name in clean_exit:
        assert exit_codes[name] == 0, started[name].log_tail()


def stack_fixture(
    *, model: str = "tiny_model_dir", variants: Mapping[str, Mapping[str, Any]] | None = None, **stack_options: Any
):
    """A module-scoped fixture that runs one running_stack for the tests of a module, on the model
    directory of the fixture named `model`, with `stack_options` (running_stack's keywords).
    `variants`: a stack per name, each with those options and its own (the fixture's params).

        stack = stack_fixture(gateway_args=["--workers", "2"])
    """

    @pytest.fixture(scope="module", params=list(variants) if variants else None)
    def stack(request, tmp_path_factory):
        variant = getattr(request, "param", None)
        options = {**stack_options, **(variants[variant] if variant else {})}
        module_name = request.module.__name__.rsplit(".", 1)[-1]
        log_dir = tmp_path_factory.mktemp(f"{module_name}-{variant}-logs" if variant else f"{module_name}-logs")
        with running_stack(request.getfixturevalue(model), log_dir, **options) as services:
            yield services

    return stack
