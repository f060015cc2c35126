"""System prompts shared through a real Redis (redis-server on a free loopback port): a replica
finds what another one stored, keys name the model, tokenizer and template versions, and a Redis
that is killed or hangs mid-run only means tokenizing locally: every request is still answered,
correctly and quickly. Skipped where redis-server is not installed."""

from __future__ import annotations

import contextlib
import shutil
import signal
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import redis
import tokenizers

from llmserve.preprocess.config import PreprocessConfig
from llmserve.preprocess.server import start_server
from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import common_pb2, preprocess_pb2, preprocess_pb2_grpc
from llmserve.tools.tiny_model import CHATML_TEMPLATE
from tests.preprocess_models import with_template
from tests.procs import running_service
from tests.redis_server import RedisServer

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
KEY_PATTERN = "llmserve:prompt:v1:*"


@contextlib.contextmanager
def redis_server():
    """A throwaway redis-server (tests/redis_server.py: no persistence), its process and a client
    to it, and its URL; killed at the end."""
    server = RedisServer()
    server.start()
    client = redis.Redis(port=server.port, socket_timeout=5)
    try:
        yield server.process, client, server.url
    finally:
        server.kill()
        client.close()


@pytest.fixture
def redis_instance():
    with redis_server() as instance:
        yield instance


def _stats(client: redis.Redis) -> tuple[int, int]:
    info = client.info("stats")
    return info["keyspace_hits"], info["keyspace_misses"]


def _wait_for_keys(client: redis.Redis, count: int) -> list[str]:
    for _ in range(200):
        keys = sorted(key.decode() for key in client.keys(KEY_PATTERN))
        if len(keys) >= count:
            return keys
        time.sleep(0.01)
    raise AssertionError(f"expected {count} keys, got {keys}")


def _chat(system: str, user: str) -> preprocess_pb2.TokenizeRequest:
    messages = [common_pb2.ChatMessage(role="system", content=system), common_pb2.ChatMessage(role="user", content=user)]
    return preprocess_pb2.TokenizeRequest(chat=common_pb2.ChatInput(messages=messages))


@contextlib.asynccontextmanager
async def _server(model_dir: Path, redis_url: str, **overrides):
    # A generous timeout: on a loaded machine a 20 ms one can expire, which reads as a miss (the
    # timeout itself is the subject of the last test).
    settings = dict(model_path=model_dir, model_name="tiny", port=0, redis_url=redis_url, redis_timeout_ms=2000)
    config = PreprocessConfig(**{**settings, **overrides})
    server = await start_server(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS)
    try:
        yield preprocess_pb2_grpc.PreprocessServiceStub(channel)
    finally:
        await channel.close()
        await server.running.server.stop(1.0)
        await server.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def reference(tiny_model_dir) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


async def _tokenize_checked(stub, request, reference: tokenizers.Tokenizer) -> list[int]:
    response = await stub.Tokenize(request, timeout=10)
    assert list(response.token_ids) == reference.encode(response.rendered_prompt, add_special_tokens=False).ids
    return list(response.token_ids)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_replica_uses_the_system_prompt_another_one_stored(tiny_model_dir, redis_instance, reference):
    _, client, url = redis_instance
    system = "You answer in one short sentence, in French. " * 4
    async with _server(tiny_model_dir, url) as first:
        await _tokenize_checked(first, _chat(system, "Capital of Italy?"), reference)
        [key] = _wait_for_keys(client, 1)
    assert key.startswith("llmserve:prompt:v1:tiny:")
    async with _server(tiny_model_dir, url) as second:
        before = _stats(client)
        await _tokenize_checked(second, _chat(system, "Capital of Spain?"), reference)
        assert _stats(client) == (before[0] + 1, before[1])  # one hit, no miss
        await _tokenize_checked(second, _chat(system, "Capital of Peru?"), reference)
        assert _stats(client) == (before[0] + 1, before[1])  # now in process: Redis not asked
    assert client.ttl(key) > 3000


@pytest.mark.asyncio(loop_scope="session")
async def test_a_changed_chat_template_misses_what_the_old_one_stored(tiny_model_dir, redis_instance, reference, tmp_path):
    _, client, url = redis_instance
    system = "Be brief."
    async with _server(tiny_model_dir, url) as old:
        await _tokenize_checked(old, _chat(system, "Hi"), reference)
    [old_key] = _wait_for_keys(client, 1)
    new_template = CHATML_TEMPLATE.replace("'\\n' + message['content']", "':\\n' + message['content']")
    async with _server(with_template(tiny_model_dir, tmp_path / "new", new_template), url) as new:
        before = _stats(client)
        await _tokenize_checked(new, _chat(system, "Hi"), reference)
        assert _stats(client) == (before[0], before[1] + 1)
    keys = _wait_for_keys(client, 2)
    [new_key] = [key for key in keys if key != old_key]
    # Same model and tokenizer, another template version: only the last field but the digest differs.
    assert new_key.split(":")[:5] == old_key.split(":")[:5] and new_key.split(":")[5] != old_key.split(":")[5]


def _tokenize_timed(address: str, request, reference) -> float:
    with grpc.insecure_channel(address) as channel:
        stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
        start_s = time.perf_counter()
        response = stub.Tokenize(request, timeout=10)
        elapsed_s = time.perf_counter() - start_s
    assert list(response.token_ids) == reference.encode(response.rendered_prompt, add_special_tokens=False).ids
    return elapsed_s


def test_a_redis_that_hangs_or_dies_mid_run_only_means_tokenizing_locally(tiny_model_dir, tmp_path, reference):
    with redis_server() as (process, client, url):
        flags = ["--model", str(tiny_model_dir), "--redis-url", url, "--redis-timeout-ms", "300"]
        with running_service("preprocess", flags, tmp_path) as service:
            for i in range(5):  # each system prompt is new: Redis is asked every time
                _tokenize_timed(service.address, _chat(f"System prompt {i}.", "Hello"), reference)
            assert len(_wait_for_keys(client, 5)) == 5
            process.send_signal(signal.SIGSTOP)  # hangs: every call would wait forever
            try:
                slow = [_tokenize_timed(service.address, _chat(f"Hung {i}.", "Hello"), reference) for i in range(5)]
            finally:
                process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait()
            dead = [_tokenize_timed(service.address, _chat(f"Dead {i}.", "Hello"), reference) for i in range(20)]
            # The prompts stored before the kill are still found in process.
            _tokenize_timed(service.address, _chat("System prompt 0.", "Again"), reference)
        log = (tmp_path / "preprocess.log").read_text()
    assert max(slow) < 2.0 and max(dead) < 2.0, (slow, dead)  # one timeout at most, then paused
    assert "redis get failed" in log and "Traceback" not in log
