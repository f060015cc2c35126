"""Inference service configuration: built once by `__main__` from flags and passed down."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.inference.engine.config import EngineConfig
from llmserve.prefix_index.redis_config import RedisIndexConfig
from llmserve.observability import ObservabilityConfig
from llmserve.server_flags import DEFAULT_GRACE_PERIOD_S, DEFAULT_HOST

DEFAULT_KV_EVENTS_HEARTBEAT_MS = 500
# Bounds of a WatchKvEvents heartbeat interval (the flag's and a subscriber's): below, the
# heartbeats alone would keep the event loop busy; above, a dead replica stays routed too long.
KV_EVENTS_HEARTBEAT_MS_RANGE = (10, 600_000)


@dataclass(frozen=True, slots=True)
class InferenceConfig:
    engine: EngineConfig
    host: str = DEFAULT_HOST
    port: int = 0  # 0: any free port
    port_file: str | None = None  # written with the bound port once the engine is loaded
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    observability: ObservabilityConfig = ObservabilityConfig()  # metrics endpoint, log format
    # Stable routing key of this replica. None: "<hostname>-<bound port>", resolved at start-up
    # (the bound port is only known then), so it is set on the KvEventLog, not stored here.
    replica_id: str | None = None
    # WatchKvEvents heartbeat interval for subscribers that ask for none.
    kv_events_heartbeat_ms: int = DEFAULT_KV_EVENTS_HEARTBEAT_MS
    # Set: this replica publishes its KV events to the Redis routing index (docs/routing.md).
    redis: RedisIndexConfig | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must not be negative, got {self.grace_period_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        low, high = KV_EVENTS_HEARTBEAT_MS_RANGE
        if not low <= self.kv_events_heartbeat_ms <= high:
            raise ValueError(f"kv_events_heartbeat_ms must be in [{low}, {high}], got {self.kv_events_heartbeat_ms}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
