"""The KV block pool: fixed-size blocks, reference counts, and the prefix cache. Pure Python.

A block holds the K/V of `block_size` consecutive tokens of one or more sequences (shared
blocks are read-only prefixes, counted by `ref_count`). A full, computed block is registered in
the prefix cache under its chained hash (llmserve.block_hash), so a later sequence with the
same prefix reuses it instead of recomputing.

The free queue orders every block with ref_count 0, first to be reused first:
  * blocks holding nothing reusable (never registered, or evicted) at the front;
  * registered blocks after them, least recently freed first (LRU). They stay findable by hash
    until reused, at which point they are evicted from the cache.
A sequence frees its blocks tail first, so its prefix (most likely to be shared) outlives its
suffix.

Reuse is exact even if two prefixes' hashes collide: a block is reused only when its stored
token ids equal the sequence's and it was computed on top of the very block matched before it
(checked through registration ids), so the whole prefix is verified token by token.

Twins: sequences admitted in the same step with a common prefix (many users of one system
prompt arriving together) each compute that prefix into blocks of their own, and a prompt of a
whole number of blocks recomputes its last block (find_cached_blocks) beside the cached one.
The first to register a block enters it; each later sequence swaps onto that registered twin
(same hash, tokens and parent) and frees its duplicate, so its later blocks register with the
twin as parent and stay findable. The swap is safe with a step launched and not processed
(async scheduling): a block is registered once the step that computes it is launched, every
step that names the duplicate is launched by then (their block tables were copied out of
`block_ids` when they were staged), and the device runs steps in launch order on one stream,
so a new owner of the duplicate (given it by a later schedule) writes only after those steps
read it; and the twin was computed by a step launched no later, so the sequence's next step
reads it complete. Nothing enters or leaves the cache in a swap.

Every change to the prefix cache is recorded as a CacheEvent (engine/types.py) until
take_events(): a registration as stored, an eviction as removed. Freeing sends nothing: a freed
block stays findable.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmserve.inference.engine.sequence import Sequence
from llmserve.inference.engine.types import CacheEvent


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens of a registered block, compared on a hit
    registration_id: int = 0  # unique per registration; 0 = not registered
    parent_registration_id: int = 0  # registration id of the block before it (0 for block 0)


@dataclass(frozen=True, slots=True)
class BlockStats:
    num_blocks_total: int
    num_blocks_used: int  # referenced by a sequence
    num_blocks_free: int  # reusable now, cached ones included
    num_blocks_cached: int  # registered in the prefix cache (in use or free)
    prefix_queried_tokens_total: int
    prefix_hit_tokens_total: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._next_registration_id = 1
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0
        self._events: list[CacheEvent] = []

    # --- queries ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free blocks in the order they will be reused, first first (the free queue of the
        module docstring): what an eviction order is checked against."""
        return list(self._free)

    def stats(self) -> BlockStats:
        return BlockStats(
            num_blocks_total=self.num_blocks,
            num_blocks_used=self.num_used_blocks,
            num_blocks_free=self.num_free_blocks,
            num_blocks_cached=len(self._cached),
            prefix_queried_tokens_total=self._num_queried_tokens,
            prefix_hit_tokens_total=self._num_hit_tokens,
        )

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`; changes nothing.

        At most (num_tokens - 1) // block_size blocks, so the last token is always computed (its
        logits are needed to sample). When num_tokens is a multiple of block_size, that leaves
        out the whole last block: all its block_size tokens are recomputed, into a fresh block.
        """
        if not self.enable_prefix_caching:
            return []
        hit_ids: list[int] = []
        parent_registration_id = 0
        for index in range((seq.num_tokens - 1) // self.block_size):
            block_id = self._cached.get(seq.block_hash(index, self.block_size))
            if block_id is None:
                break
            block = self.blocks[block_id]
            if not _holds(block, seq.block_token_ids(index, self.block_size), parent_registration_id):
                break
            hit_ids.append(block_id)
            parent_registration_id = block.registration_id
        return hit_ids

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        num_needed = self._num_new_blocks(seq, num_new_tokens, cached_block_ids)
        num_cached_free = sum(1 for block_id in cached_block_ids if self.blocks[block_id].ref_count == 0)
        return num_needed + num_cached_free <= len(self._free)

    # --- changes ---------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens; False (and no change) if short.

        A sequence without blocks first adopts `cached_block_ids` (from find_cached_blocks,
        same step), which become its first blocks: the caller records their
        len(cached_block_ids) * block_size tokens as computed.
        """
        if not self.can_allocate(seq, num_new_tokens, cached_block_ids):
            return False
        num_new_blocks = self._num_new_blocks(seq, num_new_tokens, cached_block_ids)
        if not seq.block_ids:
            self._adopt_cached(seq, cached_block_ids)
        if num_new_blocks:  # a new list: Sequence.block_ids is never changed in place
            seq.block_ids = seq.block_ids + [self._take_free_block() for _ in range(num_new_blocks)]
        return True

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first (the caller resets its computed tokens)."""
        for block_id in reversed(seq.block_ids):
            self._release(block_id)
        seq.block_ids = []
        seq.num_registered_blocks = 0

    def can_fork(self, parent: Sequence) -> bool:
        return parent.num_computed_tokens % self.block_size == 0 or bool(self._free)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` blocks for the parent's computed tokens (the caller records them as the
        child's computed tokens): full blocks shared (ref counts), the partial last block copied
        into a fresh block. Returns the (src, dst) block copy the model runner must make before
        the next forward, or None if none is needed. Needs can_fork(parent).
        """
        assert self.can_fork(parent) and not child.block_ids
        num_full = parent.num_computed_tokens // self.block_size
        has_partial = parent.num_computed_tokens % self.block_size != 0
        shared = parent.block_ids[:num_full]
        for block_id in shared:
            self.blocks[block_id].ref_count += 1
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
        if not has_partial:
            child.block_ids = shared
            return None
        child.block_ids = shared + [self._take_free_block()]
        return parent.block_ids[num_full], child.block_ids[-1]

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's newly full, computed blocks into the prefix cache, swapping onto
        the registered twin of any block another sequence entered first (module docstring).

        Called once the step that computes them is launched."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for index in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_ids[index]]
            if block.registration_id == 0:
                # Blocks before num_registered_blocks are registered and held, so never evicted.
                parent_registration_id = self.blocks[seq.block_ids[index - 1]].registration_id if index else 0
                block_hash = seq.block_hash(index, self.block_size)
                token_ids = seq.block_token_ids(index, self.block_size)
                cached_id = self._cached.get(block_hash)
                if cached_id is None:
                    parent_hash = self.blocks[seq.block_ids[index - 1]].block_hash if index else None
                    self._register(block, block_hash, token_ids, parent_registration_id, parent_hash)
                elif _holds(self.blocks[cached_id], token_ids, parent_registration_id):
                    self._swap(seq, index, cached_id)
                else:
                    break  # a hash collision: the cached block holds another prefix
            seq.num_registered_blocks = index + 1

    def hold(self, block_ids: list[int]) -> None:
        """One more reference to each block, owned by no sequence: a pin while another replica
        copies them (KV pull). Held blocks are neither reused nor evicted until released."""
        for block_id in block_ids:
            self._reference(block_id)

    def release(self, block_ids: list[int]) -> None:
        """Drop the references `hold` took, tail first (as a sequence frees its blocks)."""
        for block_id in reversed(block_ids):
            self._release(block_id)

    def take_events(self) -> list[CacheEvent]:
        """The prefix-cache changes since the previous call, in the order they happened."""
        events, self._events = self._events, []
        return events

    def count_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self._num_queried_tokens += num_queried_tokens
        self._num_hit_tokens += num_hit_tokens

    # --- internals -------------------------------------------------------------------------

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, cached_block_ids) -> int:
        if seq.block_ids:
            num_held, num_computed = len(seq.block_ids), seq.num_computed_tokens
        else:  # not admitted yet: the cached blocks will be its first blocks
            num_held, num_computed = len(cached_block_ids), len(cached_block_ids) * self.block_size
        return max(0, self.num_blocks_for(num_computed + num_new_tokens) - num_held)

    def _adopt_cached(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        for block_id in cached_block_ids:
            self._reference(block_id)
        seq.block_ids = list(cached_block_ids)
        seq.num_registered_blocks = len(cached_block_ids)

    def _swap(self, seq: Sequence, index: int, twin_id: int) -> None:
        """Point block `index` of `seq` at its registered twin and release the duplicate."""
        duplicate_id = seq.block_ids[index]
        self._reference(twin_id)
        block_ids = list(seq.block_ids)  # a new list: Sequence.block_ids is never changed in place
        block_ids[index] = twin_id
        seq.block_ids = block_ids
        self._release(duplicate_id)

    def _reference(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.registration_id == 0:
                self._free.move_to_end(block_id, last=False)  # nothing to keep: reuse first

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.registration_id:
            self._evict(block)
        block.ref_count = 1
        return block_id

    def _register(
        self, block: Block, block_hash: int, token_ids: tuple[int, ...], parent_registration_id: int,
        parent_hash: int | None,
    ) -> None:
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.registration_id = self._next_registration_id
        block.parent_registration_id = parent_registration_id
        self._next_registration_id += 1
        self._cached[block_hash] = block.block_id
        last = self._events[-1] if self._events else None
        if isinstance(last, tuple) and last[1][-1] == parent_hash:
            last[1].append(block_hash)  # the chain goes on: one event for the run
        else:
            self._events.append((parent_hash, [block_hash]))

    def _evict(self, block: Block) -> None:
        self._events.append(block.block_hash)
        del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
        block.registration_id = 0
        block.parent_registration_id = 0


def _holds(block: Block, token_ids: tuple[int, ...], parent_registration_id: int) -> bool:
    """True if the registered `block` holds `token_ids` computed on top of the block registered
    as `parent_registration_id`: the same prefix, verified token by token."""
    return block.token_ids == token_ids and block.parent_registration_id == parent_registration_id
