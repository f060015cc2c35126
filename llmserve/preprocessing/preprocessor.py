"""The preprocess pipeline's steps, free of protobuf and of asyncio.

A generation request goes through five steps:
  1. `check`, cheap enough for the event loop (nothing rendered or tokenized): an input is set,
     max_tokens within the output limit, a prompt or chat well formed and within the byte cap,
     token ids within the context and the vocabulary;
  2. a chat is rendered with the model's template (its special tokens are now text), and the
     rendered text is held to the byte cap too;
  3. tokenization: a prompt with the tokenizer's special tokens (BOS etc.), a rendered chat
     without them, as transformers' `apply_chat_template(tokenize=True)` does; token ids skip it;
  4. the prompt is checked against the context and max_tokens resolved;
  5. its length bucket and the chained hashes of its full blocks (namespaced by the model,
     tokenizer, block size and the request's cache salt) are attached.
Steps 2-3 are the BatchEncoder's (many requests at once), 4-5 are `finish`; all are synchronous
and thread-safe, and llmserve.preprocess.pipeline runs them on tokenizer threads, after `check` on
the event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import jinja2

from llmserve.block_hash import HASH_VERSION, HashNamespace
from llmserve.buckets import BucketConfig, LengthBucket
from llmserve.client_text import num_bytes
from llmserve.errors import InvalidArgument
from llmserve.message_limits import MAX_TOKEN_ID_BYTES
from llmserve.model_files import ModelFiles
from llmserve.preprocessing import validation
from llmserve.preprocessing.batch_encoder import BatchEncoder, EncodeJob, Encoding
from llmserve.preprocessing.chat_template import ChatTemplate
from llmserve.prompt_input import PromptInput, PromptTokenIds, TextOrChat
from llmserve.preprocessing.tail_tokenizer import TailTokenizer
from llmserve.preprocessing.text_pieces import DEFAULT_MAX_TEXT_PIECES
from llmserve.preprocessing.tokenizer import ModelTokenizer
from llmserve.preprocessing.validation import Limits

log = logging.getLogger(__name__)

# The request field a token-id prompt comes in (error messages name it).
TOKEN_IDS_FIELD = "prompt_token_ids"


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
    max_prompt_bytes: int
    eos_token_ids: tuple[int, ...]
    hash_namespace: HashNamespace
    block_hash_version: int
    buckets: tuple[LengthBucket, ...]
    chat_template_fingerprint: int  # 0 without a template

    @property
    def block_size_tokens(self) -> int:
        return self.hash_namespace.block_size_tokens

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template_fingerprint != 0


@dataclass(frozen=True, slots=True)
class PreprocessorSettings:
    """What a Preprocessor is built with besides its checkpoint: the preprocess service's flags
    (PreprocessConfig.preprocessor_settings), or the tier's card for the gateway's own."""

    max_output_tokens: int  # capped so that one prompt token fits the context
    block_size_tokens: int
    reuse_prefixes: bool  # a tail tokenizer for the prompt cache (chats only)
    model_name: str | None = None  # None: the name the checkpoint gives itself
    max_context_tokens: int | None = None  # None: the model's; may only lower it
    max_prompt_bytes: int | None = None  # None: derived from the context (validation.default_max_prompt_bytes)
    length_buckets: BucketConfig = BucketConfig()
    max_text_pieces: int = DEFAULT_MAX_TEXT_PIECES  # a lone long text is tokenized in up to this many pieces at once


class Preprocessor:
    """Templates, tokenizes and validates requests for one model. Build with `load`."""

    def __init__(
        self,
        *,
        tokenizer: ModelTokenizer,
        chat_template: ChatTemplate | None,
        limits: Limits,
        buckets: BucketConfig,
        hash_namespace: HashNamespace,
        model_name: str,
        eos_token_ids: tuple[int, ...],
        tail: TailTokenizer,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.limits = limits
        self.tail = tail
        self.encoder = BatchEncoder(tokenizer, chat_template, limits, tail)
        self.buckets = buckets
        self.hash_namespace = hash_namespace
        self.info = PreprocessInfo(
            model_name=model_name,
            vocab_size=tokenizer.vocab_size,
            max_context_tokens=limits.max_context_tokens,
            max_output_tokens=limits.max_output_tokens,
            max_prompt_bytes=limits.max_prompt_bytes,
            eos_token_ids=eos_token_ids,
            hash_namespace=hash_namespace,
            block_hash_version=HASH_VERSION,
            buckets=tuple(buckets.buckets()),
            chat_template_fingerprint=chat_template.fingerprint if chat_template is not None else 0,
        )

    @classmethod
    def load(
        cls, model_path: str | Path, settings: PreprocessorSettings, tokenizer: ModelTokenizer | None = None
    ) -> "Preprocessor":
        """Read the checkpoint's tokenizer, template and context once (blocking). `tokenizer`: one
        already loaded from `model_path` (the gateway shares the one it detokenizes with)."""
        model = ModelFiles.load(model_path, settings.model_name)
        tokenizer = tokenizer or ModelTokenizer.load(model.path, settings.max_text_pieces)
        limits = Limits.resolve(
            model.max_context_tokens, settings.max_context_tokens, settings.max_output_tokens,
            settings.max_prompt_bytes, tokenizer.max_token_bytes,
        )
        if limits.max_output_tokens < settings.max_output_tokens:
            log.info(
                "max output tokens capped to %d by the context of %d tokens",
                limits.max_output_tokens,
                limits.max_context_tokens,
            )
        chat_template = _compile_chat_template(model, tokenizer)
        reuse_prefixes = settings.reuse_prefixes and chat_template is not None
        return cls(
            tokenizer=tokenizer,
            chat_template=chat_template,
            limits=limits,
            buckets=settings.length_buckets.limited_to(limits.max_context_tokens),
            hash_namespace=HashNamespace.of_model_dir(model.path, settings.block_size_tokens),
            model_name=model.model_name,
            eos_token_ids=model.eos_token_ids,
            tail=TailTokenizer(_template_boundary_tokens(tokenizer, chat_template) if reuse_prefixes else {}),
        )

    def check(self, request_input: PromptInput | None, max_tokens: int | None) -> int:
        """Step 1 of a generation request: raises InvalidArgument, else returns the prompt's
        size in bytes (what the request holds while it waits for a tokenizer thread)."""
        if request_input is None:
            raise InvalidArgument("input", "set one of prompt, chat or prompt_token_ids")
        validation.check_requested_max_tokens(max_tokens, self.limits)
        if isinstance(request_input, PromptTokenIds):
            return self._check_token_ids(request_input.token_ids, max_tokens)
        if isinstance(request_input, str):
            validation.check_prompt(request_input)
        return self._check_text_or_chat(request_input, text_field="prompt")

    def finish(self, token_ids: list[int], field: str, max_tokens: int | None, cache_salt: str) -> Preprocessed:
        """Steps 4-5 once the ids are known: resolved max_tokens, bucket and block hashes (for
        `cache_salt`, "" = none). `field` names the input in errors ("prompt", "chat" or
        TOKEN_IDS_FIELD)."""
        resolved_max_tokens = validation.resolve_max_tokens(field, len(token_ids), max_tokens, self.limits)
        return Preprocessed(
            token_ids=token_ids,
            bucket=self.buckets.bucket_for(len(token_ids)),
            block_hashes=self.hash_namespace.block_hashes(token_ids, cache_salt),
            max_tokens=resolved_max_tokens,
        )

    def preprocess(self, request_input: PromptInput | None, max_tokens: int | None, cache_salt: str) -> Preprocessed:
        """Every step for one request on the calling thread, no batch and no prompt cache: what a
        process beside the tier runs for a small prompt (the gateway's local_preprocess)."""
        self.check(request_input, max_tokens)
        if isinstance(request_input, PromptTokenIds):
            return self.finish(request_input.token_ids, TOKEN_IDS_FIELD, max_tokens, cache_salt)
        field = input_field(request_input)
        job = EncodeJob(request_input, True, lambda encoding: self.finish(encoding.token_ids, field, max_tokens, cache_salt))
        [outcome] = self.encoder.encode_batch([job])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome.result

    def check_tokenize(self, request_input: TextOrChat | None) -> int:
        """`check` for a Tokenize request (no length limits but the byte cap apply)."""
        if request_input is None:
            raise InvalidArgument("input", "set one of text or chat")
        return self._check_text_or_chat(request_input, text_field="text")

    def tokenized(self, encoding: Encoding) -> Tokenized:
        """A Tokenize response's fields from an encoding."""
        token_ids = encoding.token_ids
        return Tokenized(token_ids, self.tokenizer.token_strings(token_ids), encoding.rendered_prompt)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        validation.check_token_ids("token_ids", token_ids, self.tokenizer.vocab_size)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _check_text_or_chat(self, request_input: TextOrChat, *, text_field: str) -> int:
        if isinstance(request_input, str):
            num_prompt_bytes = num_bytes(request_input)
            validation.check_prompt_bytes(text_field, num_prompt_bytes, self.limits)
            return num_prompt_bytes
        validation.check_chat(request_input.messages, has_chat_template=self.chat_template is not None)
        num_prompt_bytes = validation.chat_bytes(request_input.messages)
        validation.check_prompt_bytes("chat.messages", num_prompt_bytes, self.limits)
        return num_prompt_bytes

    def _check_token_ids(self, token_ids: list[int], max_tokens: int | None) -> int:
        if not token_ids:
            raise InvalidArgument(f"{TOKEN_IDS_FIELD}.token_ids", "must not be empty")
        # The count first: it bounds the vocabulary scan by the context.
        validation.resolve_max_tokens(TOKEN_IDS_FIELD, len(token_ids), max_tokens, self.limits)
        validation.check_token_ids(f"{TOKEN_IDS_FIELD}.token_ids", token_ids, self.tokenizer.vocab_size)
        return len(token_ids) * MAX_TOKEN_ID_BYTES


def input_field(text_or_chat: TextOrChat) -> str:
    """The request field a text or chat input comes in (error messages name it)."""
    return "prompt" if isinstance(text_or_chat, str) else "chat"


def _compile_chat_template(model: ModelFiles, tokenizer: ModelTokenizer) -> ChatTemplate | None:
    if model.chat_template is None:
        log.info("%s has no chat template: chat requests will be rejected", model.path)
        return None
    try:
        return ChatTemplate(model.chat_template, tokenizer.special_tokens)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{model.path}: the chat template does not compile: {exc}") from exc


def _template_boundary_tokens(tokenizer: ModelTokenizer, chat_template: ChatTemplate) -> dict[str, int]:
    """The boundary tokens the template writes itself: every rendered chat has them."""
    return {text: token_id for text, token_id in tokenizer.boundary_tokens().items() if text in chat_template.source}
