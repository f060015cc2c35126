"""The Helm chart's manifests, checked without a cluster (no Kubernetes API server runs here).

Every documented mode lints clean and renders to documents that validate, strictly, against a
current Kubernetes' schemas. Then what matters for running it: probes ask the real gRPC health
service names on the ports the services bind; every container sets resources; drain times nest
(preStop < drain < grace period); autoscalers, Services and the gateway's targets point at
things that exist; the args parse with the services' own parsers, so a flag that drifts from a
service fails here.
"""

from __future__ import annotations

import json

import pytest

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from kubernetes_validate.utils import latest_version  # noqa: E402

from llmserve.gateway.__main__ import build_parser as gateway_parser  # noqa: E402
from llmserve.gateway.servicer import SERVICE_NAME as GATEWAY_SERVICE  # noqa: E402
from llmserve.inference.__main__ import parse_args as parse_inference_args  # noqa: E402
from llmserve.inference.servicer import SERVICE_NAME as INFERENCE_SERVICE  # noqa: E402
from llmserve.preprocess.__main__ import build_parser as preprocess_parser  # noqa: E402
from llmserve.preprocess.servicer import SERVICE_NAME as PREPROCESS_SERVICE  # noqa: E402
from tests.helm_manifests import (  # noqa: E402
    CHART_DIR,
    MODES,
    NAMESPACE,
    PodTemplate,
    container_env,
    expanded_args,
    flag_value,
    merge_values,
    mode_values,
    named,
    of_kind,
    pod_templates,
    render,
    render_values,
    selects,
)

KUBE_VERSION = latest_version()
SERVICE_NAMES = {"gateway": GATEWAY_SERVICE, "preprocess": PREPROCESS_SERVICE, "inference": INFERENCE_SERVICE}
PARSERS = {
    "gateway": lambda args: gateway_parser().parse_args(args),
    "preprocess": lambda args: preprocess_parser().parse_args(args),
    "inference": parse_inference_args,
}
SECRETS = {"redis-urls": {"routing-url": "redis://r:6379/0", "prompt-cache-url": "redis://r:6379/1"}}
# CRDs have no schema in kubernetes-validate's bundle.
CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "ServiceMonitor")}

modes = pytest.mark.parametrize("mode", sorted(MODES))


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {mode: render(mode) for mode in MODES}


def service_containers(docs: list[dict]):
    """(pod, container, env, expanded args) of every llmserve service container."""
    for pod in pod_templates(docs):
        for container in pod.containers:
            if container["name"] in SERVICE_NAMES:
                env = container_env(container, docs, pod_name=f"{pod.workload}-0", secrets=SECRETS)
                yield pod, container, env, expanded_args(container, env)


@modes
def test_lint_is_clean(mode):
    report = helm.lint(CHART_DIR, mode_values(mode), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


_validated: set[str] = set()  # documents that render alike in several modes are validated once (~0.2 s each)


@modes
def test_every_document_validates_strictly(rendered, mode):
    for doc in rendered[mode]:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_RESOURCES:
            assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
            continue
        key = json.dumps(doc, sort_keys=True)
        if key not in _validated:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            _validated.add(key)


@pytest.mark.parametrize(
    "values, path",
    [
        ({"gateway": {"routing": "random"}}, "/gateway/routing"),
        ({"inference": {"drain": {"drainSeconds": "5m"}}}, "/inference/drain/drainSeconds"),
        ({"redis": {"mode": "sentinel"}}, "/redis/mode"),
        ({"preprocess": {"prot": 50052}}, "/preprocess"),
    ],
)
def test_schema_rejects_bad_values(values, path):
    with pytest.raises(helm.HelmValuesError, match=path):
        render_values(values)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"gateway": {"drain": {"drainSeconds": 80}}}, "must exceed preStopSleepSeconds"),
        ({"inference": {"drain": {"preStopSleepSeconds": 300}}}, "must be less than drainSeconds"),
        ({"gateway": {"startupTimeoutSeconds": 60}}, "must exceed gateway.downstreamReadyTimeoutSeconds"),
        ({"model": {"fetch": {"enabled": False}}}, "emptyDir starts empty"),
        ({"gateway": {"apiKeys": {"enabled": True}}}, "not wired"),
        ({"inference": {"device": "cpu"}}, "gpus is 1 but inference.device is cpu"),
        ({"shared": {"buckets": [512, 128]}}, "strictly increasing"),
        ({"inference": {"tensorParallel": {"size": 2}}}, r"inference.gpus \(1\) must equal inference.tensorParallel.size \(2\)"),
        ({"inference": {"gpus": 2, "device": "cuda:1", "tensorParallel": {"size": 2}}}, "needs inference.device cuda"),
        ({"inference": {"gpus": 2, "backend": "hf", "tensorParallel": {"size": 2}}}, "needs inference.backend torch"),
        ({"colocated": {"kvPull": {"enabled": True}}}, "colocated.kvPull needs colocated.enabled"),
        ({"inference": {"gpus": 2, "tensorParallel": {"size": 2}}, "colocated": {"enabled": True, "kvPull": {"enabled": True}}},
         "cannot be used with colocated.kvPull"),
        ({"colocated": {"enabled": True, "kvPull": {"enabled": True}}, "gateway": {"routing": "round-robin"}},
         "colocated.kvPull needs gateway.routing kv"),
    ],
)
def test_render_refuses_inconsistent_values(values, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        render_values(values)


@modes
def test_probes_ask_the_real_health_service_on_the_bound_port(rendered, mode):
    for _pod, container, _env, args in service_containers(rendered[mode]):
        port = int(flag_value(args, "--port"))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": port, "service": SERVICE_NAMES[container["name"]]}, probe
        ports_by_name = {p["name"].removeprefix("pre-"): p["containerPort"] for p in container["ports"]}
        expected = {"grpc": port, "metrics": int(flag_value(args, "--metrics-port"))}
        if container["name"] == "gateway":  # and its OpenAI-compatible HTTP API
            expected["http"] = int(flag_value(args, "--http-port"))
        assert ports_by_name == expected


@modes
def test_every_container_sets_resources(rendered, mode):
    for pod in pod_templates(rendered[mode]):
        for container in [*pod.init_containers, *pod.containers]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), (pod.workload, container["name"])
            assert "memory" in resources["limits"], (pod.workload, container["name"])


