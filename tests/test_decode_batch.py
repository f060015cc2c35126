"""The persistent batch of decoding sequences (engine/decode_batch.py) and the decode graphs'
rows that follow it: a sequence keeps its row across steps, only changed tables are written,
the array-built inputs equal the per-sequence definition (slot of each position, placeholder
inputs, one-token prefill chunks), and the tables a step gathers on the device are exactly its
sequences' tables while sequences arrive, leave, grow, swap blocks and lose their rows. Then the
engine on the decode graphs' path: requests aborted and past their deadline mid-batch, new ones
joining, and the survivors' tokens the same as without them."""

from __future__ import annotations

from tests.triton_cpu import HAS_TRITON, KERNEL_DEVICE  # noqa: I001  (before any kernel import)

import random
import time

import numpy as np
import pytest
import torch

from llmserve.inference.engine.batch_inputs import build_step_inputs
from llmserve.inference.engine.cuda_graphs import DecodeGraphs, pad_decode_step
from llmserve.inference.engine.decode_batch import PADDING_ROW, DecodeBatch
from llmserve.inference.engine.engine_loop import AbortRequest, AddRequest, EngineLoop
from llmserve.inference.engine.scheduler import ScheduledBatch
from llmserve.inference.engine.sequence import PLACEHOLDER_TOKEN, Sequence
from llmserve.inference.models.transfers import device_int32
from llmserve.sampling import FinishReason, SamplingParams
from tests.test_torch_engine import Result, drain, greedy, make_engine, make_prompt, request

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def decoding(seq_id: int, block_ids: list[int], num_tokens: int | None = None, placeholder_row: int = -1) -> Sequence:
    """A sequence about to compute its last token (of `num_tokens`, default: ends in its last block)."""
    num_tokens = num_tokens or len(block_ids) * BLOCK_SIZE - 1
    token_ids = [seq_id * 100 + i for i in range(num_tokens)]
    if placeholder_row >= 0:
        token_ids[-1] = PLACEHOLDER_TOKEN
    return Sequence(seq_id, f"r{seq_id}", 0, token_ids, 1, SamplingParams(max_tokens=500), block_ids=block_ids,
                    num_computed_tokens=num_tokens - 1, placeholder_row=placeholder_row)


def written_entries(changes: np.ndarray | None) -> list[tuple[int, int, int]]:
    return [] if changes is None else [tuple(entry) for entry in changes.T.tolist()]


def test_a_row_is_written_only_when_its_table_is_a_new_list():
    """The same list object is the same table (block_ids is never changed in place); a new
    object is written, even with the same contents (harmless: one re-upload)."""
    batch = DecodeBatch(max_seqs_per_step=2, width=8, block_size=BLOCK_SIZE)
    a, b = decoding(10, [1, 2]), decoding(11, [3])
    first = batch.build([a, b])
    row_a, row_b = first.rows.tolist()
    assert PADDING_ROW not in (row_a, row_b) and row_a != row_b
    assert sorted(written_entries(first.table_changes)) == sorted([(row_a, 0, 1), (row_a, 1, 2), (row_b, 0, 3)])
    again = batch.build([b, a])  # another order, the same tables
    assert again.rows.tolist() == [row_b, row_a] and again.table_changes is None
    a.block_ids = a.block_ids + [4]  # a new block: a new list, and only the new entry is written
    assert written_entries(batch.build([a, b]).table_changes) == [(row_a, 2, 4)]
    assert batch.written(row_a) == [1, 2, 4] and batch.tables[row_a, :3].tolist() == [1, 2, 4]
    a.block_ids = [1, 9, 4]  # the prefix cache swapped block 2 for its twin 9: the whole row
    assert written_entries(batch.build([a]).table_changes) == [(row_a, 0, 1), (row_a, 1, 9), (row_a, 2, 4)]
    a.block_ids = [5]  # recomputed after a preemption: a new, shorter table
    assert written_entries(batch.build([a]).table_changes) == [(row_a, 0, 5)]
    b.block_ids = list(b.block_ids)  # equal contents, another object
    assert written_entries(batch.build([b]).table_changes) == [(row_b, 0, 3)]


def test_rows_of_sequences_not_in_the_step_are_taken_back_when_none_is_free():
    batch = DecodeBatch(max_seqs_per_step=2, width=4, block_size=BLOCK_SIZE)
    assert batch.num_rows == 5
    seqs = {seq_id: decoding(seq_id, [seq_id]) for seq_id in range(1, 6)}
    held = batch.build([seqs[1], seqs[2]]).rows.tolist()
    batch.build([seqs[3], seqs[4]])  # every row but the padding row is taken now
    later = batch.build([seqs[2], seqs[5]])
    assert later.rows[0] == held[1] and written_entries(later.table_changes) == [(later.rows[1], 0, 5)]
    assert PADDING_ROW not in later.rows.tolist()
    assert seqs[1].decode_row == -1 and seqs[3].decode_row == -1 and seqs[4].decode_row == -1
    again = batch.build([seqs[1]])  # back after losing its row: a new one, its table written whole
    assert written_entries(again.table_changes) == [(again.rows[0], 0, 1)]


