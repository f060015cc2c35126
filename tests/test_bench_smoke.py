"""The benchmark scripts run end to end on the CPU with tiny models: they must not rot when the
engine changes (their numbers mean nothing here; only that every scenario completes and its
correctness checks hold). GPU numbers come from running them on a GPU: docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.long_streams import long_context_model_dir  # noqa: F401 (a fixture)
from tests.node_env import node_with

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_bench(script: str, args: list[str], results_dir: Path) -> dict:
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / script), *args], capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    (result_file,) = results_dir.glob("*.json")
    return json.loads(result_file.read_text())


def test_bench_engine_on_the_tiny_model(tmp_path):
    report = run_bench("bench_engine.py", ["--random-model", "tiny", "--results-dir", str(tmp_path)], tmp_path)
    assert report["greedy_outputs_identical_to_hf"] == report["throughput"][0]["num_requests"]
    cached = next(row for row in report["shared_prefix"] if row["prefix_caching"])
    assert cached["reported_hit_rate"] == cached["theoretical_hit_rate"] > 0
    assert report["prefill_saving_x"] > 1


def test_bench_host_step_times_every_part_of_full_decode_steps(tmp_path):
    report = run_bench("bench_host_step.py", ["--streams", "8", "--output-tokens", "12", "--out-dir", str(tmp_path)],
                       tmp_path)
    assert report["full_steps"] >= 5  # the steps after the first three, while all 8 decode
    assert set(report["host_us_per_step"]) == {
        "schedule", "inputs", "execute_launch", "sampler_launch", "result_wait", "update", "record", "loop", "pickle",
        "write",
    }
    assert report["host_us_per_step"]["execute_launch"] > 0 and report["step_us"] > 0
    # the process's CPU over the iteration, every thread: the step's forward runs on this one
    assert report["cpu_us_per_step"] > 0 and report["cpu_share_of_wall"] > 0


def test_bench_decode_inputs_times_the_decode_graph_staging_on_cpu(tmp_path):
    report = run_bench("bench_decode_inputs.py", ["--streams", "8", "--context", "40", "--steps", "40", "--repeat", "1",
                                                  "--out-dir", str(tmp_path)], tmp_path)
    assert len(report["runs"]) == 1 and report["runs"][0]["inputs"] > 0 and report["runs"][0]["staging"] > 0


def test_bench_mixed_step_times_both_modes_of_the_same_mixed_steps(tmp_path):
    pytest.importorskip("triton")
    report = run_bench("bench_mixed_step.py", ["--decodes", "3", "--chunk-tokens", "9", "--steps", "2", "--repeat", "1",
                                               "--out-dir", str(tmp_path)], tmp_path)
    (cell,) = report["cells"]
    for mode in ("eager", "piecewise"):
        assert cell["runs"][0][mode]["steps"] == 2  # every step of the mode had the 3 decodes and the chunk
        assert cell[f"{mode}_launch_us"][0] > 0


def test_bench_server_fanout_times_both_message_forms(tmp_path):
    report = run_bench("bench_server_fanout.py", ["--streams", "16", "--calls", "2", "--steps", "5", "--repeat", "2",
                                                  "--out-dir", str(tmp_path)], tmp_path)
    assert report["messages_checked"] and set(report["runs"]) == {"objects", "columns"}
    assert all(len(runs) == 2 and all(run["respond"] > 0 for run in runs) for runs in report["runs"].values())


def test_bench_gpu_scenarios_run_on_cpu(tmp_path):
    tiny = ["--device", "cpu", "--small-model", "tiny", "--large-model", "tiny", "--out-dir", str(tmp_path)]
    small_workload = ["--throughput-requests", "6", "--throughput-prompt-tokens", "24", "--throughput-output-tokens", "8",
                      "--hf-batch", "3", "--hf-prompt-tokens", "16", "--hf-output-tokens", "4", "--ttft-prompt-tokens", "32"]
    report = run_bench("bench_gpu.py", ["--scenario", "correctness,decode,ttft,throughput,vs-hf", *tiny, *small_workload],
                       tmp_path)
    failed = {name: value["error"] for name, value in report.items() if isinstance(value, dict) and "error" in value}
    assert not failed
    assert report["correctness"]["greedy_ok"] and report["correctness"]["prefix_cache_hit_tokens"] > 0
    assert report["throughput"]["requests_finished"] == 6 and report["throughput"]["async_scheduling"]
    assert report["vs_hf"]["batch_3"]["identical_greedy_outputs"] == "3/3"
    assert {"decode_small", "decode_large", "ttft"} <= set(report)


def test_bench_gpu_quant_scenario_runs_on_cpu(tmp_path):
    report = run_bench("bench_gpu.py", ["--scenario", "quant", "--device", "cpu", "--small-model", "tiny",
                                        "--large-model", "tiny", "--out-dir", str(tmp_path)], tmp_path)
    for method in ("int8", "fp8"):
        for scenario in ("correctness", "decode_small", "decode_large"):
            assert "error" not in report[f"{scenario}_{method}"], report[f"{scenario}_{method}"]
        assert report[f"correctness_{method}"]["rows"] > 0


def test_measured_rates_never_round_to_zero():
    """A loaded 2-core CPU does ~1 GFLOP/s of bf16 GEMM: 0.0012 TFLOP/s must stay 0.0012, or
    every floor derived from it divides by zero (a fresh clone's `make test` once failed so)."""
    from bench.bench_gpu import significant  # bench/ as a namespace package of the repository root
    assert significant(0.0012345) == 0.001234 or significant(0.0012345) == 0.001235
    assert significant(4.4e-7) == 4.4e-7
    assert significant(4821.77) == 4822
    assert significant(0.0) == 0.0


def assert_first_token_hops(row: dict, through_gateway: bool) -> None:
    """A stack row has the first token's mean ms per hop from the gateway's histograms, each
    within the client's own mean TTFT (the gateway's span is inside the client's)."""
    hops = row.get("first_token_hops_ms")
    if not through_gateway:
        assert hops is None
        return
    assert all(hops[hop] > 0 for hop in ("preprocess", "queue", "first_token", "client")), hops
    assert hops["preprocess"] < hops["first_token"] <= hops["client"] and hops["queue"] < hops["first_token"], hops


def assert_engine_steps(row: dict, path: str) -> None:
    """A row says what the engine's steps did in its cell (the in-process AsyncEngine's are not
    counted): every token the cell's requests got was computed in some step's batch, and no
    batch held more sequences than the cell had streams."""
    steps = row.get("engine_steps")
    if path == "async":
        assert steps is None
        return
    tokens = row["completion_tokens_per_request"] * row["num_requests"]
    assert steps["steps"] * steps["seqs_per_step"] >= 0.95 * tokens, (steps, tokens)  # seqs_per_step: 0.1 rounding
    assert 1 <= steps["seqs_per_step"] <= row["streams"] and steps["step_ms"] > 0 and steps["busy"] > 0, steps


def test_bench_stack_measures_every_path_on_cpu(tmp_path):
    """bench_stack.py --smoke: the four paths (engine core loop, AsyncEngine, the inference
    service over gRPC, the full stack through the gateway) at two stream counts, each row with
    its throughput, latencies, ratios to the core loop and the CPU of every process involved."""
    report = run_bench("bench_stack.py", ["--smoke", "--plot", "--out-dir", str(tmp_path)], tmp_path)
    assert report["errors"] == {}
    rows = {(row["path"], row["streams"]): row for row in report["rows"]}
    # the engine core runs in a process of its own behind AsyncEngine (the default --core-process)
    processes = {"core": {"bench"}, "async": {"bench", "engine-core"}, "grpc": {"bench", "engine-core", "inference"},
                 "gateway": {"bench", "engine-core", "preprocess", "inference", "gateway"}}
    assert set(rows) == {(path, streams) for path in processes for streams in (1, 4)}
    output_tokens = report["settings"]["output_tokens"]
    for (path, streams), row in rows.items():
        assert row["num_succeeded"] == row["num_requests"] >= 4, row["first_errors"]
        assert row["completion_tokens_per_request"] == output_tokens
        assert row["prompt_tokens_per_request"] > 0
        for key in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "output_ratio_vs_core",
                    "itl_ratio_vs_core"):
            assert row[key] > 0, (path, streams, key)
        # every message carries at least one token, and no more than the request had
        assert 1 <= row["tokens_per_message"] <= output_tokens, (path, streams)
        assert set(row["cpu_pct"]) == processes[path]
        # CPU is read in clock ticks (10 ms): a process that works a few ms in a short cell may
        # not reach one on a fast machine, so only the process that steps the engine the whole
        # cell is required to show CPU; every other one is reported, at 0 or more
        busy = "bench" if path == "core" else "engine-core"
        assert row["cpu_pct"][busy] > 0 and all(pct >= 0 for pct in row["cpu_pct"].values()), row["cpu_pct"]
        assert (row["gateway_tokens_per_s_per_core"] or 0) > 0 if path == "gateway" else \
            row["gateway_tokens_per_s_per_core"] is None
        assert_first_token_hops(row, path == "gateway")
        # the engine's own queue, the same measure on every path, is part of the client's TTFT
        assert 0 <= row["queue_mean_ms"] <= row["ttft_mean_ms"], (path, streams)
        assert_engine_steps(row, path)
    assert {rows[("core", s)]["output_ratio_vs_core"] for s in (1, 4)} == {1.0}
    assert report["startup_s"].keys() == processes.keys()
    (plot,) = tmp_path.glob("*.png")
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_bench_stack_repeats_cells_and_sends_text_prompts(tmp_path):
    """--repeat 2: every cell twice (new prompts), each compared with the core loop's same repeat,
    and min/median/max per (path, streams); --prompt-form text: the gateway paths' prompts (gRPC
    and the OpenAI HTTP API) are text that preprocess tokenizes to the core loop's prompt lengths;
    two gateway workers, each one's CPU reported, and with --balance-calls the gRPC clients' calls
    spread over the workers' own ports, each worker's output tokens reported."""
    paths = ("core", "gateway", "http")
    report = run_bench("bench_stack.py", ["--smoke", "--paths", ",".join(paths), "--repeat", "2", "--prompt-form", "text",
                                          "--gateway-arg", "--workers 2", "--balance-calls", "--out-dir", str(tmp_path)],
                       tmp_path)
    assert report["errors"] == {}
    rows = {(row["path"], row["streams"], row["repeat"]): row for row in report["rows"]}
    assert set(rows) == {(path, streams, repeat) for path in paths for streams in (1, 4) for repeat in (1, 2)}
    for (path, streams, repeat), row in rows.items():
        assert row["num_succeeded"] == row["num_requests"], row["first_errors"]
        assert row["prompt_tokens_per_request"] == rows[("core", streams, repeat)]["prompt_tokens_per_request"]
        assert row["output_ratio_vs_core"] > 0
        # --workers 2: each worker's CPU, for the spread between them (not the parent's)
        workers = row["gateway_worker_cpu_pct"]
        assert (len(workers) == 2 and all(pct >= 0 for pct in workers)) if path != "core" else workers is None
        # the tokens each worker served, as its x-gateway-worker said (gRPC only: HTTP has no such header)
        tokens = row["gateway_worker_tokens"]
        total = row["num_succeeded"] * row["completion_tokens_per_request"]
        assert sum(tokens) == total if path == "gateway" else tokens in (None, [0, 0])
        assert_first_token_hops(row, path != "core")  # summed over the two workers
    spreads = {(entry["path"], entry["streams"]): entry for entry in report["spread"]}
    assert set(spreads) == {(path, streams) for path in paths for streams in (1, 4)}
    for (path, streams), entry in spreads.items():
        assert entry["num_repeats"] == 2
        tok_s = sorted(rows[(path, streams, repeat)]["output_tokens_per_s"] for repeat in (1, 2))
        assert (entry["output_tokens_per_s"]["min"], entry["output_tokens_per_s"]["max"]) == tuple(tok_s)
        assert ("cpu_pct_gateway" in entry) == (path != "core")


