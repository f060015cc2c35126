"""Grammar-constrained decoding (structured outputs): compiled grammars, each sequence's matcher,
and the step's token bitmask. The library is llguidance (llmserve.response_format says why),
imported on the first request that asks for a response format: it is an optional extra.

  Grammars         one per engine, so one tokenizer: llguidance's view of the tokenizer, built
                   on first use, and the compiled grammars, an LRU keyed by the response
                   format (its schema text) holding a template matcher per format;
  GrammarMatcher   Sequence.grammar: where one sequence is in its grammar, a copy of the
                   template; the Scheduler advances it by each sampled token (accept) and
                   finishes the sequence when the grammar is done;
  constrain        the sampler's step 0: one bitmask row per constrained row, filled on the host
                   in one call (llguidance's thread pool), then one masking of all those rows'
                   disallowed tokens to -inf on the device.

Costs (measured on the 2-core development machine, docs/benchmarks.md "Structured outputs"):
the tokenizer view 0.3 s (SmolLM2, 49k tokens) to 1.1 s (Qwen3, 152k), once per engine, holding
the GIL (a thread would not keep the step loop going), so the first structured request stalls
the engine that long, once; compiling a new format ~1-3 ms, done in add_request (short enough
not to need a waiting state); a cached one is a 10 µs copy; a mask row ~40 µs, 64 rows 1.4-2.3
ms on two cores, spread over llguidance's threads (more cores, less time).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmserve import response_format as formats
from llmserve.inference.models.transfers import device_tensor
from llmserve.sampling import ResponseFormat

# Compiled formats kept per engine: template matchers are small (the lexer state is shared with
# the tokenizer view and built lazily as masks are computed).
MAX_CACHED_GRAMMARS = 512


@dataclass(slots=True)
class GrammarStats:
    """Totals since the engine started (the bench reads them: TorchEngineCore.grammar_stats)."""

    num_compiled: int = 0  # formats compiled (cache misses)
    num_cache_hits: int = 0
    compile_s: float = 0.0  # tokenizer view and compiles
    mask_fill_s: float = 0.0  # host time filling bitmask rows


class GrammarMatcher:
    """Where one sequence is in its grammar. Advanced only by Scheduler.update_from_output, with
    each token as it replaces the placeholder, so it has always seen exactly the sequence's known
    output tokens: a preempted sequence recomputes its KV from those tokens and keeps its matcher
    as it is."""

    __slots__ = ("_matcher", "_grammars")

    def __init__(self, matcher: Any, grammars: "Grammars"):
        self._matcher = matcher  # llguidance.LLMatcher
        self._grammars = grammars

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (then it is in error)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_done(self) -> bool:
        """Nothing but the end can follow (e.g. the object's closing brace): the sequence ends."""
        return self._matcher.is_stopped()

    def fork(self) -> "GrammarMatcher":
        """An independent copy in the same state (a forked sibling's, before either samples)."""
        return GrammarMatcher(self._matcher.deep_copy(), self._grammars)


class Grammars:
    """Compiles response formats for one tokenizer and caches them (see the module docstring)."""

    def __init__(self, tokenizer_path: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer_path = tokenizer_path  # the model's tokenizer.json
        self._vocab_size = vocab_size  # the model's logits width, the mask's
        self._eos_token_ids = list(eos_token_ids)  # what the grammar allows once it is complete
        self._library: Any = None  # llguidance, once loaded
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on first use
        self._executor: Any = None  # llguidance.LLExecutor: the threads that fill masks
        self._templates: OrderedDict[tuple[str, str | None], Any] = OrderedDict()
        self._bitmask: torch.Tensor | None = None  # host rows, reused (see fill_bitmask)
        self.stats = GrammarStats()

    def matcher(self, response_format: ResponseFormat) -> GrammarMatcher:
        """A new sequence's matcher. Raises InvalidArgument when the library is missing and
        ValueError when the format does not compile for this tokenizer (the servicer checked
        both, so either fails only this request: EngineLoop aborts it with ERROR)."""
        key = (response_format.kind, response_format.json_schema)
        template = self._templates.get(key)
        if template is not None:
            self._templates.move_to_end(key)
            self.stats.num_cache_hits += 1
        else:
            template = self._compile(response_format)
            self._templates[key] = template
            if len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return GrammarMatcher(template.deep_copy(), self)

    def fill_bitmask(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """[len(matchers), ceil(vocab / 32)] int32 on the host, bit set = token allowed.

        The rows live in one buffer reused from step to step. Safe: a step that fills it has
        first waited for the step before's sampled tokens (TorchEngineCore._launch processes the
        step in flight before sampling constrained rows), which follow that step's copy of the
        buffer to the device."""
        started = time.perf_counter()
        rows = self._rows(len(matchers))  # contiguous int32 on the host: what the call writes into
        # llguidance.torch.fill_next_token_bitmask_par's one call, without importing that module
        # (it decorates its helpers with torch.compile, which loads dynamo for nothing here).
        self._executor.unsafe_compute_mask_ptr(
            [(m._matcher, row) for row, m in enumerate(matchers)], rows.data_ptr(), rows.shape[1] * 4, rows.shape[0]
        )
        self.stats.mask_fill_s += time.perf_counter() - started
        return rows

    def _rows(self, num_rows: int) -> torch.Tensor:
        width = (self._vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            capacity = max(num_rows, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]), 8)
            self._bitmask = torch.zeros((capacity, width), dtype=torch.int32, pin_memory=torch.cuda.is_available())
        return self._bitmask[:num_rows]

    def _compile(self, response_format: ResponseFormat) -> Any:
        started = time.perf_counter()
        self._load()
        template = self._library.LLMatcher(self._tokenizer, formats.grammar(response_format))
        if template.is_error():
            raise ValueError(f"response_format does not compile: {template.get_error()[:200]}")
        self.stats.num_compiled += 1
        self.stats.compile_s += time.perf_counter() - started
        return template

    def _load(self) -> None:
        if self._tokenizer is not None:
            return
        library = formats.require_grammar_library()
        self._tokenizer = library.LLTokenizer(
            self._tokenizer_path.read_text(), n_vocab=self._vocab_size, eos_token=self._eos_token_ids
        )
        self._executor = library.LLExecutor()
        self._library = library


def constrain(logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]) -> torch.Tensor:
    """`logits` [num_seqs, vocab] with every token that matchers[i] does not allow set to -inf
    in row rows[i]; a new tensor (the model's output buffer is left as it is)."""
    bitmask = matchers[0]._grammars.fill_bitmask(matchers)  # [num_rows, width] on the host
    device = logits.device
    bitmask = bitmask.to(device, non_blocking=True)
    vocab_size = logits.shape[1]
    allowed = ((bitmask[:, :, None] >> _bit_shifts(device)) & 1).bool().flatten(1)[:, :vocab_size]  # [num_rows, vocab]
    if len(rows) == logits.shape[0]:  # every row constrained (a batch of structured requests)
        return logits.masked_fill(~allowed, float("-inf"))
    index = device_tensor(rows, device)
    masked = logits[index].masked_fill(~allowed, float("-inf"))
    return logits.index_put((index,), masked)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _bit_shifts(device: torch.device) -> torch.Tensor:
    """[32] int32: 0..31, one tensor per device (made once: a step's masking allocates less)."""
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, device=device, dtype=torch.int32)
    return shifts
