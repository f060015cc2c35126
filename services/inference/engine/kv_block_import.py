"""Copying a prompt's prefix blocks out of another replica's KV pool into ours (issue 22, KV
pull; docs/transport.md), on the engine core's thread.

The source replica has pinned the blocks (they stay put until it releases them) and said where
they are (KvPullSource: its region's offer, its pool's layout, its block ids for the prompt's
first blocks). Here, for the blocks of the prompt this replica does not already cache:
  1. take free blocks for them (BlockManager.allocate, as for a prompt being admitted);
  2. copy them from the mapped source region: a gather by block ids (on CUDA one kernel,
     kernels/block_copy.py), or one copy when they are one run on both sides (run by run from
     another GPU);
  3. register them in the prefix cache under the prompt's chained hashes (as if computed here);
  4. let them go: they stay cached, most recently freed, for the request submitted next.
Anything that does not fit (another layout, no free blocks, a path without a mapping) pulls
nothing: the request recomputes those tokens. The source's region is mapped once, on the first
pull from it, and kept (TensorConsumer).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from llmserve.inference import kernels
from llmserve.inference.engine.block_manager import BlockManager
from llmserve.inference.engine.kv_cache import KVCache
from llmserve.inference.engine.kv_pool_export import KvPoolLayout
from llmserve.inference.engine.sequence import Sequence
from llmserve.tensor_transport import RegionOffer, TensorConsumer, TransportPath


@dataclass(frozen=True, slots=True)
class KvPullSource:
    """Where another replica holds (pinned) the first blocks of a prompt."""

    offer: RegionOffer  # its pool's region, offered to this replica
    layout: KvPoolLayout
    block_ids: tuple[int, ...]  # its block ids of the prompt's blocks 0, 1, ..., in order


@dataclass(frozen=True, slots=True)
class KvImport:
    """What one pull copied, for the server's metrics (the engine core's own counters are not
    scraped when it runs in a process of its own)."""

    num_blocks: int
    num_bytes: int
    path: TransportPath
    opened_region: bool  # the source's region was mapped for this pull (its first from there)
    copy_s: float = 0.0  # the copies alone, done (synchronized on CUDA): the pull's bandwidth
    # The copy kernel's own time on the GPU (CUDA events around it), without the ids' upload,
    # the launch and the wait for the engine's work queued before it; None off CUDA.
    copy_device_s: float | None = None
    work_s: float = 0.0  # all of the import in the engine core: lookups, allocation, copies, registration


class KvPullRefused(Exception):
    """The pull cannot be made; `reason` is a metric label (llmserve_kv_pull_failures_total)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # crosses the engine-core pipe as a CoreReply's error
        return (KvPullRefused, (self.reason, str(self)))


# A gather's temporary, at most: a few hundred blocks of an 8B model, a small part of the
# memory the pool leaves free.
_GATHER_BYTES = 64 << 20


