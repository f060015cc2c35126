"""What a log line looks like (`--log-format`): one readable line, or one JSON object per line.

JSON keys, in this order: time (UTC, ISO 8601, milliseconds), level, service, logger, message,
request_id (on lines logged while serving a request: llmserve.request_context), the fields the
call passed with `extra=`, and exc_info (the traceback as one string) when there is one. Text:
`TIME LEVEL SERVICE LOGGER: MESSAGE`, then ` key=value` for the request id and each extra field,
then the traceback on the lines below.

TEXT_FIELDS hold prompt or completion text, or token ids (which decode to it): both formats
leave them out unless built with `log_prompts` (`--log-prompts`). So a call site passes them
as extra fields unconditionally, keeps lengths and ids in its message, and the choice is made
once, here.

No line is longer than MAX_LINE_BYTES, whatever it quotes (a message may carry a client's value,
a traceback any value it met; --log-prompts text fields are cut too): a longer text line keeps
its head and tail around " …[N bytes cut]… " (llmserve.client_text.shortened); a JSON line stays
one valid object, its longest values cut so, one after another, until it fits.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from datetime import datetime, timezone

from llmserve.client_text import num_bytes, shortened

# A few KB: log collectors split or drop longer lines (Docker's json-file splits at 16 KiB),
# and a line a client can lengthen must not cost more than this per request.
MAX_LINE_BYTES = 4096

TEXT_FIELDS = frozenset({"prompt", "prompt_token_ids", "completion", "completion_token_ids", "matched_stop"})

# The attributes every LogRecord has; any other one came from `extra=` or a filter.
_RECORD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
# A text-format value written as it is; anything else is written as JSON (quoted, escaped).
_BARE_VALUE = re.compile(r"[\w.:/@+-]+")


def _record_fields(record: logging.LogRecord, *, log_prompts: bool) -> dict[str, object]:
    """The request id and extra fields of `record` (request_id first); TEXT_FIELDS only if `log_prompts`."""
    fields = {key: value for key, value in vars(record).items() if key not in _RECORD_ATTRIBUTES}
    if not log_prompts:
        fields = {key: value for key, value in fields.items() if key not in TEXT_FIELDS}
    if "request_id" in fields:
        fields = {"request_id": fields.pop("request_id"), **fields}
    return fields


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, *, log_prompts: bool):
        super().__init__()
        self._service = service
        self._log_prompts = log_prompts

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": _utc_time(record.created),
            "level": record.levelname,
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _record_fields(record, log_prompts=self._log_prompts).items():
            line.setdefault(key, value)  # an extra field never hides one of the keys above
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return _fitted_json(line)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str, *, log_prompts: bool):
        super().__init__(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
        self._log_prompts = log_prompts

    def format(self, record: logging.LogRecord) -> str:
        return shortened(super().format(record), MAX_LINE_BYTES)

    def formatMessage(self, record: logging.LogRecord) -> str:
        fields = _record_fields(record, log_prompts=self._log_prompts)
        return super().formatMessage(record) + "".join(f" {key}={_text_value(value)}" for key, value in fields.items())


_FORMATTERS = {"text": TextFormatter, "json": JsonFormatter}


def log_formatter(log_format: str, service: str, *, log_prompts: bool) -> logging.Formatter:
    """The formatter of `log_format` (llmserve.observability.LOG_FORMATS) for `service`'s lines."""
    return _FORMATTERS[log_format](service, log_prompts=log_prompts)


# Keys a JSON line always has, short and written by us: never cut.
_FIXED_KEYS = frozenset({"time", "level", "service", "logger"})
# The least a cut value keeps (besides its marker).
_MIN_CUT_BYTES = 128


def _fitted_json(line: dict[str, object]) -> str:
    """`line` as JSON within MAX_LINE_BYTES: while it is longer, its longest value (as text) is
    shortened by the excess. json.dumps writes ASCII, each character of a value as at least as
    many characters as its UTF-8 bytes, so cutting a value's bytes by the excess cuts the line
    by at least as much; a value of _MIN_CUT_BYTES is left as it is."""
    text = json.dumps(line, default=_jsonable)
    while len(text) > MAX_LINE_BYTES:
        key, value = max(
            ((k, v if isinstance(v, str) else json.dumps(v, default=_jsonable)) for k, v in line.items()
             if k not in _FIXED_KEYS),
            key=lambda item: num_bytes(item[1]), default=(None, ""),
        )
        budget = max(_MIN_CUT_BYTES, num_bytes(value) - (len(text) - MAX_LINE_BYTES))
        if key is None or num_bytes(value) <= budget:
            return text  # nothing left to cut: only many short fields, which we never write
        line[key] = shortened(value, budget)
        text = json.dumps(line, default=_jsonable)
    return text


def _utc_time(created_s: float) -> str:
    return datetime.fromtimestamp(created_s, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _jsonable(value: object) -> object:
    """What json.dumps cannot write itself: a dataclass as its fields, anything else as str()."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


def _text_value(value: object) -> str:
    if isinstance(value, str) and _BARE_VALUE.fullmatch(value):
        return value
    return json.dumps(value, default=_jsonable)
