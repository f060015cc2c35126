"""Structured outputs: the grammar libraries compared, and constrained decoding against
unconstrained on the engine.

    python bench/bench_grammar.py                                  # libraries (CPU): both tokenizers
    python bench/bench_grammar.py --libraries llguidance --tokenizers qwen3
    python bench/bench_grammar.py --engine --device cuda           # H200: 1.5B shape, 64 streams
    python bench/bench_grammar.py --engine --smoke                 # CPU, tiny model: that it runs

Libraries (xgrammar, llguidance, outlines-core; each measured only where installed), on the
default model's tokenizer (SmolLM2, 49,152 tokens) and on the Qwen3 one (151,669 tokens), for
the schemas of bench/grammar_schemas.py:
  setup      building the library's view of the tokenizer (once per engine; imports excluded);
  compile    one schema to a grammar ready to match, cold (the library's own cache off), the
             median of --compile-repeats; the engine caches the result by schema
             (engine/grammar.py), so a repeated schema costs nothing;
  fill b=1   one bitmask row per token, along the tokens of the schema's instance: µs per token;
  fill b=64  64 matchers at different points of that walk, their rows filled in one batched call
             (the library's own threads; outlines-core has none: a loop): ms per step;
  accept     advancing a matcher by one token: µs.
The tokens are the instance's JSON text (json.dumps' separators, the engine's whitespace),
tokenized by the tokenizer, so every step is a real prefix of a valid document.

Engine (--engine): TorchEngineCore stepped in this process at --streams concurrent requests
(closed loop, --requests in all, --prompt-tokens random prompt ids, greedy), first with
response_format json_schema (--schema, default `order`; a request ends when its JSON does, or
at --output-tokens), then unconstrained on the same prompts with each request's output length
fixed to what it made constrained (ignore_eos): the same work but the grammar. Output tok/s of
each and their ratio [target on the GPU: >= 0.9 at 64 streams]; the grammar's first use (the
tokenizer view and the schema's compile, in the warm-up request), the compile time during the
run (0: every request hits the cache) and the host time filling masks
(TorchEngineCore.grammar_stats). Random weights of --shape (bench_stack.py's
build_model: Qwen2.5-1.5B shape with the Qwen tokenizer; tiny under --smoke).

Prints a table and writes JSON to --out-dir/grammar-<time>.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ siblings, run as a script or imported

from grammar_libraries import LIBRARIES  # noqa: E402
from grammar_schemas import SCHEMAS  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
BATCH = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libraries", default=",".join(LIBRARIES), help="(default: %(default)s)")
    parser.add_argument("--tokenizers", default="default,qwen3",
                        help="default (the default model's), qwen3, or tokenizer directories (default: %(default)s)")
    parser.add_argument("--compile-repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="batched fill steps at b=64 (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    engine = parser.add_argument_group("engine (--engine)")
    engine.add_argument("--engine", action="store_true", help="constrained vs unconstrained tok/s on the engine")
    engine.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few requests")
    engine.add_argument("--shape", default="qwen2.5-1.5b")
    engine.add_argument("--tokenizer", type=Path, default=None, help="for --shape (default: the Qwen one)")
    engine.add_argument("--device", default="cuda")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--streams", type=int, default=64)
    engine.add_argument("--requests", type=int, default=256)
    engine.add_argument("--prompt-tokens", type=int, default=256)
    engine.add_argument("--output-tokens", type=int, default=256)
    engine.add_argument("--schema", default="order", choices=[name for name in SCHEMAS if name != "json_object"])
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.device, args.streams, args.requests, args.prompt_tokens, args.output_tokens = "tiny", "cpu", 4, 8, 16, 48
    return args


# --- libraries -------------------------------------------------------------------------------


def load_tokenizer(name: str):
    """(label, transformers tokenizer, its eos ids) for --tokenizers' names."""
    from transformers import PreTrainedTokenizerFast

    if name == "default":
        from llmserve.tools.model_store import resolve_model

        directory = resolve_model(None)
    elif name == "qwen3":
        from bench_stack import qwen_tokenizer_dir

        directory = qwen_tokenizer_dir()
    else:
        directory = Path(name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), eos_token=_text(config.get("eos_token")))
    return name if name in ("default", "qwen3") else directory.name, tokenizer, [tokenizer.eos_token_id]


