"""GPU benchmark of the torch engine (H200-class): one command per scenario, a table, JSON.

    python bench/bench_gpu.py --scenario all --out-dir bench/results
    python bench/bench_gpu.py --scenario decode        # or ttft, throughput, vs-hf, correctness, kernels
    python bench/bench_gpu.py --scenario fp8           # float8 KV: decode-kernel sweep, then 8B throughput
    python bench/bench_gpu.py --scenario quant         # int8 / fp8 weights: drift, decode, fp8 throughput

Models: random weights with the real shapes of Llama-3.2-1B and Llama-3.1-8B, configs built in
code from transformers' LlamaConfig, weights initialized directly on the GPU in bfloat16 by a
transformers model. Nothing is downloaded and no checkpoint is written: the engine is built on
that model's state dict (`TorchEngineCore(config, weights=...)`, see `engine_on`).

Every run first measures its own ceilings (`baselines`): device copy bandwidth (bytes read +
written by a 4 GiB device-to-device copy) and a dense 8192^3 bfloat16 GEMM rate.

Scenarios (target in brackets):
  decode       batch-1 decode step at ~512 tokens of context, 1B and 8B: the CUDA-graph replay
               (GPU time) and the engine step (wall clock, host included), against
               weight_bytes / copy_bandwidth [<= 1.5x for 1B, <= 1.15x for 8B]; plus the eager
               step and the top kernels of one eager step (torch.profiler).
  ttft         1024-token prompt, batch 1, 8B: engine step that computes it and samples the first
               token, against 2 * params * 1024 / gemm_rate [<= 1.5x].
  throughput   8B, --throughput-requests requests of 1000 prompt / 1000 output tokens, greedy,
               ignore_eos: output tokens/s over the whole run [>= 12,000], with a bfloat16 and
               with a float8 KV cache; GPU-busy time (CUDA events around each step's work) vs
               wall time, where the host time goes (schedule / launch / sampler / rest), and
               the top kernels of a few steps mid-run.
  vs-hf        1B, 512-token prompts, 128 output tokens: transformers `generate` vs our engine,
               batch 1 and 64 concurrent [>= 50x and >= 30x output tokens/s].
  correctness  1B: our bfloat16 logits (engine run, CUDA graphs on, a prefix-cache hit) vs a
               float32 transformers forward on the same (bf16-representable) weights:
               ||ours - ref|| / ||ref|| [<= 2e-2], and greedy agreement on every row whose
               reference top-2 margin exceeds twice that row's max error [100%]; transformers'
               own bfloat16 forward on the same tokens is scored too, as the yardstick; and
               the same with a float8 KV cache.
  kernels      prefill attention (Triton paged kernel vs torch SDPA) at 1024 and 4096 tokens;
               decode attention bandwidth at batch 256 x 2048 context (8B shapes).
  linears      one linear layer at the 1B/8B shapes, M = 1..4096 tokens: bf16 cuBLAS (also with
               a float32 output), int8 W8A16 and fp8 W8A8: weight GB/s, TFLOP/s, error.
  fp8          (not part of "all") the all-fp8 configuration: the decode-attention config sweep,
               then the 8B throughput run with fp8 weights (W8A8) and an fp8 KV cache
               [>= 17,700]; --throughput-max-seqs 512 fits in memory with fp8 KV.
  quant        (not part of "all") weight quantization, EngineConfig.quantization: for int8
               (W8A16) and fp8 (W8A8) the drift of the 1B against the same fp32 reference as
               `correctness` (relative logit error, greedy agreement where the margin exceeds
               the error), the batch-1 decode step of 1B and 8B against the bf16 floor and
               against the quantized weights' own floor; then `linears`.

Before `kernels` and `throughput`, the decode-attention launch configs are swept at batch 256 x 2048 on a bf16 and an fp8 cache, and the fastest
becomes the process's default for each (decode_config_sweep).

Results go to --out-dir/gpu-<time>.json (rewritten after each scenario, so a run that is cut
short keeps what it measured). `--deadline-s` stops the throughput run early (reported as
partial) so the whole command fits a time limit.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.sampler import Sampler
from llmserve.inference.engine.step_stats import HOST_PARTS, StepStatsLog
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.inference.engine.types import EngineRequest
from llmserve.model_files import ModelFiles
from llmserve.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("baselines", "correctness", "decode", "vs-hf", "kernels", "linears", "ttft", "throughput", "fp8", "quant")
QUANTIZATIONS = ("int8", "fp8")
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "factor": 32.0},
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "factor": 8.0},
    ),
    # CPU smoke test of this script only.
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True, rope_theta=10000.0,
    ),
}
MAX_MODEL_LEN = 4096
BLOCK_SIZE = 16


def scenario_list(text: str) -> str:
    names = text.split(",")
    unknown = [n for n in names if n not in ("all", *SCENARIOS)]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown}; choose from all, {', '.join(SCENARIOS)}")
    return text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="all", type=scenario_list,
                        help=f"all, or a comma-separated list of: {', '.join(SCENARIOS)} (fp8 and quant run alone)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small-model", default="llama-3.2-1b", choices=tuple(SHAPES))
    parser.add_argument("--large-model", default="llama-3.1-8b", choices=tuple(SHAPES))
    parser.add_argument("--throughput-requests", type=int, default=1000)
    parser.add_argument("--throughput-prompt-tokens", type=int, default=1000)
    parser.add_argument("--throughput-output-tokens", type=int, default=1000)
    parser.add_argument("--throughput-max-seqs", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--hf-output-tokens", type=int, default=128)
    parser.add_argument("--hf-prompt-tokens", type=int, default=512)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--ttft-prompt-tokens", type=int, default=1024)
    parser.add_argument("--throughput-max-s", type=float, default=None, help="cap on each throughput run")
    parser.add_argument("--skip-fp8", action="store_true", help="skip the float8 KV-cache runs")
    parser.add_argument("--deadline-s", type=float, default=None, help="stop the throughput run this long after start")
    return parser.parse_args()


# --- timing -------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_gpu_ms(fn, device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() measured with CUDA events (perf_counter + sync on CPU)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def top_kernels(fn, device: torch.device, num_rows: int = 12) -> list[dict]:
    """The CUDA kernels of fn() by total device time (torch.profiler), one row per kernel name."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    try:
        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
    except Exception as error:  # the work must still run
        fn()
        return [{"error": repr(error)[:200]}]
    try:
        fn()
        synchronize(device)
    finally:
        prof.__exit__(None, None, None)
    totals: dict[str, list[float]] = {}
    try:
        for event in prof.events():
            if event.device_type.name != "CUDA":
                continue
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            entry[1] += 1
    except Exception as error:
        return [{"error": repr(error)[:200]}]
    grand_total = sum(t for t, _ in totals.values()) or 1.0
    rows = sorted(totals.items(), key=lambda item: -item[1][0])[:num_rows]
    return [
        {"kernel": name[:90], "calls": calls, "total_us": round(us, 1), "share": round(us / grand_total, 3)}
        for name, (us, calls) in rows
    ]


