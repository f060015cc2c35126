"""KV pull between two real inference servers on CPU, through /dev/shm (issue 22, second part).

Replica A (--kv-pull) computes a prompt; a request to replica B (--kv-pull) that names A in its
KvPullHint pulls A's blocks of the prompt and computes only the rest: its greedy tokens are
those of replica C (no --kv-pull) computing the whole prompt, and its usage says how many
tokens were pulled. A source that refuses (C), holds nothing, or died recomputes instead and the
request succeeds; a pin whose puller never releases it ends with its lease; every block is free
and every segment our servers made is unlinked at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path

import grpc
import pytest
from google.rpc import status_pb2

from llmserve.block_hash import HASH_VERSION, HashNamespace
from llmserve.inference.kv_pull_wire import identity_to_pb
from llmserve.tensor_transport import local_identity
from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.metrics_scrape import scrape
from tests.procs import free_port
from tests.test_torch_engine import make_prompt
from tests.transport_peers import segments_of, wait_until
from llmserve.tools.service_process import start_service, stop_service

BLOCK_SIZE = 16
PROMPT_TOKENS = 100  # (100 - 1) // 16 = 6 reusable blocks
NUM_NEW_TOKENS = 12
RPC_TIMEOUT_S = 300.0


def process_tree(pid: int) -> set[int]:
    """`pid` and its descendants (the engine-core process and the reaper of a server)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [pid]
    while todo:
        tree.add(todo[-1])
        todo += children.get(todo.pop(), [])
    return tree


def our_segments(pids: set[int]) -> list[str]:
    """What these processes left in /dev/shm: our segments and torch's CUDA IPC counters."""
    return segments_of(sorted(pids))


class Replica:
    def __init__(self, name: str, model_dir: Path, log_dir: Path, *flags: str):
        self.metrics_port = free_port()
        args = ["--model", str(model_dir), "--num-kv-blocks", "64", "--metrics-port", str(self.metrics_port), *flags]
        self.service = start_service(name, args, log_dir, module="llmserve.inference")
        self.pids = process_tree(self.service.process.pid)
        self.channel = grpc.insecure_channel(self.service.address)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)

    @property
    def address(self) -> str:
        return self.service.address

    def generate(self, name: str, prompt: list[int], source: Replica | None = None, num_blocks: int = 0,
                 block_hashes: list[int] = ()):
        """(tokens, usage) of a greedy request, pulling from `source` when given."""
        request = inference_pb2.GenerateTokensRequest(
            request_id=name, prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True),
        )
        if block_hashes:  # as the gateway sends them (from preprocess)
            request.block_hashes[:] = block_hashes
            request.block_size_tokens, request.block_hash_version = 16, HASH_VERSION
        if source is not None:
            request.kv_pull.CopyFrom(inference_pb2.KvPullHint(source_address=source.address, num_blocks=num_blocks))
        tokens, usage = [], None
        for response in self.stub.GenerateTokens(request, timeout=RPC_TIMEOUT_S):
            tokens += response.token_ids
            if response.finish_reason:
                usage = response.usage
        return tokens, usage

    def blocks_used(self) -> int:
        return self.stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=RPC_TIMEOUT_S).kv_blocks_used

    def stop(self) -> None:
        self.channel.close()
        if self.service.poll() is None:
            stop_service(self.service)


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("kv-pull-logs")
    started: dict[str, Replica] = {}
    try:
        for name, flags in (("a", ["--kv-pull"]), ("b", ["--kv-pull"]), ("c", [])):
            started[name] = Replica(f"inference-{name}", tiny_model_dir, log_dir, *flags)
        yield started
    finally:
        pids = set().union(*(replica.pids for replica in started.values()))
        for replica in started.values():
            replica.stop()
    assert wait_until(lambda: not our_segments(pids)), our_segments(pids)


