"""Shared fixtures: tiny real models (built once per session), the real default model, and a
Docker engine with the project's images (tests/docker_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmserve.tools.tiny_model import ARCHITECTURES, build_tiny_model
from tests.docker_engine import built_images, docker_engine  # noqa: F401 (fixtures)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint with a trained BPE tokenizer and a ChatML template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny random checkpoint per supported architecture."""
    return {arch: build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct, fetched and converted once into the llmserve cache."""
    from tests.default_model import default_model_dir_path

    return default_model_dir_path()
