"""Text the services write about what a client sent: a value quoted short, a long text cut.

A client controls the length of every string it sends (a model name, a chat role, a request
id), and a status message, an error detail or a log line that repeats such a value in full
grows with it: a 9,000-character model name quoted twice in the trailing metadata (the
message, then the google.rpc.Status) exceeded grpc's 16 KiB metadata limit, so the client got
RESOURCE_EXHAUSTED "Stream removed" instead of NOT_FOUND; a 100 KB role made a 100 KB log line
per request. So a client value is never written whole unless it is short:

    quoted("user")      -> 'user'                   (short: as repr writes it)
    quoted("r" * 7000)  -> 'rrrrrrrr…' (7000 bytes)   (long: a prefix, then the length)

and any text that may have grown so (a message, a log line) is `shortened` to a byte budget,
with a marker saying how much was cut.
"""

from __future__ import annotations

# A value whose repr is at most this long is quoted whole; a longer one is cut to a prefix
# whose repr is at most QUOTED_PREFIX_CHARS, so a quote is at most ~70 characters whatever the
# value holds (an escape such as \U0010ffff takes 10 characters of repr for one of the value).
MAX_WHOLE_QUOTE_CHARS = 64
QUOTED_PREFIX_CHARS = 40
# Room `shortened` keeps for its marker (" …[N bytes cut]… ": at most ~40 bytes of UTF-8).
_MARKER_BYTES = 48


def quoted(value: str | bytes) -> str:
    """`value` as repr writes it when short, else its first characters and its length:
    `'rrrr…' (7000 bytes)` (UTF-8 bytes for a str). Never more than ~70 characters; newlines,
    controls and lone surrogates are escaped, as repr escapes them."""
    # repr writes at least len(value) + 2 characters: a long value's whole repr is never built.
    if len(value) + 2 <= MAX_WHOLE_QUOTE_CHARS and len(whole := repr(value)) <= MAX_WHOLE_QUOTE_CHARS:
        return whole
    prefix = _repr_prefix(value)
    return f"{prefix[:-1]}…{prefix[-1]} ({num_bytes(value)} bytes)"


def num_bytes(value: str | bytes) -> int:
    """The value's length in bytes: UTF-8 for a str, without a copy for ASCII text (isascii is
    O(1)); a lone surrogate counts 3, as it would encode with surrogatepass. The prompt byte
    caps measure with it too."""
    if isinstance(value, bytes):
        return len(value)
    return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))


def _repr_prefix(value: str | bytes) -> str:
    """The repr of the longest prefix of `value` whose repr fits QUOTED_PREFIX_CHARS."""
    num_chars = QUOTED_PREFIX_CHARS  # repr never writes fewer characters than the value has
    while num_chars > 0 and len(repr(value[:num_chars])) > QUOTED_PREFIX_CHARS:
        num_chars -= 1
    return repr(value[:num_chars])


def shortened(text: str, max_bytes: int) -> str:
    """`text` when its UTF-8 is at most `max_bytes`, else its head and tail around a marker
    saying how many bytes were cut (" …[98000 bytes cut]… "), within `max_bytes` (at least
    64) in all. The
    tail is kept because a traceback's last line says what failed. A character split by the
    cut, or a lone surrogate next to it, is dropped."""
    if num_bytes(text) <= max_bytes:
        return text
    data = text.encode("utf-8", "surrogatepass")
    num_kept = max(0, max_bytes - _MARKER_BYTES)
    num_head = num_kept * 3 // 4
    num_tail = num_kept - num_head
    head = data[:num_head].decode("utf-8", "ignore")
    tail = data[len(data) - num_tail:].decode("utf-8", "ignore") if num_tail else ""
    return f"{head} …[{len(data) - num_head - num_tail} bytes cut]… {tail}"
