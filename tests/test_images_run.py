"""Every image built and started for real (issue 20): built from this checkout by
deploy/docker/build-images.sh (tests/docker_engine.py), each image runs as its service user,
answers --help, imports what every flag the chart can pass needs, and, started alone on the
default model, answers gRPC health SERVING and serves /metrics on 127.0.0.1; SIGTERM ends it
with 0. The whole stack from the images, with the chart's own arguments, is
tests/test_helm_runs.py::test_the_cpu_values_run_from_the_images.

`make images-smoke` runs these and that test; .ci/run too (LLMSERVE_IMAGES=1: no skip there).
"""

from __future__ import annotations

import subprocess
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.docker_engine import Containers, docker
from tests.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # the first test builds the images

COMPONENTS = ("gateway", "preprocess", "inference")
SERVICE_USER = "10001"
START_TIMEOUT_S = 180
MODEL_MOUNT = "/models"


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_image_runs_as_its_service_user_and_explains_its_flags(component, built_images):
    image = built_images[component]
    assert docker("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip() == f"{SERVICE_USER}:{SERVICE_USER}"
    assert docker("run", "--rm", "--network", "none", "--entrypoint", "id", image, "-u").stdout.strip() == SERVICE_USER
    helped = docker("run", "--rm", "--network", "none", image, "--help")
    assert helped.stdout.startswith("usage:") and "--redis-url" in helped.stdout, helped.stdout[:500]


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_image_imports_what_the_charts_flags_need(component, built_images):
    """The chart passes --redis-url to every service when its Redis is on: each image must
    import the redis client (it did not: "No module named 'redis'" at start)."""
    code = f"import redis, llmserve.{component}.__main__; print(redis.__version__)"
    done = docker("run", "--rm", "--network", "none", "--entrypoint", "python", built_images[component], "-c", code, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def _health_status(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return None


def _service_args(component: str, ports: dict[str, int]) -> list[str]:
    """What starts `component` alone on the default model: the gateway needs a preprocess and an
    inference server, so it is started last, against the two started before it."""
    model = ["--model", f"{MODEL_MOUNT}/smollm2-135m-instruct", "--metrics-port", str(ports[f"{component}-metrics"])]
    if component == "gateway":
        return [
            *model, "--host", "127.0.0.1", "--port", str(ports["gateway"]),
            "--preprocess", f"127.0.0.1:{ports['preprocess']}", "--inference", f"127.0.0.1:{ports['inference']}",
        ]  # fmt: skip
    return [*model, "--host", "127.0.0.1", "--port", str(ports[component])]


def test_every_image_starts_on_the_default_model_and_stops_on_sigterm(built_images, default_model_dir, tmp_path):
    containers = Containers(tmp_path)
    ports = {name: free_port() for component in COMPONENTS for name in (component, f"{component}-metrics")}
    started: dict[str, subprocess.Popen] = {}
    logs = {component: open(tmp_path / f"{component}.log", "w") for component in COMPONENTS}
    try:
        for component in ("preprocess", "inference", "gateway"):
            run = [
                "docker", "run", "--rm", *containers.run_args(component), "--network", "host",
                "--volume", f"{default_model_dir.parent}:{MODEL_MOUNT}:ro",
                built_images[component], *_service_args(component, ports),
            ]  # fmt: skip
            started[component] = subprocess.Popen(run, stdin=subprocess.DEVNULL, stdout=logs[component], stderr=subprocess.STDOUT)
            address = f"127.0.0.1:{ports[component]}"
            deadline = time.monotonic() + START_TIMEOUT_S
            while _health_status(address) != health_pb2.HealthCheckResponse.SERVING:
                log = (tmp_path / f"{component}.log").read_text()[-3000:]
                assert started[component].poll() is None, f"{component} exited:\n{log}"
                assert time.monotonic() < deadline, f"{component} not SERVING in {START_TIMEOUT_S} s:\n{log}"
                time.sleep(0.5)
            metrics_url = f"http://127.0.0.1:{ports[f'{component}-metrics']}/metrics"
            with urllib.request.urlopen(metrics_url, timeout=10) as response:
                assert response.status == 200 and "# TYPE process_cpu_seconds_total counter" in response.read().decode()
        for component in ("gateway", "inference", "preprocess"):  # the gateway first, as a rollout drains
            started[component].terminate()  # the docker client passes SIGTERM on to the container
            assert started[component].wait(timeout=90) == 0, (tmp_path / f"{component}.log").read_text()[-3000:]
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        containers.remove_all()
        for log in logs.values():
            log.close()
