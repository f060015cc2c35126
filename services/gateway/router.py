"""Router: which live replica serves a request (docs/routing.md, "Scoring").

Policies (`--routing`):
  - kv (default): look the prompt's block hashes up in the prefix index (in memory: no I/O;
    Redis: one round trip, bounded by its timeout), then, among the replicas whose load is
    within the imbalance bound, take the one holding the longest prefix; ties and a prompt
    the index knows nothing of go to the least loaded.
  - least-loaded: the replica with the fewest requests (KV in use breaks ties).
  - round-robin: each replica in turn.

Each decision says why (RouteReason; a kv fallback also says why it fell back, FallbackCause),
which the routing metrics count.

The imbalance bound keeps the replica that holds a popular prompt from becoming a hot spot: a
replica is eligible only while its load ≤ max(least load × load_ratio, least load +
load_slack). Past that, recomputing the prefix elsewhere is cheaper than queueing behind it.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

from llmserve.errors import Unavailable
from llmserve.gateway.metrics import record_route
from llmserve.gateway.preprocess_client import PreparedPrompt
from llmserve.gateway.replica import Replica
from llmserve.prefix_index import PrefixIndex

DEFAULT_LOAD_RATIO = 1.5
DEFAULT_LOAD_SLACK = 4  # requests


class RoutingPolicy(enum.Enum):
    KV = "kv"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    policy: RoutingPolicy = RoutingPolicy.KV
    load_ratio: float = DEFAULT_LOAD_RATIO
    load_slack: int = DEFAULT_LOAD_SLACK

    def __post_init__(self) -> None:
        if self.load_ratio < 1:
            raise ValueError(f"routing load ratio must be >= 1, got {self.load_ratio}")
        if self.load_slack < 0:
            raise ValueError(f"routing load slack must be >= 0, got {self.load_slack}")


class RouteReason(enum.Enum):
    PREFIX = "prefix"  # kv: the replica within the load bound holding the longest prefix
    FALLBACK = "fallback"  # kv: no replica within the bound holds any of the prompt; least loaded
    LOAD = "load"  # least-loaded, or kv with one live replica (nothing to look up)
    ROUND_ROBIN = "round_robin"


class FallbackCause(enum.Enum):
    NO_MATCH = "no_match"  # no live replica holds a block of the prompt (or the index did not answer)
    IMBALANCE = "imbalance"  # replicas hold some, all of them past the load bound


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: Replica
    predicted_cached_tokens: int  # what the index said the replica holds of the prompt
    reason: RouteReason
    fallback_cause: FallbackCause | None = None  # set when reason is FALLBACK


class Router:
    """`live_replicas` lists the routable replicas, in a stable order, at call time."""

    def __init__(self, config: RoutingConfig, live_replicas: Callable[[], Sequence[Replica]], index: PrefixIndex):
        self._config = config
        self._live_replicas = live_replicas
        self._index = index
        self._turns = itertools.count()  # round-robin, and the tie-break among equals

    async def choose(self, prompt: PreparedPrompt) -> RouteDecision:
        decision = await self._decide(prompt)
        cause = decision.fallback_cause.value if decision.fallback_cause is not None else None
        record_route(decision.replica.name, decision.reason.value, cause)
        return decision

    async def _decide(self, prompt: PreparedPrompt) -> RouteDecision:
        replicas = self._live_replicas()
        if not replicas:
            raise Unavailable("inference unavailable: no inference replica is live")
        if self._config.policy is RoutingPolicy.ROUND_ROBIN:
            return RouteDecision(replicas[next(self._turns) % len(replicas)], 0, RouteReason.ROUND_ROBIN)
        if self._config.policy is RoutingPolicy.LEAST_LOADED or len(replicas) == 1:
            return RouteDecision(self._least_loaded(replicas), 0, RouteReason.LOAD)
        return await self._by_prefix(replicas, prompt)

    async def _by_prefix(self, replicas: Sequence[Replica], prompt: PreparedPrompt) -> RouteDecision:
        matches = await self._index.lookup(prompt.block_hashes)
        eligible = self._within_bound(replicas)
        best = max(eligible, key=lambda replica: matches.get(replica.replica_id or "", 0))
        num_blocks = matches.get(best.replica_id or "", 0)
        if num_blocks == 0:
            is_held = any(matches.get(replica.replica_id or "", 0) for replica in replicas)
            cause = FallbackCause.IMBALANCE if is_held else FallbackCause.NO_MATCH
            return RouteDecision(self._least_loaded(replicas), 0, RouteReason.FALLBACK, cause)
        holders = [replica for replica in eligible if matches.get(replica.replica_id or "", 0) == num_blocks]
        return RouteDecision(self._least_loaded(holders), _reusable_tokens(prompt, num_blocks), RouteReason.PREFIX)

    def _within_bound(self, replicas: Sequence[Replica]) -> list[Replica]:
        least = min(replica.num_requests for replica in replicas)
        bound = max(least * self._config.load_ratio, least + self._config.load_slack)
        return [replica for replica in replicas if replica.num_requests <= bound]

    def _least_loaded(self, replicas: Sequence[Replica]) -> Replica:
        # Equals are taken in turn, so that an idle fleet still spreads its requests.
        start = next(self._turns)
        rotated = [replicas[(start + i) % len(replicas)] for i in range(len(replicas))]
        return min(rotated, key=lambda replica: replica.load_key)


def _reusable_tokens(prompt: PreparedPrompt, num_cached_blocks: int) -> int:
    """Prompt tokens a replica holding `num_cached_blocks` leading blocks can skip: the engine
    computes at least the prompt's last token, so a fully cached prompt reuses a block less."""
    block_size = prompt.block_size_tokens
    return min(num_cached_blocks, (len(prompt.token_ids) - 1) // block_size) * block_size
