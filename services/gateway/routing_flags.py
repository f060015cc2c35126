"""The gateway's routing flags (`--routing`, `--redis-url`, ...) and the config fields they set."""

from __future__ import annotations

import argparse
from typing import Any

from llmserve.gateway.discovery import DEFAULT_RESOLVE_INTERVAL_S
from llmserve.gateway.router import (
    DEFAULT_LOAD_RATIO,
    DEFAULT_LOAD_SLACK,
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_PULL_BLOCK_COST,
    DEFAULT_QUEUE_WEIGHT,
    RoutingConfig,
    RoutingPolicy,
)
from llmserve.prefix_index.redis_config import add_redis_arguments, redis_config_from_args


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("routing (docs/routing.md)")
    group.add_argument(
        "--routing", default=RoutingPolicy.KV.value, choices=[policy.value for policy in RoutingPolicy],
        help="kv: the replica with the least prefill before the request's first token (the prompt blocks "
        "it does not hold, plus --routing-queue-weight and --routing-load-weight terms), within the load bound "
        "(least-loaded when no replica holds any of the prompt); least-loaded: fewest requests in flight; round-robin: "
        "each replica in turn (default: %(default)s)",
    )
    group.add_argument(
        "--routing-load-ratio", type=float, default=DEFAULT_LOAD_RATIO, metavar="RATIO",
        help="kv routing skips a replica whose requests exceed both the least loaded replica's times RATIO "
        "and theirs plus --routing-load-slack, so a popular prefix does not make a hot spot (default: %(default)s)",
    )
    group.add_argument(
        "--routing-load-slack", type=int, default=DEFAULT_LOAD_SLACK, metavar="REQUESTS",
        help="requests a replica may have beyond the least loaded one's before the ratio applies "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--routing-queue-weight", type=float, default=DEFAULT_QUEUE_WEIGHT, metavar="W",
        help="kv routing counts W x the prefill this gateway has queued on a replica against the prompt "
        "blocks it holds; 0: the longest cached prefix within the load bound (default: %(default)s)",
    )
    group.add_argument(
        "--routing-load-weight", type=float, default=DEFAULT_LOAD_WEIGHT, metavar="BLOCKS",
        help="kv routing counts BLOCKS x each request in flight on a replica against the prompt blocks it "
        "holds, so a request whose cached prefix is short goes to a quieter replica before the load bound "
        "forces one whose prefix is long to move (default: %(default)s)",
    )
    group.add_argument(
        "--routing-kv-pull", action="store_true",
        help="the replicas are co-located (one host, a shared /dev/shm or, on GPUs, one IPC namespace) and "
        "started with --kv-pull: kv routing may send a request to a less-loaded replica with a hint to pull "
        "the prompt's prefix KV from the replica holding it, instead of recomputing it there (docs/routing.md)",
    )
    group.add_argument(
        "--routing-pull-block-cost", type=float, default=DEFAULT_PULL_BLOCK_COST, metavar="BLOCKS",
        help="with --routing-kv-pull, what pulling one KV block costs in recomputed blocks (default: %(default)s)",
    )
    add_redis_arguments(
        group,
        "keep the prefix index in this Redis (redis://host:port/db), written by the inference replicas "
        "(start them with the same --redis-url), shared by every gateway; unset: each gateway keeps its own "
        "index in memory from the replicas' KV events",
    )
    group.add_argument(
        "--resolve-interval-s", type=float, default=DEFAULT_RESOLVE_INTERVAL_S, metavar="SECONDS",
        help="how often dns:/// inference targets are resolved again (default: %(default)s)",
    )
    group.add_argument(
        "--heartbeat-interval-ms", type=int, default=0, metavar="MS",
        help="heartbeat interval asked of each replica's KV event stream; a replica silent for its "
        "heartbeat TTL is not routed to (default: 0, the replica's own)",
    )


def routing_options(args: argparse.Namespace) -> dict[str, Any]:
    """GatewayConfig fields from the parsed routing flags."""
    return dict(
        routing=RoutingConfig(
            RoutingPolicy(args.routing), args.routing_load_ratio, args.routing_load_slack,
            args.routing_queue_weight, args.routing_load_weight, args.routing_kv_pull, args.routing_pull_block_cost,
        ),
        redis=redis_config_from_args(args),
        resolve_interval_s=args.resolve_interval_s,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
    )
