"""HFEngineCore: the baseline and correctness oracle, on transformers' AutoModelForCausalLM.

Deliberately the simplest correct engine: first come first served, one sequence at a time,
one token per `step()` (so an abort takes effect between any two tokens), the model's own
KV cache (`DynamicCache`, see HFModel) instead of a paged pool. A request with n > 1 runs its
sequences one after another, each from a fresh prefill of the prompt, drawing from the
request's one random stream in turn. Priority is ignored. No prefix cache, so no KV cache events
(take_kv_events is always empty): routing sees this backend's load only.

Tokens are chosen by the torch engine's Sampler on a batch of one, so both backends process
logits the same way (penalties, min_tokens, temperature, logprobs, truncation, a response
format's grammar mask: see sampler.py and grammar.py); what this backend checks independently is
the model and its KV cache. A sequence with a response format gets its grammar matcher from the
same compiled-grammar cache as the torch engine's, and stop rule 4 (engine/stop.py) ends it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.grammar import Grammars
from llmserve.inference.engine.hf_model import HFModel
from llmserve.inference.engine.sampler import Sampler
from llmserve.inference.engine.sequence import Sequence
from llmserve.inference.engine.stop import finish_at_token, finish_by_grammar, stop_token_ids
from llmserve.engine_output import EngineOutput
from llmserve.inference.engine.types import CacheEvent, EngineLoad, EngineRequest, ModelInfo, StepFailed
from llmserve.model_files import ModelFiles
from llmserve.sampling import FinishReason, TokenLogprob

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    request: EngineRequest
    generator: torch.Generator  # one random stream per request, shared by its sequences in order
    first_scheduled_ns: int = 0


@dataclass(slots=True)
class _Running:
    """The one sequence being generated now."""

    owner: _Request
    sequence: Sequence  # its tokens, sampling and random stream, as the Sampler reads them
    kv_cache: Any = None  # the model's cache object; None before the prefill


class HFEngineCore:
    """EngineCore on transformers. Not thread-safe: the EngineThread calls it from itself only."""

    def __init__(self, config: EngineConfig):
        self._config = config
        files = ModelFiles.load(config.model_path, config.model_name)
        self._model = HFModel(files, config.dtype, config.device)
        self.model_info = ModelInfo.describe(
            config, files, vocab_size=self._model.vocab_size, backend="hf", device=str(self._model.device)
        )
        self._eos_token_ids = frozenset(files.eos_token_ids)
        self._sampler = Sampler(files.eos_token_ids)
        self._grammars = Grammars(files.path / "tokenizer.json", self._model.vocab_size, files.eos_token_ids)
        self._waiting: deque[_Request] = deque()
        self._running: _Running | None = None
        self._num_requests_added = 0  # seeds requests that bring none: config.seed + this
        self._scheduled_batch = (0, 0)  # the latest step's: one sequence, or none when nothing was waiting

    # --- EngineCore interface -------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        assert request.prompt_token_ids, "the servicer rejects empty prompts"
        seed = request.sampling.seed
        if seed is None:
            seed = self._config.seed + self._num_requests_added
        self._num_requests_added += 1
        generator = torch.Generator(device=self._model.device)
        generator.manual_seed(seed)
        if request.sampling.response_format is not None:  # compiled (and cached) now: a failure fails this request only
            self._grammars.matcher(request.sampling.response_format)
        self._waiting.append(_Request(request=request, generator=generator))

    def abort_request(self, request_id: str) -> bool:
        if self._running is not None and self._running.sequence.request_id == request_id:
            self._running = None  # drops the KV cache with it
            return True
        for waiting in self._waiting:
            if waiting.request.request_id == request_id:
                self._waiting.remove(waiting)
                return True
        return False

    def has_requests_in_flight(self) -> bool:
        return self._running is not None or bool(self._waiting)

    def step(self) -> list[EngineOutput]:
        """Generate one token of the running sequence (prefilling it first if new)."""
        if self._running is None and not self._schedule_next():
            self._scheduled_batch = (0, 0)
            return []
        running = self._running
        self._scheduled_batch = (1, len(self._new_token_ids(running)))
        try:
            token_id, logprob = self._generate_token(running)
        except Exception as exc:
            raise StepFailed(f"{type(exc).__name__}: {exc}", [running.sequence.request_id]) from exc
        return [self._update(running, token_id, logprob)]

    def load(self) -> EngineLoad:
        """num_running counts the one sequence being generated; num_waiting counts requests.

        kv_blocks_total and kv_blocks_used are 0: this backend has no paged KV pool (the model's
        DynamicCache grows per sequence). The request totals are the engine loop's.
        """
        return EngineLoad(
            num_running=int(self._running is not None),
            num_waiting=len(self._waiting),
            kv_blocks_total=0,
            kv_blocks_used=0,
        )

    def scheduled_batch(self) -> tuple[int, int]:
        return self._scheduled_batch

    def take_kv_events(self) -> list[CacheEvent]:
        return []

    # --- schedule → execute → update ------------------------------------------------------

    def _schedule_next(self) -> bool:
        if not self._waiting:
            return False
        request = self._waiting.popleft()
        request.first_scheduled_ns = time.monotonic_ns()
        self._running = _Running(owner=request, sequence=self._new_sequence(request, 0))
        return True

    def _generate_token(self, running: _Running) -> tuple[int, TokenLogprob | None]:
        logits = self._forward(running)
        sampled = self._sampler.sample(logits[None], [running.sequence])  # [1, vocab] → one token
        return sampled.token_ids[0], sampled.logprobs[0]

    def _forward(self, running: _Running) -> torch.Tensor:
        """Logits [vocab] for the next position: the prompt's on the first call, then the last
        token's."""
        logits, running.kv_cache = self._model.forward(self._new_token_ids(running), running.kv_cache)
        return logits

    @staticmethod
    def _new_token_ids(running: _Running) -> list[int]:
        sequence = running.sequence
        return sequence.token_ids if running.kv_cache is None else sequence.token_ids[-1:]

    def _update(self, running: _Running, token_id: int, logprob: TokenLogprob | None) -> EngineOutput:
        now_ns = time.monotonic_ns()
        sequence = running.sequence
        sequence.token_ids.append(token_id)
        if sequence.num_completion_tokens == 1:
            sequence.first_token_ns = now_ns
        finish = finish_at_token(
            token_id, sequence.num_completion_tokens, sequence.num_tokens, sequence.sampling,
            stop_token_ids(sequence.sampling, self._eos_token_ids), self.model_info.max_context_tokens,
        )
        if finish[0] is None and sequence.grammar is not None:
            finish = (finish_by_grammar(sequence.grammar, token_id), None)
        output = EngineOutput.for_token(sequence.request_id, sequence.sequence_index, token_id, logprob, finish)
        if finish[0] is FinishReason.ERROR:
            output.error_message = f"the response format's grammar refused token {token_id}"
        if output.is_finished:
            _fill_final(output, running, now_ns)
            self._advance(running)
        return output

    def _advance(self, finished: _Running) -> None:
        """Start the request's next sequence, or retire the request."""
        next_index = finished.sequence.sequence_index + 1
        if next_index < finished.sequence.sampling.n:
            self._running = _Running(owner=finished.owner, sequence=self._new_sequence(finished.owner, next_index))
            return
        self._running = None

    def _new_sequence(self, owner: _Request, index: int) -> Sequence:
        request = owner.request
        response_format = request.sampling.response_format
        return _sequence(owner, index, None if response_format is None else self._grammars.matcher(response_format))


def _sequence(owner: _Request, index: int, grammar) -> Sequence:
    request = owner.request
    return Sequence(
        seq_id=index,  # unused here: only the torch engine's scheduler orders by it
        request_id=request.request_id,
        sequence_index=index,
        token_ids=list(request.prompt_token_ids),
        num_prompt_tokens=len(request.prompt_token_ids),
        sampling=request.sampling,
        arrival_ns=request.arrival_ns,
        rng=owner.generator,
        grammar=grammar,
    )


def _fill_final(output: EngineOutput, running: _Running, now_ns: int) -> None:
    sequence, arrival_ns = running.sequence, running.sequence.arrival_ns
    output.num_prompt_tokens = sequence.num_prompt_tokens
    output.num_completion_tokens = sequence.num_completion_tokens
    output.queue_time_ns = max(0, running.owner.first_scheduled_ns - arrival_ns)
    output.time_to_first_token_ns = max(0, sequence.first_token_ns - arrival_ns)
    output.total_time_ns = max(0, now_ns - arrival_ns)
