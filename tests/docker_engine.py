"""A Docker engine and the project's images, for the tests that run the images for real
(tests/test_images_run.py, and tests/test_helm_runs.py's pods from images).

`docker_engine` uses the engine that answers, or starts dockerd as a machine without a bridge
network needs it (`--bridge=none --iptables=false --ip6tables=false`) and stops it at the end;
`built_images` builds the images with deploy/docker/build-images.sh (what `make images` runs: a
base from Debian's packages where no registry answers, the CPU torch from pip's find-links).
Where Docker is missing they skip, unless LLMSERVE_IMAGES=1 (.ci/run sets it), where they fail:
in CI a missing engine must not pass as a skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 1800  # a cold build: the base (~100 s), pip installs from PyPI, torch
DOCKERD_START_S = 60
# The images the chart runs on CPU, by component (build-images.sh tags them so).
IMAGE_REPOSITORIES = {
    "gateway": "llmserve/gateway",
    "preprocess": "llmserve/preprocess",
    "inference": "llmserve/inference-cpu",
}


def version() -> str:
    (found,) = re.findall(r'^version = "(.*)"$', (REPO_ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    return found


def torch_version() -> str:
    (found,) = re.findall(r"^TORCH_VERSION := (\S+)$", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE)
    return found


def _unavailable(reason: str) -> None:
    if os.environ.get("LLMSERVE_IMAGES") == "1":
        pytest.fail(f"LLMSERVE_IMAGES=1 but {reason}")
    pytest.skip(reason)


def _answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"docker {' '.join(args)}: {done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory):
    if shutil.which("docker") is None:
        _unavailable("no docker client (apt-get install docker.io)")
    if _answers():
        yield
        return
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        _unavailable("no Docker engine answers, and dockerd cannot be started here (needs root)")
    log_path = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with open(log_path, "w") as log:
        daemon = subprocess.Popen(
            ["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + DOCKERD_START_S
        while not _answers():
            assert daemon.poll() is None, f"dockerd exited: {log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"dockerd did not answer in {DOCKERD_START_S} s"
            time.sleep(0.5)
        yield
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


@pytest.fixture(scope="session")
def built_images(docker_engine, tmp_path_factory) -> dict[str, str]:
    """{component: image tag} of the CPU images, built from this checkout."""
    log_path = tmp_path_factory.mktemp("images") / "build.log"
    with open(log_path, "w") as log:
        done = subprocess.run(
            [str(REPO_ROOT / "deploy/docker/build-images.sh"), version(), torch_version()],
            cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            timeout=BUILD_TIMEOUT_S, env={**os.environ, "CUDA_IMAGE": "0"},
        )  # fmt: skip
    built = log_path.read_text()
    assert done.returncode == 0, f"build-images.sh failed:\n{built[-4000:]}"
    print("\n".join(line for line in built.splitlines() if line.startswith("build-images:")))
    return {component: f"{repository}:{version()}" for component, repository in IMAGE_REPOSITORIES.items()}


class Containers:
    """Containers a test started, each named uniquely and removed by id at the end."""

    def __init__(self, work_dir: Path):
        self.work_dir = work_dir
        self.cid_files: list[Path] = []

    def run_args(self, name: str) -> list[str]:
        """`docker run` arguments that name the container and record its id for removal."""
        cid_file = self.work_dir / f"{name}-{uuid.uuid4().hex[:8]}.cid"
        self.cid_files.append(cid_file)
        return ["--name", cid_file.stem, "--cidfile", str(cid_file)]

    def remove_all(self) -> None:
        for cid_file in self.cid_files:
            if cid_file.exists():
                docker("rm", "--force", cid_file.read_text().strip(), check=False)
