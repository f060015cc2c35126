"""The gateway's OpenAI-compatible HTTP face (issue 21, first part): `--http-port`.

A second face of the same gateway, not a proxy: it runs on the worker's event loop (aiohttp),
turns each body into the gateway's own GenerateParams (openai_params.py), and runs it through
the same validation, GenerationPipeline, routing, admission and metrics as gRPC.

  POST /v1/chat/completions   chat; `stream: true` answers Server-Sent Events in OpenAI's framing
  POST /v1/completions        one prompt (text or token ids), streamed the same way
  GET  /v1/models             the served model
  GET  /health                200 while serving, 503 while draining

Every answer carries `x-request-id` (the id the gateway logs the request under). Errors are
OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the status clients expect:
400 a bad field (named in `param`), 404 an unknown model, 413 a body over the limit (refused as it
is read, not after), 429 with `Retry-After` from admission, 503 unavailable or draining, 504 past
the deadline a request may carry in milliseconds (`x-request-timeout-ms`, or Envoy's
`x-envoy-expected-rq-timeout-ms`): it goes down to preprocess, admission and the engine as a
gRPC client's does. A client that disconnects cancels its handler (handler_cancellation), which closes
its generation: the inference request is aborted and its KV blocks freed, as for a gRPC cancel.
Logprobs come in each endpoint's shape (openai_logprobs.py). `n` > 1 answers one choice per
sequence (`index`), streamed interleaved, with the usage of all of them; a completions `prompt`
list (at most 32) runs each prompt as a request of its own, answered as one (merged_deltas.py).
`response_format` (json_object, json_schema) constrains decoding in the engine (openai_params.py
reads it into the same SamplingParams field gRPC clients set).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

import grpc
from aiohttp import web

from llmserve.client_text import quoted
from llmserve.gateway.connection_age import age_http_connections
from llmserve.errors import InvalidArgument, ServiceError, Unavailable
from llmserve.gateway.detokenizer import Detokenizer
from llmserve.gateway.generation import GenerationDelta, GenerationResult
from llmserve.gateway.openai_logprobs import CompletionLogprobs, TokenText, chat_logprobs
from llmserve.gateway.merged_deltas import merged_deltas
from llmserve.gateway.metrics import tracked_request
from llmserve.gateway.openai_params import chat_params, completion_params, openai_param
from llmserve.gateway.request_id import REQUEST_ID_METADATA_KEY, new_request_id
from llmserve.gateway.servicer import GatewayServicer
from llmserve.request_context import bind_request_id
from llmserve.sampling import FinishReason, TokenLogprob

log = logging.getLogger(__name__)

# gRPC status → (HTTP status, OpenAI error type).
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


# Where an HTTP request says how long it may take (no OpenAI field does): our own header, and the
# one Envoy sets on the requests it routes (its route timeout), so a proxy's deadline carries on.
DEADLINE_HEADERS = ("x-request-timeout-ms", "x-envoy-expected-rq-timeout-ms")
MAX_DEADLINE_MS = 24 * 3600 * 1000


class _HttpDeadline:
    """An HTTP request's deadline, asked for as a gRPC context's (tracked_request, the pipeline,
    which passes it to preprocess and to inference's admission and engine); None: no deadline."""

    def __init__(self, timeout_s: float | None):
        self._deadline_s = None if timeout_s is None else time.monotonic() + timeout_s

    def time_remaining(self) -> float | None:
        return None if self._deadline_s is None else self._deadline_s - time.monotonic()


def _deadline_of(request: web.Request) -> _HttpDeadline:
    for name in DEADLINE_HEADERS:
        value = request.headers.get(name)
        if value is None:
            continue
        if not value.strip().isdigit() or not 0 < int(value) <= MAX_DEADLINE_MS:
            raise InvalidArgument(name, f"must be milliseconds in [1, {MAX_DEADLINE_MS}], got {quoted(value)}")
        return _HttpDeadline(int(value) / 1000)
    return _HttpDeadline(None)


class OpenAIHttpApi:
    """The handlers; `servicer` is the gRPC face, whose validation and pipeline they share."""

    def __init__(self, servicer: GatewayServicer, detokenizer: Detokenizer, *, max_body_bytes: int):
        self._servicer = servicer
        self._max_body_bytes = max_body_bytes
        self.is_serving = True
        decoder = detokenizer.decoder
        self._token_text: TokenText = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: decoder.decode_without_clean_up([token_id], skip_special_tokens=False)
        )

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body_bytes, middlewares=[self._errors_middleware])
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    # --- endpoints ---------------------------------------------------------------------------

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda body: [chat_params(body)], _ChatShape)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, completion_params, _CompletionShape)

    async def _models(self, request: web.Request) -> web.Response:
        card = self._servicer.model
        model = {
            "id": self._servicer.model_name, "object": "model", "created": 0, "owned_by": "llmserve",
            "max_model_len": card.max_context_tokens,
        }  # fmt: skip
        return web.json_response({"object": "list", "data": [model]})

    async def _health(self, request: web.Request) -> web.Response:
        if not self.is_serving:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    # --- generation --------------------------------------------------------------------------

    async def _generate(self, request: web.Request, to_params: Callable, shape_type: type["_Shape"]) -> web.StreamResponse:
        if not self.is_serving:
            raise Unavailable("the gateway is draining (SIGTERM): send the request to another one")
        arrival_ns = time.monotonic_ns()
        request_id = new_request_id()
        bind_request_id(request_id)
        request["request_id"] = request_id
        body = await _json_body(request, self._max_body_bytes)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidArgument("stream", "must be a boolean")
        include_usage = stream and bool((body.get("stream_options") or {}).get("include_usage"))
        # Several prompts: a request each (the first under the answer's id), answered as one.
        generations = [
            self._servicer.request_from_params(params, request_id if index == 0 else f"{request_id}-{index}", arrival_ns)
            for index, params in enumerate(to_params(body))
        ]
        sampling = generations[0].sampling
        shape = shape_type(self._token_text, wants_logprobs=sampling.logprobs is not None, n=sampling.n)
        context = _Context(request_id, self._servicer.model_name, int(time.time()))
        deadline = _deadline_of(request)
        with tracked_request(deadline) as outcome:
            deltas = merged_deltas(
                [self._servicer.pipeline.generate(generation, deadline.time_remaining) for generation in generations],
                sampling.n,
            )
            async with aclosing(deltas):
                if stream:
                    return await self._stream(request, deltas, shape, context, include_usage, outcome)
                return await self._whole(deltas, shape, context, outcome)

    async def _whole(self, deltas: AsyncIterator[GenerationDelta], shape: "_Shape", context: "_Context", outcome) -> web.Response:
        choices: dict[int, _Choice] = {}
        async for delta in deltas:
            choice = choices.setdefault(delta.sequence_index, _Choice())
            choice.texts.append(delta.text)
            choice.logprobs.extend(delta.logprobs or ())
            if delta.result is not None:
                choice.result = delta.result
                outcome.finish_reason = delta.result.finish_reason
        response = shape.whole(context, [choices[index] for index in sorted(choices)])
        return web.json_response(response, headers={REQUEST_ID_METADATA_KEY: context.request_id})

    async def _stream(
        self, request: web.Request, deltas: AsyncIterator[GenerationDelta],
        shape: "_Shape", context: "_Context", include_usage: bool, outcome,
    ) -> web.StreamResponse:  # fmt: skip
        # The first delta before the headers: an error in preprocess or admission (400, 429)
        # is still an HTTP status, not an event in a 200 stream.
        first = await anext(deltas)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", REQUEST_ID_METADATA_KEY: context.request_id}
        )  # fmt: skip
        await response.prepare(request)
        started: set[int] = set()  # sequences whose first chunk (the role) went out
        results: dict[int, GenerationResult] = {}  # by choice index
        try:
            delta: GenerationDelta | None = first
            while delta is not None:
                if delta.sequence_index not in started:
                    started.add(delta.sequence_index)
                    await _send_event(response, shape.first_chunk(context, delta.sequence_index))
                if delta.text or delta.logprobs or delta.result is not None:
                    await _send_event(response, shape.chunk(context, delta))
                if delta.result is not None:
                    outcome.finish_reason = delta.result.finish_reason
                    results[delta.sequence_index] = delta.result
                delta = await anext(deltas, None)
            if include_usage:
                await _send_event(response, shape.usage_chunk(context, [results[index] for index in sorted(results)]))
        except ServiceError as error:  # after the headers: an error event, as OpenAI's server sends
            await _send_event(response, _error_body(error)[1])
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ServiceError as error:
            status, body = _error_body(error)
            headers = {}
            if error.retry_after_ms:
                headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_ms / 1000)))
            if "request_id" in request:
                headers[REQUEST_ID_METADATA_KEY] = request["request_id"]
            return web.json_response(body, status=status, headers=headers)
        except web.HTTPRequestEntityTooLarge:
            return web.json_response(
                _openai_error(f"the request body exceeds {self._max_body_bytes} bytes", "invalid_request_error", None, 413),
                status=413,
            )  # fmt: skip
        except web.HTTPException as error:
            return web.json_response(_openai_error(error.reason, "invalid_request_error", None, error.status), status=error.status)
        except Exception:  # a defect: logged here with its traceback, never sent to the client
            log.exception("HTTP %s %s failed", request.method, request.path)
            return web.json_response(_openai_error("internal error", "internal_error", None, 500), status=500)


