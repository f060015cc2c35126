"""The preprocess service's /metrics (docs/observability.md, llmserve_preprocess_*) after real
requests: the real service (tiny checkpoint, a real redis-server) scraped over HTTP, each metric
moved by exactly what the requests did."""

from __future__ import annotations

import grpc
import pytest
import redis

from llmserve.preprocess.config import PreprocessConfig
from llmserve.preprocess.server import start_server
from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import common_pb2, preprocess_pb2, preprocess_pb2_grpc
from tests.metrics_scrape import scrape
from tests.procs import free_port, running_service
from tests.redis_server import redis_server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.asyncio(loop_scope="session")

SYSTEM = "Answer in French."
LONG_TOKEN_IDS = list(range(5, 155))  # over the first bucket (128) of the tiny model's two
REDIS_TIMEOUT_MS = 2000  # generous: a loaded machine must not turn a Redis hit into a miss
REQUESTS = "llmserve_preprocess_requests_total"
BY_BUCKET = "llmserve_preprocess_requests_by_bucket_total"
HITS = "llmserve_preprocess_prompt_cache_hits_total"


def chat(user: str) -> common_pb2.ChatInput:
    messages = [common_pb2.ChatMessage(role="system", content=SYSTEM), common_pb2.ChatMessage(role="user", content=user)]
    return common_pb2.ChatInput(messages=messages)


async def store_system_prompt_in_redis(model_dir, redis_url: str) -> None:
    """Another replica (in this process) sees SYSTEM first and writes it to Redis."""
    config = PreprocessConfig(
        model_path=model_dir, model_name="tiny", port=0, redis_url=redis_url, redis_timeout_ms=REDIS_TIMEOUT_MS
    )
    server = await start_server(config)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS) as channel:
        stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
        await stub.Tokenize(preprocess_pb2.TokenizeRequest(chat=chat("Capital of Italy?")), timeout=10)
    await server.running.server.stop(1.0)
    await server.close()  # waits for its Redis write


async def test_preprocess_metrics_follow_the_requests(tiny_model_dir, tmp_path, redis_server):  # noqa: F811
    await store_system_prompt_in_redis(tiny_model_dir, redis_server.url)
    assert redis.Redis(port=redis_server.port).keys("llmserve:prompt:*")
    port = free_port()
    args = [
        "--model", str(tiny_model_dir), "--model-name", "tiny", "--redis-url", redis_server.url,
        "--redis-timeout-ms", str(REDIS_TIMEOUT_MS), "--metrics-port", str(port),
    ]  # fmt: skip
    with running_service("preprocess", args, tmp_path) as service:
        async with grpc.aio.insecure_channel(service.address, options=CHANNEL_OPTIONS) as channel:
            stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
            start = scrape(port)
            ok_requests = [
                preprocess_pb2.PreprocessRequest(prompt="Hello there", max_tokens=8),
                preprocess_pb2.PreprocessRequest(
                    prompt_token_ids=common_pb2.TokenIdsInput(token_ids=LONG_TOKEN_IDS), max_tokens=8
                ),
                preprocess_pb2.PreprocessRequest(chat=chat("Capital of Spain?"), max_tokens=8),  # SYSTEM from Redis
                preprocess_pb2.PreprocessRequest(chat=chat("Capital of Spain?"), max_tokens=8),  # the chat from the LRU
            ]
            responses = [await stub.Preprocess(request, timeout=10) for request in ok_requests]
            with pytest.raises(grpc.aio.AioRpcError) as invalid:
                await stub.Preprocess(preprocess_pb2.PreprocessRequest(max_tokens=8), timeout=10)
            end = scrape(port)

    assert invalid.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (BY_BUCKET, (("bucket", "128"),)) in start.samples  # every bucket exported from the start
    assert end.delta(start, REQUESTS, code="OK") == len(ok_requests)
    assert end.delta(start, REQUESTS, code="INVALID_ARGUMENT") == 1
    assert end.delta(start, "llmserve_preprocess_tokens_total") == sum(len(r.token_ids) for r in responses)
    assert end.delta(start, "llmserve_preprocess_tokenize_duration_seconds_count") == len(ok_requests)
    assert end.delta(start, "llmserve_preprocess_tokenize_duration_seconds_sum") > 0
    buckets = [128 if len(response.token_ids) <= 128 else 256 for response in responses]  # the model's two
    assert buckets[:2] == [128, 256]
    for bucket in (128, 256):
        assert end.delta(start, BY_BUCKET, bucket=str(bucket)) == buckets.count(bucket)
    assert end.delta(start, HITS, tier="redis") == 1
    assert end.delta(start, HITS, tier="memory") == 1
