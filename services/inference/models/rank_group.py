"""RankGroup: the processes of one tensor-parallel engine and the collectives they run together.

One process per rank, joined through a file rendezvous (a path on the host's disk that does
not exist before the first join: no port to pick and race for; engine/rank_processes.py makes
it). Two torch.distributed groups over the same ranks:

  device group  the model's collectives on its tensors (the all-reduce after o_proj and
                down_proj, the embedding's all-reduce, the logits' all-gather): NCCL on CUDA,
                stream-ordered, so they queue like any kernel and a CUDA graph captures them;
                gloo on CPU;
  host group    gloo, for what only the host has: the agreement on the KV pool size at start,
                the barrier at the end, and a message too large for the ring's slot.
On CPU the two are one gloo group. Beside them, rank 0's messages to the others (the step each
rank runs, engine/step_broadcast.py) go through a ring in shared memory (models/rank_ring.py),
set up as the ranks join.

`SINGLE_RANK` is the group of one process: every collective returns its input, so the model
and the runner have one code path whether or not they are split.
"""

from __future__ import annotations

import logging
import pickle
from datetime import timedelta
from pathlib import Path

import torch

from llmserve.inference.models.rank_ring import TOO_LARGE, RankRing

log = logging.getLogger(__name__)

# How long a collective waits for a rank that is not there. A rank that died is found by its
# process ending (engine_process.py watches every rank), not by this timeout; it only bounds a
# rank that hangs.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# How long a rank polls for rank 0's next message before it sleeps on its FIFO (rank_ring.py):
# on a GPU, about a decode step (the next one is usually there within it) for a core that is
# the rank's own; on CPU, where the ranks share the host's cores with the work, none.
CUDA_RING_SPIN_S = 0.002


class RankGroup:
    """This process's place among the ranks, and the collectives over all of them."""

    def __init__(self, rank: int, size: int, device_group=None, host_group=None, backend: str = "",
                 ring: RankRing | None = None):
        self.rank = rank
        self.size = size
        self._device_group = device_group
        self._host_group = host_group
        self._backend = backend
        self._ring = ring  # None: messages go over the host group

    @classmethod
    def join(
        cls, store_path: str, world_size: int, rank: int, device: torch.device, backend: str | None = None,
        ring_spin_s: float | None = None,
    ) -> "RankGroup":
        """Block until all `world_size` ranks have joined at `store_path`. `backend`: NCCL for a
        CUDA device, gloo otherwise; gloo on CUDA lets ranks share one GPU (tests: NCCL refuses
        two ranks on one device), at a host copy per collective and without CUDA graphs.
        `ring_spin_s`: how long a rank polls for rank 0's next message (None: by the device)."""
        import torch.distributed as dist

        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"rank {rank} of {world_size} needs {device}: {torch.cuda.device_count()} GPUs visible")
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )  # fmt: skip
        device_group = dist.group.WORLD
        host_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend == "nccl" else device_group
        if backend == "nccl":
            # NCCL makes its communicator on the first collective, which must not be one a CUDA
            # graph is capturing (the runner captures its decode graphs at start).
            dist.all_reduce(torch.zeros(1, device=device), group=device_group)
            torch.cuda.synchronize(device)
        group = cls(rank, world_size, device_group, host_group, backend)
        if world_size > 1:
            group._ring = RankRing.open(
                rank, world_size, Path(store_path).parent, group.broadcast_object, group.barrier,
                spin_s=ring_spin_s if ring_spin_s is not None else CUDA_RING_SPIN_S if device.type == "cuda" else 0.0,
            )  # fmt: skip
        log.info("rank %d of %d joined (%s)", rank, world_size, backend)
        return group

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place; every rank gets the same values."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self._device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on each rank -> [rows, size * cols], rank r's columns r-th."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        tensor = tensor.contiguous()
        rows, cols = tensor.shape
        if self._backend == "nccl":  # one flat buffer: what NCCL gathers into, and a graph captures
            flat = torch.empty((self.size * rows, cols), dtype=tensor.dtype, device=tensor.device)
            dist.all_gather_into_tensor(flat, tensor, group=self._device_group)
            return flat.view(self.size, rows, cols).permute(1, 0, 2).reshape(rows, self.size * cols)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self._device_group)
        return torch.cat(parts, dim=1)

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's values into `tensor` on every rank (the same shape and dtype everywhere)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.broadcast(tensor, src=0, group=self._device_group)
        return tensor

    def broadcast_object(self, obj=None):
        """Rank 0's picklable `obj`, returned on every rank (the others pass nothing)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        holder = [obj]
        dist.broadcast_object_list(holder, src=0, group=self._host_group)
        return holder[0]

    def send_to_ranks(self, obj) -> None:
        """Rank 0: `obj` (picklable) to every other rank, which `receive_from_leader` returns in
        the order sent. Returns once it is written, not once it is read."""
        if self.size == 1:
            return
        if self._ring is None:
            self.broadcast_object(obj)
            return
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if not self._ring.send(payload):
            self.broadcast_object(payload)  # larger than a slot: in its turn, over the host group

    def receive_from_leader(self):
        """The other ranks: rank 0's next `send_to_ranks` object (waits for it)."""
        if self._ring is None:
            return self.broadcast_object()
        message = self._ring.receive(pickle.loads)
        return pickle.loads(self.broadcast_object()) if message is TOO_LARGE else message

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier(group=self._host_group)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (each rank sizes its KV pool from its own free
        memory; they must agree, since one block table addresses every rank's pool)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._host_group)
        return int(tensor.item())

    def leave(self) -> None:
        """Every rank calls this last, then ends its process with `exit_without_teardown`: the
        ranks finish together, and nobody tears the groups down. gloo's teardown aborted a rank
        (SIGABRT, "terminate called without an active exception") whose peer closed first, in
        about 1 run of 4 here, and still about 1 in 20 after a barrier."""
        self.barrier()
        if self._ring is not None:
            self._ring.close()


def exit_without_teardown(code: int = 0) -> None:
    """End a rank's process now: logs flushed, no destructors (see RankGroup.leave)."""
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


SINGLE_RANK = RankGroup(rank=0, size=1)
