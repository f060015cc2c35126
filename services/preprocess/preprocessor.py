"""The preprocess pipeline, free of protobuf and of asyncio.

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
Steps 2-5 (`preprocess`, `tokenize`) are synchronous and thread-safe; the servicer runs them on
worker threads, after `check` on the event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import jinja2

from llmserve.block_hash import HASH_VERSION, HashNamespace
from llmserve.buckets import BucketConfig, LengthBucket
from llmserve.errors import InvalidArgument
from llmserve.message_limits import MAX_TOKEN_ID_BYTES
from llmserve.model_files import ModelFiles
from llmserve.preprocess.chat_template import ChatTemplate
from llmserve.preprocess.config import PreprocessConfig
from llmserve.preprocess.tokenizer import ModelTokenizer
from llmserve.preprocess import validation
from llmserve.preprocess.validation import Limits
from llmserve.sampling import ChatMessage

log = logging.getLogger(__name__)

# The request field a token-id prompt comes in (error messages name it).
_TOKEN_IDS_FIELD = "prompt_token_ids"


@dataclass(frozen=True, slots=True)
class Chat:
    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True


@dataclass(frozen=True, slots=True)
class PromptTokenIds:
    """A prompt given as token ids: used as they are, no template, no special tokens added."""

    token_ids: list[int]


# What to tokenize: raw text, or a chat to render first.
TextOrChat = str | Chat
# What to generate from.
PromptInput = TextOrChat | PromptTokenIds


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
    has_chat_template: bool

    @property
    def block_size_tokens(self) -> int:
        return self.hash_namespace.block_size_tokens


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
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.limits = limits
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
            hash_namespace=HashNamespace.of_model_dir(model.path, config.block_size_tokens),
            model_name=model.model_name,
            eos_token_ids=model.eos_token_ids,
        )

    def check(self, request_input: PromptInput | None, max_tokens: int | None) -> int:
        """Step 1 of a generation request: raises InvalidArgument, else returns the prompt's
        size in bytes (what the request holds while it waits for a worker)."""
        if request_input is None:
            raise InvalidArgument("input", "set one of prompt, chat or prompt_token_ids")
        validation.check_requested_max_tokens(max_tokens, self.limits)
        if isinstance(request_input, PromptTokenIds):
            return self._check_token_ids(request_input.token_ids, max_tokens)
        if isinstance(request_input, str):
            validation.check_prompt(request_input)
        return self._check_text_or_chat(request_input, text_field="prompt")

    def preprocess(self, request_input: PromptInput, max_tokens: int | None, cache_salt: str) -> Preprocessed:
        """Steps 2-5 for an input that passed `check`: token ids, bucket, block hashes (for
        `cache_salt`, "" = none) and resolved max_tokens."""
        if isinstance(request_input, PromptTokenIds):
            token_ids, field = request_input.token_ids, _TOKEN_IDS_FIELD
        else:
            token_ids, _ = self._encode(request_input, add_special_tokens=None)
            field = "prompt" if isinstance(request_input, str) else "chat"
        resolved_max_tokens = validation.resolve_max_tokens(field, len(token_ids), max_tokens, self.limits)
        return Preprocessed(
            token_ids=token_ids,
            bucket=self.buckets.bucket_for(len(token_ids)),
            block_hashes=self.hash_namespace.block_hashes(token_ids, cache_salt),
            max_tokens=resolved_max_tokens,
        )

    def check_tokenize(self, request_input: TextOrChat | None) -> int:
        """`check` for a Tokenize request (no length limits but the byte cap apply)."""
        if request_input is None:
            raise InvalidArgument("input", "set one of text or chat")
        return self._check_text_or_chat(request_input, text_field="text")

    def tokenize(self, request_input: TextOrChat, add_special_tokens: bool | None) -> Tokenized:
        """Token ids and their vocabulary strings, for an input that passed `check_tokenize`."""
        token_ids, rendered_prompt = self._encode(request_input, add_special_tokens)
        return Tokenized(token_ids, self.tokenizer.token_strings(token_ids), rendered_prompt)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        validation.check_token_ids("token_ids", token_ids, self.tokenizer.vocab_size)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _check_text_or_chat(self, request_input: TextOrChat, *, text_field: str) -> int:
        if isinstance(request_input, str):
            num_bytes = validation.utf8_bytes(request_input)
            validation.check_prompt_bytes(text_field, num_bytes, self.limits)
            return num_bytes
        validation.check_chat(request_input.messages, has_chat_template=self.chat_template is not None)
        num_bytes = validation.chat_bytes(request_input.messages)
        validation.check_prompt_bytes("chat.messages", num_bytes, self.limits)
        return num_bytes

    def _check_token_ids(self, token_ids: list[int], max_tokens: int | None) -> int:
        if not token_ids:
            raise InvalidArgument(f"{_TOKEN_IDS_FIELD}.token_ids", "must not be empty")
        # The count first: it bounds the vocabulary scan by the context.
        validation.resolve_max_tokens(_TOKEN_IDS_FIELD, len(token_ids), max_tokens, self.limits)
        validation.check_token_ids(f"{_TOKEN_IDS_FIELD}.token_ids", token_ids, self.tokenizer.vocab_size)
        return len(token_ids) * MAX_TOKEN_ID_BYTES

    def _encode(self, request_input: TextOrChat, add_special_tokens: bool | None) -> tuple[list[int], str]:
        """Ids plus the rendered chat ("" for text). `add_special_tokens` applies to text only
        (unset: true); a rendered chat already holds its special tokens as text."""
        if isinstance(request_input, str):
            add = True if add_special_tokens is None else add_special_tokens
            return self.tokenizer.encode(request_input, add_special_tokens=add), ""
        rendered = self.chat_template.render(
            request_input.messages, add_generation_prompt=request_input.add_generation_prompt
        )
        # A template may add text per turn: what is tokenized is held to the cap too.
        validation.check_prompt_bytes("chat", validation.utf8_bytes(rendered), self.limits)
        return self.tokenizer.encode(rendered, add_special_tokens=False), rendered


def _compile_chat_template(model: ModelFiles, tokenizer: ModelTokenizer) -> ChatTemplate | None:
    if model.chat_template is None:
        log.info("%s has no chat template: chat requests will be rejected", model.path)
        return None
    try:
        return ChatTemplate(model.chat_template, tokenizer.special_tokens)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{model.path}: the chat template does not compile: {exc}") from exc