def test_b_pulls_a_prefix_from_a_and_generates_what_recomputing_does(replicas):
    a, b, c = replicas["a"], replicas["b"], replicas["c"]
    prompt = make_prompt(PROMPT_TOKENS, seed=21)
    before = scrape(b.metrics_port)
    a.generate("on-a", prompt)
    pulled, usage = b.generate("on-b", prompt, source=a, num_blocks=6)
    recomputed, plain_usage = c.generate("on-c", prompt)
    assert pulled == recomputed
    assert (usage.cached_tokens, usage.pulled_tokens) == (6 * BLOCK_SIZE, 6 * BLOCK_SIZE)
    assert (plain_usage.cached_tokens, plain_usage.pulled_tokens) == (0, 0)
    after = scrape(b.metrics_port)
    assert after.delta(before, "llmserve_kv_pull_blocks_total", path="shm") == 6
    assert after.delta(before, "llmserve_kv_pull_bytes_total", path="shm") > 0
    assert after.value("llmserve_kv_pull_regions_opened_total", path="shm") == 1
    assert after.delta(before, "llmserve_kv_pull_copy_seconds_count") == 1
    assert after.value("llmserve_kv_pull_copy_device_seconds_count") == 0  # a GPU kernel's time: none on CPU
    again, usage = b.generate("on-b-again", prompt, source=a, num_blocks=6)
    assert again == recomputed and (usage.cached_tokens, usage.pulled_tokens) == (6 * BLOCK_SIZE, 0)  # B's own now
    assert b.blocks_used() == 0
    assert wait_until(lambda: a.blocks_used() == 0)  # the pin was released (after B's request started)


@pytest.mark.parametrize("case", ["refuses", "holds_nothing", "evicted_tail"])
def test_a_source_that_cannot_give_the_blocks_is_recomputed_from(replicas, case):
    a, b, c = replicas["a"], replicas["b"], replicas["c"]
    prompt = make_prompt(PROMPT_TOKENS, seed={"refuses": 22, "holds_nothing": 23, "evicted_tail": 24}[case])
    reference, _ = c.generate(f"{case}-reference", prompt)  # C caches it, but refuses to pin
    reason = {"refuses": "refused", "holds_nothing": "nothing_cached", "evicted_tail": "evicted"}[case]
    before = scrape(b.metrics_port)
    if case == "evicted_tail":
        a.generate(f"{case}-on-a", prompt[: 2 * BLOCK_SIZE + 1])  # A holds 2 of the 6 blocks
    source = c if case == "refuses" else a
    tokens, usage = b.generate(f"{case}-on-b", prompt, source=source, num_blocks=6)
    assert tokens == reference
    expected_pulled = 2 * BLOCK_SIZE if case == "evicted_tail" else 0
    assert (usage.cached_tokens, usage.pulled_tokens) == (expected_pulled, expected_pulled)
    assert scrape(b.metrics_port).delta(before, "llmserve_kv_pull_failures_total", reason=reason) == 1
    assert a.blocks_used() == b.blocks_used() == 0


def test_a_source_that_died_is_recomputed_from_and_leaves_no_segment(tiny_model_dir, tmp_path, replicas):
    b, c = replicas["b"], replicas["c"]
    doomed = Replica("inference-doomed", tiny_model_dir, tmp_path, "--kv-pull")
    try:
        first, prompt = make_prompt(PROMPT_TOKENS, seed=28), make_prompt(PROMPT_TOKENS, seed=25)
        doomed.generate("on-doomed-first", first)
        doomed.generate("on-doomed", prompt)
        (pool,) = our_segments(doomed.pids)
        assert b.generate("pulled-before-death", first, source=doomed, num_blocks=6)[1].pulled_tokens == 96
        assert mapped_by(b, pool)  # B's engine core maps the doomed pool
        doomed.service.send_signal(signal.SIGKILL)
        doomed.service.process.wait()
        tokens, usage = b.generate("after-death", prompt, source=doomed, num_blocks=6)
        assert tokens == c.generate("after-death-reference", prompt)[0]
        assert usage.pulled_tokens == 0
        assert wait_until(lambda: not our_segments(doomed.pids)), our_segments(doomed.pids)  # its reaper's work
        assert not mapped_by(b, pool)  # and B let go of its memory
    finally:
        doomed.stop()


