"""bench/bench_preprocess.py runs end to end on the tiny model's tokenizer with a small workload,
its clients on raw channels and through the gateway's PreprocessPool, so that it does not rot (its numbers mean nothing here; docs/benchmarks.md has the real run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("via", ["channel", "pool"])
def test_bench_preprocess_on_the_tiny_tokenizer(tiny_model_dir, tmp_path, via):
    small = ["--via", via, "--seconds", "0.3", "--rounds", "1", "--replicas", "1,2", "--client-processes", "1", "--concurrency", "2",
             "--num-prompts", "4", "--prompt-tokens", "60", "--latency-requests", "5"]
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench/bench_preprocess.py"), "--tokenizer", str(tiny_model_dir),
         "--results-dir", str(tmp_path), *small],
        capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    (result_file,) = tmp_path.glob("preprocess-*.json")
    report = json.loads(result_file.read_text())
    assert [row["replicas"] for row in report["throughput"]] == [1, 2]
    assert all(row["requests"] > 0 and row["per_core_ratio"] > 0 for row in report["throughput"])
    assert report["via"] == via and report["throughput"][0]["requests_per_s_ratio"] == 1.0
    assert report["throughput"][1]["tokens_per_s_ratio"] > 0
    assert report["latency"]["grpc_ms_p50"] > 0 and "| replicas |" in report["table"]
