"""Which HTTP server library should carry the gateway's OpenAI API (issue 21)? Each candidate
serves the same minimal Server-Sent-Events endpoint, driven by the same client at a fixed
concurrency; what it costs is read from /proc (bench/proc_cpu.py).

    python bench/bench_http_server.py                        # every server installed, 3 rounds
    python bench/bench_http_server.py --servers aiohttp,uvicorn --concurrency 64 --chunks 128
    pip install -e '.[bench-http]'                           # uvicorn, starlette, granian

  aiohttp         aiohttp.web on an asyncio loop we own (what the gateway runs: its worker's loop,
                  shared with grpc.aio)
  uvicorn         uvicorn (httptools parser) + starlette, `Server.serve()` on a loop we own: it can
                  share the gateway's loop too
  granian-embed   granian's embedded server (experimental in granian 2) + starlette: its Rust
                  runtime does the socket I/O on a thread of its own, the app runs on our loop
  granian         granian as it is usually run: its own worker process (1 worker, asyncio loop),
                  the app there; for the gateway that would be a second process, one more hop

The endpoint: POST /stream {"chunks": N, "interval_ms": T} answers N events of one fixed
~200-byte OpenAI chat chunk (pre-encoded: the JSON encoding is the gateway's cost on any server,
so it is left out), then `data: [DONE]`. Between chunks the handler awaits asyncio.sleep(T):
T = 0 still yields to the loop, as a token arriving from the engine's stream does, so every chunk
is its own write. Each server runs in a process of its own; the client (aiohttp, --client-processes
spawned processes, a keep-alive connection per stream) checks every stream brings N chunks.

Reported per server (median over --rounds, servers interleaved within each round):
  chunks_per_server_core_s  chunks sent per CPU-second of the server's processes (all threads):
                            the headline, independent of how much CPU the client took
  chunks_per_s              over the load's wall time (client-bound on a small machine)
  server_cores, client_cores  mean cores busy over the load
  first_chunk_ms p50 / p99  request sent -> first chunk read, at that concurrency
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path

from proc_cpu import CLOCK_TICKS_PER_S, child_pids, snapshot

BENCH_DIR = Path(__file__).resolve().parent
SERVERS = ("aiohttp", "uvicorn", "granian-embed", "granian")
# What each server needs importable, beside this script's own aiohttp.
SERVER_MODULES = {"aiohttp": ("aiohttp",), "uvicorn": ("uvicorn", "starlette", "httptools"),
                  "granian-embed": ("granian", "starlette"), "granian": ("granian", "starlette")}
HOST = "127.0.0.1"
_READY_TIMEOUT_S = 30.0
_CHUNK = ("data: " + json.dumps({
    "id": "chatcmpl-0123456789abcdef0123456789abcdef", "object": "chat.completion.chunk", "created": 1767225600,
    "model": "smollm2-135m-instruct",
    "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None, "finish_reason": None}],
}, separators=(",", ":")) + "\n\n").encode()  # fmt: skip
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache"}


# --- the endpoint, on each server -----------------------------------------------------------


async def events(num_chunks: int, interval_s: float) -> AsyncIterator[bytes]:
    for _ in range(num_chunks):
        await asyncio.sleep(interval_s)
        yield _CHUNK
    yield _DONE


def aiohttp_app():
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **_SSE_HEADERS})
        await response.prepare(request)
        async for event in events(body["chunks"], body["interval_ms"] / 1e3):
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/stream", stream)
    return app


def starlette_app():
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def stream(request: Request) -> StreamingResponse:
        body = await request.json()
        return StreamingResponse(events(body["chunks"], body["interval_ms"] / 1e3), media_type="text/event-stream",
                                 headers=_SSE_HEADERS)

    return Starlette(routes=[Route("/stream", stream, methods=["POST"])])


async def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    runner = web.AppRunner(aiohttp_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, HOST, port).start()
    await asyncio.Event().wait()


async def serve_uvicorn(port: int) -> None:
    import uvicorn

    config = uvicorn.Config(starlette_app(), host=HOST, port=port, loop="none", http="httptools", lifespan="off",
                            log_level="warning", access_log=False)
    await uvicorn.Server(config).serve()


async def serve_granian_embedded(port: int) -> None:
    from granian.constants import Interfaces
    from granian.server.embed import Server

    await Server(starlette_app(), address=HOST, port=port, interface=Interfaces.ASGINL, log_enabled=False).serve()


def serve_granian_process(port: int) -> None:
    from granian import Granian
    from granian.constants import Interfaces, Loops

    # The target by name: granian's worker process imports it (this file's directory is on its path).
    Granian("bench_http_server:starlette_app", address=HOST, port=port, interface=Interfaces.ASGINL, factory=True,
            workers=1, loop=Loops.asyncio, log_enabled=False).serve()


def run_server(name: str, port: int) -> None:
    """The server process's body (`--serve NAME`): serve until killed."""
    if name == "granian":
        serve_granian_process(port)
        return
    serve = {"aiohttp": serve_aiohttp, "uvicorn": serve_uvicorn, "granian-embed": serve_granian_embedded}[name]
    asyncio.run(serve(port))


