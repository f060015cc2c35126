"""Token ids → text, with the one rule both preprocess (Detokenize) and the gateway (streamed
output) apply: the same text transformers' `tokenizer.decode` gives.

That is the Rust tokenizer's decode, then `clean_up_tokenization` when tokenizer_config.json
sets `clean_up_tokenization_spaces` (transformers skips it for BPE models, where it would delete
real spaces, unless `clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`).

Decoding goes through `decode_batch` on purpose: in tokenizers 0.23 `Tokenizer.decode` holds the
GIL for the whole call, `decode_batch` releases it, so worker threads decode in parallel.

Streamed text is decoded in windows (llmserve.gateway.detokenizer), so the clean-up cannot run
per window: it would delete a space already sent. `CleanUpStream` applies it to the stream
instead, holding back text from the last space until no clean-up pattern can still reach it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import tokenizers

# transformers' PreTrainedTokenizerBase.clean_up_tokenization, in its order. Every pattern starts
# with a space and only deletes spaces.
_CLEAN_UP_REPLACEMENTS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and contractions, byte for byte."""
    for pattern, replacement in _CLEAN_UP_REPLACEMENTS:
        text = text.replace(pattern, replacement)
    return text


def read_tokenizer_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _cleans_up(backend: tokenizers.Tokenizer, tokenizer_config: dict) -> bool:
    if not tokenizer_config.get("clean_up_tokenization_spaces", False):
        return False
    is_bpe = type(backend.model).__name__ == "BPE"
    return not is_bpe or bool(
        tokenizer_config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    )


class TextDecoder:
    """The model's decode rule. Thread-safe; holds no request state."""

    def __init__(self, backend: tokenizers.Tokenizer, tokenizer_config: dict):
        self._backend = backend
        self.cleans_up = _cleans_up(backend, tokenizer_config)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "TextDecoder":
        """Read tokenizer.json and tokenizer_config.json from a checkpoint directory."""
        backend = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        return cls(backend, read_tokenizer_config(model_dir))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        """The text transformers' `tokenizer.decode(token_ids, skip_special_tokens=...)` gives."""
        text = self.decode_without_clean_up(token_ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.cleans_up else text

    def decode_without_clean_up(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        """The tokenizer's own decode; streams pass it through a CleanUpStream (`new_clean_up`)."""
        return self._backend.decode_batch([list(token_ids)], skip_special_tokens=skip_special_tokens)[0]

    def new_clean_up(self) -> "CleanUpStream | None":
        """Per-stream clean-up state; None when this model's rule has no clean-up."""
        return CleanUpStream() if self.cleans_up else None


class CleanUpStream:
    """`clean_up_tokenization` over text that arrives in pieces: the pieces it returns add up to
    the clean-up of the whole text.

    A pattern starts at a space and spans at most 4 characters, and a replacement only deletes
    spaces. So the text before a space is final once cleaned unless a pattern can reach across
    that space: one ending in it (" ' "), one formed when " ' " after it deletes it (" 'm" from
    "  ' m", " n't" from " n ' t"). `_can_cut_at` excludes exactly those; the rest waits.
    """

    def __init__(self) -> None:
        self._held_back = ""

    def push(self, text: str) -> str:
        self._held_back += text
        cut = _last_safe_cut(self._held_back)
        ready, self._held_back = self._held_back[:cut], self._held_back[cut:]
        return clean_up_tokenization(ready)

    def flush(self) -> str:
        ready, self._held_back = self._held_back, ""
        return clean_up_tokenization(ready)


def _can_cut_at(text: str, space: int) -> bool:
    before = text[:space]
    return not before.endswith((" ", "'", " n"))


def _last_safe_cut(text: str) -> int:
    """The largest index up to which `text` can be cleaned now (a space, or the end)."""
    if " " not in text:
        return len(text)  # no pattern can start here (nor later, without a space)
    cut = text.rfind(" ")
    while cut > 0 and not _can_cut_at(text, cut):
        cut = text.rfind(" ", 0, cut)
    return max(cut, 0)