class KvBlockImporter:
    def __init__(self, kv_cache: KVCache, block_manager: BlockManager, gather_bytes: int = _GATHER_BYTES):
        self._gather_bytes = gather_bytes
        self._kv_cache = kv_cache
        self._block_manager = block_manager
        self._layout = KvPoolLayout.of(kv_cache.data)
        self._consumer = TensorConsumer()

    def import_prefix(self, seq: Sequence, source: KvPullSource) -> KvImport:
        """Pull the blocks of `seq`'s prompt that the source holds and we do not (none: nothing
        to pull). Raises KvPullRefused when it cannot."""
        started_s = time.perf_counter()
        imported = self._import_prefix(seq, source)
        return dataclasses.replace(imported, work_s=time.perf_counter() - started_s)

    def _import_prefix(self, seq: Sequence, source: KvPullSource) -> KvImport:
        self._check(source)
        if not self._block_manager.enable_prefix_caching:
            raise KvPullRefused("prefix_caching_off", "pulled blocks are found through the prefix cache, which is off")
        block_manager, block_size = self._block_manager, self._block_manager.block_size
        cached_ids = block_manager.find_cached_blocks(seq)
        num_source = min(len(source.block_ids), (seq.num_tokens - 1) // block_size)
        num_pulled = num_source - len(cached_ids)
        if num_pulled <= 0:
            return KvImport(0, 0, source.offer.path, False)
        if not block_manager.allocate(seq, num_pulled * block_size, cached_ids):
            raise KvPullRefused("no_free_blocks", f"{num_pulled} free blocks are not there to pull into")
        num_opened_before = self._consumer.num_regions_opened
        try:
            self._open(source.offer)
            copy_started_s = time.perf_counter()
            copy_device_s = self._copy(
                source, source.block_ids[len(cached_ids) : num_source], seq.block_ids[len(cached_ids) : num_source]
            )
            copy_s = time.perf_counter() - copy_started_s
            seq.num_computed_tokens = num_source * block_size
            block_manager.register_computed_blocks(seq)
        finally:
            block_manager.free(seq)
            seq.num_computed_tokens = 0
        opened_region = self._consumer.num_regions_opened > num_opened_before
        return KvImport(num_pulled, num_pulled * source.layout.bytes_per_block, source.offer.path, opened_region, copy_s,
                        copy_device_s=copy_device_s)

    def forget(self, region_id: str) -> None:
        self._consumer.close(region_id)

    def close(self) -> None:
        self._consumer.close_all()

    def _open(self, offer: RegionOffer) -> None:
        try:
            self._consumer.open(offer)
        except OSError as error:  # its segment is gone: the source died (its reaper unlinked it)
            raise KvPullRefused("source_gone", f"the source's region cannot be mapped: {error}") from error

    def _check(self, source: KvPullSource) -> None:
        if source.offer.path is TransportPath.INLINE:
            raise KvPullRefused("no_shared_memory", "the source's pool cannot be mapped here (no shm or CUDA IPC path)")
        if not self._layout.can_exchange_with(source.layout):
            raise KvPullRefused("layout_mismatch", f"the source's pool {source.layout} differs from ours {self._layout}")

    def _copy(self, source: KvPullSource, source_ids: tuple[int, ...], target_ids: list[int]) -> float | None:
        """Every layer's k and v of the blocks at once. On one CUDA device: one kernel for
        whatever the ids are (kernels/block_copy.py). Elsewhere: a gather by block ids (in
        chunks of at most `_gather_bytes`) when the blocks are not one run on both sides, else
        one strided copy; a source on another GPU run by run (a gather would need a temporary
        on the source's GPU, whose memory its own pool holds).

        Measured on the H200 (docs/benchmarks.md, KV pull): a copy per run, the first design,
        moved an 8k-token import of 231 MB at 10 GB/s; the torch gather at 133-211 GB/s (8k
        tokens, 231 MB and 1,057 MB); the kernel, then for gathers only, at 193-603 GB/s. On an
        H100 the kernel alone moves 1.15-1.42 TB/s from 231 MB on (bench/bench_block_copy.py),
        1.2 TB/s at 1,057 MB in the server. Returns the kernel's own device seconds (None
        without it)."""
        pool = _raw(self._kv_cache.data)
        whole = source.layout.block_run_ref(source.offer.region_id, 0, source.layout.num_blocks)
        num_bytes = len(source_ids) * source.layout.bytes_per_block
        source_pool = _raw(self._consumer.view(whole, num_bytes))  # orders the reads after the source's writes
        same_device = source_pool.device == pool.device
        if same_device and pool.device.type == "cuda" and kernels.is_available():
            return self._copy_by_kernel(source_pool, source_ids, target_ids, pool)
        runs = _consecutive_runs(list(zip(source_ids, target_ids)))
        if len(runs) > 1 and same_device:
            self._gather(source_pool, source_ids, target_ids, pool)
        else:
            for start, length in runs:
                first_source, first_target = source_ids[start], target_ids[start]
                pool[:, :, first_target : first_target + length].copy_(
                    source_pool[:, :, first_source : first_source + length], non_blocking=True
                )
        if pool.device.type == "cuda":
            # Deliberate sync: the source releases its pin once we answer, so the copies must be done.
            torch.cuda.current_stream(pool.device).synchronize()
        return None

    def _copy_by_kernel(self, source_pool: torch.Tensor, source_ids: tuple[int, ...], target_ids: list[int],
                        pool: torch.Tensor) -> float:
        """The kernel's copy, waited for (the source releases its pin once we answer); its own
        device seconds, from CUDA events around it."""
        from llmserve.inference.kernels.block_copy import copy_blocks  # imports triton: only here

        ids = ids_on_device(source_ids, target_ids, pool.device)
        stream = torch.cuda.current_stream(pool.device)
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record(stream)
        copy_blocks(source_pool, pool, ids[0], ids[1])
        ended.record(stream)
        ended.synchronize()
        return began.elapsed_time(ended) / 1000

    def _gather(self, source_pool: torch.Tensor, source_ids: tuple[int, ...], target_ids: list[int], pool: torch.Tensor) -> None:
        source_index = torch.tensor(source_ids, dtype=torch.int64).to(pool.device, non_blocking=True)
        target_index = torch.tensor(target_ids, dtype=torch.int64).to(pool.device, non_blocking=True)
        bytes_per_block = pool[:, :, 0].nbytes
        blocks_per_chunk = max(1, self._gather_bytes // bytes_per_block)
        for start in range(0, len(source_ids), blocks_per_chunk):
            chunk = slice(start, start + blocks_per_chunk)
            # index_select then index_copy_: the blocks pass through a temporary of the chunk's size.
            pool.index_copy_(2, target_index[chunk], source_pool.index_select(2, source_index[chunk]))


def ids_on_device(source_ids: tuple[int, ...], target_ids: list[int], device: torch.device) -> torch.Tensor:
    """[2, pairs] int64 ids on `device`. Through numpy: torch.tensor on the nested lists took
    54-56 µs for 504 pairs (an 8k-token pull) on the development machine, numpy 15-19 µs (3 runs;
    docs/benchmarks.md, "Nineteenth session"); a pull's copy waits for it."""
    return torch.from_numpy(np.array([source_ids, target_ids], dtype=np.int64)).to(device, non_blocking=True)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """float8 pools are copied as bytes (indexing float8 tensors is not supported everywhere)."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def _consecutive_runs(id_pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start index, length) of each run of (source, target) block ids that both go up by one."""
    runs: list[tuple[int, int]] = []
    for index, (source_id, target_id) in enumerate(id_pairs):
        if runs and id_pairs[index - 1] == (source_id - 1, target_id - 1):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs
