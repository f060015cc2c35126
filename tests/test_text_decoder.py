"""One decode rule for preprocess's Detokenize and the gateway's streamed text, checked against
transformers' `tokenizer.decode` on real tokenizers and on one where its space clean-up applies."""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

from llmserve.gateway.detokenizer import Detokenizer
from llmserve.preprocessing.tokenizer import ModelTokenizer
from llmserve.text_decoder import CleanUpStream, TextDecoder, clean_up_tokenization

TEXTS = [
    "I don't know, isn't it? You're right. It's fine! We've done 'quoted' things , ok .",
    "Héllo wörld — naïve café, 東京 and 北京 are cities; emoji 🙂🚀 test multi-byte text.",
    "def add(a, b):\n    return a + b  # spaces ,  kept ?",
    "They ' re here n't  'm 's 've 're . , ? !",
]
# The shared assets live beside a checkout, never inside it: tests that use them skip elsewhere.
SHARED_ASSETS = Path(os.environ.get("LLMSERVE_SHARED_ASSETS", Path(__file__).resolve().parents[1].parent / "shared/assets"))


def build_clean_up_tokenizer(out_dir: Path) -> Path:
    """A WordPiece tokenizer (BERT-style, spaces around punctuation) whose tokenizer_config sets
    clean_up_tokenization_spaces, which transformers applies to non-BPE models."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=False)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[SEP]"])
    tokenizer.train_from_iterator(TEXTS * 5, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"clean_up_tokenization_spaces": True, "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return out_dir


@pytest.fixture(scope="module")
def clean_up_dir(tmp_path_factory) -> Path:
    return build_clean_up_tokenizer(tmp_path_factory.mktemp("wordpiece-clean-up"))


def _qwen3_dir() -> Path:
    path = SHARED_ASSETS / "tokenizers/qwen3"
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"no Qwen3 tokenizer at {path} (set LLMSERVE_SHARED_ASSETS)")
    return path


@pytest.fixture(params=["clean-up", "qwen3", pytest.param("smollm2", marks=pytest.mark.slow)])
def tokenizer_dir(request, clean_up_dir) -> Path:
    if request.param == "clean-up":
        return clean_up_dir
    if request.param == "qwen3":
        return _qwen3_dir()
    return request.getfixturevalue("default_model_dir")


def stream_text(detokenizer: Detokenizer, token_ids: list[int], chunk_size: int) -> str:
    stream = detokenizer.new_stream()
    deltas = [stream.push(token_ids[i : i + chunk_size]) for i in range(0, len(token_ids), chunk_size)]
    return "".join(deltas) + stream.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_both_services_decode_as_transformers(tokenizer_dir, text):
    reference = AutoTokenizer.from_pretrained(tokenizer_dir)
    token_ids = reference.encode(text, add_special_tokens=False)
    expected = reference.decode(token_ids, skip_special_tokens=True)
    assert ModelTokenizer.load(tokenizer_dir).decode(token_ids, skip_special_tokens=True) == expected
    detokenizer = Detokenizer.from_model_dir(tokenizer_dir)
    for chunk_size in (1, 3):
        assert stream_text(detokenizer, token_ids, chunk_size) == expected


def test_the_clean_up_really_applies_to_the_wordpiece_tokenizer(clean_up_dir):
    # Guard for the tests above: clean-up on, and it changes this tokenizer's text.
    decoder = TextDecoder.from_model_dir(clean_up_dir)
    token_ids = AutoTokenizer.from_pretrained(clean_up_dir).encode(TEXTS[0], add_special_tokens=False)
    raw = decoder.decode_without_clean_up(token_ids, skip_special_tokens=True)
    assert decoder.cleans_up and decoder.decode(token_ids, skip_special_tokens=True) != raw


def test_clean_up_is_skipped_for_bpe_unless_forced(tiny_model_dir):
    backend = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert not TextDecoder(backend, {"clean_up_tokenization_spaces": True}).cleans_up
    forced = {"clean_up_tokenization_spaces": True, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}
    assert TextDecoder(backend, forced).cleans_up


def _streamed_clean_up(pieces) -> str:
    stream = CleanUpStream()
    return "".join(stream.push(piece) for piece in pieces) + stream.flush()


def test_streamed_clean_up_equals_the_clean_up_of_the_whole_text():
    # Every string of up to 6 characters over the characters the patterns are made of, one
    # character at a time: the cases where a pattern reaches back over text already seen.
    for length in range(1, 7):
        for chars in itertools.product(" 'n.tm", repeat=length):
            text = "".join(chars)
            assert _streamed_clean_up(text) == clean_up_tokenization(text), repr(text)
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(" '.,?!ntsmvrea") for _ in range(rng.randint(0, 16)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(5, len(text) + 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _streamed_clean_up(pieces) == clean_up_tokenization(text), (text, pieces)


def test_streamed_clean_up_releases_text_without_spaces_at_once():
    stream = CleanUpStream()
    assert stream.push("Hello") == "Hello"
    assert stream.push(" world ,") == " world"  # " ," is a pattern: held back until it is final
    assert stream.push(" and") == ","
    assert stream.flush() == " and"