def _text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def measure_library(library_cls, tokenizer, eos_ids: list[int], args) -> dict:
    vocab_size = len(tokenizer)
    for module in library_cls.modules:  # an ImportError says it is not installed; imports are not setup
        importlib.import_module(module)
    started = time.perf_counter()
    library = library_cls(tokenizer, vocab_size, eos_ids)
    result = {"library": library.name, "vocab_size": vocab_size, "setup_s": time.perf_counter() - started, "schemas": {}}
    for name, (schema, instance) in SCHEMAS.items():
        try:
            result["schemas"][name] = measure_schema(library, schema, instance, tokenizer, vocab_size, args)
        except Exception as error:  # a library that cannot compile a schema: reported, not fatal
            result["schemas"][name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
        print(f"  {library.name} {name}: {result['schemas'][name]}", flush=True)
    return result


def measure_schema(library, schema, instance, tokenizer, vocab_size: int, args) -> dict:
    compile_s = []
    for _ in range(args.compile_repeats):
        started = time.perf_counter()
        compiled = library.compile(schema)
        compile_s.append(time.perf_counter() - started)
    walk = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
    width = (vocab_size + 31) // 32
    # batch 1: fill, then accept, along the walk
    matcher = library.matcher(compiled)
    row = torch.zeros((1, width), dtype=torch.int32)
    fill_s, accept_s = [], []
    for token_id in walk:
        started = time.perf_counter()
        library.fill([matcher], row)
        fill_s.append(time.perf_counter() - started)
        if not _allows(row[0], token_id):
            raise AssertionError(f"the mask refuses token {token_id} of the instance")
        started = time.perf_counter()
        if not library.accept(matcher, token_id):
            raise AssertionError(f"the matcher refused token {token_id} of the instance")
        accept_s.append(time.perf_counter() - started)
    library.fill([matcher], row)
    if not any(_allows(row[0], eos) for eos in tokenizer.all_special_ids):
        raise AssertionError("no stop token is allowed once the instance is complete")
    # batch 64: matchers spread along the walk, all filled per step
    matchers, positions = [], []
    for i in range(BATCH):
        m = library.matcher(compiled)
        position = (i * len(walk)) // BATCH
        for token_id in walk[:position]:
            library.accept(m, token_id)
        matchers.append(m)
        positions.append(position)
    bitmask = torch.zeros((BATCH, width), dtype=torch.int32)
    step_s = []
    for _ in range(args.steps):
        started = time.perf_counter()
        library.fill(matchers, bitmask)
        step_s.append(time.perf_counter() - started)
        for i, m in enumerate(matchers):
            if positions[i] == len(walk):
                library.reset(m)
                positions[i] = 0
            library.accept(m, walk[positions[i]])
            positions[i] += 1
    return {
        "compile_ms": statistics.median(compile_s) * 1e3,
        "compile_first_ms": compile_s[0] * 1e3,
        "walk_tokens": len(walk),
        "fill_b1_us": statistics.mean(fill_s) * 1e6,
        "fill_b64_ms": statistics.median(step_s) * 1e3,
        "accept_us": statistics.mean(accept_s) * 1e6,
    }


def _allows(row: torch.Tensor, token_id: int) -> bool:
    return bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


def library_table(results: list[dict]) -> str:
    names = list(SCHEMAS)
    lines = [
        "| tokenizer | library | setup s | compile ms (" + " / ".join(names) + ") | fill µs/token b=1 | fill ms/step b=64 | accept µs |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        cells = [r["schemas"][n] for n in names]
        ok = [c for c in cells if "error" not in c]
        compile_ms = " / ".join("n/a" if "error" in c else f"{c['compile_ms']:.1f}" for c in cells)
        mean = lambda key: statistics.mean(c[key] for c in ok) if ok else float("nan")  # noqa: E731
        lines.append(
            f"| {r['tokenizer']} ({r['vocab_size']}) | {r['library']} | {r['setup_s']:.2f} | {compile_ms} | "
            f"{mean('fill_b1_us'):.0f} | {mean('fill_b64_ms'):.2f} | {mean('accept_us'):.0f} |"
        )
    return "\n".join(lines)


def run_libraries(args) -> dict:
    results = []
    for name in args.tokenizers.split(","):
        label, tokenizer, eos_ids = load_tokenizer(name)
        for library_name in args.libraries.split(","):
            try:
                library_cls = LIBRARIES[library_name]
                results.append({"tokenizer": label, **measure_library(library_cls, tokenizer, eos_ids, args)})
            except ImportError as error:
                print(f"  {library_name}: not installed ({error})", flush=True)
    print(library_table(results))
    return {"libraries": results}


# --- engine ----------------------------------------------------------------------------------


def run_engine(args) -> dict:
    """The constrained run first; then the unconstrained one on the same prompts with each
    request's output length fixed to what the constrained run made (ignore_eos): the same
    prefill and decode work, so the ratio is what the grammar costs."""
    import tempfile

    from bench_stack import build_model, free_device_memory

    with tempfile.TemporaryDirectory() as out_dir:
        model_dir = build_model(args, Path(out_dir) / "model")
        constrained = engine_run(model_dir, args, schema=SCHEMAS[args.schema][0], lengths=None)
        free_device_memory()  # the next engine sizes its KV pool from what is free
        unconstrained = engine_run(model_dir, args, schema=None, lengths=constrained.pop("lengths"))
    runs = [unconstrained, constrained]
    unconstrained.pop("lengths")
    ratio = constrained["output_tokens_per_s"] / unconstrained["output_tokens_per_s"]
    print("| run | requests | output tokens | wall s | output tok/s | grammar first use s | compile s (cache hits) "
          "| mask fill s | ended by the grammar |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in runs:
        print(f"| {run['name']} | {run['num_requests']} | {run['num_output_tokens']} | {run['wall_s']:.2f} | "
              f"{run['output_tokens_per_s']:.0f} | {run['first_use_s']:.3f} | {run['compile_s']:.3f} ({run['num_cache_hits']}) | "
              f"{run['mask_fill_s']:.3f} | {run['num_stopped']} |")
    print(f"json_schema / unconstrained output tok/s at {args.streams} streams: {ratio:.3f} (target >= 0.9 on the GPU)")
    return {"engine": runs, "ratio": ratio}


def engine_run(model_dir: Path, args, schema: dict | None, lengths: list[int] | None) -> dict:
    """A closed loop of args.requests requests, args.streams at a time, greedy. `schema`: each
    request's json_schema (output up to --output-tokens); else free text of lengths[i] tokens."""
    from llmserve.inference.engine.config import EngineConfig, default_dtype
    from llmserve.inference.engine.torch_engine import TorchEngineCore
    from llmserve.inference.engine.types import EngineRequest
    from llmserve.sampling import ResponseFormat, SamplingParams

    config = EngineConfig(model_path=model_dir, model_name="bench", device=args.device, dtype=default_dtype(args.device),
                          max_num_seqs=max(args.streams, 8), seed=args.seed)
    engine = TorchEngineCore(config)
    response_format = None if schema is None else ResponseFormat(json_schema=json.dumps(schema), name=args.schema)
    vocab = min(engine.model_info.vocab_size, 1000)

    def new_request(index: int) -> EngineRequest:
        prompt = torch.randint(10, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(index)).tolist()
        if response_format is not None:
            max_tokens = args.output_tokens if index >= 0 else 4
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, response_format=response_format)
        else:
            sampling = SamplingParams(max_tokens=max(1, lengths[index]) if index >= 0 else 4, temperature=0.0, ignore_eos=True)
        return EngineRequest(f"r{index}", prompt, sampling, time.monotonic_ns())

    # Warm-up, untimed: a full batch of short requests, so that the kernels' first use at this
    # batch size (and the grammar's tokenizer view) falls in neither run; without it the run
    # that goes first pays them.
    for index in range(-1, -1 - min(args.streams, args.requests), -1):
        engine.add_request(new_request(index))
    while engine.has_requests_in_flight():
        engine.step()
    stats = engine.grammar_stats()
    first_use_s, fill_before, hits_before = stats.compile_s, stats.mask_fill_s, stats.num_cache_hits
    made = [0] * args.requests
    num_started = num_stopped = 0
    started = time.perf_counter()
    while num_started < min(args.streams, args.requests):
        engine.add_request(new_request(num_started))
        num_started += 1
    while engine.has_requests_in_flight():
        for output in engine.step():
            made[int(output.request_id[1:])] += len(output.new_token_ids)
            if output.is_finished:
                num_stopped += output.finish_reason.value == "stop"
                if num_started < args.requests:
                    engine.add_request(new_request(num_started))
                    num_started += 1
    wall_s = time.perf_counter() - started
    return {
        "name": "unconstrained (same lengths)" if schema is None else f"json_schema ({args.schema})",
        "num_requests": num_started, "num_output_tokens": sum(made), "wall_s": wall_s,
        "output_tokens_per_s": sum(made) / wall_s, "num_stopped": num_stopped if schema is not None else 0,
        "first_use_s": first_use_s, "compile_s": stats.compile_s - first_use_s,
        "num_cache_hits": stats.num_cache_hits - hits_before, "mask_fill_s": stats.mask_fill_s - fill_before,
        "lengths": made,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = {"config": {k: str(v) for k, v in vars(args).items()}}
    report.update(run_engine(args) if args.engine else run_libraries(args))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"grammar-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