def test_a_table_wider_than_the_batch_or_a_step_larger_than_it_is_refused():
    batch = DecodeBatch(max_seqs_per_step=2, width=2, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="a block table of 3 blocks is wider than the batch's 2"):
        batch.build([decoding(1, [1, 2, 3])])
    with pytest.raises(ValueError, match="3 decodes in a step of a batch of at most 2"):
        batch.build([decoding(seq_id, [seq_id]) for seq_id in range(3)])


def reference_inputs(seqs: list[Sequence]) -> dict[str, list[int]]:
    """The decode inputs by their definition, one sequence at a time."""
    inputs = {name: [] for name in ("input_ids", "positions", "slot_mapping", "context_lens", "placeholder_rows",
                                    "placeholder_source_rows")}
    for row, seq in enumerate(seqs):
        position = seq.num_computed_tokens
        is_placeholder = seq.placeholder_row >= 0 and position == len(seq.token_ids) - 1
        inputs["input_ids"].append(0 if is_placeholder else seq.token_ids[position])
        if is_placeholder:
            inputs["placeholder_rows"].append(row)
            inputs["placeholder_source_rows"].append(seq.placeholder_row)
        inputs["positions"].append(position)
        inputs["slot_mapping"].append(seq.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
        inputs["context_lens"].append(position + 1)
    return inputs


class RandomDecodes:
    """Sequences decoding over many steps: tokens appended (known or placeholders), blocks
    appended and swapped, preemptions (shorter tables), one-token prefill chunks, sequences
    leaving and arriving, and steps that take a random subset in a random order."""

    def __init__(self, seed: int, width: int):
        self.random = random.Random(seed)
        self.width = width
        self.next_seq_id = 0
        self.next_block = 1
        self.running = [self.new_seq() for _ in range(6)]

    def new_seq(self) -> Sequence:
        self.next_seq_id += 1
        num_tokens = self.random.randrange(2, 4 * BLOCK_SIZE)
        blocks = [self.block() for _ in range(-(-num_tokens // BLOCK_SIZE))]
        return decoding(self.next_seq_id, blocks, num_tokens)

    def block(self) -> int:
        self.next_block += 1
        return self.next_block

    def step(self) -> list[Sequence]:
        rand = self.random
        if rand.random() < 0.2:
            self.running.remove(rand.choice(self.running))
        if (rand.random() < 0.25 or len(self.running) < 2) and len(self.running) < 8:  # a step holds 8 at most
            self.running.append(self.new_seq())
        for seq in self.running:
            self.advance(seq)
        return rand.sample(self.running, k=rand.randrange(1, len(self.running) + 1))

    def advance(self, seq: Sequence) -> None:
        rand = self.random
        if seq.placeholder_row >= 0:
            seq.token_ids[-1] = rand.randrange(1000)
        seq.placeholder_row = -1
        seq.num_computed_tokens = len(seq.token_ids)
        if len(seq.token_ids) >= (self.width - 1) * BLOCK_SIZE:  # a long one: preempted, recomputing its start
            seq.num_computed_tokens = rand.randrange(0, 2 * BLOCK_SIZE)  # a one-token chunk of a longer remainder
            seq.block_ids = [self.block() for _ in range(seq.num_computed_tokens // BLOCK_SIZE + 1)]
            return
        is_placeholder = rand.random() < 0.7
        seq.token_ids.append(PLACEHOLDER_TOKEN if is_placeholder else rand.randrange(1000))
        seq.placeholder_row = rand.randrange(8) if is_placeholder else -1
        seq.num_computed_tokens = len(seq.token_ids) - 1
        if seq.num_computed_tokens >= len(seq.block_ids) * BLOCK_SIZE:
            seq.block_ids = seq.block_ids + [self.block()]
        elif rand.random() < 0.05:
            seq.block_ids = [self.block()] + seq.block_ids[1:]  # swapped for a cached twin


def test_array_built_inputs_equal_the_per_sequence_definition_over_many_steps():
    width = 12
    batch = DecodeBatch(max_seqs_per_step=8, width=width, block_size=BLOCK_SIZE)
    device_rows = torch.zeros(batch.num_rows, width, dtype=torch.long)  # what the decode graphs keep
    decodes = RandomDecodes(seed=7, width=width)
    for _ in range(300):
        seqs = decodes.step()
        built = batch.build(seqs)
        expected = reference_inputs(seqs)
        for name, values in expected.items():
            assert getattr(built, name).tolist() == values, name
        if built.table_changes is not None:
            row, column, block = torch.from_numpy(built.table_changes.astype(np.int64))
            device_rows[row, column] = block
        for seq, row in zip(seqs, built.rows.tolist()):
            assert seq.decode_row == row
            assert device_rows[row, : len(seq.block_ids)].tolist() == seq.block_ids
        assert len(set(built.rows.tolist())) == len(seqs) and PADDING_ROW not in built.rows.tolist()
        assert device_rows[PADDING_ROW].count_nonzero() == 0


def test_decode_graphs_stage_each_step_of_the_batch_and_gather_each_sequences_table():
    width = 12
    graphs = DecodeGraphs(None, (4, 8), max_blocks_per_seq=width, metadata_for=None, device=CPU, pool=None)
    batch = DecodeBatch(max_seqs_per_step=8, width=width, block_size=BLOCK_SIZE)
    decodes = RandomDecodes(seed=3, width=width)
    for step_index in range(120):
        seqs = decodes.step()
        scheduled = ScheduledBatch(list(seqs), [1] * len(seqs))
        step = build_step_inputs(scheduled, batch)
        size = 4 if len(seqs) <= 4 else 8
        if step_index % 5 == 4:  # a step without a graph reads the same rows
            tables = graphs.device_block_tables(step)
            for row, seq in enumerate(seqs):
                assert tables[row, : len(seq.block_ids)].tolist() == seq.block_ids
            continue
        assert graphs.can_run(step)
        graphs._stage(step, size)
        padded = pad_decode_step(step, size)  # the padding values, as lists: the oracle
        assert graphs.input_ids[:size].tolist() == padded.input_ids
        assert graphs.positions[:size].tolist() == padded.positions
        assert graphs.slot_mapping[:size].tolist() == padded.slot_mapping
        assert graphs.context_lens[:size].tolist() == padded.context_lens
        torch.index_select(graphs.row_tables, 0, graphs.table_rows[:size], out=graphs.block_tables[:size])
        for row, seq in enumerate(seqs):
            assert graphs.block_tables[row, : len(seq.block_ids)].tolist() == seq.block_ids
        assert graphs.block_tables[len(seqs) : size].count_nonzero() == 0


def test_a_step_built_by_hand_without_rows_runs_without_the_decode_graphs():
    from llmserve.inference.models.step_inputs import StepInputs

    graphs = DecodeGraphs(None, (4,), max_blocks_per_seq=6, metadata_for=None, device=CPU, pool=None)
    step = StepInputs(input_ids=[3], positions=[5], slot_mapping=[9], decode_block_tables=[[2, 1]],
                      decode_context_lens=[6], decode_seq_ids=[0], logits_indices=[0])
    assert not graphs.can_run(step)


def test_lists_and_arrays_sent_in_one_copy_keep_their_values_and_start_16_byte_aligned():
    values = [[1, 2, 3], np.array([4, 5, 6, 7, 8]), [], np.arange(1, dtype=np.int32) + 9]
    tensors = device_int32(values, CPU)
    assert [t.tolist() for t in tensors] == [list(map(int, v)) for v in values]
    assert all(t.dtype == torch.int32 and (t.storage_offset() * 4) % 16 == 0 for t in tensors)


# --- the engine on the decode graphs' path ----------------------------------------------------


def collect(results: dict[str, Result], outputs) -> None:
    for output in outputs:
        results.setdefault(output.request_id, Result()).add(output)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_aborts_and_deadlines_mid_batch_leave_the_other_streams_tokens_unchanged(tiny_model_dirs):
    """Six streams decode on the decode graphs' path (triton backend; uncaptured on CPU) with
    async scheduling (placeholder inputs), driven by the engine loop: one is aborted and one
    passes its deadline mid-batch, a new one joins; every other stream gets the tokens and
    logprobs it gets alone on the portable backend (no decode graphs), and the pool empties."""
    model_dir = tiny_model_dirs["llama"]
    prompts = {f"s{i}": make_prompt(5 + 3 * i, seed=20 + i) for i in range(6)} | {"late": make_prompt(9, seed=40)}
    portable = make_engine(model_dir, attention_backend="portable")  # no decode graphs: the oracle
    alone = {}
    for request_id, prompt in prompts.items():
        portable.add_request(request(request_id, prompt, greedy(12)))
        alone |= drain(portable)
    engine = make_engine(model_dir, device=KERNEL_DEVICE, attention_backend="triton", async_scheduling=True)

    loop = EngineLoop(engine)
    results: dict[str, Result] = {}
    deadline_ns = time.monotonic_ns() + 3_000_000_000
    collect(results, loop.iterate([
        AddRequest(request(request_id, prompt, greedy(12), deadline_ns=deadline_ns if request_id == "s4" else 0))
        for request_id, prompt in prompts.items() if request_id != "late"
    ]).outputs)
    for _ in range(3):
        collect(results, loop.iterate([]).outputs)
    collect(results, loop.iterate([AbortRequest("s1"), AddRequest(request("late", prompts["late"], greedy(12)))]).outputs)
    time.sleep(max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9))  # s4's deadline passes mid-batch
    for _ in range(200):
        if not loop.has_work:
            break
        collect(results, loop.iterate([]).outputs)

    assert results["s1"].finals[0].finish_reason is FinishReason.CANCELLED
    assert results["s4"].finals[0].finish_reason is FinishReason.DEADLINE
    assert len(results["s4"].token_ids.get(0, [])) < 12
    for request_id in ("s0", "s2", "s3", "s5", "late"):
        assert results[request_id].token_ids == alone[request_id].token_ids, request_id
        assert results[request_id].logprobs[0] == pytest.approx(alone[request_id].logprobs[0], abs=1e-4), request_id
    assert engine.runner.decode_graphs.num_steps > 0
    load = engine.load()
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
