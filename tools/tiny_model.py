"""Tiny real models, for the tests and the benchmarks' CPU smoke runs: a trained byte-level BPE
tokenizer and random-weight decoders of each supported architecture, saved as ordinary HF
checkpoints (config.json + model.safetensors + tokenizer.json + tokenizer_config.json with a
ChatML template). Built in seconds on a CPU; their outputs mean nothing, only that every path runs.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Large language models generate one token at a time, reading a cache of keys and values.",
    "Continuous batching lets new requests join the running batch between steps.",
    "Héllo wörld — naïve café, 東京 and 北京 are cities; emoji 🙂🚀 test multi-byte text.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 !@#$%^&*()_+-=[]{};':\",./<>?",
] * 20

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> None:
    """Train a small byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": 256,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )


def _config(arch: str, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=eos_id,
        torch_dtype="float32",
    )
    if arch == "llama":
        # llama3-style RoPE scaling exercises the scaled-frequency path.
        return LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_theta=100000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1000000.0)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)
    if arch == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None)
    raise ValueError(f"unknown architecture {arch!r}; known: {ARCHITECTURES}")


def build_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0) -> Path:
    """Write a random-weight checkpoint of `arch` with the tiny tokenizer into `out_dir`."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    build_tokenizer(out_dir)
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    config = _config(arch, tok.get_vocab_size(), tok.token_to_id("<|im_end|>"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is small; scale weights up so logits are not all near-ties and greedy
    # comparisons are meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