def test_bench_preprocess_flood_on_the_tiny_model(tiny_model_dir, tmp_path):
    report = run_bench("bench_preprocess_flood.py", ["--model", str(tiny_model_dir), "--rounds", "1",
                                                     "--idle-requests", "3", "--normal-max-tokens", "2",
                                                     "--results-dir", str(tmp_path)], tmp_path)
    statuses = {row["config"]: row["refusal_statuses"] for row in report["configs"]}
    assert statuses == {"receive-limit": {"RESOURCE_EXHAUSTED": 4}, "byte-cap": {"INVALID_ARGUMENT": 4},
                        "gateway": {"RESOURCE_EXHAUSTED": 4}}  # and the normal requests succeeded (the bench checks)


def test_bench_prefix_ttft_times_a_cached_prefix_on_cpu(tmp_path):
    report = run_bench("bench_prefix_ttft.py", ["--smoke", "--out-dir", str(tmp_path)], tmp_path)
    summary = report["summary"]
    assert summary["cached_tokens_median"] == 80  # 86 of 96 tokens asked: five whole blocks
    assert summary["cold_ms"] > 0 and summary["warm_ms"] > 0 and summary["off_ms"] > 0


def test_bench_routing_compares_policies_on_cpu(tmp_path):
    report = run_bench("bench_routing.py", ["--smoke", "--out-dir", str(tmp_path)], tmp_path)
    rows = report["rows"]
    assert set(rows) == {"kv", "round-robin"}
    assert all(row["num_succeeded"] == row["num_requests"] == 24 for row in rows.values())
    assert rows["round-robin"]["throughput_vs_round_robin"] == 1.0
    assert all(0 < row["cached_over_ideal"] <= 1.0 for row in rows.values())
    for row in rows.values():  # sampled only while half the clients' turns are in flight: maybe never here
        assert row["mean_load_per_replica"] is None or len(row["mean_load_per_replica"]) == 3


