"""The layers point one way (README, Layout): the floor (`llmserve/`) imports no service and no
tool; a service imports no other service and no tool; inside inference, `models/` and `kernels/`
import nothing of `engine/`, and `engine/` nothing of the service around it. Read from the
source with `ast`, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("gateway", "preprocess", "inference")
# The inference modules of the engine and below it; everything else in llmserve.inference is the
# service around the engine.
INFERENCE_LOWER = ("llmserve.inference.engine", "llmserve.inference.models", "llmserve.inference.kernels")


def _module_name(path: Path) -> str:
    relative = path.relative_to(REPO_ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[0] == "services":
        parts = ["llmserve", *parts[1:]]
    elif parts[0] == "tools":
        parts = ["llmserve", "tools", *parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("llmserve.") or name == "llmserve"}


def _sources() -> list[Path]:
    roots = [REPO_ROOT / "llmserve", REPO_ROOT / "services", REPO_ROOT / "tools"]
    return sorted(p for root in roots for p in root.rglob("*.py") if "v1" not in p.relative_to(root).parts)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _forbidden(module: str) -> tuple[str, ...]:
    """The packages `module` must not import."""
    tools = ("llmserve.tools",)
    services = tuple(f"llmserve.{s}" for s in SERVICES)
    if _within(module, "llmserve.tools"):
        return ()
    for service in SERVICES:
        package = f"llmserve.{service}"
        if _within(module, package):
            others = tuple(p for p in services if p != package)
            if any(_within(module, lower) for lower in INFERENCE_LOWER[1:]):
                return tools + others + ("llmserve.inference.engine",) + _inference_service_modules()
            if _within(module, INFERENCE_LOWER[0]):
                return tools + others + _inference_service_modules()
            return tools + others
    return tools + services  # the floor


def _inference_service_modules() -> tuple[str, ...]:
    package = REPO_ROOT / "services" / "inference"
    names = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    return tuple(f"llmserve.inference.{name}" for name in names)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_imports_point_down(path: Path) -> None:
    module = _module_name(path)
    forbidden = _forbidden(module)
    wrong = sorted(name for name in _imports(path) if any(_within(name, package) for package in forbidden))
    assert not wrong, f"{module} imports {wrong}, above or beside its layer"


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The check itself: the floor importing a service, the engine the servicer, a model the engine."""
    assert _within("llmserve.gateway.router", "llmserve.gateway")
    assert "llmserve.gateway" in _forbidden("llmserve.pb")
    assert "llmserve.inference.servicer" in _forbidden("llmserve.inference.engine.scheduler")
    assert "llmserve.inference.engine" in _forbidden("llmserve.inference.models.llama")
    assert "llmserve.tools" in _forbidden("llmserve.inference.servicer")
    assert _forbidden("llmserve.tools.launcher") == ()
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from llmserve.gateway.router import Router\n")
    assert "llmserve.gateway.router.Router" in _imports(source)