async def _json_body(request: web.Request, max_body_bytes: int) -> dict[str, Any]:
    if request.content_length is not None and request.content_length > max_body_bytes:  # before reading any
        raise web.HTTPRequestEntityTooLarge(max_size=max_body_bytes, actual_size=request.content_length)
    raw = await request.read()  # bounded by client_max_size (a chunked body): 413 past it
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise InvalidArgument("body", f"not valid JSON: {str(error)[:200]}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return body


async def _send_event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


def _error_body(error: ServiceError) -> tuple[int, dict]:
    status, kind = _HTTP_STATUS.get(error.code, (500, "internal_error"))
    param = openai_param(error.field) if isinstance(error, InvalidArgument) else None
    message = f"{openai_param(error.field)}: {error.problem}" if isinstance(error, InvalidArgument) else error.message
    return status, _openai_error(message, kind, param, error.code.name.lower())


def _openai_error(message: str, kind: str, param: str | None, code: Any) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Context:
    __slots__ = ("request_id", "model", "created")

    def __init__(self, request_id: str, model: str, created: int):
        self.request_id, self.model, self.created = request_id, model, created


class _Choice:
    """One sequence of a whole (non-streamed) answer, gathered from its deltas."""

    __slots__ = ("texts", "logprobs", "result")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.result: GenerationResult | None = None


def _usage(results: list[GenerationResult], n: int) -> dict:
    """The request's usage: each prompt once (the results come n per prompt, in choice order),
    the completion tokens of every sequence."""
    per_prompt = results[::n]
    prompt_tokens = sum(result.num_prompt_tokens for result in per_prompt)
    completion_tokens = sum(result.num_completion_tokens for result in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(result.num_cached_tokens for result in per_prompt)},
    }


