"""`python -m llmserve.gateway --workers 2`: two gateway processes on one port, as real processes.

Many clients on their own channels all succeed and both workers serve some (`x-gateway-worker`);
one channel's calls move between workers as its connections age (--max-connection-age-s);
with --worker-ports each worker also listens on its own port, and one round_robin channel over
them spreads its calls evenly;
SIGTERM to the parent drains every worker (a stream in flight finishes, exit 0); a worker that
dies takes the gateway down with a log line naming it.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmserve.call_balancing import balanced_target, balancing_options
from llmserve.gateway.worker_ports import read_worker_ports
from llmserve.tools.cli import build_parser as build_cli_parser
from llmserve.gateway.__main__ import build_parser as build_gateway_parser
from llmserve.gateway.__main__ import config_from_args as gateway_config_from_args
from llmserve.tools.launcher import common_argv, gateway_argv
from llmserve.tools.serve_config import ServeConfig, default_gateway_workers, serve_config_from_args
from llmserve.tools.service_process import ServiceProcess, ServiceStartError, stop_service
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.procs import free_port, running_service, stack_fixture

NUM_WORKERS = 2
NUM_CLIENTS = 24
EXIT_TIMEOUT_S = 30.0
DRAIN_MAX_TOKENS = 200
# grpc's channels to one address share one connection unless each has its own subchannel pool;
# SO_REUSEPORT spreads connections, so each client here gets a connection of its own.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
# A receive window of ~1 KiB: a stream that is not read cannot finish, so it is in flight when
# the gateway is stopped (client_stream's bound, 2048 tokens by default, is far away).
SMALL_WINDOW = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))
MAX_CHANNELS = 64  # channels opened until streams run on every worker (all on one: 2 ** -63)


def params(max_tokens: int) -> gateway_pb2.GenerateParams:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return gateway_pb2.GenerateParams(prompt="Hello", sampling=sampling)


def stream_on_own_channel(address: str, max_tokens: int) -> tuple[str, list[gateway_pb2.GenerateStreamResponse]]:
    """One client on a connection of its own: the worker that served it, its messages."""
    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        stream = gateway_pb2_grpc.GatewayServiceStub(channel).GenerateStream(
            gateway_pb2.GenerateStreamRequest(params=params(max_tokens)), timeout=60.0
        )
        messages = list(stream)
        return dict(stream.initial_metadata())["x-gateway-worker"], messages


def worker_pids(log_text: str) -> dict[int, int]:
    return {int(w): int(p) for w, p in re.findall(r"gateway worker (\d+) started \(pid (\d+)\)", log_text)}


stack = stack_fixture(gateway_args=["--workers", str(NUM_WORKERS)])


def start_second_gateway(stack, model_dir, log_dir, *extra_args: str):
    """Another two-worker gateway in front of the stack's hops (one these tests may stop or break)."""
    args = [
        "--model", str(model_dir), "--preprocess", stack["preprocess"].address,
        "--inference", stack["inference"].address, "--workers", str(NUM_WORKERS), *extra_args,
    ]
    return running_service("gateway", args, log_dir)


def test_clients_on_separate_channels_all_succeed_on_both_workers(stack):
    address = stack["gateway"].address
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda _: stream_on_own_channel(address, 8), range(NUM_CLIENTS)))
    texts = {"".join(m.text for m in messages) for _, messages in results}
    assert len(texts) == 1  # greedy, one prompt: every worker says the same
    assert all(messages[-1].result.usage.completion_tokens == 8 for _, messages in results)
    assert {worker for worker, _ in results} == {str(i) for i in range(NUM_WORKERS)}


def test_logs_name_the_worker(stack):
    log_text = stack["gateway"].log_path.read_text()
    assert sorted(worker_pids(log_text)) == list(range(NUM_WORKERS))
    for worker_id in range(NUM_WORKERS):
        assert re.search(rf" gateway/{worker_id} \S+: gateway serving ", log_text), log_text


