"""The KV pull's copy kernel alone (issue 22; kernels/block_copy.py) against the device's own copy
rate: where a pull's copy time goes once the servers are taken away. With --ipc also from a pool
of another process, mapped as the server maps it; with --idle-ms after the GPU idled, as between
a server's pulls.

    python bench/bench_block_copy.py                         # CUDA: 1.5B and 8B pool layouts
    python bench/bench_block_copy.py --ipc                   # and from another process's pool
    python bench/bench_block_copy.py --ipc --idle-ms 50      # every repeat after 50 ms idle
    python bench/bench_block_copy.py --sweep                 # and every tile x warps setting
    python bench/bench_block_copy.py --smoke [--ipc]         # that it runs (on CPU: Triton's interpreter)

Two pools laid out as the engine's KV cache ([2, layers, blocks, 16, kv heads, head dim],
bfloat16), --pool-blocks each, on one GPU: the "local" rows' source and this process's pool, the
target of every copy. With --ipc a third, the "ipc" rows' source: allocated in a child process
(spawned) through TensorProducer as a source replica allocates its pool (KvPoolExport), filled
there, offered to this process's identity and mapped here once through TensorConsumer as
KvBlockImporter maps it (CUDA IPC; on CPU a /dev/shm segment). For each shape and --blocks
count, source and target block ids drawn at random (a pull's ids: the source's and this
replica's free blocks are scattered; the same ids for both sources), then, median of --repeats:
  roofline    one contiguous `copy_` of the same number of bytes, CUDA events: the copy rate
  kernel      copy_blocks with its ids already on the device, CUDA events: the kernel alone
  import      what KvBlockImporter does per pull, timed on the host: the ids to the device (its
              own function), the kernel, and the synchronize the source's release waits for
  copy phase  ipc rows only: what the server times as a pull's copy (KvImport.copy_s), on the
              host: KvBlockImporter._copy and _copy_by_kernel step by step, so the view of the
              source's pool (the stream's wait on the region's interprocess event) included;
              and the kernel's time inside it by the events the server puts around it
              (KvImport.copy_device_s)
GB/s = bytes copied / time (10^9 bytes; read + write would be twice that). Ratios and
differences: kernel / roofline rate; fixed ms = import - kernel (the fixed part a whole pull
adds); phase - kernel = copy phase - kernel (medians: what the server's copy phase adds to the
kernel alone); phase - its kernel = the median over repeats of the copy phase less the kernel's
events inside it: the figure the server reports (copy_s - copy_device_s: ~0.45 ms in the server
where import - kernel is ~0.09 ms here; --ipc and --idle-ms tell the suspects apart: the source
in another process, the view's event wait, an idle GPU). Not reproduced: a busy source. The
child's event was recorded once, when it filled the pool, so the wait here never holds the
stream (a source that pins mid-step records it behind its step in flight), and no work of the
child's shares the GPU with the copies.
--idle-ms N: before every timed repeat of every column, the device synchronized and then N ms of
sleep, so each copy starts on an idle GPU as a server's pulls do (without: back to back).
Every copy is checked block by block once, and the ipc source's bytes against the child's
per-block sums. At the end the child closes its producer (region, offer, segments) and exits;
the references it still had out and any /dev/shm name of its own left behind are reported (and
apart, the file the CUDA driver leaves in /dev/shm for every process that exported memory).
Prints a table and writes --out-dir/block-copy-<time>.json.
Without CUDA (--smoke only) the kernel runs under Triton's interpreter, timed on the host: the
figures then say nothing.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: the kernel runs interpreted on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from results_file import write_results

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
# num_layers, num_kv_heads, head_dim of the configs bench_stack.py builds
SHAPES = {"qwen2.5-1.5b": (28, 2, 128), "llama-3.1-8b": (32, 8, 128), "tiny": (2, 1, 16)}
SWEEP_TILES = (1024, 2048, 4096, 8192, 16384)
SWEEP_WARPS = (4, 8, 16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The child's start: a spawned interpreter importing torch and initializing CUDA, then the fill.
CHILD_START_TIMEOUT_S = 300
CHILD_EXIT_TIMEOUT_S = 60
# The child's reaper unlinks what the child left in /dev/shm once the child is gone: a moment later.
REAPER_GRACE_S = 2.0


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2.5-1.5b,llama-3.1-8b", help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--blocks", default="128,504,1536",
                        help="blocks per copy, comma-separated (16 tokens each: 2k, 8k, 24k tokens)")
    parser.add_argument("--pool-blocks", type=int, default=2048, help="blocks in each of the pools")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time the kernel at every tile x warps")
    parser.add_argument("--ipc", action="store_true",
                        help="also copy from a pool a child process allocates and offers (TensorProducer), as a source replica")
    parser.add_argument("--idle-ms", type=float, default=0.0,
                        help="before every timed repeat, synchronize and sleep this long: the GPU idles as between pulls")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape, small pools, few repeats")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.blocks, args.pool_blocks, args.repeats = "tiny", "4,8", 16, 2
    if args.idle_ms < 0:
        parser.error("--idle-ms cannot be negative")
    return args


def pause(idle_s: float) -> None:
    """Let the device idle `idle_s` (--idle-ms): a server's pulls find it idle, its clocks down."""
    if idle_s > 0:
        synchronize()
        time.sleep(idle_s)


