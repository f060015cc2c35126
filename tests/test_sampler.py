"""Sampler: processing order, truncation, stop-token masking, logprobs and seeded streams."""

from __future__ import annotations

import functools
import math

import torch

from llmserve.inference.engine.sampler import Sampler, is_plain_greedy
from llmserve.inference.engine.sequence import Sequence
from tests import engine_objects

EOS = 5
VOCAB = 6


make_seq = functools.partial(engine_objects.make_seq, prompt=(0, 1), seed=0)


def logits_of(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def full_logprobs(sampler: Sampler, logits: torch.Tensor, seq: Sequence) -> list[float]:
    """The processed distribution, read back through logprobs (all VOCAB alternatives)."""
    result = sampler.sample(logits, [seq]).logprobs[0]
    by_id = {alt.token_id: alt.logprob for alt in result.top_logprobs}
    return [by_id[i] for i in range(VOCAB)]


def log_softmax(values: list[float]) -> list[float]:
    finite = [v for v in values if v != -math.inf]
    top = max(finite)
    total = math.log(sum(math.exp(v - top) for v in finite)) + top
    return [v - total for v in values]


def test_greedy_rows_take_the_argmax():
    sampler = Sampler((EOS,))
    logits = logits_of([0.0, 3.0, 1.0, 0, 0, 0], [4.0, 0, 0, 0, 0, 0])
    out = sampler.sample(logits, [make_seq(temperature=0.0), make_seq(temperature=0.0)])
    assert out.token_ids == [1, 0]
    assert out.logprobs == [None, None]


def test_plain_greedy_rows_take_the_fast_path_to_the_same_tokens():
    sampler = Sampler((EOS,))
    logits = logits_of([0.0, 3.0, 1.0, 0, 0, 9.0], [4.0, 0, 0, 0, 0, 0])
    seqs = [make_seq(temperature=0.0), make_seq(temperature=0.0)]
    assert [is_plain_greedy(seq.sampling) for seq in seqs] == [True, True]
    general = sampler.sample(logits, seqs)
    for seq in seqs:
        seq.is_plain_greedy = True
    fast = sampler.sample(logits, seqs)
    assert fast.token_ids == general.token_ids == [5, 0] and fast.logprobs == [None, None]
    # EOS masked until min_tokens: not plain, so the general path runs and masks it.
    masked = make_seq(temperature=0.0, min_tokens=2)
    assert not is_plain_greedy(masked.sampling)
    assert sampler.sample(logits[:1], [masked]).token_ids == [1]
    for sampling in ({"temperature": 0.5}, {"temperature": 0.0, "logprobs": 0},
                     {"temperature": 0.0, "repetition_penalty": 1.1}):
        assert not is_plain_greedy(make_seq(**sampling).sampling)


def test_penalties_follow_the_documented_formulas():
    sampler = Sampler((EOS,))
    raw = [2.0, -1.0, 0.5, 1.0, 0.0, 0.0]
    seq = make_seq(
        prompt=(0, 1),
        output=(2, 2, 3),
        temperature=0.0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logprobs=VOCAB,
    )
    # repetition over prompt + output (0, 1, 2, 3): positive / 2, negative * 2;
    # then output counts: token 2 twice, token 3 once.
    expected = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 2 * 0.5 - 0.25, 1.0 / 2 - 0.5 - 0.25, 0.0, 0.0]
    assert full_logprobs(sampler, logits_of(raw), seq) == pytest_approx(log_softmax(expected))


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    sampler = Sampler((EOS,))
    logits = logits_of([0, 0, 0, 0, 1.0, 9.0])
    early = make_seq(output=(0,), temperature=0.0, min_tokens=2, stop_token_ids=(4,), logprobs=VOCAB)
    lps = full_logprobs(sampler, logits, early)
    assert lps[4] == -math.inf and lps[EOS] == -math.inf
    assert sampler.sample(logits, [early]).token_ids == [0]
    ignoring = make_seq(output=(0,), temperature=0.0, min_tokens=2, stop_token_ids=(4,), ignore_eos=True)
    assert sampler.sample(logits, [ignoring]).token_ids == [EOS]  # EOS is an ordinary token then
    reached = make_seq(output=(0, 0), temperature=0.0, min_tokens=2)
    assert sampler.sample(logits, [reached]).token_ids == [EOS]


