"""How large a request each service accepts (its receive-message limit), derived from what it
legitimately receives. A larger message is refused before it is parsed (llmserve.undecodable):
the client gets RESOURCE_EXHAUSTED "request: N bytes exceeds the limit of LIMIT bytes for
/llmserve.v1.<Service>/<Method>; not parsed", without RetryInfo, and the server keeps serving.

  gateway, preprocess: the prompt byte cap (prompt text, or a chat's roles, contents and turn
                       framing) or the context as token ids, whichever is larger, + slack;
  inference:           the context as token ids and one block hash per block, + slack.

The slack covers every other field: request id, model name, sampling with its stop strings
and a response format's schema (at most MAX_SCHEMA_BYTES, on top of the rest).
"""

from __future__ import annotations

from llmserve.response_format import MAX_SCHEMA_BYTES

# The most bytes one uint32 takes as a protobuf varint (ids of a large vocabulary, or any id a
# client sends before it is checked against the vocabulary).
MAX_TOKEN_ID_BYTES = 5
# The most bytes one uint64 block hash takes as a varint (hashes use all 64 bits).
MAX_BLOCK_HASH_BYTES = 10
# Room for a request's fields besides its prompt; stop strings beyond this are refused.
REQUEST_SLACK_BYTES = 64 * 1024 + MAX_SCHEMA_BYTES


def prompt_request_bytes(max_prompt_bytes: int, max_context_tokens: int) -> int:
    """The receive limit of a service that takes prompts as text, chat or token ids."""
    return max(max_prompt_bytes, max_context_tokens * MAX_TOKEN_ID_BYTES) + REQUEST_SLACK_BYTES


def token_ids_request_bytes(max_context_tokens: int, block_size_tokens: int) -> int:
    """The receive limit of a service that takes prompts as token ids with their block hashes."""
    num_blocks = -(-max_context_tokens // block_size_tokens)
    return max_context_tokens * MAX_TOKEN_ID_BYTES + num_blocks * MAX_BLOCK_HASH_BYTES + REQUEST_SLACK_BYTES
