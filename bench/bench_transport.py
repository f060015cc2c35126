"""The tensor transport (llmserve.tensor_transport, issue 22) against inline gRPC bytes: one
tensor at a time from a producer process to a consumer process, for 4 KiB (the per-transfer
overhead) and 1, 16 and 128 MiB.

    python bench/bench_transport.py                        # CPU: shm, shm-staged, grpc
    python bench/bench_transport.py --device cuda          # GPU: cuda-ipc, grpc (the H200)
    python bench/bench_transport.py --sizes 16MiB --repeats 50

One transfer, timed by the producer from the moment it sends until the consumer says it is done:
  shm         the tensor already lies in the producer's shared-memory region (as a KV pool
              would): a TensorRef crosses a pipe, the consumer copies the tensor out of its
              mapping into memory of its own, and answers;
  shm-staged  the same, after the producer first copies the tensor from its own memory into the
              region (a tensor made elsewhere, e.g. token ids): two copies in all;
  cuda-ipc    the tensor lies in the producer's GPU region: a TensorRef crosses the pipe, the
              consumer's stream waits on the region's event and copies device to device into its
              own GPU tensor, synchronizes, and answers;
  grpc        the bytes inline: the producer serializes the tensor (on CUDA: to the host first),
              a unary call to a grpc.aio server in the consumer process carries them on loopback,
              and the consumer copies them into its own tensor (on CUDA: up to the GPU, then
              synchronizes) before answering.
Every path ends with the data in the consumer's own preallocated memory, so they compare like for
like. The regions are mapped once before timing (the transport's design: at connection time).
Warm-up transfers are not counted; then --repeats timed transfers per size and path: min, median
and max. GB/s = bytes / median time (10^9 bytes). Prints a table and writes JSON to --results-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import numpy as np
import torch

from llmserve.tensor_transport import TensorConsumer, TensorProducer, TransportPath, local_identity
from llmserve.tensor_transport.views import to_bytes

REPO_ROOT = Path(__file__).resolve().parent.parent
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
DEFAULT_SIZES = "4KiB,1MiB,16MiB,128MiB"
CPU_PATHS = ("shm", "shm-staged", "grpc")
CUDA_PATHS = ("cuda-ipc", "grpc")
GRPC_METHOD = "/bench.Transport/Send"
GRPC_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
WARMUP = 3
TARGET_SHM_GBPS = 5.0
TARGET_CUDA_RATIO = 0.1
TARGET_OVERHEAD_US = 50.0


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def size_label(num_bytes: int) -> str:
    for unit, factor in reversed(UNITS.items()):
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor} {unit}"
    return f"{num_bytes} B"


def default_repeats(num_bytes: int) -> int:
    """More of the short transfers, whose times vary more; a few seconds per cell on a CPU."""
    return 200 if num_bytes <= 1 << 20 else 30 if num_bytes <= 16 << 20 else 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N (both processes on that GPU)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"payloads, comma-separated (default {DEFAULT_SIZES})")
    parser.add_argument("--paths", default="", help=f"default: {','.join(CPU_PATHS)} on cpu, {','.join(CUDA_PATHS)} on cuda")
    parser.add_argument("--repeats", type=int, default=0, help="timed transfers per cell (default: by size, 200/30/10)")
    parser.add_argument(
        "--torch-threads", type=int, default=0,
        help="torch threads in each process (default 0: torch's own, one per core; on a small host two "
        "processes' OpenMP workers spin on each other's cores: 1 avoids that, at one core per copy)",
    )
    parser.add_argument("--results-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args()
    args.sizes = [parse_size(size) for size in args.sizes.split(",")]
    is_cuda = torch.device(args.device).type == "cuda"
    args.paths = args.paths.split(",") if args.paths else list(CUDA_PATHS if is_cuda else CPU_PATHS)
    return args


# --- the consumer processes ------------------------------------------------------------------


def ref_consumer_main(conn: Connection, device: str, max_bytes: int, torch_threads: int) -> None:
    """Answers TensorRefs sent over `conn`: copies each into its own memory, then says so. A
    plain blocking loop: nothing else runs in this process. An empty message is a ping."""
    if torch_threads:
        torch.set_num_threads(torch_threads)
    out = torch.empty(max_bytes, dtype=torch.uint8, device=device)
    consumer = TensorConsumer()
    conn.send(local_identity(device))
    consumer.open(conn.recv())  # the offer: mapped once, before any transfer
    conn.send(b"")
    while (ref := conn.recv()) is not None:
        if isinstance(ref, bytes):  # a ping
            conn.send(b"")
            continue
        start = time.perf_counter()
        consumer.copy_into(ref, out[: ref.num_bytes].view(ref.torch_dtype).view(ref.shape))
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        conn.send(time.perf_counter() - start)  # the transport's own work, without the pipe


def grpc_consumer_main(conn: Connection, device: str, max_bytes: int, torch_threads: int) -> None:
    """A grpc.aio server on loopback whose one method copies the bytes it gets into its own
    memory (on CUDA: through the host, up to the GPU) before answering."""
    if torch_threads:
        torch.set_num_threads(torch_threads)
    out = torch.empty(max_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(max_bytes, dtype=torch.uint8) if out.is_cuda else out

    async def send(request: bytes, context) -> bytes:
        num_bytes = len(request)
        host[:num_bytes].numpy()[:] = np.frombuffer(request, dtype=np.uint8)
        if out.is_cuda:
            out[:num_bytes].copy_(host[:num_bytes])
            torch.cuda.synchronize(out.device)
        return b""

    async def serve() -> None:
        handler = grpc.method_handlers_generic_handler(
            "bench.Transport", {"Send": grpc.unary_unary_rpc_method_handler(send)}  # raw bytes: no proto
        )
        server = grpc.aio.server(options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        await server.stop(None)

    asyncio.run(serve())


def start_consumer(target, device: str, max_bytes: int, torch_threads: int) -> tuple[mp.Process, Connection]:
    context = mp.get_context("spawn")  # grpc and CUDA must not be forked
    ours, theirs = context.Pipe()
    process = context.Process(target=target, args=(theirs, device, max_bytes, torch_threads), daemon=True)
    process.start()
    theirs.close()
    return process, ours


# --- the producer (this process) -------------------------------------------------------------


def timed(transfer, repeats: int) -> list[float]:
    for _ in range(WARMUP):
        transfer()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        transfer()
        times.append(time.perf_counter() - start)
    return times


def measure_refs(path: str, args: argparse.Namespace) -> tuple[dict[int, list[float]], dict[int, list[float]], list[float]]:
    """shm, shm-staged, cuda-ipc: one region of the largest size, offered to one consumer. Also
    the consumer's own time per transfer (view, event wait, copy, synchronize: the transport's
    work without the pipe that carries the ref, which in the service is a message already sent)
    and the control pipe's round trip alone (a ping: no tensor), the floor under every transfer."""
    device, sizes = args.device, args.sizes
    max_bytes = max(sizes)
    process, conn = start_consumer(ref_consumer_main, device, max_bytes, args.torch_threads)
    producer = TensorProducer(local_identity(device))
    try:
        region = producer.allocate(max_bytes)
        offer = producer.offer(region, conn.recv())
        expected = TransportPath.CUDA_IPC if path == "cuda-ipc" else TransportPath.SHM
        if offer.path is not expected:
            raise RuntimeError(f"negotiation gave {offer.path.value}, not {expected.value}: is /dev/shm or the GPU shared?")
        conn.send(offer)
        conn.recv()
        source = torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, device=device)
        region.data.copy_(source)
        producer.mark_written(region)
        results, consumer_times = {}, {}
        for num_bytes in sizes:
            ref = region.ref(0, (num_bytes,), torch.uint8)
            consumer_times[num_bytes] = answers = []

            def transfer() -> None:
                if path == "shm-staged":
                    region.data[:num_bytes].copy_(source[:num_bytes])
                conn.send(producer.message_for(offer, ref))
                answers.append(conn.recv())

            results[num_bytes] = timed(transfer, args.repeats or default_repeats(num_bytes))
            del answers[:WARMUP]
        pings = timed(lambda: (conn.send(b""), conn.recv()), args.repeats or default_repeats(0))
        conn.send(None)
        process.join(30)
        return results, consumer_times, pings
    finally:
        producer.close()
        if process.is_alive():
            process.kill()


