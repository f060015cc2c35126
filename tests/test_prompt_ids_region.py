"""Long prompts' ids in preprocess's shared-memory ring (llmserve.prompt_ids_region; issue 22):
the ring's own rules, then the real stack relaying a reference from preprocess to inference."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from llmserve.errors import Unavailable
from llmserve.gateway.preprocess_client import PreparedPrompt
from llmserve.prompt_ids_region import (
    BadReference, EntryGone, PromptIdsReader, PromptIdsRing, RegionIds, RingOnDemand, SharedMemoryScope, local_scope,
)
from llmserve.tensor_transport.identity import SHM_DIR
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.metrics_scrape import scrape
from tests.procs import stack_fixture
from tests.test_gateway_metrics import metrics_url

LEASE_S = 10.0
REGION_FROM = 32  # the stack's gateway puts prompts of 32+ tokens in the ring
LONG_PROMPT = [(7 * i + 5) % 200 + 3 for i in range(40)]  # 40 ids below the tiny model's vocabulary
SHORT_PROMPT = [5, 6, 7, 8]


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ring(clock):
    ring = PromptIdsRing(1024, LEASE_S, clock=clock)
    yield ring
    ring.close()


def ids(start: int, count: int) -> np.ndarray:
    return np.arange(start, start + count, dtype="<u4")


def packed(start: int, count: int) -> bytes:
    return ids(start, count).tobytes()


def test_an_entry_reads_back_whole_and_by_its_tail(ring):
    prompt = ids(100, 50)
    ref = ring.put(prompt.tobytes())
    reader = PromptIdsReader()
    assert reader.read(ref).tolist() == prompt.tolist()
    assert reader.last(ref, 5) == prompt[-5:].tolist()
    assert reader.last(ref, 500) == prompt.tolist()


def test_a_ring_full_of_young_entries_refuses_and_reuses_the_oldest_after_the_lease(ring, clock):
    reader = PromptIdsReader()
    # 1,024 bytes: a 16-byte header, then entries of 16 + 4 x 40 = 176 bytes: five fit.
    refs = [ring.put(packed(i * 100, 40)) for i in range(5)]
    assert all(ref is not None for ref in refs)
    assert ring.put(packed(900, 40)) is None  # every entry younger than the lease
    clock.now_s = LEASE_S - 0.001
    assert ring.put(packed(900, 40)) is None
    clock.now_s = LEASE_S
    newest = ring.put(packed(900, 40))
    assert newest is not None and newest.offset_bytes == refs[0].offset_bytes  # wrapped onto the oldest
    with pytest.raises(EntryGone):
        reader.read(refs[0])  # its reader is refused, not handed another prompt's ids
    assert reader.read(newest).tolist() == ids(900, 40).tolist()
    assert [reader.read(ref)[0] for ref in refs[1:]] == [100, 200, 300, 400]  # the others untouched


def test_an_entry_larger_than_the_ring_is_refused(ring):
    assert ring.put(packed(0, 1024)) is None


def test_a_reference_that_no_ring_holds_is_refused_precisely(ring):
    reader = PromptIdsReader()
    ref = ring.put(packed(1, 8))
    cases = {
        "../../etc/passwd": "is not a prompt-ids ring's name",
        "llmserve-ids-1-000000000000": "cannot be opened here",
    }
    for name, problem in cases.items():
        with pytest.raises(BadReference, match=re.escape(problem)):
            reader.read(RegionIds(name, ref.offset_bytes, ref.num_ids, ref.key, LEASE_S))
    for offset, problem in ((20, "is not an entry's start"), (8, "is not an entry's start"), (1016, "ends past")):
        with pytest.raises(BadReference, match=re.escape(problem)):
            reader.read(RegionIds(ref.region_name, offset, ref.num_ids, ref.key, LEASE_S))
    with pytest.raises(BadReference, match="at least 1"):
        reader.read(RegionIds(ref.region_name, ref.offset_bytes, 0, ref.key, LEASE_S))
    with pytest.raises(EntryGone):
        reader.read(RegionIds(ref.region_name, ref.offset_bytes, ref.num_ids, ref.key ^ 1, LEASE_S))
    with pytest.raises(EntryGone):
        reader.read(RegionIds(ref.region_name, ref.offset_bytes, ref.num_ids + 1, ref.key, LEASE_S))


def test_a_segment_that_is_not_a_ring_is_refused(tmp_path):
    name = f"llmserve-ids-{os.getpid()}-{'ab' * 6}"
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as file:
        file.write(b"\0" * 4096)
    try:
        with pytest.raises(BadReference, match="is not a prompt-ids ring"):
            PromptIdsReader().read(RegionIds(name, 16, 1, 1, LEASE_S))
    finally:
        os.unlink(path)


def test_closing_unlinks_the_segment_and_a_mapped_reader_still_reads(clock):
    ring = PromptIdsRing(4096, LEASE_S, clock=clock)
    ref = ring.put(packed(3, 10))
    reader = PromptIdsReader()
    assert reader.read(ref).tolist() == ids(3, 10).tolist()  # mapped now
    ring.close()
    assert not os.path.exists(os.path.join(SHM_DIR, ring.name))
    assert reader.read(ref).tolist() == ids(3, 10).tolist()
    assert ring.put(packed(3, 10)) is None
    with pytest.raises(BadReference, match="cannot be opened here"):
        PromptIdsReader().read(ref)


def test_a_ring_whose_owner_is_killed_is_unlinked_by_its_reaper():
    owner = subprocess.run(
        [sys.executable, "-c", "import os, signal; from llmserve.prompt_ids_region import PromptIdsRing; "
         "ring = PromptIdsRing(4096, 1.0); print(ring.name, flush=True); os.kill(os.getpid(), signal.SIGKILL)"],
        capture_output=True, text=True, timeout=60,
    )
    assert owner.returncode == -signal.SIGKILL, owner.stderr
    path = os.path.join(SHM_DIR, owner.stdout.strip())
    deadline = time.monotonic() + 30.0
    while os.path.exists(path):  # the reaper unlinks once its owner is gone
        assert time.monotonic() < deadline, f"{path} outlived its owner"
        time.sleep(0.05)


def test_a_ring_on_demand_is_made_at_its_first_entry_and_never_with_size_0():
    assert RingOnDemand(0, LEASE_S).put(packed(1, 4)) is None
    on_demand = RingOnDemand(4096, LEASE_S)
    before = set(os.listdir(SHM_DIR))
    ref = on_demand.put(packed(1, 4))
    made = set(os.listdir(SHM_DIR)) - before
    on_demand.close()
    assert made == {ref.region_name}
    assert not os.path.exists(os.path.join(SHM_DIR, ref.region_name))


def test_a_gateway_s_prompt_in_the_ring_reads_it_relays_it_while_young_and_fails_unavailable_once_gone(ring, clock):
    prompt_ids = ids(10, 12)
    ref = ring.put(prompt_ids.tobytes())
    prepared = PreparedPrompt(b"", [], 16, 1, "", 4, 0, ids_in_region=ref, answered_s=time.monotonic())
    assert prepared.num_tokens == 12 and prepared.last_token_ids(5) == prompt_ids[-5:].tolist()
    assert prepared.inline_token_id_bytes() == prompt_ids.tobytes()
    assert prepared.can_relay_region()
    answered_long_ago = dataclasses.replace(prepared, answered_s=time.monotonic() - ref.valid_for_s / 2)
    assert not answered_long_ago.can_relay_region()  # sent as bytes from here on
    clock.now_s = LEASE_S
    ring.put(packed(900, 240))  # reuses the entry, its lease over
    for read in (lambda: prepared.last_token_ids(5), prepared.inline_token_id_bytes):
        with pytest.raises(Unavailable, match="no longer in preprocess's ring"):
            read()


def test_scopes_share_only_when_both_are_known_and_equal():
    here = local_scope()
    assert here.shares_with(SharedMemoryScope(here.boot_id, here.shm_device))
    assert not here.shares_with(SharedMemoryScope(here.boot_id, here.shm_device + 1))
    assert not here.shares_with(SharedMemoryScope("another boot", here.shm_device))
    assert not SharedMemoryScope("", 0).shares_with(SharedMemoryScope("", 0))
    assert not here.shares_with(None)


# --- the stack: preprocess, inference (torch) and a gateway on this host ---------------------------

stack = stack_fixture(
    gateway_args=["--prompt-ids-region-from", str(REGION_FROM), "--local-preprocess-max-bytes", "0"],
    service_args=["--metrics-port", "0"],
)


def greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def through_gateway(stack, token_ids: list[int]) -> gateway_pb2.GenerateResponse:
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        params = gateway_pb2.GenerateParams(
            prompt_token_ids=common_pb2.TokenIdsInput(token_ids=token_ids), sampling=greedy(8), return_token_ids=True
        )
        return gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
            gateway_pb2.GenerateRequest(params=params), timeout=60.0
        )


def straight_to_inference(stack, token_ids: list[int]) -> list[int]:
    with grpc.insecure_channel(stack["inference"].address) as channel:
        request = inference_pb2.GenerateTokensRequest(request_id="direct", prompt_token_ids=token_ids, sampling=greedy(8))
        responses = inference_pb2_grpc.InferenceServiceStub(channel).GenerateTokens(request, timeout=60.0)
        return [token for response in responses for token in response.token_ids]


def test_a_long_prompt_s_ids_travel_in_preprocess_s_ring_and_generate_what_the_ids_do(stack):
    preprocess_url, inference_url = metrics_url(stack["preprocess"]), metrics_url(stack["inference"])
    preprocess_before, inference_before = scrape(preprocess_url), scrape(inference_url)
    long_answer = through_gateway(stack, LONG_PROMPT)
    short_answer = through_gateway(stack, SHORT_PROMPT)
    preprocess_after, inference_after = scrape(preprocess_url), scrape(inference_url)

    written = "llmserve_preprocess_prompt_ids_in_region_total"
    assert preprocess_after.delta(preprocess_before, written, outcome="written") == 1  # the long one only
    received = "llmserve_inference_prompts_received_total"
    assert inference_after.delta(inference_before, received, encoding="region") == 1
    assert inference_after.delta(inference_before, received, encoding="token_id_bytes") == 1  # the short one
    assert long_answer.result.usage.prompt_tokens == len(LONG_PROMPT)
    assert list(long_answer.token_ids) == straight_to_inference(stack, LONG_PROMPT)
    assert list(short_answer.token_ids) == straight_to_inference(stack, SHORT_PROMPT)


def test_the_ring_is_made_in_preprocess_s_process_and_unlinked_when_it_stops(stack):
    through_gateway(stack, LONG_PROMPT)
    pid = stack["preprocess"].process.pid
    rings = [name for name in os.listdir(SHM_DIR) if name.startswith(f"llmserve-ids-{pid}-")]
    assert len(rings) == 1, os.listdir(SHM_DIR)
    assert rings[0] in stack["preprocess"].log_path.read_text()  # its log says where it is
    stack["preprocess"].process.terminate()
    stack["preprocess"].process.wait(timeout=30)
    assert not os.path.exists(os.path.join(SHM_DIR, rings[0]))
