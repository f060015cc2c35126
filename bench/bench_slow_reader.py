"""A client that never reads its stream: how long its request holds the replica (a sequence and
KV blocks), against a client that reads the same request (issue 18's slow readers;
docs/reliability.md, "Slow readers").

    python bench/bench_slow_reader.py                                        # default model, CPU
    python bench/bench_slow_reader.py --shape qwen2.5-1.5b --device cuda --max-tokens 4096 --runs 3

Starts the stack as `llmserve serve` runs it (preprocess, inference on the default torch backend,
a gateway with its OpenAI HTTP API; real subprocesses on loopback, the gateway's slow-reader
bounds at their defaults unless --gateway-arg says otherwise), then sends one request at a time,
a completion of --max-tokens tokens (ignore_eos), from each client:

  reads            a gRPC client that reads every message (the baseline: how long the request
                   holds the replica when nobody stalls)
  grpc-default     a gRPC client with grpc's default channel options that never reads (C-core's
                   receive window starts at 64 KiB and grows by BDP probing, read or not)
  grpc-no-bdp      the same with `grpc.http2.bdp_probe` 0: the window stays 64 KiB
  grpc-1k-window   `grpc.http2.lookahead_bytes` 1024 and no BDP: a window of ~1 KiB
  http-sse         a TCP client that sends a streamed POST /v1/completions and never reads
  node-grpc-js     a Node.js client (@grpc/grpc-js, tests/node/never_read.js) that attaches no
                   `data` listener; run where node and tests/node's packages are (`make setup`)

For each: the seconds until the replica no longer ran the request and held none of its KV blocks
(polled with GetLoad), whether it was aborted (a bound fired) or finished, the most KV blocks it
held, whether the gateway still served the call --linger-s later (its streams-in-flight gauge:
a handler blocked on a write to a client that does not read), and what the client then read:
what its window or socket held, and how the stream ended.
The ratio is those seconds over the reader's in the same run: a never-reading client that holds
the replica no longer than a reader costs nothing a reader does not. Prints a table and writes
JSON to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

import bench_stack
from metrics_scrape import sample_totals
from results_file import write_results
import stack_services
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc

PROMPT = "Tell me a long story about a lighthouse keeper."
POLL_S = 0.1
GRPC_OPTIONS = {
    "grpc-default": (),
    "grpc-no-bdp": (("grpc.http2.bdp_probe", 0),),
    "grpc-1k-window": (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)),
}
CLIENTS = ("reads", *GRPC_OPTIONS, "http-sse", "node-grpc-js")
NODE_CLIENT = Path(__file__).resolve().parent.parent / "tests" / "node" / "never_read.js"
READ_BACK_TIMEOUT_S = 30.0  # reading what a window or socket held, once the replica freed it
IN_FLIGHT = "llmserve_gateway_streams_in_flight"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_stack.add_served_model_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens each request asks for (default: %(default)s)")
    parser.add_argument("--clients", help=f"comma-separated, of {', '.join(CLIENTS)} (default: all; node-grpc-js only "
                                          "where node and tests/node's packages are installed)")
    parser.add_argument("--runs", type=int, default=1,
                        help="every client this many times on one stack; with 3 or more the summary gives "
                             "min/median/max per client (default: %(default)s)")
    parser.add_argument("--give-up-s", type=float, default=600.0,
                        help="a request the replica still runs after this long is cancelled and reported as such "
                             "(default: %(default)s)")
    parser.add_argument("--linger-s", type=float, default=5.0,
                        help="how long after the replica freed a request the gateway's in-flight calls are read "
                             "(default: %(default)s)")
    parser.add_argument("--inference-arg", action="append", default=[], metavar="FLAGS",
                        help="flag(s) for the inference service, shell-split, repeatable")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="FLAGS",
                        help="flag(s) for the gateway, shell-split, repeatable (e.g. \"--max-unread-s 5\")")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    node = node_client()
    if args.clients is None:
        args.clients = [c for c in CLIENTS if node or c != "node-grpc-js"]
    else:
        args.clients = args.clients.split(",")
    unknown = [c for c in args.clients if c not in CLIENTS]
    if unknown:
        parser.error(f"unknown client(s) {unknown}; choose from {', '.join(CLIENTS)}")
    if "node-grpc-js" in args.clients and not node:
        parser.error("node-grpc-js needs node and tests/node's packages (`make setup` installs them where npm is)")
    if "reads" not in args.clients:
        args.clients.insert(0, "reads")  # the baseline of every ratio
    args.inference_arg = [flag for value in args.inference_arg for flag in shlex.split(value)]
    args.gateway_arg = [flag for value in args.gateway_arg for flag in shlex.split(value)]
    return args


@dataclass
class Holding:
    """How long one request held the replica, and what its client read afterwards."""

    client: str
    run: int
    held_s: float  # from sending until the replica neither ran it nor held its KV blocks
    ended: str  # "finished", "aborted" (by the gateway: a bound fired) or "gave up" (cancelled after --give-up-s)
    max_kv_blocks: int
    gateway_calls_after: int  # calls the gateway served --linger-s after the replica freed this one
    messages_read: int  # what the client read: gRPC messages, or SSE events with text
    bytes_read: int  # gRPC messages' bytes (0 from the Node client, which does not count them), or the HTTP response's
    tokens_read: int  # gRPC only (token ids); the SSE events carry text
    how_it_ended: str  # the status (gRPC) or the last event (SSE), cut short
    ratio_to_reader: float | None = None


class ReplicaWatch:
    """The replica's load, polled while one request runs on it alone."""

    def __init__(self, address: str):
        self._channel = grpc.insecure_channel(address)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)

    def load(self) -> inference_pb2.GetLoadResponse:
        return self._stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=10)

    def until_freed(self, before: inference_pb2.GetLoadResponse, started_s: float, give_up_s: float,
                    on_give_up) -> tuple[float, str, int]:
        """Seconds from `started_s` until the request that started after `before` was over on the
        replica (finished, none running, no KV block used); how it ended; the most blocks it held."""
        max_blocks = 0
        gave_up = False
        while True:
            load = self.load()
            max_blocks = max(max_blocks, load.kv_blocks_used)
            over = load.num_finished_total > before.num_finished_total and load.num_running == 0 and load.kv_blocks_used == 0
            if over:
                held_s = time.monotonic() - started_s
                aborted = load.num_aborted_total > before.num_aborted_total
                return held_s, "gave up" if gave_up else ("aborted" if aborted else "finished"), max_blocks
            if not gave_up and time.monotonic() - started_s > give_up_s:
                on_give_up()
                gave_up = True
            time.sleep(POLL_S)

    def close(self) -> None:
        self._channel.close()