def test_sigterm_drains_every_worker(stack, tiny_model_dir, tmp_path):
    with start_second_gateway(stack, tiny_model_dir, tmp_path) as gateway:
        # Streams in flight on every worker: each has sent its first message and waits for its reader.
        channels, in_flight, workers = [], [], set()
        while workers != {str(i) for i in range(NUM_WORKERS)} and len(channels) < MAX_CHANNELS:
            channels.append(grpc.insecure_channel(gateway.address, options=OWN_CONNECTION + SMALL_WINDOW))
            stream = gateway_pb2_grpc.GatewayServiceStub(channels[-1]).GenerateStream(
                # The deadline only guards against a hang: admission refuses one the measured pace
                # cannot meet, and a loaded 2-core machine has stepped the tiny model at 300 ms.
                gateway_pb2.GenerateStreamRequest(params=params(DRAIN_MAX_TOKENS)), timeout=600.0
            )
            in_flight.append((next(stream), stream))
            workers.add(dict(stream.initial_metadata())["x-gateway-worker"])
        gateway.send_signal(signal.SIGTERM)
        for first, stream in in_flight:
            rest = list(stream)
            assert rest[-1].request_id == first.request_id
            assert rest[-1].result.usage.completion_tokens == DRAIN_MAX_TOKENS
        assert gateway.wait(EXIT_TIMEOUT_S) == 0, gateway.log_tail()
        for channel in channels:
            channel.close()
        log_text = gateway.log_path.read_text()
        for worker_id in range(NUM_WORKERS):
            assert re.search(rf" gateway/{worker_id} \S+: signal received: draining", log_text), log_text


def test_an_aged_connection_moves_and_its_stream_in_flight_finishes(stack, tiny_model_dir, tmp_path):
    """--max-connection-age-s 0.5: one client channel's calls land on both workers (each age
    ends its connection with GOAWAY; the next call connects again and the kernel places it
    afresh), and a stream that outlives several ages ends with all its tokens (held unread
    behind a small window meanwhile; --max-unread-s 0, so the slow-reader bound leaves it). The
    HTTP face's keep-alive connections age too."""
    http_port = free_port()
    with start_second_gateway(stack, tiny_model_dir, tmp_path, "--max-connection-age-s", "0.5", "--max-unread-s", "0",
                              "--http-port", str(http_port)) as gateway:
        # HTTP keep-alive ages too: a response once the connection is past its age says so, and closes it.
        keep_alive = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
        keep_alive.request("GET", "/v1/models")
        fresh = keep_alive.getresponse()
        fresh.read()
        time.sleep(0.6)
        keep_alive.request("GET", "/v1/models")
        aged = keep_alive.getresponse()
        aged.read()
        assert (fresh.getheader("Connection"), aged.getheader("Connection")) == (None, "close")
        keep_alive.close()
        with grpc.insecure_channel(gateway.address, options=SMALL_WINDOW) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            long_stream = stub.GenerateStream(gateway_pb2.GenerateStreamRequest(params=params(DRAIN_MAX_TOKENS)), timeout=600.0)
            first = next(long_stream)  # in flight on the first connection
            started_on = dict(long_stream.initial_metadata())["x-gateway-worker"]
            workers, num_calls = set(), 0
            while workers != {str(i) for i in range(NUM_WORKERS)} and num_calls < MAX_CHANNELS:
                time.sleep(0.6)  # past the age (±10% jitter): the connection used last has gone
                _, call = stub.Generate.with_call(gateway_pb2.GenerateRequest(params=params(2)), timeout=60.0)
                workers.add(dict(call.initial_metadata())["x-gateway-worker"])
                num_calls += 1
            assert workers == {str(i) for i in range(NUM_WORKERS)}, f"{num_calls} calls, all on worker {workers}"
            rest = list(long_stream)  # read only now: it waited, unread, across every age
            assert rest[-1].request_id == first.request_id and started_on in workers
            assert rest[-1].result.usage.completion_tokens == DRAIN_MAX_TOKENS


def served_by(channel: grpc.Channel) -> str:
    """The worker that serves one short call on `channel`."""
    _, call = gateway_pb2_grpc.GatewayServiceStub(channel).Generate.with_call(
        gateway_pb2.GenerateRequest(params=params(1)), timeout=60.0
    )
    return dict(call.initial_metadata())["x-gateway-worker"]


@pytest.mark.parametrize("num_workers", [1, NUM_WORKERS])
def test_worker_ports_spread_one_channels_calls_over_every_worker(stack, tiny_model_dir, tmp_path, num_workers):
    """--worker-ports 0: each worker's own port serves that worker, and one channel with
    round_robin over all of them places its calls on the workers in turn."""
    ports_file = tmp_path / "worker-ports"
    args = ["--model", str(tiny_model_dir), "--preprocess", stack["preprocess"].address, "--inference",
            stack["inference"].address, "--workers", str(num_workers), "--worker-ports", "0",
            "--worker-ports-file", str(ports_file)]
    with running_service("gateway", args, tmp_path) as gateway:
        ports = read_worker_ports(ports_file)
        assert len(set(ports)) == num_workers and gateway.port not in ports
        for worker_id, port in enumerate(ports):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert served_by(channel) == str(worker_id)
        target = balanced_target("localhost", ports)
        with grpc.insecure_channel(target, options=balancing_options(target)) as channel:
            # round_robin places calls only on connections that are ready: until every worker's is
            workers = [served_by(channel)]
            while len(set(workers[-num_workers:])) < num_workers and len(workers) < MAX_CHANNELS:
                workers.append(served_by(channel))
            in_turn = [served_by(channel) for _ in range(4 * num_workers)]
        assert sorted(in_turn) == sorted(str(i) for i in range(num_workers) for _ in range(4)), workers + in_turn
        log_text = gateway.log_path.read_text()
        for worker_id, port in enumerate(ports):
            assert f"gateway worker {worker_id}'s own port: {port}" in log_text


