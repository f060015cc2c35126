"""The `trtllm` backend: TensorRT-LLM's LLM API behind llmserve's async engine interface.

UNTESTED: TensorRT-LLM cannot be installed on our development machines or the GPU host (its
registry packages are stubs that download from a vendor index), so this module has never run.
It is written against the documented LLM API (tensorrt_llm.LLM, SamplingParams, KvCacheConfig,
RequestOutput / CompletionOutput) and imported only when `--backend trtllm` is chosen.

TensorRT-LLM brings its own scheduler (in-flight batching), paged KV cache with block reuse and
CUDA graphs, so it does not plug in as an EngineCore that our loop steps: TrtllmClient is a
core client of its own (the CoreClient of async_engine.py, like EngineThread and EngineProcess),
and AsyncEngine drives it like the others: admission, the table of requests in flight, metrics
and the consumers are the same for every backend. Each request is one task on the event loop
that reads LLM.generate_async and hands its outputs to AsyncEngine as CoreUpdates; the task
gives every sequence exactly one final output, as the engine loop does for the cores (CANCELLED
on an abort, DEADLINE at the request's deadline, ERROR when TensorRT-LLM fails).

KV cache events: with prefix caching on, KvCacheConfig(event_buffer_max_size=...) makes
TensorRT-LLM record them, and a task drains LLM.get_kv_cache_events_async into the updates,
translated to llmserve's block hashes (trtllm_kv_events.py; never run either).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from llmserve.block_hash import HashNamespace
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.engine_loop import CoreUpdate, Deliver
from llmserve.inference.engine.trtllm_kv_events import TrtllmKvEventTranslator
from llmserve.engine_output import EngineOutput
from llmserve.inference.engine.types import EngineLoad, EngineRequest, ModelInfo
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


@dataclass(slots=True)
class _Request:
    """One request's TensorRT-LLM result stream and how far its sequences got."""

    request: EngineRequest
    result: object  # tensorrt_llm's RequestOutput (async-iterable, abort())
    num_sent: list[int]  # per sequence: tokens handed on
    finished: set[int] = field(default_factory=set)  # sequences that had their final output
    first_token_ns: int = 0
    abort_reason: FinishReason | None = None  # set when we aborted it (cancel or deadline)


