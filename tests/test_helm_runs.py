"""The rendered chart runs: values-cpu.yaml's manifests started as local processes on loopback.

Every pod of the render (one per Deployment and StatefulSet, one replica each) becomes local
processes: its init containers run to completion, then its containers start with the command,
args, env and ports the manifests give them. What a cluster would provide is replaced by one
small, explicit mapping (`Loopback`), and nothing else is changed:
  - a Service address `name[.ns[.svc[.cluster.local]]]:port` → 127.0.0.1 and the local port of
    the pod port that Service targets (so Services must select pods and name their ports);
  - each pod's container ports → free local ports, in the values of --port, --metrics-port and
    -p and in probes (so a flag value that is no declared containerPort fails);
  - the bind address 0.0.0.0 → 127.0.0.1;
  - volumes: the model emptyDir → the llmserve model cache (the init container's real
    `llmserve fetch-model` finds the default model there), every other volume → a fresh dir;
  - commands: python → this interpreter, llmserve → this venv's, redis-server/redis-cli → PATH.
Then the stack must answer through the gateway's Service, every probe must pass as the kubelet
asks it (gRPC Health/Check with the probe's service, exec, tcpSocket), every metrics port must
serve /metrics, and SIGTERM must end every container, with exit code 0, in the time its pod
leaves it after the preStop hook.

Run by `images` (issue 20), every llmserve container runs from its real image instead
(tests/docker_engine.py builds them): `docker run` on the host network, as the pod's user, with
its read-only root filesystem, dropped capabilities and no privilege escalation, its volumes
bind-mounted at their mount paths (owned by the pod's fsGroup, as a kubelet makes an emptyDir)
and its environment; an exec probe runs in the container. What differs from a kubelet: the
built-in Redis pod's image (redis:7-alpine) cannot be pulled here, so it runs as a local
redis-server as above; host networking stands in for the pod network (the port mapping above);
the model volume is this machine's model cache, mounted as is; the containers of a pod share the
host's IPC namespace for their /dev/shm.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytest.importorskip("helm_python")

from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tests.helm_manifests import (  # noqa: E402
    NAMESPACE,
    PodTemplate,
    container_env,
    expand,
    of_kind,
    pod_templates,
    render,
    selects,
)
from tests.docker_engine import Containers  # noqa: E402
from tests.procs import free_port  # noqa: E402

pytestmark = pytest.mark.slow

LOOPBACK = "127.0.0.1"
PORT_FLAGS = ("--port", "--metrics-port", "--http-port", "-p")
PROBE_POLL_S = 1.0  # the kubelet asks every periodSeconds; polling faster only starts the test sooner
RPC_TIMEOUT_S = 120


def _commands() -> dict[str, str | None]:
    return {
        "python": sys.executable,
        "llmserve": str(Path(sys.executable).with_name("llmserve")),
        "redis-server": shutil.which("redis-server"),
        "redis-cli": shutil.which("redis-cli"),
    }


@dataclass
class LocalPod:
    """One pod of the render, on loopback: its container ports and volumes mapped to local ones."""

    template: PodTemplate
    ports: dict[int, int]  # containerPort → local port (one network namespace per pod)
    volumes: dict[str, Path]  # volume name → local directory
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    container_names: dict[str, str] = field(default_factory=dict)  # from images: container → docker name

    @property
    def name(self) -> str:
        return f"{self.template.workload}-0"

    @property
    def component(self) -> str:
        return self.template.labels["app.kubernetes.io/component"]

    def named_port(self, container: dict, port: int | str) -> int:
        if isinstance(port, int):
            return port
        (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
        return number


class Loopback:
    """The explicit mapping from what a cluster provides to what this machine has. With
    `containers`, the llmserve containers run from their images (see the module doc)."""

    def __init__(self, docs: list[dict], pods: list[LocalPod], containers: Containers | None = None):
        self.docs = docs
        self.containers = containers
        self.commands = _commands()
        self.addresses = {}
        for service in of_kind(docs, "Service"):
            (pod,) = [p for p in pods if selects(service["spec"]["selector"], p.template.labels)]
            containers = pod.template.containers
            for port in service["spec"]["ports"]:
                container_port = next(
                    pod.named_port(c, port["targetPort"]) for c in containers
                    if any(p["name"] == port["targetPort"] for p in c["ports"])
                )
                name = service["metadata"]["name"]
                for host in (name, f"{name}.{NAMESPACE}", f"{name}.{NAMESPACE}.svc", f"{name}.{NAMESPACE}.svc.cluster.local"):
                    self.addresses[f"{host}:{port['port']}"] = f"{LOOPBACK}:{pod.ports[container_port]}"

    def service_address(self, name: str, port: int) -> str:
        return self.addresses[f"{name}.{NAMESPACE}.svc:{port}"]

    def in_image(self, container: dict) -> bool:
        return self.containers is not None and container["image"].startswith("llmserve/")

    def token(self, pod: LocalPod, container: dict, token: str) -> str:
        if token == "0.0.0.0":
            return LOOPBACK
        for mount in [] if self.in_image(container) else container.get("volumeMounts", []):
            path = mount["mountPath"]
            if token == path or token.startswith(path + "/"):
                return str(pod.volumes[mount["name"]]) + token[len(path):]
        for address in sorted(self.addresses, key=len, reverse=True):
            token = token.replace(address, self.addresses[address])
        return token

    def argv(self, pod: LocalPod, container: dict, argv: list[str]) -> list[str]:
        command = argv[0] if self.in_image(container) else self.commands[argv[0]]
        assert command, f"{argv[0]} is not installed here"
        local = [command]
        for previous, token in zip(argv, argv[1:]):
            if previous in PORT_FLAGS:
                assert int(token) in pod.ports, f"{container['name']}: {previous} {token} is no containerPort of its pod"
                local.append(str(pod.ports[int(token)]))
            else:
                local.append(self.token(pod, container, token))
        return local

    def process(self, pod: LocalPod, container: dict) -> tuple[list[str], dict[str, str]]:
        """The container's argv and environment, as the kubelet would start it, mapped to loopback."""
        env = container_env(container, self.docs, pod_name=pod.name, secrets={})
        argv = [expand(token, env) for token in [*container["command"], *container.get("args", [])]]
        local_env = {name: self.token(pod, container, value) for name, value in env.items()}
        if self.in_image(container):
            argv = self.docker_run(pod, container, self.argv(pod, container, argv), local_env)
        else:
            argv = self.argv(pod, container, argv)
        return argv, {**os.environ, **local_env}  # what the docker client does not read, it ignores

    def docker_run(self, pod: LocalPod, container: dict, argv: list[str], env: dict[str, str]) -> list[str]:
        """`docker run` of the container's image, as its pod's security context says."""
        pod_security = pod.template.spec.get("securityContext", {})
        security = container.get("securityContext", {})
        options = ["--network", "host", "--ipc", "host", "--entrypoint", argv[0]]
        if "runAsUser" in pod_security:
            options += ["--user", f"{pod_security['runAsUser']}:{pod_security.get('runAsGroup', pod_security['runAsUser'])}"]
        if security.get("readOnlyRootFilesystem"):
            options.append("--read-only")
        if security.get("allowPrivilegeEscalation") is False:
            options += ["--security-opt", "no-new-privileges"]
        options += [f"--cap-drop={cap}" for cap in security.get("capabilities", {}).get("drop", [])]
        for mount in container.get("volumeMounts", []):
            options += ["--volume", f"{pod.volumes[mount['name']]}:{mount['mountPath']}"]
        for name, value in env.items():
            options += ["--env", f"{name}={value}"]
        run_args = self.containers.run_args(f"{pod.name}-{container['name']}")
        pod.container_names[container["name"]] = run_args[1]
        return ["docker", "run", "--rm", *run_args, *options, container["image"], *argv[1:]]

    def exec_argv(self, pod: LocalPod, container: dict, argv: list[str]) -> list[str]:
        """An exec probe's command: in the running container where it runs from an image."""
        if self.in_image(container):
            return ["docker", "exec", pod.container_names[container["name"]], *argv]
        return self.argv(pod, container, argv)


