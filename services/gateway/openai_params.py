"""OpenAI request bodies as the gateway's own GenerateParams (issue 21): the HTTP face builds the
same typed request the gRPC face receives, so both are validated, routed and admitted by the same
code (GatewayServicer.request_from_params). Only the shapes are translated here; the values are
checked where gRPC's are (llmserve.pb.sampling_from_pb), and a field those checks name
("sampling.top_p") is reported under its OpenAI name ("top_p", `openai_param`).

Unknown fields are ignored, as OpenAI's server does; a known field of the wrong type is refused
with its name. `response_format` becomes SamplingParams.response_format: {"type": "text"} (free
text, as without it), {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}, the schema sent on as JSON text and checked with gRPC's
(llmserve.response_format); `strict` is read but changes nothing: every schema is enforced.

Our own options ride in the body beside OpenAI's, as vLLM's extra-body fields do:
`ignore_eos`, `min_tokens`, `cache_salt`, `top_k`, `min_p`, `repetition_penalty`.
"""

from __future__ import annotations

import json
from typing import Any

from llmserve.client_text import quoted
from llmserve.errors import InvalidArgument
from llmserve.v1 import common_pb2, gateway_pb2

# Roles a chat template renders (OpenAI's "developer" is its newer name for "system").
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_NUMBERS = (int, float)


# Prompts one completions request may carry (each a request of its own, run at once).
MAX_PROMPTS_PER_REQUEST = 32


def chat_params(body: dict[str, Any]) -> gateway_pb2.GenerateParams:
    """POST /v1/chat/completions' body."""
    params = _common_params(body)
    messages = _required(body, "messages", list)
    if not messages:
        raise InvalidArgument("messages", "must hold at least one message")
    for index, message in enumerate(messages):
        params.chat.messages.append(_chat_message(message, f"messages[{index}]"))
    max_tokens = _optional(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _optional(body, "max_tokens", int)
    if max_tokens is not None:
        _assign(params.sampling, "max_tokens", max_tokens)
    if _optional(body, "logprobs", bool):
        _assign(params.sampling, "logprobs", _optional(body, "top_logprobs", int) or 0, param="top_logprobs")
    elif _optional(body, "top_logprobs", int):
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    return params


def completion_params(body: dict[str, Any]) -> list[gateway_pb2.GenerateParams]:
    """POST /v1/completions' body: its prompts (a string, token ids, or a list of either, at
    most MAX_PROMPTS_PER_REQUEST), each as the GenerateParams of a request of its own."""
    prompts = _prompts(body.get("prompt"))
    template = _completion_template(body)
    requests = []
    for index, prompt in enumerate(prompts):
        params = gateway_pb2.GenerateParams()
        params.CopyFrom(template)
        field = "prompt" if len(prompts) == 1 else f"prompt[{index}]"
        if isinstance(prompt, str):
            params.prompt = prompt
        else:
            if any(t < 0 for t in prompt):
                raise InvalidArgument(field, "token ids must be >= 0")
            if any(t >= 1 << 32 for t in prompt):
                raise InvalidArgument(field, "token ids must be below 2^32")
            params.prompt_token_ids.token_ids.extend(prompt)
        requests.append(params)
    return requests


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions body: a string or token ids alone, or a list of those."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS_PER_REQUEST:
            raise InvalidArgument("prompt", f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(prompt)}")
        return prompt
    raise InvalidArgument("prompt", "must be a string, a list of token ids, or a list of those")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion_template(body: dict[str, Any]) -> gateway_pb2.GenerateParams:
    """Every field of a completions body but the prompt."""
    params = _common_params(body)
    max_tokens = _optional(body, "max_tokens", int)
    if max_tokens is not None:
        _assign(params.sampling, "max_tokens", max_tokens)
    logprobs = _optional(body, "logprobs", int)
    if logprobs is not None:
        _assign(params.sampling, "logprobs", logprobs)
    if _optional(body, "echo", bool):
        raise InvalidArgument("echo", "echoing the prompt is not supported")
    return params


def openai_param(field: str) -> str:
    """The OpenAI name of a field our validation named."""
    return field.removeprefix("sampling.")


def _common_params(body: dict[str, Any]) -> gateway_pb2.GenerateParams:
    params = gateway_pb2.GenerateParams(model=_optional(body, "model", str) or "")
    sampling = params.sampling
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _optional(body, name, _NUMBERS)
        if value is not None:
            setattr(sampling, name, float(value))
    for name in ("top_k", "seed", "min_tokens", "n"):
        value = _optional(body, name, int)
        if name == "top_k" and value is not None and value < 0:
            value = 0  # vLLM's -1: no limit
        if value is not None:
            _assign(sampling, name, value)
    if _optional(body, "ignore_eos", bool):
        sampling.ignore_eos = True
    stop = body.get("stop")
    if isinstance(stop, str):
        sampling.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        sampling.stop.extend(stop)
    elif stop is not None:
        raise InvalidArgument("stop", "must be a string or a list of strings")
    params.cache_salt = _optional(body, "cache_salt", str) or ""
    response_format = _response_format(_optional(body, "response_format", dict))
    if response_format is not None:
        sampling.response_format.CopyFrom(response_format)
    return params


def _response_format(value: dict[str, Any] | None) -> common_pb2.ResponseFormat | None:
    """OpenAI's response_format as ours; None for text. Only the shape is checked here."""
    kind = None if value is None else value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return common_pb2.ResponseFormat(json_object=common_pb2.JsonObjectFormat())
    if kind != "json_schema":
        raise InvalidArgument("response_format.type", f"must be text, json_object or json_schema, got {quoted(str(kind))}")
    spec = _required(value, "json_schema", dict, field="response_format.json_schema")
    name = _optional(spec, "name", str, field="response_format.json_schema.name") or ""
    _optional(spec, "strict", bool, field="response_format.json_schema.strict")
    schema = _required(spec, "schema", dict, field="response_format.json_schema.schema")
    return common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(name=name, schema=json.dumps(schema)))