def mapped_by(replica: Replica, segment: str) -> bool:
    """Whether a process of `replica` maps `segment` (even unlinked: "(deleted)")."""
    for pid in replica.pids:
        try:
            if f"/dev/shm/{segment}" in Path(f"/proc/{pid}/maps").read_text():
                return True
        except FileNotFoundError:
            continue
    return False


def test_pins_are_released_by_their_lease_and_bad_pins_are_refused(replicas):
    a, c = replicas["a"], replicas["c"]
    prompt = make_prompt(PROMPT_TOKENS, seed=26)
    a.generate("to-pin", prompt)
    puller = identity_to_pb(local_identity("cpu"))
    pin = a.stub.PinKvBlocks(
        inference_pb2.PinKvBlocksRequest(prompt_token_ids=prompt, puller=puller, lease_ms=50), timeout=RPC_TIMEOUT_S
    )
    assert len(pin.block_ids) == 6 and pin.region.path == inference_pb2.TRANSPORT_PATH_SHM
    assert wait_until(lambda: a.blocks_used() == 0)  # nobody released it: the lease did
    released = a.stub.ReleaseKvBlocks(inference_pb2.ReleaseKvBlocksRequest(pin_id=pin.pin_id), timeout=RPC_TIMEOUT_S)
    assert not released.was_pinned
    with pytest.raises(grpc.RpcError) as refused:
        c.stub.PinKvBlocks(inference_pb2.PinKvBlocksRequest(prompt_token_ids=prompt, puller=puller))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--kv-pull" in refused.value.details()
    for request, field in (
        (inference_pb2.PinKvBlocksRequest(puller=puller), "prompt_token_ids"),
        (inference_pb2.PinKvBlocksRequest(prompt_token_ids=prompt, puller=puller, lease_ms=60_001), "lease_ms"),
        (inference_pb2.PinKvBlocksRequest(prompt_token_ids=prompt), "puller"),
    ):
        with pytest.raises(grpc.RpcError) as invalid:
            a.stub.PinKvBlocks(request)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT and invalid.value.details().startswith(field)


def test_a_pin_looks_blocks_up_by_the_hashes_it_is_sent(replicas, tiny_model_dir):
    """The puller forwards its request's block hashes so the source need not hash the prompt:
    the right ones find every cached block; another salt's find none (so they were used, not
    recomputed); hashes unlike this replica's are refused naming the field."""
    a = replicas["a"]
    prompt = make_prompt(PROMPT_TOKENS, seed=29)
    a.generate("to-pin-by-hash", prompt)
    puller = identity_to_pb(local_identity("cpu"))
    namespace = HashNamespace.of_model_dir(tiny_model_dir, 16)

    def pin(hashes: list[int], **fields) -> inference_pb2.PinKvBlocksResponse:
        fields = {"block_size_tokens": 16, "block_hash_version": HASH_VERSION, **fields}
        return a.stub.PinKvBlocks(inference_pb2.PinKvBlocksRequest(
            prompt_token_ids=prompt, puller=puller, block_hashes=hashes, **fields), timeout=RPC_TIMEOUT_S)

    for hashes, num_pinned in ((namespace.block_hashes(prompt), 6), (namespace.block_hashes(prompt, "another"), 0)):
        pinned = pin(hashes)
        assert len(pinned.block_ids) == num_pinned
        if pinned.pin_id:
            a.stub.ReleaseKvBlocks(inference_pb2.ReleaseKvBlocksRequest(pin_id=pinned.pin_id), timeout=RPC_TIMEOUT_S)
    hashes = namespace.block_hashes(prompt)
    for fields, field in (
        ({"block_size_tokens": 32}, "block_size_tokens"),
        ({"block_hash_version": HASH_VERSION + 1}, "block_hash_version"),
        ({"hashes": hashes + [1]}, "block_hashes"),  # 7 hashes for 6 full blocks
    ):
        with pytest.raises(grpc.RpcError) as invalid:
            pin(**{"hashes": hashes, **fields})
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT and invalid.value.details().startswith(field)
    assert wait_until(lambda: a.blocks_used() == 0)


