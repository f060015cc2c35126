"""Start-up compiles every Triton kernel variant serving launches (issue 18's cold first burst):
on a fresh host each new variant is a ~1 s compile inside some request.

Under Triton's interpreter (CPU), the variants are computed as Triton's launcher keys them
(tests/kernel_variants.py). The CUDA-graph captures, which compile their sizes' variants on
a GPU, do not run here, so the rest of start-up (the prefill warm-up and the backend's
warm_up) must cover everything the served steps launch: decode and prefill graph steps,
piecewise steps, and eager attention for every batch size beside a prompt chunk.
"""

from __future__ import annotations

from tests.triton_cpu import HAS_CUDA, HAS_TRITON, KERNEL_DEVICE  # noqa: I001  (before any kernel import)

import pytest

from tests.test_torch_engine import drain, greedy, make_engine, make_prompt, request

pytestmark = pytest.mark.skipif(not HAS_TRITON or HAS_CUDA, reason="keys launches under Triton's interpreter (CPU)")

# Split counts follow the batch and the SM count: with 12 SMs and the tiny model's 2 KV heads,
# batches of 1 to 12 decodes ask for every count from 16 down to 1 (on an H200's 132 SMs the
# same happens over 1 to ~130 decodes, too many steps for the interpreter).
SMALL_GPU_SMS = 12


def test_serving_launches_only_kernel_variants_start_up_compiled(tiny_model_dirs, monkeypatch):
    """The fp8 cache (its own kernel configurations) and the piecewise graphs (their eager
    attention between pieces) on, async scheduling: every path a step can take."""
    from llmserve.inference.models import triton_attention
    from tests.kernel_variants import KernelVariants

    monkeypatch.setattr(triton_attention, "CPU_NUM_SMS", SMALL_GPU_SMS)
    variants = KernelVariants()
    with variants:
        engine = make_engine(tiny_model_dirs["llama"], device=KERNEL_DEVICE, attention_backend="triton",
                             async_scheduling=True, piecewise_graphs=True, kv_cache_dtype="fp8",
                             max_batched_tokens=32, max_num_seqs=12, num_kv_blocks=96)
        at_start = variants.take()
        serve_growing_batches(engine)
        served = variants.take()

    assert served, "no launch was recorded: the recorder does not see the kernels"
    assert served <= at_start, "\n".join(f"compiled while serving: {v[0]} {v[1]}" for v in sorted(served - at_start))
    assert engine.runner.piecewise_graphs.num_steps > 0 and engine.runner.decode_graphs.num_steps > 0
    assert engine.load().kv_blocks_used == 0


def serve_growing_batches(engine) -> None:
    """Arrivals of 1, 1, 2, 4 and 4 requests two steps apart: each joins the decoding batch in a
    mixed step (a wave's prompts chunked over several), then decode batches of 1, 2, 4, 8 and 12,
    and smaller again as they finish: every split count from 16 to 1 on SMALL_GPU_SMS."""
    for wave, count in enumerate((1, 1, 2, 4, 4)):
        for i in range(count):
            engine.add_request(request(f"w{wave}-{i}", make_prompt(5 + 3 * i, seed=10 * wave + i), greedy(10)))
        for _ in range(2):
            engine.step()
    drain(engine)