def _assign(message: Any, name: str, value: int, *, param: str | None = None) -> None:
    """Set an unsigned protobuf field, refusing what it cannot hold (negative, too large)."""
    try:
        setattr(message, name, value)
    except ValueError:
        raise InvalidArgument(param or name, f"must be a non-negative integer in range, got {value}") from None


def _chat_message(message: Any, field: str) -> common_pb2.ChatMessage:
    if not isinstance(message, dict):
        raise InvalidArgument(field, "must be an object with role and content")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise InvalidArgument(f"{field}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {str(role)[:32]!r}")
    return common_pb2.ChatMessage(role=CHAT_ROLES[role], content=_content(message.get("content"), f"{field}.content"))


def _content(content: Any, field: str) -> str:
    """A message's content: a string, or text parts (joined); no other part type is read."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(f"{field}[{index}]", 'only text parts ({"type": "text", "text": ...}) are read')
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    raise InvalidArgument(field, "must be a string or a list of text parts")


def _optional(body: dict[str, Any], name: str, kind: type | tuple[type, ...], *, field: str | None = None) -> Any:
    """body[name] when set and of `kind`; `field`: the name errors give it (default `name`)."""
    value = body.get(name)
    if value is None:
        return None
    # bool is an int in Python, never in JSON's sense of a number.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        expected = kind.__name__ if isinstance(kind, type) else "number"
        raise InvalidArgument(field or name, f"must be a {_JSON_TYPES.get(expected, expected)}, got {type(value).__name__}")
    return value


def _required(body: dict[str, Any], name: str, kind: type, *, field: str | None = None) -> Any:
    if body.get(name) is None:
        raise InvalidArgument(field or name, "is required")
    return _optional(body, name, kind, field=field)


_JSON_TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "dict": "object", "list": "array"}