def _start_pods(
    docs: list[dict], model_cache: Path, work_dir: Path, containers: Containers | None = None
) -> tuple[list[LocalPod], Loopback]:
    pods = []
    for template in pod_templates(docs):
        ports = {p["containerPort"]: free_port() for c in template.containers for p in c.get("ports", [])}
        volumes = {}
        for volume in template.spec.get("volumes", []):
            if volume["name"] == "model" and "emptyDir" in volume:
                volumes["model"] = model_cache
            else:
                volumes[volume["name"]] = work_dir / template.workload / volume["name"]
                volumes[volume["name"]].mkdir(parents=True)
                fs_group = template.spec.get("securityContext", {}).get("fsGroup")
                if containers is not None and fs_group is not None:  # as a kubelet makes an emptyDir
                    os.chown(volumes[volume["name"]], fs_group, fs_group)
        pods.append(LocalPod(template, ports, volumes))
    loopback = Loopback(docs, pods, containers)
    for pod in pods:
        for container in pod.template.init_containers:
            _run_init_container(pod, container, loopback)
    for pod in pods:
        for container in pod.template.containers:
            argv, env = loopback.process(pod, container)
            log = open(work_dir / f"{pod.template.workload}-{container['name']}.log", "w")
            pod.processes[container["name"]] = subprocess.Popen(
                argv, env=env, cwd=work_dir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
    return pods, loopback


def _run_init_container(pod: LocalPod, container: dict, loopback: Loopback) -> None:
    argv, env = loopback.process(pod, container)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{pod.name} init {container['name']}: {done.stderr[-2000:]}"
    if container["name"] == "fetch-model":
        # What it prints is where the services look for the model (LLMSERVE_MODEL_DIR).
        assert done.stdout.strip() == env["LLMSERVE_MODEL_DIR"]


def _log_tail(work_dir: Path, pod: LocalPod, name: str) -> str:
    return (work_dir / f"{pod.template.workload}-{name}.log").read_text()[-3000:]


def _probe_passes(pod: LocalPod, container: dict, probe: dict, loopback: Loopback) -> bool:
    """One probe, asked as the kubelet asks it (within its timeoutSeconds)."""
    timeout_s = probe.get("timeoutSeconds", 1)
    if "grpc" in probe:
        with grpc.insecure_channel(f"{LOOPBACK}:{pod.ports[probe['grpc']['port']]}") as channel:
            request = health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", ""))
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s)
            except grpc.RpcError:
                return False
        return response.status == health_pb2.HealthCheckResponse.SERVING
    if "exec" in probe:
        argv = loopback.exec_argv(pod, container, probe["exec"]["command"])
        try:
            return subprocess.run(argv, capture_output=True, timeout=timeout_s).returncode == 0
        except subprocess.TimeoutExpired:
            return False
    if "tcpSocket" in probe:
        port = pod.ports[pod.named_port(container, probe["tcpSocket"]["port"])]
        try:
            socket.create_connection((LOOPBACK, port), timeout=timeout_s).close()
        except OSError:
            return False
        return True
    raise AssertionError(f"{container['name']}: a probe this test cannot ask: {probe}")


