"""Tokenized chat prefixes: an in-process LRU, and Redis behind it for system prompts.

An entry is a rendered chat and its full tokenization (`TokenizedPrefix`), keyed by what it was
rendered from: the digest of its messages (roles and contents, chained turn by turn, so every
leading run of a chat has its own key computed in one pass) and `add_generation_prompt`. A
request looks up each of its leading runs, longest first: the previous turn of a conversation
(stored when that turn was preprocessed) and the system prompt alone (stored the first time a
conversation with it was seen, here or - through Redis - on any preprocess server). The LRU holds both,
bounded by `max_bytes`; only system prompts go to Redis, which is what the servers share.

The Redis key also names the model, the tokenizer version and the chat template's version:
another tokenizer or template renders or splits the same messages differently, so its entries
must never be found. Used from the event loop only (no locks).

Metrics: a lookup counts one memory hit when it found any entry in process, one redis hit when
Redis had its system prompt (llmserve.preprocess.metrics).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from llmserve.preprocess import metrics
from llmserve.preprocess.redis_prompt_store import RedisPromptStore, decode_entry, encode_entry
from llmserve.preprocessing.tail_tokenizer import TailTokenizer, TokenizedPrefix
from llmserve.sampling import ChatMessage

_KEY_PREFIX = "llmserve:prompt:v1"


def message_digests(messages: Sequence[ChatMessage]) -> list[bytes]:
    """digests[j] identifies messages[: j + 1] (length-prefixed, so no two runs collide)."""
    chain = hashlib.blake2b(digest_size=16)
    digests = []
    for message in messages:
        role, content = message.role.encode("utf-8"), message.content.encode("utf-8")
        chain.update(struct.pack("<II", len(role), len(content)) + role + content)
        digests.append(chain.copy().digest())
    return digests


def prefix_key(digest: bytes, add_generation_prompt: bool) -> bytes:
    return digest + (b"\x01" if add_generation_prompt else b"\x00")


def cache_namespace(model_name: str, tokenizer_version: str, template_source: str) -> str:
    template_version = hashlib.blake2b(template_source.encode("utf-8"), digest_size=8).hexdigest()
    return f"{_KEY_PREFIX}:{model_name}:{tokenizer_version}:{template_version}"


@dataclass(frozen=True, slots=True)
class Lookup:
    """What a chat finds before it is rendered: its own key (to store it under), the entries of
    its leading runs, longest first, and the key of its system prompt alone when that has no
    entry yet (None: no system prompt, or found)."""

    key: bytes
    prefixes: tuple[TokenizedPrefix, ...]
    missing_system_key: bytes | None


class PromptCache:
    def __init__(
        self, tail: TailTokenizer, *, max_bytes: int, namespace: str, vocab_size: int,
        remote: RedisPromptStore | None = None,
    ):
        self._tail = tail
        self._max_bytes = max_bytes
        self._namespace = namespace
        self._vocab_size = vocab_size
        self._remote = remote
        self._entries: OrderedDict[bytes, TokenizedPrefix] = OrderedDict()
        self._num_bytes = 0

    async def lookup(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> Lookup:
        digests = message_digests(messages)
        keys = [prefix_key(digests[-1], add_generation_prompt)]
        for digest in reversed(digests[:-1]):
            keys += [prefix_key(digest, True), prefix_key(digest, False)]
        prefixes = tuple(entry for key in keys if (entry := self._get(key)) is not None)
        if prefixes:
            metrics.record_memory_hit()
        # The system prompt rendered alone, when the chat has one and more turns after it.
        if len(messages) < 2 or messages[0].role != "system":
            return Lookup(keys[0], prefixes, None)
        system_key = prefix_key(digests[0], False)
        if self._get(system_key) is not None:
            return Lookup(keys[0], prefixes, None)
        remote = await self._get_remote(system_key)
        if remote is not None:
            metrics.record_redis_hit()
            return Lookup(keys[0], prefixes + (remote,), None)
        return Lookup(keys[0], prefixes, system_key)

    def put(self, key: bytes, entry: TokenizedPrefix) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._num_bytes -= old.num_bytes
        if entry.num_bytes > self._max_bytes:
            return
        self._entries[key] = entry
        self._num_bytes += entry.num_bytes
        while self._num_bytes > self._max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._num_bytes -= evicted.num_bytes

    async def put_system(self, key: bytes, entry: TokenizedPrefix) -> None:
        """Store a system prompt's entry here and (if configured) in Redis."""
        self.put(key, entry)
        if self._remote is not None:
            await self._remote.put(self._remote_key(key), encode_entry(entry.text, entry.token_ids))

    def _get(self, key: bytes) -> TokenizedPrefix | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    async def _get_remote(self, key: bytes) -> TokenizedPrefix | None:
        if self._remote is None:
            return None
        value = await self._remote.get(self._remote_key(key))
        decoded = decode_entry(value) if value is not None else None
        if decoded is None or (decoded[1] and max(decoded[1]) >= self._vocab_size):
            return None
        entry = self._tail.prefix(*decoded)
        self.put(key, entry)
        return entry

    def _remote_key(self, key: bytes) -> str:
        return f"{self._namespace}:{key.hex()}"

    async def close(self) -> None:
        if self._remote is not None:
            await self._remote.close()