# --- models -------------------------------------------------------------------------------------


def hf_config(shape: str):
    from transformers import LlamaConfig

    config = LlamaConfig(
        **SHAPES[shape], max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    config.architectures = ["LlamaForCausalLM"]
    config._attn_implementation = "sdpa"
    return config


def build_hf_model(shape: str, device: torch.device, dtype=torch.bfloat16):
    """A transformers Llama with random weights (transformers' own init), built on `device`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_config(shape))
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def model_dir_for(shape: str, root: Path) -> Path:
    """config.json (and an empty tokenizer.json, which ModelFiles requires) for the engine."""
    path = root / shape
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(shape).to_dict()))
    (path / "tokenizer.json").write_text("{}")
    return path


class LogitsRecordingSampler(Sampler):
    """Our Sampler, which also keeps a host copy of every logits row it samples from while
    `rows` is a dict (request id -> rows in order); the correctness scenario scores them."""

    def __init__(self, eos_token_ids: tuple[int, ...]):
        super().__init__(eos_token_ids)
        self.rows: dict[str, list[torch.Tensor]] | None = None

    def launch(self, logits, seqs):
        if self.rows is not None:
            for seq, row in zip(seqs, logits):
                self.rows.setdefault(seq.request_id, []).append(row.float().cpu())
        return super().launch(logits, seqs)


def engine_on(hf_model, model_dir: Path, device: str, **overrides) -> TorchEngineCore:
    """Our engine serving `hf_model`'s weights (HF names: the random weights never touch the disk)."""
    settings = dict(
        model_path=model_dir, model_name=model_dir.name, device=device, dtype="bfloat16",
        max_context_tokens=MAX_MODEL_LEN, enable_prefix_caching=True,
    )
    settings.update(overrides)
    # If graph capture or the kernels fail on this machine, still measure what does work
    # (reported as engine.fallback).
    attempts = [({}, None), ({"enforce_eager": True}, "eager"), ({"attention_backend": "portable"}, "portable-attention")]
    for extra, fallback in attempts:
        start = time.perf_counter()
        try:
            sampler = LogitsRecordingSampler(ModelFiles.load(model_dir, model_dir.name).eos_token_ids)
            engine = TorchEngineCore(EngineConfig(**(settings | extra)), weights=hf_model.state_dict().items(),
                                     sampler=sampler)
        except Exception:
            import traceback

            traceback.print_exc()
            free_memory()
            continue
        engine.startup_s = round(time.perf_counter() - start, 2)  # weights copy + KV alloc + graph capture
        engine.fallback = fallback
        return engine
    raise RuntimeError("no engine configuration could start")


def weight_read_bytes(model) -> int:
    """Bytes a decode step must read: every matrix, scale and norm (quantized layers keep theirs
    in buffers); the embedding table only when it is also the lm_head (tied) - an untied
    embedding is read one row per token."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}  # tied: once
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if not model.config.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    return total


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (num, length), generator=generator).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_all(engine: TorchEngineCore, requests: list[EngineRequest], deadline: float | None = None,
            profile_at_step: int | None = None) -> dict:
    """Add, step until done (or the deadline: the rest is aborted); output ids per request, and
    the top kernels of 5 steps from step `profile_at_step` on (CUDA)."""
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    num_steps, profiled = 0, []
    while engine.has_requests_in_flight():
        if deadline is not None and time.perf_counter() > deadline:
            for request in requests:
                engine.abort_request(request.request_id)
            break
        num_steps += 1
        step_outputs = []
        if num_steps == profile_at_step:
            profiled = top_kernels(lambda: step_outputs.extend(out for _ in range(5) for out in engine.step()),
                                   engine.runner.device)
        else:
            step_outputs = engine.step()
        for output in step_outputs:
            if output.error_message:
                raise SystemExit(f"request {output.request_id} failed: {output.error_message}")
            outputs[output.request_id].extend(output.new_token_ids)
    return {"outputs": outputs, "num_steps": num_steps, "top_kernels": profiled}


def significant(value: float, digits: int = 4) -> float:
    """`value` rounded to `digits` significant digits: a measured rate never rounds to zero."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def requests_for(prompts: list[list[int]], max_tokens: int, prefix: str) -> list[EngineRequest]:
    now = time.monotonic_ns()
    return [EngineRequest(f"{prefix}{i}", p, greedy(max_tokens), now) for i, p in enumerate(prompts)]


# --- scenarios ----------------------------------------------------------------------------------


def baselines(device: torch.device, small: bool) -> dict:
    num_bytes = (64 << 20) if small else (4 << 30)
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_ms = time_gpu_ms(lambda: dst.copy_(src), device)
    size = 512 if small else 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    gemm_ms = time_gpu_ms(lambda: a @ b, device)
    result = {
        "copy_bytes": num_bytes,
        "copy_ms": round(copy_ms, 4),
        "copy_bandwidth_GBps": significant(2 * num_bytes / copy_ms / 1e6),  # read + write
        "gemm_size": size,
        "gemm_ms": round(gemm_ms, 4),
        # A loaded CPU reaches ~1 GFLOP/s: decimals would round it to 0 and every floor to inf.
        "gemm_TFLOPs": significant(2 * size**3 / gemm_ms / 1e9),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    del src, dst, a, b
    free_memory()
    return result


def decode_scenario(engine: TorchEngineCore, model, device: torch.device, base: dict, prompt_tokens: int = 448,
                    num_steps: int = 128) -> dict:
    """One sequence decoding num_steps tokens after a prompt_tokens prompt (median context ~512)."""
    runner = engine.runner
    prompt = random_prompts(1, prompt_tokens, runner.vocab_size, seed=11)[0]
    engine.add_request(EngineRequest("decode", prompt, greedy(num_steps + 1), time.monotonic_ns()))
    engine.step()  # the prompt
    step_ms = []
    while engine.has_requests_in_flight():
        start = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
    weight_bytes = weight_read_bytes(model)
    floor_ms = weight_bytes / (base["copy_bandwidth_GBps"] * 1e6)
    result = {
        "prompt_tokens": prompt_tokens,
        "decode_steps": len(step_ms),
        "weight_read_bytes": weight_bytes,
        "kv_read_bytes_at_512": 512 * runner.kv_cache.spec.bytes_per_block // BLOCK_SIZE,
        "floor_ms_weight_bytes_over_copy_bw": round(floor_ms, 4),
        "engine_step_ms_median": round(statistics.median(step_ms[8:]), 4),
        "engine_step_ms_p90": round(sorted(step_ms[8:])[int(0.9 * len(step_ms[8:]))], 4),
    }
    graphs = runner.decode_graphs
    if graphs is not None and 1 in graphs.captured_graphs:
        # The static inputs still hold the last step (context ~prompt + num_steps): replaying
        # it rewrites that token's K/V into a block that is free now, which nothing reads.
        result["graph_replay_ms"] = round(time_gpu_ms(graphs.captured_graphs[1].replay, device, repeats=50), 4)
        result["graph_replay_over_floor"] = round(result["graph_replay_ms"] / floor_ms, 3)
        with torch.inference_mode():
            result["eager_step_ms"] = round(time_gpu_ms(lambda: graphs.forward_uncaptured(1), device, repeats=10), 4)
            result["top_kernels_eager_step"] = top_kernels(lambda: graphs.forward_uncaptured(1), device)
    result["engine_step_over_floor"] = round(result["engine_step_ms_median"] / floor_ms, 3)
    return result


def ttft_scenario(engine: TorchEngineCore, model, device: torch.device, base: dict, prompt_tokens: int = 1024,
                  repeats: int = 5) -> dict:
    """Fresh 1024-token prompts (no prefix hits), one at a time: the wall time of the step that
    computes the prompt and samples the first token, from add_request to its output."""
    prompts = random_prompts(repeats + 1, prompt_tokens, engine.runner.vocab_size, seed=21)
    times_ms = []
    for i, prompt in enumerate(prompts):
        synchronize(device)
        start = time.perf_counter()
        engine.add_request(EngineRequest(f"ttft{i}", prompt, greedy(1), time.monotonic_ns()))
        outputs, num_calls = [], 0
        while not outputs:  # async scheduling: the token comes out of the next call
            outputs, num_calls = engine.step(), num_calls + 1
        elapsed = (time.perf_counter() - start) * 1e3
        assert outputs[0].new_token_ids and num_calls <= 2, "the prompt did not finish in one forward"
        if i:  # the first one warms up the prefill shapes
            times_ms.append(elapsed)
    params = num_params(model)
    floor_ms = 2 * params * prompt_tokens / (base["gemm_TFLOPs"] * 1e9)
    median = statistics.median(times_ms)
    return {
        "prompt_tokens": prompt_tokens,
        "params": params,
        "floor_ms_2_params_tokens_over_gemm_rate": round(floor_ms, 3),
        "ttft_ms_median": round(median, 3),
        "ttft_ms_all": [round(t, 2) for t in times_ms],
        "ttft_over_floor": round(median / floor_ms, 3),
    }


def throughput_scenario(engine: TorchEngineCore, args, device: torch.device, deadline: float | None) -> dict:
    prompts = random_prompts(args.throughput_requests, args.throughput_prompt_tokens, engine.runner.vocab_size, seed=31)
    if args.throughput_max_s:
        cap = time.perf_counter() + args.throughput_max_s
        deadline = cap if deadline is None else min(deadline, cap)
    # Host seconds per part of a step, and GPU-busy time (engine.step_stats: CUDA events before
    # each step's forward and after its sampling is queued, read after the run, so the
    # measurement adds no syncs). With async scheduling the host work of step N+1 overlaps step
    # N, so the host parts can add up to more than the idle time.
    engine.step_stats = StepStatsLog(measure_gpu=True)
    synchronize(device)
    start = time.perf_counter()
    try:
        ran = run_all(engine, requests_for(prompts, args.throughput_output_tokens, "t"), deadline,
                      profile_at_step=400)  # mid-run, the batch is full
        synchronize(device)
    finally:
        steps, engine.step_stats = engine.step_stats.steps, None
    wall_s = time.perf_counter() - start
    gpu_busy_s = sum(stats.gpu_busy_ms() for stats in steps) / 1e3
    host_s = {part: sum(getattr(stats, f"{part}_s") for stats in steps)
              for part in HOST_PARTS}
    num_output = sum(len(o) for o in ran["outputs"].values())
    num_finished = sum(len(o) == args.throughput_output_tokens for o in ran["outputs"].values())
    return {
        "requests": args.throughput_requests,
        "requests_finished": num_finished,
        "partial": num_finished < args.throughput_requests,
        "prompt_tokens": args.throughput_prompt_tokens,
        "output_tokens_per_request": args.throughput_output_tokens,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_batched_tokens": engine.config.max_batched_tokens,
        "output_tokens": num_output,
        "wall_s": round(wall_s, 2),
        "output_tokens_per_s": round(num_output / wall_s, 1),
        "total_tokens_per_s": round((num_output + num_finished * args.throughput_prompt_tokens) / wall_s, 1),
        "steps": ran["num_steps"],
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "quantization": engine.config.quantization,
        "async_scheduling": engine.config.async_scheduling,
        "gpu_busy_s": round(gpu_busy_s, 2),
        "gpu_idle_s": round(wall_s - gpu_busy_s, 2),
        "host_s": {k: round(v, 2) for k, v in host_s.items()},
        "top_kernels_5_steps_mid_run": ran["top_kernels"],
        "num_preemptions": engine.load().num_preemptions_total,
    }


def hf_generate_tokens_per_s(hf_model, prompts: list[list[int]], num_new: int, device: torch.device) -> dict:
    input_ids = torch.tensor(prompts, device=device)
    attention_mask = torch.ones_like(input_ids)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        hf_model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, min_new_tokens=4, **kwargs)
        synchronize(device)
        start = time.perf_counter()
        out = hf_model.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=num_new, min_new_tokens=num_new, **kwargs
        )
        synchronize(device)
    wall_s = time.perf_counter() - start
    generated = out[:, input_ids.shape[1] :]
    return {
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(generated.numel() / wall_s, 1),
        "outputs": generated.tolist(),
    }


