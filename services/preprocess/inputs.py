"""What a preprocess request asks to tokenize, as internal types (the servicer converts to them)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.sampling import ChatMessage


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