def timed_on_device(work, repeats: int, idle_s: float = 0.0) -> list[float]:
    """Seconds of `work` on the current stream, by CUDA events, once per repeat (one warm-up)."""
    if DEVICE == "cpu":
        return timed_on_host(work, repeats, idle_s)
    work()
    times = []
    for _ in range(repeats):
        pause(idle_s)
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        work()
        ended.record()
        ended.synchronize()
        times.append(began.elapsed_time(ended) / 1000)
    return times


def timed_on_host(work, repeats: int, idle_s: float = 0.0, returned: list | None = None) -> list[float]:
    """Seconds of `work` by the host's clock, the device synchronized before each (one warm-up);
    `returned`, when given, collects what `work` returned in each timed repeat."""
    work()
    times = []
    for _ in range(repeats):
        synchronize()
        pause(idle_s)
        started = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - started)
        if returned is not None:
            returned.append(result)
    return times


def significant(value: float) -> float:
    """Three significant digits: a rate on a slow host must not round to 0."""
    return float(f"{value:.3g}")


def pool_dims(shape: str, pool_blocks: int) -> tuple[int, ...]:
    num_layers, num_kv_heads, head_dim = SHAPES[shape]
    return (2, num_layers, pool_blocks, BLOCK_SIZE, num_kv_heads, head_dim)


