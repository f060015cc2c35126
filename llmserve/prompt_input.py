"""What to generate from, as internal types: raw text, chat turns or token ids. The gateway
builds one from a client's GenerateParams and sends it on; preprocess tokenizes it
(llmserve.pb converts both ways, for both)."""

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
