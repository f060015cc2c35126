"""deploy/grafana/llmserve.json is a valid dashboard that charts the metrics of docs/observability.md.

The metric names and labels are read from the doc's tables, so a metric renamed there (or on the
dashboard alone) fails here; so does a metric in the doc that no panel charts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = REPO_ROOT / "deploy/grafana/llmserve.json"
OBSERVABILITY_DOC = REPO_ROOT / "docs/observability.md"
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
# Labels every scraped series has (Prometheus and its Kubernetes discovery), and histograms' le.
TARGET_LABELS = {"instance", "job", "namespace", "pod", "le"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
SELECTOR = '{namespace=~"$namespace", job=~"$job"}'
PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
}
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


@dataclass(frozen=True)
class DocumentedMetric:
    name: str
    type: str  # counter, gauge or histogram
    labels: frozenset[str]

    def series(self) -> set[str]:
        """The series names Prometheus stores for it."""
        if self.type == "histogram":
            return {self.name + suffix for suffix in HISTOGRAM_SERIES}
        return {self.name}


def documented_metrics(doc: str) -> dict[str, DocumentedMetric]:
    """The rows of the doc's metric tables: | `name` | type | labels | what |."""
    metrics = {}
    for line in doc.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`llmserve_\w+`", cells[0]):
            name = cells[0].strip("`")
            labels = frozenset(re.findall(r"`(\w+)`", cells[2]))
            metrics[name] = DocumentedMetric(name, cells[1], labels)
    return metrics


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads: identifiers outside strings, selectors, ranges and
    groupings that are neither a function call nor a keyword."""
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = GROUPING.sub(" ", bare)
    identifiers = re.findall(r"(?<![\w.])([a-zA-Z_:][\w:]*)\s*(\(?)", bare)
    return {name for name, call in identifiers if not call and name not in PROMQL_KEYWORDS}


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for labels in GROUPING.findall(expr) for label in labels.split(",") if label.strip()}


def series_by_name(metrics: dict[str, DocumentedMetric]) -> dict[str, DocumentedMetric]:
    return {series: metric for metric in metrics.values() for series in metric.series()}


def undocumented(expr: str, metrics: dict[str, DocumentedMetric]) -> set[str]:
    return metric_names(expr) - set(series_by_name(metrics))


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def metrics() -> dict[str, DocumentedMetric]:
    found = documented_metrics(OBSERVABILITY_DOC.read_text())
    assert len(found) >= 30, "the doc's metric tables were not found: has their layout changed?"
    return found


def charts(dashboard: dict) -> list[dict]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def targets(dashboard: dict) -> list[dict]:
    return [target for panel in charts(dashboard) for target in panel["targets"]]


def test_it_is_a_dashboard_with_unique_ids_and_a_non_overlapping_grid(dashboard):
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & area, f"{panel['title']} overlaps another panel"
        cells |= area


def test_every_chart_queries_the_datasource_variable(dashboard):
    [datasource] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert datasource["query"] == "prometheus"
    uid = f"${{{datasource['name']}}}"
    for panel in charts(dashboard):
        assert panel["targets"], f"{panel['title']} has no query"
        assert panel["datasource"]["uid"] == uid
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == uid, panel["title"]


def test_every_series_is_filtered_by_the_namespace_and_job_variables(dashboard):
    names = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert {"namespace", "job"} <= names
    for target in targets(dashboard):
        expr = target["expr"]
        used = set(re.findall(r"\$\{?(\w+)", expr))
        assert used <= names | GRAFANA_BUILTINS, expr
        for name in metric_names(expr):
            assert re.search(re.escape(name + SELECTOR), expr), f"{name} is not filtered by {SELECTOR}: {expr}"


def test_every_metric_charted_is_documented(dashboard, metrics):
    for target in targets(dashboard):
        assert metric_names(target["expr"]), target["expr"]
        assert not undocumented(target["expr"], metrics), f"not in docs/observability.md: {target['expr']}"


def test_the_check_catches_a_renamed_metric(metrics):
    """The test above can fail: a name the doc does not list, or a histogram read without its suffix."""
    renamed = 'sum(rate(llmserve_gateway_request_total{job=~"$job"}[5m]))'
    assert undocumented(renamed, metrics) == {"llmserve_gateway_request_total"}
    bare_histogram = "histogram_quantile(0.9, sum by (le) (rate(llmserve_inference_step_duration_seconds[5m])))"
    assert undocumented(bare_histogram, metrics) == {"llmserve_inference_step_duration_seconds"}


def test_grouping_and_legend_labels_are_labels_of_the_metrics_queried(dashboard, metrics):
    series = series_by_name(metrics)
    for target in targets(dashboard):
        queried = [series[name] for name in metric_names(target["expr"]) if name in series]
        known = TARGET_LABELS.union(*(metric.labels for metric in queried))
        used = grouping_labels(target["expr"]) | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"]))
        assert used <= known, f"{target['legendFormat']!r}, {target['expr']}"


def test_every_documented_metric_is_on_the_dashboard(dashboard, metrics):
    charted = set().union(*(metric_names(target["expr"]) for target in targets(dashboard)))
    missing = [name for name, metric in metrics.items() if not metric.series() & charted]
    assert not missing, f"documented in docs/observability.md but on no panel of {DASHBOARD.name}: {missing}"