@modes
def test_grace_period_exceeds_drain_exceeds_prestop(rendered, mode):
    for pod, container, _env, args in service_containers(rendered[mode]):
        pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        drain_s = float(flag_value(args, "--grace-period-s"))
        grace_s = pod.spec["terminationGracePeriodSeconds"]
        assert pre_stop_s < drain_s < grace_s, container["name"]
        assert pre_stop_s + drain_s < grace_s, container["name"]


@modes
def test_startup_probe_outlasts_the_slowest_start(rendered, mode):
    with helm.Chart.load(CHART_DIR) as chart:
        values = chart.merge_values(mode_values(mode))
    for _pod, container, _env, args in service_containers(rendered[mode]):
        name = container["name"]
        timeout_s = values[name]["startupTimeoutSeconds"]
        probe = container["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= timeout_s
        if name == "gateway":
            assert timeout_s > float(flag_value(args, "--downstream-ready-timeout-s"))


@modes
def test_autoscalers_target_deployments_that_exist(rendered, mode):
    docs = rendered[mode]
    deployments = {doc["metadata"]["name"] for doc in of_kind(docs, "Deployment")}
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
        assert target["name"] in deployments
        assert "replicas" not in named(docs, "Deployment", target["name"])["spec"], "the HPA owns replicas"


def _pods_behind(docs: list[dict], selector: dict[str, str]) -> list[PodTemplate]:
    return [pod for pod in pod_templates(docs) if selects(selector, pod.labels)]


@modes
def test_services_select_pods_whose_ports_they_name(rendered, mode):
    docs = rendered[mode]
    for service in of_kind(docs, "Service"):
        pods = _pods_behind(docs, service["spec"]["selector"])
        assert pods, f"{service['metadata']['name']} selects no pod"
        for pod in pods:
            named_ports = {p["name"]: p["containerPort"] for c in pod.containers for p in c.get("ports", [])}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in named_ports, (service["metadata"]["name"], port)


@modes
def test_disruption_budgets_and_network_policies_select_pods(rendered, mode):
    docs = rendered[mode]
    for doc in [*of_kind(docs, "PodDisruptionBudget"), *of_kind(docs, "NetworkPolicy")]:
        selector = doc["spec"].get("selector", doc["spec"].get("podSelector"))["matchLabels"]
        assert _pods_behind(docs, selector), doc["metadata"]["name"]


@modes
def test_gateway_finds_replicas_through_the_headless_service(rendered, mode):
    docs = rendered[mode]
    [(_pod, _gateway, _env, args)] = [c for c in service_containers(docs) if c[1]["name"] == "gateway"]
    target = flag_value(args, "--inference")
    host, port = target.removeprefix("dns:///").rsplit(":", 1)
    assert target.startswith("dns:///") and host.endswith(f".{NAMESPACE}.svc")
    service = named(docs, "Service", host.split(".")[0])
    assert service["spec"]["clusterIP"] == "None"
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    assert any(c["name"] == "inference" for pod in _pods_behind(docs, service["spec"]["selector"]) for c in pod.containers)
    preprocess_target = flag_value(args, "--preprocess")
    assert preprocess_target.startswith("dns:///"), "the gateway balances over every preprocess pod"
    preprocess_host, preprocess_port = preprocess_target.removeprefix("dns:///").rsplit(":", 1)
    preprocess = named(docs, "Service", preprocess_host.split(".")[0])
    assert preprocess["spec"]["clusterIP"] == "None"
    assert int(preprocess_port) in {p["port"] for p in preprocess["spec"]["ports"]}


@modes
def test_gateway_connections_age_so_added_pods_get_clients(rendered, mode):
    [(_pod, _gateway, _env, args)] = [c for c in service_containers(rendered[mode]) if c[1]["name"] == "gateway"]
    parsed = PARSERS["gateway"](args)
    assert parsed.max_connection_age_s == 300.0  # values.yaml's gateway.maxConnectionAgeSeconds


@modes
def test_args_parse_with_the_services_own_parsers(rendered, mode):
    for _pod, container, _env, args in service_containers(rendered[mode]):
        assert not [arg for arg in args if "$(" in arg], "every $(VAR) is defined"
        PARSERS[container["name"]](args)


@modes
def test_preprocess_and_inference_agree_on_blocks_and_buckets(rendered, mode):
    args = {c["name"]: a for _pod, c, _env, a in service_containers(rendered[mode])}
    assert flag_value(args["preprocess"], "--block-size") == flag_value(args["inference"], "--block-size")
    assert flag_value(args["preprocess"], "--length-buckets") == flag_value(args["inference"], "--length-buckets")


@modes
def test_only_the_gateway_is_open_to_everyone(rendered, mode):
    policies = of_kind(rendered[mode], "NetworkPolicy")
    open_ports = [
        (policy["metadata"]["name"], port["port"])
        for policy in policies
        for rule in policy["spec"]["ingress"]
        if "from" not in rule
        for port in rule["ports"]
    ]
    assert open_ports == [("rel-llmserve-gateway", 50051), ("rel-llmserve-gateway", 8000)]  # gRPC, HTTP


def test_the_gateways_http_api_is_on_its_public_service_and_can_be_turned_off(rendered):
    service = named(rendered["default"], "Service", "rel-llmserve-gateway")
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        ("grpc", 50051, "grpc"), ("http", 8000, "http"),
    ]  # fmt: skip
    docs = render_values(merge_values(mode_values("default"), {"gateway": {"httpPort": None}}))
    gateway = next(pod for pod in pod_templates(docs) if pod.workload.endswith("-gateway")).container("gateway")
    assert "--http-port" not in gateway["args"] and "http" not in {p["name"] for p in gateway["ports"]}
    assert [p["name"] for p in named(docs, "Service", "rel-llmserve-gateway")["spec"]["ports"]] == ["grpc"]


