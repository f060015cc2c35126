"""A lone long text tokenized in pieces gives exactly the whole text's ids
(llmserve.preprocessing.text_pieces), on every tokenizer the tests have; tokenizers whose
pipeline could look across a cut are tokenized whole."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, processors

from llmserve.preprocessing import text_pieces
from llmserve.preprocessing.tokenizer import ModelTokenizer
from tests.preprocess_models import metaspace_model_dir, qwen3_model_dir

# Fragments that meet at a cut: words, runs of spaces, tabs and newlines, digits, contractions,
# accents composed and combining, CJK, emoji, punctuation, and added tokens' texts.
FRAGMENTS = [
    "word", "Paris", "it's", "we'll", "x", " ", "  ", "   ", "\t", "\n", "\n\n", " \n", "2024", "3.14", "—", "!?",
    "café", "cafe\u0301", "東京", "🙂", " é", "e", " <|im_start|>", "<|im_end|>", "<think>", "a<|endoftext|>b", "ﬁ",
]
texts = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(min_size=1, max_size=12)), min_size=150, max_size=400
).map(" ".join)


@pytest.fixture(scope="module")
def tokenizer_dirs(tiny_model_dir, default_model_dir, tmp_path_factory):
    """Every cuttable tokenizer the tests have: the tiny model's (GPT-2 style byte-level BPE),
    SmolLM2's (Digits + byte-level), Qwen3's (a split regex; skipped where absent), and the tiny
    one with a post-processor that adds a token before and after."""
    dirs = {"tiny": tiny_model_dir, "smollm2": default_model_dir}
    try:
        dirs["qwen3"] = qwen3_model_dir(tmp_path_factory.mktemp("q") / "qwen3")
    except pytest.skip.Exception:
        pass
    framed = tmp_path_factory.mktemp("framed")
    shutil.copy(tiny_model_dir / "tokenizer_config.json", framed / "tokenizer_config.json")
    backend = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    start, end = backend.token_to_id("<|im_start|>"), backend.token_to_id("<|im_end|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>", special_tokens=[("<|im_start|>", start), ("<|im_end|>", end)]
    )
    backend.save(str(framed / "tokenizer.json"))
    dirs["framed"] = framed
    return {name: (ModelTokenizer.load(path, max_text_pieces=1), ModelTokenizer.load(path, max_text_pieces=8))
            for name, path in dirs.items()}


def test_every_tokenizer_here_may_be_cut(tokenizer_dirs):
    assert {name: pieces.max_text_pieces for name, (_, pieces) in tokenizer_dirs.items()} == {
        name: 8 for name in tokenizer_dirs
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, add_special_tokens=st.booleans())
def test_pieces_give_the_whole_texts_ids(tokenizer_dirs, text, add_special_tokens):
    assume(len(text_pieces.cut(text, 8)) > 1)  # texts that are cut
    for whole, pieces in tokenizer_dirs.values():
        assert pieces.encode(text, add_special_tokens=add_special_tokens) == whole.encode(
            text, add_special_tokens=add_special_tokens
        )


def test_plain_prose_is_cut_and_matches(tokenizer_dirs):
    text = " ".join(["The quick brown fox's den, by 12 oaks\nand a café."] * 60)
    framed_whole, framed_pieces = tokenizer_dirs["framed"]
    calls = []
    encode_batch = framed_pieces._encode_batch
    framed_pieces._encode_batch = lambda texts, **kwargs: calls.append(len(texts)) or encode_batch(texts, **kwargs)
    try:
        ids = framed_pieces.encode(text, add_special_tokens=True)
    finally:
        framed_pieces._encode_batch = encode_batch
    assert calls == [8]  # one call into the library, with the 8 pieces
    assert ids == framed_whole.encode(text, add_special_tokens=True)
    start, end = framed_whole.encode("", add_special_tokens=True)  # the template's two tokens
    assert ids == [start, *framed_whole.encode(text, add_special_tokens=False), end]  # once each, not per piece
    assert framed_pieces.encode_batch([text, text], add_special_tokens=False) == [
        framed_whole.encode(text, add_special_tokens=False)
    ] * 2


@given(text=st.text(max_size=3000), max_pieces=st.integers(1, 12))
def test_cuts_are_before_a_space_between_ascii_letters(text, max_pieces):
    pieces = text_pieces.cut(text, max_pieces)
    assert "".join(pieces) == text and 1 <= len(pieces) <= max(1, max_pieces)
    if len(pieces) > 1:
        assert all(len(piece) >= text_pieces.MIN_PIECE_CHARS for piece in pieces)
    offset = 0
    for piece in pieces[:-1]:
        offset += len(piece)
        before, space, after = text[offset - 1 : offset + 2]
        assert space == " " and before.isascii() and before.isalpha() and after.isascii() and after.isalpha()


def _edited(tiny_model_dir, tmp_path, edit) -> ModelTokenizer:
    spec = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    edit(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(tiny_model_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    return ModelTokenizer.load(tmp_path, max_text_pieces=8)


def _unknown_split(spec):
    spec["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": r"\S+\s*"}, "behavior": "Isolated", "invert": False}


def _stripping_token(spec):
    spec["added_tokens"][0]["rstrip"] = True


def _prefix_space(spec):
    spec["pre_tokenizer"]["add_prefix_space"] = True


def _lowercase(spec):
    spec["normalizer"] = {"type": "Lowercase"}


def _no_word_split(spec):
    spec["pre_tokenizer"]["use_regex"] = False


@pytest.mark.parametrize("edit, reason", [
    (_unknown_split, "split pattern"), (_stripping_token, "strips whitespace"), (_prefix_space, "prefix space"),
    (_lowercase, "normalizer Lowercase"), (_no_word_split, "does not split words"),
])
def test_a_pipeline_that_could_look_across_a_cut_is_tokenized_whole(tiny_model_dir, tmp_path, caplog, edit, reason):
    with caplog.at_level("INFO"):
        assert _edited(tiny_model_dir, tmp_path, edit).max_text_pieces == 1
    assert "tokenized whole" in caplog.text and reason in caplog.text


def test_a_sentencepiece_tokenizer_is_tokenized_whole(tmp_path):
    tokenizer = ModelTokenizer.load(metaspace_model_dir(tmp_path / "m"), max_text_pieces=8)
    assert tokenizer.max_text_pieces == 1
