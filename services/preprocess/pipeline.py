"""The preprocess pipeline on the event loop: check, admit, look up, batch, store.

For each request:
  1. `Preprocessor.check` on the loop (refused before it waits for anything);
  2. its bytes are admitted into the TokenizerThreads's budget (RESOURCE_EXHAUSTED when they do not
     fit) and held until it is answered;
  3. a chat looks up the tokenized prefixes of its leading turns (PromptCache: in process, then
     Redis for its system prompt, bounded by a timeout);
  4. it joins the next micro-batch (MicroBatcher), which renders, tokenizes and finishes it on a
     tokenizer thread (BatchEncoder, Preprocessor.finish);
  5. the chat's own tokenization, and its system prompt's if one was made, are stored for the
     turns that follow it (a Redis write does not delay the answer).
Token-id prompts skip 3-5: they are finished on a tokenizer thread directly.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Sequence

from llmserve.message_limits import MAX_TOKEN_ID_BYTES
from llmserve.preprocessing.batch_encoder import Encoded, EncodeJob
from llmserve.preprocess.config import PreprocessConfig
from llmserve.prompt_input import PromptInput, PromptTokenIds, TextOrChat
from llmserve.preprocess.micro_batcher import MicroBatcher
from llmserve.preprocessing.preprocessor import TOKEN_IDS_FIELD, Preprocessed, Preprocessor, Tokenized, input_field
from llmserve.preprocess.prompt_cache import PromptCache, cache_namespace
from llmserve.preprocess.redis_prompt_store import RedisPromptStore
from llmserve.preprocess.tokenizer_threads import TokenizerThreads


class PreprocessPipeline:
    """Preprocess, Tokenize and Detokenize as the servicer calls them. Use from one event loop."""

    def __init__(self, preprocessor: Preprocessor, threads: TokenizerThreads, cache: PromptCache | None, max_batch_prompts: int):
        self.preprocessor = preprocessor
        self.threads = threads
        self._cache = cache
        self._batcher: MicroBatcher[EncodeJob, Encoded] = MicroBatcher(
            threads, preprocessor.encoder.encode_batch, max_batch_jobs=max_batch_prompts
        )
        self._writes: set[asyncio.Task] = set()

    @classmethod
    def build(cls, preprocessor: Preprocessor, config: PreprocessConfig) -> "PreprocessPipeline":
        threads = TokenizerThreads(
            config.num_tokenizer_threads, config.max_in_flight_prompt_bytes, config.inline_max_prompt_bytes
        )
        cache = None
        if preprocessor.tail.is_enabled:
            remote = None
            if config.redis_url is not None:
                remote = RedisPromptStore(config.redis_url, timeout_ms=config.redis_timeout_ms, ttl_s=config.redis_ttl_s)
            namespace = cache_namespace(
                preprocessor.info.model_name, preprocessor.tokenizer.version, preprocessor.chat_template.source
            )
            cache = PromptCache(
                preprocessor.tail, max_bytes=config.prompt_cache_bytes, namespace=namespace,
                vocab_size=preprocessor.info.vocab_size, remote=remote,
            )
        return cls(preprocessor, threads, cache, config.max_batch_prompts)

    @property
    def is_reusing_prefixes(self) -> bool:
        return self._cache is not None

    async def preprocess(self, request_input: PromptInput | None, max_tokens: int | None, cache_salt: str) -> Preprocessed:
        num_bytes = self.preprocessor.check(request_input, max_tokens)
        with self.threads.hold(num_bytes):
            if isinstance(request_input, PromptTokenIds):
                finish = functools.partial(
                    self.preprocessor.finish, request_input.token_ids, TOKEN_IDS_FIELD, max_tokens, cache_salt
                )
                return await self.threads.execute(num_bytes, finish)
            field = input_field(request_input)

            def finish_encoding(encoding) -> Preprocessed:
                return self.preprocessor.finish(encoding.token_ids, field, max_tokens, cache_salt)

            return await self._encode(request_input, True, num_bytes, finish_encoding)

    async def tokenize(self, request_input: TextOrChat | None, add_special_tokens: bool | None) -> Tokenized:
        num_bytes = self.preprocessor.check_tokenize(request_input)
        add = True if add_special_tokens is None else add_special_tokens
        with self.threads.hold(num_bytes):
            return await self._encode(request_input, add, num_bytes, self.preprocessor.tokenized)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        return await self.threads.run(
            len(token_ids) * MAX_TOKEN_ID_BYTES,
            self.preprocessor.detokenize, token_ids, skip_special_tokens=skip_special_tokens,
        )

    async def close(self) -> None:
        """After the gRPC server has stopped: finish Redis writes, stop the tokenizer threads."""
        if self._writes:
            await asyncio.wait(self._writes)
        if self._cache is not None:
            await self._cache.close()
        self.threads.close()

    async def _encode(self, text_or_chat: TextOrChat, add_special_tokens: bool, num_bytes: int, finish):
        if self._cache is None or isinstance(text_or_chat, str):
            job = EncodeJob(text_or_chat, add_special_tokens, finish)
            return (await self._batcher.run(job, num_bytes)).result
        lookup = await self._cache.lookup(text_or_chat.messages, text_or_chat.add_generation_prompt)
        job = EncodeJob(
            text_or_chat, add_special_tokens, finish, prefixes=lookup.prefixes,
            make_system_prefix=lookup.missing_system_key is not None,
        )
        encoded = await self._batcher.run(job, num_bytes)
        self._store(lookup.key, lookup.missing_system_key, encoded)
        return encoded.result

    def _store(self, key: bytes, system_key: bytes | None, encoded: Encoded) -> None:
        if encoded.prefix is not None:
            self._cache.put(key, encoded.prefix)
        if system_key is not None and encoded.system_prefix is not None:
            task = asyncio.get_running_loop().create_task(self._cache.put_system(system_key, encoded.system_prefix))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)
