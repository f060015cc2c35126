"""Rank 0's steps to the other ranks (engine/step_broadcast.py), through real gloo processes:
decode block tables go as changes, and a rank puts back the very list it got before for a
sequence whose table did not change."""

from __future__ import annotations

import torch

from llmserve.inference.engine.step_broadcast import StepBroadcast
from llmserve.inference.models.rank_group import RankGroup
from llmserve.inference.models.step_inputs import StepInputs
from tests.rank_runs import run_ranks


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


def _send_or_receive_steps(group: RankGroup):
    """Rank 0: steps() then stop. The others: each step's tables, and for each row whether it is
    the very list received for its sequence the step before."""
    broadcast = StepBroadcast(group, torch.device("cpu"))
    if group.is_leader:
        for step in steps():
            broadcast.send([], step, None)
        broadcast.stop()
        return None
    received, previous = [], {}
    while (step := broadcast.receive()) is not None:
        tables = step.inputs.decode_block_tables
        kept = [previous.get(seq_id) is table for seq_id, table in zip(step.inputs.decode_seq_ids, tables)]
        received.append((tables, kept))
        previous = dict(zip(step.inputs.decode_seq_ids, tables))
    return received


def test_unchanged_decode_tables_arrive_as_the_list_received_before(tmp_path):
    received = run_ranks(_send_or_receive_steps, 2, str(tmp_path / "rendezvous"))[1]
    assert [tables for tables, _ in received] == [step.decode_block_tables for step in steps()]
    assert [kept for _, kept in received] == [
        [False, False], [True, False], [True], [False, True], [False],
    ]