class TrtllmClient:
    """A core client over tensorrt_llm.LLM. Every public method runs on the event loop."""

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
        self._drains_kv_events = config.enable_prefix_caching
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
        self._requests: dict[str, _Request] = {}  # TensorRT-LLM's handle of each request it runs
        self._tasks: set[asyncio.Task] = set()
        self._kv_events = TrtllmKvEventTranslator(self.model_info.hash_namespace)
        self._deliver: Deliver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_running = False
        self._num_aborted_total = 0
        self._num_finished_total = 0

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        self._loop, self._deliver = loop, deliver
        self._is_running = True
        if self._drains_kv_events:
            self._spawn(self._drain_kv_events())

    @property
    def is_running(self) -> bool:
        return self._is_running

    async def stop(self) -> None:
        for request_id in list(self._requests):
            self._abort(request_id, FinishReason.CANCELLED)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=KV_EVENTS_DRAIN_TIMEOUT_S * 20)
        for task in list(self._tasks):
            task.cancel()
        self._is_running = False
        self._llm.shutdown()

    def add_request(self, request: EngineRequest) -> None:
        sampling = trt_sampling(self._trt_sampling_cls, request.sampling, self._eos_token_ids)
        result = self._llm.generate_async(request.prompt_token_ids, sampling, streaming=True)
        state = _Request(request, result, [0] * request.sampling.n)
        self._requests[request.request_id] = state
        if request.deadline_ns:
            delay_s = max(0.0, (request.deadline_ns - time.monotonic_ns()) / 1e9)
            self._loop.call_later(delay_s, self._abort, request.request_id, FinishReason.DEADLINE)
        self._spawn(self._forward(state))

    def abort_request(self, request_id: str) -> None:
        self._abort(request_id, FinishReason.CANCELLED)

    def load(self) -> EngineLoad:
        # The LLM API exposes no cheap per-call KV statistics; num_running counts the in-flight
        # requests.
        return EngineLoad(
            num_running=len(self._requests),
            num_waiting=0,
            kv_blocks_total=0,
            kv_blocks_used=0,
            num_aborted_total=self._num_aborted_total,
            num_finished_total=self._num_finished_total,
        )

    def _abort(self, request_id: str, reason: FinishReason) -> None:
        state = self._requests.get(request_id)
        if state is not None and state.abort_reason is None:
            state.abort_reason = reason
            state.result.abort()

    def _spawn(self, work) -> None:
        task = self._loop.create_task(work)
        self._tasks.add(task)  # kept so it is not garbage-collected mid-flight
        task.add_done_callback(self._tasks.discard)

    async def _forward(self, state: _Request) -> None:
        """Hand the request's outputs on as they stream; end every sequence exactly once."""
        error = ""
        try:
            async for output in state.result:
                outputs = [out for completion in output.outputs if (out := self._output(state, completion))]
                if outputs:
                    self._deliver(CoreUpdate(outputs, [], []))
        except Exception as exc:  # noqa: BLE001 — the request must still end with a final output
            log.exception("trtllm request %r failed", state.request.request_id)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self._end(state, error)

    def _output(self, state: _Request, completion) -> EngineOutput | None:
        """TensorRT-LLM's CompletionOutput → our output of its new tokens (None: nothing new)."""
        index, request = completion.index, state.request
        start = state.num_sent[index]
        new_ids = completion.token_ids[start:]
        state.num_sent[index] = len(completion.token_ids)
        if new_ids and not state.first_token_ns:
            state.first_token_ns = time.monotonic_ns()
        finish = _FINISH_REASONS.get(completion.finish_reason) if completion.finish_reason else None
        if finish is FinishReason.CANCELLED and state.abort_reason is not None:
            finish = state.abort_reason
        if index in state.finished or (not new_ids and finish is None):
            return None
        output = EngineOutput(
            request_id=request.request_id,
            sequence_index=index,
            new_token_ids=list(new_ids),
            logprobs=_logprobs(completion.logprobs, start),
            finish_reason=finish,
            stop_token_id=completion.stop_reason if isinstance(completion.stop_reason, int) else None,
        )
        if finish is not None:
            state.finished.add(index)
            _fill_final(output, state, len(completion.token_ids))
        return output

    def _end(self, state: _Request, error: str) -> None:
        """The stream ended: a final output for each sequence that had none."""
        request = state.request
        self._requests.pop(request.request_id, None)
        self._num_finished_total += 1
        self._num_aborted_total += state.abort_reason is not None
        reason = FinishReason.ERROR if error else (state.abort_reason or FinishReason.CANCELLED)
        finals = []
        for index in sorted(set(range(request.sampling.n)) - state.finished):
            output = EngineOutput(request.request_id, index, [], finish_reason=reason, error_message=error)
            _fill_final(output, state, state.num_sent[index])
            finals.append(output)
        if finals:
            self._deliver(CoreUpdate(finals, [], []))

    async def _drain_kv_events(self) -> None:
        """TensorRT-LLM's KV events into the updates, in llmserve's hashes, until stopped."""
        while True:
            raw = [event async for event in self._llm.get_kv_cache_events_async(timeout=KV_EVENTS_DRAIN_TIMEOUT_S)]
            events = self._kv_events.translate(raw)
            if events:
                self._deliver(CoreUpdate([], events, []))
            if not raw:
                await asyncio.sleep(KV_EVENTS_DRAIN_TIMEOUT_S)


def _fill_final(output: EngineOutput, state: _Request, num_completion_tokens: int) -> None:
    request, now_ns = state.request, time.monotonic_ns()
    output.num_prompt_tokens = len(request.prompt_token_ids)
    output.num_completion_tokens = num_completion_tokens
    output.time_to_first_token_ns = state.first_token_ns - request.arrival_ns if state.first_token_ns else 0
    output.total_time_ns = now_ns - request.arrival_ns