def ours_tokens_per_s(engine: TorchEngineCore, prompts: list[list[int]], num_new: int, device, prefix: str) -> dict:
    # Warm-up on different prompts of the same shape (no prefix-cache hits in the timed run).
    warm = random_prompts(len(prompts), len(prompts[0]), engine.runner.vocab_size, seed=len(prompts) + 99)
    run_all(engine, requests_for(warm, 4, prefix + "warm"))
    synchronize(device)
    start = time.perf_counter()
    ran = run_all(engine, requests_for(prompts, num_new, prefix))
    wall_s = time.perf_counter() - start
    outputs = [ran["outputs"][f"{prefix}{i}"] for i in range(len(prompts))]
    return {
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(sum(map(len, outputs)) / wall_s, 1),
        "outputs": outputs,
    }


def vs_hf_scenario(engine: TorchEngineCore, hf_model, args, device: torch.device) -> dict:
    result = {"prompt_tokens": args.hf_prompt_tokens, "output_tokens": args.hf_output_tokens}
    for batch, seed in ((1, 41), (args.hf_batch, 42)):
        prompts = random_prompts(batch, args.hf_prompt_tokens, engine.runner.vocab_size, seed)
        theirs = hf_generate_tokens_per_s(hf_model, prompts, args.hf_output_tokens, device)
        ours = ours_tokens_per_s(engine, prompts, args.hf_output_tokens, device, f"hf{batch}-")
        same = sum(a == b for a, b in zip(ours.pop("outputs"), theirs.pop("outputs")))
        result[f"batch_{batch}"] = {
            "hf_generate": theirs,
            "ours": ours,
            "speedup": round(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 1),
            "identical_greedy_outputs": f"{same}/{batch}",
        }
    return result


