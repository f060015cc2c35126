"""The chained prefix block hash (llmserve.block_hash): the one definition shared by preprocess,
the engine's prefix cache and routing, namespaced by model, tokenizer, block size and salt."""

from __future__ import annotations

import json
import shutil

import pytest

from llmserve.block_hash import DEFAULT_BLOCK_SIZE, HASH_VERSION, HashNamespace, chain_block_hashes, hash_block

BLOCK = 16
NAMESPACE = HashNamespace(model_fingerprint=1, tokenizer_fingerprint=2, block_size_tokens=BLOCK)


def hashes(token_ids: list[int], cache_salt: str = "") -> list[int]:
    return NAMESPACE.block_hashes(token_ids, cache_salt)


def test_equal_prefixes_give_equal_hashes_until_they_diverge():
    shared = list(range(100, 100 + 2 * BLOCK))
    hashes_a, hashes_b = hashes(shared + [1] * BLOCK), hashes(shared + [2] * BLOCK)
    assert hashes_a[:2] == hashes_b[:2]
    assert hashes_a[2] != hashes_b[2]


def test_changed_token_changes_its_block_and_every_later_one_but_no_earlier_one():
    tokens = list(range(4 * BLOCK))
    changed = list(tokens)
    changed[BLOCK + 5] = 9999  # inside block 1
    before, after = hashes(tokens), hashes(changed)
    assert after[0] == before[0]
    assert all(x != y for x, y in zip(after[1:], before[1:]))


def test_a_later_block_hash_depends_on_the_earlier_blocks():
    # Block 1 holds the same tokens in both, but what precedes it differs.
    assert hashes([1] * BLOCK + [5] * BLOCK)[1] != hashes([2] * BLOCK + [5] * BLOCK)[1]


@pytest.mark.parametrize(
    ("num_tokens", "num_hashes"),
    [(0, 0), (1, 0), (BLOCK - 1, 0), (BLOCK, 1), (BLOCK + 1, 1), (3 * BLOCK - 1, 2), (3 * BLOCK, 3)],
)
def test_only_full_blocks_get_a_hash(num_tokens, num_hashes):
    assert len(hashes(list(range(num_tokens)))) == num_hashes


def test_partial_trailing_block_does_not_change_the_full_block_hashes():
    tokens = list(range(2 * BLOCK))
    assert hashes(tokens + [7, 8, 9]) == hashes(tokens)


def test_chaining_from_parent_hash_equals_hashing_the_concatenation():
    head = list(range(2 * BLOCK))
    tail = list(range(500, 500 + 3 * BLOCK + 4))
    head_hashes = hashes(head)
    assert head_hashes + chain_block_hashes(tail, BLOCK, head_hashes[-1]) == hashes(head + tail)


def test_the_first_block_chains_from_the_namespace_seed():
    tokens = list(range(2 * BLOCK))
    first = hash_block(NAMESPACE.seed(), tokens[:BLOCK])
    assert hashes(tokens) == [first, hash_block(first, tokens[BLOCK:])]
    assert hashes(tokens, "t")[0] == hash_block(NAMESPACE.seed("t"), tokens[:BLOCK])


def test_salts_share_no_hash_and_an_equal_salt_shares_all():
    tokens = list(range(6 * BLOCK))
    unsalted, tenant_a, tenant_b = hashes(tokens), hashes(tokens, "tenant-a"), hashes(tokens, "tenant-b")
    assert hashes(tokens, "tenant-a") == tenant_a and hashes(tokens) == unsalted
    assert not set(unsalted) & set(tenant_a) and not set(tenant_a) & set(tenant_b)


@pytest.mark.parametrize(
    "other",
    [
        HashNamespace(model_fingerprint=3, tokenizer_fingerprint=2, block_size_tokens=BLOCK),
        HashNamespace(model_fingerprint=1, tokenizer_fingerprint=3, block_size_tokens=BLOCK),
    ],
    ids=["model", "tokenizer"],
)
def test_another_model_or_tokenizer_shares_no_hash(other):
    tokens = list(range(4 * BLOCK))
    assert not set(other.block_hashes(tokens)) & set(hashes(tokens))


def test_block_size_is_part_of_what_is_hashed():
    tokens = list(range(32))
    halves = HashNamespace(1, 2, 16).block_hashes(tokens)
    # Both hashes cover tokens [0, 32), cut differently: they must not be confused.
    assert halves[1] != HashNamespace(1, 2, 32).block_hashes(tokens)[0]


def test_the_namespace_of_a_model_dir_is_its_config_and_tokenizer_bytes(tiny_model_dir, tmp_path):
    namespace = HashNamespace.of_model_dir(tiny_model_dir, BLOCK)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "model.safetensors").unlink()  # the weights are not read
    (copy / "tokenizer_config.json").write_text("{}")  # nor is the template
    assert HashNamespace.of_model_dir(copy, BLOCK) == namespace
    config = json.loads((copy / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (copy / "config.json").write_text(json.dumps(config))
    changed = HashNamespace.of_model_dir(copy, BLOCK)
    assert changed.model_fingerprint != namespace.model_fingerprint
    assert changed.tokenizer_fingerprint == namespace.tokenizer_fingerprint


def test_hashes_are_unsigned_64_bit():
    assert all(0 <= h < 2**64 for h in hashes(list(range(10 * BLOCK)), "salt") + [NAMESPACE.seed()])


def test_non_positive_block_size_is_rejected():
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        chain_block_hashes([1, 2, 3], 0, NAMESPACE.seed())


def test_known_answer_pins_the_version_2_definition():
    # Computed once from the v2 definition. If this fails, the definition changed: bump
    # HASH_VERSION (consumers ignore hashes of a version they don't know) and re-pin.
    assert HASH_VERSION == 2
    assert DEFAULT_BLOCK_SIZE == 16
    assert NAMESPACE.seed() == 1442841365957783561
    assert NAMESPACE.seed("tenant") == 7920916591625910372
    assert hashes(list(range(40))) == [1081132048617707136, 143102124024960068]
    assert hash_block(0, [0] * 16) == 7939727806148262660
