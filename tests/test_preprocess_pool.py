"""The gateway's PreprocessPool over real preprocess servers (subprocesses on the tiny model):
calls spread over both, a server killed mid-run is skipped and every request still answered,
health checks see it down, and a server that discovery adds later takes calls."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.errors import Unavailable
from llmserve.gateway.preprocess_pool import PreprocessPool
from llmserve.tools.service_process import start_service, stop_service

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = "The capital of France is"


async def _send(pool: PreprocessPool, num_requests: int) -> list:
    return await asyncio.gather(*(
        pool.preprocess(f"r{i}", PROMPT, max_tokens=4, cache_salt="", timeout_s=20) for i in range(num_requests)
    ))


def _calls(pool: PreprocessPool) -> dict[str, int]:
    return {status.address: status.num_calls for status in pool.status()}


async def test_a_pool_spreads_calls_and_answers_everything_when_a_replica_is_killed(tiny_model_dir, tmp_path):
    flags = ["--model", str(tiny_model_dir)]
    servers = [start_service("preprocess", flags, tmp_path / name) for name in ("a", "b")]
    addresses = [server.address for server in servers]
    pool = PreprocessPool(lambda: addresses, retry_after_s=0.3)
    try:
        expected = (await _send(pool, 1))[0].token_id_bytes
        prepared = await _send(pool, 20)
        assert all(p.token_id_bytes == expected and p.max_tokens == 4 for p in prepared)
        assert all(n >= 5 for n in _calls(pool).values()), _calls(pool)  # both took a share

        killed, alive = servers
        killed.kill()
        before = _calls(pool)
        prepared = await _send(pool, 20)  # each one that meets the dead server is sent on
        assert all(p.token_id_bytes == expected for p in prepared)
        status = {s.address: s for s in pool.status()}
        assert not status[killed.address].is_up and status[alive.address].is_up
        assert _calls(pool)[alive.address] - before[alive.address] == 20

        await asyncio.sleep(0.4)  # past retry_after_s: the dead one is tried again, and skipped again
        assert all(p.token_id_bytes == expected for p in await _send(pool, 5))
        await pool.check_health()
        assert [s.is_up for s in pool.status()] == [False, True]

        servers.append(start_service("preprocess", flags, tmp_path / "c"))  # discovery finds a new one
        addresses.append(servers[-1].address)
        await _send(pool, 20)
        assert _calls(pool)[servers[-1].address] >= 5

        addresses.remove(killed.address)  # and forgets the dead one
        await _send(pool, 4)
        assert killed.address not in _calls(pool)
        for server in servers[1:]:
            stop_service(server)
        with pytest.raises(Unavailable):
            await _send(pool, 1)
    finally:
        await pool.close()
        for server in servers:
            server.kill()
