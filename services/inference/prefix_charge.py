"""The KV charge of shared prompt prefixes: which full prompt blocks the in-flight requests of a
replica hold, by chained hash (llmserve.block_hash), each charged once however many hold it.

The prefix cache makes requests with a common prefix (one system prompt) share the same
physical blocks, so the blocks they hold together are the distinct full prompt blocks plus each
one's own partial and decode blocks. A reference count per hash over the in-flight requests
keeps that exact: a request is charged only the hashes no other in-flight request holds, and a
hash's charge is released when the last holder ends (whoever it was first charged to).

A block that is cached but held by no in-flight request is evictable: a request that reuses it
holds it from then on, so it is charged like one it computes.

The hashes are the engine's own (engine/sequence_factory.py): the request's (from preprocess)
where cut and defined like this replica's, else chained from the namespace seed of its cache
salt, so requests of different tenants never share a charge, as they share no block. The
engine reuses a block only when its tokens match too; a hash collision (64 bits) would merely
charge two different blocks once.
"""

from __future__ import annotations

from llmserve.block_hash import HASH_VERSION, HashNamespace, chain_block_hashes
from llmserve.inference.engine.types import EngineRequest


def prompt_block_hashes(request: EngineRequest, namespace: HashNamespace) -> list[int]:
    """The hashes the engine gives the request's full prompt blocks: its own when cut and
    defined like ours (extended where it sent fewer), else computed like Sequence.block_hash."""
    block_size = namespace.block_size_tokens
    num_full_blocks = len(request.prompt_token_ids) // block_size
    hashes: list[int] = []
    if request.block_size_tokens == block_size and request.block_hash_version == HASH_VERSION:
        hashes = list(request.block_hashes[:num_full_blocks])
    parent = hashes[-1] if hashes else namespace.seed(request.cache_salt)
    hashes += chain_block_hashes(request.prompt_token_ids[len(hashes) * block_size :], block_size, parent)
    return hashes


class PrefixCharge:
    """Reference counts of the prompt-block hashes that admitted requests hold, and of the
    holders that have started (produced a token: their prompt's blocks are computed and in the
    prefix cache, where a later sharer finds them). O(blocks of the prompt) per call; runs on
    the event loop with admission."""

    def __init__(self) -> None:
        self._num_holders: dict[int, int] = {}  # block hash -> in-flight requests holding it
        self._num_started_holders: dict[int, int] = {}  # those of them that have started (> 0 only)

    @property
    def num_blocks(self) -> int:
        """Blocks charged for every in-flight prompt's full blocks: one per distinct hash."""
        return len(self._num_holders)

    def num_unheld(self, block_hashes: list[int]) -> int:
        """Blocks of `block_hashes` that a request holding them would add to the charge."""
        return sum(1 for block_hash in block_hashes if block_hash not in self._num_holders)

    def num_held_uncomputed(self, block_hashes: list[int]) -> int:
        """Blocks of `block_hashes` held, but by no request that has started: the engine may be
        computing them for a holder while a request with this prompt computes them again."""
        return sum(
            1
            for block_hash in block_hashes
            if block_hash in self._num_holders and block_hash not in self._num_started_holders
        )

    def num_leading_held(self, block_hashes: list[int]) -> int:
        """Leading blocks of the chain `block_hashes` already held: their KV is computed (or being
        computed) for another request, so a request with this prompt finds them cached."""
        for index, block_hash in enumerate(block_hashes):
            if block_hash not in self._num_holders:
                return index
        return len(block_hashes)

    def hold(self, block_hashes: list[int]) -> int:
        """Count one more holder of each hash; returns how many blocks became charged."""
        return _count_up(self._num_holders, block_hashes)

    def start(self, block_hashes: list[int]) -> None:
        """A holder of `block_hashes` has started."""
        _count_up(self._num_started_holders, block_hashes)

    def release(self, block_hashes: list[int], *, has_started: bool) -> int:
        """Count one holder less of each hash (held before, started or not); returns how many
        blocks' charge ended with it, its last holder."""
        if has_started:
            _count_down(self._num_started_holders, block_hashes)
        return _count_down(self._num_holders, block_hashes)


def _count_up(counts: dict[int, int], block_hashes: list[int]) -> int:
    """Increment each hash's count; returns how many were not counted before."""
    num_new = 0
    for block_hash in block_hashes:
        count = counts.get(block_hash, 0)
        counts[block_hash] = count + 1
        num_new += count == 0
    return num_new


def _count_down(counts: dict[int, int], block_hashes: list[int]) -> int:
    """Decrement each hash's count, dropping those that reach 0; returns how many did."""
    num_dropped = 0
    for block_hash in block_hashes:
        count = counts[block_hash] - 1
        if count:
            counts[block_hash] = count
        else:
            del counts[block_hash]
            num_dropped += 1
    return num_dropped