def _wait_until_started(pod: LocalPod, container: dict, loopback: Loopback, work_dir: Path) -> None:
    """The startup probe (or, without one, readiness) until it passes, within the kubelet's budget."""
    probe = container.get("startupProbe") or container["readinessProbe"]
    deadline = time.monotonic() + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    while not _probe_passes(pod, container, probe, loopback):
        process = pod.processes[container["name"]]
        assert process.poll() is None, f"{pod.name}/{container['name']} exited:\n{_log_tail(work_dir, pod, container['name'])}"
        assert time.monotonic() < deadline, f"{pod.name}/{container['name']} never started:\n{_log_tail(work_dir, pod, container['name'])}"
        time.sleep(PROBE_POLL_S)


def _ask_the_gateway(docs: list[dict], loopback: Loopback) -> gateway_pb2.GenerateResponse:
    service = next(s for s in of_kind(docs, "Service") if s["metadata"]["name"].endswith("-gateway"))
    address = loopback.service_address(service["metadata"]["name"], service["spec"]["ports"][0]["port"])
    params = gateway_pb2.GenerateParams(
        chat=common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content="What is the capital of France?")]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=16),
    )
    with grpc.insecure_channel(address) as channel:
        return gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
            gateway_pb2.GenerateRequest(params=params), timeout=RPC_TIMEOUT_S
        )