def measure_grpc(args: argparse.Namespace) -> dict[int, list[float]]:
    device, sizes, repeats = args.device, args.sizes, args.repeats
    max_bytes = max(sizes)
    process, conn = start_consumer(grpc_consumer_main, device, max_bytes, args.torch_threads)
    port = conn.recv()
    source = torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, device=device)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
            call = channel.unary_unary(GRPC_METHOD)  # bytes in and out: no serializer
            results = {}
            for num_bytes in sizes:
                piece = source[:num_bytes]
                results[num_bytes] = timed(lambda: call(to_bytes(piece)), repeats or default_repeats(num_bytes))
        conn.send(None)
        process.join(30)
        return results
    finally:
        if process.is_alive():
            process.kill()


# --- report ----------------------------------------------------------------------------------


def summarize(times: list[float], num_bytes: int) -> dict:
    """num_bytes 0: a ping, GB/s 0."""
    median = statistics.median(times)
    return {
        "repeats": len(times),
        "min_ms": min(times) * 1e3,
        "median_ms": median * 1e3,
        "max_ms": max(times) * 1e3,
        "gbps": num_bytes / median / 1e9 if num_bytes else 0.0,
    }


def print_table(cells: dict[str, dict[int, dict]], sizes: list[int]) -> None:
    print(f"{'size':>8}  {'path':<11} {'min ms':>9} {'median ms':>10} {'max ms':>9} {'GB/s':>8} {'x grpc':>7}")
    for num_bytes in sizes:
        grpc_median = cells.get("grpc", {}).get(num_bytes, {}).get("median_ms")
        for path, by_size in cells.items():
            cell = by_size[num_bytes]
            ratio = f"{cell['median_ms'] / grpc_median:.3f}" if grpc_median else "-"
            print(
                f"{size_label(num_bytes):>8}  {path:<11} {cell['min_ms']:>9.3f} {cell['median_ms']:>10.3f} "
                f"{cell['max_ms']:>9.3f} {cell['gbps']:>8.2f} {ratio:>7}"
            )


