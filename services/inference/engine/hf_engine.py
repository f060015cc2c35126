"""HFEngineCore: the baseline and correctness oracle, on transformers' AutoModelForCausalLM.

Deliberately the simplest correct engine: first come first served, one sequence at a time,
one token per `step()` (so an abort takes effect between any two tokens), the model's own
KV cache (`DynamicCache`) instead of a paged pool. A request with n > 1 runs its sequences one
after another, each from a fresh prefill of the prompt. Priority is ignored.

Logits processing, in order, on float32 logits of the last position:
  1. repetition penalty over prompt + output tokens (divide positive logits, multiply negative);
  2. frequency and presence penalties over output tokens;
  3. while fewer than min_tokens were generated: EOS (unless ignore_eos) and stop token ids → -inf;
  4. temperature (skipped when greedy).
Logprobs are the log_softmax of these processed logits: the sampling distribution before
top-k / top-p / min-p truncation (as common.proto's TopLogprob says). With greedy decoding and
no penalties they equal the log_softmax of the model's raw logits. Truncation then applies to
the probabilities and a token is drawn with the request's own torch.Generator.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.stop import finish_at_token, stop_token_ids
from llmserve.inference.engine.types import EngineLoad, EngineOutput, EngineRequest, ModelInfo
from llmserve.model_files import ModelFiles
from llmserve.sampling import SamplingParams, TokenLogprob, TopLogprob

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFStepError(RuntimeError):
    """A step failed for specific requests; AsyncEngine fails only `request_ids`."""

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = request_ids


@dataclass(slots=True)
class _Request:
    request: EngineRequest
    generator: torch.Generator  # one random stream per request, shared by its sequences in order
    first_scheduled_ns: int = 0


@dataclass(slots=True)
class _Sequence:
    """The one sequence being generated now."""

    owner: _Request
    index: int  # sequence_index within the request
    output_token_ids: list[int] = field(default_factory=list)
    kv_cache: Any = None  # the model's cache object; None before the prefill
    first_token_ns: int = 0

    @property
    def request_id(self) -> str:
        return self.owner.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.owner.request.sampling


class HFEngineCore:
    """EngineCore on transformers. Not thread-safe: AsyncEngine calls it from its thread only."""

    def __init__(self, config: EngineConfig):
        self._config = config
        self._device = _resolve_device(config.device)
        files = ModelFiles.load(config.model_path, config.model_name)
        self._model = _load_model(files, config.dtype, self._device)
        self._cache_kwarg, self._logits_kwargs = _forward_kwargs(self._model)
        vocab_size = self._model.get_output_embeddings().weight.shape[0]
        max_context_tokens = files.max_context_tokens
        if config.max_context_tokens is not None:
            max_context_tokens = min(max_context_tokens, config.max_context_tokens)
        self.model_info = ModelInfo(
            model_name=config.model_name or files.model_name,
            architecture=files.architecture,
            max_context_tokens=max_context_tokens,
            vocab_size=vocab_size,
            eos_token_ids=files.eos_token_ids,
            block_size_tokens=config.block_size_tokens,
            dtype=config.dtype,
            backend="hf",
            device=str(self._device),
        )
        self._eos_token_ids = frozenset(files.eos_token_ids)
        self._waiting: deque[_Request] = deque()
        self._running: _Sequence | None = None
        self._num_requests_added = 0  # seeds requests that bring none: config.seed + this
        self._num_aborted_total = 0
        self._num_finished_total = 0

    # --- EngineCore interface -------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        assert request.prompt_token_ids, "the servicer rejects empty prompts"
        seed = request.sampling.seed
        if seed is None:
            seed = self._config.seed + self._num_requests_added
        self._num_requests_added += 1
        generator = torch.Generator(device=self._device)
        generator.manual_seed(seed)
        self._waiting.append(_Request(request=request, generator=generator))

    def abort_request(self, request_id: str) -> bool:
        if self._running is not None and self._running.request_id == request_id:
            self._running = None  # drops the KV cache with it
            self._count_done(aborted=True)
            return True
        for pending in self._waiting:
            if pending.request.request_id == request_id:
                self._waiting.remove(pending)
                self._count_done(aborted=True)
                return True
        return False

    def has_unfinished_requests(self) -> bool:
        return self._running is not None or bool(self._waiting)

    def step(self) -> list[EngineOutput]:
        """Generate one token of the current sequence (prefilling it first if new)."""
        if self._running is None and not self._schedule_next():
            return []
        sequence = self._running
        try:
            token_id, logprob = self._generate_token(sequence)
        except Exception as exc:
            raise HFStepError(f"{type(exc).__name__}: {exc}", [sequence.request_id]) from exc
        return [self._update(sequence, token_id, logprob)]

    def load(self) -> EngineLoad:
        """num_running counts the one sequence being generated; num_waiting counts requests.

        kv_blocks_total and kv_blocks_used are 0: this backend has no paged KV pool (the model's
        DynamicCache grows per sequence). num_finished_total counts every request that ended,
        aborted ones included.
        """
        return EngineLoad(
            num_running=int(self._running is not None),
            num_waiting=len(self._waiting),
            kv_blocks_total=0,
            kv_blocks_used=0,
            num_aborted_total=self._num_aborted_total,
            num_finished_total=self._num_finished_total,
        )

    # --- schedule → execute → update ------------------------------------------------------

    def _schedule_next(self) -> bool:
        if not self._waiting:
            return False
        pending = self._waiting.popleft()
        pending.first_scheduled_ns = time.monotonic_ns()
        self._running = _Sequence(owner=pending, index=0)
        return True

    @torch.inference_mode()
    def _generate_token(self, sequence: _Sequence) -> tuple[int, TokenLogprob | None]:
        logits = self._forward(sequence)
        processed = self._process_logits(sequence, logits)
        token_id = _choose_token(processed, sequence.sampling, sequence.owner.generator)
        logprob = None
        if sequence.sampling.logprobs is not None:
            logprob = _token_logprob(processed, token_id, sequence.sampling.logprobs)
        return token_id, logprob

    def _forward(self, sequence: _Sequence) -> torch.Tensor:
        """Logits [vocab] (float32) for the next position; prefills on the first call."""
        if sequence.kv_cache is None:
            new_token_ids = sequence.owner.request.prompt_token_ids
        else:
            new_token_ids = sequence.output_token_ids[-1:]
        input_ids = torch.tensor([new_token_ids], dtype=torch.long, device=self._device)  # [1, t]
        kwargs = dict(self._logits_kwargs)
        if sequence.kv_cache is not None:
            kwargs[self._cache_kwarg] = sequence.kv_cache
        out = self._model(input_ids=input_ids, use_cache=True, **kwargs)
        cache = getattr(out, "cache", None)
        sequence.kv_cache = cache if cache is not None else out.past_key_values
        return out.logits[0, -1].float()

    def _process_logits(self, sequence: _Sequence, logits: torch.Tensor) -> torch.Tensor:
        sampling = sequence.sampling
        prompt_ids = sequence.owner.request.prompt_token_ids
        output_ids = sequence.output_token_ids
        if sampling.repetition_penalty != 1.0:
            logits = _apply_repetition_penalty(logits, prompt_ids + output_ids, sampling.repetition_penalty)
        if output_ids and (sampling.frequency_penalty or sampling.presence_penalty):
            logits = _apply_output_penalties(logits, output_ids, sampling)
        if len(output_ids) < sampling.min_tokens:
            logits = _mask_tokens(logits, self._stop_ids(sampling))
        if not sampling.is_greedy:
            logits = logits / sampling.temperature
        return logits

    def _update(self, sequence: _Sequence, token_id: int, logprob: TokenLogprob | None) -> EngineOutput:
        now_ns = time.monotonic_ns()
        sequence.output_token_ids.append(token_id)
        if len(sequence.output_token_ids) == 1:
            sequence.first_token_ns = now_ns
        num_completion_tokens = len(sequence.output_token_ids)
        finish = finish_at_token(
            token_id, num_completion_tokens, len(sequence.owner.request.prompt_token_ids) + num_completion_tokens,
            sequence.sampling, self._stop_ids(sequence.sampling), self.model_info.max_context_tokens,
        )
        output = EngineOutput.for_token(sequence.request_id, sequence.index, token_id, logprob, finish)
        if output.is_finished:
            self._fill_final(output, sequence, now_ns)
            self._advance(sequence)
        return output

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        return stop_token_ids(sampling, self._eos_token_ids)

    def _fill_final(self, output: EngineOutput, sequence: _Sequence, now_ns: int) -> None:
        request = sequence.owner.request
        output.num_prompt_tokens = len(request.prompt_token_ids)
        output.num_completion_tokens = len(sequence.output_token_ids)
        output.queue_time_ns = max(0, sequence.owner.first_scheduled_ns - request.arrival_ns)
        output.time_to_first_token_ns = max(0, sequence.first_token_ns - request.arrival_ns)
        output.total_time_ns = max(0, now_ns - request.arrival_ns)

    def _advance(self, finished: _Sequence) -> None:
        """Start the request's next sequence, or retire the request."""
        if finished.index + 1 < finished.sampling.n:
            self._running = _Sequence(owner=finished.owner, index=finished.index + 1)
            return
        self._running = None
        self._count_done(aborted=False)

    def _count_done(self, *, aborted: bool) -> None:
        self._num_finished_total += 1
        self._num_aborted_total += int(aborted)