def _http_models(docs: list[dict], loopback: Loopback) -> list[str]:
    """The model ids the gateway's OpenAI HTTP API lists, through the public Service's http port."""
    service = next(s for s in of_kind(docs, "Service") if s["metadata"]["name"].endswith("-gateway"))
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"]
    address = loopback.service_address(service["metadata"]["name"], port)
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=RPC_TIMEOUT_S) as answer:
        return [model["id"] for model in json.loads(answer.read())["data"]]


def _scrape(pod: LocalPod, container: dict) -> str:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"].endswith("metrics")]
    with urllib.request.urlopen(f"http://{LOOPBACK}:{pod.ports[port]}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def _stop(pod: LocalPod) -> dict[str, int | None]:
    """SIGTERM every container (the preStop sleep is skipped: it only waits), then the exit codes
    within what the pod's grace period leaves after that sleep."""
    for process in pod.processes.values():
        process.send_signal(signal.SIGTERM)
    codes = {}
    for container in pod.template.containers:
        pre_stop_s = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        budget_s = pod.template.spec.get("terminationGracePeriodSeconds", 30) - pre_stop_s
        try:
            codes[container["name"]] = pod.processes[container["name"]].wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            codes[container["name"]] = None
    return codes


@pytest.mark.parametrize("mode", ["cpu", "cpu-colocated", "cpu-tensor-parallel"])
def test_the_cpu_values_run_serve_and_answer_every_probe(mode, default_model_dir, tmp_path):
    _serve_and_stop(render(mode), default_model_dir, tmp_path)


# The co-located mode from the images passed too (2026-12-03, by hand: LLMSERVE_IMAGE_MODES=
# cpu,cpu-colocated); each mode costs CI ~2 minutes, and what the images add is the same in both.
IMAGE_MODES = os.environ.get("LLMSERVE_IMAGE_MODES", "cpu").split(",")


@pytest.mark.timeout(2400)  # the first builds the images (tests/docker_engine.py)
@pytest.mark.parametrize("mode", IMAGE_MODES)
def test_the_cpu_values_run_from_the_images(mode, built_images, default_model_dir, tmp_path):
    docs = render(mode)
    images = {c["image"] for pod in pod_templates(docs) for c in [*pod.containers, *pod.init_containers]}
    assert {image for image in images if image.startswith("llmserve/")} <= set(built_images.values())
    containers = Containers(tmp_path)
    try:
        _serve_and_stop(docs, default_model_dir, tmp_path, containers)
    finally:
        containers.remove_all()


def _serve_and_stop(docs: list[dict], default_model_dir: Path, tmp_path: Path, containers: Containers | None = None) -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are needed for the built-in Redis pod")
    pods, loopback = _start_pods(docs, default_model_dir.parent, tmp_path, containers)
    try:
        for pod in pods:
            for container in pod.template.containers:
                _wait_until_started(pod, container, loopback, tmp_path)

        response = _ask_the_gateway(docs, loopback)
        assert "Paris" in response.text, response.text
        assert _http_models(docs, loopback) == ["smollm2-135m-instruct"]  # the default model's name

        for pod in pods:
            for container in pod.template.containers:
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if kind in container:
                        assert _probe_passes(pod, container, container[kind], loopback), (pod.name, container["name"], kind)
                if any(p["name"].endswith("metrics") for p in container["ports"]):
                    assert "# TYPE process_cpu_seconds_total counter" in _scrape(pod, container)

        # The gateway first, as a rollout or uninstall would drain it before what it calls.
        in_stop_order = sorted(pods, key=lambda pod: pod.component != "gateway")
        codes = {pod.name: _stop(pod) for pod in in_stop_order}
        assert codes == {pod.name: dict.fromkeys((c["name"] for c in pod.template.containers), 0) for pod in pods}
    finally:
        for pod in pods:
            for process in pod.processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
