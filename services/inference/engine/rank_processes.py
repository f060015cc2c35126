"""RankProcesses: the tensor-parallel ranks 1..N-1 of one engine, spawned and watched by the
server process (rank 0 is the engine-core process itself, engine_process.py).

The server spawns every rank, not rank 0, so that it sees each rank's process end: a rank that
dies leaves the others blocked in a collective (NCCL waits for its timeout), so the server ends
them all and fails the engine, naming the rank (`dead_rank`). The ranks meet at a file
rendezvous in a directory of their own, removed when they are ended.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import shutil
import tempfile
from multiprocessing.context import SpawnContext
from pathlib import Path

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.rank_worker import run_rank_worker
from llmserve.observability import ObservabilityConfig

log = logging.getLogger(__name__)

_END_WAIT_S = 5.0


class RankProcesses:
    def __init__(self, config: EngineConfig, context: SpawnContext, log_level: str, observability: ObservabilityConfig):
        self.world_size = config.tensor_parallel_size
        self._directory = Path(tempfile.mkdtemp(prefix="llmserve-ranks-"))
        self.store_path = str(self._directory / "rendezvous")
        self._processes = {
            rank: context.Process(
                target=run_rank_worker, args=(config, rank, self.store_path, log_level, observability),
                name=f"engine-rank-{rank}",
            )  # fmt: skip
            for rank in range(1, self.world_size)
        }
        for process in self._processes.values():
            process.start()
        for rank, process in self._processes.items():
            log.info("tensor-parallel rank %d runs in process %d", rank, process.pid)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes.values()]

    @property
    def sentinels(self) -> list[int]:
        """Readable (on an event loop) once a rank's process has ended."""
        return [process.sentinel for process in self._processes.values()]

    @property
    def exit_codes(self) -> list[int | None]:
        """Ranks 1..N-1's exit codes (None: still running)."""
        return [process.exitcode for process in self._processes.values()]

    def dead_rank(self) -> str:
        """Which rank's process ended and how, or "" while all run."""
        ended = set(multiprocessing.connection.wait(self.sentinels, timeout=0))
        for rank, process in self._processes.items():
            if process.sentinel in ended:
                # The sentinel closes as the process exits, a moment before it can be reaped.
                process.join(_END_WAIT_S)
                return f"tensor-parallel rank {rank} (process {process.pid}) exited with code {process.exitcode}"
        return ""

    def join(self, timeout_s: float = _END_WAIT_S) -> None:
        """Wait for the ranks to leave by themselves (after rank 0's stop), then end the rest."""
        for process in self._processes.values():
            process.join(timeout_s)
        self.end()

    def end(self) -> None:
        """Kill every rank still running (blocked in a collective with a dead peer, it would never
        return) and remove the rendezvous."""
        for process in self._processes.values():
            if process.exitcode is None:
                process.kill()
        for process in self._processes.values():
            process.join(_END_WAIT_S)
        shutil.rmtree(self._directory, ignore_errors=True)
