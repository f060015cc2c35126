"""A burst of new streams at a busy gRPC server: how long each waits before its handler runs,
with one accept loop (grpc's asyncio server as it comes) and with several on the port
(llmserve.server.create_server's num_accept_loops, the gateway's --accept-loops).

    python bench/bench_accept.py                                  # 1/4/8 loops x idle/2/5 ms slices
    python bench/bench_accept.py --accept-loops 1,2 --busy-ms 2 --burst 8 --connections 4 --rounds 1

Why: grpc's asyncio server keeps one request_call outstanding and accepts the next RPC only after
the last one has gone through its event loop (a few trips per RPC). A gateway worker's loop is
busy streaming tokens, so at 256 streams on the H200 the stack's first token came 0.3-1.1 s after
the core loop's. Here the server process (create_server, our interceptors, a unary-stream
handler that answers the monotonic time it started) keeps its loop busy with a task that
computes for --busy-ms and yields, the way streaming keeps the gateway's loop busy; a client
process opens --connections channels and starts --burst streams at once, round-robin over
them. A stream's accept delay is its handler's start less its send, on the host's monotonic
clock (one host: the same clock). Each (loops, slice) cell: --rounds bursts, the delays pooled;
p50 and max, each as a ratio to one loop at the same slice, measured in the same run.

Prints a table and writes --out-dir/accept-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import grpc

from results_file import write_results
from llmserve.server import create_server

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVICE, METHOD = "llmserve.bench.Accept", "Start"
MAX_RECEIVE_BYTES = 1 << 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accept-loops", default="1,4,8", help="loops per cell, comma-separated (default: %(default)s)")
    parser.add_argument("--busy-ms", default="0,2,5",
                        help="the server loop's busy slices in ms, comma-separated; 0 idle (default: %(default)s)")
    parser.add_argument("--burst", type=int, default=64, help="streams started at once (default: %(default)s)")
    parser.add_argument("--connections", type=int, default=16, help="client channels (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per cell (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results", metavar="DIR")
    return parser.parse_args(argv)


async def _answer_start(request: bytes, context):
    yield str(time.monotonic_ns()).encode()  # when this handler started


def _register(server: grpc.aio.Server) -> None:
    handler = grpc.unary_stream_rpc_method_handler(_answer_start)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),))


async def _serve(num_accept_loops: int, busy_ms: float, ports: mp.Queue) -> None:
    running = await create_server("127.0.0.1:0", _register, (SERVICE,), max_receive_bytes=MAX_RECEIVE_BYTES,
                                  num_accept_loops=num_accept_loops)
    await running.set_serving(True)

    async def keep_busy() -> None:  # slices of work between yields, as streaming keeps a loop busy
        while True:
            until = time.perf_counter() + busy_ms / 1000
            while time.perf_counter() < until:
                pass
            await asyncio.sleep(0)

    # The port goes out before the loop is busy: a Queue's put only hands the item to a feeder
    # thread, which a loop spinning beside grpc's threads can starve of the GIL for good (seen on
    # a 2-core machine: the port never arrived).
    ports.put(running.port)
    ports.close()
    ports.join_thread()
    busy = asyncio.ensure_future(keep_busy()) if busy_ms else None
    try:
        await asyncio.Event().wait()
    finally:
        if busy is not None:
            busy.cancel()


def _server_main(num_accept_loops: int, busy_ms: float, ports: mp.Queue) -> None:
    asyncio.run(_serve(num_accept_loops, busy_ms, ports))


async def _bursts(port: int, args: argparse.Namespace) -> list[float]:
    """Every stream's accept delay in ms, over --rounds bursts."""
    # One subchannel pool per channel: each is a connection of its own, as separate clients' are.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(args.connections)]
    try:
        await asyncio.gather(*(channel.channel_ready() for channel in channels))
        starts = [channel.unary_stream(f"/{SERVICE}/{METHOD}") for channel in channels]

        async def one(index: int) -> float:
            sent_ns = time.monotonic_ns()
            async for started in starts[index % len(starts)](b""):
                return (int(started) - sent_ns) / 1e6
            raise RuntimeError("the stream ended without its start time")

        delays: list[float] = []
        for _ in range(args.rounds):
            delays += await asyncio.gather(*(one(index) for index in range(args.burst)))
            await asyncio.sleep(0.2)
        return delays
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


def measure(num_accept_loops: int, busy_ms: float, args: argparse.Namespace) -> dict:
    context = mp.get_context("spawn")
    ports = context.Queue()
    server = context.Process(target=_server_main, args=(num_accept_loops, busy_ms, ports), daemon=True)
    server.start()
    try:
        delays = sorted(asyncio.run(_bursts(ports.get(timeout=60), args)))
    finally:
        server.kill()
        server.join()
    return {"accept_loops": num_accept_loops, "busy_ms": busy_ms, "num_streams": len(delays),
            "p50_ms": statistics.median(delays), "max_ms": delays[-1]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    loop_counts = [int(count) for count in args.accept_loops.split(",")]
    rows = []
    for busy_ms in (float(ms) for ms in args.busy_ms.split(",")):
        cells = [measure(count, busy_ms, args) for count in loop_counts]
        baseline = next((cell for cell in cells if cell["accept_loops"] == 1), cells[0])
        for cell in cells:
            cell["p50_vs_one_loop"] = cell["p50_ms"] / baseline["p50_ms"]
            cell["max_vs_one_loop"] = cell["max_ms"] / baseline["max_ms"]
            print(f"busy {busy_ms:g} ms, {cell['accept_loops']} loops: p50 {cell['p50_ms']:.1f} ms, "
                  f"max {cell['max_ms']:.1f} ms", flush=True)
        rows += cells
    print(f"\nA burst of {args.burst} streams over {args.connections} connections, {args.rounds} rounds per cell "
          "(accept delay: handler start - send)")
    print("| server loop busy slices | accept loops | p50 ms | max ms | p50 vs one loop | max vs one loop |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['busy_ms']:g} ms | {row['accept_loops']} | {row['p50_ms']:.1f} | {row['max_ms']:.1f} | "
              f"{row['p50_vs_one_loop']:.2f} | {row['max_vs_one_loop']:.2f} |")
    write_results(args, "accept", {"rows": rows})


if __name__ == "__main__":
    main()
