"""The routing index: which replica holds which prefix blocks (docs/routing.md).

One interface (PrefixIndex), two backends: MemoryPrefixIndex (embedded in a gateway, fed by
its WatchKvEvents subscriptions) and RedisPrefixIndex (shared by gateways, written by each
replica's RedisPublisher). The Redis ones live in their own modules, imported only where
`--redis-url` is set: redis-py is an optional dependency (`pip install llmserve[redis]`).
"""

from llmserve.prefix_index.interface import ApplyOutcome, PrefixIndex, PrefixMatches
from llmserve.prefix_index.memory import MemoryPrefixIndex

__all__ = ["ApplyOutcome", "MemoryPrefixIndex", "PrefixIndex", "PrefixMatches"]
