"""Router: which live replica serves a request (docs/routing.md, "Scoring").

Policies (`--routing`):
  - kv (default): look the prompt's block hashes up in the prefix index (in memory: no I/O;
    Redis: one round trip, bounded by its timeout), then, among the replicas whose load is
    within the imbalance bound, take the one of least cost (below); a prompt the index knows
    nothing of goes to the least loaded.
  - least-loaded: the replica with the fewest requests (KV in use breaks ties).
  - round-robin: each replica in turn.

Each decision says why (RouteReason; a kv fallback also says why it fell back, FallbackCause),
which the routing metrics count.

The imbalance bound keeps the replica that holds a popular prompt from becoming a hot spot: a
replica is eligible only while its load ≤ max(least load × load_ratio, least load +
load_slack). Past that, recomputing the prefix elsewhere is cheaper than queueing behind it.

Cost: the blocks the replica would prefill before this request's first token: the prompt's
blocks it does not hold, plus queue_weight x those this gateway's requests there have yet to
prefill (known until each reports its first token; other gateways' queues show only in the
load), plus load_weight x its requests in flight. So a holder with a prefill queue loses to a
replica that recomputes less than that queue, and with load_weight > 0 a request whose cached
prefix is short (a system prompt) goes to a quieter replica before the bound forces one whose
prefix is long (a conversation's history) to move. Both 0: the longest cached prefix within
the bound.

KV pull (`--routing-kv-pull`, replicas co-located and started with --kv-pull; issue 22): a
replica may also take the request with a hint to pull the prefix from the replica holding the
most of it (any live one, past the bound included: that is the point), at pull_block_cost per
pulled block instead of 1 per recomputed block. Its cost is then the blocks neither holds, plus
pull_block_cost x the blocks pulled, plus its load terms, and it is weighed against its own
cost without pulling and against every other replica's (the holder's queue included). So a busy
holder's prefix moves to a quiet replica by copy, not by recompute; a cheap prefix still goes
where it is cheapest. A pull that fails on the replica recomputes (the request never fails).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

from llmserve.config_checks import check_at_least
from llmserve.errors import Unavailable
from llmserve.gateway.metrics import record_route
from llmserve.gateway.preprocess_client import PreparedPrompt
from llmserve.gateway.replica import Replica
from llmserve.prefix_index import PrefixIndex

DEFAULT_LOAD_RATIO = 1.5
DEFAULT_LOAD_SLACK = 4  # requests
# 0: at 1 the CPU routing show (tests/test_routing.py) keeps 0.72-0.80 of the conversations'
# history cached instead of >= 0.9, and on the H200 it bought a shorter tail for fewer hits and,
# on the 8B shape, less throughput (docs/benchmarks.md, runs V-Y).
DEFAULT_QUEUE_WEIGHT = 0.0
# 1 block per request in flight: spreads requests whose cached prefix is short (the CPU show's
# loads stay within 1.25x); a 128-block prefix on the H200 shapes outweighs it.
DEFAULT_LOAD_WEIGHT = 1.0
# A pulled block against a recomputed one: on the H200 a 2k-token prefix of the 8B shape (~256 MB)
# copies in a fraction of a millisecond and prefills in tens of milliseconds; on CPU a shm copy
# is also far below the prefill. 0.1 leaves room for the pin round trip on short prefixes.
DEFAULT_PULL_BLOCK_COST = 0.1


class RoutingPolicy(enum.Enum):
    KV = "kv"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    policy: RoutingPolicy = RoutingPolicy.KV
    load_ratio: float = DEFAULT_LOAD_RATIO
    load_slack: int = DEFAULT_LOAD_SLACK
    queue_weight: float = DEFAULT_QUEUE_WEIGHT
    load_weight: float = DEFAULT_LOAD_WEIGHT
    kv_pull: bool = False  # the replicas share memory (co-located, --kv-pull): pulling is an option
    pull_block_cost: float = DEFAULT_PULL_BLOCK_COST  # a pulled block, in recomputed blocks

    def __post_init__(self) -> None:
        check_at_least("routing pull block cost", self.pull_block_cost, 0)
        check_at_least("routing load weight", self.load_weight, 0)
        check_at_least("routing queue weight", self.queue_weight, 0)
        check_at_least("routing load ratio", self.load_ratio, 1)
        check_at_least("routing load slack", self.load_slack, 0)


class RouteReason(enum.Enum):
    PREFIX = "prefix"  # kv: the replica within the load bound holding the longest prefix
    FALLBACK = "fallback"  # kv: no replica within the bound holds any of the prompt; least loaded
    LOAD = "load"  # least-loaded, or kv with one live replica (nothing to look up)
    PULL = "pull"  # kv with pull: a replica that pulls the prefix from its holder (RouteDecision.pull_from)
    ROUND_ROBIN = "round_robin"


class FallbackCause(enum.Enum):
    NO_MATCH = "no_match"  # no live replica holds a block of the prompt (or the index did not answer)
    IMBALANCE = "imbalance"  # replicas hold some, all of them past the load bound


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: Replica
    predicted_cached_tokens: int  # what the index said the replica holds of the prompt
    prefill_blocks: int  # the prompt's blocks it will compute there (queued prefill until its first token)
    reason: RouteReason
    fallback_cause: FallbackCause | None = None  # set when reason is FALLBACK
    pull_from: Replica | None = None  # set when reason is PULL: the replica holding the prefix
    pull_blocks: int = 0  # the prompt's leading blocks pull_from holds (what the hint names)


class Router:
    """`live_replicas` lists the routable replicas, in a stable order, at call time."""

    def __init__(self, config: RoutingConfig, live_replicas: Callable[[], Sequence[Replica]], index: PrefixIndex):
        self._config = config
        self._live_replicas = live_replicas
        self._index = index
        self._turns = itertools.count()  # round-robin, and the tie-break among equals

    async def choose(self, prompt: PreparedPrompt, excluding: Collection[Replica] = ()) -> RouteDecision:
        """Route among the live replicas less `excluding` (those that refused this request)."""
        decision = await self._decide(prompt, self._routable(excluding))
        cause = decision.fallback_cause.value if decision.fallback_cause is not None else None
        record_route(decision.replica.name, decision.reason.value, cause)
        return decision

    def has_replica_beyond(self, excluding: Collection[Replica]) -> bool:
        return bool(self._routable(excluding))

    def _routable(self, excluding: Collection[Replica]) -> list[Replica]:
        return [replica for replica in self._live_replicas() if replica not in excluding]

    async def _decide(self, prompt: PreparedPrompt, replicas: Sequence[Replica]) -> RouteDecision:
        if not replicas:
            raise Unavailable("inference unavailable: no inference replica is live")
        if self._config.policy is RoutingPolicy.ROUND_ROBIN:
            return _uncached(prompt, replicas[next(self._turns) % len(replicas)], RouteReason.ROUND_ROBIN)
        if self._config.policy is RoutingPolicy.LEAST_LOADED or len(replicas) == 1:
            return _uncached(prompt, self._least_loaded(replicas), RouteReason.LOAD)
        return await self._by_prefix(replicas, prompt)

    async def _by_prefix(self, replicas: Sequence[Replica], prompt: PreparedPrompt) -> RouteDecision:
        matches = await self._index.lookup(prompt.block_hashes)
        held = {id(replica): _reusable_blocks(prompt, matches.get(replica.replica_id or "", 0)) for replica in replicas}
        eligible = self._within_bound(replicas)
        source = max(replicas, key=lambda replica: held[id(replica)]) if self._config.kv_pull else None
        if source is not None and not held[id(source)]:
            source = None
        if not any(held[id(replica)] for replica in eligible) and source is None:
            is_held = any(matches.get(replica.replica_id or "", 0) for replica in replicas)
            cause = FallbackCause.IMBALANCE if is_held else FallbackCause.NO_MATCH
            return _uncached(prompt, self._least_loaded(replicas), RouteReason.FALLBACK, cause)
        num_blocks = _num_blocks(prompt)
        queue_weight, load_weight = self._config.queue_weight, self._config.load_weight

        def prefill(replica: Replica) -> tuple[float, int]:
            """(blocks it would prefill, pulled ones weighted; blocks it pulls: 0 = none)."""
            own = held[id(replica)]
            if source is None or held[id(source)] <= own:
                return num_blocks - own, 0
            pulled = held[id(source)] - own
            with_pull = num_blocks - held[id(source)] + self._config.pull_block_cost * pulled
            return (with_pull, pulled) if with_pull < num_blocks - own else (num_blocks - own, 0)

        def cost(replica: Replica) -> tuple[float, int, float]:
            weighted_load = queue_weight * replica.queued_prefill_blocks + load_weight * replica.num_requests
            return prefill(replica)[0] + weighted_load, *replica.load_key

        best = min(self._rotated(eligible), key=cost)
        if prefill(best)[1]:
            source_blocks = held[id(source)]
            return RouteDecision(
                best, source_blocks * prompt.block_size_tokens, num_blocks - source_blocks, RouteReason.PULL,
                pull_from=source, pull_blocks=source_blocks,
            )
        own = held[id(best)]
        return RouteDecision(best, own * prompt.block_size_tokens, num_blocks - own, RouteReason.PREFIX)

    def _within_bound(self, replicas: Sequence[Replica]) -> list[Replica]:
        least = min(replica.num_requests for replica in replicas)
        bound = max(least * self._config.load_ratio, least + self._config.load_slack)
        return [replica for replica in replicas if replica.num_requests <= bound]

    def _least_loaded(self, replicas: Sequence[Replica]) -> Replica:
        return min(self._rotated(replicas), key=lambda replica: replica.load_key)

    def _rotated(self, replicas: Sequence[Replica]) -> list[Replica]:
        # Equals are taken in turn, so that an idle fleet still spreads its requests.
        start = next(self._turns)
        return [replicas[(start + i) % len(replicas)] for i in range(len(replicas))]


def _uncached(
    prompt: PreparedPrompt, replica: Replica, reason: RouteReason, cause: FallbackCause | None = None
) -> RouteDecision:
    return RouteDecision(replica, 0, _num_blocks(prompt), reason, cause)


def _num_blocks(prompt: PreparedPrompt) -> int:
    return -(-prompt.num_tokens // prompt.block_size_tokens)


def _reusable_blocks(prompt: PreparedPrompt, num_cached_blocks: int) -> int:
    """Prompt blocks a replica holding `num_cached_blocks` leading blocks can skip: the engine
    computes at least the prompt's last token, so a fully cached prompt reuses a block less."""
    return min(num_cached_blocks, (prompt.num_tokens - 1) // prompt.block_size_tokens)
