"""Model directories derived from the tiny models of llmserve.tools.tiny_model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def with_context(model_dir: Path, out_dir: Path, context_tokens: int) -> Path:
    """A copy of `model_dir` under `out_dir` whose config allows `context_tokens` positions (a
    tiny model's weights do not depend on it): room for long prompts or long generations."""
    out = out_dir / "model"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = context_tokens
    (out / "config.json").write_text(json.dumps(config))
    return out
