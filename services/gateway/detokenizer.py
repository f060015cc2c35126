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

The windows are decoded without transformers' space clean-up; where the model's rule has one
(llmserve.text_decoder, shared with preprocess's Detokenize), it runs on the emitted stream, so
the deltas add up to `tokenizer.decode` of the whole output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from llmserve.text_decoder import CleanUpStream, TextDecoder

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as decoding context for the first output tokens (so that a leading-space
# marker on the first output token decodes as a space, as it would mid-text).
NUM_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, so with valid output at most 4 tokens can be waiting
# for the rest of one character. More than that means the model produced invalid UTF-8: emit it
# (with its replacement characters) instead of holding text back for the rest of the request.
MAX_HELD_BACK_TOKENS = 4


class Detokenizer:
    """The model's decode rule, loaded once and shared by all requests (no request state)."""

    def __init__(self, decoder: TextDecoder):
        self.decoder = decoder

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "Detokenizer":
        return cls(TextDecoder.from_model_dir(model_dir))

    def decode_window(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens (EOS, template markers) left out, not cleaned up."""
        return self.decoder.decode_without_clean_up(token_ids, skip_special_tokens=True)

    def new_stream(self, prompt_token_ids: Sequence[int] = ()) -> "DetokenizerStream":
        """Per-request state; the prompt's last tokens serve as decoding context only."""
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        return DetokenizerStream(
            detokenizer=self,
            token_ids=context,
            prefix_offset=0,
            read_offset=len(context),
            clean_up=self.decoder.new_clean_up(),
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
    clean_up: CleanUpStream | None = None  # the model's space clean-up, if its rule has one
    # The text of tokens[prefix_offset:read_offset], decoded once per window move rather than
    # at every push (None: not decoded yet for this window).
    _emitted_text: str | None = None

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly completed text ("" while a character is incomplete)."""
        self.token_ids.extend(new_token_ids)
        text = self._completed_text()
        return self.clean_up.push(text) if self.clean_up is not None else text

    def flush(self) -> str:
        """Emit whatever is held back; call once after the last token."""
        text = self._advance_to(len(self.token_ids))
        return text + self.clean_up.flush() if self.clean_up is not None else text

    def _completed_text(self) -> str:
        end = len(self.token_ids)
        full_text = self._decode(self.prefix_offset, end)
        if not full_text.endswith(REPLACEMENT_CHAR):
            return self._advance_to(end, full_text)
        if end - self.read_offset <= MAX_HELD_BACK_TOKENS:
            return ""  # the incomplete character's remaining bytes may still come
        # A chunk of several tokens ending mid-character: the text before the last
        # MAX_HELD_BACK_TOKENS tokens is complete, unless the model emitted invalid UTF-8 there.
        return self._advance_to(end - MAX_HELD_BACK_TOKENS)

    def _decode(self, start: int, end: int) -> str:
        return self.detokenizer.decode_window(self.token_ids[start:end])

    def _advance_to(self, end: int, full_text: str | None = None) -> str:
        """Emit the text of tokens[read_offset:end] and move the window there (`full_text`: that
        of tokens[prefix_offset:end], when the caller decoded it already)."""
        if self._emitted_text is None:
            self._emitted_text = self._decode(self.prefix_offset, self.read_offset)
        emitted_text = self._emitted_text
        if full_text is None:
            full_text = self._decode(self.prefix_offset, end)
        if len(full_text) <= len(emitted_text):
            # Special tokens (skipped) or tokens without text yet: nothing new to show, and the
            # window must not move past tokens whose text was never emitted.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = end
        self._emitted_text = None
        return full_text[len(emitted_text) :]
