"""Run a function on every rank of a real tensor-parallel group: spawned processes joined over
gloo at a file rendezvous, as the engine's ranks join (models/rank_group.py)."""

from __future__ import annotations

import multiprocessing
from typing import Callable, NoReturn

import torch

from llmserve.inference.models.rank_group import RankGroup, exit_without_teardown

RANK_TIMEOUT_S = 300


def run_ranks(work, world_size: int, store_path: str, *args, device: str = "cpu") -> dict[int, object]:
    """`work(group, *args)` on each of `world_size` processes (a module-level function: it is
    pickled to them); what each returned, by rank. Every rank must exit 0."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=_rank_main, args=(work, store_path, world_size, rank, device, args, results))
        for rank in range(world_size)
    ]
    for process in ranks:
        process.start()
    try:
        gathered = dict(results.get(timeout=RANK_TIMEOUT_S) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=RANK_TIMEOUT_S)
    assert [p.exitcode for p in ranks] == [0] * world_size
    return gathered


def _rank_main(work, store_path: str, world_size: int, rank: int, device: str, args: tuple, results) -> None:
    # gloo on CUDA too: the ranks share the one GPU a test machine has (NCCL refuses that).
    group = RankGroup.join(store_path, world_size, rank, torch.device(device), backend="gloo")
    put_result_and_exit(results, lambda: (rank, work(group, *args)), group.leave)


def put_result_and_exit(results, produce: Callable[[], object], leave: Callable[[], None]) -> NoReturn:
    """A rank process's end: put what `produce()` returns on `results`, `leave()` its group
    whatever happened, and exit without teardown (exit code 1 if `produce` raised)."""
    exit_code = 1
    try:
        results.put(produce())
        exit_code = 0
    finally:
        leave()
        results.close()
        results.join_thread()  # the result is written before the process ends without teardown
        exit_without_teardown(exit_code)
