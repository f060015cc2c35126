"""Incremental detokenizer: whole characters only, deltas add up to the full decode."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from llmserve.gateway.detokenizer import REPLACEMENT_CHAR, Detokenizer
from llmserve.text_decoder import TextDecoder
from llmserve.tools.tiny_model import build_tokenizer

MULTI_BYTE_TEXTS = [
    "é",
    "東京",
    "🙂",
    "Héllo wörld — naïve café, 東京 and 北京 are cities; emoji 🙂🚀 test multi-byte text.",
    "plain ascii: The capital of France is Paris.",
    "🙂🚀東京é",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    out_dir = tmp_path_factory.mktemp("tok")
    build_tokenizer(out_dir)
    return Tokenizer.from_file(str(out_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def detokenizer(tokenizer) -> Detokenizer:
    return Detokenizer(TextDecoder(tokenizer, {}))


def byte_token_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: the worst split a byte-level BPE model can produce."""
    byte_to_char = {b: c for b, c in zip(range(256), _byte_level_alphabet())}
    return [tokenizer.token_to_id(byte_to_char[b]) for b in text.encode("utf-8")]


def _byte_level_alphabet() -> list[str]:
    # GPT-2's bytes_to_unicode table, which the ByteLevel pre-tokenizer uses.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def stream_deltas(detokenizer: Detokenizer, token_ids: list[int], chunk_size: int = 1, prompt=()) -> list[str]:
    stream = detokenizer.new_stream(prompt)
    deltas = [stream.push(token_ids[i : i + chunk_size]) for i in range(0, len(token_ids), chunk_size)]
    deltas.append(stream.flush())
    return deltas


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
@pytest.mark.parametrize("chunk_size", [1, 2, 3])
def test_bpe_tokens_deltas_add_up_and_never_split_a_character(tokenizer, detokenizer, text, chunk_size):
    token_ids = tokenizer.encode(text).ids
    deltas = stream_deltas(detokenizer, token_ids, chunk_size)
    assert "".join(deltas) == detokenizer.decoder.decode(token_ids, skip_special_tokens=True) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_tokenizer_really_splits_characters_across_tokens(tokenizer):
    # Guard for the tests above: some single tokens decode to half a character.
    token_ids = tokenizer.encode("🙂 東京").ids
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in token_ids)


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_one_token_per_byte(tokenizer, detokenizer, text):
    token_ids = byte_token_ids(tokenizer, text)
    assert tokenizer.decode(token_ids) == text
    deltas = stream_deltas(detokenizer, token_ids)
    assert "".join(deltas) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    # Each delta is released as soon as its last byte arrives: one delta per character.
    assert [d for d in deltas if d] == list(text)


def test_four_byte_character_is_held_until_its_last_byte(tokenizer, detokenizer):
    stream = detokenizer.new_stream()
    token_ids = byte_token_ids(tokenizer, "a🙂")
    assert stream.push(token_ids[:1]) == "a"
    assert [stream.push([t]) for t in token_ids[1:]] == ["", "", "", "🙂"]
    assert stream.flush() == ""


def test_special_tokens_are_skipped(tokenizer, detokenizer):
    im_end = tokenizer.token_to_id("<|im_end|>")
    im_start = tokenizer.token_to_id("<|im_start|>")
    token_ids = [im_start, *tokenizer.encode("café 東京").ids, im_end]
    deltas = stream_deltas(detokenizer, token_ids)
    assert "".join(deltas) == "café 東京"


def test_prompt_tokens_are_context_only(tokenizer, detokenizer):
    prompt_ids = tokenizer.encode("The capital of France is").ids
    output_ids = tokenizer.encode(" Paris. 東京 🙂").ids
    deltas = stream_deltas(detokenizer, output_ids, prompt=prompt_ids)
    assert "".join(deltas) == " Paris. 東京 🙂"


def test_prompt_ending_mid_character_does_not_leak_into_output(tokenizer, detokenizer):
    prompt_ids = byte_token_ids(tokenizer, "x🙂")[:-2]  # ends with 2 of 🙂's 4 bytes
    output_ids = tokenizer.encode("ok é").ids
    deltas = stream_deltas(detokenizer, output_ids, prompt=prompt_ids)
    assert "".join(deltas) == "ok é"


def test_flush_emits_an_incomplete_character_at_the_end(tokenizer, detokenizer):
    stream = detokenizer.new_stream()
    b_id, lead_byte_id = byte_token_ids(tokenizer, "b🙂")[:2]
    assert stream.push([b_id]) == "b"
    assert stream.push([lead_byte_id]) == ""
    assert stream.flush() == REPLACEMENT_CHAR


def test_invalid_utf8_is_not_held_back_forever(tokenizer, detokenizer):
    # A model can emit lead bytes that never complete; after MAX_HELD_BACK_TOKENS the text goes out.
    lead_byte = byte_token_ids(tokenizer, "東")[0]
    stream = detokenizer.new_stream()
    deltas = [stream.push([lead_byte]) for _ in range(6)]
    assert deltas[:4] == ["", "", "", ""]
    assert REPLACEMENT_CHAR in "".join(deltas)


def test_from_model_dir(tmp_path):
    build_tokenizer(tmp_path)
    detokenizer = Detokenizer.from_model_dir(tmp_path)
    token_ids = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("東京").ids
    assert detokenizer.decoder.decode(token_ids, skip_special_tokens=True) == "東京"