def pools(shape: str, pool_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    source = torch.randn(pool_dims(shape, pool_blocks), device=DEVICE, dtype=torch.bfloat16)
    return source, torch.zeros_like(source)


def block_sums(pool: torch.Tensor) -> torch.Tensor:
    """One float32 sum per block, on the CPU: what tells the child's fill from anything else."""
    return pool.sum(dim=(0, 1, 3, 4, 5), dtype=torch.float32).cpu()


def check_copied(source: torch.Tensor, target: torch.Tensor, source_ids: list[int], target_ids: list[int]) -> None:
    if not torch.equal(source[:, :, source_ids], target[:, :, target_ids]):
        raise SystemExit("the kernel's copy differs from its source")


# --- the ipc source: another process's pool, as a source replica's -------------------------------


def serve_source_pool(connection, dims: tuple[int, ...], device: str, consumer_identity) -> None:
    """The child process: a pool of `dims` in a TensorProducer's region as KvPoolExport allocates
    a replica's, filled with random values, marked written (the consumer's reads wait for the
    fill), offered to `consumer_identity`. Sends (offer, layout, block sums), waits for the
    parent's "close" (its mapping dropped), closes the producer, then sends how many references
    the consumer still held before that (CUDA IPC: 0 when it gave its own back; else None)."""
    from llmserve.inference.engine.kv_pool_export import KvPoolLayout
    from llmserve.tensor_transport import TensorProducer, TransportPath, local_identity
    from llmserve.tensor_transport.cuda_ipc import CudaExport, references_held

    producer = TensorProducer(local_identity(device))
    references = None
    try:
        region = producer.allocate(torch.Size(dims).numel() * torch.bfloat16.itemsize)
        pool = region.view(region.ref(0, dims, torch.bfloat16))
        pool.normal_()
        producer.mark_written(region)
        offer = producer.offer(region, consumer_identity)
        # The sums as floats: a tensor would cross the pipe through torch's own shared memory.
        connection.send((offer, KvPoolLayout.of(pool), block_sums(pool).tolist()))
        connection.recv()  # "close", or EOFError: the parent is gone; either way we are done
        if offer.path is TransportPath.CUDA_IPC:
            references = references_held(CudaExport(offer.cuda_export))
        del pool, region
    finally:
        producer.close()
    connection.send(references)


class IpcSourcePool:
    """A source pool in a child process, mapped here once through TensorConsumer. `pool` is the
    view of the whole region the server gets (consumer.view of the pool's block run), taken once
    for the kernel and import columns; the copy phase views it again per pull, as
    KvBlockImporter._copy does. close() lets go of all of it; `report` then says how that went."""

    def __init__(self, shape: str, child: multiprocessing.Process, connection) -> None:
        from llmserve.tensor_transport import TensorConsumer

        self.shape = shape
        self.consumer = TensorConsumer()
        self.pool: torch.Tensor | None = None
        self.open_s = 0.0
        self.report: dict = {}
        self._child = child
        self._connection = connection
        self.offer = self.layout = None

    @classmethod
    def start(cls, shape: str, pool_blocks: int) -> IpcSourcePool:
        from llmserve.tensor_transport import local_identity

        context = multiprocessing.get_context("spawn")  # CUDA is initialized here: fork would break it
        connection, child_end = context.Pipe()
        child = context.Process(target=serve_source_pool, daemon=True, name=f"ipc-source-{shape}",
                                args=(child_end, pool_dims(shape, pool_blocks), DEVICE, local_identity(DEVICE)))
        child.start()
        child_end.close()  # so that a child that dies makes recv raise EOFError, not wait forever
        source = cls(shape, child, connection)
        try:
            source._open()
        except BaseException:
            source.close()
            raise
        return source

    def _open(self) -> None:
        from llmserve.tensor_transport import TransportPath

        if not self._connection.poll(CHILD_START_TIMEOUT_S):
            raise SystemExit(f"the ipc source's child sent no offer within {CHILD_START_TIMEOUT_S} s")
        self.offer, self.layout, child_sums = self._connection.recv()
        if self.offer.path not in (TransportPath.CUDA_IPC, TransportPath.SHM):
            raise SystemExit(f"the child's pool reaches this process by the {self.offer.path.value} path, not a mapping")
        started = time.perf_counter()
        self.consumer.open(self.offer)  # once, at connection time: cudaIpcOpenMemHandle takes 100s of ms
        self.open_s = time.perf_counter() - started
        self.pool = self.view_whole_pool(None)
        if not torch.allclose(block_sums(self.pool), torch.tensor(child_sums), rtol=1e-4, atol=1e-2):
            raise SystemExit("the mapped pool differs from what the child wrote")

    def view_whole_pool(self, num_bytes_read: int | None) -> torch.Tensor:
        """KvBlockImporter._copy's view: the ref made and checked, the stream made to wait on the
        region's interprocess event, the transfer counted."""
        whole = self.layout.block_run_ref(self.offer.region_id, 0, self.layout.num_blocks)
        return self.consumer.view(whole, num_bytes_read)

    def close(self) -> None:
        """Drop our mapping (a CUDA one gives the child's reference back), then let the child
        close its producer and exit (killed if it does not within CHILD_EXIT_TIMEOUT_S)."""
        self.pool = None
        gc.collect()  # a view of the mapping still referenced would keep the IPC handle open
        synchronize()
        self.consumer.close_all()
        gc.collect()
        references = None
        try:
            self._connection.send("close")
            if self._connection.poll(CHILD_EXIT_TIMEOUT_S):
                references = self._connection.recv()
        except (EOFError, OSError):  # the child is gone already: its exit code says how
            pass
        self._child.join(CHILD_EXIT_TIMEOUT_S)
        if self._child.is_alive():
            self._child.kill()
            self._child.join()
        self._connection.close()
        self.report = {
            "shape": self.shape, "path": self.offer.path.value if self.offer else None,
            "open_ms": round(self.open_s * 1000, 3), "child_pid": self._child.pid, "child_exit_code": self._child.exitcode,
            "references_held_at_close": references, "left_in_dev_shm": left_in_dev_shm(self._child.pid),
            "driver_left_in_dev_shm": driver_files_in_dev_shm(self._child.pid),
        }


def driver_files_in_dev_shm(pid: int) -> list[str]:
    """The CUDA driver's /dev/shm file of the process `pid` (cuda.shm.0.<pid in hex>.1). The
    driver makes one in a process that exports memory or creates an interprocess event, and
    leaves it when the process exits (H200, driver 580: a bare torch child did the same); no
    API frees it, and it is not ours to unlink. Reported apart, for what every exporting
    process (a replica with --kv-pull) leaves."""
    pattern = re.compile(rf"cuda\.shm\.\d+\.{pid:x}\.\d+")
    try:
        return sorted(name for name in os.listdir("/dev/shm") if pattern.fullmatch(name))
    except OSError:
        return []


def left_in_dev_shm(pid: int) -> list[str]:
    """/dev/shm names the process `pid` made and nobody unlinked (its segments; torch's CUDA IPC
    reference counters), after its reaper had a moment to unlink them."""
    prefixes = (f"llmserve-tt-{pid}-", f"torch_{pid}_")
    deadline = time.monotonic() + REAPER_GRACE_S
    while True:
        try:
            left = sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefixes))
        except OSError:
            return []
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# --- measuring ----------------------------------------------------------------------------------


