"""`llmserve bench`, the load generator: its workload, its statistics, and a real run against a
real stack (preprocess, inference on the torch backend, gateway) on the tiny model."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from llmserve.tools.loadgen.client import ClientPlan, RequestRecord, build_request, run_plan
from llmserve.tools.loadgen.conversation import Conversation
from llmserve.tools.loadgen.report import format_table
from llmserve.tools.loadgen.runner import RunConfig, run_workload
from llmserve.tools.loadgen.stats import itl_samples_ms, percentile, summarize, timeline, tpot_ms, ttft_ms
from llmserve.tools.loadgen.workload import LengthDistribution, PromptBuilder, PromptForm, WorkloadConfig, plan_requests
from tests.procs import stack_fixture

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_length_distributions_parse_and_stay_in_range():
    rng = random.Random(1)
    assert LengthDistribution.parse("512").sample(rng) == 512
    uniform = LengthDistribution.parse("uniform:10:20")
    assert {uniform.sample(rng) for _ in range(500)} == set(range(10, 21))
    normal = [LengthDistribution.parse("normal:100:10").sample(rng) for _ in range(2000)]
    assert 98 < sum(normal) / len(normal) < 102 and min(normal) >= 1
    for bad in ("", "x", "uniform:1", "gamma:1:2", "normal:a:b"):
        with pytest.raises(ValueError, match="expected N, uniform:LOW:HIGH or normal:MEAN:STDDEV"):
            LengthDistribution.parse(bad)


@pytest.mark.slow
def test_prompts_have_exactly_the_asked_token_lengths(default_model_dir):
    builder = PromptBuilder.from_path(default_model_dir)
    rng = random.Random(0)
    for num_tokens in (1, 7, 64, 512, 2000):
        assert builder.count(builder.text(num_tokens, rng)) == num_tokens


def _workload(**overrides) -> WorkloadConfig:
    values = dict(num_requests=40, prompt_tokens=LengthDistribution.parse("uniform:40:80"),
                  output_tokens=LengthDistribution.parse("8"), seed=7)
    return WorkloadConfig(**{**values, **overrides})


def test_plans_are_reproducible_and_share_prefixes_token_for_token(tiny_model_dir):
    builder = PromptBuilder.from_path(tiny_model_dir)
    config = _workload(num_prefix_groups=3, prefix_tokens=24)
    planned = plan_requests(config, builder)
    assert planned == plan_requests(config, builder)
    assert planned != plan_requests(_workload(num_prefix_groups=3, prefix_tokens=24, seed=8), builder)
    assert {p.prefix_group for p in planned} == {0, 1, 2}
    for group in range(3):
        members = [p for p in planned if p.prefix_group == group]
        prefix_ids = builder.token_ids(members[0].prefix_text)
        assert len({p.prefix_text for p in members}) == 1 and abs(len(prefix_ids) - 24) <= 2
        for p in members:  # the shared text is also a shared token prefix (what the KV cache reuses)
            assert p.prompt_token_ids[: len(prefix_ids) - 1] == prefix_ids[:-1]
    assert all(p.max_tokens == 8 and p.send_at_s == 0.0 for p in planned)


def test_each_prompt_form_sends_the_planned_prompt_in_its_field(tiny_model_dir):
    builder = PromptBuilder.from_path(tiny_model_dir)
    [planned] = plan_requests(_workload(num_requests=1, num_prefix_groups=1, prefix_tokens=8), builder)
    sent = {form: build_request(planned, _workload(prompt_form=form), True, "").params for form in PromptForm}
    assert sent[PromptForm.TEXT].prompt == planned.prefix_text + planned.suffix_text
    assert [(m.role, m.content) for m in sent[PromptForm.CHAT].chat.messages] == [
        ("system", planned.prefix_text), ("user", planned.suffix_text)
    ]
    assert sent[PromptForm.TOKEN_IDS].WhichOneof("input") == "prompt_token_ids"
    assert tuple(sent[PromptForm.TOKEN_IDS].prompt_token_ids.token_ids) == planned.prompt_token_ids


def test_conversations_plan_consecutive_turns_and_send_their_history(tiny_model_dir):
    builder = PromptBuilder.from_path(tiny_model_dir)
    planned = plan_requests(_workload(num_requests=9, num_turns=3, num_prefix_groups=2, prefix_tokens=16,
                                      request_rate=10.0), builder)
    assert [(p.conversation, p.turn) for p in planned] == [(c, t) for c in range(3) for t in range(3)]
    for turns in (planned[0:3], planned[3:6], planned[6:9]):
        assert len({p.prefix_group for p in turns}) == 1 and turns[0].send_at_s > 0
        assert all(p.send_at_s == 0.0 for p in turns[1:])  # sent when the turn before has ended
        assert turns[0].prompt_token_ids == builder.token_ids(turns[0].prefix_text + turns[0].suffix_text)
        assert turns[1].prompt_token_ids == builder.token_ids(turns[1].suffix_text)  # only the new message
    first, second, third = planned[0:3]
    conversation = Conversation(first.prefix_text)
    conversation.add(first, " answer one", (7, 8))
    conversation.add(second, " answer two", (9,))
    sent = {form: build_request(third, _workload(prompt_form=form, num_turns=3), True, "", conversation).params
            for form in PromptForm}
    assert sent[PromptForm.TEXT].prompt == (first.prefix_text + first.suffix_text + " answer one" + second.suffix_text
                                            + " answer two" + third.suffix_text)
    assert [(m.role, m.content) for m in sent[PromptForm.CHAT].chat.messages] == [
        ("system", first.prefix_text), ("user", first.suffix_text), ("assistant", " answer one"),
        ("user", second.suffix_text), ("assistant", " answer two"), ("user", third.suffix_text),
    ]
    assert tuple(sent[PromptForm.TOKEN_IDS].prompt_token_ids.token_ids) == (
        first.prompt_token_ids + (7, 8) + second.prompt_token_ids + (9,) + third.prompt_token_ids
    )


def test_poisson_arrivals_have_the_asked_mean_rate(tiny_model_dir):
    builder = PromptBuilder.from_path(tiny_model_dir)
    planned = plan_requests(_workload(num_requests=3000, prompt_tokens=LengthDistribution.parse("4"),
                                      request_rate=50.0), builder)
    gaps = np.diff([0.0] + [p.send_at_s for p in planned])
    assert all(gaps > 0)
    assert abs(gaps.mean() - 1 / 50) < 0.002  # 3000 exponential gaps: the mean is within ~4 sigma
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1  # exponential: std == mean


def _record(index, start, times, tokens, status="OK", completion=None):
    record = RequestRecord(index, -1, 10, 8, start_s=start, end_s=times[-1] if times else start + 1)
    record.message_times_s, record.message_num_tokens = list(times), list(tokens)
    record.num_completion_tokens = sum(tokens) if completion is None else completion
    record.status = status
    return record


def test_statistics_spread_coalesced_messages_over_their_tokens():
    record = _record(0, 10.0, [10.1, 10.13, 10.16], [1, 3, 1])
    assert itl_samples_ms(record) == pytest.approx([10.0, 10.0, 10.0, 30.0])
    assert tpot_ms(record) == pytest.approx(60.0 / 4)
    values = sorted(random.Random(3).random() for _ in range(101))
    for p in (50, 90, 99):
        assert percentile(values, p) == pytest.approx(np.percentile(values, p))
    failed = _record(1, 10.0, [], [], status="DEADLINE_EXCEEDED", completion=0)
    summary = summarize([record, failed], 10.0, 11.0)
    assert summary["num_succeeded"] == 1 and summary["errors_by_status"] == {"DEADLINE_EXCEEDED": 1}
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert summary["output_tokens_per_s"] == pytest.approx(5.0)
    assert summary["total_tokens_per_s"] == pytest.approx(15.0)
    over_time = timeline([record], 10.0, 10.16, bin_s=0.1)
    assert over_time["output_tokens_per_s"] == pytest.approx([10.0, 40.0])


def test_the_summary_counts_each_gateway_workers_tokens_and_the_table_shows_their_spread():
    """x-gateway-worker, as each record keeps it: tokens per worker (failures and records
    without a worker left out), and a table line once there are two workers."""
    served = []
    for index, (worker, tokens) in enumerate([("0", 5), ("1", 3), ("1", 7), ("", 4)]):
        record = _record(index, 10.0, [10.1], [tokens])
        record.worker = worker
        served.append(record)
    failed = _record(4, 10.0, [], [], status="UNAVAILABLE", completion=0)
    failed.worker = "0"
    summary = summarize([*served, failed], 10.0, 11.0)
    assert summary["completion_tokens_by_worker"] == {"0": 5, "1": 10}
    assert "workers      0: 5, 1: 10 completion tokens (max / min 2.00)" in format_table(summary)
    assert "workers " not in format_table(summarize(served[:1], 10.0, 11.0))


stack = stack_fixture()


@pytest.fixture(scope="module")
def gateway_address(stack) -> str:
    return stack["gateway"].address


def _bench(address, tiny_model_dir, out_dir, *args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "llmserve.tools.cli", "bench", "--address", address, "--tokenizer", str(tiny_model_dir),
               "--out-dir", str(out_dir), "--name", "run", "--no-progress", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _bench_report(address, tiny_model_dir, out_dir, *args) -> dict:
    """Run `llmserve bench` (it must exit 0) and read the report it wrote."""
    completed = _bench(address, tiny_model_dir, out_dir, *args)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((out_dir / "run.json").read_text())


def test_bench_measures_a_real_stack(gateway_address, tiny_model_dir, tmp_path):
    completed = _bench(gateway_address, tiny_model_dir, tmp_path, "--num-requests", "12", "--concurrency", "4",
                       "--client-processes", "2", "--prompt-tokens", "uniform:20:40", "--output-tokens", "6",
                       "--prefix-groups", "2", "--prefix-tokens", "32")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "12/12 succeeded" in completed.stdout and "TTFT" in completed.stdout and "Queue" in completed.stdout
    report = json.loads((tmp_path / "run.json").read_text())
    summary = report["summary"]
    assert summary["num_succeeded"] == 12 and summary["num_completion_tokens"] == 12 * 6
    assert summary["num_cached_tokens"] > 0  # the shared prefixes hit the prefix cache
    # one ITL sample per token after each request's first message, which carries one or more
    # (exactly how many: test_itl_counts_every_token_after_the_first_message)
    assert summary["itl_ms"]["count"] <= 12 * 5
    assert 0 < summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p90"] <= summary["ttft_ms"]["p99"]
    assert summary["ttft_ms"]["p99"] <= summary["e2e_ms"]["p99"]
    assert summary["queue_ms"]["count"] == 12  # the replica's own wait, from each final message's Timings
    assert sum(report["timeline"]["output_tokens_per_s"]) * report["timeline"]["bin_s"] == 12 * 6
    for name in ("run-latency.png", "run-throughput.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_itl_counts_every_token_after_the_first_message(gateway_address, tiny_model_dir):
    """The gateway coalesces tokens for a reader that falls behind, so how many a message carries
    depends on how fast this machine reads; the ITL samples do not: one per token after the first
    message, whatever the split (the workload of test_bench_measures_a_real_stack, in process)."""
    workload = WorkloadConfig(num_requests=12, prompt_tokens=LengthDistribution.parse("uniform:20:40"),
                              output_tokens=LengthDistribution.parse("6"), num_prefix_groups=2, prefix_tokens=32)
    planned = plan_requests(workload, PromptBuilder.from_path(tiny_model_dir))
    result = run_workload(planned, workload, RunConfig(gateway_address, concurrency=4, num_client_processes=2,
                                                       show_progress=False))
    assert [r.status for r in result.records] == ["OK"] * 12
    for record in result.records:
        assert sum(record.message_num_tokens) == record.num_completion_tokens == 6
        assert 0 <= record.queue_ms <= ttft_ms(record)  # the replica's wait is part of the client's
    summary = summarize(result.records, result.start_s, result.end_s)
    num_after_first = sum(r.num_completion_tokens - r.message_num_tokens[0] for r in result.records)
    assert summary["itl_ms"]["count"] == num_after_first


def _connections_to(port: int) -> set[int]:
    """Local ports of this process's established TCP connections to `port`."""
    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED}


@pytest.mark.parametrize("num_connections", [1, 3])
def test_a_client_spreads_its_conversations_over_its_connections(gateway_address, tiny_model_dir, num_connections):
    """Each of a client's connections is a TCP connection of its own (grpc would otherwise share
    one between a process's channels), and every one carries requests."""
    workload = WorkloadConfig(num_requests=6, prompt_tokens=LengthDistribution.parse("16"),
                              output_tokens=LengthDistribution.parse("4"))
    planned = plan_requests(workload, PromptBuilder.from_path(tiny_model_dir))
    plan = ClientPlan(gateway_address, tuple(planned), workload, max_in_flight=6, timeout_s=120, ignore_eos=True,
                      num_connections=num_connections)
    port = int(gateway_address.rsplit(":", 1)[1])
    seen: list[set[int]] = []
    records = asyncio.run(run_plan(plan, time.monotonic(), on_done=lambda record: seen.append(_connections_to(port))))
    assert [r.status for r in records] == ["OK"] * 6
    assert len(seen[-1]) == num_connections  # after the last request: every connection was used
    assert all(len(ports) <= num_connections for ports in seen)


def test_bench_sends_poisson_chat_load(gateway_address, tiny_model_dir, tmp_path):
    report = _bench_report(gateway_address, tiny_model_dir, tmp_path, "--num-requests", "6", "--request-rate", "20",
                           "--chat", "--prefix-groups", "1", "--prefix-tokens", "16", "--prompt-tokens", "40",
                           "--output-tokens", "3", "--no-plots")
    assert report["config"]["request_rate"] == 20 and report["config"]["prompt_form"] == "chat"
    assert report["summary"]["num_completion_tokens"] == 6 * 3
    assert not list(tmp_path.glob("*.png"))


