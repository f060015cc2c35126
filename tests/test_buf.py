"""The contract in protos/ passes `buf lint` and has no breaking change against its baseline.

buf.yaml says which rules apply and how to refresh protos/buf-baseline.json when a break is
intended. buf runs offline: the module has no dependencies to fetch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.package_binary import package_binary

REPO_ROOT = Path(__file__).resolve().parents[1]
BASELINE = "protos/buf-baseline.json"
BUF_TIMEOUT_S = 120


def run_buf(*args: str, cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "BUF_CACHE_DIR": str(tmp_path / "buf-cache")}
    buf = package_binary("buf-bin", "buf")
    return subprocess.run(
        [str(buf), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=BUF_TIMEOUT_S
    )


def test_protos_pass_buf_lint(tmp_path):
    result = run_buf("lint", cwd=REPO_ROOT, tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_protos_have_no_breaking_change_against_the_baseline(tmp_path):
    result = run_buf("breaking", "--against", BASELINE, cwd=REPO_ROOT, tmp_path=tmp_path)
    assert result.returncode == 0, (
        f"{result.stdout}{result.stderr}\nIf this break is intended, see buf.yaml for refreshing {BASELINE}."
    )


def test_a_renumbered_field_is_reported_as_breaking(tmp_path):
    """The check above can fail: a copy of the protos with one field number changed breaks."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "protos", copy / "protos")
    shutil.copy(REPO_ROOT / "buf.yaml", copy / "buf.yaml")
    gateway_proto = copy / "protos/llmserve/v1/gateway.proto"
    text = gateway_proto.read_text()
    assert text.count("bool return_token_ids = 5;") == 1
    gateway_proto.write_text(text.replace("bool return_token_ids = 5;", "bool return_token_ids = 99;"))

    result = run_buf("breaking", "--against", BASELINE, cwd=copy, tmp_path=tmp_path)
    assert result.returncode != 0
    assert 'field "5" with name "return_token_ids" on message "GenerateParams" was deleted' in result.stdout, (
        result.stdout + result.stderr
    )