def measure(shape: str, num_blocks: int, source: torch.Tensor, target: torch.Tensor, args: argparse.Namespace,
            ipc: IpcSourcePool | None = None) -> dict:
    """One row: copies of `num_blocks` from `source` (with `ipc`, its mapped pool) into `target`."""
    from llmserve.inference.engine.kv_block_import import ids_on_device
    from llmserve.inference.kernels.block_copy import copy_blocks

    if ipc is not None:
        source = ipc.pool
    idle_s = args.idle_ms / 1000
    chooser = random.Random(num_blocks)  # the same ids for both sources
    source_ids = chooser.sample(range(args.pool_blocks), num_blocks)
    target_ids = chooser.sample(range(args.pool_blocks), num_blocks)
    device_ids = torch.tensor([source_ids, target_ids], dtype=torch.int64, device=DEVICE)
    num_bytes = num_blocks * source[:, :, 0].nbytes
    flat_source, flat_target = source.view(-1).view(torch.uint8), target.view(-1).view(torch.uint8)

    def kernel(tile: int | None = None, num_warps: int | None = None):
        settings = {key: value for key, value in (("tile", tile), ("num_warps", num_warps)) if value}
        return lambda: copy_blocks(source, target, device_ids[0], device_ids[1], **settings)

    def import_as_the_engine_does():  # KvBlockImporter._copy_by_kernel, without the pool view
        ids = ids_on_device(tuple(source_ids), target_ids, torch.device(DEVICE))
        copy_blocks(source, target, ids[0], ids[1])
        synchronize()

    def copy_phase_as_the_server_times_it() -> float:
        """KvBlockImporter._copy then _copy_by_kernel, step by step (bfloat16: no _raw view);
        returns the kernel's seconds by the events around it (on CPU by the host's clock)."""
        source_pool = ipc.view_whole_pool(num_bytes)  # orders the reads after the source's writes
        ids = ids_on_device(tuple(source_ids), target_ids, torch.device(DEVICE))
        if DEVICE == "cpu":
            started = time.perf_counter()
            copy_blocks(source_pool, target, ids[0], ids[1])
            return time.perf_counter() - started
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        copy_blocks(source_pool, target, ids[0], ids[1])
        ended.record()
        ended.synchronize()
        return began.elapsed_time(ended) / 1000

    copies = [kernel(), import_as_the_engine_does] + ([copy_phase_as_the_server_times_it] if ipc else [])
    for copy in copies:
        target.zero_()
        copy()
        check_copied(source, target, source_ids, target_ids)
    seconds = {
        "roofline": timed_on_device(lambda: flat_target[:num_bytes].copy_(flat_source[:num_bytes]), args.repeats, idle_s),
        "kernel": timed_on_device(kernel(), args.repeats, idle_s),
        "import": timed_on_host(import_as_the_engine_does, args.repeats, idle_s),
    }
    kernel_in_phase: list[float] = []
    if ipc is not None:
        seconds["copy_phase"] = timed_on_host(copy_phase_as_the_server_times_it, args.repeats, idle_s, kernel_in_phase)
    row = {"shape": shape, "blocks": num_blocks, "source": "ipc" if ipc else "local", "tokens": num_blocks * BLOCK_SIZE,
           "mb": significant(num_bytes / 1e6)}
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    for name, times in seconds.items():
        row[f"{name}_ms"] = spread_ms(times)
        row[f"{name}_gb_per_s"] = significant(num_bytes / medians[name] / 1e9)
    row["kernel_over_roofline_rate"] = significant(medians["roofline"] / medians["kernel"])
    row["import_fixed_ms"] = round((medians["import"] - medians["kernel"]) * 1000, 4)
    if ipc is not None:
        row["copy_phase_kernel_ms"] = spread_ms(kernel_in_phase)
        row["copy_phase_fixed_ms"] = round((medians["copy_phase"] - medians["kernel"]) * 1000, 4)
        row["copy_phase_over_its_kernel_ms"] = round(statistics.median(
            phase - in_phase for phase, in_phase in zip(seconds["copy_phase"], kernel_in_phase, strict=True)) * 1000, 4)
    if args.sweep and ipc is None:
        row["sweep_gb_per_s"] = {
            f"{tile}x{warps}": significant(num_bytes / statistics.median(
                timed_on_device(kernel(tile, warps), args.repeats, idle_s)) / 1e9)
            for tile in SWEEP_TILES for warps in SWEEP_WARPS
        }
    return row