def test_bench_routing_places_replica_k_on_gpu_k_only_on_cuda():
    """--gpu-per-replica (issue 23's multi-GPU routing run): refused off CUDA, with why."""
    completed = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_routing.py"), "--gpu-per-replica", "--device", "cpu"],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2 and "--gpu-per-replica places replicas on GPUs" in completed.stderr


def test_bench_grammar_measures_the_libraries_and_the_engine_on_cpu(tiny_model_dir, tmp_path):
    """Library mode on the tiny tokenizer, whichever of the three libraries are installed (llguidance
    is, with the `structured` extra): every schema's instance walks through its mask. Engine mode:
    both runs make the same number of tokens."""
    pytest.importorskip("llguidance")
    libraries = run_bench("bench_grammar.py", ["--tokenizers", str(tiny_model_dir), "--compile-repeats", "1", "--steps", "2",
                                               "--libraries", "llguidance", "--out-dir", str(tmp_path / "libraries")],
                          tmp_path / "libraries")  # fmt: skip
    [llguidance] = libraries["libraries"]
    assert all("error" not in schema for schema in llguidance["schemas"].values()), llguidance
    engine = run_bench("bench_grammar.py", ["--engine", "--smoke", "--out-dir", str(tmp_path / "engine")], tmp_path / "engine")
    unconstrained, constrained = engine["engine"]
    assert unconstrained["num_output_tokens"] == constrained["num_output_tokens"] > 0