# --- the client -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    port: int
    num_requests: int  # this client process's share
    concurrency: int  # its streams in flight
    num_chunks: int
    interval_ms: float


@dataclass(slots=True)
class ClientResult:
    first_chunk_ms: list[float]
    num_chunks: int
    num_bad_streams: int  # streams that did not bring exactly num_chunks chunks and [DONE]
    cpu_s: float


async def _one_stream(session, load: Load) -> tuple[float, int, bool]:
    body = {"chunks": load.num_chunks, "interval_ms": load.interval_ms}
    start = time.monotonic()
    first_ms, chunks, done = float("nan"), 0, False
    async with session.post(f"http://{HOST}:{load.port}/stream", json=body) as response:
        async for line in response.content:
            if line == b"data: [DONE]\n":
                done = True
            elif line.startswith(b"data: "):
                if chunks == 0:
                    first_ms = (time.monotonic() - start) * 1e3
                chunks += 1
    return first_ms, chunks, done and chunks == load.num_chunks


async def _drive(load: Load) -> ClientResult:
    import aiohttp

    remaining = load.num_requests
    result = ClientResult([], 0, 0, 0.0)
    connector = aiohttp.TCPConnector(limit=load.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def stream_loop() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                first_ms, chunks, ok = await _one_stream(session, load)
                result.first_chunk_ms.append(first_ms)
                result.num_chunks += chunks
                result.num_bad_streams += not ok

        await asyncio.gather(*(stream_loop() for _ in range(load.concurrency)))
    return result


def _client_main(load: Load, start_event, results) -> None:
    start_event.wait()
    cpu_before_s = time.process_time()
    result = asyncio.run(_drive(load))
    result.cpu_s = time.process_time() - cpu_before_s
    results.put(result)


# --- one measurement ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def _wait_listening(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            socket.create_connection((HOST, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {HOST}:{port} after {_READY_TIMEOUT_S} s")


def _server_ticks(pid: int) -> int:
    """CPU ticks of the server process and its children (granian's worker)."""
    pids = [pid, *child_pids(pid)]
    return sum(ticks for _, ticks in snapshot({"server": pids}).process_ticks.values())


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if k < total % parts else 0) for k in range(parts)]


def _run_clients(loads: list[Load]) -> tuple[list[ClientResult], float]:
    """Start the client processes together; (their results, the load's wall seconds)."""
    context = mp.get_context("spawn")
    start_event, results = context.Event(), context.Queue()
    clients = [context.Process(target=_client_main, args=(load, start_event, results), daemon=True) for load in loads]
    for client in clients:
        client.start()
    time.sleep(0.5)  # let them import before the clock starts
    start = time.monotonic()
    start_event.set()
    done = [results.get(timeout=600) for _ in clients]
    wall_s = time.monotonic() - start
    for client in clients:
        client.join(timeout=10)
    return done, wall_s


@dataclass(frozen=True, slots=True)
class Measurement:
    server: str
    chunks_per_server_core_s: float
    chunks_per_s: float
    server_cores: float
    client_cores: float
    first_chunk_p50_ms: float
    first_chunk_p99_ms: float
    num_streams: int
    num_bad_streams: int


