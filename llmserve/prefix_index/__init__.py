"""The routing index: which replica holds which prefix blocks (docs/routing.md).

One interface (PrefixIndex), two backends: MemoryPrefixIndex (embedded in a gateway, fed by
its WatchKvEvents subscriptions) and RedisPrefixIndex (shared by gateways, written by each
replica's RedisPublisher).
"""

from llmserve.prefix_index.interface import ApplyOutcome, PrefixIndex, PrefixMatches
from llmserve.prefix_index.memory import MemoryPrefixIndex

__all__ = ["ApplyOutcome", "MemoryPrefixIndex", "PrefixIndex", "PrefixMatches"]
