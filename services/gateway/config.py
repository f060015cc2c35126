"""Gateway configuration: built once by __main__ from flags and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmserve.config_checks import check_at_least
from llmserve.gateway.connection_age import DEFAULT_MAX_CONNECTION_AGE_S
from llmserve.gateway.discovery import DEFAULT_RESOLVE_INTERVAL_S, Target
from llmserve.gateway.local_preprocess import LocalPreprocessConfig
from llmserve.gateway.router import RoutingConfig
from llmserve.gateway.slow_reader import SlowReaderBounds
from llmserve.gateway.stream_interval import StreamInterval, check_stream_interval
from llmserve.gateway.worker_ports import check_worker_ports
from llmserve.prefix_index.redis_config import RedisIndexConfig
from llmserve.observability import ObservabilityConfig
from llmserve.server_flags import DEFAULT_GRACE_PERIOD_S, DEFAULT_HOST, GATEWAY_PORT

# How long to wait at start for preprocess and inference to report SERVING (they may still be
# loading weights).
DEFAULT_DOWNSTREAM_READY_TIMEOUT_S = 600.0

# bench/bench_accept.py: a burst of 64 new streams on a loop busy in 2-5 ms slices waited a median
# 340-829 ms for its handlers with one accept loop, 0.27-0.32x of that with 4 (3 runs); the last
# stream's wait did not fall, and 8 loops at 5 ms slices were slower than one.
DEFAULT_ACCEPT_LOOPS = 4

# Prompts of at least this many tokens have their ids put in preprocess's shared-memory ring,
# where preprocess shares /dev/shm with this gateway. Measured (docs/benchmarks.md, "Prompt
# token ids"): the ring costs the three processes' own work 1.2x the bytes' at 2k tokens and
# breaks even at ~16k, but spares both hops' gRPC the bytes (~0.65 ns a byte a hop on loopback
# by the fastest round trips, more at the medians), so in all it breaks even at 2k tokens or
# below; twice that, to be clear of it.
DEFAULT_PROMPT_IDS_REGION_FROM = 4096


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    preprocess_targets: tuple[Target, ...]  # preprocess servers: host:port or dns:///name:port (discovery)
    inference_targets: tuple[Target, ...]  # inference replicas: host:port or dns:///name:port (discovery)
    model_path: Path  # checkpoint dir whose tokenizer.json detokenizes the output
    model_name: str | None = None  # None: the name the inference replica reports
    host: str = DEFAULT_HOST
    port: int = GATEWAY_PORT  # 0 = any free port
    port_file: str | None = None
    # The OpenAI-compatible HTTP API's port (openai_http.py): None off, 0 any free port.
    http_port: int | None = None
    log_level: str = "INFO"
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    observability: ObservabilityConfig = ObservabilityConfig()  # metrics endpoint, log format
    downstream_ready_timeout_s: float = DEFAULT_DOWNSTREAM_READY_TIMEOUT_S
    # Gateway processes sharing the port (SO_REUSEPORT); 1 serves in the gateway process itself.
    num_workers: int = 1
    # Each worker's own port besides the shared one, worker i on this + i (0: free ports), so a
    # client can spread calls over the workers (worker_ports.py); None: none.
    worker_base_port: int | None = None
    worker_ports_file: str | None = None  # where the workers' own ports are written
    # After this long a client connection is asked to go (GOAWAY; its streams in flight finish)
    # and the client's next call connects again, wherever the kernel or a load balancer puts
    # it now (connection_age.py). 0: never.
    max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S
    # gRPC servers per gateway process on the port, each accepting its connections' new RPCs
    # (llmserve.server.create_server: grpc's asyncio server accepts one RPC at a time).
    num_accept_loops: int = DEFAULT_ACCEPT_LOOPS
    # When a stream's client counts as not reading and its request is aborted.
    slow_readers: SlowReaderBounds = SlowReaderBounds()
    # Least time between two messages of one client stream while the worker is busy (stream_interval.py).
    stream_interval: StreamInterval = StreamInterval()
    routing: RoutingConfig = RoutingConfig()
    # Small prompts at light load preprocessed in the gateway itself (local_preprocess.py).
    local_preprocess: LocalPreprocessConfig = LocalPreprocessConfig()
    # Seconds between DNS resolutions of dns:/// targets (preprocess and inference).
    resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S
    # Asked of each replica's WatchKvEvents; 0: the replica's default.
    heartbeat_interval_ms: int = 0
    # None: the prefix index lives in this process, fed by every replica's events. Set: the
    # index is in this Redis (written by the replicas), and this process only reads and sweeps it.
    redis: RedisIndexConfig | None = None
    # Seconds between sweeps of replicas whose liveness key expired (Redis only).
    sweep_interval_s: float = 1.0
    # Prompts of at least this many tokens travel by reference in preprocess's shared-memory
    # ring to replicas on its host, where it shares /dev/shm with this gateway; 0: never.
    prompt_ids_region_from: int = DEFAULT_PROMPT_IDS_REGION_FROM

    def __post_init__(self) -> None:
        if not self.preprocess_targets:
            raise ValueError("at least one preprocess address is required")
        if not self.inference_targets:
            raise ValueError("at least one inference address is required")
        check_at_least("grace_period_s", self.grace_period_s, 0)
        check_at_least("prompt_ids_region_from", self.prompt_ids_region_from, 0)
        check_at_least("num_workers", self.num_workers, 1)
        check_worker_ports(self.worker_base_port, self.num_workers, self.port, self.worker_ports_file)
        check_stream_interval(self.stream_interval, self.slow_readers.max_unread_s)
        check_at_least("max_connection_age_s", self.max_connection_age_s, 0)
        check_at_least("num_accept_loops", self.num_accept_loops, 1)
        if self.http_port == 0 and self.num_workers > 1:
            raise ValueError("--http-port 0 picks a port per worker: give a port to share with --workers > 1")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
