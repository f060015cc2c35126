"""Rank 0's steps to the other ranks (engine/step_broadcast.py), through real gloo processes:
decode block tables go as changes, and a rank puts back the very list it got before for a
sequence whose table did not change (so its BlockTableRows uploads nothing for it)."""

from __future__ import annotations

import multiprocessing

import torch

from llmserve.inference.engine.step_broadcast import StepBroadcast
from llmserve.inference.models.rank_group import RankGroup, exit_without_teardown
from llmserve.inference.models.step_inputs import StepInputs

TIMEOUT_S = 120


def decode(seq_ids: list[int], tables: list[list[int]]) -> StepInputs:
    return StepInputs(
        input_ids=[1] * len(seq_ids), positions=[0] * len(seq_ids), slot_mapping=[0] * len(seq_ids),
        decode_block_tables=tables, decode_context_lens=[1] * len(seq_ids), decode_seq_ids=seq_ids,
        logits_indices=list(range(len(seq_ids))),
    )  # fmt: skip


def steps() -> list[StepInputs]:
    a, b, b2 = [0, 1], [2], [2, 3]
    return [
        decode([1, 2], [a, b]),
        decode([1, 2], [a, b2]),  # 1 unchanged (the same list), 2 grew a block (a new list)
        decode([2], [b2]),  # 1 skips a step
        decode([1, 2], [a, b2]),  # 1 is back with the same list: sent whole, since it skipped
        decode([7], [[5, 6]]),
    ]


def _rank_main(store_path: str, rank: int, results) -> None:
    group = RankGroup.join(store_path, 2, rank, torch.device("cpu"))
    try:
        broadcast = StepBroadcast(group, torch.device("cpu"))
        if group.is_leader:
            for step in steps():
                broadcast.send([], step, None)
            broadcast.stop()
            results.put((rank, None))
        else:
            received, previous = [], {}
            while (step := broadcast.receive()) is not None:
                tables = step.inputs.decode_block_tables
                kept = [previous.get(seq_id) is table for seq_id, table in zip(step.inputs.decode_seq_ids, tables)]
                received.append((tables, kept))
                previous = dict(zip(step.inputs.decode_seq_ids, tables))
            results.put((rank, received))
    finally:
        group.leave()
        results.close()
        results.join_thread()
        exit_without_teardown()


def test_unchanged_decode_tables_arrive_as_the_list_received_before():
    import tempfile

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        ranks = [context.Process(target=_rank_main, args=(f"{directory}/rendezvous", r, results)) for r in range(2)]
        for process in ranks:
            process.start()
        gathered = dict(results.get(timeout=TIMEOUT_S) for _ in ranks)
        for process in ranks:
            process.join(TIMEOUT_S)
    assert [p.exitcode for p in ranks] == [0, 0]
    received = gathered[1]
    assert [tables for tables, _ in received] == [step.decode_block_tables for step in steps()]
    assert [kept for _, kept in received] == [
        [False, False], [True, False], [True], [False, True], [False],
    ]
