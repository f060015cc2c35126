"""The Helm chart (deploy/helm/llmserve) rendered offline, and its manifests read as the kubelet reads them.

`render(mode)` renders with a documented mode's values through helm-python-sdk (Helm v4 as a
library: no helm binary, no cluster) and returns the parsed documents. `container_env` and
`expand` resolve a container's environment and its `$(VAR)` references the way the kubelet
does, so the args seen here are the args a pod runs.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART_DIR = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "llmserve"
RELEASE = "rel"
NAMESPACE = "llm"

# Every documented mode: its values files (applied in order, as `-f a -f b`) and --set-like overrides.
MODES: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "default": ((), {}),
    "cpu": (("values-cpu.yaml",), {}),
    "colocated": (("values-colocated.yaml",), {}),
    "external-redis": (("values-external-redis.yaml",), {}),
    "external-redis-secret": (
        ("values-external-redis.yaml",),
        {"redis": {"external": {"routingUrl": "", "promptCacheUrl": "", "existingSecret": "redis-urls"}}},
    ),
    "no-redis": ((), {"redis": {"mode": "none"}}),
    "observed": ((), {
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "gateway": {"autoscaling": {"customMetric": {"enabled": True}}},
    }),
    "model-pvc": ((), {"model": {"volume": {"type": "pvc", "pvc": {"claimName": "models"}}, "fetch": {"enabled": False}}}),
    "model-hostpath": ((), {"model": {"volume": {"type": "hostPath", "hostPath": {"path": "/var/lib/llmserve"}}}}),
    "cpu-colocated": (("values-cpu.yaml", "values-colocated.yaml"), {}),
    # One replica on 4 GPUs of a pod (docs/parallelism.md); on CPU, 3 gloo ranks (the default
    # model's 9 heads and 3 KV heads split 3 ways).
    "tensor-parallel": ((), {"inference": {"gpus": 4, "tensorParallel": {"size": 4}}}),
    "cpu-tensor-parallel": (("values-cpu.yaml",), {"inference": {"tensorParallel": {"size": 3}}}),
    "colocated-kv-pull": (("values-colocated.yaml",), {"colocated": {"kvPull": {"enabled": True}}}),
}


def merge_values(base: dict, override: dict) -> dict:
    """Helm's merge of -f files and --set: maps merge key by key, anything else replaces."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def mode_values(mode: str) -> dict:
    files, overrides = MODES[mode]
    values: dict = {}
    for name in files:
        values = merge_values(values, helm.values_from_yaml((CHART_DIR / name).read_text()))
    return merge_values(values, overrides)


def render_values(values: dict) -> list[dict]:
    """Every manifest the chart renders with `values` (NOTES.txt and empty documents left out)."""
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return [
        doc
        for path, text in sorted(rendered.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def render(mode: str) -> list[dict]:
    return render_values(mode_values(mode))


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [doc for doc in of_kind(docs, kind) if doc["metadata"]["name"] == name]
    return doc


@dataclass(frozen=True)
class PodTemplate:
    """One workload's pod: what a Deployment or StatefulSet would start."""

    workload: str
    labels: dict[str, str]
    spec: dict

    @property
    def containers(self) -> list[dict]:
        return self.spec["containers"]

    @property
    def init_containers(self) -> list[dict]:
        return self.spec.get("initContainers", [])

    def container(self, name: str) -> dict:
        (container,) = [c for c in self.containers if c["name"] == name]
        return container


def pod_templates(docs: list[dict]) -> list[PodTemplate]:
    return [
        PodTemplate(doc["metadata"]["name"], doc["spec"]["template"]["metadata"]["labels"], doc["spec"]["template"]["spec"])
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet")
    ]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def container_env(container: dict, docs: list[dict], *, pod_name: str, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env (which wins).

    ConfigMaps come from the rendered manifests; Secrets (never rendered by the chart) from
    `secrets`; the only fieldRef the chart uses is the pod name.
    """
    configmaps = {doc["metadata"]["name"]: doc.get("data", {}) for doc in of_kind(docs, "ConfigMap")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "configMapKeyRef" in ref:
            env[var["name"]] = configmaps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref:
            env[var["name"]] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        elif ref.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = pod_name
        else:
            raise AssertionError(f"{container['name']}: env {var['name']} has a source this check does not know: {ref}")
    return env


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined VAR is replaced, an undefined one kept, $$ is $."""
    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REF.sub(replace, text)


def expanded_args(container: dict, env: dict[str, str]) -> list[str]:
    return [expand(arg, env) for arg in container.get("args", [])]


def flag_value(args: list[str], flag: str) -> str:
    """The value after `flag` (written as two tokens, as the chart writes every flag)."""
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == flag]
    assert len(values) == 1, f"{flag} appears {len(values)} times in {args}"
    return values[0]
