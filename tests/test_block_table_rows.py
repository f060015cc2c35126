"""BlockTableRows and the decode graphs' staging over it: a sequence's block table stays in its
row across steps, only changed rows are sent, and the tables a step gathers on the device are
exactly its sequences' tables (appended blocks, a block swapped for its cached twin, sequences
that leave and arrive, rows taken back when none is free)."""

from __future__ import annotations

import random

import torch

from llmserve.inference.engine.block_table_rows import PADDING_ROW, BlockTableRows
from llmserve.inference.engine.cuda_graphs import DecodeGraphs, pad_decode_step
from llmserve.inference.models.step_inputs import StepInputs

CPU = torch.device("cpu")


def test_a_row_is_sent_only_when_its_table_is_a_new_list():
    """The same list object is the same table (block_ids is never changed in place); a new
    object is sent, even with the same contents (harmless: one re-upload)."""
    rows = BlockTableRows(max_seqs_per_step=2, width=8, device=CPU)
    table_10, table_11 = [1, 2], [3]
    first, changed = rows.assign([10, 11], [table_10, table_11])
    assert sorted(changed) == sorted((row, 0) for row in first) and PADDING_ROW not in first and len(set(first)) == 2
    again, changed = rows.assign([11, 10], [table_11, table_10])
    assert again == first[::-1] and changed == []
    table_10 = table_10 + [4]  # a new block: a new list, and only the new entry is sent
    grown, changed = rows.assign([10, 11], [table_10, table_11])
    assert grown == first and changed == [(first[0], 2)] and rows.written(first[0]) == [1, 2, 4]
    swapped, changed = rows.assign([10], [[1, 9, 4]])  # the prefix cache swapped block 2 for its twin 9
    assert changed == [(first[0], 0)] and rows.written(first[0]) == [1, 9, 4]
    shorter, changed = rows.assign([10], [[5]])  # recomputed after a preemption: a new, shorter table
    assert changed == [(first[0], 0)]
    resent, changed = rows.assign([11], [list(table_11)])  # equal contents, another object
    assert changed == [(resent[0], 0)]


def test_rows_of_sequences_not_in_the_step_are_taken_back_when_none_is_free():
    rows = BlockTableRows(max_seqs_per_step=2, width=4, device=CPU)
    assert rows.num_rows == 5
    tables = {seq_id: [seq_id] for seq_id in range(1, 6)}
    held, _ = rows.assign([1, 2], [tables[1], tables[2]])
    rows.assign([3, 4], [tables[3], tables[4]])  # every row but the padding row is taken now
    later, changed = rows.assign([2, 5], [tables[2], tables[5]])
    assert later[0] == held[1] and changed == [(later[1], 0)]  # 2 kept its row; 5 got a reclaimed one
    assert PADDING_ROW not in later


def _step(seq_ids: list[int], tables: dict[int, list[int]]) -> StepInputs:
    """A decode step; each table a new list (the tests below change theirs in place)."""
    step = StepInputs()
    for seq_id in seq_ids:
        table = tables[seq_id]
        context = len(table) * 4 - 1
        step.input_ids.append(seq_id)
        step.positions.append(context - 1)
        step.slot_mapping.append(table[-1] * 4)
        step.decode_block_tables.append(list(table))
        step.decode_context_lens.append(context)
        step.decode_seq_ids.append(seq_id)
    return step


def test_staged_steps_gather_each_sequences_table_and_pad_with_zero_rows():
    random.seed(3)
    graphs = DecodeGraphs(None, (4, 8), max_blocks_per_seq=16, metadata_for=None, device=CPU, pool=None)
    tables = {seq_id: [random.randrange(1, 500) for _ in range(random.randrange(1, 6))] for seq_id in range(40)}
    running = list(range(6))
    next_id = 6
    for step_index in range(60):
        for seq_id in running:
            if random.random() < 0.3 and len(tables[seq_id]) < 16:
                tables[seq_id].append(random.randrange(1, 500))  # a new block
            if random.random() < 0.05:
                tables[seq_id][0] = random.randrange(1, 500)  # swapped for a cached twin
        if step_index % 7 == 6:  # one leaves, another arrives
            running.remove(random.choice(running))
            running.append(next_id % 40)
            next_id += 1
        batch = random.sample(running, k=random.randrange(1, len(running) + 1))
        step = _step(batch, tables)
        size = 4 if len(batch) <= 4 else 8
        graphs._stage(step, size)
        padded = pad_decode_step(step, size)  # the padding values, as lists: the oracle
        assert graphs.input_ids[:size].tolist() == padded.input_ids and graphs.positions[:size].tolist() == padded.positions
        assert graphs.slot_mapping[:size].tolist() == padded.slot_mapping
        assert graphs.context_lens[:size].tolist() == padded.context_lens
        torch.index_select(graphs.rows.table, 0, graphs.table_rows[:size], out=graphs.block_tables[:size])
        for row, seq_id in enumerate(batch):
            assert graphs.block_tables[row, : len(tables[seq_id])].tolist() == tables[seq_id]
        assert graphs.block_tables[len(batch) : size].count_nonzero() == 0
        assert graphs.input_ids[: len(batch)].tolist() == batch


def test_a_step_without_a_graph_gets_its_decodes_tables_from_the_same_rows():
    graphs = DecodeGraphs(None, (4,), max_blocks_per_seq=6, metadata_for=None, device=CPU, pool=None)
    tables = {1: [4, 5], 2: [7], 3: [9, 8, 2]}
    step = _step([1, 2, 3], tables)
    graphs._stage(step, 4)  # a graph step first: rows written
    tables[2].append(11)
    eager = graphs.device_block_tables(_step([3, 2], tables))
    assert eager.shape == (2, 6)
    assert eager[0, :3].tolist() == [9, 8, 2] and eager[1, :2].tolist() == [7, 11]


def test_lists_sent_in_one_copy_keep_their_values_and_start_16_byte_aligned():
    from llmserve.inference.models.transfers import device_int32

    lists = [[1, 2, 3], [4, 5, 6, 7, 8], [], [9]]
    tensors = device_int32(lists, CPU)
    assert [t.tolist() for t in tensors] == lists
    assert all(t.dtype == torch.int32 and (t.storage_offset() * 4) % 16 == 0 for t in tensors)
