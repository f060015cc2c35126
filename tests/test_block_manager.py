"""BlockManager: exact block ids, ref counts, prefix hits and eviction order (block size 4)."""

from __future__ import annotations

import functools

import pytest

from llmserve.block_hash import HashNamespace, chain_block_hashes
from llmserve.inference.engine.block_manager import BlockManager
from llmserve.inference.engine.sequence import Sequence
from tests import engine_objects

BLOCK_SIZE = 4
HASH_SEED = HashNamespace(model_fingerprint=1, tokenizer_fingerprint=2, block_size_tokens=BLOCK_SIZE).seed()


make_seq = functools.partial(engine_objects.make_seq, max_tokens=8, hash_seed=HASH_SEED)


def compute(manager: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Allocate like the scheduler (adopting cache hits) and record the tokens computed, as the
    scheduler does (it writes num_computed_tokens; the block manager only reads it)."""
    cached = manager.find_cached_blocks(seq) if not seq.block_ids else []
    if cached:
        seq.num_computed_tokens = len(cached) * BLOCK_SIZE
    if num_tokens is None:
        num_tokens = seq.num_tokens - seq.num_computed_tokens
    assert manager.allocate(seq, num_tokens, cached)
    seq.num_computed_tokens += num_tokens
    manager.register_computed_blocks(seq)


@pytest.fixture
def manager() -> BlockManager:
    return BlockManager(num_blocks=8, block_size=BLOCK_SIZE)


def ref_counts(manager: BlockManager) -> list[int]:
    return [block.ref_count for block in manager.blocks]


def test_allocates_lowest_free_ids_and_frees_everything(manager):
    seq = make_seq(range(10))  # 2 full blocks + 2 tokens
    compute(manager, seq)
    assert seq.block_ids == [0, 1, 2]
    assert ref_counts(manager) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert (manager.num_used_blocks, manager.num_free_blocks) == (3, 5)
    manager.free(seq)
    assert seq.block_ids == [] and seq.num_registered_blocks == 0
    assert manager.num_free_blocks == 8 and ref_counts(manager) == [0] * 8


def test_allocate_grows_one_block_at_a_time_and_refuses_when_short(manager):
    seq = make_seq(range(4))
    compute(manager, seq)
    assert seq.block_ids == [0]
    seq.token_ids.append(99)  # a decode: the 5th token needs a second block
    assert manager.allocate(seq, 1)
    assert seq.block_ids == [0, 1]
    big = make_seq(range(100, 128), seq_id=2)  # 7 blocks, only 6 free
    assert not manager.can_allocate(big, 28)
    assert not manager.allocate(big, 28)
    assert big.block_ids == [] and manager.num_free_blocks == 6


def test_prefix_hit_shares_full_blocks_by_ref_count(manager):
    first = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], seq_id=1)
    compute(manager, first)
    second = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44], seq_id=2)
    assert manager.find_cached_blocks(second) == [0, 1]
    compute(manager, second)
    assert second.block_ids == [0, 1, 3]
    assert second.num_computed_tokens == 11
    assert ref_counts(manager)[:4] == [2, 2, 1, 1]
    manager.free(first)
    assert ref_counts(manager)[:4] == [1, 1, 0, 1]
    manager.free(second)
    assert manager.num_free_blocks == 8


def test_fully_cached_prompt_still_computes_its_last_token(manager):
    compute(manager, make_seq(range(8), seq_id=1))  # blocks 0, 1 registered
    again = make_seq(range(8), seq_id=2)
    assert manager.find_cached_blocks(again) == [0]  # (8 - 1) // 4 = 1 block at most
    assert manager.allocate(again, 4, [0])
    assert again.block_ids == [0, 2]  # the last block is recomputed in a fresh block
    again.num_computed_tokens = 8
    manager.register_computed_blocks(again)
    assert again.block_ids == [0, 1]  # ... then swapped onto its cached twin, which is freed
    assert manager.free_block_ids()[0] == 2 and ref_counts(manager)[:3] == [2, 2, 0]
    again.token_ids += [8, 9, 10, 11, 12]  # its decodes fill a block chained to the twin
    compute(manager, again, 4)
    assert manager.find_cached_blocks(make_seq(range(13), seq_id=3)) == [0, 1, 2]


def test_request_hashes_are_used_when_given(manager):
    compute(manager, make_seq(range(8), seq_id=1))
    hashes = chain_block_hashes(list(range(9)), BLOCK_SIZE, HASH_SEED)
    assert manager.find_cached_blocks(make_seq(range(9), seq_id=2, block_hashes=hashes)) == [0, 1]


def test_hash_collision_with_different_tokens_is_no_hit(manager):
    compute(manager, make_seq([1, 2, 3, 4, 5], seq_id=1))
    forged = chain_block_hashes([1, 2, 3, 4], BLOCK_SIZE, HASH_SEED)  # claims the tokens were 1..4
    assert manager.find_cached_blocks(make_seq([9, 9, 9, 9, 5], seq_id=2, block_hashes=forged)) == []


def test_collision_on_a_later_block_needs_the_same_parent(manager):
    """Block 1 of `other` forges the hash of block 1 of `first` with equal tokens, but its
    block 0 differs: the cached block 1 was computed on another prefix, so no hit."""
    first = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0], seq_id=1)
    compute(manager, first)
    compute(manager, make_seq([9, 9, 9, 9, 0], seq_id=3))  # registers [9, 9, 9, 9] as block 2
    forged = [chain_block_hashes([9, 9, 9, 9], BLOCK_SIZE, HASH_SEED)[0], first.block_hashes[1]]
    other = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0], seq_id=2, block_hashes=forged)
    assert manager.find_cached_blocks(other) == [3]


def test_freed_blocks_stay_cached_until_evicted_lru_tail_first(manager):
    a = make_seq(range(0, 8), seq_id=1)  # 2 full blocks + recompute nothing: blocks 0, 1
    b = make_seq(range(100, 108), seq_id=2)  # blocks 2, 3
    c = make_seq(range(200, 206), seq_id=3)  # blocks 4, 5 (5 is partial: never cached)
    for seq in (a, b, c):
        compute(manager, seq)
    manager.free(a)
    manager.free(b)
    manager.free(c)
    # Uncached first (5, and the never-used 6, 7), then cached LRU, each sequence tail first.
    assert manager.free_block_ids() == [5, 6, 7, 1, 0, 3, 2, 4]
    assert manager.stats().num_blocks_cached == 5
    filler = make_seq(range(300, 320), seq_id=4)  # 5 blocks: evicts a's blocks 1, 0
    assert manager.allocate(filler, 20)
    assert filler.block_ids == [5, 6, 7, 1, 0]
    assert manager.find_cached_blocks(make_seq(range(0, 9), seq_id=5)) == []
    assert manager.find_cached_blocks(make_seq(range(100, 109), seq_id=6)) == [2, 3]


def test_hit_refreshes_recency(manager):
    a = make_seq(range(0, 5), seq_id=1)
    b = make_seq(range(100, 105), seq_id=2)
    compute(manager, a)  # blocks 0 (cached), 1
    compute(manager, b)  # blocks 2 (cached), 3
    manager.free(a)
    manager.free(b)
    reuse = make_seq(range(0, 6), seq_id=3)
    compute(manager, reuse)  # cached block 0 again, then the front of the queue: 3, freed last
    assert reuse.block_ids == [0, 3]
    manager.free(reuse)
    assert manager.free_block_ids()[-2:] == [2, 0]  # block 0 is now the most recently used


def compute_in_one_step(manager: BlockManager, seqs: list[Sequence]) -> None:
    """Allocate every sequence first, then register each: their step computed them together."""
    for seq in seqs:
        assert manager.allocate(seq, seq.num_tokens)
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens
        manager.register_computed_blocks(seq)


def test_twin_blocks_computed_in_one_step_register_once_and_the_chains_go_on(manager):
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    a, b = make_seq(shared + [10, 11, 12, 13, 14], seq_id=1), make_seq(shared + [20, 21, 22, 23, 24], seq_id=2)
    compute_in_one_step(manager, [a, b])
    assert a.block_ids == [0, 1, 2, 3]
    assert b.block_ids == [0, 1, 6, 7]  # swapped onto a's blocks 0, 1; its own 4, 5 freed ...
    assert manager.free_block_ids()[:2] == [5, 4]  # ... to the front: they hold nothing to keep
    assert ref_counts(manager) == [2, 2, 1, 1, 0, 0, 1, 1]
    assert b.num_registered_blocks == 3 and manager.stats().num_blocks_cached == 4
    assert manager.blocks[6].parent_registration_id == manager.blocks[1].registration_id
    resent_b = make_seq(b.token_ids, seq_id=3)
    assert manager.find_cached_blocks(resent_b) == [0, 1, 6]  # as if b had come after a
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 8


def test_a_hash_collision_is_no_twin_and_ends_the_registration(manager):
    first = make_seq([1, 2, 3, 4, 0], seq_id=1)
    compute(manager, first)  # block 0 registered under hash(1, 2, 3, 4)
    forged = chain_block_hashes([1, 2, 3, 4], BLOCK_SIZE, HASH_SEED)  # claims its tokens are 1..4
    other = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0], seq_id=2, block_hashes=forged)
    compute(manager, other)
    assert other.block_ids == [2, 3, 4] and other.num_registered_blocks == 0
    assert manager.stats().num_blocks_cached == 1


def test_a_forked_sibling_on_a_duplicate_swaps_onto_the_twin_too(manager):
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    first, parent = make_seq(prompt, seq_id=1), make_seq(prompt, seq_id=2)
    for seq in (first, parent):
        assert manager.allocate(seq, 8)
        seq.num_computed_tokens = 8
    manager.register_computed_blocks(first)  # blocks 0, 1 registered
    child = make_seq(prompt, seq_id=3)
    assert manager.fork(parent, child) is None  # forked before the parent registers (same launch)
    manager.register_computed_blocks(parent)
    assert parent.block_ids == [0, 1] and child.block_ids == [2, 3]
    assert ref_counts(manager)[:4] == [2, 2, 1, 1]  # the duplicates live on for the child
    child.num_computed_tokens = 8
    manager.register_computed_blocks(child)
    assert child.block_ids == [0, 1] and ref_counts(manager)[:4] == [3, 3, 0, 0]
    for seq in (first, parent, child):
        manager.free(seq)
    assert manager.num_free_blocks == 8


def test_fork_shares_full_blocks_and_copies_the_partial_one(manager):
    parent = make_seq(range(6), seq_id=1)
    compute(manager, parent)
    child = make_seq(range(6), seq_id=2)
    assert manager.fork(parent, child) == (1, 2)
    assert child.block_ids == [0, 2] and child.num_registered_blocks == 1
    assert ref_counts(manager)[:3] == [2, 1, 1]
    aligned = make_seq(range(8), seq_id=3)
    compute(manager, aligned)
    twin = make_seq(range(8), seq_id=4)
    assert manager.fork(aligned, twin) is None
    assert twin.block_ids == aligned.block_ids
    for seq in (parent, child, aligned, twin):
        manager.free(seq)
    assert manager.num_free_blocks == 8


def test_a_block_table_is_replaced_never_changed_in_place(manager):
    """A step's inputs and the persistent decode batch's rows hold a sequence's block_ids list
    by reference and take the same object for the same table (engine/decode_batch.py): each
    change must come as a new list, and a list handed out must keep its contents."""
    seq = make_seq(range(4), seq_id=1)
    compute(manager, seq)
    held = seq.block_ids
    assert manager.allocate(seq, 0) and seq.block_ids is held  # no new block: the same list
    seq.token_ids.append(99)
    assert manager.allocate(seq, 1)
    assert seq.block_ids == [0, 1] and seq.block_ids is not held and held == [0]
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    first, second = make_seq(prompt, seq_id=2), make_seq(prompt, seq_id=3)
    for other in (first, second):
        assert manager.allocate(other, 8)
        other.num_computed_tokens = 8
    manager.register_computed_blocks(first)
    before_swap = second.block_ids
    copy_before = list(before_swap)
    manager.register_computed_blocks(second)  # swapped onto first's blocks
    assert second.block_ids == first.block_ids and before_swap == copy_before and second.block_ids is not before_swap
    child = make_seq(range(5), seq_id=4)
    seq.num_computed_tokens = 5
    assert manager.fork(seq, child) is not None
    assert child.block_ids is not seq.block_ids and seq.block_ids == [0, 1]
    freed = seq.block_ids
    manager.free(seq)
    assert freed == [0, 1] and seq.block_ids == []
    for other in (first, second, child):
        manager.free(other)
    assert manager.num_free_blocks == 8


def test_fork_needs_a_free_block_for_the_partial_copy():
    manager = BlockManager(num_blocks=2, block_size=BLOCK_SIZE)
    parent = make_seq(range(6))
    compute(manager, parent)
    assert not manager.can_fork(parent)


def test_prefix_caching_off_never_hits(manager):
    off = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    compute(off, make_seq(range(8), seq_id=1))
    assert off.find_cached_blocks(make_seq(range(9), seq_id=2)) == []
    assert off.stats().num_blocks_cached == 0


def test_stats_count_prefix_lookups(manager):
    manager.count_prefix_lookup(40, 32)
    manager.count_prefix_lookup(10, 0)
    stats = manager.stats()
    assert (stats.prefix_queried_tokens_total, stats.prefix_hit_tokens_total) == (50, 32)
    assert (stats.num_blocks_total, stats.num_blocks_used, stats.num_blocks_free) == (8, 0, 8)
