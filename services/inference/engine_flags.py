"""The engine's command-line flags, built from EngineConfig's fields (see EngineFlag).

From the one declaration of each flag on its EngineConfig field come:
  - add_engine_arguments: the flags of `python -m llmserve.inference` and of `llmserve serve`;
  - engine_options: what they parsed into, by EngineConfig field name;
  - engine_config: the EngineConfig those options give for a model;
  - engine_argv: the flags that give the inference service the same options (the launcher's
    command line for its child).
So adding an engine flag is adding a flagged EngineConfig field.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping

from llmserve.inference.engine.config import FLAG, EngineConfig, EngineFlag, default_async_scheduling, default_dtype

# EngineConfig field name → value, for every flagged field (engine_options, default_engine_options).
EngineOptions = Mapping[str, Any]

_FIELD_TYPES = typing.get_type_hints(EngineConfig)


def flagged_fields() -> tuple[dataclasses.Field, ...]:
    """The EngineConfig fields that have a flag, in declaration order."""
    return tuple(f for f in dataclasses.fields(EngineConfig) if FLAG in f.metadata)


def flag_of(field: dataclasses.Field) -> EngineFlag:
    return field.metadata[FLAG]


def value_type(field: dataclasses.Field) -> type:
    """The type a flag's value parses to: int for `int` and for `int | None`."""
    hint = _FIELD_TYPES[field.name]
    return next((arg for arg in typing.get_args(hint) if arg is not type(None)), hint)


def parsed_default(field: dataclasses.Field) -> Any:
    """What the flag parses to when it is not given."""
    return None if flag_of(field).unset_by_default else field.default


def default_engine_options() -> dict[str, Any]:
    return {field.name: parsed_default(field) for field in flagged_fields()}


def add_engine_arguments(
    parser: argparse.ArgumentParser, groups: Mapping[str, argparse._ArgumentGroup] | None = None
) -> None:
    """Add every engine flag to `parser`, each under its EngineFlag.group; `groups` are
    groups the caller already made (by title), for its own flags to share."""
    made = dict(groups or {})
    for field in flagged_fields():
        flag = flag_of(field)
        if flag.group not in made:
            made[flag.group] = parser.add_argument_group(flag.group)
        if value_type(field) is bool and flag.unset_by_default:  # unset: resolved by engine_config
            options = {"action": "store_const", "const": not field.default, "default": None, "help": flag.help}
        elif value_type(field) is bool:
            options = {"action": "store_false" if field.default else "store_true", "help": flag.help}
        else:
            options = {
                "type": value_type(field),
                "default": parsed_default(field),
                "choices": flag.choices,
                "metavar": flag.metavar,
                "help": _help_with_default(flag, parsed_default(field)),
            }
        made[flag.group].add_argument(flag.name, *flag.aliases, dest=field.name, **options)


def _help_with_default(flag: EngineFlag, default: Any) -> str:
    # A None default is explained by the help itself ("default: the model's context").
    return flag.help if default is None else f"{flag.help} (default: {default})"


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags' parsed values, by EngineConfig field name."""
    return {field.name: getattr(args, field.name) for field in flagged_fields()}


def engine_config(options: EngineOptions, model_path: Path, model_name: str) -> EngineConfig:
    """The EngineConfig that `options` (from engine_options) give for a model."""
    values = dict(options)
    if values["dtype"] is None:
        values["dtype"] = default_dtype(values["device"])
    if values["async_scheduling"] is None:
        values["async_scheduling"] = default_async_scheduling(values["device"])
    return EngineConfig(model_path=model_path, model_name=model_name, **values)


def engine_argv(options: EngineOptions, names: Iterable[str] | None = None) -> list[str]:
    """The flags that parse back into `options` (only the fields in `names`, if given).

    Options equal to the default are left out, so the receiving service's defaults stay the
    only source of them; a missing option counts as the default.
    """
    wanted = None if names is None else set(names)
    argv: list[str] = []
    for field in flagged_fields():
        value = options.get(field.name, parsed_default(field))
        if (wanted is not None and field.name not in wanted) or value == parsed_default(field):
            continue
        if value_type(field) is bool:  # the flag flips the field's default, which it differs from here
            if value != field.default:
                argv.append(flag_of(field).name)
        else:
            argv += [flag_of(field).name, str(value)]
    return argv