def test_a_worker_port_another_program_holds_stops_the_gateway_in_one_line(stack, tiny_model_dir, tmp_path):
    """A socket without SO_REUSEPORT holds worker 1's port: that worker cannot bind it, says so
    in one log line (no traceback), and the gateway exits 1 without serving."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        base = held.getsockname()[1] - 1  # worker 1's port is the held one
        args = ["--model", str(tiny_model_dir), "--preprocess", stack["preprocess"].address, "--inference",
                stack["inference"].address, "--port", "0", "--workers", str(NUM_WORKERS), "--worker-ports", str(base)]
        gateway = ServiceProcess("gateway", "llmserve.gateway", args, port_file=tmp_path / "gateway.port",
                                 log_path=tmp_path / "gateway.log")
        gateway.start()
        try:
            with pytest.raises(ServiceStartError):
                gateway.wait_until_serving(EXIT_TIMEOUT_S)
            assert gateway.wait(EXIT_TIMEOUT_S) == 1
        finally:
            stop_service(gateway)
    log_text = (tmp_path / "gateway.log").read_text()
    assert f"cannot start: cannot bind 127.0.0.1:{base + 1}: the port is held by another program" in log_text
    assert re.search(r"gateway worker \d exited with code 1 during start-up", log_text)  # 1, unless 0's port was taken too
    assert "Traceback" not in log_text


def test_worker_ports_are_checked_at_start():
    parse = build_gateway_parser().parse_args
    base = ["--model", "m", "--preprocess", "p:1", "--inference", "i:1", "--workers", "4"]
    assert gateway_config_from_args(parse([*base, "--worker-ports", "6000"])).worker_base_port == 6000
    with pytest.raises(ValueError, match=r"worker_ports 50050..50053 hold the shared port 50051"):
        gateway_config_from_args(parse([*base, "--port", "50051", "--worker-ports", "50050"]))
    with pytest.raises(ValueError, match=r"base \+ workers - 1 <= 65535, got 65533"):
        gateway_config_from_args(parse([*base, "--worker-ports", "65533"]))
    with pytest.raises(ValueError, match="worker_ports_file needs worker_ports"):
        gateway_config_from_args(parse([*base, "--worker-ports-file", "f"]))


def test_a_dead_worker_takes_the_gateway_down(stack, tiny_model_dir, tmp_path):
    with start_second_gateway(stack, tiny_model_dir, tmp_path) as gateway:
        pids = worker_pids(gateway.log_path.read_text())
        os.kill(pids[1], signal.SIGKILL)
        assert gateway.wait(EXIT_TIMEOUT_S) == 1, gateway.log_tail()
        assert f"gateway worker 1 (pid {pids[1]}) exited with code -9; stopping the gateway" in gateway.log_tail()
        assert not is_running(pids[0])  # the other worker is gone too


def test_serve_passes_its_gateway_workers_to_the_gateway(tmp_path):
    config = serve_config_from_args(build_cli_parser().parse_args(["serve", "--gateway-workers", "3"]))
    hops = [ServiceProcess(name, f"llmserve.{name}", [], port_file=tmp_path / name) for name in ("preprocess", "inference")]
    for port, hop in enumerate(hops, start=1):
        hop.port = port
    preprocess, inference = hops
    command = gateway_argv(config, common_argv(config, tmp_path, None), preprocess, [inference])
    assert gateway_config_from_args(build_gateway_parser().parse_args(command)).num_workers == 3
    assert ServeConfig().gateway_workers == default_gateway_workers() >= 1


def test_workers_exit_when_the_gateway_is_killed(stack, tiny_model_dir, tmp_path):
    """SIGKILL leaves the parent no chance to stop its workers: they get SIGTERM from the kernel
    (PR_SET_PDEATHSIG) and drain and exit on their own."""
    with start_second_gateway(stack, tiny_model_dir, tmp_path) as gateway:
        pids = worker_pids(gateway.log_path.read_text())
        gateway.kill()
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while any(is_running(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(is_running(pid) for pid in pids.values()), gateway.log_tail()


def is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, exited but not reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
