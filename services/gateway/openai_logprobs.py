"""Logprobs in OpenAI's two shapes (issue 21), from the engine's TokenLogprobs: chat's
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}` and completions' parallel
lists `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.

A token's text is its own decode (special tokens kept), as OpenAI-compatible servers give it: a
token holding part of a UTF-8 character decodes to U+FFFD, and its `bytes` are those of that text,
not the raw byte piece (the tokenizer's decoder gives no other).
"""

from __future__ import annotations

from typing import Callable

from llmserve.sampling import TokenLogprob

TokenText = Callable[[int], str]


def chat_logprobs(items: list[TokenLogprob], token_text: TokenText) -> dict:
    return {"content": [_chat_entry(item, token_text) for item in items]}


def _chat_entry(item: TokenLogprob, token_text: TokenText) -> dict:
    text = token_text(item.token_id)
    return {
        "token": text, "logprob": item.logprob, "bytes": list(text.encode()),
        "top_logprobs": [
            {"token": (top := token_text(t.token_id)), "logprob": t.logprob, "bytes": list(top.encode())}
            for t in item.top_logprobs
        ],
    }  # fmt: skip


class CompletionLogprobs:
    """Completions' lists for one choice; `text_offset` runs on over the chunks of a stream."""

    def __init__(self, token_text: TokenText):
        self._token_text = token_text
        self._offset = 0

    def of(self, items: list[TokenLogprob]) -> dict:
        tokens, offsets = [], []
        for item in items:
            text = self._token_text(item.token_id)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [item.logprob for item in items],
            "top_logprobs": [{self._token_text(t.token_id): t.logprob for t in item.top_logprobs} for item in items],
            "text_offset": offsets,
        }