def targets(cells: dict[str, dict[int, dict]], sizes: list[int]) -> list[str]:
    """Issue 22's transport targets, for the sizes and paths this run measured."""
    lines = []
    for num_bytes in sizes:
        if num_bytes >= 16 << 20 and "shm" in cells:
            gbps = cells["shm"][num_bytes]["gbps"]
            lines.append(f"shm at {size_label(num_bytes)}: {gbps:.2f} GB/s (target >= {TARGET_SHM_GBPS})")
        if num_bytes >= 1 << 20 and "cuda-ipc" in cells and "grpc" in cells:
            ratio = cells["cuda-ipc"][num_bytes]["median_ms"] / cells["grpc"][num_bytes]["median_ms"]
            lines.append(f"cuda-ipc at {size_label(num_bytes)}: {ratio:.4f}x gRPC's time (target <= {TARGET_CUDA_RATIO})")
    for path in ("cuda-ipc", "shm"):
        if path in cells and min(sizes) <= 4 << 10:
            overhead_us = cells[path][min(sizes)]["median_ms"] * 1e3
            lines.append(
                f"{path} per-transfer overhead ({size_label(min(sizes))}, mapping open): {overhead_us:.1f} µs"
                f" (target for cuda-ipc <= {TARGET_OVERHEAD_US:g})"
            )
    return lines


def consumer_lines(consumer_cells: dict[str, dict[int, dict]], sizes: list[int]) -> list[str]:
    """The consumer's own time at the smallest size: the transfer's overhead without the pipe."""
    smallest = min(sizes)
    return [
        f"{path} consumer's own time ({size_label(smallest)}: view, event wait, copy, synchronize):"
        f" median {by_size[smallest]['median_ms'] * 1e3:.1f} µs, min {by_size[smallest]['min_ms'] * 1e3:.1f} µs"
        for path, by_size in consumer_cells.items()
    ]


def environment(device: str) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "command": " ".join([sys.executable, *sys.argv]),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def main() -> None:
    args = parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    raw: dict[str, dict[int, list[float]]] = {}
    consumer_raw: dict[str, dict[int, list[float]]] = {}
    pings: list[float] = []
    for path in args.paths:
        print(f"measuring {path} ...", flush=True)
        if path == "grpc":
            raw[path] = measure_grpc(args)
        else:
            raw[path], consumer_raw[path], path_pings = measure_refs(path, args)
            pings += path_pings
    cells = {path: {size: summarize(times, size) for size, times in by_size.items()} for path, by_size in raw.items()}
    consumer_cells = {
        path: {size: summarize(times, size) for size, times in by_size.items()} for path, by_size in consumer_raw.items()
    }
    print_table(cells, args.sizes)
    target_lines = targets(cells, args.sizes) + consumer_lines(consumer_cells, args.sizes)
    if pings:
        ping = summarize(pings, 0)
        target_lines.append(f"control pipe round trip alone (no tensor): median {ping['median_ms'] * 1e3:.1f} µs")
    print("\n".join(target_lines))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"transport-{torch.device(args.device).type}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    report = {
        "environment": environment(args.device),
        "device": args.device,
        "cells": {path: {str(size): cell for size, cell in by_size.items()} for path, by_size in cells.items()},
        "consumer_cells": {
            path: {str(size): cell for size, cell in by_size.items()} for path, by_size in consumer_cells.items()
        },
        "targets": target_lines,
        "torch_threads": args.torch_threads,
        "ping_ms": summarize(pings, 0) if pings else None,
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
