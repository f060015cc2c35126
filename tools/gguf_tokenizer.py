"""The GGUF's tokenizer as HF files: tokenizer.json (byte-level BPE rebuilt from
`tokenizer.ggml.*` with the `tokenizers` library), tokenizer_config.json (special tokens and the
chat template) and generation_config.json (bos/eos/pad ids)."""

from __future__ import annotations

from typing import Any

from llmserve.tools.gguf_metadata import UnsupportedGGUFError

# llama.cpp `tokenizer.ggml.token_type` values (llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _smollm_pre_tokenizer(add_prefix_space: bool):
    # llama.cpp's "smollm" split: every digit alone (\p{N}), then the GPT-2 regex.
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True),
        ]
    )


def _gpt2_pre_tokenizer(add_prefix_space: bool):
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


# `tokenizer.ggml.pre` -> pre-tokenizer that splits text the way the merges were learned.
_PRE_TOKENIZERS = {"smollm": _smollm_pre_tokenizer, "gpt2": _gpt2_pre_tokenizer}


def build_tokenizer(metadata: dict[str, Any]):
    """A `tokenizers.Tokenizer` equal to the byte-level BPE the metadata describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    model_type = metadata.get("tokenizer.ggml.model")
    pre_type = metadata.get("tokenizer.ggml.pre", "gpt2")
    if model_type != "gpt2":
        raise UnsupportedGGUFError(f"tokenizer model {model_type!r} is not supported (only byte-level BPE, 'gpt2')")
    if pre_type not in _PRE_TOKENIZERS:
        raise UnsupportedGGUFError(f"pre-tokenizer {pre_type!r} is not supported (known: {sorted(_PRE_TOKENIZERS)})")
    if "tokenizer.ggml.merges" not in metadata:
        raise UnsupportedGGUFError("byte-level BPE tokenizer without tokenizer.ggml.merges")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    # Byte-level tokens never contain a raw space (it is spelled "Ġ"), so one split is unambiguous.
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))

    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre_type](add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(metadata, tokens)
    # Control tokens (<|im_start|> ...) must match whole and be skippable when decoding;
    # user-defined ones match whole but are ordinary text.
    typed = list(zip(tokens, token_types))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in typed if kind == _TOKEN_TYPE_CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in typed if kind == _TOKEN_TYPE_USER_DEFINED]
    )
    if tokenizer.get_vocab_size() != len(tokens):
        raise UnsupportedGGUFError(f"rebuilt tokenizer has {tokenizer.get_vocab_size()} tokens, the file {len(tokens)}")
    return tokenizer


def _post_processor(metadata: dict[str, Any], tokens: list[str]):
    from tokenizers import processors

    byte_level = processors.ByteLevel(trim_offsets=False)
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if not metadata.get("tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return byte_level
    bos = tokens[bos_id]
    with_bos = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    return processors.Sequence([byte_level, with_bos])


def tokenizer_config(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS/EOS policy and the chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(metadata.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": metadata.get("tokenizer.chat_template"),
    }


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if config[key] is not None}
