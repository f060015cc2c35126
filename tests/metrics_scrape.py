"""Scrape a service's /metrics over HTTP, as Prometheus would, for the metrics tests."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Scrape:
    """Every sample of one scrape: (sample name, sorted label pairs) → value."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    types: dict[str, str]  # metric family name → its type

    def value(self, name: str, **labels: str) -> float:
        """The sample's value; 0 for a labelled child not created yet (as Prometheus treats it)."""
        key = (name, tuple(sorted(labels.items())))
        if key not in self.samples and not labels:
            raise KeyError(f"{name} is not exported")
        return self.samples.get(key, 0.0)

    def delta(self, before: "Scrape", name: str, **labels: str) -> float:
        return self.value(name, **labels) - before.value(name, **labels)


def scrape(where: int | str) -> Scrape:
    """`where`: a metrics port on 127.0.0.1, or the endpoint's URL."""
    url = where if isinstance(where, str) else f"http://127.0.0.1:{where}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        text = response.read().decode("utf-8")
    samples, types = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return Scrape(samples, types)
