"""Engine configuration: built once by the inference service's __main__ and passed down.

Each field a user may set carries its command-line flag (`EngineFlag`) as dataclass metadata:
this is the one declaration of an engine flag. llmserve.inference.engine_flags builds from it the
inference service's flags, `llmserve serve`'s flags and the argv the launcher hands the service.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmserve.block_hash import DEFAULT_BLOCK_SIZE
from llmserve.buckets import DEFAULT_BUCKET_BOUNDS, LENGTH_BUCKETS_FLAG, BucketConfig

BACKENDS = ("torch", "hf", "trtllm")
# torch backend attention/small-op implementation (models/attention_backend.py): "auto" = the
# Triton kernels on CUDA when triton imports, else the portable path; "triton" requires them;
# "portable" forces the portable path (any device).
ATTENTION_BACKENDS = ("auto", "portable", "triton")
# KV-cache element type: "auto" = the model dtype; "fp8" = float8 e4m3 with scale 1 (half the
# bytes attention reads per step; needs the triton backend).
KV_CACHE_DTYPES = ("auto", "fp8")
# Linear-layer weights (the lm_head and embeddings stay in the model dtype):
#   none  the model dtype;
#   fp8   W8A8: float8 e4m3 weights with per-output-channel scales, activations quantized per
#         token at run time, float8 tensor-core GEMMs (CUDA, compute capability >= 8.9);
#   int8  W8A16 weight-only: int8 weights with per-output-channel scales, dequantized inside
#         the GEMM (halves the bytes a decode step streams).
QUANTIZATIONS = ("none", "fp8", "int8")
DTYPES = ("float32", "bfloat16", "float16")

# The groups flags are listed under in --help.
MODEL_GROUP = "model"
ENGINE_GROUP = "engine (torch backend; hf ignores what it has no use for)"
KERNELS_GROUP = "kernels and precision (torch backend)"
ADMISSION_GROUP = "admission (what a replica accepts before refusing with a retry hint)"

# Requests admitted but not yet producing tokens, when --max-waiting-requests is unset: a full
# batch (--max-num-seqs) on an accelerator, so a burst of that many streams starts without a
# refusal (a GPU starts them within a few steps). A CPU steps ~100x slower and every sequence
# slows its steps: 128 short requests on the default model took 23-60 s on a loaded 2-core CPU,
# 32 take a few seconds; beyond that the measured pace decides (admission.py).
CPU_MAX_WAITING_REQUESTS = 32
DEFAULT_MAX_NUM_SEQS = 256
# Unset --max-waiting-prompt-tokens: this many contexts' worth, so any prompt that fits the
# context is admissible and a few long documents can queue at once; and at least
# WAITING_PROMPT_TOKENS_PER_REQUEST per admissible waiting request, so a burst of
# --max-waiting-requests ordinary prompts is not refused for its tokens (measured on the H200:
# 256 streams of 1000-token prompts on an 8k-context model were refused at 4 contexts, 32k
# tokens, although the engine prefills them in seconds).
WAITING_PROMPT_CONTEXTS = 4
WAITING_PROMPT_TOKENS_PER_REQUEST = 2048
# At 1.0 the admitted requests fit the KV pool together at their full length: none is preempted.
DEFAULT_KV_OVERCOMMIT = 1.0


@dataclass(frozen=True, slots=True)
class EngineFlag:
    """How one EngineConfig field is spelled on the command line.

    A bool field that defaults to True is turned off by its flag (`--no-prefix-caching`); one
    that defaults to False is turned on by it. A field whose default is None says in `help`
    what None means; so does an `unset_by_default` flag, whose None engine_flags resolves.
    """

    name: str
    help: str
    group: str = ENGINE_GROUP
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    unset_by_default: bool = False


FLAG = "flag"  # the metadata key of a field's EngineFlag


def _flagged(default, name: str, help: str, **flag_options):
    return field(default=default, metadata={FLAG: EngineFlag(name, help, **flag_options)})


def default_max_waiting_requests(device: str, max_num_seqs: int) -> int:
    """What an unset --max-waiting-requests means on `device`."""
    return CPU_MAX_WAITING_REQUESTS if device == "cpu" else max_num_seqs


def default_async_scheduling(device: str) -> bool:
    """What an unset --no-async-scheduling means on `device`: on where a device computes while
    the host schedules. On a CPU the forward runs on the host thread that would overlap it, so
    launching step N+1 before step N's tokens go out adds a whole forward to every token's
    latency (the first token's included) and overlaps nothing."""
    return device.startswith("cuda")


def default_dtype(device: str) -> str:
    """The dtype an unset --dtype means on `device`."""
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_path: Path  # local HF checkpoint directory (config.json, *.safetensors, tokenizer.json)
    model_name: str
    backend: str = _flagged(
        "torch", "--backend", "engine: torch (ours: paged KV, continuous batching), hf (transformers "
        "baseline) or trtllm (TensorRT-LLM, where installed)",
        group=MODEL_GROUP, choices=BACKENDS,
    )  # fmt: skip
    device: str = _flagged("cpu", "--device", "cpu, cuda or cuda:N", group=MODEL_GROUP)
    # One engine-core process per rank (engine/rank_worker.py, docs/parallelism.md).
    tensor_parallel_size: int = _flagged(
        1, "--tensor-parallel-size", "torch backend: split the model's heads, MLP and vocabulary over N "
        "processes, one per GPU (--device cuda:B: rank r on cuda:B+r, B 0 for cuda; NCCL) or N CPU processes (gloo); "
        "every rank keeps its own KV pool; rank 0 schedules",
        group=MODEL_GROUP, metavar="N",
    )  # fmt: skip
    dtype: str = _flagged(
        "float32", "--dtype", "weights and activations (default: float32 on cpu, bfloat16 on cuda)",
        group=MODEL_GROUP, choices=DTYPES, unset_by_default=True,  # unset: default_dtype(device)
    )  # fmt: skip
    max_context_tokens: int | None = _flagged(
        None, "--max-context-tokens", "largest prompt + output in tokens (default: the model's context; "
        "--max-model-len is vLLM's name)",
        group=MODEL_GROUP, metavar="TOKENS", aliases=("--max-model-len",),
    )  # fmt: skip
    seed: int = _flagged(0, "--seed", "engine seed for requests that bring none", group=MODEL_GROUP)
    block_size_tokens: int = _flagged(DEFAULT_BLOCK_SIZE, "--block-size", "tokens per KV block", metavar="TOKENS")
    # KV pool size: an explicit block count wins; otherwise a fraction of free device memory
    # (CUDA) or a byte budget (CPU).
    num_kv_blocks: int | None = _flagged(
        None, "--num-kv-blocks", "KV pool size in blocks (default: --kv-memory-fraction on CUDA, a byte "
        "budget on CPU)",
        metavar="N",
    )  # fmt: skip
    kv_memory_fraction: float = _flagged(
        0.9, "--kv-memory-fraction", "CUDA: share of the GPU memory free after loading the weights that "
        "the KV pool takes",
        metavar="FRACTION",
    )  # fmt: skip
    kv_cpu_memory_bytes: int = 2 * 1024**3
    max_num_seqs: int = _flagged(DEFAULT_MAX_NUM_SEQS, "--max-num-seqs", "most sequences running at once", metavar="N")
    max_batched_tokens: int = _flagged(
        2048, "--max-batched-tokens", "per-step token budget: prefill chunks plus decodes", metavar="TOKENS"
    )
    length_buckets: str = _flagged(
        ",".join(map(str, DEFAULT_BUCKET_BOUNDS)), LENGTH_BUCKETS_FLAG, "prompt-length bucket upper bounds "
        "in tokens, increasing (cut at the context): the waiting queue keeps one queue per bucket and "
        "admits from them in turn, so short prompts do not wait behind long documents; preprocess "
        "takes the same flag, and must get the same value",
        metavar="N,N,...",
    )  # fmt: skip
    enable_prefix_caching: bool = _flagged(True, "--no-prefix-caching", "do not reuse KV blocks of shared prefixes")
    enable_chunked_prefill: bool = True
    # The KV pool in a transport region (docs/transport.md, "KV pull"): co-located replicas pull
    # each other's prefix blocks instead of recomputing them. Off by default: on CPU the pool is
    # a /dev/shm segment, which must fit the container's shm size.
    kv_pull: bool = _flagged(
        False, "--kv-pull", "export the KV pool so that co-located replicas pull prefix blocks from it, "
        "and pull them from others when a request names a source (PinKvBlocks). On CPU the pool is "
        "allocated in /dev/shm: the container's /dev/shm must hold it (see --num-kv-blocks); on CUDA "
        "it is exported by CUDA IPC (same GPU or peer access, one IPC namespace)",
    )  # fmt: skip
    # A pin answered while the source's loop is inside a step (engine/mid_step_calls.py).
    mid_step_calls: bool = _flagged(
        True, "--no-mid-step-calls", "with --kv-pull, answer other replicas' pins only between two "
        "engine steps, as every other command (by default a thread of the engine-core process answers "
        "them during a step's forward and its wait for the device: a pin does not wait for the step in "
        "progress); for comparison and debugging",
    )  # fmt: skip
    enforce_eager: bool = _flagged(False, "--enforce-eager", "CUDA: skip CUDA-graph capture")
    # On the H200 (1.5B shape) a mixed step takes 0.30-0.47x the eager one, the served stack at
    # 256 streams went from 0.82-0.91x of the core loop to 0.98-1.05x, and the capture takes
    # ~0.6 s and ~0.15 GiB (docs/benchmarks.md, "Twelfth session").
    piecewise_graphs: bool = _flagged(
        True, "--no-piecewise-graphs", "CUDA, triton attention backend: capture only the whole-forward "
        "graphs (decode steps, one-chunk prefills); by default the model is also captured between its "
        "attention calls, per padded token count up to 2048, so steps those graphs do not take "
        "(decodes and prefill chunks in one step, several chunks) replay the pieces instead of "
        "launching every kernel from Python (engine/piecewise_graphs.py)",
        group=KERNELS_GROUP,
    )  # fmt: skip
    # The core's own process keeps the step loop off the GIL that gRPC serving holds
    # (engine/engine_process.py says what it measured).
    core_process: bool = _flagged(
        True, "--no-core-process", "run the engine core on a thread of the server process instead of a "
        "process of its own (one GIL for the step loop and gRPC serving: slower from ~32 streams up)",
    )  # fmt: skip
    # CPU work of step N+1 (scheduling, input staging, streaming step N's tokens) runs while
    # the device computes step N. Unset on the command line: default_async_scheduling(device).
    async_scheduling: bool = _flagged(
        True, "--no-async-scheduling", "run one step at a time (default on cpu, where the device is the "
        "host: nothing overlaps, and each token would wait for the next step's forward); on cuda the "
        "default overlaps the host's work on the next step (scheduling, input staging, streaming this "
        "step's tokens) with the device's compute of this one; off is slower there but simpler to debug",
        unset_by_default=True,
    )  # fmt: skip
    attention_backend: str = _flagged(
        "auto", "--attention-backend", "attention and the small fused ops: triton = Triton kernels "
        "reading the paged KV cache in place, decode and small one-chunk prefill steps replayed as "
        "CUDA graphs unless "
        "--enforce-eager (CUDA; needs the triton package); portable = the portable path, any device; "
        "auto = triton on CUDA when triton imports, portable otherwise (always portable on CPU)",
        group=KERNELS_GROUP, choices=ATTENTION_BACKENDS,
    )  # fmt: skip
    kv_cache_dtype: str = _flagged(
        "auto", "--kv-cache-dtype", "KV cache element type: auto = the model dtype; fp8 = float8 e4m3 "
        "(scale 1), half the bytes of bfloat16, so twice the tokens fit and attention reads half as "
        "much per step, at a small accuracy cost (needs the triton attention backend, so CUDA)",
        group=KERNELS_GROUP, choices=KV_CACHE_DTYPES,
    )  # fmt: skip
    quantization: str = _flagged(
        "none", "--quantization", "linear-layer weights; the lm_head and embeddings stay in --dtype. "
        "none = --dtype; fp8 = W8A8: float8 e4m3 weights with per-output-channel scales, "
        "activations quantized per token at run time, float8 tensor-core GEMMs (CUDA, compute "
        "capability >= 8.9); int8 = W8A16 weight-only: int8 weights with per-output-channel "
        "scales, dequantized inside the GEMM (halves the weight bytes a decode step reads). Off "
        "CUDA both run a slow float32 reference of the same math (for tests)",
        group=KERNELS_GROUP, choices=QUANTIZATIONS,
    )  # fmt: skip

    max_waiting_requests: int | None = _flagged(
        None, "--max-waiting-requests", "most requests admitted but not yet producing tokens; more are "
        f"refused with RESOURCE_EXHAUSTED and a retry hint (default: --max-num-seqs, on cpu "
        f"{CPU_MAX_WAITING_REQUESTS})",
        group=ADMISSION_GROUP, metavar="N",
    )  # fmt: skip
    max_waiting_prompt_tokens: int | None = _flagged(
        None, "--max-waiting-prompt-tokens", "most prompt tokens of requests not yet producing tokens "
        f"(default: the larger of {WAITING_PROMPT_CONTEXTS} x the context and "
        f"{WAITING_PROMPT_TOKENS_PER_REQUEST} x --max-waiting-requests)",
        group=ADMISSION_GROUP, metavar="TOKENS",
    )  # fmt: skip
    kv_overcommit: float = _flagged(
        DEFAULT_KV_OVERCOMMIT, "--kv-overcommit", "KV blocks that admitted requests may need at their full length "
        "(prompt + max_tokens; prompt blocks shared by requests in flight count once), as a multiple of the "
        "pool; above 1 admits more but may preempt (recompute) running sequences when they all grow long",
        group=ADMISSION_GROUP, metavar="FACTOR",
    )  # fmt: skip
    deadline_admission: bool = _flagged(
        True, "--no-deadline-admission", "admit requests whose deadline the measured pace cannot meet "
        "(they end with DEADLINE_EXCEEDED when it passes) instead of refusing them at once with the "
        "estimate; for measuring what the refusals cost (bench/bench_overload.py)",
        group=ADMISSION_GROUP,
    )  # fmt: skip

    def __post_init__(self) -> None:
        for name, allowed in (
            ("backend", BACKENDS),
            ("attention_backend", ATTENTION_BACKENDS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("quantization", QUANTIZATIONS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("block_size_tokens", "tensor_parallel_size", "max_waiting_requests", "max_waiting_prompt_tokens", "kv_overcommit"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        BucketConfig.parse(self.length_buckets)  # raises ValueError on a malformed list