def test_the_puller_sends_its_request_s_hashes_with_the_pin(replicas, tiny_model_dir):
    """A request that came with block hashes pulls by them: right ones pull the whole prefix
    (and the output is the recomputed one); another salt's pull nothing, since the source looked
    the blocks up by the hashes B forwarded."""
    a, b, c = replicas["a"], replicas["b"], replicas["c"]
    namespace = HashNamespace.of_model_dir(tiny_model_dir, 16)
    for seed, salt, num_pulled in ((30, "", 96), (31, "another", 0)):
        prompt = make_prompt(PROMPT_TOKENS, seed=seed)
        a.generate(f"held-{seed}", prompt)
        tokens, usage = b.generate(f"pulled-{seed}", prompt, source=a, num_blocks=6,
                                   block_hashes=namespace.block_hashes(prompt, salt))
        assert usage.pulled_tokens == num_pulled
        assert tokens == c.generate(f"reference-{seed}", prompt)[0]


def test_multiplex_pulls_and_an_abort_while_pulling_ends_the_request_cancelled(replicas):
    """On the gateway's stream: a request pulls as on GenerateTokens; one whose source never
    answers (a socket that listens and says nothing) is aborted while it waits to pull, and
    ends CANCELLED without reaching the engine."""
    a, b = replicas["a"], replicas["b"]
    prompt = make_prompt(PROMPT_TOKENS, seed=27)
    a.generate("for-mux", prompt)
    silent = socket.create_server(("127.0.0.1", 0))
    sampling = common_pb2.SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def generate(name: str, source_address: str) -> inference_pb2.MultiplexRequest:
        request = inference_pb2.GenerateTokensRequest(request_id=name, prompt_token_ids=prompt, sampling=sampling)
        request.kv_pull.CopyFrom(inference_pb2.KvPullHint(source_address=source_address, num_blocks=6))
        return inference_pb2.MultiplexRequest(generate=request)

    done = threading.Event()

    def commands():
        yield generate("mux-pull", a.address)
        yield generate("mux-stuck", f"127.0.0.1:{silent.getsockname()[1]}")
        yield inference_pb2.MultiplexRequest(abort=inference_pb2.AbortRequest(request_id="mux-stuck"))
        done.wait(RPC_TIMEOUT_S)

    outputs: dict[str, list[inference_pb2.RequestOutput]] = {}
    try:
        for response in b.stub.Multiplex(commands(), timeout=RPC_TIMEOUT_S):
            for output in response.outputs:
                outputs.setdefault(output.request_id, []).append(output)
            finished = {rid for rid, outs in outputs.items() if outs[-1].error_status or outs[-1].output.finish_reason}
            if finished == {"mux-pull", "mux-stuck"}:
                done.set()
    finally:
        done.set()
        silent.close()
    (stuck,) = outputs["mux-stuck"]
    assert status_pb2.Status.FromString(stuck.error_status).code == grpc.StatusCode.CANCELLED.value[0]
    last = outputs["mux-pull"][-1].output
    assert (last.usage.cached_tokens, last.usage.pulled_tokens) == (6 * BLOCK_SIZE, 6 * BLOCK_SIZE)
    assert [t for o in outputs["mux-pull"] for t in o.output.token_ids] == replicas["c"].generate("mux-ref", prompt)[0]
    assert b.blocks_used() == 0