def _finish_reason(result: GenerationResult | None) -> str | None:
    return None if result is None else _FINISH_REASONS.get(result.finish_reason, "stop")


class _Shape:
    """How one endpoint's responses look, whole and as stream chunks, for one request."""

    object_whole: str
    object_chunk: str
    id_prefix: str

    def __init__(self, token_text: TokenText, *, wants_logprobs: bool, n: int):
        self._token_text = token_text
        self._wants_logprobs = wants_logprobs
        self._n = n  # sequences per prompt: choice i x n + j is prompt i's sequence j

    def _base(self, context: _Context, kind: str) -> dict:
        return {"id": f"{self.id_prefix}-{context.request_id}", "object": kind, "created": context.created, "model": context.model}

    def whole(self, context: _Context, choices: list[_Choice]) -> dict:
        """The answer: one choice per sequence, in index order (each has its result)."""
        whole_choices = [
            self._whole_choice(index, "".join(choice.texts), choice.result, self._logprobs(index, choice.logprobs))
            for index, choice in enumerate(choices)
        ]
        usage = _usage([choice.result for choice in choices], self._n)
        return {**self._base(context, self.object_whole), "choices": whole_choices, "usage": usage}

    def first_chunk(self, context: _Context, index: int) -> dict:
        return {**self._base(context, self.object_chunk), "choices": [self._chunk_choice(index, "", None, None, first=True)]}

    def chunk(self, context: _Context, delta: GenerationDelta) -> dict:
        logprobs = self._logprobs(delta.sequence_index, delta.logprobs or [])
        choice = self._chunk_choice(delta.sequence_index, delta.text, delta.result, logprobs, first=False)
        return {**self._base(context, self.object_chunk), "choices": [choice]}

    def usage_chunk(self, context: _Context, results: list[GenerationResult]) -> dict:
        return {**self._base(context, self.object_chunk), "choices": [], "usage": _usage(results, self._n)}

    def _logprobs(self, index: int, items: list[TokenLogprob]) -> dict | None:
        """Choice `index`'s logprobs for `items`, or None when the request asked for none."""
        raise NotImplementedError

    def _whole_choice(self, index: int, text: str, result: GenerationResult, logprobs: dict | None) -> dict:
        raise NotImplementedError

    def _chunk_choice(self, index: int, text: str, result: GenerationResult | None, logprobs: dict | None, *,
                      first: bool) -> dict:
        raise NotImplementedError


