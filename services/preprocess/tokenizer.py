"""The model's tokenizer: HuggingFace `tokenizers` (Rust) loaded once from tokenizer.json.

Encoding and decoding go through the *batch* entry points on purpose: in tokenizers 0.23
`Tokenizer.encode` and `Tokenizer.decode` hold the GIL for the whole call, while
`encode_batch(_fast)` and `decode_batch` release it. Only the latter let the worker threads
tokenize in parallel while the event loop keeps serving (measured with tokenizers 0.23.3: a
Python thread runs at full speed beside `encode_batch` and barely at all beside `encode`).

tokenizer.json's post-processor decides which special tokens (BOS etc.) plain text gets, as in
transformers 5's generic TokenizersBackend, which ignores add_bos_token/add_eos_token in
tokenizer_config.json (checked by the parity tests). What transformers does layer on top is
reproduced here: the named special tokens chat templates see, and
`clean_up_tokenization_spaces` on decode (which it skips for BPE models).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import tokenizers

# The named special tokens transformers passes to chat templates (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value) -> str | None:
    # tokenizer_config stores special tokens as strings or as {"content": ...} objects.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _clean_up_tokenization(text: str) -> str:
    # transformers' PreTrainedTokenizerBase.clean_up_tokenization, kept byte-for-byte.
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


class ModelTokenizer:
    """Thread-safe encode/decode with the model's tokenizer. Build with `load`."""

    def __init__(self, backend: tokenizers.Tokenizer, special_tokens: dict[str, str], clean_up_spaces: bool):
        self._backend = backend
        # Named special tokens (bos_token, eos_token, ...) that are set; chat templates see them.
        self.special_tokens = special_tokens
        self._clean_up_spaces = clean_up_spaces
        # One past the largest id, so that every id below it can be decoded. Equal to the
        # number of tokens (special tokens included) unless the vocabulary has holes.
        self.vocab_size = 1 + max(backend.get_vocab(with_added_tokens=True).values())
        # `encode_batch_fast` (tokenizers >= 0.21) skips offset tracking we do not use.
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)

    @classmethod
    def load(cls, model_dir: str | Path) -> "ModelTokenizer":
        """Read tokenizer.json and tokenizer_config.json from a checkpoint directory."""
        model_dir = Path(model_dir)
        backend = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _read_tokenizer_config(model_dir)
        special_tokens = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None
        }
        # transformers ignores clean-up for BPE models: it would delete real spaces there.
        is_bpe = type(backend.model).__name__ == "BPE"
        clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and not is_bpe
        return cls(backend, special_tokens, clean_up_spaces)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs the post-processor (BOS etc.)."""
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each id (e.g. "Ġthe" for byte-level BPE), as transformers'
        convert_ids_to_tokens gives them."""
        id_to_token = self._backend.id_to_token
        return [id_to_token(token_id) or "" for token_id in token_ids]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        text = self._backend.decode_batch([list(token_ids)], skip_special_tokens=skip_special_tokens)[0]
        return _clean_up_tokenization(text) if self._clean_up_spaces else text
