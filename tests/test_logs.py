"""Structured logs: the formatters (unit), the request-id context (unit, in asyncio tasks), and
real services run with `--log-format json --log-level DEBUG`: every line of their log is a JSON
object, the lines of a request carry its id, and prompt text (or its token ids) appears only
with `--log-prompts`, and then only in the text fields."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest

from llmserve.log_format import TEXT_FIELDS, JsonFormatter, TextFormatter
from llmserve.request_context import RequestIdFilter, bind_request_id, context_without_request, serving_request
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, preprocess_pb2, preprocess_pb2_grpc
from tests.procs import running_service, running_stack

SECRET = "my card number is 4111 1111 1111 1111, swordfish"
REQUEST_ID = "req-logs-0001"
JSON_DEBUG = ["--log-format", "json", "--log-level", "DEBUG"]


def _logger(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    """A logger of its own writing through one handler with `formatter` and the request-id filter."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    handler.addFilter(RequestIdFilter())
    logger = logging.getLogger(f"tests.logs.{id(out)}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.handlers = [handler]
    return logger, out


def _json_lines(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


# --- formatters ---------------------------------------------------------------------------------


def test_a_json_line_has_the_documented_keys_in_order():
    logger, out = _logger(JsonFormatter("preprocess", log_prompts=False))
    with serving_request("r-1"):
        logger.info("tokenized %d prompts", 3, extra={"bucket": 2})
    (line,) = _json_lines(out)
    assert list(line) == ["time", "level", "service", "logger", "message", "request_id", "bucket"]
    assert (line["level"], line["service"], line["logger"]) == ("INFO", "preprocess", logger.name)
    assert (line["message"], line["request_id"], line["bucket"]) == ("tokenized 3 prompts", "r-1", 2)
    logged_at = datetime.fromisoformat(line["time"].replace("Z", "+00:00"))
    assert line["time"].endswith("Z") and abs(datetime.now(timezone.utc) - logged_at) < timedelta(seconds=5)


def test_a_json_line_has_no_request_id_outside_a_request_and_the_traceback_as_one_field():
    logger, out = _logger(JsonFormatter("gateway", log_prompts=False))
    try:
        raise ValueError("bad value")
    except ValueError:
        logger.exception("it failed")
    (line,) = _json_lines(out)
    assert "request_id" not in line
    assert line["exc_info"].startswith("Traceback") and "ValueError: bad value" in line["exc_info"]
    assert len(out.getvalue().splitlines()) == 1


def test_an_extra_field_never_hides_a_documented_key():
    logger, out = _logger(JsonFormatter("gateway", log_prompts=False))
    logger.info("hello", extra={"service": "spoofed", "level": "NONE"})
    (line,) = _json_lines(out)
    assert (line["service"], line["level"]) == ("gateway", "INFO")


@pytest.mark.parametrize("log_prompts", [False, True])
def test_text_fields_are_written_only_with_log_prompts(log_prompts):
    text = {"prompt": SECRET, "prompt_token_ids": [11, 12], "completion": "sure", "completion_token_ids": [13],
            "matched_stop": "###"}
    assert set(text) == TEXT_FIELDS
    json_logger, json_out = _logger(JsonFormatter("gateway", log_prompts=log_prompts))
    text_logger, text_out = _logger(TextFormatter("gateway", log_prompts=log_prompts))
    for logger in (json_logger, text_logger):
        logger.debug("finished: %d tokens", 1, extra={**text, "num_cached_tokens": 0})
    (line,) = _json_lines(json_out)
    assert {key: line.get(key) for key in text} == (text if log_prompts else dict.fromkeys(text))
    assert line["num_cached_tokens"] == 0
    assert (SECRET in text_out.getvalue()) == log_prompts
    assert ("prompt_token_ids=[11, 12]" in text_out.getvalue()) == log_prompts


def test_a_text_line_ends_with_the_request_id_and_the_extra_fields():
    logger, out = _logger(TextFormatter("gateway/1", log_prompts=True))
    with serving_request("0af3"):
        logger.warning("aborted", extra={"reason": "client went away", "prompt": "hi"})
    line = out.getvalue().rstrip("\n")
    assert f"WARNING gateway/1 {logger.name}: aborted request_id=0af3" in line
    assert line.endswith(' reason="client went away" prompt=hi')


def test_a_dataclass_field_is_written_as_its_fields():
    from llmserve.sampling import ChatMessage

    logger, out = _logger(JsonFormatter("gateway", log_prompts=True))
    logger.debug("accepted", extra={"prompt": (ChatMessage(role="user", content=SECRET),)})
    (line,) = _json_lines(out)
    assert line["prompt"] == [{"role": "user", "content": SECRET}]


# --- the request-id context -------------------------------------------------------------------


def test_each_task_logs_its_own_request_id_and_tasks_it_starts_inherit_it():
    logger, out = _logger(JsonFormatter("inference", log_prompts=False))

    async def handle(request_id: str, started: asyncio.Event, other_started: asyncio.Event) -> None:
        bind_request_id(request_id)
        started.set()
        await other_started.wait()  # both bound now: neither may see the other's id
        logger.info("handling")
        await asyncio.create_task(asyncio.to_thread(logger.info, "child"))
        shared = asyncio.get_running_loop().create_task(_log(logger, "shared"), context=context_without_request())
        await shared

    async def main() -> None:
        a, b = asyncio.Event(), asyncio.Event()
        await asyncio.gather(handle("a", a, b), handle("b", b, a))
        logger.info("outside")

    asyncio.run(main())
    lines = [(line["message"], line.get("request_id")) for line in _json_lines(out)]
    assert sorted(lines, key=str) == sorted(
        [("handling", "a"), ("handling", "b"), ("child", "a"), ("child", "b"), ("shared", None), ("shared", None),
         ("outside", None)],
        key=str,
    )


async def _log(logger: logging.Logger, message: str) -> None:
    logger.info(message)


def test_serving_request_labels_only_the_block():
    logger, out = _logger(JsonFormatter("inference", log_prompts=False))
    with serving_request("outer"):
        with serving_request("inner"):
            logger.info("one")
        logger.info("two")
    logger.info("three")
    assert [line.get("request_id") for line in _json_lines(out)] == ["inner", "outer", None]


# --- real services ------------------------------------------------------------------------------


def _read_json_log(path: Path) -> list[dict]:
    """Every line of the service's log (stdout and stderr) as JSON: fails on any line that is not."""
    lines = []
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            pytest.fail(f"{path.name} line {number} is not JSON: {text!r}")
    return lines


def _logged_between(lines: list[dict], start: datetime, end: datetime) -> list[dict]:
    start_ms = start.replace(microsecond=start.microsecond // 1000 * 1000)  # the log's times are truncated
    return [line for line in lines if start_ms <= datetime.fromisoformat(line["time"].replace("Z", "+00:00")) <= end]


def _without_text_fields(line: dict) -> str:
    return json.dumps({key: value for key, value in line.items() if key not in TEXT_FIELDS})


def _token_ids_text(token_ids) -> str:
    return json.dumps(list(token_ids))[1:-1]  # "5, 6, 7": how a run of them reads in a JSON line


@pytest.mark.parametrize("log_prompts", [False, True], ids=["default", "log-prompts"])
def test_preprocess_labels_its_request_and_logs_the_prompt_only_when_asked(tiny_model_dir, tmp_path, log_prompts):
    flags = ["--model", str(tiny_model_dir), *JSON_DEBUG, *(["--log-prompts"] if log_prompts else [])]
    with running_service("preprocess", flags, tmp_path) as service:
        stub = preprocess_pb2_grpc.PreprocessServiceStub(grpc.insecure_channel(service.address))
        start = datetime.now(timezone.utc)
        response = stub.Preprocess(preprocess_pb2.PreprocessRequest(request_id=REQUEST_ID, prompt=SECRET))
        end = datetime.now(timezone.utc)
        with pytest.raises(grpc.RpcError):  # another RPC on the same channel, with no request id
            stub.Tokenize(preprocess_pb2.TokenizeRequest())
    lines = _read_json_log(tmp_path / "preprocess.log")

    # The Tokenize call's line ends the request's lines: log times are truncated to the
    # millisecond, so a line logged just after `end` can carry a time before it.
    (rejected_at,) = [i for i, line in enumerate(lines) if line["message"].startswith("tokenize rejected")]
    serving = _logged_between(lines[:rejected_at], start, end)
    assert serving and all(line.get("request_id") == REQUEST_ID for line in serving)
    rejected = lines[rejected_at]
    assert "request_id" not in rejected
    (preprocessed,) = [line for line in lines if line["message"].startswith("preprocessed")]
    assert f"prompt_tokens={len(response.token_ids)}" in preprocessed["message"]

    whole_log = (tmp_path / "preprocess.log").read_text()
    prompt_ids = _token_ids_text(response.token_ids)
    assert (SECRET in whole_log) == log_prompts and (prompt_ids in whole_log) == log_prompts
    assert not any(SECRET in _without_text_fields(line) or prompt_ids in _without_text_fields(line) for line in lines)
    if log_prompts:
        assert (preprocessed["prompt"], preprocessed["prompt_token_ids"]) == (SECRET, list(response.token_ids))


def test_the_gateway_stack_labels_every_hop_and_keeps_text_in_the_text_fields(tiny_model_dir, tmp_path):
    """One request through gateway → preprocess → inference (the Multiplex path, the engine in its
    own process), all with --log-prompts: each service labels the request's lines with the id the
    gateway minted, and prompt text or token ids appear in text fields only (which the formatter
    drops without the flag: test_text_fields_are_written_only_with_log_prompts)."""
    flags = [*JSON_DEBUG, "--log-prompts"]
    # Through preprocess: a prompt this small would otherwise be preprocessed in the gateway.
    with running_stack(tiny_model_dir, tmp_path, service_args=flags,
                       gateway_args=["--local-preprocess-max-bytes", "0"]) as stack:
        gateway = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack["gateway"].address))
        params = gateway_pb2.GenerateParams(
            prompt=SECRET, sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0), return_token_ids=True
        )
        start = datetime.now(timezone.utc)
        response = gateway.Generate(gateway_pb2.GenerateRequest(params=params))
        end = datetime.now(timezone.utc)
    request_id = response.request_id
    logs = {name: _read_json_log(tmp_path / f"{name}.log") for name in ("gateway", "preprocess", "inference")}

    for name, lines in logs.items():
        labelled = [line for line in lines if line.get("request_id") == request_id]
        assert labelled, f"{name} logged no line with the request id"
        assert all(line.get("request_id") in (None, request_id) for line in lines), name
        assert not any(SECRET in _without_text_fields(line) for line in lines), name
        for line in _logged_between(lines, start, end):
            if request_id in line["message"]:
                assert line.get("request_id") == request_id, line
    gateway_lines = {line["message"].split(":")[0]: line for line in logs["gateway"] if "request_id" in line}
    assert gateway_lines["accepted"]["prompt"] == SECRET  # the prompt input as preprocess gets it
    assert gateway_lines["completion sent"]["completion"] == response.text
    assert gateway_lines["completion sent"]["completion_token_ids"] == list(response.token_ids)
    # Bound to the RPC, not passed line by line: the pipeline's own line carries it too.
    assert any(key.startswith(f"request {request_id} finished") for key in gateway_lines), list(gateway_lines)
    (preprocessed,) = [line for line in logs["preprocess"] if line["message"].startswith("preprocessed")]
    (admitted,) = [line for line in logs["inference"] if line["message"].startswith("admitted")]
    assert preprocessed["request_id"] == admitted["request_id"] == request_id
    assert admitted["prompt_token_ids"] == preprocessed["prompt_token_ids"]
    prompt_ids = _token_ids_text(preprocessed["prompt_token_ids"])
    for name, lines in logs.items():
        assert not any(prompt_ids in _without_text_fields(line) for line in lines), name