def spread_ms(times: list[float]) -> list[float]:
    return [significant(t * 1000) for t in (min(times), statistics.median(times), max(times))]


def measure_shape(shape: str, args: argparse.Namespace) -> tuple[list[dict], dict | None]:
    """Every --blocks row of `shape`: from the local source, then (--ipc) from the child's; and
    how the child's pool was let go of."""
    source, target = pools(shape, args.pool_blocks)
    ipc = IpcSourcePool.start(shape, args.pool_blocks) if args.ipc else None
    try:
        rows = []
        for blocks in args.blocks.split(","):
            rows.append(measure(shape, int(blocks), source, target, args))
            if ipc is not None:
                rows.append(measure(shape, int(blocks), source, target, args, ipc))
    finally:
        if ipc is not None:
            ipc.close()
    del source, target
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows, ipc.report if ipc is not None else None


def print_table(rows: list[dict]) -> None:
    print("| shape | blocks | source | tokens | MB | roofline ms (min/med/max) | roofline GB/s | kernel ms (min/med/max) "
          "| kernel GB/s | **kernel / roofline** | import ms (min/med/max) | import GB/s | fixed ms (import - kernel) "
          "| copy phase ms (min/med/max) | phase - kernel ms | **phase - its kernel ms** |")
    print("| --- " * 16 + "|")
    for row in rows:
        spread = lambda key: " / ".join(f"{value:.3f}" for value in row[key]) if key in row else "-"  # noqa: E731
        print(f"| {row['shape']} | {row['blocks']} | {row['source']} | {row['tokens']} | {row['mb']} | "
              f"{spread('roofline_ms')} | {row['roofline_gb_per_s']} | {spread('kernel_ms')} | {row['kernel_gb_per_s']} | "
              f"{row['kernel_over_roofline_rate']} | {spread('import_ms')} | {row['import_gb_per_s']} | "
              f"{row['import_fixed_ms']} | {spread('copy_phase_ms')} | {row.get('copy_phase_fixed_ms', '-')} | "
              f"{row.get('copy_phase_over_its_kernel_ms', '-')} |")
    for row in rows:
        if "sweep_gb_per_s" in row:
            best = max(row["sweep_gb_per_s"], key=row["sweep_gb_per_s"].get)
            print(f"sweep {row['shape']} {row['blocks']} blocks (tile x warps: GB/s), best {best}: {row['sweep_gb_per_s']}")


def print_ipc_reports(reports: list[dict]) -> None:
    for report in reports:
        references = report["references_held_at_close"]
        clean = report["child_exit_code"] == 0 and not report["left_in_dev_shm"] and not references
        driver_files = report["driver_left_in_dev_shm"]
        print(f"ipc source {report['shape']}: {report['path']}, opened in {report['open_ms']} ms; child exit code "
              f"{report['child_exit_code']}, references held at close {'n/a' if references is None else references}, "
              f"left in /dev/shm: {report['left_in_dev_shm'] or 'nothing'}{'' if clean else '  <-- NOT CLEAN'}"
              f"{'; the CUDA driver left its ' + ', '.join(driver_files) if driver_files else ''}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if DEVICE == "cpu" and not args.smoke:
        print("bench_block_copy measures a CUDA device; on CPU only --smoke runs (interpreted)", file=sys.stderr)
        return 2
    rows, ipc_reports = [], []
    for shape in args.shapes.split(","):
        shape_rows, ipc_report = measure_shape(shape, args)
        rows += shape_rows
        if ipc_report is not None:
            ipc_reports.append(ipc_report)
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton's interpreter)"
    print(f"device: {device_name}, torch {torch.__version__}, idle between repeats: {args.idle_ms} ms")
    print_table(rows)
    print_ipc_reports(ipc_reports)
    write_results(args, "block-copy", {"device": device_name, "idle_ms": args.idle_ms, "rows": rows,
                                       "ipc_sources": ipc_reports})
    return 0


if __name__ == "__main__":
    sys.exit(main())
