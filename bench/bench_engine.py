"""Benchmark the torch engine: throughput against the hf backend, and prefix-cache savings.

    python bench/bench_engine.py --model DIR [--device cpu] [--dtype float32] ...
    python bench/bench_engine.py --random-model smollm2-135m   # random weights, SmolLM2-135M's shape
    python bench/bench_engine.py --random-model tiny           # the tests' tiny llama

Workloads (random prompt token ids, greedy, ignore_eos, so every run does the same work):
  1. throughput: --num-requests concurrent requests (prompt --prompt-tokens, output
     --output-tokens) through TorchEngineCore and through HFEngineCore (one sequence at a time:
     the transformers baseline); output tokens/s, wall time, and how many greedy outputs agree;
  2. shared prefix: --prefix-requests requests whose prompts share their first 90%; one
     request runs first, the rest arrive together. Prompt tokens actually computed (counted
     from the batches the model ran) with the prefix cache on vs off, and the reported hit rate
     against the theoretical one: every request but the first can reuse the whole blocks of the
     shared part.

Prints a table and writes JSON to bench/results/. Timings on a shared CPU are noisy; compare
runs from the same machine and moment.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.torch_engine import TorchEngineCore
from llmserve.inference.engine.types import EngineRequest
from llmserve.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_FRACTION = 0.9


@dataclass
class ThroughputResult:
    backend: str
    num_requests: int
    num_prompt_tokens: int
    num_completion_tokens: int
    wall_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    mean_ttft_ms: float
    num_steps: int


@dataclass
class PrefixResult:
    prefix_caching: bool
    num_requests: int
    num_prompt_tokens: int
    num_prompt_tokens_computed: int
    reported_hit_rate: float
    theoretical_hit_rate: float
    wall_s: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="HF checkpoint directory")
    source.add_argument("--random-model", choices=("tiny", "smollm2-135m"), help="build a random-weight model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--num-requests", type=int, default=32, help="concurrent requests (throughput)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--prefix-requests", type=int, default=16, help="requests of the shared-prefix workload")
    parser.add_argument("--prefix-prompt-tokens", type=int, default=200)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--skip-hf", action="store_true", help="skip the hf baseline")
    parser.add_argument("--results-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    return parser.parse_args()


def random_model_dir(kind: str, out_dir: Path) -> Path:
    from llmserve.tools.tiny_model import build_tiny_model, build_tokenizer

    if kind == "tiny":
        return build_tiny_model(out_dir, "llama")
    from transformers import AutoModelForCausalLM, LlamaConfig

    build_tokenizer(out_dir)  # the engine reads eos ids from it; prompts are token ids
    config = LlamaConfig(  # HuggingFaceTB/SmolLM2-135M's shape
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def engine_config(args, model_dir: Path, backend: str, prefix_caching: bool = True) -> EngineConfig:
    return EngineConfig(
        model_path=model_dir,
        model_name=model_dir.name,
        backend=backend,
        device=args.device,
        dtype=args.dtype,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=max(args.num_requests, args.prefix_requests),
        max_batched_tokens=args.max_batched_tokens,
        enable_prefix_caching=prefix_caching,
    )


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (num, length), generator=generator).tolist()


def sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_requests(engine, requests: list[EngineRequest]) -> tuple[dict[str, list[int]], dict[str, int], int]:
    """Add all, step until done: (output ids, ttft ns per request, steps)."""
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    ttft_ns: dict[str, int] = {}
    num_steps = 0
    while engine.has_requests_in_flight():
        num_steps += 1
        for output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
            if output.error_message:
                raise SystemExit(f"request {output.request_id} failed: {output.error_message}")
            if output.is_finished:
                ttft_ns[output.request_id] = output.time_to_first_token_ns
    return outputs, ttft_ns, num_steps


def throughput(args, engine, backend: str, prompts: list[list[int]]) -> tuple[ThroughputResult, dict]:
    now = time.monotonic_ns()
    requests = [EngineRequest(f"t{i}", p, sampling(args.output_tokens), now) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    outputs, ttft_ns, num_steps = run_requests(engine, requests)
    wall_s = time.perf_counter() - start
    num_output = sum(len(o) for o in outputs.values())
    num_prompt = sum(len(p) for p in prompts)
    result = ThroughputResult(
        backend=backend,
        num_requests=len(prompts),
        num_prompt_tokens=num_prompt,
        num_completion_tokens=num_output,
        wall_s=round(wall_s, 3),
        output_tokens_per_s=round(num_output / wall_s, 1),
        total_tokens_per_s=round((num_output + num_prompt) / wall_s, 1),
        mean_ttft_ms=round(sum(ttft_ns.values()) / len(ttft_ns) / 1e6, 1),
        num_steps=num_steps,
    )
    return result, outputs


def count_prompt_tokens_computed(engine: TorchEngineCore) -> list[int]:
    """Wrap the model runner so every executed batch adds its prompt-range tokens to a counter."""
    counter = [0]
    execute = engine.runner.execute

    def counting_execute(batch, *args):
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            counter[0] += max(0, min(start + num_new, seq.num_prompt_tokens) - start)
        return execute(batch, *args)

    engine.runner.execute = counting_execute
    return counter


def shared_prefix(args, model_dir: Path, vocab_size: int, prefix_caching: bool) -> PrefixResult:
    engine = TorchEngineCore(engine_config(args, model_dir, "torch", prefix_caching))
    counter = count_prompt_tokens_computed(engine)
    length = args.prefix_prompt_tokens
    num_shared = int(length * SHARED_FRACTION)
    shared = random_prompts(1, num_shared, vocab_size, seed=1)[0]
    suffixes = random_prompts(args.prefix_requests, length - num_shared, vocab_size, seed=2)
    prompts = [shared + suffix for suffix in suffixes]
    now = time.monotonic_ns()
    requests = [EngineRequest(f"p{i}", p, sampling(4), now) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    run_requests(engine, requests[:1])  # the first request fills the cache
    run_requests(engine, requests[1:])  # the others arrive together
    wall_s = time.perf_counter() - start
    load = engine.load()
    block_size = engine.model_info.block_size_tokens
    del engine
    free_device_memory()
    reusable = min(num_shared // block_size * block_size, (length - 1) // block_size * block_size)
    total = length * len(prompts)
    return PrefixResult(
        prefix_caching=prefix_caching,
        num_requests=len(prompts),
        num_prompt_tokens=total,
        num_prompt_tokens_computed=counter[0],
        reported_hit_rate=round(load.prefix_cache_hit_tokens_total / max(1, load.prefix_cache_queried_tokens_total), 4),
        theoretical_hit_rate=round(reusable * (len(prompts) - 1) / total, 4) if prefix_caching else 0.0,
        wall_s=round(wall_s, 3),
    )


def print_table(title: str, rows: list) -> None:
    if not rows:
        return
    columns = list(asdict(rows[0]))
    widths = [max(len(c), *(len(str(asdict(r)[c])) for r in rows)) for c in columns]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(str(asdict(row)[c]).ljust(w) for c, w in zip(columns, widths)))


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or random_model_dir(args.random_model, Path(tmp) / args.random_model)
        report = bench(args, model_dir)
    report["model"] = str(args.model or f"random:{args.random_model}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    name = (args.model.name if args.model else args.random_model) + time.strftime("-%Y%m%d-%H%M%S")
    path = args.results_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")


def bench(args, model_dir: Path) -> dict:
    torch_engine = TorchEngineCore(engine_config(args, model_dir, "torch"))
    vocab_size = torch_engine.model_info.vocab_size
    kv_blocks_total = torch_engine.load().kv_blocks_total
    prompts = random_prompts(args.num_requests, args.prompt_tokens, vocab_size, seed=0)
    result, ours = throughput(args, torch_engine, "torch", prompts)
    del torch_engine
    free_device_memory()
    throughput_rows = [result]
    agreement = None
    if not args.skip_hf:
        from llmserve.inference.engine.hf_engine import HFEngineCore

        hf_engine = HFEngineCore(engine_config(args, model_dir, "hf"))
        result, theirs = throughput(args, hf_engine, "hf", prompts)
        del hf_engine
        free_device_memory()
        throughput_rows.append(result)
        agreement = sum(ours[k] == theirs[k] for k in ours)
    print_table(f"throughput ({args.device}, {args.dtype}, {kv_blocks_total} KV blocks)", throughput_rows)
    if agreement is not None:
        print(f"greedy outputs identical to hf: {agreement}/{len(ours)}")
    prefix_rows = [shared_prefix(args, model_dir, vocab_size, caching) for caching in (True, False)]
    print_table(f"shared prefix ({SHARED_FRACTION:.0%} shared)", prefix_rows)
    on, off = prefix_rows
    saving = off.num_prompt_tokens_computed / max(1, on.num_prompt_tokens_computed)
    print(f"prompt tokens computed, cache off / on: {saving:.1f}x")
    return {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "kv_blocks_total": kv_blocks_total,
        "throughput": [asdict(r) for r in throughput_rows],
        "greedy_outputs_identical_to_hf": agreement,
        "shared_prefix": [asdict(r) for r in prefix_rows],
        "prefill_saving_x": round(saving, 2),
        "torch_threads": torch.get_num_threads(),
    }


def free_device_memory() -> None:
    """After dropping an engine: the next one sizes its KV pool from the free device memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