def test_bench_http_server_streams_every_chunk_from_each_installed_server(tmp_path):
    report = run_bench("bench_http_server.py", ["--requests", "8", "--concurrency", "4", "--chunks", "8", "--rounds", "1",
                                                "--out-dir", str(tmp_path)], tmp_path)
    measured = {row["server"] for row in report["servers"]}
    assert "aiohttp" in measured and measured | set(report["not_installed"]) == {"aiohttp", "uvicorn", "granian-embed", "granian"}
    for row in report["servers"]:
        assert row["num_streams"] == 8 and row["num_bad_streams"] == 0
        assert row["chunks_per_s"] > 0 and row["first_chunk_p50_ms"] > 0


@pytest.mark.parametrize("busy_source", [[], ["--busy-source-prompt-tokens", "64", "--busy-source-output-tokens", "16"]],
                         ids=["idle-source", "busy-source"])
def test_bench_kv_pull_pulls_and_recomputes_on_cpu(tmp_path, busy_source):
    report = run_bench("bench_kv_pull.py", ["--smoke", *busy_source, "--out-dir", str(tmp_path)], tmp_path)
    assert [row["prefix_tokens"] for row in report["rows"]] == [96, 160]
    for row in report["rows"]:  # every pull pulled the whole prefix and gave the recomputed first token
        assert row["all_pulled"] and row["all_same_first_token"] and row["recompute_cached_nothing"]
        assert row["pull_ttft_ms"] > 0 and row["recompute_ttft_ms"] > 0 and row["bytes_per_pull"] > 0
        # B's metrics around each run saw exactly its one pull (the same bytes every time) and its copies.
        assert {run["at_b"]["bytes"] for run in row["runs"]} == {row["bytes_per_pull"]}
        assert all(run["at_b"]["copy_ms"] > 0 for run in row["runs"]) and row["copy_gb_per_s"] > 0
        # The cached arm hit B's own cache: the prompt's full blocks before its last token (the
        # smoke's 16-token suffix ends a block, so the prefix's).
        assert [run["cached_tokens_own"] for run in row["runs"]] == [row["prefix_tokens"]] * len(row["runs"])
        assert row["cached_ttft_ms"] > 0


