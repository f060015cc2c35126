"""Checkpoint directories for preprocess tests: the tiny model's tokenizer under other chat
templates, a SentencePiece-style (Metaspace, NFKC) tokenizer, and the real Qwen3 tokenizer
(from the shared assets; tests that use it skip where it is absent, as in CI)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from llmserve.tools.tiny_model import CHATML_TEMPLATE, SPECIAL_TOKENS

SHARED_ASSETS = Path(os.environ.get("LLMSERVE_SHARED_ASSETS", Path(__file__).resolve().parents[1].parent / "shared/assets"))
# No boundary token between a user turn and the assistant's reply: the seam of a conversation
# that continues falls inside ordinary text, where BPE merges and multi-byte characters meet.
SEAMLESS_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'assistant' %}{{ '<|im_start|>' + message['role'] + '\\n' }}{% endif %}"
    "{{ message['content'] }}"
    "{% endfor %}"
)
_CORPUS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Héllo wörld — naïve café, 東京 and 北京; emoji 🙂🚀 and ﬁ ligatures.",
    "def add(a, b):\n    return a + b  # spaces  kept\n",
] * 30


def with_template(model_dir: Path, out_dir: Path, chat_template: str) -> Path:
    """`model_dir`'s config and tokenizer files with another chat template."""
    out_dir.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(model_dir / name, out_dir / name)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return out_dir


def metaspace_model_dir(out_dir: Path) -> Path:
    """A SentencePiece-style BPE (NFKC, "▁" prepended to the first piece only) with ChatML."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<|endoftext|>", byte_fallback=True))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    out_dir.mkdir(parents=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (out_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "vocab_size": 400}))
    return out_dir


def qwen3_model_dir(out_dir: Path) -> Path:
    """The Qwen3 tokenizer and its own chat template, with a config.json (32k context)."""
    source = SHARED_ASSETS / "tokenizers/qwen3"
    if not (source / "tokenizer.json").is_file():
        pytest.skip(f"no Qwen3 tokenizer at {source} (set LLMSERVE_SHARED_ASSETS)")
    out_dir.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out_dir / name)
    config = {"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 32768, "vocab_size": 151936}
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir
