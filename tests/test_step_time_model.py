"""StepTimeModel: the step time of a batch, fitted from the steps a replica ran."""

from __future__ import annotations

import random

import pytest

from llmserve.inference.step_time_model import HALF_LIFE_S, StepTimeModel


def test_before_any_step_there_is_no_estimate():
    assert StepTimeModel().step_s(8, 8) is None


def test_a_fixed_part_and_parts_per_sequence_and_per_token_are_recovered_from_noisy_steps():
    model, rng = StepTimeModel(), random.Random(0)
    for _ in range(400):
        num_seqs = rng.randint(1, 25)
        num_tokens = num_seqs + rng.choice([0, 0, 0, 512])  # some steps carry a prefill chunk
        model.add(0.08 + 0.0075 * num_seqs + 0.0004 * (num_tokens - num_seqs) + rng.gauss(0, 0.002), num_seqs, num_tokens)
    # decode steps, measured at 200 and 270 ms for 16 and 25 sequences (CPU, issue 18)
    assert model.step_s(16, 16) == pytest.approx(0.200, rel=0.03)
    assert model.step_s(25, 25) == pytest.approx(0.2675, rel=0.03)
    assert model.step_s(16, 16 + 512) == pytest.approx(0.200 + 512 * 0.0004, rel=0.03)


def test_few_alike_steps_of_a_burst_give_each_part_what_the_steps_measured():
    """The steps a CPU replica ran after a warm-up (issue 18): a joint least-squares fit of the
    three terms made the base -1.0 s and a sequence 133 ms, predicting 0 for these decode steps."""
    model = StepTimeModel()
    for batch in [(0.143, 8, 8), (0.150, 8, 8), (0.114, 7, 7), (0.074, 3, 3), (1.029, 1, 427), (0.779, 2, 428)]:
        model.add(*batch)
    for _ in range(5):
        model.add(0.062, 2, 2)
    assert model.fit.base_s >= 0 and model.fit.per_seq_s >= 0
    assert 0.04 < model.step_s(2, 2) < 0.09
    assert 0.6 < model.step_s(1, 427) < 1.1  # the prompt steps, about as measured
    assert model.step_s(3, 3 + 2045) == pytest.approx(model.step_s(3, 3) + 2045 * model.fit.per_prompt_token_s)


def test_prompt_steps_before_any_decode_step_count_wholly_as_prompt_tokens():
    model = StepTimeModel()
    model.add(1.0, 2, 1002)
    assert model.step_s(2, 2) == 0.0  # not measured yet: a cold replica admits
    assert model.step_s(2, 2002) == pytest.approx(2.0)


def test_one_batch_size_seen_predicts_its_step_for_every_batch():
    model = StepTimeModel()
    for _ in range(50):
        model.add(0.1, 1, 1)
    assert model.step_s(100, 100) == pytest.approx(0.1)  # no slope it has not measured


def test_a_step_that_shrinks_with_the_batch_is_noise_and_has_no_negative_slope():
    model = StepTimeModel()
    for num_seqs in (1, 2, 3, 4) * 10:
        model.add(0.2 - 0.01 * num_seqs, num_seqs, num_seqs)
    assert model.fit.per_seq_s >= 0 and model.fit.base_s >= 0
    assert model.step_s(64, 64) == pytest.approx(model.step_s(1, 1))


def test_steps_older_than_a_few_half_lives_of_step_time_are_forgotten():
    model = StepTimeModel()
    for _ in range(1000):
        model.add(0.1, 4, 4)  # 100 s of steps on a quiet host
    for _ in range(int(HALF_LIFE_S / 0.2)):
        model.add(0.2, 4, 4)  # one half-life of steps on a loaded one
    assert 0.1 < model.step_s(4, 4) < 0.2
    for _ in range(int(7 * HALF_LIFE_S / 0.2)):
        model.add(0.2, 4, 4)
    assert model.step_s(4, 4) == pytest.approx(0.2, rel=0.01)
