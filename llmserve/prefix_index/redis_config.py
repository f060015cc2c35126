"""Where the Redis routing index lives, and its flags, shared by the gateway and inference.

Importable without redis-py (only the modules that talk to Redis need it).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# A replica whose batches carry no TTL is considered gone after this long without one.
DEFAULT_HEARTBEAT_TTL_MS = 10_000
# The keys' prefix; the braces are a Redis Cluster hash tag (every key, so every script, on one slot).
DEFAULT_REDIS_KEY_PREFIX = "{llmserve-routing}"
# Bound on every Redis call; a local Redis answers in well under a millisecond.
DEFAULT_REDIS_TIMEOUT_MS = 50


@dataclass(frozen=True, slots=True)
class RedisIndexConfig:
    url: str  # redis://host:port/db
    key_prefix: str = DEFAULT_REDIS_KEY_PREFIX
    timeout_ms: int = DEFAULT_REDIS_TIMEOUT_MS

    def __post_init__(self) -> None:
        if self.timeout_ms <= 0:
            raise ValueError(f"redis timeout must be a positive number of milliseconds, got {self.timeout_ms}")


def add_redis_arguments(group: argparse._ArgumentGroup, url_help: str) -> None:
    group.add_argument("--redis-url", metavar="URL", help=url_help)
    group.add_argument(
        "--redis-timeout-ms", type=int, default=DEFAULT_REDIS_TIMEOUT_MS, metavar="MS",
        help="bound on every Redis call of the routing index; a slower or absent Redis makes routing "
        "load-only and never fails a request (default: %(default)s)",
    )
    group.add_argument(
        "--redis-key-prefix", default=DEFAULT_REDIS_KEY_PREFIX, metavar="PREFIX",
        help="prefix of the routing index's Redis keys, the same on every replica and gateway; never one "
        "an evictable cache uses (default: %(default)s)",
    )


def redis_config_from_args(args: argparse.Namespace) -> RedisIndexConfig | None:
    """None when --redis-url is unset."""
    if not args.redis_url:
        return None
    return RedisIndexConfig(args.redis_url, args.redis_key_prefix, args.redis_timeout_ms)
