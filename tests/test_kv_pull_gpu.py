"""KV pull by CUDA IPC between two inference servers on one GPU (issue 22; marked gpu, run on
the H200): replica B pulls a prefix from replica A's pool mapped by CUDA IPC, its greedy tokens
are those of replica C computing the whole prompt, the source's pool is opened once for two
pulls of two prompts, and the blocks and segments are released at the end.

    python -m pytest -q -m gpu tests/test_kv_pull_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.metrics_scrape import scrape
from tests.test_kv_pull_service import BLOCK_SIZE, PROMPT_TOKENS, Replica, our_segments
from tests.test_torch_engine import make_prompt
from tests.transport_peers import wait_until

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_ipc_pull_between_two_engine_processes_on_one_gpu(tiny_model_dir, tmp_path):
    cuda = ["--device", "cuda", "--dtype", "float32"]
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
            assert pulled == c.generate(f"on-c-{seed}", prompt)[0]
            assert (usage.cached_tokens, usage.pulled_tokens) == (6 * BLOCK_SIZE, 6 * BLOCK_SIZE)
            assert scrape(b.metrics_port).delta(before, "llmserve_kv_pull_blocks_total", path="cuda_ipc") == 6
        assert scrape(b.metrics_port).value("llmserve_kv_pull_regions_opened_total", path="cuda_ipc") == 1
        assert a.blocks_used() == b.blocks_used() == 0
    finally:
        pids = set().union(*(replica.pids for replica in started)) if started else set()
        for replica in started:
            replica.stop()
    assert wait_until(lambda: not our_segments(pids)), our_segments(pids)
