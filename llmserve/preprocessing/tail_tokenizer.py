"""Tokenize a rendered chat by reusing the ids of a prefix of it that was tokenized before.

A multi-turn chat renders to the previous turn's text plus a new tail, and a system prompt to
the start of every conversation that uses it. Tokenizing only the tail is not safe at the seam:
BPE merges and pre-tokenizer rules look across it (a newline that joins the next one, a multi-
byte character whose bytes merge with what follows), so the prefix's last ids may change once
text follows them. The splice therefore backs off to the prefix's last *boundary token*, an
added token such as `<|im_start|>` that the tokenizer cuts the text on before it normalizes or
pre-tokenizes anything (`ModelTokenizer.boundary_tokens`): the text on either side of one is
tokenized independently, so

    ids(text) == prefix_ids[:anchor] + ids(text[anchor_offset:])

whenever the boundary token is matched at `anchor_offset` in both texts. Two checks make that
hold rather than hope for it: a prefix is only used when its textual occurrences of the token
are exactly its ids of the token (so the anchor id is the last occurrence's), and a splice is
only accepted when the re-tokenized window starts with the anchor id (the token was matched
there in the new text too). Otherwise the caller tokenizes the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True, slots=True)
class Seam:
    """Where a splice cuts a prefix: at its last boundary token."""

    text_offset: int  # the boundary token's first character in the prefix text
    num_kept_ids: int  # prefix ids before it (the boundary token's own index)
    anchor_id: int  # the boundary token's id


@dataclass(frozen=True, slots=True)
class TokenizedPrefix:
    """A rendered text and its full tokenization (no special tokens added), with its seam
    (None: it has no usable boundary token, so a splice on it is never tried)."""

    text: str
    token_ids: list[int]
    seam: Seam | None

    @property
    def num_bytes(self) -> int:
        """About what the entry holds in memory (text, the list and its int objects)."""
        return len(self.text) + 36 * len(self.token_ids)


class TailTokenizer:
    """Finds seams and checks splices; pure and thread-safe."""

    def __init__(self, boundary_tokens: Mapping[str, int]):
        self._boundary_tokens = dict(boundary_tokens)

    @property
    def is_enabled(self) -> bool:
        return bool(self._boundary_tokens)

    def prefix(self, text: str, token_ids: list[int]) -> TokenizedPrefix:
        """`text` with its full tokenization, and the seam a later splice cuts it at."""
        return TokenizedPrefix(text, token_ids, self._seam(text, token_ids))

    def window(self, text: str, prefix: TokenizedPrefix) -> str | None:
        """What to re-tokenize of `text` on top of `prefix`: from the seam on; None when the
        prefix is not a prefix of `text` (the template rendered the earlier turns differently)
        or has no seam."""
        if prefix.seam is None or not text.startswith(prefix.text):
            return None
        return text[prefix.seam.text_offset :]

    @staticmethod
    def splice(prefix: TokenizedPrefix, window_ids: list[int]) -> list[int] | None:
        """The full text's ids from the prefix's and the window's, or None when the window does not
        start with the anchor token (then only a full tokenization is right)."""
        seam = prefix.seam
        if seam is None or not window_ids or window_ids[0] != seam.anchor_id:
            return None
        return prefix.token_ids[: seam.num_kept_ids] + window_ids

    def _seam(self, text: str, token_ids: list[int]) -> Seam | None:
        best: Seam | None = None
        for token_text, token_id in self._boundary_tokens.items():
            offset = text.rfind(token_text)
            if offset < 0 or (best is not None and offset <= best.text_offset):
                continue
            if text.count(token_text) != token_ids.count(token_id):
                continue  # some occurrence was not matched as the token: no safe anchor
            index = len(token_ids) - 1 - token_ids[::-1].index(token_id)
            best = Seam(text_offset=offset, num_kept_ids=index, anchor_id=token_id)
        return best
