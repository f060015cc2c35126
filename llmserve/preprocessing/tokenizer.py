"""The model's tokenizer: HuggingFace `tokenizers` (Rust) loaded once from tokenizer.json.

Encoding goes through the *batch* entry point on purpose: in tokenizers 0.23 `Tokenizer.encode`
holds the GIL for the whole call, while `encode_batch(_fast)` releases it (decoding likewise,
llmserve.text_decoder). Only the latter let the tokenizer threads tokenize in parallel while the event loop keeps serving (measured with tokenizers 0.23.3: a
Python thread runs at full speed beside `encode_batch` and barely at all beside `encode`).

tokenizer.json's post-processor decides which special tokens (BOS etc.) plain text gets, as in
transformers 5's generic TokenizersBackend, which ignores add_bos_token/add_eos_token in
tokenizer_config.json (checked by the parity tests). What transformers does layer on top is
reproduced here: the named special tokens chat templates see; decoding follows the rule the
gateway's streamed output follows too (llmserve.text_decoder).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Sequence

import tokenizers

from llmserve.preprocessing import text_pieces
from llmserve.preprocessing.text_pieces import DEFAULT_MAX_TEXT_PIECES
from llmserve.text_decoder import TextDecoder, read_tokenizer_config

log = logging.getLogger(__name__)

# The named special tokens transformers passes to chat templates (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value) -> str | None:
    # tokenizer_config stores special tokens as strings or as {"content": ...} objects.
    if isinstance(value, dict):
        return value.get("content")
    return value


class ModelTokenizer:
    """Thread-safe encode/decode with the model's tokenizer. Build with `load`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        decoder: TextDecoder,
        version: str,
        max_text_pieces: int = DEFAULT_MAX_TEXT_PIECES,
    ):
        self._backend = backend
        # Changes whenever tokenizer.json or the library does: part of shared cache keys.
        self.version = version
        # Named special tokens (bos_token, eos_token, ...) that are set; chat templates see them.
        self.special_tokens = special_tokens
        # The decode rule, shared with the gateway's streamed output (its Detokenizer).
        self.decoder = decoder
        # One past the largest id, so that every id below it can be decoded. Equal to the
        # number of tokens (special tokens included) unless the vocabulary has holes.
        vocab_ids = backend.get_vocab(with_added_tokens=True).values()
        self.vocab_size = 1 + max(vocab_ids)
        # The most UTF-8 bytes one token stands for: a text of N bytes needs at least
        # N / max_token_bytes tokens, which bounds the prompt bytes worth tokenizing.
        texts = backend.decode_batch([[i] for i in vocab_ids], skip_special_tokens=False)
        self.max_token_bytes = max(1, max(len(text.encode("utf-8")) for text in texts))
        # `encode_batch_fast` (tokenizers >= 0.21) skips offset tracking we do not use.
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        # 1 (or a tokenizer whose pipeline could look across a cut): texts are encoded whole.
        self.max_text_pieces = max_text_pieces
        if max_text_pieces > 1 and (reason := text_pieces.why_not_cuttable(backend)) is not None:
            log.info("long texts are tokenized whole, not in pieces: %s", reason)
            self.max_text_pieces = 1

    @classmethod
    def load(cls, model_dir: str | Path, max_text_pieces: int = DEFAULT_MAX_TEXT_PIECES) -> "ModelTokenizer":
        """Read tokenizer.json and tokenizer_config.json from a checkpoint directory.
        `max_text_pieces`: a lone long text is encoded in up to this many pieces at once (1: whole)."""
        model_dir = Path(model_dir)
        tokenizer_json = (model_dir / "tokenizer.json").read_bytes()
        backend = tokenizers.Tokenizer.from_str(tokenizer_json.decode("utf-8"))
        config = read_tokenizer_config(model_dir)
        special_tokens = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None
        }
        digest = hashlib.blake2b(tokenizer_json, digest_size=8).hexdigest()
        version = f"{digest}-tokenizers{tokenizers.__version__}"
        return cls(backend, special_tokens, TextDecoder(backend, config), version, max_text_pieces)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs the post-processor (BOS etc.)."""
        return self.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool) -> list[list[int]]:
        """`encode` of each text, in one call into Rust (one GIL release for the batch). A lone
        long text is cut into pieces encoded at once (text_pieces); a batch of several is
        already spread over the tokenizer's threads."""
        if len(texts) == 1 and self.max_text_pieces > 1:
            pieces = text_pieces.cut(texts[0], self.max_text_pieces)
            if len(pieces) > 1:
                return [self._encode_pieces(pieces, add_special_tokens)]
        return [encoding.ids for encoding in self._encode_batch(texts, add_special_tokens=add_special_tokens)]

    def _encode_pieces(self, pieces: list[str], add_special_tokens: bool) -> list[int]:
        """The ids of the text the pieces make up: encoded bare, merged, post-processed once."""
        encoding = tokenizers.Encoding.merge(self._encode_batch(pieces, add_special_tokens=False), growing_offsets=False)
        if add_special_tokens:
            encoding = self._backend.post_process(encoding, add_special_tokens=True)
        return encoding.ids

    def boundary_tokens(self) -> dict[str, int]:
        """Added tokens the tokenizer splits the text on before normalizing or pre-tokenizing it,
        matched on the raw text with nothing stripped around them: the text on either side of one
        is tokenized independently (what the tail tokenizer relies on). A token inside another
        added token is left out (a longer match could swallow it), and there are none when the
        tokenizer truncates, pads or is told to tokenize special tokens as text."""
        backend = self._backend
        if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens:
            return {}
        added = backend.get_added_tokens_decoder()
        texts = [token.content for token in added.values()]
        return {
            token.content: token_id
            for token_id, token in added.items()
            if not (token.normalized or token.lstrip or token.rstrip or token.single_word)
            and token.content
            and sum(token.content in text for text in texts) == 1
        }

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each id (e.g. "Ġthe" for byte-level BPE), as transformers'
        convert_ids_to_tokens gives them."""
        id_to_token = self._backend.id_to_token
        return [id_to_token(token_id) or "" for token_id in token_ids]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        """The text transformers' `tokenizer.decode` gives (llmserve.text_decoder's rule)."""
        return self.decoder.decode(token_ids, skip_special_tokens=skip_special_tokens)
