"""The `trtllm` backend: TensorRT-LLM's LLM API behind llmserve's async engine interface.

UNTESTED: TensorRT-LLM cannot be installed on our development machines or the GPU host (its
registry packages are stubs that download from a vendor index), so this module has never run.
It is written against the documented LLM API (tensorrt_llm.LLM, SamplingParams, KvCacheConfig,
RequestOutput / CompletionOutput) and imported only when `--backend trtllm` is chosen.

TensorRT-LLM brings its own scheduler (in-flight batching), paged KV cache with block reuse and
CUDA graphs, so this class replaces AsyncEngine + EngineCore as a whole rather than plugging in
as a core: it offers the same public methods (start, shutdown, generate, abort, load,
model_info) that the servicer uses.

KV cache events: with prefix caching on, KvCacheConfig(event_buffer_max_size=...) makes
TensorRT-LLM record them, and a task drains LLM.get_kv_cache_events_async into the sink,
translated to llmserve's block hashes (trtllm_kv_events.py; never run either).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import AsyncIterator

from llmserve.block_hash import HashNamespace
from llmserve.errors import InvalidArgument, Unavailable
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.trtllm_kv_events import TrtllmKvEventTranslator
from llmserve.inference.engine.types import CacheEvent, EngineLoad, EngineOutput, EngineRequest, ModelInfo
from llmserve.model_files import ModelFiles
from llmserve.sampling import FinishReason, SamplingParams, TokenLogprob, TopLogprob

log = logging.getLogger(__name__)

# KV events TensorRT-LLM buffers between drains (older ones are dropped: a gap in the index that
# the next snapshot after a resubscribe repairs), and the longest a drain waits for one.
KV_EVENT_BUFFER_SIZE = 16384
KV_EVENTS_DRAIN_TIMEOUT_S = 0.05

# CompletionOutput.finish_reason → ours. "timeout" is TensorRT-LLM's own per-request timeout.
_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.CANCELLED,
    "timeout": FinishReason.CANCELLED,
}


def _import_trtllm():
    try:
        from tensorrt_llm import LLM, SamplingParams as TrtSamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig
    except ImportError as exc:  # ModuleNotFoundError or a broken CUDA/TensorRT install
        raise ImportError(
            f"the trtllm backend needs TensorRT-LLM (`import tensorrt_llm` failed: {exc}); "
            "install it from NVIDIA's index on a CUDA host, or use --backend torch"
        ) from exc
    return LLM, TrtSamplingParams, KvCacheConfig


def trt_sampling(trt_sampling_cls, params: SamplingParams, eos_token_ids: tuple[int, ...]):
    """Our resolved SamplingParams → tensorrt_llm.SamplingParams (token ids in and out).
    `trt_sampling_cls` is that class, passed in: tensorrt_llm is imported only when the backend
    starts (and the mapping is tested without it)."""
    greedy = params.is_greedy
    return trt_sampling_cls(
        max_tokens=params.max_tokens,
        end_id=eos_token_ids[0] if eos_token_ids and not params.ignore_eos else -1,
        stop_token_ids=list(params.stop_token_ids) + list(eos_token_ids[1:]) if not params.ignore_eos else list(params.stop_token_ids),
        # Greedy is top-k 1: the one definition every TensorRT-LLM sampler agrees on.
        temperature=None if greedy else params.temperature,
        top_k=1 if greedy else (params.top_k or None),
        top_p=None if greedy else params.top_p,
        min_p=params.min_p or None,
        seed=params.seed,
        min_tokens=params.min_tokens or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
        logprobs=params.logprobs,
        n=params.n,
        # Stop strings are applied by the gateway; the engine works on token ids only.
        detokenize=False,
    )


def _logprobs(raw, start: int) -> list[TokenLogprob] | None:
    """CompletionOutput.logprobs (list of {token_id: Logprob}) from index `start` → ours."""
    if not raw:
        return None
    items = []
    for position in raw[start:]:
        ranked = sorted(position.items(), key=lambda kv: -kv[1].logprob)
        chosen = next((tid for tid, lp in position.items() if getattr(lp, "rank", None) is None), ranked[0][0])
        items.append(
            TokenLogprob(
                token_id=chosen,
                logprob=position[chosen].logprob,
                top_logprobs=tuple(TopLogprob(tid, lp.logprob) for tid, lp in ranked),
            )
        )
    return items


class TrtllmEngine:
    """Async engine over tensorrt_llm.LLM. Every public method runs on the event loop."""

    def __init__(self, config: EngineConfig):
        llm_cls, self._trt_sampling_cls, kv_cache_config_cls = _import_trtllm()
        files = ModelFiles.load(config.model_path, config.model_name)
        self._eos_token_ids = files.eos_token_ids
        # TensorRT-LLM builds (or loads) its engine from the HF checkpoint directory itself.
        self._llm = llm_cls(
            model=str(config.model_path),
            skip_tokenizer_init=True,
            dtype={"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[config.dtype],
            max_batch_size=config.max_num_seqs,
            max_num_tokens=config.max_batched_tokens,
            max_seq_len=config.max_context_tokens or files.max_context_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            kv_cache_config=kv_cache_config_cls(
                free_gpu_memory_fraction=config.kv_memory_fraction,
                enable_block_reuse=config.enable_prefix_caching,
                tokens_per_block=config.block_size_tokens,
                event_buffer_max_size=KV_EVENT_BUFFER_SIZE if config.enable_prefix_caching else 0,
            ),
        )
        self.model_info = ModelInfo(
            model_name=files.model_name,
            architecture=files.architecture,
            max_context_tokens=config.max_context_tokens or files.max_context_tokens,
            vocab_size=files.vocab_size,
            eos_token_ids=files.eos_token_ids,
            block_size_tokens=config.block_size_tokens,
            dtype=config.dtype,
            backend="trtllm",
            device=config.device,
            hash_namespace=HashNamespace.of_model_dir(files.path, config.block_size_tokens),
        )
        self._results: dict[str, object] = {}  # request_id → RequestOutput, for each in-flight request
        self._forwarders: dict[str, asyncio.Task] = {}  # request_id → its submit() task
        self._kv_events = TrtllmKvEventTranslator(self.model_info.hash_namespace)
        self._kv_event_drain: asyncio.Task | None = None
        self._is_accepting = False
        self._num_aborted_total = 0
        self._num_finished_total = 0

    async def start(self) -> None:
        self._is_accepting = True

    async def shutdown(self, drain_timeout_s: float) -> None:
        self._is_accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._results and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._results):
            self.abort(request_id)
        if self._kv_event_drain is not None:
            self._kv_event_drain.cancel()
        self._llm.shutdown()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if not self._is_accepting:
            raise Unavailable("the inference engine is shutting down")
        if request.request_id in self._results:
            raise InvalidArgument("request_id", f"{request.request_id!r} is already in flight")
        sampling = trt_sampling(self._trt_sampling_cls, request.sampling, self._eos_token_ids)
        result = self._llm.generate_async(request.prompt_token_ids, sampling, streaming=True)
        self._results[request.request_id] = result
        num_sent = [0] * request.sampling.n
        first_token_ns = 0
        try:
            async for output in result:
                for completion in output.outputs:
                    new_ids = completion.token_ids[num_sent[completion.index] :]
                    if new_ids and not first_token_ns:
                        first_token_ns = time.monotonic_ns()
                    start = num_sent[completion.index]
                    num_sent[completion.index] = len(completion.token_ids)
                    finish = _FINISH_REASONS.get(completion.finish_reason) if completion.finish_reason else None
                    if not new_ids and finish is None:
                        continue
                    now_ns = time.monotonic_ns()
                    yield EngineOutput(
                        request_id=request.request_id,
                        sequence_index=completion.index,
                        new_token_ids=list(new_ids),
                        logprobs=_logprobs(completion.logprobs, start),
                        finish_reason=finish,
                        stop_token_id=completion.stop_reason if isinstance(completion.stop_reason, int) else None,
                        num_prompt_tokens=len(request.prompt_token_ids) if finish else 0,
                        num_completion_tokens=len(completion.token_ids) if finish else 0,
                        time_to_first_token_ns=(first_token_ns - request.arrival_ns) if finish and first_token_ns else 0,
                        total_time_ns=(now_ns - request.arrival_ns) if finish else 0,
                    )
        finally:
            self._results.pop(request.request_id, None)
            self._num_finished_total += 1
            if not result.finished:
                result.abort()
                self._num_aborted_total += 1

    def submit(self, request: EngineRequest, on_output: Callable[[EngineOutput], None]) -> None:
        """AsyncEngine.submit's contract on top of generate(): a task forwards the outputs."""
        if not self._is_accepting:
            raise Unavailable("the inference engine is shutting down")
        if request.request_id in self._results or request.request_id in self._forwarders:
            raise InvalidArgument("request_id", f"{request.request_id!r} is already in flight")
        task = asyncio.get_running_loop().create_task(self._forward(request, on_output))
        self._forwarders[request.request_id] = task
        task.add_done_callback(lambda _: self._forwarders.pop(request.request_id, None))

    async def _forward(self, request: EngineRequest, on_output: Callable[[EngineOutput], None]) -> None:
        finished_indexes: set[int] = set()
        try:
            async for output in self.generate(request):
                if output.is_finished:
                    finished_indexes.add(output.sequence_index)
                on_output(output)
        except Exception as exc:  # noqa: BLE001 — the request must still end with a final output
            log.exception("trtllm request %r failed", request.request_id)
            for index in sorted(set(range(request.sampling.n)) - finished_indexes):
                on_output(EngineOutput(request.request_id, index, [], finish_reason=FinishReason.ERROR,
                                       error_message=f"{type(exc).__name__}: {exc}"))

    def detach(self, request_id: str) -> None:
        """The consumer left: cancelling the forwarder leaves generate(), which aborts."""
        task = self._forwarders.get(request_id)
        if task is not None:
            task.cancel()

    def abort(self, request_id: str) -> bool:
        result = self._results.get(request_id)
        if result is None:
            return False
        result.abort()
        return True

    def forward_kv_events(self, sink: Callable[[list[CacheEvent]], None]) -> None:
        """Drain TensorRT-LLM's KV events into `sink`, in llmserve's hashes, until shutdown."""
        self._kv_event_drain = asyncio.get_running_loop().create_task(self._drain_kv_events(sink))

    async def _drain_kv_events(self, sink: Callable[[list[CacheEvent]], None]) -> None:
        while True:
            raw = [event async for event in self._llm.get_kv_cache_events_async(timeout=KV_EVENTS_DRAIN_TIMEOUT_S)]
            events = self._kv_events.translate(raw)
            if events:
                sink(events)
            if not raw:
                await asyncio.sleep(KV_EVENTS_DRAIN_TIMEOUT_S)

    def load(self) -> EngineLoad:
        # The LLM API exposes no cheap per-call KV statistics; num_running counts the in-flight
        # requests.
        return EngineLoad(
            num_running=len(self._results),
            num_waiting=0,
            kv_blocks_total=0,
            kv_blocks_used=0,
            num_aborted_total=self._num_aborted_total,
            num_finished_total=self._num_finished_total,
        )