# --- model loading ------------------------------------------------------------------------


def _resolve_device(device: str) -> torch.device:
    """"cuda" means the current CUDA device; name its index so ModelInfo says e.g. "cuda:0"."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _load_model(files: ModelFiles, dtype: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(TORCH_DTYPES)}, got {dtype!r}")
    log.info("loading %s (%s) with transformers on %s as %s", files.path, files.architecture, device, dtype)
    model = AutoModelForCausalLM.from_pretrained(files.path, dtype=TORCH_DTYPES[dtype])
    return model.to(device).eval()


def _forward_kwargs(model) -> tuple[str, dict]:
    """The cache keyword (transformers 5.x says `cache`, 4.x `past_key_values`) and the
    keyword that computes logits for the last position only (as generate() does, which keeps
    our greedy tokens bit-identical to it)."""
    parameters = inspect.signature(model.forward).parameters
    cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
    if "logits_to_keep" in parameters:
        return cache_kwarg, {"logits_to_keep": 1}
    if "num_logits_to_keep" in parameters:
        return cache_kwarg, {"num_logits_to_keep": 1}
    return cache_kwarg, {}


# --- logits processing and sampling (pure functions on a [vocab] float32 tensor) -------------


def _apply_repetition_penalty(logits: torch.Tensor, seen_ids: list[int], penalty: float) -> torch.Tensor:
    ids = torch.tensor(sorted(set(seen_ids)), dtype=torch.long, device=logits.device)
    seen = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def _apply_output_penalties(logits: torch.Tensor, output_ids: list[int], sampling: SamplingParams) -> torch.Tensor:
    ids = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
    counts = torch.bincount(ids, minlength=logits.shape[0]).to(logits.dtype)  # [vocab]
    return logits - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).to(logits.dtype)


def _mask_tokens(logits: torch.Tensor, token_ids: frozenset[int]) -> torch.Tensor:
    ids = [t for t in token_ids if t < logits.shape[0]]
    if not ids:
        return logits
    logits = logits.clone()
    logits[torch.tensor(ids, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def _choose_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    if sampling.is_greedy:
        return int(torch.argmax(logits))  # host sync: one token per step is the point here
    probs = _truncate(torch.softmax(logits, dim=-1), sampling)
    return int(torch.multinomial(probs, 1, generator=generator))


def _truncate(probs: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Apply top-k, top-p and min-p to probabilities [vocab]; the top token always survives."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if 0 < sampling.top_k < probs.shape[0]:
        kth_largest = torch.topk(probs, sampling.top_k).values[-1]
        keep &= probs >= kth_largest
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        keep_sorted = mass_before < sampling.top_p  # the smallest prefix reaching top_p
        keep &= torch.zeros_like(keep).scatter(0, order, keep_sorted)
    if sampling.min_p > 0.0:
        keep &= probs >= sampling.min_p * probs.max()
    keep[torch.argmax(probs)] = True
    return torch.where(keep, probs, torch.zeros_like(probs))


def _token_logprob(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    logprobs = torch.log_softmax(logits, dim=-1)
    top = ()
    if num_top > 0:
        values, ids = torch.topk(logprobs, num_top)
        top = tuple(TopLogprob(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist()))
    return TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id]), top_logprobs=top)