def correctness_scenario(engine: TorchEngineCore, hf_model, device: torch.device, num_new: int = 32) -> dict:
    """Record the logits our engine samples from, then score them against a float32 forward of
    transformers on the same weights over the same tokens (teacher forcing on our outputs)."""
    vocab_size = engine.runner.vocab_size
    base = random_prompts(4, 700, vocab_size, seed=51)
    prompts = [base[0][:37], base[1][:300], base[2], base[2][:512] + base[3][:100]]  # the last hits 32 cached blocks
    recorded: dict[str, list[torch.Tensor]] = {}
    engine.sampler.rows = recorded
    hits_before = engine.load().prefix_cache_hit_tokens_total
    try:
        first = run_all(engine, requests_for(prompts[:3], num_new, "c"))["outputs"]
        hits_before = engine.load().prefix_cache_hit_tokens_total
        second = run_all(engine, requests_for(prompts[3:], num_new, "cached"))["outputs"]
    finally:
        engine.sampler.rows = None
    generated = first | second
    request_prompts = {"c0": prompts[0], "c1": prompts[1], "c2": prompts[2], "cached0": prompts[3]}
    reference_model = copy.deepcopy(hf_model).float()  # the same bf16 values, float32 arithmetic
    torch.backends.cuda.matmul.allow_tf32 = False
    rows_ours, rows_ref, rows_hf_bf16 = [], [], []
    for request_id, prompt in request_prompts.items():
        # Teacher forcing on our tokens: row k predicts generated[k] from prompt + generated[:k].
        full = torch.tensor([prompt + generated[request_id][:-1]], device=device)
        with torch.inference_mode():
            rows_ref.append(reference_model(full).logits[0, len(prompt) - 1 :].float().cpu())
            rows_hf_bf16.append(hf_model(full).logits[0, len(prompt) - 1 :].float().cpu())
        rows_ours.append(torch.stack(recorded[request_id]))
    del reference_model
    free_memory()
    ours, ref = torch.cat(rows_ours).double(), torch.cat(rows_ref).double()
    hf_bf16 = torch.cat(rows_hf_bf16).double()
    rel_error = ((ours - ref).norm() / ref.norm()).item()
    row_rel = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1))
    row_max_error = (ours - ref).abs().max(dim=-1).values
    top2 = ref.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    eligible = margin > 2 * row_max_error
    agree = ours.argmax(-1) == ref.argmax(-1)
    return {
        "rows": int(ours.shape[0]),
        "rel_error": round(rel_error, 5),
        "hf_bf16_rel_error": round(((hf_bf16 - ref).norm() / ref.norm()).item(), 5),
        "hf_bf16_greedy_agree_all_rows": int((hf_bf16.argmax(-1) == ref.argmax(-1)).sum()),
        "row_rel_error_max": round(row_rel.max().item(), 5),
        "logit_std": round(ref.std().item(), 4),
        "rows_with_margin_over_2x_error": int(eligible.sum()),
        "greedy_agree_on_those": int((agree & eligible).sum()),
        "greedy_agree_all_rows": int(agree.sum()),
        "prefix_cache_hit_tokens": engine.load().prefix_cache_hit_tokens_total - hits_before,
        "rel_error_ok": rel_error <= 2e-2,
        "greedy_ok": bool((agree | ~eligible).all()),
    }


