"""Rank 0's step message to the other tensor-parallel ranks: the shared-memory ring
(models/rank_ring.py) against gloo's broadcast_object (what it replaced), in one run (issue 23).

    python bench/bench_step_broadcast.py                      # 2 and 4 ranks, CPU processes
    python bench/bench_step_broadcast.py --spin-s 0.002       # readers poll as on a GPU host

Each size starts that many real processes joined as RankGroup does (gloo), and sends the same
StepMessages three ways: gloo, the ring, and the ring through StepBroadcast, which sends a decode
table only when its list changed (each step here replaces 1 table in 16, as a block appended
every 16 tokens does). The messages: a decode step of --decode-rows sequences (contexts of
--context tokens: their block tables ride along) and a prefill chunk of --prefill-tokens
tokens. Two timings:

  paced         one message every --interval-ms (steps, with the readers idle between them,
                as ranks waiting for rank 0's next step are): rank 0's send µs, and delivery µs
                (send start to each reader holding the object, on the host's monotonic clock)
  back-to-back  --messages sent as fast as they go: messages per second

Prints a table with each ring figure's ratio to gloo's at the same size and message, and
writes JSON to --out-dir. The message is engine/step_broadcast.py's, pickled as it is there;
each reader checks every paced message equals the one sent (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import torch

from results_file import write_results

from llmserve.inference.engine.step_broadcast import StepBroadcast, StepMessage
from llmserve.inference.models.rank_group import RankGroup, exit_without_teardown
from llmserve.inference.models.step_inputs import StepInputs

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
TIMEOUT_S = 600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,4", metavar="N,N,...", help="ranks (default: %(default)s)")
    parser.add_argument("--decode-rows", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--context", type=int, default=1024, help="decode contexts, tokens (default: %(default)s)")
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="(default: %(default)s)")
    parser.add_argument("--messages", type=int, default=200, help="per timing and message (default: %(default)s)")
    parser.add_argument("--interval-ms", type=float, default=2.0, help="paced: between sends (default: %(default)s)")
    parser.add_argument("--spin-s", type=float, default=0.0, help="how long ring readers poll before they sleep "
                        "(default: %(default)s, the CPU setting; 0.002 on CUDA)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results", metavar="DIR")
    args = parser.parse_args(argv)
    args.sizes = [int(size) for size in args.sizes.split(",")]
    return args


def decode_step(rows: int, context: int) -> StepMessage:
    blocks = -(-context // BLOCK_SIZE)
    step = StepInputs(
        input_ids=[(7 * r) % 50000 for r in range(rows)], positions=[context + r for r in range(rows)],
        slot_mapping=[r * blocks * BLOCK_SIZE + context for r in range(rows)],
        decode_block_tables=[list(range(r * blocks, (r + 1) * blocks)) for r in range(rows)],
        decode_context_lens=[context + 1] * rows, decode_seq_ids=list(range(rows)), logits_indices=list(range(rows)),
    )  # fmt: skip
    return StepMessage([], step)


def prefill_step(tokens: int) -> StepMessage:
    step = StepInputs(
        input_ids=[(13 * t) % 50000 for t in range(tokens)], positions=list(range(tokens)),
        slot_mapping=list(range(tokens)), prefill_query_starts=[0], prefill_query_lens=[tokens],
        prefill_context_lens=[tokens], prefill_block_tables=[list(range(-(-tokens // BLOCK_SIZE)))],
        prefill_has_cached_prefix=[False], logits_indices=[tokens - 1],
    )  # fmt: skip
    return StepMessage([], step)


TRANSPORTS = ("gloo", "ring", "ring, tables as changes")


def churned(message: StepMessage, index: int) -> StepMessage:
    """The message as the `index`-th step sends it: 1 decode table in BLOCK_SIZE a new list (a
    block appended, as a sequence's table changes once every block_size tokens), the rest the
    very lists of the step before."""
    tables = [
        list(table) if (row + index) % BLOCK_SIZE == 0 else table
        for row, table in enumerate(message.inputs.decode_block_tables)
    ]  # fmt: skip
    return StepMessage(message.block_copies, dataclasses.replace(message.inputs, decode_block_tables=tables))


def wire_message(message: StepMessage, transport: str) -> StepMessage:
    """What `transport` pickles for a step past the first (as churned: 1 table in BLOCK_SIZE new)."""
    if transport != TRANSPORTS[2]:
        return message
    tables = [table if row % BLOCK_SIZE == 0 else None for row, table in enumerate(message.inputs.decode_block_tables)]
    return StepMessage(message.block_copies, dataclasses.replace(message.inputs, decode_block_tables=tables))


def _send(group: RankGroup, steps: StepBroadcast, transport: str, message) -> None:
    if transport == "gloo":
        group.broadcast_object(message)
    elif transport == "ring":
        group.send_to_ranks(message)
    else:
        steps.send(message.block_copies, message.inputs, None)


def _receive(group: RankGroup, steps: StepBroadcast, transport: str):
    if transport == "gloo":
        return group.broadcast_object()
    if transport == "ring":
        return group.receive_from_leader()
    received = steps.receive()
    return StepMessage(received.block_copies, received.inputs)


def _rank_main(store_path: str, size: int, rank: int, messages: dict, args: argparse.Namespace, results) -> None:
    group = RankGroup.join(store_path, size, rank, torch.device("cpu"), ring_spin_s=args.spin_s)
    try:
        measured = {}
        for transport in TRANSPORTS:
            for name, message in messages.items():
                steps = StepBroadcast(group, torch.device("cpu"))
                group.barrier()
                times, intact = [], True
                for index in range(args.messages):  # paced
                    sent = churned(message, index)
                    if group.is_leader:
                        start = time.monotonic()
                        _send(group, steps, transport, sent)
                        times.append((start, time.monotonic()))
                        time.sleep(args.interval_ms / 1000)
                    else:
                        received = _receive(group, steps, transport)
                        times.append(time.monotonic())
                        intact = intact and received == sent
                group.barrier()
                sends = [churned(message, index) for index in range(args.messages)]
                start = time.monotonic()
                for sent in sends:  # back to back
                    _send(group, steps, transport, sent) if group.is_leader else _receive(group, steps, transport)
                group.barrier()  # the last reader has the last message
                measured[(transport, name)] = (times, time.monotonic() - start, intact)
        results.put((rank, measured))
    finally:
        group.leave()
        results.close()
        results.join_thread()
        exit_without_teardown()


def run_size(size: int, messages: dict, args: argparse.Namespace) -> dict:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="bench-step-broadcast-") as directory:
        store_path = str(Path(directory) / "rendezvous")
        ranks = [context.Process(target=_rank_main, args=(store_path, size, r, messages, args, results))
                 for r in range(size)]  # fmt: skip
        for process in ranks:
            process.start()
        gathered = dict(results.get(timeout=TIMEOUT_S) for _ in ranks)
        for process in ranks:
            process.join(TIMEOUT_S)
    return gathered


def summarize(size: int, gathered: dict, messages: dict, args: argparse.Namespace) -> list[dict]:
    rows = []
    for (transport, name), (sends, wall_s, _) in gathered[0].items():
        send_us = [(end - start) * 1e6 for start, end in sends]
        delivery_us = [
            (gathered[reader][(transport, name)][0][i] - sends[i][0]) * 1e6
            for reader in range(1, size) for i in range(len(sends))
        ]  # fmt: skip
        rows.append({
            "ranks": size, "message": name, "transport": transport,
            "bytes": len(pickle.dumps(wire_message(messages[name], transport), protocol=pickle.HIGHEST_PROTOCOL)),
            "send_us_p50": statistics.median(send_us), "delivery_us_p50": statistics.median(delivery_us),
            "delivery_us_p90": statistics.quantiles(delivery_us, n=10)[-1],
            "back_to_back_per_s": args.messages / wall_s,
            "intact": all(gathered[reader][(transport, name)][2] for reader in range(1, size)),
        })  # fmt: skip
    by_key = {(r["message"], r["transport"]): r for r in rows}
    for row in rows:
        gloo = by_key[(row["message"], "gloo")]
        for key in ("send_us_p50", "delivery_us_p50", "back_to_back_per_s"):
            row[f"{key}_vs_gloo"] = row[key] / gloo[key]
    return rows


def print_table(rows: list[dict]) -> None:
    print("| ranks | message | bytes | transport | send µs p50 | delivery µs p50 / p90 | back-to-back msg/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = lambda key: "" if r["transport"] == "gloo" else f" ({r[key + '_vs_gloo']:.2f}x)"  # noqa: E731
        print(
            f"| {r['ranks']} | {r['message']} | {r['bytes']:,} | {r['transport']} | {r['send_us_p50']:.0f}{ratio('send_us_p50')} "
            f"| {r['delivery_us_p50']:.0f}{ratio('delivery_us_p50')} / {r['delivery_us_p90']:.0f} "
            f"| {r['back_to_back_per_s']:,.0f}{ratio('back_to_back_per_s')} |"
        )


def main() -> None:
    args = parse_args()
    messages = {
        f"decode {args.decode_rows} rows": decode_step(args.decode_rows, args.context),
        f"prefill {args.prefill_tokens} tokens": prefill_step(args.prefill_tokens),
    }
    rows = []
    for size in args.sizes:
        rows += summarize(size, run_size(size, messages, args), messages, args)
    print_table(rows)
    if not all(row["intact"] for row in rows):
        raise SystemExit("a rank received a message other than the one sent")
    write_results(args, "step-broadcast", {"rows": rows})


if __name__ == "__main__":
    main()