def test_logprobs_use_the_temperature_and_list_alternatives_best_first():
    sampler = Sampler((EOS,))
    raw = [1.0, 2.0, 3.0, 0.0, 0.0, 0.0]
    seq = make_seq(temperature=0.5, top_k=1, logprobs=2)
    result = sampler.sample(logits_of(raw), [seq]).logprobs[0]
    expected = log_softmax([v / 0.5 for v in raw])
    assert result.token_id == 2
    assert result.logprob == pytest_approx(expected[2])
    assert [alt.token_id for alt in result.top_logprobs] == [2, 1]
    assert [alt.logprob for alt in result.top_logprobs] == pytest_approx([expected[2], expected[1]])
    no_alternatives = make_seq(temperature=0.0, logprobs=0)
    assert sampler.sample(logits_of(raw), [no_alternatives]).logprobs[0].top_logprobs == ()


def test_truncation_to_one_token_is_greedy_at_any_temperature():
    sampler = Sampler((EOS,))
    logits = logits_of([1.0, 1.2, 0.9, 1.1, 0.0, 0.0])
    for settings in ({"top_k": 1}, {"top_p": 0.01}, {"min_p": 1.0}):
        seqs = [make_seq(seed=s, temperature=5.0, **settings) for s in range(20)]
        assert sampler.sample(logits.expand(20, VOCAB), seqs).token_ids == [1] * 20


def test_top_k_and_top_p_keep_only_the_head_of_the_distribution():
    sampler = Sampler((EOS,))
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0, 0.0]]))
    seqs_k = [make_seq(seed=s, top_k=2) for s in range(200)]
    drawn_k = set(sampler.sample(logits.expand(200, VOCAB), seqs_k).token_ids)
    assert drawn_k == {0, 1}
    seqs_p = [make_seq(seed=s, top_p=0.75) for s in range(200)]  # mass before token 2 is 0.7
    drawn_p = set(sampler.sample(logits.expand(200, VOCAB), seqs_p).token_ids)
    assert drawn_p == {0, 1, 2}
    seqs_min_p = [make_seq(seed=s, min_p=0.45) for s in range(200)]  # keeps p >= 0.18
    assert set(sampler.sample(logits.expand(200, VOCAB), seqs_min_p).token_ids) == {0, 1, 2}


def test_draws_follow_the_distribution():
    sampler = Sampler((EOS,))
    probs = [0.5, 0.3, 0.2, 0.0, 0.0, 0.0]
    seq = make_seq(seed=1234)
    logits = torch.log(torch.tensor([probs]))
    counts = [0] * VOCAB
    for _ in range(3000):
        counts[sampler.sample(logits, [seq]).token_ids[0]] += 1
    assert counts[3:] == [0, 0, 0]
    assert [abs(c / 3000 - p) < 0.03 for c, p in zip(counts, probs)] == [True] * VOCAB


def test_a_seeded_sequence_samples_the_same_whatever_else_is_in_the_batch():
    sampler = Sampler((EOS,))
    torch.manual_seed(0)
    rows = torch.randn(4, VOCAB)
    alone = make_seq(seed=42)
    alone_tokens = [sampler.sample(rows[:1], [alone]).token_ids[0] for _ in range(30)]
    batched = make_seq(seed=42)
    others = [make_seq(seed=7), make_seq(seed=8, temperature=0.0), make_seq(seed=9, top_k=3)]
    batched_tokens = []
    for step in range(30):
        # the seeded row moves around and its neighbours change every step
        position = step % 3
        seqs = others[:position] + [batched] + others[position:]
        logits = torch.cat([rows[1 : 1 + position], rows[:1], rows[1 + position : 4]])
        batched_tokens.append(sampler.sample(logits, seqs).token_ids[position])
    assert batched_tokens == alone_tokens
    assert len(set(alone_tokens)) > 1  # really sampled, not greedy


def pytest_approx(values):
    import pytest

    return pytest.approx(values, abs=1e-6)