def measure(name: str, args: argparse.Namespace) -> Measurement:
    port = _free_port()
    # A process group of its own: stopping it stops granian's worker process too.
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", name, "--port", str(port)],
                              cwd=BENCH_DIR, start_new_session=True)
    try:
        _wait_listening(port, server)
        warmup = [Load(port, args.concurrency, args.concurrency, args.chunks, args.interval_ms)]
        _run_clients(warmup)  # connections, imports and the first requests' one-off costs
        shares = zip(_split(args.requests, args.client_processes), _split(args.concurrency, args.client_processes))
        loads = [Load(port, n, c, args.chunks, args.interval_ms) for n, c in shares if n and c]
        ticks_before = _server_ticks(server.pid)
        results, wall_s = _run_clients(loads)
        server_cpu_s = (_server_ticks(server.pid) - ticks_before) / CLOCK_TICKS_PER_S
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    first_ms = sorted(ms for r in results for ms in r.first_chunk_ms)
    num_chunks = sum(r.num_chunks for r in results)
    return Measurement(
        # At least one clock tick: a load too short to be measured (a smoke run) reads as one tick.
        server=name, chunks_per_server_core_s=num_chunks / max(server_cpu_s, 1 / CLOCK_TICKS_PER_S),
        chunks_per_s=num_chunks / wall_s,
        server_cores=server_cpu_s / wall_s, client_cores=sum(r.cpu_s for r in results) / wall_s,
        first_chunk_p50_ms=_percentile(first_ms, 50), first_chunk_p99_ms=_percentile(first_ms, 99),
        num_streams=len(first_ms), num_bad_streams=sum(r.num_bad_streams for r in results),
    )


def _percentile(ordered: list[float], p: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round((len(ordered) - 1) * p / 100))]


def median_of(rounds: list[Measurement]) -> dict:
    """Per field, the median over the rounds (bad streams: the total)."""
    row = {"server": rounds[0].server, "rounds": len(rounds)}
    for field in Measurement.__dataclass_fields__:
        if field == "server":
            continue
        values = [getattr(m, field) for m in rounds]
        row[field] = sum(values) if field == "num_bad_streams" else statistics.median(values)
    return row


# --- the run --------------------------------------------------------------------------------


def available(name: str) -> bool:
    return all(importlib.util.find_spec(module) is not None for module in SERVER_MODULES[name])


def print_table(rows: list[dict], missing: list[str]) -> None:
    header = f"{'server':<14}{'chunks/s per core':>18}{'chunks/s':>10}{'server cores':>13}{'client cores':>13}" \
             f"{'1st chunk p50 ms':>17}{'p99 ms':>9}{'bad':>5}"
    print(header)
    for r in rows:
        print(f"{r['server']:<14}{r['chunks_per_server_core_s']:>18.0f}{r['chunks_per_s']:>10.0f}"
              f"{r['server_cores']:>13.2f}{r['client_cores']:>13.2f}{r['first_chunk_p50_ms']:>17.2f}"
              f"{r['first_chunk_p99_ms']:>9.2f}{r['num_bad_streams']:>5}")
    for name in missing:
        print(f"{name:<14}not installed ({', '.join(SERVER_MODULES[name])}): pip install -e '.[bench-http]'")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of: %(default)s")
    p.add_argument("--concurrency", type=int, default=64, help="streams in flight (default: %(default)s)")
    p.add_argument("--requests", type=int, default=512, help="streams per server and round (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=64, help="chunks per stream (default: %(default)s)")
    p.add_argument("--interval-ms", type=float, default=0.0,
                   help="the handler's sleep between chunks; 0 yields only (default: %(default)s)")
    p.add_argument("--client-processes", type=int, default=1, help="default: %(default)s")
    p.add_argument("--rounds", type=int, default=3, help="rounds, servers interleaved; medians reported (default: %(default)s)")
    p.add_argument("--out-dir", type=Path, default=BENCH_DIR / "results")
    p.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)  # the server process's own entry
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        run_server(args.serve, args.port)
        return 0
    names = [name.strip() for name in args.servers.split(",") if name.strip()]
    unknown = set(names) - set(SERVERS)
    if unknown:
        raise SystemExit(f"unknown servers: {', '.join(sorted(unknown))} (choose from {', '.join(SERVERS)})")
    runnable = [name for name in names if available(name)]
    rounds: dict[str, list[Measurement]] = {name: [] for name in runnable}
    for k in range(args.rounds):
        shift = k % max(1, len(runnable))  # each round starts with the next server: none always goes first
        for name in runnable[shift:] + runnable[:shift]:
            rounds[name].append(measure(name, args))
            print(f"round {k + 1}/{args.rounds} {name}: {rounds[name][-1].chunks_per_server_core_s:.0f} chunks/s per core",
                  file=sys.stderr)
    rows = [median_of(rounds[name]) for name in runnable]
    missing = [name for name in names if name not in runnable]
    print_table(rows, missing)
    config = {key: value for key, value in vars(args).items() if key not in ("serve", "port", "out_dir")}
    report = {"config": config, "cpus": os.cpu_count(), "servers": rows, "not_installed": missing,
              "rounds": {name: [asdict(m) for m in ms] for name, ms in rounds.items()}}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / time.strftime("http-server-%Y%m%d-%H%M%S.json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if all(row["num_bad_streams"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
