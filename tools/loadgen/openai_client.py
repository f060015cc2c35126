"""The load generator's OpenAI HTTP driver (`llmserve bench --http`): the same planned requests,
sent to an OpenAI-compatible server's streaming endpoints and recorded as the gRPC driver records
them, so one report (loadgen/stats.py) measures both faces of the gateway, or any other server.

  chat form                POST {base}/chat/completions   messages (the shared prefix as the system turn)
  text and token-ids form  POST {base}/completions        prompt as a string, or as token ids

Every request streams (Server-Sent Events) with `stream_options.include_usage`, greedy, and with
`ignore_eos` (vLLM's and our extra-body field) unless --allow-eos. What is recorded:
  - a message time for each chunk whose content is non-empty: TTFT is the first, ITL the gaps.
    An OpenAI chunk says nothing of how many tokens it carries, so each counts as one (vLLM's and
    guidellm's benchmarks count the same way); our gateway sends one chunk per detokenized delta,
    one token unless it coalesced for a slow reader or held text back (an incomplete character,
    a possible stop string), and the report's `num_messages` beside `num_completion_tokens` shows
    how often that happened;
  - prompt, completion and cached tokens from the usage chunk: a stream without one is an error
    (NO_USAGE), never a count guessed from the chunks;
  - an HTTP error as `HTTP_<status>` with the body's message, an error event inside a 200 stream
    (what OpenAI's server sends after the headers) as `STREAM_ERROR`, an event that is not such
    JSON as `BAD_RESPONSE`, the client's own deadline (--timeout-s over the whole request) as
    DEADLINE_EXCEEDED, as in the gRPC mode.

aiohttp's client (already a dependency, for the gateway's server): one session per client process,
its connection pool sized to the process's requests in flight, so each stream keeps one
keep-alive HTTP/1.1 connection and no request waits for a free one.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

import aiohttp

from llmserve.tools.loadgen.client import ClientPlan, RequestRecord
from llmserve.tools.loadgen.conversation import Conversation
from llmserve.tools.loadgen.workload import PlannedRequest, PromptForm

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
CHAT_PATH, COMPLETIONS_PATH = "chat/completions", "completions"  # under the base URL
_DATA = b"data:"
_DONE = b"[DONE]"
_MODELS_TIMEOUT_S = 30.0


def connect(plan: ClientPlan) -> aiohttp.ClientSession:
    """The client process's session (ClientPlan.connect)."""
    connector = aiohttp.TCPConnector(limit=plan.max_in_flight, limit_per_host=plan.max_in_flight)
    # A deadline over the whole request, as gRPC's is; no read timeout of its own beside it.
    timeout = aiohttp.ClientTimeout(total=plan.timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


def served_model(base_url: str) -> str:
    """The first model `GET {base_url}/models` lists: what a request names when --model is not given
    (the OpenAI API requires a model; our gateway would take none)."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=_MODELS_TIMEOUT_S) as response:
        models = json.load(response)["data"]
    if not models:
        raise SystemExit(f"llmserve bench: {base_url}/models lists no model")
    return models[0]["id"]


def request_body(planned: PlannedRequest, plan: ClientPlan, conversation: Conversation) -> tuple[str, dict[str, Any]]:
    """(endpoint path, JSON body) of one planned request: greedy, exactly max_tokens when ignore_eos."""
    body: dict[str, Any] = {
        "model": plan.model, "max_tokens": planned.max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if plan.ignore_eos:
        body["ignore_eos"] = True
    form = plan.workload.prompt_form
    if form is PromptForm.CHAT:
        body["messages"] = [{"role": role, "content": content} for role, content in conversation.chat_messages(planned)]
        return CHAT_PATH, body
    if form is PromptForm.TOKEN_IDS:
        body["prompt"] = conversation.prompt_token_ids(planned)
    else:
        body["prompt"] = conversation.prompt_text(planned)
    return COMPLETIONS_PATH, body


async def send_one(session: aiohttp.ClientSession, planned: PlannedRequest, plan: ClientPlan,
                   conversation: Conversation) -> RequestRecord:
    """One streamed request (ClientPlan.send), recorded."""
    record = RequestRecord(planned.index, planned.prefix_group, planned.num_prompt_tokens, planned.max_tokens)
    path, body = request_body(planned, plan, conversation)
    record.start_s = time.monotonic()
    try:
        async with session.post(f"{plan.address.rstrip('/')}/{path}", json=body) as response:
            if response.status != 200:
                record.status, record.error = f"HTTP_{response.status}", _error_message(await response.text())
            else:
                is_chat = path == CHAT_PATH
                await _read_events(record, response.content, is_chat, keep_answer=plan.workload.num_turns > 1)
    except asyncio.TimeoutError:
        record.status, record.error = "DEADLINE_EXCEEDED", f"no complete answer within {plan.timeout_s} s"
    except aiohttp.ClientError as error:
        record.status, record.error = "CONNECTION_ERROR", f"{type(error).__name__}: {error}"
    except (ValueError, KeyError, TypeError) as error:  # an event that is not the JSON OpenAI sends
        record.status, record.error = "BAD_RESPONSE", f"{type(error).__name__}: {str(error)[:300]}"
    record.end_s = time.monotonic()
    return record


async def _read_events(record: RequestRecord, content: aiohttp.StreamReader, is_chat: bool, keep_answer: bool) -> None:
    """Read the SSE stream into `record` (see the module's docstring for what counts)."""
    has_usage = False
    async for line in content:
        if not line.startswith(_DATA):
            continue  # blank separators, ": comments", other SSE fields
        data = line[len(_DATA):].strip()
        if data == _DONE:
            break
        now = time.monotonic()
        event = json.loads(data)
        if "error" in event:
            record.status, record.error = "STREAM_ERROR", _error_message(data)
            return
        text = _content_of(event, is_chat)
        if text:
            record.message_times_s.append(now)
            record.message_num_tokens.append(1)
            if keep_answer:
                record.answer_text += text
        if usage := event.get("usage"):
            has_usage = True
            record.num_prompt_tokens = usage["prompt_tokens"]
            record.num_completion_tokens = usage["completion_tokens"]
            record.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    else:
        record.status, record.error = "CONNECTION_ERROR", "the stream ended before data: [DONE]"
        return
    if not has_usage:
        record.status, record.error = "NO_USAGE", "the stream carried no usage chunk (stream_options.include_usage)"


def _content_of(event: dict, is_chat: bool) -> str:
    """The text of a chunk's first choice: `delta.content` (chat) or `text` (completions)."""
    choices = event.get("choices")
    if not choices:
        return ""
    choice = choices[0]
    return ((choice.get("delta") or {}).get("content") if is_chat else choice.get("text")) or ""


def _error_message(text: str | bytes) -> str:
    """OpenAI's `{"error": {"message": ...}}`, else the start of the body as it came."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return (text.decode(errors="replace") if isinstance(text, bytes) else text)[:500]