PREFILL_CONFIGS = [
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2},
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
]
# Decode-attention launch configs, swept by kernels_scenario (batch 1) and decode_config_sweep
# (batch 256, where the fastest is adopted); the first is paged_decode's default, the reference.
DECODE_CONFIGS = [
    {"block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_n": 64, "num_warps": 4, "num_stages": 2},
    {"block_n": 64, "num_warps": 4, "num_stages": 4},
    {"block_n": 32, "num_warps": 4, "num_stages": 3},
    {"block_n": 64, "num_warps": 8, "num_stages": 3},
    {"block_n": 128, "num_warps": 4, "num_stages": 2},
    {"block_n": 128, "num_warps": 8, "num_stages": 2},
    {"block_n": 128, "num_warps": 8, "num_stages": 3},
    {"block_n": 32, "num_warps": 2, "num_stages": 4},
]
CONFIG_KEYS = ("block_n", "num_warps", "num_stages")
ATTENTION_SHAPE = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}  # Llama-3.1-8B


def decode_attention_inputs(device: torch.device, batch: int, context: int):
    """(q, k_cache, v_cache, block_tables, context_lens) for `batch` sequences of `context`
    tokens each, bf16, blocks scattered over the pool in random order (8B shapes)."""
    num_heads, num_kv_heads, head_dim = ATTENTION_SHAPE.values()
    blocks_per_seq = context // BLOCK_SIZE
    k_cache = torch.randn(batch * blocks_per_seq, BLOCK_SIZE, num_kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks_per_seq, device=device, dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_heads, head_dim, dtype=torch.bfloat16, device=device)
    return q, k_cache, v_cache, tables, lens


def sweep(configs: list[dict], run, device: torch.device) -> list[dict]:
    """Median ms of run(config) for each config (a failing config is reported, not fatal)."""
    rows = []
    for config in configs:
        try:
            rows.append({**config, "ms": round(time_gpu_ms(lambda: run(config), device, repeats=10), 4)})
        except Exception as error:
            rows.append({**config, "error": repr(error)[:200]})
    return rows


