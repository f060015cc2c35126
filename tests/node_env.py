"""The Node.js clients' project (tests/node, installed by `make setup`'s `npm ci`): where it is,
and `node_with`, which the Node client tests' fixtures use to skip where Node is not installed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parent / "node"


def node_with(package: str) -> str:
    """The node executable, with `package` installed in tests/node. Skip without node or npm (the
    project runs without them, and `make setup` installs the packages only where npm is: Debian
    packages node and npm apart); fail when both are there but the package is not (a missing
    `make setup`, not a missing tool)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    installed = (NODE_DIR / "node_modules" / package / "package.json").is_file()
    if not installed and shutil.which("npm") is None:
        pytest.skip("npm is not installed, so `make setup` installed no Node packages")
    if not installed:
        pytest.fail(f"the Node clients' package {package} is missing: run `make setup` (npm ci in {NODE_DIR})")
    return node
