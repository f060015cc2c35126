"""Tokenized system prompts shared by every preprocess server through Redis (optional).

Redis is a cache and never a dependency: every call is bounded by `timeout_ms` (connect
included, no retries), and any failure - down, slow, refusing, a value that does not parse -
reads as a miss, so the caller tokenizes locally and no request fails because of Redis. After a
failure Redis is left alone for `_PAUSE_AFTER_FAILURE_S`, so a dead Redis costs one timeout per
pause, not one per request. Entries expire after `ttl_s` and are evictable (Redis's maxmemory
policy); the key says which model, tokenizer and chat template made them (`PromptCache`).

Value layout (little-endian): magic `LPC1`, the text's UTF-8 byte length (uint32), the text,
then the token ids as uint32.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time

from llmserve import token_id_bytes

log = logging.getLogger(__name__)

_MAGIC = b"LPC1"
_HEADER = struct.Struct("<4sI")
_PAUSE_AFTER_FAILURE_S = 1.0


def encode_entry(text: str, token_ids: list[int]) -> bytes:
    text_bytes = text.encode("utf-8")
    return _HEADER.pack(_MAGIC, len(text_bytes)) + text_bytes + token_id_bytes.pack(token_ids)


def decode_entry(value: bytes) -> tuple[str, list[int]] | None:
    """The text and ids of a stored value; None for anything malformed."""
    if len(value) < _HEADER.size:
        return None
    magic, num_text_bytes = _HEADER.unpack_from(value)
    ids_start = _HEADER.size + num_text_bytes
    if magic != _MAGIC or ids_start > len(value) or (len(value) - ids_start) % token_id_bytes.BYTES_PER_ID:
        return None
    try:
        text = value[_HEADER.size : ids_start].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text, token_id_bytes.unpack(value[ids_start:])


class RedisPromptStore:
    """get/put of encoded entries with a hard time bound; failures are misses."""

    def __init__(self, url: str, *, timeout_ms: int, ttl_s: int):
        # redis-py is imported only here, with --redis-url: serving without Redis needs no redis-py.
        import redis.asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self._errors = (redis.RedisError, OSError, TimeoutError)
        self._timeout_s = timeout_ms / 1000
        self._ttl_s = ttl_s
        self._client = redis.asyncio.Redis.from_url(
            url, socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._paused_until_s = 0.0  # monotonic; no calls before it after a failure

    async def get(self, key: str) -> bytes | None:
        return await self._call("get", self._client.get, key)

    async def put(self, key: str, value: bytes) -> None:
        await self._call("set", self._client.set, key, value, ex=self._ttl_s)

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(self, what: str, method, *args, **kwargs):
        if time.monotonic() < self._paused_until_s:
            return None
        try:
            async with asyncio.timeout(self._timeout_s):
                return await method(*args, **kwargs)
        except self._errors as exc:
            self._paused_until_s = time.monotonic() + _PAUSE_AFTER_FAILURE_S
            log.warning("redis %s failed (%s: %s); tokenizing locally, next try in %.0f s",
                        what, type(exc).__name__, exc, _PAUSE_AFTER_FAILURE_S)
            return None
