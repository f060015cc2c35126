"""Where a bench's JSON goes: --out-dir/<stem>-<time>.json, the run's arguments beside its results."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def write_results(args: argparse.Namespace, stem: str, results: dict) -> Path:
    """Write {"args": every argument as text, **results} to args.out_dir and say where."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"args": {key: str(value) for key, value in vars(args).items()}, **results}, indent=2))
    print(f"wrote {path}")
    return path
