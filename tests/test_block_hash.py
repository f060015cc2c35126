"""The chained prefix block hash (llmserve.block_hash): the one definition shared by preprocess,
the engine's prefix cache and routing."""

from __future__ import annotations

import pytest

from llmserve.block_hash import DEFAULT_BLOCK_SIZE, HASH_VERSION, chain_block_hashes, hash_block

BLOCK = 16


def test_equal_prefixes_give_equal_hashes_until_they_diverge():
    shared = list(range(100, 100 + 2 * BLOCK))
    a = shared + [1] * BLOCK
    b = shared + [2] * BLOCK
    hashes_a, hashes_b = chain_block_hashes(a, BLOCK), chain_block_hashes(b, BLOCK)
    assert hashes_a[:2] == hashes_b[:2]
    assert hashes_a[2] != hashes_b[2]


def test_changed_token_changes_its_block_and_every_later_one_but_no_earlier_one():
    tokens = list(range(4 * BLOCK))
    before = chain_block_hashes(tokens, BLOCK)
    changed = list(tokens)
    changed[BLOCK + 5] = 9999  # inside block 1
    after = chain_block_hashes(changed, BLOCK)
    assert after[0] == before[0]
    assert all(x != y for x, y in zip(after[1:], before[1:]))


def test_a_later_block_hash_depends_on_the_earlier_blocks():
    # Block 1 holds the same tokens in both, but what precedes it differs.
    a = [1] * BLOCK + [5] * BLOCK
    b = [2] * BLOCK + [5] * BLOCK
    assert chain_block_hashes(a, BLOCK)[1] != chain_block_hashes(b, BLOCK)[1]


@pytest.mark.parametrize(
    ("num_tokens", "num_hashes"),
    [(0, 0), (1, 0), (BLOCK - 1, 0), (BLOCK, 1), (BLOCK + 1, 1), (3 * BLOCK - 1, 2), (3 * BLOCK, 3)],
)
def test_only_full_blocks_get_a_hash(num_tokens, num_hashes):
    assert len(chain_block_hashes(list(range(num_tokens)), BLOCK)) == num_hashes


def test_partial_trailing_block_does_not_change_the_full_block_hashes():
    tokens = list(range(2 * BLOCK))
    assert chain_block_hashes(tokens + [7, 8, 9], BLOCK) == chain_block_hashes(tokens, BLOCK)


def test_chaining_from_parent_hash_equals_hashing_the_concatenation():
    head = list(range(2 * BLOCK))
    tail = list(range(500, 500 + 3 * BLOCK + 4))
    head_hashes = chain_block_hashes(head, BLOCK)
    tail_hashes = chain_block_hashes(tail, BLOCK, parent_hash=head_hashes[-1])
    assert head_hashes + tail_hashes == chain_block_hashes(head + tail, BLOCK)


def test_first_hash_is_hash_block_without_parent_and_later_ones_chain():
    tokens = list(range(2 * BLOCK))
    first = hash_block(None, tokens[:BLOCK])
    assert chain_block_hashes(tokens, BLOCK) == [first, hash_block(first, tokens[BLOCK:])]


def test_block_size_is_part_of_what_is_hashed():
    tokens = list(range(32))
    # Both hashes cover tokens [0, 32), cut differently: they must not be confused.
    assert chain_block_hashes(tokens, 16)[1] != chain_block_hashes(tokens, 32)[0]


def test_hashes_are_unsigned_64_bit():
    hashes = chain_block_hashes(list(range(10 * BLOCK)), BLOCK)
    assert all(0 <= h < 2**64 for h in hashes)


def test_non_positive_block_size_is_rejected():
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        chain_block_hashes([1, 2, 3], 0)


def test_known_answer_pins_the_version_1_definition():
    # Computed once from the v1 definition. If this fails, the definition changed: bump
    # HASH_VERSION (consumers ignore hashes of a version they don't know) and re-pin.
    assert HASH_VERSION == 1
    assert DEFAULT_BLOCK_SIZE == 16
    assert chain_block_hashes(list(range(40)), 16) == [16501581937995407562, 7547325393894459211]
    assert chain_block_hashes([7] * 8, 4) == [8477907539404915642, 9754538808386062325]
    assert hash_block(None, [0] * 16) == 10005921194165186649
