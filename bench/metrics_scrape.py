"""What a service's /metrics endpoint serves now, parsed: the one scrape the benches share."""

from __future__ import annotations

import urllib.request

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 10.0


def metric_families(metrics_port: int) -> list[Metric]:
    """Every metric family of the endpoint on 127.0.0.1:`metrics_port`."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        return list(text_string_to_metric_families(response.read().decode("utf-8")))


def sample_totals(metrics_port: int) -> dict[str, float]:
    """Each sample name's value summed over its label sets (a gateway's workers, a histogram's
    phases): histograms' `_sum` and `_count`, counters' `_total`."""
    totals: dict[str, float] = {}
    for family in metric_families(metrics_port):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals
