"""The real default model (SmolLM2-135M-Instruct) for slow tests, resolved once per session.

conftest.py wraps `default_model_dir_path()` in a session fixture. The converted checkpoint lives in
`$LLMSERVE_CACHE_DIR` (else ~/.cache/llmserve), the same cache `make serve` uses, so the ~93 MB
download and the conversion happen once per machine, not once per test run.
"""

from __future__ import annotations

import functools
from pathlib import Path

from llmserve.tools.model_store import resolve_model


@functools.cache
def default_model_dir_path() -> Path:
    """The default model's HF checkpoint directory, fetched and converted on first use."""
    return resolve_model(None)
