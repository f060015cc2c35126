"""The model store and the GGUF converter.

Fast tests build a tiny llama GGUF the way llama.cpp's convert_hf_to_gguf.py does (Q/K rows
permuted for its RoPE layout, some tensors Q8_0, a byte-level BPE vocabulary in the metadata) from
a random transformers model, convert it back and compare with the original. The slow test fetches
and converts the real default model and asks it for the capital of France.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from llmserve.block_hash import HashNamespace
from llmserve.tools.gguf_convert import convert_gguf_to_hf, reverse_rope_permutation
from llmserve.tools.gguf_metadata import UnsupportedGGUFError
from llmserve.tools.gguf_tokenizer import build_tokenizer
from llmserve.model_files import ModelFiles
from llmserve.tools.model_store import (
    COMPLETE_MARKER,
    ModelResolutionError,
    default_cache_dir,
    gguf_cache_name,
    resolve_model,
)
from llmserve.tools.tiny_model import CHATML_TEMPLATE, build_tokenizer as build_tiny_tokenizer

NUM_HEADS = 4
NUM_KV_HEADS = 2
NUM_LAYERS = 2

# HF llama parameter -> GGUF tensor name, as llama.cpp's converter names them.
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Stored Q8_0 in the tiny GGUF (rows are multiples of 32); everything else F32.
_Q8_0_PARTS = ("embed_tokens", "mlp.")


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest.removesuffix('.weight')]}.weight"


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: each head's [half0 | half1] rows -> interleaved.
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _is_q8_0(hf_name: str) -> bool:
    return any(part in hf_name for part in _Q8_0_PARTS)


def _tiny_hf_state_dict(vocab_size: int, tied: bool) -> dict[str, np.ndarray]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS, tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.08) if param.dim() >= 2 else param.uniform_(0.5, 1.5)
    state = {name: t.numpy().copy() for name, t in model.state_dict().items()}
    if tied:
        del state["lm_head.weight"]
    return state


def write_tiny_gguf(path: Path, tied: bool = True, pre_tokenizer: str = "gpt2") -> dict:
    """Write a 2-layer llama GGUF like llama.cpp would; return the HF state dict and tokenizer."""
    import gguf

    tokenizer_dir = path.parent / f"{path.stem}-tokenizer"
    build_tiny_tokenizer(tokenizer_dir)
    tokenizer_json = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"] | {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer_json["added_tokens"]}
    state = _tiny_hf_state_dict(len(tokens), tied)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(pair) for pair in tokenizer_json["model"]["merges"]])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_unk_token_id(vocab["<|endoftext|>"])
    writer.add_pad_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    for hf_name, values in state.items():
        if hf_name.endswith("q_proj.weight"):
            values = _llama_cpp_permute(values, NUM_HEADS)
        elif hf_name.endswith("k_proj.weight"):
            values = _llama_cpp_permute(values, NUM_KV_HEADS)
        if _is_q8_0(hf_name):
            writer.add_tensor(_gguf_name(hf_name), gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(_gguf_name(hf_name), values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"state": state, "tokenizer_dir": tokenizer_dir, "vocab": vocab}


def _q8_0_round_trip(values: np.ndarray) -> np.ndarray:
    import gguf

    q8_0 = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.dequantize(gguf.quants.quantize(values, q8_0), q8_0)


def _read_safetensors(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    return path, write_tiny_gguf(path)


@pytest.fixture(scope="module")
def tiny_converted(tiny_gguf, tmp_path_factory) -> Path:
    return convert_gguf_to_hf(tiny_gguf[0], tmp_path_factory.mktemp("converted"), progress=False)


# ---------------------------------------------------------------------------------------------
# gguf_convert: weights


def test_reverse_rope_permutation_undoes_llama_cpp_permute():
    weights = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)  # 2 heads of head_dim 6

    permuted = _llama_cpp_permute(weights, num_heads=2)

    assert permuted[:, 0].tolist() == [0, 9, 3, 12, 6, 15, 18, 27, 21, 30, 24, 33]
    np.testing.assert_array_equal(reverse_rope_permutation(permuted, num_heads=2), weights)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_weights_round_trip_through_llama_cpp_layout(tmp_path, tied):
    written = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)

    converted = _read_safetensors(convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False))

    original = written["state"]
    assert sorted(converted) == sorted(original)
    assert ("lm_head.weight" in converted) == (not tied)
    for name, values in original.items():
        assert converted[name].dtype == np.float32, name
        expected = _q8_0_round_trip(values) if _is_q8_0(name) else values
        np.testing.assert_array_equal(converted[name], expected, err_msg=name)


def test_weights_equal_transformers_gguf_loader(tiny_gguf, tiny_converted):
    from transformers import AutoModelForCausalLM

    gguf_path, _ = tiny_gguf
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(tiny_converted, dtype=torch.float32)

    reference_state, our_state = reference.state_dict(), ours.state_dict()
    assert sorted(our_state) == sorted(reference_state)
    for name, values in reference_state.items():
        torch.testing.assert_close(our_state[name], values, rtol=0, atol=0, msg=name)


def test_converted_model_logits_match_original(tiny_gguf, tiny_converted):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    _, written = tiny_gguf
    ours = AutoModelForCausalLM.from_pretrained(tiny_converted, dtype=torch.float32)
    # The original with the same Q8_0 rounding the GGUF applied: then only the layout differs.
    original = LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_converted))
    original.load_state_dict(
        {n: torch.from_numpy(_q8_0_round_trip(v) if _is_q8_0(n) else v) for n, v in written["state"].items()},
        strict=False,
    )
    original.tie_weights()
    input_ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])

    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids).logits, original(input_ids).logits)


# ---------------------------------------------------------------------------------------------
# gguf_convert: config and tokenizer


def test_config_comes_from_metadata(tiny_gguf, tiny_converted):
    vocab = tiny_gguf[1]["vocab"]
    config = json.loads((tiny_converted / "config.json").read_text())

    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(vocab),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": vocab["<|im_start|>"],
        "eos_token_id": vocab["<|im_end|>"],
        "pad_token_id": vocab["<|im_end|>"],
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }
    assert json.loads((tiny_converted / "generation_config.json").read_text()) == {
        "bos_token_id": vocab["<|im_start|>"],
        "eos_token_id": vocab["<|im_end|>"],
        "pad_token_id": vocab["<|im_end|>"],
    }


def test_tokenizer_matches_the_one_the_gguf_was_made_from(tiny_gguf, tiny_converted):
    from tokenizers import Tokenizer

    source = Tokenizer.from_file(str(tiny_gguf[1]["tokenizer_dir"] / "tokenizer.json"))
    rebuilt = Tokenizer.from_file(str(tiny_converted / "tokenizer.json"))
    texts = [
        "The capital of France is Paris.",
        "Héllo wörld — naïve café, 東京 🙂🚀",
        "def add(a, b):\n    return a + b\n",
        "  two  spaces\tand 0123456789",
        "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    ]

    for text in texts:
        assert rebuilt.encode(text).ids == source.encode(text).ids, text
        assert rebuilt.decode(rebuilt.encode(text).ids, skip_special_tokens=False) == text
    assert rebuilt.get_vocab(with_added_tokens=True) == source.get_vocab(with_added_tokens=True)


def test_tokenizer_config_and_model_files(tiny_gguf, tiny_converted):
    vocab = tiny_gguf[1]["vocab"]

    files = ModelFiles.load(tiny_converted)

    assert files.chat_template == CHATML_TEMPLATE
    assert files.eos_token_ids == (vocab["<|im_end|>"],)
    assert files.max_context_tokens == 256
    assert files.vocab_size == len(vocab)
    assert files.architecture == "LlamaForCausalLM"
    tokenizer_config = json.loads((tiny_converted / "tokenizer_config.json").read_text())
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert (tokenizer_config["unk_token"], tokenizer_config["pad_token"]) == ("<|endoftext|>", "<|im_end|>")
    assert tokenizer_config["add_bos_token"] is False


def test_two_conversions_of_one_gguf_hash_blocks_in_one_namespace(tiny_gguf, tiny_converted, tmp_path):
    """Services that each convert the same GGUF (one cache directory per host) write the same
    config.json and tokenizer.json bytes, so their block hashes agree."""
    again = convert_gguf_to_hf(tiny_gguf[0], tmp_path / "again", progress=False)
    assert HashNamespace.of_model_dir(again, 16) == HashNamespace.of_model_dir(tiny_converted, 16)


def test_smollm_pre_tokenizer_splits_digits_one_by_one(tmp_path):
    from gguf import GGUFReader

    from llmserve.tools.gguf_metadata import read_metadata

    tokenizers = {}
    for pre_tokenizer in ("gpt2", "smollm"):
        write_tiny_gguf(tmp_path / f"{pre_tokenizer}.gguf", pre_tokenizer=pre_tokenizer)
        tokenizers[pre_tokenizer] = build_tokenizer(read_metadata(GGUFReader(tmp_path / f"{pre_tokenizer}.gguf")))

    # The tiny vocabulary learned "0123456789" as one token; llama.cpp's "smollm" split forbids it.
    assert tokenizers["gpt2"].encode(" 0123456789").tokens == ["Ġ", "0123456789"]
    assert tokenizers["smollm"].encode(" 0123456789").tokens == ["Ġ", *"0123456789"]


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(UnsupportedGGUFError, match="architecture 'gpt2' is not supported"):
        convert_gguf_to_hf(tmp_path / "gpt2.gguf", tmp_path / "out", progress=False)


# ---------------------------------------------------------------------------------------------
# model_store: local paths


def test_local_checkpoint_dir_is_returned_resolved(tiny_model_dir, tmp_path):
    assert resolve_model(str(tiny_model_dir), cache_dir=tmp_path) == tiny_model_dir.resolve()


def test_local_dir_missing_files_are_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")

    with pytest.raises(ModelResolutionError, match=r"is missing \*\.safetensors, tokenizer\.json$"):
        resolve_model(str(tmp_path), cache_dir=tmp_path / "cache")


def test_unknown_name_is_rejected(tmp_path):
    with pytest.raises(ModelResolutionError, match="neither a local path nor a known model name"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=tmp_path)


def test_plain_file_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")

    with pytest.raises(ModelResolutionError, match="is a file; expected an HF checkpoint directory or a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"), cache_dir=tmp_path)


def test_file_that_is_not_gguf_is_rejected(tmp_path):
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file at all")

    with pytest.raises(ModelResolutionError, match="cannot convert fake.gguf: .*GGUF magic invalid"):
        resolve_model(str(tmp_path / "fake.gguf"), cache_dir=tmp_path / "cache")


def test_default_cache_dir_reads_env_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert default_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("LLMSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "llmserve"


# ---------------------------------------------------------------------------------------------
# model_store: the conversion cache


def test_gguf_path_is_converted_once_into_the_cache(tiny_gguf, tmp_path):
    gguf_path, _ = tiny_gguf
    cache_dir = tmp_path / "cache"

    first = resolve_model(str(gguf_path), cache_dir=cache_dir, progress=False)
    marker_mtime_ns = (first / COMPLETE_MARKER).stat().st_mtime_ns
    second = resolve_model(str(gguf_path), cache_dir=cache_dir, progress=False)

    assert first == second == cache_dir / gguf_cache_name(gguf_path)
    assert (second / COMPLETE_MARKER).stat().st_mtime_ns == marker_mtime_ns
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted([first.name, f".{first.name}.lock"])
    assert ModelFiles.load(first).vocab_size == len(tiny_gguf[1]["vocab"])


def test_changed_gguf_gets_a_new_cache_entry(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    first = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", progress=False)

    os.utime(gguf_path, ns=(0, 1_000_000_000))
    second = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", progress=False)

    assert second != first
    assert second.name == f"gguf-tiny-{gguf_path.stat().st_size}-1000000000"


def test_leftovers_of_a_crashed_build_are_replaced(tiny_gguf, tmp_path):
    gguf_path, _ = tiny_gguf
    cache_dir = tmp_path / "cache"
    name = gguf_cache_name(gguf_path)
    stale_temp = cache_dir / f".{name}.tmp-crashed"
    stale_temp.mkdir(parents=True)
    (stale_temp / "model.safetensors").write_bytes(b"half")
    (cache_dir / name).mkdir()  # no marker: never finished
    (cache_dir / name / "config.json").write_text("{}")

    model_dir = resolve_model(str(gguf_path), cache_dir=cache_dir, progress=False)

    assert not stale_temp.exists()
    assert (model_dir / COMPLETE_MARKER).is_file()
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "llama"


def test_failed_conversion_leaves_nothing_behind(tmp_path):
    import gguf

    broken = tmp_path / "broken.gguf"  # a llama with no layers' tensors at all
    writer = gguf.GGUFWriter(broken, "llama")
    for add, value in [("add_block_count", 1), ("add_context_length", 16), ("add_embedding_length", 32),
                       ("add_feed_forward_length", 64), ("add_head_count", 2), ("add_layer_norm_rms_eps", 1e-5)]:
        getattr(writer, add)(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache_dir = tmp_path / "cache"

    with pytest.raises(ModelResolutionError, match="cannot convert broken.gguf: the file lacks 10 tensors"):
        resolve_model(str(broken), cache_dir=cache_dir, progress=False)

    assert [p.name for p in cache_dir.iterdir()] == [f".{gguf_cache_name(broken)}.lock"]


def test_concurrent_callers_convert_once(tiny_gguf, tmp_path, caplog):
    gguf_path, _ = tiny_gguf
    cache_dir = tmp_path / "cache"
    results: list[Path] = []
    barrier = threading.Barrier(3)

    def resolve() -> None:
        barrier.wait()
        results.append(resolve_model(str(gguf_path), cache_dir=cache_dir, progress=False))

    with caplog.at_level(logging.INFO, logger="llmserve.tools.model_store"):
        threads = [threading.Thread(target=resolve) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    assert results == [cache_dir / gguf_cache_name(gguf_path)] * 3
    assert sum("ready at" in record.getMessage() for record in caplog.records) == 1


# ---------------------------------------------------------------------------------------------
# The real default model


@pytest.mark.slow
def test_default_model_is_fetched_converted_and_knows_paris(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(None, cache_dir=tmp_path, progress=False)

    assert model_dir == tmp_path / "smollm2-135m-instruct"
    assert resolve_model("default", cache_dir=tmp_path) == model_dir
    files = ModelFiles.load(model_dir)
    assert (files.architecture, files.vocab_size, files.max_context_tokens) == ("LlamaForCausalLM", 49152, 8192)
    assert files.eos_token_ids == (2,)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    output_ids = model.generate(**prompt, max_new_tokens=30, do_sample=False)
    answer = tokenizer.decode(output_ids[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer == "The capital of France is Paris."
