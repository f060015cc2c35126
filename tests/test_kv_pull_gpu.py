"""KV pull by CUDA IPC between two inference servers on one GPU (issue 22; marked gpu, run on
the H200): replica B pulls a prefix from replica A's pool mapped by CUDA IPC; its greedy tokens
are those of replica C serving the same prompt from its own cache of the prefix (the same
kernels on the same KV, in the served dtype: bitwise the same, where a full recompute in
bfloat16 may differ in the last bits); the source's pool is opened once for two pulls of two
prompts, and the blocks and segments are released at the end.

    python -m pytest -q -m gpu tests/test_kv_pull_gpu.py
    PYTHONPATH=. python -m pytest -q -p no:cacheprovider --noconftest tests/test_kv_pull_gpu.py   # the H200 image

Its model is built here (no conftest fixture), so it also runs with --noconftest.
"""

from __future__ import annotations

import pytest
import torch

from llmserve.tools.tiny_model import build_tiny_model

from tests.metrics_scrape import scrape
from tests.test_kv_pull_service import BLOCK_SIZE, PROMPT_TOKENS, Replica, our_segments
from tests.test_torch_engine import make_prompt
from tests.transport_peers import wait_until

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_ipc_pull_between_two_engine_processes_on_one_gpu(tmp_path):
    tiny_model_dir = build_tiny_model(tmp_path / "tiny-llama", "llama")
    cuda = ["--device", "cuda"]
    started = []
    try:
        for name, flags in (("a", ["--kv-pull"]), ("b", ["--kv-pull"]), ("c", [])):
            started.append(Replica(f"inference-{name}", tiny_model_dir, tmp_path, *cuda, *flags))
        a, b, c = started
        for seed in (31, 32):
            prompt = make_prompt(PROMPT_TOKENS, seed=seed)
            a.generate(f"on-a-{seed}", prompt)
            before = scrape(b.metrics_port)
            pulled, usage = b.generate(f"on-b-{seed}", prompt, source=a, num_blocks=6)
            c.generate(f"c-computes-{seed}", prompt)
            from_own_cache, c_usage = c.generate(f"c-from-cache-{seed}", prompt)
            assert c_usage.cached_tokens == 6 * BLOCK_SIZE
            assert pulled == from_own_cache
            assert (usage.cached_tokens, usage.pulled_tokens) == (6 * BLOCK_SIZE, 6 * BLOCK_SIZE)
            after = scrape(b.metrics_port)
            assert after.delta(before, "llmserve_kv_pull_blocks_total", path="cuda_ipc") == 6
            # the copy kernel timed on the device, once per pull, and within the pull's synchronized copy
            assert after.delta(before, "llmserve_kv_pull_copy_device_seconds_count") == 1
            assert 0 < after.delta(before, "llmserve_kv_pull_copy_device_seconds_sum") \
                <= after.delta(before, "llmserve_kv_pull_copy_seconds_sum")
        assert scrape(b.metrics_port).value("llmserve_kv_pull_regions_opened_total", path="cuda_ipc") == 1
        assert a.blocks_used() == b.blocks_used() == 0
    finally:
        pids = set().union(*(replica.pids for replica in started)) if started else set()
        for replica in started:
            replica.stop()
    assert wait_until(lambda: not our_segments(pids)), our_segments(pids)
