"""Edge validation for preprocess requests: every error names the field and the limit.

Pure functions over internal types; the pipeline calls them in order (cheap checks before
tokenization, length checks after), and they raise `InvalidArgument`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from llmserve.client_text import num_bytes, quoted
from llmserve.errors import InvalidArgument
from llmserve.sampling import ChatMessage

ALLOWED_ROLES = ("system", "user", "assistant", "tool")
_EXPECTED_ROLES = f"expected one of {', '.join(ALLOWED_ROLES)}"


@dataclass(frozen=True, slots=True)
class Limits:
    """Token limits found at start-up from the model and the flags."""

    max_context_tokens: int  # prompt + output, in tokens
    max_output_tokens: int  # largest max_tokens accepted (< max_context_tokens)
    max_prompt_bytes: int  # larger prompt or chat text is refused before tokenizing

    @classmethod
    def resolve(
        cls, model_context_tokens: int, context_flag: int | None, output_flag: int,
        prompt_bytes_flag: int | None = None, max_token_bytes: int = 1,
    ) -> "Limits":
        """Apply --max-context-tokens (may only lower the model's context), cap the output limit
        so that at least one prompt token fits, and derive the prompt byte cap unless given."""
        if context_flag is not None and context_flag > model_context_tokens:
            raise ValueError(
                f"--max-context-tokens {context_flag} exceeds the model's context of {model_context_tokens} tokens"
            )
        context = context_flag or model_context_tokens
        return cls(
            max_context_tokens=context, max_output_tokens=min(output_flag, context - 1),
            max_prompt_bytes=prompt_bytes_flag or default_max_prompt_bytes(context, max_token_bytes),
        )


# A normalizer may shrink text before tokenizing (NFC composes characters): the derived cap
# allows twice what the longest tokens could cover.
_NORMALIZATION_SLACK = 2


def default_max_prompt_bytes(max_context_tokens: int, max_token_bytes: int) -> int:
    """More UTF-8 bytes than this cannot fit the context even if every token were the longest
    one, so they are refused at once instead of being tokenized (seconds of CPU for megabytes)."""
    return max_context_tokens * max_token_bytes * _NORMALIZATION_SLACK


# What a chat turn takes on the wire besides its role and content (tags and lengths): counted
# toward the cap, so that the receive limit (cap + slack, llmserve.message_limits) holds every
# chat the cap allows, however many turns it has.
TURN_FRAMING_BYTES = 8


def chat_bytes(messages: Sequence[ChatMessage]) -> int:
    """A chat's size against the prompt byte cap: roles, contents and turn framing."""
    return sum(num_bytes(m.role) + num_bytes(m.content) + TURN_FRAMING_BYTES for m in messages)


def check_prompt_bytes(field: str, num_bytes: int, limits: Limits) -> None:
    if num_bytes > limits.max_prompt_bytes:
        raise InvalidArgument(
            field, f"{num_bytes} bytes exceeds the limit of {limits.max_prompt_bytes} bytes; not tokenized",
        )


def check_requested_max_tokens(max_tokens: int | None, limits: Limits) -> None:
    if max_tokens is None:
        return
    if max_tokens < 1:
        raise InvalidArgument("max_tokens", f"must be at least 1, got {max_tokens}")
    if max_tokens > limits.max_output_tokens:
        raise InvalidArgument(
            "max_tokens", f"{max_tokens} exceeds the server limit of {limits.max_output_tokens} output tokens"
        )


def check_prompt(prompt: str) -> None:
    if not prompt:
        raise InvalidArgument("prompt", "must not be empty")


def check_chat(messages: Sequence[ChatMessage], *, has_chat_template: bool) -> None:
    if not has_chat_template:
        raise InvalidArgument("chat", "the model has no chat template; send a prompt instead")
    if not messages:
        raise InvalidArgument("chat.messages", "must not be empty")
    for i, message in enumerate(messages):
        if not message.role:
            raise InvalidArgument(f"chat.messages[{i}].role", f"must not be empty; {_EXPECTED_ROLES}")
        if message.role not in ALLOWED_ROLES:
            raise InvalidArgument(f"chat.messages[{i}].role", f"unknown role {quoted(message.role)}; {_EXPECTED_ROLES}")


def resolve_max_tokens(field: str, num_prompt_tokens: int, requested: int | None, limits: Limits) -> int:
    """Check the prompt against the context and return max_tokens with the default applied:
    unset → whatever fits, up to the output limit. `field` names the input ("prompt"/"chat")."""
    context = limits.max_context_tokens
    if num_prompt_tokens == 0:
        raise InvalidArgument(field, "encodes to no tokens")
    if num_prompt_tokens > context:
        raise InvalidArgument(field, f"{num_prompt_tokens} tokens exceeds the model context of {context} tokens")
    if num_prompt_tokens == context:
        raise InvalidArgument(
            field, f"{num_prompt_tokens} tokens leaves no room for output in the model context of {context} tokens"
        )
    if requested is None:
        return min(context - num_prompt_tokens, limits.max_output_tokens)
    if num_prompt_tokens + requested > context:
        raise InvalidArgument(
            "max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({requested}) exceeds the model context of {context} tokens",
        )
    return requested


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Every id below `vocab_size`; the first one that is not is named as `field[i]`."""
    if not token_ids or max(token_ids) < vocab_size:
        return
    for i, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            raise InvalidArgument(f"{field}[{i}]", f"{token_id} is outside the vocabulary of {vocab_size} tokens")