class _ChatShape(_Shape):
    object_whole, object_chunk, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def _logprobs(self, index: int, items: list[TokenLogprob]) -> dict | None:
        return chat_logprobs(items, self._token_text) if self._wants_logprobs else None

    def _whole_choice(self, index: int, text: str, result: GenerationResult, logprobs: dict | None) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": _finish_reason(result)}

    def _chunk_choice(self, index: int, text: str, result: GenerationResult | None, logprobs: dict | None, *,
                      first: bool) -> dict:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": _finish_reason(result)}


class _CompletionShape(_Shape):
    object_whole, object_chunk, id_prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, token_text: TokenText, *, wants_logprobs: bool, n: int):
        super().__init__(token_text, wants_logprobs=wants_logprobs, n=n)
        self._completion_logprobs: dict[int, CompletionLogprobs] = {}  # per choice: its text_offset runs on

    def _logprobs(self, index: int, items: list[TokenLogprob]) -> dict | None:
        if not self._wants_logprobs:
            return None
        return self._completion_logprobs.setdefault(index, CompletionLogprobs(self._token_text)).of(items)

    def _whole_choice(self, index: int, text: str, result: GenerationResult, logprobs: dict | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish_reason(result)}

    def _chunk_choice(self, index: int, text: str, result: GenerationResult | None, logprobs: dict | None, *,
                      first: bool) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish_reason(result)}


class HttpServer:
    """The HTTP API served on the worker's loop: `drain` (on SIGTERM) makes /health 503 and
    lets in-flight requests finish; `close` stops it."""

    def __init__(self, api: OpenAIHttpApi, runner: web.AppRunner, port: int):
        self._api = api
        self._runner = runner
        self.port = port

    async def drain(self) -> None:
        self._api.is_serving = False

    async def close(self) -> None:
        await self._runner.cleanup()


async def start_http_server(
    servicer: GatewayServicer, detokenizer: Detokenizer, host: str, port: int, *, max_body_bytes: int,
    max_connection_age_s: float = 0.0,
) -> HttpServer:
    """Bound and serving on return. The port is shared by the gateway's workers (SO_REUSEPORT),
    as the gRPC one is, and its connections age as the gRPC ones do (connection_age.py)."""
    api = OpenAIHttpApi(servicer, detokenizer, max_body_bytes=max_body_bytes)
    app = api.app()
    age_http_connections(app, max_connection_age_s)
    # handler_cancellation: a client that disconnects cancels its handler, so its generation
    # closes and inference aborts the request (frees its KV blocks).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=True)
    await site.start()
    bound_port = runner.addresses[0][1]
    return HttpServer(api, runner, bound_port)