def kernels_scenario(device: torch.device) -> dict:
    """Prefill attention: Triton paged kernel (launch configs swept) vs torch SDPA; decode
    attention bandwidth at batch 1, 16 and 256 (configs swept at batch 1; batch 256 is swept
    by decode_config_sweep)."""
    if device.type != "cuda":
        return {}
    import torch.nn.functional as F

    from llmserve.inference.kernels.paged_decode import decode_num_splits, paged_decode_attention
    from llmserve.inference.kernels.paged_prefill import paged_prefill_attention

    num_heads, num_kv_heads, head_dim = ATTENTION_SHAPE.values()
    result = {}
    for num_tokens in (1024, 4096):
        num_blocks = num_tokens // BLOCK_SIZE
        k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=torch.bfloat16, device=device)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(num_blocks, device=device, dtype=torch.int32)[None]
        q = torch.randn(num_tokens, num_heads, head_dim, dtype=torch.bfloat16, device=device)
        ints = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        starts, lens = ints([0]), ints([num_tokens])
        configs = sweep(PREFILL_CONFIGS, lambda c: paged_prefill_attention(
            q, k_cache, v_cache, table, starts, lens, lens, num_tokens, head_dim**-0.5, config=c), device)
        triton_ms = configs[0].get("ms", float("nan"))
        positions = table[0].long()[torch.arange(num_tokens, device=device) // BLOCK_SIZE] * BLOCK_SIZE + (
            torch.arange(num_tokens, device=device) % BLOCK_SIZE)
        k = k_cache.view(-1, num_kv_heads, head_dim)[positions].transpose(0, 1)[None]
        v = v_cache.view(-1, num_kv_heads, head_dim)[positions].transpose(0, 1)[None]
        q4 = q.transpose(0, 1)[None]
        sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        try:
            sdpa_ms = time_gpu_ms(sdpa, device)
        except Exception:  # no GQA-capable fused backend: expand the kv heads
            k, v = (t.repeat_interleave(num_heads // num_kv_heads, dim=1) for t in (k, v))
            sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True)  # noqa: E731
            sdpa_ms = time_gpu_ms(sdpa, device)
        ref = sdpa()[0].transpose(0, 1)
        out = paged_prefill_attention(q, k_cache, v_cache, table, starts, lens, lens, num_tokens, head_dim**-0.5)
        flops = 4 * num_heads * head_dim * num_tokens * num_tokens / 2
        result[f"prefill_{num_tokens}"] = {
            "triton_paged_ms": round(triton_ms, 4),
            "sdpa_contiguous_ms": round(sdpa_ms, 4),
            "triton_TFLOPs": round(flops / triton_ms / 1e9, 1),
            "rel_diff_vs_sdpa": round(((out.float() - ref.float()).norm() / ref.float().norm()).item(), 5),
            "configs": configs,
        }
    batch, context = 256, 2048
    q, k_cache, v_cache, tables, lens = decode_attention_inputs(device, batch, context)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    for b in (1, 16, batch):
        splits = decode_num_splits(b, num_kv_heads, num_sms)
        ms = time_gpu_ms(lambda: paged_decode_attention(q[:b], k_cache, v_cache, tables[:b], lens[:b], head_dim**-0.5,
                                                        num_splits=splits), device)
        kv_bytes = 2 * b * context * num_kv_heads * head_dim * 2
        result[f"decode_batch_{b}_ctx_{context}"] = {
            "ms": round(ms, 4), "splits": splits, "kv_bytes": kv_bytes, "GBps": round(kv_bytes / ms / 1e6, 1),
        }
        if b == 1:
            result[f"decode_batch_{b}_ctx_{context}"]["configs"] = sweep(DECODE_CONFIGS, lambda c: paged_decode_attention(
                q[:b], k_cache, v_cache, tables[:b], lens[:b], head_dim**-0.5, num_splits=splits, config=c), device)
    return result


LINEAR_SHAPES = {  # name: (in_features K, out_features N)
    "1b_qkv": (2048, 3072), "1b_gate_up": (2048, 16384), "1b_down": (8192, 2048),
    "8b_qkv": (4096, 6144), "8b_o": (4096, 4096), "8b_gate_up": (4096, 28672), "8b_down": (14336, 4096),
}


def graph_ms_per_call(calls: list, device: torch.device) -> float:
    """Device ms per call of `calls` (each run once, in order) captured in one CUDA graph:
    kernel time without Python launch overhead, as in the engine's decode graphs."""
    for call in calls:
        call()
    synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return time_gpu_ms(graph.replay, device, repeats=10) / len(calls)


def linears_scenario(device: torch.device, num_tokens: tuple[int, ...] = (1, 16, 64, 256, 4096)) -> dict:
    """One linear layer at the model shapes: bf16 cuBLAS (and with a float32 output), int8
    W8A16 (our Triton GEMM) and fp8 W8A8 (per-token quantization + torch._scaled_mm). Timed
    as CUDA-graph replays over enough distinct copies of the weights (>= 400 MB) that nothing
    is served from L2: weight GB/s at small M, TFLOP/s at large M."""
    if device.type != "cuda":
        return {}
    import torch.nn.functional as F

    from llmserve.inference.models.quantization import Fp8Linear, Int8Linear

    result = {}
    for name, (k, n) in LINEAR_SHAPES.items():
        num_copies = max(2, -(-(400 << 20) // (2 * k * n)))
        linears = [torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16) for _ in range(num_copies)]
        variants = {"bf16": linears}
        for label, cls in (("int8", Int8Linear), ("fp8", Fp8Linear)):
            try:
                variants[label] = [cls.from_linear(linear) for linear in linears]
            except Exception as error:
                result[f"{name}_{label}_error"] = repr(error)[:200]
        rows = {}
        for m in num_tokens:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            reference = F.linear(x.float(), linears[0].weight.float())
            row = {}
            for label, modules in variants.items():
                try:
                    with torch.inference_mode():
                        ms = graph_ms_per_call([lambda mod=mod: mod(x) for mod in modules], device)
                        error = ((modules[0](x).float() - reference).norm() / reference.norm()).item()
                    weight_bytes = sum(t.numel() * t.element_size() for t in modules[0].parameters())
                    row[label] = {"us": round(ms * 1e3, 2), "GBps": round(weight_bytes / ms / 1e6, 1),
                                  "TFLOPs": round(2 * m * k * n / ms / 1e9, 1), "rel_error": round(error, 5)}
                except Exception as error:
                    row[label] = {"error": repr(error)[:200]}
            try:
                with torch.inference_mode():
                    ms = graph_ms_per_call(
                        [lambda w=lin.weight: torch.mm(x, w.t(), out_dtype=torch.float32) for lin in linears], device)
                row["bf16_fp32_out"] = {"us": round(ms * 1e3, 2), "GBps": round(k * n * 2 / ms / 1e6, 1)}
            except Exception as error:
                row["bf16_fp32_out"] = {"error": repr(error)[:200]}
            rows[f"m{m}"] = row
        result[name] = rows
        del linears, variants
        free_memory()
    return result


def decode_config_sweep(device: torch.device, batch: int = 256, context: int = 2048) -> dict:
    """Decode attention at batch x context (8B shapes) on a bfloat16 and on a float8 cache over
    DECODE_CONFIGS; the fastest config whose output stays within 1e-2 of the reference
    becomes paged_decode.DEFAULT_CONFIG / FP8_CONFIG for the rest of this process."""
    from llmserve.inference.kernels import paged_decode

    q, k_cache, v_cache, tables, lens = decode_attention_inputs(device, batch, context)
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    run = lambda k, v, c: paged_decode_attention_call(paged_decode, q, k, v, tables, lens, c)  # noqa: E731
    result = {"batch": batch, "context": context}
    for label, (k, v), attribute in (("bf16", (k_cache, v_cache), "DEFAULT_CONFIG"), ("fp8", (k8, v8), "FP8_CONFIG")):
        kv_bytes = 2 * k.numel() * k.element_size()  # K and V, every block read once
        reference = run(k.to(torch.bfloat16), v.to(torch.bfloat16), DECODE_CONFIGS[0]).float()
        rows = []
        for config in DECODE_CONFIGS:
            try:
                out = run(k, v, config).float()
                ms = time_gpu_ms(lambda: run(k, v, config), device, repeats=10)
                rows.append({**config, "ms": round(ms, 4), "GBps": round(kv_bytes / ms / 1e6, 1),
                             "rel_diff": round(((out - reference).norm() / reference.norm()).item(), 6)})
            except Exception as error:
                rows.append({**config, "error": repr(error)[:200]})
        valid = [r for r in rows if "ms" in r and r["rel_diff"] < 1e-2]
        best = min(valid, key=lambda r: r["ms"]) if valid else None
        if best is not None:
            setattr(paged_decode, attribute, {key: best[key] for key in CONFIG_KEYS if key in best})
        result[label] = {"configs": rows, "best": best, "adopted": getattr(paged_decode, attribute)}
    return result


def paged_decode_attention_call(paged_decode, q, k, v, tables, lens, config):
    return paged_decode.paged_decode_attention(q, k, v, tables, lens, q.shape[-1] ** -0.5, num_splits=1, config=config)


# --- report -------------------------------------------------------------------------------------


def summary_rows(report: dict) -> list[tuple[str, str, str, str]]:
    """(metric, measured, target, verdict) for the table; failed scenarios show their error."""
    rows = [(name, str(value["error"])[:80], "-", "ERROR") for name, value in report.items()
            if isinstance(value, dict) and "error" in value]
    report = {k: v for k, v in report.items() if not (isinstance(v, dict) and "error" in v)}
    base = report.get("baselines", {})
    if base:
        rows.append(("copy bandwidth (read+write)", f"{base['copy_bandwidth_GBps']:.4g} GB/s", "-", "baseline"))
        rows.append(("bf16 GEMM 8192^3", f"{base['gemm_TFLOPs']:.3g} TFLOP/s", "-", "baseline"))
    for key, target in (("decode_small", 1.5), ("decode_large", 1.15)):
        d = report.get(key)
        if d and "graph_replay_ms" in d:
            rows.append((f"{key} graph replay / floor", f"{d['graph_replay_ms']:.3f} ms / {d['floor_ms_weight_bytes_over_copy_bw']:.3f} ms = {d['graph_replay_over_floor']:.2f}x", f"<= {target}x", _verdict(d["graph_replay_over_floor"] <= target)))
            rows.append((f"{key} engine step / floor", f"{d['engine_step_ms_median']:.3f} ms = {d['engine_step_over_floor']:.2f}x", f"<= {target}x", _verdict(d["engine_step_over_floor"] <= target)))
    t = report.get("ttft")
    if t:
        rows.append(("TTFT 1024 tok 8B / floor", f"{t['ttft_ms_median']:.1f} ms / {t['floor_ms_2_params_tokens_over_gemm_rate']:.1f} ms = {t['ttft_over_floor']:.2f}x", "<= 1.5x", _verdict(t["ttft_over_floor"] <= 1.5)))
    for key in ("decode_small_int8", "decode_small_fp8", "decode_large_int8", "decode_large_fp8"):
        d = report.get(key)
        if d and "graph_replay_over_bf16_floor" in d:
            rows.append((f"{key} replay / bf16 floor (own floor)", f"{d['graph_replay_ms']:.3f} ms = {d['graph_replay_over_bf16_floor']:.2f}x ({d['graph_replay_over_floor']:.2f}x)", "-", "info"))
    for key, target in (("throughput", 12000), ("throughput_fp8_kv", 12000), ("throughput_fp8", 17700)):
        th = report.get(key)
        if th:
            label = f"{key} 8B {th['requests_finished']}/{th['requests']} req" + (" (partial)" if th["partial"] else "")
            rows.append((label, f"{th['output_tokens_per_s']:.0f} out tok/s", f">= {target}", _verdict(th["output_tokens_per_s"] >= target)))
    h = report.get("vs_hf")
    if h and "settings" in report:
        for key, target in (("batch_1", 50), (f"batch_{report['settings']['hf_batch']}", 30)):
            if key in h:
                rows.append((f"vs HF generate {key}", f"{h[key]['speedup']}x ({h[key]['ours']['output_tokens_per_s']:.0f} vs {h[key]['hf_generate']['output_tokens_per_s']:.0f} tok/s)", f">= {target}x", _verdict(h[key]["speedup"] >= target)))
    for key in ("correctness", "correctness_fp8_kv", "correctness_int8", "correctness_fp8"):
        c = report.get(key)
        if c:
            rows.append((f"{key}: rel. error vs fp32 HF", f"{c['rel_error']:.4f} (HF bf16: {c['hf_bf16_rel_error']:.4f})", "<= 0.02", _verdict(c["rel_error_ok"])))
            rows.append((f"{key}: greedy agree (margin > 2x err)", f"{c['greedy_agree_on_those']}/{c['rows_with_margin_over_2x_error']}", "all", _verdict(c["greedy_ok"])))
    return rows


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def print_summary(report: dict) -> None:
    rows = summary_rows(report)
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))


