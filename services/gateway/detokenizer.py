"""Incremental detokenization: token ids arrive a few at a time, text leaves whole characters only.

A byte-level BPE token can end in the middle of a UTF-8 character (東 is three bytes, 🙂 four,
and either may be split over several tokens), and SentencePiece-style decoders change a token's
text depending on what precedes it (the leading-space marker). So a token cannot be decoded on its
own. The classic two-offset window fixes both:

    tokens:  ... [prefix_offset ........ read_offset ........ len(tokens)]
                  \\_ already emitted, kept _/ \\_ not yet emitted _____/
                      as decoding context

Each step decodes tokens[prefix_offset:] and tokens[prefix_offset:read_offset]; the difference is
the new text. If the new text ends in U+FFFD (a character whose remaining bytes have not arrived
yet) it is held back until a later token completes it. `flush` emits whatever is left at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as decoding context for the first output tokens (so that a leading-space
# marker on the first output token decodes as a space, as it would mid-text).
NUM_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, so with valid output at most 4 tokens can be waiting
# for the rest of one character. More than that means the model produced invalid UTF-8: emit it
# (with its replacement characters) instead of holding text back for the rest of the request.
MAX_PENDING_TOKENS = 4


class Detokenizer:
    """The model's tokenizer, loaded once and shared by all requests (it holds no request state)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "Detokenizer":
        return cls(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids` with special tokens (EOS, template markers) left out."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def new_stream(self, prompt_token_ids: Sequence[int] = ()) -> "DetokenizerStream":
        """Per-request state; the prompt's last tokens serve as decoding context only."""
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        return DetokenizerStream(
            detokenizer=self,
            token_ids=context,
            prefix_offset=0,
            read_offset=len(context),
        )


@dataclass(slots=True)
class DetokenizerStream:
    """Incremental text of one sequence. `push` new token ids, get the text they completed."""

    detokenizer: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    # tokens[prefix_offset:read_offset] were emitted already and are kept as decoding context;
    # tokens[read_offset:] are not emitted yet.
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly completed text ("" while a character is incomplete)."""
        self.token_ids.extend(new_token_ids)
        emitted_text, full_text = self._decode_window()
        num_pending_tokens = len(self.token_ids) - self.read_offset
        if full_text.endswith(REPLACEMENT_CHAR) and num_pending_tokens <= MAX_PENDING_TOKENS:
            return ""
        return self._advance(emitted_text, full_text)

    def flush(self) -> str:
        """Emit whatever is held back; call once after the last token."""
        emitted_text, full_text = self._decode_window()
        return self._advance(emitted_text, full_text)

    def _decode_window(self) -> tuple[str, str]:
        decode = self.detokenizer.decode
        emitted_text = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = decode(self.token_ids[self.prefix_offset :])
        return emitted_text, full_text

    def _advance(self, emitted_text: str, full_text: str) -> str:
        if len(full_text) <= len(emitted_text):
            # Special tokens (skipped) or tokens without text yet: nothing new to show, and the
            # window must not move past tokens whose text was never emitted.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full_text[len(emitted_text) :]
