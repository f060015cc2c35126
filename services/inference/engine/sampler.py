"""Turn a batch of logits into one token per sequence, on the logits' device.

Per row, in order (the same as the hf backend, so both backends agree):
  0. structured output (a sequence with a grammar matcher, engine/grammar.py): every token its
     grammar does not allow -> -inf, for all such rows at once (one bitmask filled on the host,
     one masking on the device); the steps below see only allowed tokens, so the greedy pick,
     the draw and the logprobs are those of the constrained distribution;
  1. repetition penalty over prompt + output tokens (divide positive logits, multiply negative);
  2. frequency and presence penalties over output tokens;
  3. while fewer than min_tokens were generated: EOS (unless ignore_eos) and stop ids -> -inf;
  4. temperature (greedy rows keep temperature 1);
  5. logprobs, when asked: log_softmax of these processed logits - the sampling distribution
     before truncation. Greedy without penalties gives the model's raw log-probabilities;
  6. greedy rows: argmax. Other rows: top-k, top-p and min-p keep masks over the probabilities
     (the top token always survives), then one draw by the exponential race
     argmax(p / E), E ~ Exp(1) drawn from the sequence's own torch.Generator.
     Each sequence draws exactly one vocabulary-sized sample per token from its own stream,
     so a seeded sequence gets the same tokens whatever else is in the batch.

`launch` queues all of this on the device and starts copying the results (sampled ids, plus
logprobs for the rows that ask) to pinned host memory without waiting; `LaunchedSample.result()`
is the step's one host sync. The sampled ids also stay on the device, where the next step reads
its input ids before the host has seen them (async scheduling).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.inference.models.transfers import device_tensor
from llmserve.inference.engine.grammar import constrain
from llmserve.inference.engine.sequence import Sequence
from llmserve.inference.engine.stop import stop_token_ids
from llmserve.sampling import SamplingParams, TokenLogprob, TopLogprob


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # logprobs[row] by row, for the rows that asked for them only (empty: none did)
    logprobs_by_row: dict[int, TokenLogprob] = field(default_factory=dict)


@dataclass(slots=True)
class _LogprobRows:
    """Device results for the rows that asked for logprobs."""

    rows: list[int]  # batch rows
    num_top: list[int]  # alternatives each row asked for
    chosen: torch.Tensor  # [num_rows] logprob of the sampled token
    top_values: torch.Tensor | None  # [num_rows, max num_top]
    top_ids: torch.Tensor | None


class LaunchedSample:
    """A launched sampling step: token ids on the device now, on the host after result()."""

    def __init__(self, token_ids: torch.Tensor, logprob_rows: _LogprobRows | None):
        self.token_ids = token_ids  # [num_seqs] int64, on the device
        self._logprob_rows = logprob_rows
        device_results = [token_ids]
        if logprob_rows is not None:
            device_results.append(logprob_rows.chosen)
            if logprob_rows.top_values is not None:
                device_results += [logprob_rows.top_values, logprob_rows.top_ids]
        self._host_results = [_copy_to_host_async(t) for t in device_results]
        self._copied: torch.cuda.Event | None = None
        if token_ids.device.type == "cuda":
            # Blocking: the host waits asleep rather than spinning. It is ahead of the device only
            # when it has nothing else to do (async scheduling), and a spin there showed up as 15%
            # of the engine-core process's samples and most of its "busy" core at 256 streams.
            self._copied = torch.cuda.Event(blocking=True)
            self._copied.record()

    def result(self) -> SamplerOutput:
        """Waits for the copies (the step's one host sync) and converts them."""
        if self._copied is not None:
            self._copied.synchronize()
        host = [t.tolist() for t in self._host_results]
        token_ids = host[0]
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        by_row: dict[int, TokenLogprob] = {}
        rows = self._logprob_rows
        if rows is not None:
            chosen = host[1]
            no_top = [[] for _ in rows.rows]
            top_values, top_ids = (host[2], host[3]) if len(host) == 4 else (no_top, no_top)
            for j, (i, k) in enumerate(zip(rows.rows, rows.num_top)):
                alternatives = tuple(TopLogprob(t, v) for t, v in zip(top_ids[j][:k], top_values[j][:k]))
                logprobs[i] = by_row[i] = TokenLogprob(token_id=token_ids[i], logprob=chosen[j], top_logprobs=alternatives)
        return SamplerOutput(token_ids, logprobs, by_row)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = frozenset(eos_token_ids)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """launch + result: one token per sequence, on the host."""
        return self.launch(logits, seqs).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, seqs: list[Sequence]) -> LaunchedSample:
        """logits [num_seqs, vocab] float32, row i for seqs[i] (whose last token was just
        computed; penalties and grammars read the token history, which must be known on the
        host: reads_host_tokens)."""
        if all(seq.is_plain for seq in seqs):  # the common batch: one argmax, no other work
            return LaunchedSample(logits.argmax(dim=-1), None)
        logits = _apply_grammars(logits, seqs)
        if all(seq.is_plain_greedy for seq in seqs):  # greedy rows, some with a grammar: the masked argmax
            return LaunchedSample(logits.argmax(dim=-1), None)
        logits = _apply_penalties(logits, seqs)
        logits = self._mask_stop_tokens(logits, seqs)
        logits = _apply_temperature(logits, seqs)
        token_ids = logits.argmax(dim=-1)  # [num_seqs]
        random_rows = [i for i, seq in enumerate(seqs) if not seq.sampling.is_greedy]
        if random_rows:
            rows = device_tensor(random_rows, logits.device)
            samplings = [seqs[i].sampling for i in random_rows]
            token_ids[rows] = _draw(logits[rows], samplings, [seqs[i].rng for i in random_rows])
        return LaunchedSample(token_ids, _logprob_rows(logits, token_ids, seqs))

    def _mask_stop_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab_size = logits.shape[1]
        masked = [
            (row, token_id)
            for row, seq in enumerate(seqs)
            if seq.num_completion_tokens < seq.sampling.min_tokens
            for token_id in stop_token_ids(seq.sampling, self.eos_token_ids)
            if token_id < vocab_size
        ]
        if not masked:
            return logits
        rows, token_ids = zip(*masked)
        logits = logits.clone()
        logits[device_tensor(rows, logits.device), device_tensor(token_ids, logits.device)] = float("-inf")
        return logits


