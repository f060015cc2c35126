"""Structured outputs at the edge: a response format's checks and its grammar, written once.

A ResponseFormat (llmserve.sampling) is checked where the rest of the sampling is
(llmserve.pb.sampling_from_pb): at the gateway and again at the replica. The checks, in order,
each an INVALID_ARGUMENT naming the field:
  1. the schema's size: at most MAX_SCHEMA_BYTES of UTF-8 (a realistic schema is a few KiB;
     the cap keeps a request's non-prompt fields within llmserve.message_limits' slack);
  2. the schema is JSON, and a JSON object (a schema of `true` or a list is refused);
  3. the grammar library accepts it: every keyword the output must obey is one it enforces
     (an unsupported one, e.g. "not", "uniqueItems" or an unknown "format", is refused, never
     ignored, so an output never misses a constraint in silence). Only where the library is installed: a gateway without it leaves this to the
     replica, which requires it (`require_grammar_library`).

The grammar library is llguidance (docs/benchmarks.md, "Structured outputs": chosen over
xgrammar and outlines-core by compile time, ~1 ms a schema against up to seconds, and by its
dependencies: none). It is an optional extra (`pip install 'llmserve[structured]'`), imported
on the first request that asks for a response format, never at start-up.
"""

from __future__ import annotations

import functools
import json
import re
from types import ModuleType

from llmserve.client_text import quoted
from llmserve.errors import InvalidArgument
from llmserve.sampling import ResponseFormat

MAX_SCHEMA_BYTES = 32 * 1024
MAX_NAME_CHARS = 64
_NAME = re.compile(r"[A-Za-z0-9_-]*")
# json_object's grammar: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# The output's whitespace: none but json.dumps' own separators. Free whitespace lets a small
# model wander (runs of newlines or spaces until max_tokens: vLLM's disable_any_whitespace
# exists for it); these separators are what models trained on JSON write, so the mask rarely
# overrides their choice. Overrides, not defaults: a schema's own "x-guidance" cannot loosen them.
GRAMMAR_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The field errors name, relative to GenerateParams (the OpenAI face drops "sampling.").
FIELD = "sampling.response_format"
SCHEMA_FIELD = f"{FIELD}.json_schema.schema"
NAME_FIELD = f"{FIELD}.json_schema.name"
_VALIDATED_SCHEMAS = 256  # schemas whose grammar check is remembered (each ≤ MAX_SCHEMA_BYTES)


def check_response_format(response_format: ResponseFormat) -> None:
    """The checks of the module docstring; the grammar check only where the library is installed."""
    if not _NAME.fullmatch(response_format.name) or len(response_format.name) > MAX_NAME_CHARS:
        raise InvalidArgument(
            NAME_FIELD, f"letters, digits, '_' and '-', at most {MAX_NAME_CHARS} characters, got {quoted(response_format.name)}"
        )
    schema = response_format.json_schema
    if schema is None:
        return
    num_bytes = len(schema.encode("utf-8", "surrogatepass"))
    if num_bytes > MAX_SCHEMA_BYTES:
        raise InvalidArgument(SCHEMA_FIELD, f"{num_bytes} bytes exceeds the limit of {MAX_SCHEMA_BYTES} bytes")
    problem = _schema_problem(schema)
    if problem is not None:
        raise InvalidArgument(SCHEMA_FIELD, problem)


def require_grammar_library() -> ModuleType:
    """The grammar library, or INVALID_ARGUMENT naming the field when it is not installed."""
    library = _grammar_library()
    if library is None:
        raise InvalidArgument(
            FIELD, "structured outputs need the grammar library llguidance, which this server does not have: "
            "pip install 'llmserve[structured]'",
        )
    return library


def grammar(response_format: ResponseFormat) -> str:
    """The llguidance grammar of `response_format` (needs the library)."""
    schema = response_format.json_schema if response_format.json_schema is not None else JSON_OBJECT_SCHEMA
    return require_grammar_library().LLMatcher.grammar_from_json_schema(schema, overrides=GRAMMAR_OPTIONS)


@functools.lru_cache(maxsize=_VALIDATED_SCHEMAS)
def _schema_problem(schema: str) -> str | None:
    """What is wrong with the schema's text, or None. Cached: a repeated schema is checked once."""
    try:
        parsed = json.loads(schema)
    except ValueError as error:
        return f"not valid JSON: {_first_line(str(error))}"
    except RecursionError:  # ~1,000 levels fit in the size cap; the library takes far fewer
        return "nested too deeply"
    if not isinstance(parsed, dict):
        return f"must be a JSON object (a JSON Schema), got {type(parsed).__name__}"
    library = _grammar_library()
    if library is None:
        return None  # the replica checks it (require_grammar_library)
    try:
        is_error, messages = library.LLMatcher.validate_grammar_with_warnings(
            library.LLMatcher.grammar_from_json_schema(parsed, overrides=GRAMMAR_OPTIONS), None
        )
    except Exception as error:  # noqa: BLE001 - whatever the library raises on a schema, it is the schema's
        return f"invalid or unsupported: {_first_line(str(error))}"
    if is_error:
        return f"invalid or unsupported: {_first_line(messages[0] if messages else 'refused by the grammar library')}"
    return None


@functools.cache
def _grammar_library() -> ModuleType | None:
    try:
        import llguidance
    except ImportError:
        return None
    return llguidance


def _first_line(text: str) -> str:
    """A library's message on one line, short: it may quote the client's schema."""
    line = " ".join(text.split()) or "invalid"
    return line if len(line) <= 200 else line[:199] + "…"
