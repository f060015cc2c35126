"""Defaults of the routing index that flags and configs share (importable without redis-py)."""

# A replica whose batches carry no TTL is considered gone after this long without one.
DEFAULT_HEARTBEAT_TTL_MS = 10_000
# The Redis keys' prefix; the braces are a Redis Cluster hash tag (every key on one slot).
DEFAULT_REDIS_KEY_PREFIX = "{llmserve-routing}"
# Bound on every Redis call; a local Redis answers in well under a millisecond.
DEFAULT_REDIS_TIMEOUT_MS = 50
