"""The preprocess pipeline, free of protobuf and of asyncio.

A generation request goes through five steps:
  1. cheap checks: an input is set, max_tokens within the output limit, prompt/chat well formed;
  2. a chat is rendered with the model's template (its special tokens are now text);
  3. tokenization: a prompt with the tokenizer's special tokens (BOS etc.), a rendered chat
     without them, as transformers' `apply_chat_template(tokenize=True)` does;
  4. the prompt is checked against the context and max_tokens resolved;
  5. its length bucket and the chained hashes of its full blocks are attached.
Every method is synchronous and thread-safe; the servicer runs them on worker threads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import jinja2

from llmserve.block_hash import HASH_VERSION, chain_block_hashes
from llmserve.buckets import BucketConfig, LengthBucket
from llmserve.errors import InvalidArgument
from llmserve.model_files import ModelFiles
from llmserve.preprocess.chat_template import ChatTemplate
from llmserve.preprocess.config import PreprocessConfig
from llmserve.preprocess.tokenizer import ModelTokenizer
from llmserve.preprocess import validation
from llmserve.preprocess.validation import Limits
from llmserve.sampling import ChatMessage

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Chat:
    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True


# What to tokenize: raw text, or a chat to render first.
TextOrChat = str | Chat


@dataclass(frozen=True, slots=True)
class Preprocessed:
    token_ids: list[int]
    bucket: LengthBucket
    block_hashes: list[int]  # one per full block of block_size_tokens
    max_tokens: int  # resolved: prompt + max_tokens fits the context


@dataclass(frozen=True, slots=True)
class Tokenized:
    token_ids: list[int]
    tokens: list[str]  # vocabulary entry per id
    rendered_prompt: str  # the rendered chat; "" for text input


@dataclass(frozen=True, slots=True)
class PreprocessInfo:
    model_name: str
    vocab_size: int
    max_context_tokens: int
    max_output_tokens: int
    eos_token_ids: tuple[int, ...]
    block_size_tokens: int
    block_hash_version: int
    buckets: tuple[LengthBucket, ...]
    has_chat_template: bool


class Preprocessor:
    """Templates, tokenizes and validates requests for one model. Build with `load`."""

    def __init__(
        self,
        *,
        tokenizer: ModelTokenizer,
        chat_template: ChatTemplate | None,
        limits: Limits,
        buckets: BucketConfig,
        block_size_tokens: int,
        model_name: str,
        eos_token_ids: tuple[int, ...],
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.limits = limits
        self.buckets = buckets
        self.block_size_tokens = block_size_tokens
        self.info = PreprocessInfo(
            model_name=model_name,
            vocab_size=tokenizer.vocab_size,
            max_context_tokens=limits.max_context_tokens,
            max_output_tokens=limits.max_output_tokens,
            eos_token_ids=eos_token_ids,
            block_size_tokens=block_size_tokens,
            block_hash_version=HASH_VERSION,
            buckets=tuple(buckets.buckets()),
            has_chat_template=chat_template is not None,
        )

    @classmethod
    def load(cls, config: PreprocessConfig) -> "Preprocessor":
        """Read the checkpoint's tokenizer, template and context once (blocking)."""
        model = ModelFiles.load(config.model_path, config.model_name)
        tokenizer = ModelTokenizer.load(model.path)
        limits = Limits.resolve(
            model.max_context_tokens, config.max_context_tokens, config.max_output_tokens,
            config.max_prompt_bytes, tokenizer.max_token_bytes,
        )
        if limits.max_output_tokens < config.max_output_tokens:
            log.info(
                "max output tokens capped to %d by the context of %d tokens",
                limits.max_output_tokens,
                limits.max_context_tokens,
            )
        return cls(
            tokenizer=tokenizer,
            chat_template=_compile_chat_template(model, tokenizer),
            limits=limits,
            buckets=config.buckets.limited_to(limits.max_context_tokens),
            block_size_tokens=config.block_size_tokens,
            model_name=model.model_name,
            eos_token_ids=model.eos_token_ids,
        )

    def preprocess(self, request_input: TextOrChat | None, max_tokens: int | None) -> Preprocessed:
        """Token ids, bucket, block hashes and resolved max_tokens for one generation request."""
        if request_input is None:
            raise InvalidArgument("input", "set one of prompt or chat")
        validation.check_requested_max_tokens(max_tokens, self.limits)
        if isinstance(request_input, str):
            validation.check_prompt(request_input)
        token_ids, _ = self._encode(request_input, add_special_tokens=None)
        field = "prompt" if isinstance(request_input, str) else "chat"
        resolved_max_tokens = validation.resolve_max_tokens(field, len(token_ids), max_tokens, self.limits)
        return Preprocessed(
            token_ids=token_ids,
            bucket=self.buckets.bucket_for(len(token_ids)),
            block_hashes=chain_block_hashes(token_ids, self.block_size_tokens),
            max_tokens=resolved_max_tokens,
        )

    def tokenize(self, request_input: TextOrChat | None, add_special_tokens: bool | None) -> Tokenized:
        """Token ids and their vocabulary strings; no length limits apply."""
        if request_input is None:
            raise InvalidArgument("input", "set one of text or chat")
        token_ids, rendered_prompt = self._encode(request_input, add_special_tokens)
        return Tokenized(token_ids, self.tokenizer.token_strings(token_ids), rendered_prompt)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        validation.check_token_ids(token_ids, self.tokenizer.vocab_size)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _encode(self, request_input: TextOrChat, add_special_tokens: bool | None) -> tuple[list[int], str]:
        """Ids plus the rendered chat ("" for text). `add_special_tokens` applies to text only
        (unset: true); a rendered chat already holds its special tokens as text."""
        if isinstance(request_input, str):
            validation.check_prompt_bytes("prompt", len(request_input.encode("utf-8")), self.limits)
            add = True if add_special_tokens is None else add_special_tokens
            return self.tokenizer.encode(request_input, add_special_tokens=add), ""
        validation.check_chat(request_input.messages, has_chat_template=self.chat_template is not None)
        num_bytes = sum(len(m.content.encode("utf-8")) + len(m.role) for m in request_input.messages)
        validation.check_prompt_bytes("chat.messages", num_bytes, self.limits)
        rendered = self.chat_template.render(
            request_input.messages, add_generation_prompt=request_input.add_generation_prompt
        )
        return self.tokenizer.encode(rendered, add_special_tokens=False), rendered


def _compile_chat_template(model: ModelFiles, tokenizer: ModelTokenizer) -> ChatTemplate | None:
    if model.chat_template is None:
        log.info("%s has no chat template: chat requests will be rejected", model.path)
        return None
    try:
        return ChatTemplate(model.chat_template, tokenizer.special_tokens)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{model.path}: the chat template does not compile: {exc}") from exc