def test_gateway_pods_are_listed_by_a_headless_service_for_clients_that_spread_calls(rendered):
    """gateway.headlessService (on by default): every gateway pod's gRPC port behind one DNS name,
    what a round_robin client spreads its calls over; off, no such Service."""
    service = named(rendered["default"], "Service", "rel-llmserve-gateway-pods")
    assert service["spec"]["clusterIP"] == "None"
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [("grpc", 50051, "grpc")]
    assert [pod.workload for pod in _pods_behind(rendered["default"], service["spec"]["selector"])] == ["rel-llmserve-gateway"]
    docs = render_values(merge_values(mode_values("default"), {"gateway": {"headlessService": False}}))
    assert "rel-llmserve-gateway-pods" not in {s["metadata"]["name"] for s in of_kind(docs, "Service")}


def test_inference_gets_a_gpu_by_default(rendered):
    pod = next(pod for pod in pod_templates(rendered["default"]) if pod.workload.endswith("-inference"))
    inference = pod.container("inference")
    assert inference["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert flag_value(inference["args"], "--device") == "cuda"
    assert pod.spec["nodeSelector"] and pod.spec["tolerations"]


def test_cpu_values_need_no_gpu(rendered):
    pod = next(pod for pod in pod_templates(rendered["cpu"]) if pod.workload.endswith("-inference"))
    inference = pod.container("inference")
    assert "nvidia.com/gpu" not in inference["resources"]["limits"]
    assert flag_value(inference["args"], "--device") == "cpu"
    assert "nodeSelector" not in pod.spec and "tolerations" not in pod.spec


@pytest.mark.parametrize(("mode", "size", "gpus"), [("tensor-parallel", 4, 4), ("cpu-tensor-parallel", 3, None)])
def test_a_tensor_parallel_replica_is_one_pod_with_its_gpus_and_a_memory_shm(rendered, mode, size, gpus):
    (pod,) = [pod for pod in pod_templates(rendered[mode]) if pod.workload.endswith("-inference")]
    inference = pod.container("inference")
    (args,) = [args for _pod, container, _env, args in service_containers(rendered[mode]) if container is inference]
    assert parse_inference_args(args).tensor_parallel_size == size
    assert inference["resources"]["limits"].get("nvidia.com/gpu") == gpus
    (shm,) = [v for v in pod.spec["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in inference["volumeMounts"]


def test_one_process_replicas_get_no_split_and_no_shm(rendered):
    (pod,) = [pod for pod in pod_templates(rendered["default"]) if pod.workload.endswith("-inference")]
    assert "--tensor-parallel-size" not in pod.container("inference")["args"]
    assert "shm" not in {v["name"] for v in pod.spec["volumes"]}


def test_colocated_pod_shares_processes_and_a_memory_shm(rendered):
    docs = rendered["colocated"]
    assert not [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-preprocess")]
    (pod,) = [pod for pod in pod_templates(docs) if pod.workload.endswith("-inference")]
    assert {c["name"] for c in pod.containers} == {"inference", "preprocess"}
    assert pod.spec["shareProcessNamespace"] is True
    (shm,) = [v for v in pod.spec["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    ports = [p["containerPort"] for c in pod.containers for p in c["ports"]]
    assert len(ports) == len(set(ports)), "containers of one pod share its network namespace"
    for container in pod.containers:
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    preprocess_service = named(docs, "Service", "rel-llmserve-preprocess")
    assert _pods_behind(docs, preprocess_service["spec"]["selector"]) == [pod]


def test_colocated_kv_pull_puts_the_replicas_on_one_node_sharing_its_shm_and_ipc(rendered):
    docs = rendered["colocated-kv-pull"]
    (pod,) = [pod for pod in pod_templates(docs) if pod.workload.endswith("-inference")]
    assert pod.spec["hostIPC"] is True  # CUDA IPC across the replicas' pods
    (shm,) = [v for v in pod.spec["volumes"] if v["name"] == "shm"]
    assert shm == {"name": "shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}}  # one tmpfs for all pods
    for container in pod.containers:
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    (term,) = pod.spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and selects(term["labelSelector"]["matchLabels"], pod.labels)
    args = {c["name"]: a for _pod, c, _env, a in service_containers(docs)}
    assert "--kv-pull" in args["inference"] and "--routing-kv-pull" in args["gateway"]
    for mode in ("default", "colocated", "cpu-colocated"):
        assert all("--kv-pull" not in a and "--routing-kv-pull" not in a for *_, a in service_containers(rendered[mode]))
        assert all("hostIPC" not in pod.spec for pod in pod_templates(rendered[mode]))


def test_redis_urls_reach_every_service_that_takes_one(rendered):
    for mode, expected in [("default", "rel-llmserve-redis"), ("external-redis", "redis.example.internal"),
                           ("external-redis-secret", "redis://r:6379")]:
        args = {c["name"]: a for _pod, c, _env, a in service_containers(rendered[mode])}
        assert {name: expected in flag_value(a, "--redis-url") for name, a in args.items()} == dict.fromkeys(args, True)
    for _pod, _container, _env, args in service_containers(rendered["no-redis"]):
        assert "--redis-url" not in args


def test_service_monitor_scrapes_every_stage(rendered):
    docs = rendered["observed"]
    (monitor,) = of_kind(docs, "ServiceMonitor")
    scraped = [s for s in of_kind(docs, "Service") if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    components = {pod.labels["app.kubernetes.io/component"] for s in scraped for pod in _pods_behind(docs, s["spec"]["selector"])}
    assert components == {"gateway", "preprocess", "inference"}
    assert all(any(p["name"] == "metrics" for p in s["spec"]["ports"]) for s in scraped)
    (gateway_hpa,) = [h for h in of_kind(docs, "HorizontalPodAutoscaler") if h["metadata"]["name"].endswith("-gateway")]
    assert gateway_hpa["spec"]["metrics"][1]["pods"]["metric"]["name"] == "llmserve_gateway_streams_in_flight"