def test_bench_transport_measures_every_cpu_path(tmp_path):
    report = run_bench("bench_transport.py", ["--sizes", "4KiB,64KiB", "--repeats", "3", "--results-dir", str(tmp_path)],
                       tmp_path)
    assert set(report["cells"]) == {"shm", "shm-staged", "grpc"}
    for by_size in report["cells"].values():
        assert set(by_size) == {str(4 << 10), str(64 << 10)}
        for cell in by_size.values():
            assert cell["repeats"] == 3 and 0 < cell["min_ms"] <= cell["median_ms"] <= cell["max_ms"]
    assert report["ping_ms"]["repeats"] == 2 * 3  # pooled over the two paths that use the pipe


@pytest.mark.parametrize("ipc", [False, True], ids=["local", "ipc"])
def test_bench_block_copy_checks_and_times_the_kv_pull_kernel(tmp_path, ipc):
    pytest.importorskip("triton")
    # --ipc on CPU: the source pool is a child process's /dev/shm segment (TensorProducer's host path)
    report = run_bench("bench_block_copy.py", ["--smoke", "--sweep", *(["--ipc", "--idle-ms", "1"] if ipc else []),
                                               "--out-dir", str(tmp_path)], tmp_path)
    sources = ["local", "ipc"] if ipc else ["local"]
    assert [(row["shape"], row["blocks"], row["source"]) for row in report["rows"]] == [
        ("tiny", blocks, source) for blocks in (4, 8) for source in sources
    ]
    for row in report["rows"]:  # the bench exits 1 if a copy differs from its source
        names = ("roofline", "kernel", "import") + (("copy_phase",) if row["source"] == "ipc" else ())
        for name in names:
            low, median, high = row[f"{name}_ms"]
            assert 0 < low <= median <= high and row[f"{name}_gb_per_s"] > 0
        if row["source"] == "ipc":
            assert min(row["copy_phase_kernel_ms"]) > 0 and "copy_phase_over_its_kernel_ms" in row
        else:
            assert len(row["sweep_gb_per_s"]) == 15
    if ipc:  # the child exited by itself and left nothing behind (on CUDA: we gave its IPC reference back)
        (source,) = report["ipc_sources"]
        assert source["path"] in ("shm", "cuda_ipc") and source["child_exit_code"] == 0
        assert not source["references_held_at_close"] and source["left_in_dev_shm"] == []