def grpc_request(max_tokens: int) -> gateway_pb2.GenerateStreamRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return gateway_pb2.GenerateStreamRequest(
        params=gateway_pb2.GenerateParams(prompt=PROMPT, sampling=sampling, return_token_ids=True))


def read_grpc(stream) -> tuple[int, int, int, str]:
    """Messages, bytes and tokens a stream yields from here on, and its status."""
    messages = num_bytes = tokens = 0
    status = "OK"
    try:
        for message in stream:
            messages += 1
            num_bytes += message.ByteSize()
            tokens += len(message.token_ids)
    except grpc.RpcError as error:
        status = f"{error.code().name}: {error.details()}"
    return messages, num_bytes, tokens, status[:160]


def gateway_calls(metrics_port: int) -> int:
    return round(sample_totals(metrics_port).get(IN_FLIGHT, 0.0))


def wait_unread(watch: ReplicaWatch, before: inference_pb2.GetLoadResponse, started_s: float, args,
                metrics_port: int, give_up) -> tuple[float, str, int, int]:
    """For a client that has read nothing yet: until_freed's seconds, ending and blocks, then the
    calls the gateway still serves --linger-s later."""
    held_s, ended, max_blocks = watch.until_freed(before, started_s, args.give_up_s, give_up)
    time.sleep(args.linger_s)
    return held_s, ended, max_blocks, gateway_calls(metrics_port)