def _copy_to_host_async(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy that does not wait: into pinned memory, non_blocking (CUDA)."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def is_plain_greedy(sampling: SamplingParams) -> bool:
    """Greedy with nothing that changes its logits or its output: no penalties, no stop tokens
    ever masked (min_tokens 0), no logprobs. Steps 1-5 of the module docstring leave such a row
    as it is, so its token is the argmax of the raw logits. Sequence.is_plain_greedy holds it."""
    return (
        sampling.temperature == 0.0 and sampling.logprobs is None and sampling.min_tokens == 0
        and not needs_token_history(sampling)
    )


def needs_token_history(sampling: SamplingParams) -> bool:
    """Sampling that reads the sequence's earlier tokens on the host: the penalties."""
    return sampling.repetition_penalty != 1.0 or sampling.frequency_penalty != 0.0 or sampling.presence_penalty != 0.0


def reads_host_tokens(seq: Sequence) -> bool:
    """Sampling this sequence needs its latest token on the host: its penalties count it, or its
    grammar matcher must have accepted it before the mask of the next token can be filled."""
    return seq.grammar is not None or needs_token_history(seq.sampling)


def _apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Step 0. A sequence finished since it was scheduled (its token is discarded) is left as it is."""
    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None and not seq.is_finished]
    if not rows:
        return logits
    return constrain(logits, rows, [seqs[i].grammar for i in rows])


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Penalties are rare: build token counts only for the rows that ask for them."""
    rows = [i for i, seq in enumerate(seqs) if needs_token_history(seq.sampling)]
    if not rows:
        return logits
    logits = logits.clone()
    device, vocab_size = logits.device, logits.shape[1]
    row_index = device_tensor(rows, device)
    penalized = logits[row_index]
    output_counts = _token_counts([seqs[i].output_token_ids for i in rows], vocab_size, device)
    seen = _token_counts([seqs[i].token_ids for i in rows], vocab_size, device) > 0
    repetition = device_tensor([seqs[i].sampling.repetition_penalty for i in rows], device, torch.float)[:, None]
    repeated = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
    penalized = torch.where(seen, repeated, penalized)
    frequency = device_tensor([seqs[i].sampling.frequency_penalty for i in rows], device, torch.float)[:, None]
    presence = device_tensor([seqs[i].sampling.presence_penalty for i in rows], device, torch.float)[:, None]
    penalized = penalized - frequency * output_counts - presence * (output_counts > 0).float()
    logits[row_index] = penalized
    return logits


def _token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[num_rows, vocab] float32 occurrence counts (ids padded with vocab_size, then dropped)."""
    width = max(1, max(len(ids) for ids in token_lists))
    padded = [[min(t, vocab_size) for t in ids] + [vocab_size] * (width - len(ids)) for ids in token_lists]
    padded = device_tensor(padded, device)  # [num_rows, width]
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float))
    return counts[:, :vocab_size]


def _apply_temperature(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    temperatures = [1.0 if seq.sampling.is_greedy else seq.sampling.temperature for seq in seqs]
    if all(t == 1.0 for t in temperatures):
        return logits
    return logits / device_tensor(temperatures, logits.device, torch.float)[:, None]


def _draw(logits: torch.Tensor, samplings: list[SamplingParams], generators: list) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    probs = torch.where(_keep_mask(probs, samplings), probs, torch.zeros_like(probs))
    race = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        race[row].exponential_(generator=generator)
    return (probs / race).argmax(dim=-1)


def _keep_mask(probs: torch.Tensor, samplings: list[SamplingParams]) -> torch.Tensor:
    """Top-k, top-p and min-p over the same probabilities, combined; the argmax always stays."""
    device, vocab_size = probs.device, probs.shape[1]
    keep = torch.ones_like(probs, dtype=torch.bool)
    top_ks = [s.top_k if 0 < s.top_k < vocab_size else vocab_size for s in samplings]
    top_ps = [s.top_p for s in samplings]
    if any(k < vocab_size for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        kth_largest = sorted_probs.gather(1, device_tensor(top_ks, device)[:, None] - 1)
        keep &= probs >= kth_largest
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = mass_before < device_tensor(top_ps, device, torch.float)[:, None]
        keep &= torch.zeros_like(keep).scatter(1, order, keep_sorted)
    min_ps = [s.min_p for s in samplings]
    if any(p > 0.0 for p in min_ps):
        max_probs = probs.max(dim=-1, keepdim=True).values
        keep &= probs >= device_tensor(min_ps, device, torch.float)[:, None] * max_probs
    keep.scatter_(1, probs.argmax(dim=-1, keepdim=True), True)
    return keep


def _logprob_rows(logits, token_ids, seqs: list[Sequence]) -> _LogprobRows | None:
    rows = [i for i, seq in enumerate(seqs) if seq.sampling.logprobs is not None]
    if not rows:
        return None
    row_index = device_tensor(rows, logits.device)
    logprobs = torch.log_softmax(logits[row_index], dim=-1)
    chosen = logprobs.gather(1, token_ids[row_index][:, None])[:, 0]
    num_top = [seqs[i].sampling.logprobs for i in rows]
    top_values = top_ids = None
    if max(num_top) > 0:
        top_values, top_ids = torch.topk(logprobs, max(num_top), dim=-1)
    return _LogprobRows(rows, num_top, chosen, top_values, top_ids)