def test_bench_sends_token_ids_of_exactly_the_planned_lengths(gateway_address, tiny_model_dir, tmp_path):
    report = _bench_report(gateway_address, tiny_model_dir, tmp_path, "--num-requests", "6", "--concurrency", "3",
                           "--token-ids", "--prompt-tokens", "uniform:50:70", "--output-tokens", "3", "--seed", "5",
                           "--prefix-groups", "2", "--prefix-tokens", "40", "--no-plots")
    assert report["config"]["prompt_form"] == "token_ids"
    workload = WorkloadConfig(num_requests=6, prompt_tokens=LengthDistribution.parse("uniform:50:70"),
                              output_tokens=LengthDistribution.parse("3"), seed=5, num_prefix_groups=2,
                              prefix_tokens=40, prompt_form=PromptForm.TOKEN_IDS)
    planned = plan_requests(workload, PromptBuilder.from_path(tiny_model_dir))
    summary = report["summary"]
    assert summary["num_prompt_tokens"] == sum(p.num_prompt_tokens for p in planned)  # the server counted them
    assert summary["num_completion_tokens"] == 6 * 3 and summary["num_cached_tokens"] > 0


def test_bench_replays_conversations_over_their_own_answers(gateway_address, tiny_model_dir, tmp_path):
    report = _bench_report(gateway_address, tiny_model_dir, tmp_path, "--num-requests", "12", "--turns", "3",
                           "--concurrency", "2", "--client-processes", "2", "--token-ids",
                           "--prompt-tokens", "uniform:20:40", "--output-tokens", "5", "--seed", "3", "--no-plots")
    assert report["config"]["turns"] == 3
    workload = WorkloadConfig(num_requests=12, prompt_tokens=LengthDistribution.parse("uniform:20:40"),
                              output_tokens=LengthDistribution.parse("5"), seed=3, prompt_form=PromptForm.TOKEN_IDS,
                              num_turns=3)
    planned = plan_requests(workload, PromptBuilder.from_path(tiny_model_dir))
    expected_prompt_tokens, reusable_tokens, history = 0, 0, 0
    for p in planned:
        history = 0 if p.turn == 0 else history
        prompt = history + p.num_prompt_tokens
        expected_prompt_tokens += prompt
        # what a turn can find cached: the full blocks of the history its previous turn computed
        # (the last answer token was sampled, never fed back), 16 tokens per block
        reusable_tokens += min(history - 1, prompt - 1) // 16 * 16 if p.turn else 0
        history = prompt + 5
    summary = report["summary"]
    assert summary["num_succeeded"] == 12
    assert summary["num_prompt_tokens"] == expected_prompt_tokens  # each turn carried its real history
    assert reusable_tokens * 0.9 <= summary["num_cached_tokens"]


def test_bench_counts_errors_by_status(gateway_address, tiny_model_dir, tmp_path):
    # Prompts that fit the tiny model's context: a too-long one is refused before its deadline
    # passes where the gateway preprocesses it itself.
    completed = _bench(gateway_address, tiny_model_dir, tmp_path, "--num-requests", "4", "--timeout-s", "0.001",
                       "--prompt-tokens", "20", "--output-tokens", "32", "--no-plots")
    assert completed.returncode == 1
    summary = json.loads((tmp_path / "run.json").read_text())["summary"]
    assert summary["num_succeeded"] == 0 and summary["errors_by_status"] == {"DEADLINE_EXCEEDED": 4}
    assert "DEADLINE_EXCEEDED x4" in completed.stdout
