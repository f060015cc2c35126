"""The KV demand of a replica's in-flight requests: the blocks they will hold together at their
full length (prompt + max_tokens), which admission keeps within the pool. Pure Python, on the
event loop with admission; O(blocks of the prompt) per request, its hashing included.

The prefix cache makes requests with a common prefix (one system prompt) share the same
physical blocks, so the blocks they hold together are the distinct full prompt blocks plus each
one's own: its partial last prompt block and its decode growth, per sequence (its n sequences
share the prompt's full blocks). The ledger is exact, not a guess: a reference count per full
block hash over the in-flight requests, so a request is charged only the hashes no other
in-flight request holds, and a hash's charge ends with its last holder (whoever it was first
charged to). A block that is cached but held by no in-flight request is evictable: a request
that reuses one holds it from then on, so it is charged like one it computes.

The hashes are the engine's own (engine/sequence_factory.py): the request's (from preprocess)
where cut and defined like this replica's, else chained from the namespace seed of its cache
salt, so tenants never share a charge, as they share no block. The engine reuses a block only
when its tokens match too; a hash collision (64 bits) would merely charge two blocks once, and
hashes a caller forges to collide the same (callers are our own services).

Twins (engine/block_manager.py): a request the engine schedules while a holder is still
computing the shared blocks computes them again beside it, into blocks of its own, until the
step that computes them is launched and it swaps onto the holder's. Those duplicates are held
for one step only, but within that step a running prefill chunk can need up to a whole step's
tokens of them (ceil(max_batched_tokens / block size) blocks; only one sequence is ever cut
mid-prefill), and a running sequence short of a block preempts (measured on the tiny model: a
sharer 8 tokens behind its holder's last chunk of 56 needed 4 blocks more than the demand). So
while a request waits whose shared blocks were held, at its admission, by requests none of
which had started (produced a token, so its prompt is computed and cached), admission keeps
min(those blocks, one step's blocks) free beyond the demand. Once a holder has started, a
sharer finds the blocks in the cache and computes none again. Left open: a started holder that
ends and whose blocks are evicted before two sharers admitted meanwhile reach the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.block_hash import HashNamespace, chain_block_hashes
from llmserve.inference.engine.types import EngineRequest


def kv_blocks_needed(request: EngineRequest, block_size_tokens: int) -> int:
    """Blocks the request holds at its full length: the prompt's full blocks, shared by its n
    sequences, plus each sequence's own blocks from there (its copy of a partial last one)."""
    num_prompt_tokens = len(request.prompt_token_ids)
    max_tokens = request.sampling.max_tokens
    assert max_tokens is not None, "preprocess resolves max_tokens; the servicer refuses a request without"
    num_shared = num_prompt_tokens // block_size_tokens
    num_per_sequence = -(-(num_prompt_tokens + max_tokens) // block_size_tokens) - num_shared
    return num_shared + request.sampling.n * num_per_sequence


def prompt_block_hashes(request: EngineRequest, namespace: HashNamespace) -> list[int]:
    """The hashes the engine gives the request's full prompt blocks: its own when cut and
    defined like ours (extended where it sent fewer), else computed like Sequence.block_hash."""
    block_size = namespace.block_size_tokens
    hashes = request.usable_block_hashes(block_size)
    parent = hashes[-1] if hashes else namespace.seed(request.cache_salt)
    hashes += chain_block_hashes(request.prompt_token_ids[len(hashes) * block_size :], block_size, parent)
    return hashes


@dataclass(slots=True)
class RequestDemand:
    """What one request brings to the KV demand, given what the in-flight requests hold."""

    num_kv_blocks: int  # at its full length, alone
    block_hashes: list[int]  # of its full prompt blocks (the ledger's keys); none where nothing is shared
    num_own_kv_blocks: int  # num_kv_blocks less those full prompt blocks
    num_new_kv_blocks: int  # what admitting it adds to the demand
    num_twin_kv_blocks: int  # its full prompt blocks held, but by requests none of which has started
    num_prompt_tokens_to_prefill: int  # its prompt less the leading blocks another request holds


class KvDemand:
    """The ledger. `hash_namespace` None: the core shares no blocks (no pool, or no prefix
    cache), so each request is charged its whole prompt."""

    def __init__(
        self, *, hash_namespace: HashNamespace | None, block_size_tokens: int, max_batched_tokens: int,
    ):  # fmt: skip
        self._hash_namespace = hash_namespace
        self._block_size_tokens = block_size_tokens
        self._max_twin_blocks = -(-max_batched_tokens // block_size_tokens)
        self._num_holders: dict[int, int] = {}  # block hash -> in-flight requests holding it
        self._num_started_holders: dict[int, int] = {}  # those that have started (> 0 only)
        self._num_twin_blocks_waiting = 0  # num_twin_kv_blocks of the requests still waiting
        self.num_blocks = 0  # distinct held hashes + every in-flight request's own blocks

    def of(self, request: EngineRequest) -> RequestDemand:
        """What `request` would bring, given what is held now (nothing changes)."""
        num_prompt_tokens = len(request.prompt_token_ids)
        num_kv_blocks = kv_blocks_needed(request, self._block_size_tokens)
        if self._hash_namespace is None:
            return RequestDemand(num_kv_blocks, [], num_kv_blocks, num_kv_blocks, 0, num_prompt_tokens)
        hashes = prompt_block_hashes(request, self._hash_namespace)
        num_own_kv_blocks = num_kv_blocks - len(hashes)
        # Held hashes form a prefix of the chain (a holder holds its whole prompt's); the engine
        # computes a prompt's last token whatever is cached (BlockManager.find_cached_blocks).
        num_held = sum(1 for block_hash in hashes if block_hash in self._num_holders)
        num_cached_blocks = min(num_held, (num_prompt_tokens - 1) // self._block_size_tokens)
        num_twin = sum(
            1 for block_hash in hashes if block_hash in self._num_holders and block_hash not in self._num_started_holders
        )
        return RequestDemand(
            num_kv_blocks,
            hashes,
            num_own_kv_blocks,
            num_new_kv_blocks=num_own_kv_blocks + len(hashes) - num_held,
            num_twin_kv_blocks=num_twin,
            num_prompt_tokens_to_prefill=num_prompt_tokens - num_cached_blocks * self._block_size_tokens,
        )

    def twin_reserve_blocks(self, demand: RequestDemand) -> int:
        """Blocks to keep free beyond the demand once `demand` is admitted (module docstring)."""
        return min(self._max_twin_blocks, self._num_twin_blocks_waiting + demand.num_twin_kv_blocks)

    def add(self, demand: RequestDemand) -> None:
        """The request is admitted, waiting."""
        self.num_blocks += demand.num_own_kv_blocks + _count_up(self._num_holders, demand.block_hashes)
        self._num_twin_blocks_waiting += demand.num_twin_kv_blocks

    def stop_waiting(self, demand: RequestDemand, *, has_started: bool) -> None:
        """The request produced its first token (`has_started`), or ended without one."""
        self._num_twin_blocks_waiting -= demand.num_twin_kv_blocks
        if has_started:
            _count_up(self._num_started_holders, demand.block_hashes)

    def remove(self, demand: RequestDemand, *, has_started: bool) -> int:
        """The request ended (after stop_waiting); returns the blocks of demand released."""
        if has_started:
            _count_down(self._num_started_holders, demand.block_hashes)
        num_released = demand.num_own_kv_blocks + _count_down(self._num_holders, demand.block_hashes)
        self.num_blocks -= num_released
        return num_released


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
