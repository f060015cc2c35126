"""What a service shows an operator: where its Prometheus metrics are served and how it logs.

Built once from the flags every service takes (llmserve.server_flags) and passed down in each
service's config. Metric names and the log format are documented in docs/observability.md.
"""

from __future__ import annotations

from dataclasses import dataclass

LOG_FORMATS = ("text", "json")


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    # Port of the HTTP /metrics endpoint (Prometheus text format); None: no endpoint; 0: any free port.
    metrics_port: int | None = None
    # "json": one JSON object per line, for log collectors; "text": one readable line.
    log_format: str = "text"
    # Prompt and completion text appear in logs only when asked: they may hold personal data.
    log_prompts: bool = False

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