def run_reader(run: int, args, gateway: str, watch: ReplicaWatch, metrics_port: int) -> Holding:
    """The baseline: a gRPC client that reads every message (on its own thread, while the replica
    is polled here)."""
    with grpc.insecure_channel(gateway) as channel, ThreadPoolExecutor(1) as reader:
        before = watch.load()
        started_s = time.monotonic()
        stream = gateway_pb2_grpc.GatewayServiceStub(channel).GenerateStream(
            grpc_request(args.max_tokens), timeout=args.give_up_s + 120)
        read = reader.submit(read_grpc, stream)
        held_s, ended, max_blocks = watch.until_freed(before, started_s, args.give_up_s, stream.cancel)
        messages, num_bytes, tokens, status = read.result()
    return Holding("reads", run, held_s, ended, max_blocks, gateway_calls(metrics_port), messages, num_bytes, tokens,
                   status)


def run_grpc(client: str, run: int, args, gateway: str, watch: ReplicaWatch, metrics_port: int) -> Holding:
    """A Python gRPC client with GRPC_OPTIONS[client] that reads nothing until the replica is done."""
    with grpc.insecure_channel(gateway, options=GRPC_OPTIONS[client]) as channel:
        before = watch.load()
        started_s = time.monotonic()
        stream = gateway_pb2_grpc.GatewayServiceStub(channel).GenerateStream(
            grpc_request(args.max_tokens), timeout=args.give_up_s + 120)
        stream.initial_metadata()  # sent and started; from here on the client takes nothing
        held_s, ended, max_blocks, calls_after = wait_unread(watch, before, started_s, args, metrics_port, stream.cancel)
        messages, num_bytes, tokens, status = read_grpc(stream)
    return Holding(client, run, held_s, ended, max_blocks, calls_after, messages, num_bytes, tokens, status)


def node_client() -> str | None:
    """The node executable, where tests/node's @grpc/grpc-js is installed beside it."""
    node = shutil.which("node")
    installed = (NODE_CLIENT.parent / "node_modules" / "@grpc" / "grpc-js" / "package.json").is_file()
    return node if node and installed else None


def run_node(run: int, args, gateway: str, watch: ReplicaWatch, metrics_port: int) -> Holding:
    before = watch.load()
    started_s = time.monotonic()
    with subprocess.Popen([node_client(), str(NODE_CLIENT), gateway, str(args.max_tokens), PROMPT],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as client:
        try:
            first_line = client.stdout.readline().strip()
            if first_line != "started":
                raise RuntimeError(f"the Node client did not start its call: {first_line!r}")
            held_s, ended, max_blocks, calls_after = wait_unread(watch, before, started_s, args, metrics_port, client.kill)
            out, _ = client.communicate("read\n", timeout=READ_BACK_TIMEOUT_S)  # now it reads, then prints what it got
        finally:
            if client.poll() is None:  # a failure above: no client left behind
                client.kill()
    read = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"messages": 0, "tokens": 0, "status": "killed"}
    return Holding("node-grpc-js", run, held_s, ended, max_blocks, calls_after, read["messages"], 0, read["tokens"],
                   read["status"][:160])


def http_request(max_tokens: int, port: int) -> bytes:
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


def read_sse(sock: socket.socket) -> tuple[int, int, str]:
    """SSE events with text and bytes read until the server closes (or READ_BACK_TIMEOUT_S passes
    without a byte), and the last event."""
    sock.settimeout(READ_BACK_TIMEOUT_S)
    received = bytearray()
    ending = "closed by the server"
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except TimeoutError:
        ending = f"no byte for {READ_BACK_TIMEOUT_S:.0f} s, still open"
    events = re.findall(rb"data: ([^\n]*)\n\n", received)  # one per chunk of the chunked body
    with_text = sum(1 for e in events if b'"text":"' in e and b'"text":""' not in e)
    last = events[-1].decode(errors="replace") if events else received[:120].decode(errors="replace")
    return with_text, len(received), f"{last[:120]} ({ending})"


def run_http(run: int, args, port: int, watch: ReplicaWatch, metrics_port: int) -> Holding:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        before = watch.load()
        started_s = time.monotonic()
        sock.sendall(http_request(args.max_tokens, port))
        held_s, ended, max_blocks, calls_after = wait_unread(watch, before, started_s, args, metrics_port,
                                                             lambda: sock.shutdown(socket.SHUT_RDWR))
        messages, num_bytes, last = read_sse(sock)
    return Holding("http-sse", run, held_s, ended, max_blocks, calls_after, messages, num_bytes, 0, last)


