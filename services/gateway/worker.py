"""One gateway worker: a full gateway in this process, served until SIGTERM/SIGINT.

Start (gateway.app.start_gateway) → `on_serving(port, own port)` → serve → drain on the signal (health
NOT_SERVING, in-flight streams finish within the grace period) → close the hop clients. With
`--workers 1` the gateway process is its only worker; with more, gateway.worker_group runs this
in each child.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from llmserve.errors import ServiceError
from llmserve.gateway.app import start_gateway
from llmserve.gateway.block_layout import BlockLayoutMismatch
from llmserve.gateway.config import GatewayConfig
from llmserve.server import BindError, serve_until_signal

log = logging.getLogger("llmserve.gateway")


# on_serving(the shared port, this worker's own port or None): called once SERVING
OnServing = Callable[[int, "int | None"], None]


async def _serve(config: GatewayConfig, worker_id: int, on_serving: OnServing) -> None:
    gateway = await start_gateway(config, worker_id)
    on_serving(gateway.port, gateway.server.second_port)
    try:
        await serve_until_signal(
            gateway.server, grace_s=config.grace_period_s,
            on_drain=gateway.http.drain if gateway.http is not None else None,
        )  # fmt: skip
    finally:
        await gateway.close_clients()


def run_worker(config: GatewayConfig, worker_id: int, on_serving: OnServing) -> int:
    """Serve until a signal; the process exit code (1: could not start)."""
    try:
        asyncio.run(_serve(config, worker_id, on_serving))
    except ServiceError as error:  # a hop never became ready
        log.error("%s", error.message)
        return 1
    except (BlockLayoutMismatch, BindError) as error:  # hops started differently; a port taken
        log.error("cannot start: %s", error)
        return 1
    except KeyboardInterrupt:  # interrupted during start-up, before the signal handlers exist
        return 130
    return 0