def test_bench_tensor_parallel_compares_sizes_on_cpu(tmp_path):
    report = run_bench("bench_tensor_parallel.py", ["--smoke", "--out-dir", str(tmp_path)], tmp_path)
    assert not report["errors"]
    assert [(row["size"], row["streams"]) for row in report["rows"]] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(row["num_succeeded"] == row["num_requests"] > 0 for row in report["rows"])
    assert [row["output_ratio"] for row in report["rows"] if row["size"] == 1] == [1.0, 1.0]
    (tp2_decode,) = [row for row in report["rows"] if (row["size"], row["streams"]) == (2, 1)]
    assert tp2_decode["weight_floor_ms_per_gpu"] * 2 == pytest.approx(report["rows"][0]["weight_floor_ms_per_gpu"], rel=1e-3)


def test_bench_step_broadcast_compares_the_ring_with_gloo(tmp_path):
    report = run_bench("bench_step_broadcast.py", ["--sizes", "2", "--messages", "5", "--decode-rows", "8",
                                                   "--prefill-tokens", "64", "--out-dir", str(tmp_path)], tmp_path)
    rows = report["rows"]
    assert sorted((row["transport"], row["message"]) for row in rows) == [
        (transport, message) for transport in ("gloo", "ring", "ring, tables as changes")
        for message in ("decode 8 rows", "prefill 64 tokens")
    ]  # fmt: skip
    assert all(row["intact"] and row["delivery_us_p50"] > 0 and row["back_to_back_per_s"] > 0 for row in rows)
    assert all(row["send_us_p50_vs_gloo"] > 0 for row in rows if row["transport"] == "ring")


def test_bench_async_scheduling_times_both_settings_on_cpu(tmp_path):
    report = run_bench("bench_async_scheduling.py", ["--shape", "tiny", "--rounds", "2", "--output-tokens", "4",
                                                     "--out-dir", str(tmp_path)], tmp_path)
    assert [row["setting"] for row in report["rows"]] == ["async", "one step at a time"]
    assert report["rows"][0]["ttft_ms_vs_async"] == [1.0, 1.0, 1.0]
    assert all(ms > 0 for row in report["rows"] for ms in row["ttft_ms"])


def test_bench_pin_times_pins_mid_step_and_between_steps_on_cpu(tmp_path):
    report = run_bench("bench_pin.py", ["--shape", "tiny", "--prefix-tokens", "96", "--busy-prompt-tokens", "64",
                                        "--busy-output-tokens", "16", "--pins", "3", "--num-kv-blocks", "128",
                                        "--block-hashes", "--out-dir", str(tmp_path)], tmp_path)
    assert [(row["setting"], row["kind"]) for row in report["rows"]] == [
        ("mid-step", "no hashes"), ("mid-step", "hashes"), ("between steps", "no hashes"), ("between steps", "hashes"),
    ]  # every pin of either kind found the prefix's blocks (the bench exits otherwise)
    assert all(len(times) == 3 and min(times) > 0 for times in report["times"].values())
    assert [row["p50_vs_between_steps"] for row in report["rows"][2:]] == [1.0, 1.0]
    assert [row["p50_vs_no_hashes"] for row in report["rows"][::2]] == [1.0, 1.0]


