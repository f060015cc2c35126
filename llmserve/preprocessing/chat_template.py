"""The model's chat template, rendered exactly as transformers' `apply_chat_template` renders it.

The Jinja environment mirrors transformers (utils/chat_template_utils.py): a sandbox whose
objects templates cannot mutate, `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, a `{% generation %}` tag, `raise_exception`, `strftime_now`, a `tojson` filter that
does not escape HTML, and the same guarded `dict` and `namespace`. Templates see `messages`,
`tools` and `documents` (None), `add_generation_prompt` and the named special tokens
(`bos_token`, `eos_token`, ...), as in transformers. The template is compiled once at start-up.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmserve.block_hash import fingerprint
from llmserve.client_text import shortened
from llmserve.errors import InvalidArgument
from llmserve.sampling import ChatMessage

# How much of a template's refusal an error carries: a template may quote a turn it was given.
MAX_TEMPLATE_REASON_BYTES = 512


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself (no attribute tricks)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, which could reach CPython internals."""

    def __init__(*args, **kwargs):
        # Same signature trick as Jinja's Namespace, so that `namespace(self=...)` still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; when
    serving it renders its body unchanged (templates that use it must still compile)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in transformers' environment; raises TemplateSyntaxError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to. Thread-safe."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]):
        self.source = source
        self._template = compile_template(source)
        self._special_tokens = dict(special_tokens)
        # What the rendering depends on, as one number: a gateway compares its own with the tier's.
        self.fingerprint = fingerprint(json.dumps([source, sorted(self._special_tokens.items())]).encode())

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        """The conversation as the model expects it. A template that refuses the conversation
        (raise_exception, or any other template error) → InvalidArgument naming `chat`."""
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except jinja2.TemplateError as exc:
            reason = shortened(str(exc), MAX_TEMPLATE_REASON_BYTES)
            raise InvalidArgument("chat", f"the model's chat template rejected the conversation: {reason}") from exc