def run_fp8_only(args, device: torch.device, deadline: float | None, record) -> None:
    """The all-fp8 configuration: fp8 weights (W8A8) and an fp8 KV cache, 8B throughput."""
    record("decode_config_sweep", lambda: decode_config_sweep(device))
    with tempfile.TemporaryDirectory() as tmp:
        hf_large = build_hf_model(args.large_model, device)
        blocks_per_seq = -(-(args.throughput_prompt_tokens + args.throughput_output_tokens) // BLOCK_SIZE)
        engine = engine_on(
            hf_large, model_dir_for(args.large_model, Path(tmp)), args.device,
            max_num_seqs=args.throughput_max_seqs, max_batched_tokens=args.max_batched_tokens,
            num_kv_blocks=args.throughput_max_seqs * (blocks_per_seq + 1) + 512, kv_cache_dtype="fp8",
            quantization="fp8")
        del hf_large
        free_memory()
        record("throughput_fp8", lambda: throughput_scenario(engine, args, device, deadline))


def run_quant(args, device: torch.device, base: dict, deadline: float | None, record) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        hf_small = build_hf_model(args.small_model, device)
        for method in QUANTIZATIONS:
            engine = engine_on(hf_small, model_dir_for(args.small_model, Path(tmp)), args.device, max_num_seqs=8,
                               num_kv_blocks=2048, quantization=method)
            record(f"correctness_{method}", lambda: correctness_scenario(engine, hf_small, device))
            record(f"decode_small_{method}", lambda: decode_scenario(engine, engine.runner.model, device, base))
            del engine
            free_memory()
        bf16_bytes = weight_read_bytes(hf_small)
        del hf_small
        free_memory()
        hf_large = build_hf_model(args.large_model, device)
        bf16_large_bytes = weight_read_bytes(hf_large)
        for method in QUANTIZATIONS:
            engine = engine_on(hf_large, model_dir_for(args.large_model, Path(tmp)), args.device, max_num_seqs=8,
                               num_kv_blocks=2048, quantization=method)
            record(f"decode_large_{method}", lambda: decode_scenario(engine, engine.runner.model, device, base))
            del engine
            free_memory()
        for key, bf16 in (("small", bf16_bytes), ("large", bf16_large_bytes)):
            floor_ms = bf16 / (base["copy_bandwidth_GBps"] * 1e6)
            for method in QUANTIZATIONS:
                d = report_ref[0].get(f"decode_{key}_{method}")
                if d and "graph_replay_ms" in d:
                    d["bf16_floor_ms"] = round(floor_ms, 4)
                    d["graph_replay_over_bf16_floor"] = round(d["graph_replay_ms"] / floor_ms, 3)
                    d["engine_step_over_bf16_floor"] = round(d["engine_step_ms_median"] / floor_ms, 3)
        del hf_large
        free_memory()
    record("linears", lambda: linears_scenario(device))


report_ref: list[dict] = [{}]  # the running report, for scenarios that annotate earlier results


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    deadline = started + args.deadline_s if args.deadline_s else None
    device = torch.device(args.device)
    wanted = set(SCENARIOS) - {"fp8", "quant"} if args.scenario == "all" else {*args.scenario.split(","), "baselines"}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out_path = args.out_dir / time.strftime("gpu-%Y%m%d-%H%M%S.json")
    report: dict = {"settings": {k: str(v) for k, v in vars(args).items()} | {"hf_batch": args.hf_batch}}
    report_ref[0] = report
    report["settings"]["torch"] = torch.__version__
    small_shape = args.small_model
    is_smoke = small_shape == "tiny"

    def record(name: str, fn) -> None:
        begin = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as error:  # keep the other scenarios' numbers
            import traceback

            traceback.print_exc()
            report[name] = {"error": repr(error)}
        report.setdefault("scenario_seconds", {})[name] = round(time.perf_counter() - begin, 1)
        out_path.write_text(json.dumps(report, indent=2))
        print(f"[{time.perf_counter() - started:7.1f}s] {name}: {json.dumps(report[name])[:1500]}", flush=True)

    record("baselines", lambda: baselines(device, small=is_smoke))
    base = report["baselines"]
    if args.scenario in ("fp8", "quant"):
        if args.scenario == "fp8":
            run_fp8_only(args, device, deadline, record)
        else:
            run_quant(args, device, base, deadline, record)
        report["total_s"] = round(time.perf_counter() - started, 1)
        out_path.write_text(json.dumps(report, indent=2))
        print_summary(report)
        print(f"\nwrote {out_path}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        if wanted & {"correctness", "decode", "vs-hf"}:
            hf_small = build_hf_model(small_shape, device)
            engine = engine_on(hf_small, model_dir_for(small_shape, Path(tmp)), args.device, max_num_seqs=args.hf_batch,
                               max_batched_tokens=args.max_batched_tokens, num_kv_blocks=8192)
            report["small_model"] = {"shape": small_shape, "params": num_params(hf_small), "startup_s": engine.startup_s,
                                     "fallback": engine.fallback}
            if "correctness" in wanted:
                record("correctness", lambda: correctness_scenario(engine, hf_small, device))
                if not args.skip_fp8 and not is_smoke:
                    def fp8_correctness():
                        fp8_engine = engine_on(hf_small, model_dir_for(small_shape, Path(tmp)), args.device,
                                               max_num_seqs=8, num_kv_blocks=2048, kv_cache_dtype="fp8")
                        try:
                            return correctness_scenario(fp8_engine, hf_small, device)
                        finally:
                            del fp8_engine
                            free_memory()

                    record("correctness_fp8_kv", fp8_correctness)
            if "decode" in wanted:
                record("decode_small", lambda: decode_scenario(engine, engine.runner.model, device, base))
            if "vs-hf" in wanted:
                record("vs_hf", lambda: vs_hf_scenario(engine, hf_small, args, device))
            del engine, hf_small
            free_memory()
        if wanted & {"kernels", "throughput"} and device.type == "cuda":
            record("decode_config_sweep", lambda: decode_config_sweep(device))  # adopts the fastest
        if "kernels" in wanted:
            record("kernels", lambda: kernels_scenario(device))
        if "linears" in wanted:
            record("linears", lambda: linears_scenario(device))
        if wanted & {"decode", "ttft", "throughput"}:
            large_shape = "tiny" if is_smoke else args.large_model
            hf_large = build_hf_model(large_shape, device)
            blocks_per_seq = -(-(args.throughput_prompt_tokens + args.throughput_output_tokens) // BLOCK_SIZE)
            engine = engine_on(hf_large, model_dir_for(large_shape, Path(tmp)), args.device,
                               max_num_seqs=args.throughput_max_seqs, max_batched_tokens=args.max_batched_tokens,
                               num_kv_blocks=args.throughput_max_seqs * (blocks_per_seq + 1) + 512)
            report["large_model"] = {"shape": large_shape, "params": num_params(hf_large), "startup_s": engine.startup_s,
                                     "fallback": engine.fallback}
            if "decode" in wanted:
                record("decode_large", lambda: decode_scenario(engine, engine.runner.model, device, base))
            if "ttft" in wanted:
                record("ttft", lambda: ttft_scenario(engine, engine.runner.model, device, base, args.ttft_prompt_tokens))
            if "throughput" in wanted:
                record("throughput", lambda: throughput_scenario(engine, args, device, deadline))
            del engine
            free_memory()
            if "throughput" in wanted and not args.skip_fp8 and not is_smoke:
                def fp8_throughput():
                    fp8_engine = engine_on(
                        hf_large, model_dir_for(large_shape, Path(tmp)), args.device,
                        max_num_seqs=args.throughput_max_seqs, max_batched_tokens=args.max_batched_tokens,
                        num_kv_blocks=args.throughput_max_seqs * (blocks_per_seq + 1) + 512, kv_cache_dtype="fp8")
                    try:
                        return throughput_scenario(fp8_engine, args, device, deadline)
                    finally:
                        del fp8_engine
                        free_memory()

                record("throughput_fp8_kv", fp8_throughput)
            del hf_large
            free_memory()
    report["total_s"] = round(time.perf_counter() - started, 1)
    out_path.write_text(json.dumps(report, indent=2))
    print_summary(report)
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