def test_bench_accept_times_a_burst_at_one_and_at_two_loops(tmp_path):
    report = run_bench("bench_accept.py", ["--accept-loops", "1,2", "--busy-ms", "1", "--burst", "8", "--connections", "4",
                                           "--rounds", "2", "--out-dir", str(tmp_path)], tmp_path)
    assert [(row["accept_loops"], row["busy_ms"]) for row in report["rows"]] == [(1, 1.0), (2, 1.0)]
    for row in report["rows"]:
        assert row["num_streams"] == 8 * 2 and 0 < row["p50_ms"] <= row["max_ms"]
    assert report["rows"][0]["p50_vs_one_loop"] == 1.0


def test_bench_admission_times_a_burst_with_and_without_deadlines(tmp_path):
    report = run_bench("bench_admission.py", ["--burst", "8", "--rounds", "2", "--prompt-tokens", "32", "--max-tokens", "8",
                                              "--out-dir", str(tmp_path)], tmp_path)
    assert [(row["burst"], row["deadline"]) for row in report["rows"]] == [(8, "none"), (8, "600 s")]
    for row in report["rows"]:
        low, median, high = row["total_ms"]
        assert 0 < low <= median <= high and row["mean_us"][1] > 0
    assert report["rows"][0]["total_vs_no_deadline"] == 1.0


def test_bench_prompt_ids_carries_the_same_ids_every_way(tmp_path):
    report = run_bench("bench_prompt_ids.py", ["--tokens", "64,512", "--repeats", "2", "--results-dir", str(tmp_path)],
                       tmp_path)
    assert [row["tokens"] for row in report["rows"]] == [64, 512]  # each encoding's ids checked equal
    for row in report["rows"]:
        assert set(row["us"]) == {"token_ids", "token_id_bytes", "region"}
        assert row["us"]["token_id_bytes"]["request_bytes"] > 4 * row["tokens"]
        assert row["us"]["region"]["request_bytes"] < 100  # a reference, whatever the prompt's length


def test_bench_slow_reader_holds_each_client_against_a_reader(long_context_model_dir, tmp_path):
    # A tokens bound of 64 aborts the 1 KiB window's stream within a few hundred tokens, on any
    # machine; the other clients' windows may or may not fill before 600 tokens are made.
    report = run_bench("bench_slow_reader.py", ["--model", str(long_context_model_dir), "--max-tokens", "600",
                                                "--clients", "grpc-1k-window,http-sse", "--linger-s", "0.2",
                                                "--gateway-arg", "--max-unsent-tokens 64", "--out-dir", str(tmp_path)],
                       tmp_path)
    by_client = {row["client"]: row for row in report["holdings"]}
    assert list(by_client) == ["reads", "grpc-1k-window", "http-sse"]
    reader, stalled = by_client["reads"], by_client["grpc-1k-window"]
    assert (reader["ended"], reader["tokens_read"], reader["how_it_ended"], reader["ratio_to_reader"]) == ("finished", 600, "OK", 1.0)
    assert stalled["ended"] == "aborted"
    assert stalled["how_it_ended"].startswith("RESOURCE_EXHAUSTED: client is not reading: "), stalled["how_it_ended"]
    assert stalled["tokens_read"] < 600  # what its window held before the abort
    assert by_client["http-sse"]["ended"] in ("finished", "aborted") and by_client["http-sse"]["bytes_read"] > 0


def test_bench_slow_reader_drives_the_node_client(long_context_model_dir, tmp_path):
    node_with("@grpc/grpc-js")
    report = run_bench("bench_slow_reader.py", ["--model", str(long_context_model_dir), "--max-tokens", "50",
                                                "--clients", "node-grpc-js", "--linger-s", "0.2", "--out-dir", str(tmp_path)],
                       tmp_path)
    node = report["holdings"][-1]
    assert node["client"] == "node-grpc-js"
    # 50 one-token messages fit any window: the request finishes, and the client reads them all once told to.
    assert (node["ended"], node["tokens_read"], node["how_it_ended"]) == ("finished", 50, "OK")
