"""What a local HF checkpoint directory says about itself, read once.

Every service that is handed `--model DIR` reads the same facts from here: name, architecture,
context length, EOS ids and chat template. DIR holds config.json, the weights
(*.safetensors), tokenizer.json and usually tokenizer_config.json / generation_config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _token_text(value) -> str | None:
    # tokenizer_config stores special tokens as strings or as {"content": ...} objects.
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass(frozen=True, slots=True)
class ModelFiles:
    path: Path
    model_name: str
    architecture: str
    max_context_tokens: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    config: dict  # config.json as read

    @classmethod
    def load(cls, path: str | Path, model_name: str | None = None) -> "ModelFiles":
        path = Path(path).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory: config.json is missing")
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        config = _read_json(path / "config.json")
        generation = _read_json(path / "generation_config.json")
        tok_config = _read_json(path / "tokenizer_config.json")
        tokenizer = _read_json(path / "tokenizer.json")
        eos_ids = _as_ids(generation.get("eos_token_id")) or _as_ids(config.get("eos_token_id"))
        eos_token = _token_text(tok_config.get("eos_token"))
        if eos_token is not None:
            added = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
            eos_id = added.get(eos_token, tokenizer.get("model", {}).get("vocab", {}).get(eos_token))
            if eos_id is not None and eos_id not in eos_ids:
                eos_ids = (*eos_ids, eos_id)
        chat_template = tok_config.get("chat_template")
        if chat_template is None and (path / "chat_template.jinja").is_file():
            chat_template = (path / "chat_template.jinja").read_text()
        if isinstance(chat_template, list):  # named templates: take "default"
            chat_template = next((t["template"] for t in chat_template if t.get("name") == "default"), None)
        architectures = config.get("architectures") or ["unknown"]
        return cls(
            path=path,
            model_name=model_name or config.get("_name_or_path") or path.name,
            architecture=architectures[0],
            max_context_tokens=int(config.get("max_position_embeddings") or tok_config.get("model_max_length") or 2048),
            vocab_size=int(config.get("vocab_size", 0)),
            eos_token_ids=eos_ids,
            chat_template=chat_template,
            config=config,
        )