def run_all(args, model_dir: Path, log_dir: Path) -> list[Holding]:
    http_port, metrics_port = stack_services.free_port(), stack_services.free_port()
    services = stack_services.start_stack(
        model_dir, log_dir, timeout_s=args.startup_timeout_s, inference_flags=["--device", args.device, *args.inference_arg],
        gateway_flags=["--http-port", str(http_port), "--metrics-port", str(metrics_port), *args.gateway_arg])
    watch = ReplicaWatch(services["inference"].address)
    holdings = []
    try:
        for run in range(1, args.runs + 1):
            reader_s = None
            for client in args.clients:
                print(f"[run {run}] {client}: {args.max_tokens} tokens asked", flush=True)
                if client == "reads":
                    holding = run_reader(run, args, services["gateway"].address, watch, metrics_port)
                elif client == "http-sse":
                    holding = run_http(run, args, http_port, watch, metrics_port)
                elif client == "node-grpc-js":
                    holding = run_node(run, args, services["gateway"].address, watch, metrics_port)
                else:
                    holding = run_grpc(client, run, args, services["gateway"].address, watch, metrics_port)
                reader_s = holding.held_s if client == "reads" else reader_s
                holding.ratio_to_reader = holding.held_s / reader_s
                print(f"[run {run}] {client}: {holding.ended} after {holding.held_s:.1f} s "
                      f"({holding.ratio_to_reader:.2f}x the reader); gateway calls {args.linger_s:.0f} s later: "
                      f"{holding.gateway_calls_after}; read later {holding.messages_read} messages, "
                      f"{holding.bytes_read} bytes; {holding.how_it_ended}", flush=True)
                holdings.append(holding)
    finally:
        watch.close()
        stack_services.stop_services(services)
    return holdings


def format_table(holdings: list[Holding]) -> str:
    lines = ["| run | client | held the replica | x reader | ended | max KV blocks | gateway calls after | "
             "read later: messages / tokens / bytes | how the stream ended |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for h in holdings:
        lines.append(f"| {h.run} | {h.client} | {h.held_s:.1f} s | {h.ratio_to_reader:.2f} | {h.ended} | {h.max_kv_blocks} "
                     f"| {h.gateway_calls_after} | {h.messages_read} / {h.tokens_read} / {h.bytes_read:,} | {h.how_it_ended.replace('|', '/')} |")
    return "\n".join(lines)


def spread(holdings: list[Holding], clients: list[str]) -> dict:
    """Per client: min/median/max of the seconds held and of the ratio to the reader."""
    out = {}
    for client in clients:
        of_client = [h for h in holdings if h.client == client]
        out[client] = {key: {"min": min(values), "median": statistics.median(values), "max": max(values)}
                       for key, values in (("held_s", [h.held_s for h in of_client]),
                                           ("ratio_to_reader", [h.ratio_to_reader for h in of_client]))}
        out[client]["ended"] = sorted({h.ended for h in of_client})
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-slow-reader-") as log_dir:
        args.model = bench_stack.served_model(args, Path(log_dir))
        holdings = run_all(args, args.model, Path(log_dir))
    print()
    print(format_table(holdings))
    spreads = spread(holdings, args.clients)
    if args.runs >= 3:
        print()
        print("| client | held s min / median / max | x reader min / median / max | ended |")
        print("| --- | --- | --- | --- |")
        for client, s in spreads.items():
            print(f"| {client} | {s['held_s']['min']:.1f} / {s['held_s']['median']:.1f} / {s['held_s']['max']:.1f} "
                  f"| {s['ratio_to_reader']['min']:.2f} / {s['ratio_to_reader']['median']:.2f} / "
                  f"{s['ratio_to_reader']['max']:.2f} | {', '.join(s['ended'])} |")
    write_results(args, "slow-reader", {"holdings": [asdict(h) for h in holdings], "spread": spreads})


if __name__ == "__main__":
    main()
