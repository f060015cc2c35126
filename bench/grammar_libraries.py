"""The three grammar libraries bench_grammar.py compares, behind one small adapter each: build the
tokenizer's index once, compile a JSON schema (or any JSON object), make a matcher, fill a batch
of bitmask rows ([rows, ceil(vocab / 32)] int32, bit set = allowed) and advance a matcher by a
token. Only the bench uses these; the engine's own adapter is services/inference/engine/grammar.py.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

# The engine's options (engine/grammar.py): no free whitespace, json.dumps' separators.
LLGUIDANCE_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Xgrammar:
    name = "xgrammar"
    modules = ("xgrammar",)  # imported before setup is timed

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        # The cache is ours (engine/grammar.py), so its own is off: every compile is measured cold.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        self._batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict | None) -> Any:
        if schema is None:
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        return self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def reset(self, matcher) -> None:
        matcher.reset()


class Llguidance:
    name = "llguidance"
    modules = ("llguidance", "llguidance.torch")

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        import llguidance
        import llguidance.torch

        self._ll = llguidance
        # As the engine builds it (engine/grammar.py): from the tokenizer.json text.
        self._tokenizer = llguidance.LLTokenizer(hf_tokenizer.backend_tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids)
        self._executor = llguidance.LLExecutor()

    def compile(self, schema: dict | None) -> Any:
        grammar = self._ll.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, defaults=LLGUIDANCE_OPTIONS
        )
        matcher = self._ll.LLMatcher(self._tokenizer, grammar)  # builds the lexer: the compile step
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled) -> Any:
        return self._ll.LLMatcher(self._tokenizer, compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            self._ll.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self._ll.torch.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def reset(self, matcher) -> None:
        matcher.reset()


class OutlinesCore:
    """outlines-core compiles a schema to a regex and the regex to a token-level DFA index: no
    recursion, so `json_object` is a regex of bounded nesting (its build_regex_from_schema's)."""

    name = "outlines-core"
    modules = ("outlines_core",)

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        import outlines_core

        self._oc = outlines_core
        self._vocabulary = outlines_core.Vocabulary(eos_token_ids[0], _token_bytes(hf_tokenizer, set(eos_token_ids)))

    def compile(self, schema: dict | None) -> Any:
        regex = self._oc.json_schema.build_regex_from_schema(json.dumps(schema if schema is not None else {"type": "object"}))
        return self._oc.Index(regex, self._vocabulary)

    def matcher(self, compiled) -> Any:
        return self._oc.Guide(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        # No batched entry point: one row at a time.
        width = bitmask.shape[1]
        for row, guide in enumerate(matchers):
            guide.write_mask_into(bitmask[row].data_ptr(), width, 4)

    def accept(self, matcher, token_id: int) -> bool:
        try:
            matcher.advance(token_id, return_tokens=False)
        except ValueError:
            return False
        return True

    def reset(self, matcher) -> None:
        matcher.reset()


LIBRARIES = {cls.name: cls for cls in (Xgrammar, Llguidance, OutlinesCore)}


def _token_bytes(hf_tokenizer, skip_ids: set[int]) -> dict[bytes, list[int]]:
    """Each normal token's bytes (byte-level BPE tokens spell bytes with GPT-2's printable
    alphabet), for outlines-core's Vocabulary; special tokens are left out."""
    to_byte = {char: byte for byte, char in _bytes_to_unicode().items()}
    special = set(hf_tokenizer.all_special_ids) | skip_ids
    vocabulary: dict[bytes, list[int]] = {}
    for token, token_id in hf_tokenizer.get_vocab().items():
        if token_id in special or any(char not in to_byte for char in token):
            continue
        vocabulary.setdefault(bytes(to_byte[char] for char in token), []).append(token_id)
    return vocabulary


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars
