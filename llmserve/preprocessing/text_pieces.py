"""A long text tokenized in pieces on the tokenizer's threads, with exactly the whole text's ids.

Why: one prompt is one `encode` on one core. On the H100 host a 512-token text of new words took
2.9 ms after 5 ms idle, and 0.97 ms cut into 8 pieces handed to `encode_batch_fast` in one call,
whose Rust threads (rayon) encode them at once (docs/benchmarks.md, "Fifteenth session"). At
one stream that is most of what tokenizing adds to the first token.

Where a text may be cut: before a space that has an ASCII letter on each side ("word| word").
For the tokenizers this module accepts (`why_not_cuttable`), nothing looks across that point:
  - the normalizer, if any, is NFC or NFKC: they compose a character with the marks that follow
    it, and a space is neither;
  - the pre-tokenizer is byte-level BPE's: GPT-2's regex (ByteLevel with use_regex), or one of
    the split regexes in KNOWN_SPLIT_PATTERNS, with Digits. In each, no alternative matches a
    letter followed by a space, so the piece holding the letter ends before the space; the space
    starts the next piece (" ?\\p{L}+" or "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+", tried before any
    whitespace rule), which a scan restarted at the space finds alike. They have no lookbehind or
    anchors, and their one lookahead, "\\s+(?!\\S)", only ends runs of whitespace;
  - BPE merges within a pre-tokenized piece, never across;
  - no added token holds whitespace or strips it (lstrip/rstrip): none spans the cut or eats
    the space;
  - no truncation, padding or special-token-as-text mode.
The pieces are encoded without special tokens, merged, and post-processed once, as `encode`
post-processes the whole text. tests/test_text_pieces.py checks the ids against the whole text's
on every tokenizer the tests have, on generated texts.
"""

from __future__ import annotations

import argparse
import json

import tokenizers

from llmserve.cores import available_cores

# Split regexes of the Qwen2/2.5/3 and Llama-3 tokenizers (tokenizer.json, exact text).
KNOWN_SPLIT_PATTERNS = frozenset({
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
})
_CUTTABLE_NORMALIZERS = frozenset({"NFC", "NFKC"})
# Shorter pieces cost more in hand-offs than they save.
MIN_PIECE_CHARS = 256
# 8 was the fastest of 2, 4 and 8 for a 512-token text on a 16-core host; no more than the cores.
DEFAULT_MAX_TEXT_PIECES = min(8, available_cores())


def add_text_pieces_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--tokenize-pieces", dest="max_text_pieces", type=int, default=DEFAULT_MAX_TEXT_PIECES, metavar="N",
        help="tokenize a lone prompt text of at least 512 characters in up to N pieces at once on the "
        "tokenizer's threads, cut where the ids cannot change (before a space between ASCII letters, for "
        "byte-level BPE tokenizers known to allow it; others are tokenized whole, said in the log); 1: whole "
        "(default: 8 or the cores, fewer: %(default)s)",
    )


def why_not_cuttable(backend: tokenizers.Tokenizer) -> str | None:
    """None when texts may be cut as the module docstring says; else the reason, for the log."""
    if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens:
        return "it truncates, pads or tokenizes special tokens as text"
    model = type(backend.model).__name__
    if model != "BPE":
        return f"its model is {model}, not BPE"
    # Each component's own settings, not `backend.to_str()`: that serializes the whole
    # vocabulary (~0.2 s for Qwen3's) at every start-up.
    pre_tokenizer = _spec(backend.pre_tokenizer)
    reason = _why_not_normalizer(_spec(backend.normalizer)) or _why_not_pre_tokenizer(pre_tokenizer)
    if reason:
        return reason
    parts = pre_tokenizer["pretokenizers"] if pre_tokenizer["type"] == "Sequence" else [pre_tokenizer]
    if not any(_splits_words(part) for part in parts):
        return "its pre-tokenizer does not split words: BPE would merge across a cut"
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or any(c.isspace() for c in token.content):
            return f"its added token {token.content!r} holds or strips whitespace"
    return None


def _spec(component) -> dict | None:
    """A normalizer's or pre-tokenizer's settings as tokenizer.json writes them (None: unset)."""
    return None if component is None else json.loads(component.__getstate__())


def _why_not_normalizer(normalizer: dict | None) -> str | None:
    if normalizer is None:
        return None
    if normalizer["type"] == "Sequence":
        return next(filter(None, map(_why_not_normalizer, normalizer["normalizers"])), None)
    return None if normalizer["type"] in _CUTTABLE_NORMALIZERS else f"its normalizer {normalizer['type']} may look across a cut"


def _why_not_pre_tokenizer(pre_tokenizer: dict | None) -> str | None:
    if pre_tokenizer is None:
        return "it has no pre-tokenizer: BPE would merge across a cut"
    kind = pre_tokenizer["type"]
    if kind == "Sequence":
        return next(filter(None, map(_why_not_pre_tokenizer, pre_tokenizer["pretokenizers"])), None)
    if kind == "ByteLevel":
        return "its ByteLevel pre-tokenizer adds a prefix space" if pre_tokenizer["add_prefix_space"] else None
    if kind == "Digits":
        return None
    if kind == "Split":
        pattern = pre_tokenizer["pattern"].get("Regex")
        if pattern in KNOWN_SPLIT_PATTERNS and pre_tokenizer["behavior"] == "Isolated" and not pre_tokenizer["invert"]:
            return None
        return "its split pattern is not one whose pieces are known to end before a space"
    return f"its pre-tokenizer {kind} is not one whose pieces are known to end before a space"


def _splits_words(pre_tokenizer: dict) -> bool:
    kind = pre_tokenizer["type"]
    return kind == "Split" or (kind == "ByteLevel" and pre_tokenizer.get("use_regex", True))


def cut(text: str, max_pieces: int) -> list[str]:
    """`text` in at most `max_pieces` pieces of about equal length, each at least MIN_PIECE_CHARS
    long, cut only before a space between two ASCII letters (the text itself when none fits)."""
    num_pieces = min(max_pieces, len(text) // MIN_PIECE_CHARS)
    points, start = [], 0
    for piece in range(1, num_pieces):
        point = _cut_point(text, max(start + MIN_PIECE_CHARS, len(text) * piece // num_pieces))
        if point is None or len(text) - point < MIN_PIECE_CHARS:
            break
        points.append(point)
        start = point
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _cut_point(text: str, at: int) -> int | None:
    """The first index from `at` of a space between two ASCII letters, or None."""
    while True:
        point = text.find(" ", at, len(text) - 1)
        if point <= 0:
            return None
        before, after = text[point - 1], text[point + 1]
        if before.isascii() and before.isalpha() and after.isascii() and after.isalpha():
            return point
        at = point + 1
