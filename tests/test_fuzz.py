"""Property-based fuzzing of every public method of the three services, against one running
stack (real servers on port 0, the tiny model, the torch backend): valid and hostile requests
(tests/fuzz_messages.py) must each get a precise status, never UNKNOWN or INTERNAL, and never a
transport error caused by the server's own reply; after each method's cases no log line is over
a few KB, nothing crashed, every service serves and the KV pool is empty; after them all the
services' memory is bounded.

    LLMSERVE_FUZZ_EXAMPLES  cases per method (default 150: CI's few thousand in all;
                            `make fuzz`: 10,000)
    LLMSERVE_FUZZ_RANDOM=1  new cases each run (`make fuzz`); otherwise derandomized, so that a
                            failure in CI is the same failure here

A failure prints the shrunk case: the request as text (or its bytes, when they do not parse).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.message_limits import prompt_request_bytes, token_ids_request_bytes
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from llmserve.v1 import preprocess_pb2, preprocess_pb2_grpc
from tests.fuzz_messages import MAX_LOG_LINE_BYTES, Caps, Case, Method, cases, public_methods
from tests.procs import stack_fixture

EXAMPLES_ENV = "LLMSERVE_FUZZ_EXAMPLES"
RANDOM_ENV = "LLMSERVE_FUZZ_RANDOM"
DEFAULT_EXAMPLES = 150
# The longest case is a request that leaves max_tokens unset: ~240 tokens of the tiny model, about
# a second through the gateway on two idle cores, 20 s seen with other tests sharing them. A call
# that outlives this is a hang, and fails as a status the server never sent.
HANG_GUARD_S = 120.0
# Statuses that say what happened. CANCELLED only where the client cancelled.
PRECISE_CODES = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED,
})
# A status quotes client values cut short (llmserve.client_text): its google.rpc.Status, message
# and details, stays far below the client's 8 KiB metadata limit, which it is sent in twice.
MAX_STATUS_BYTES = 2048
# Streams that last as long as the replica: the client always cancels them.
ENDLESS_STREAMS = frozenset({"/llmserve.v1.InferenceService/WatchKvEvents"})
# A generous bound: fuzzing must not grow a service by more than its own size again and this.
MEMORY_SLACK_BYTES = 256 * 1024 * 1024
_CODES = {code.value[0]: code for code in grpc.StatusCode}

METHODS = public_methods()

# The most a line can carry: every request logged at DEBUG, with its prompt (--log-prompts)
stack = stack_fixture(service_args=["--log-level", "DEBUG", "--log-prompts"])


@pytest.fixture(scope="module")
def channels(stack) -> dict[str, grpc.Channel]:
    """One channel per service, with grpc's default options: a new client's limits."""
    opened = {name: grpc.insecure_channel(service.address) for name, service in stack.items()}
    yield opened
    for channel in opened.values():
        channel.close()


@pytest.fixture(scope="module")
def caps(channels) -> Caps:
    info = preprocess_pb2_grpc.PreprocessServiceStub(channels["preprocess"]).GetPreprocessInfo(
        preprocess_pb2.GetPreprocessInfoRequest(), timeout=HANG_GUARD_S
    )
    model = inference_pb2_grpc.InferenceServiceStub(channels["inference"]).GetModelInfo(
        inference_pb2.GetModelInfoRequest(), timeout=HANG_GUARD_S
    ).model
    prompt_limit = prompt_request_bytes(info.max_prompt_bytes, info.model.max_context_tokens)
    preprocess = preprocess_pb2_grpc.PreprocessServiceStub(channels["preprocess"])
    ring_entries = [
        preprocess.Preprocess(preprocess_pb2.PreprocessRequest(prompt=prompt, token_ids_in_region_from=1),
                              timeout=HANG_GUARD_S).token_ids_in_region
        for prompt in ("hello", "a prompt whose ids go through the ring")
    ]
    return Caps(
        model_name=info.model.model_name, vocab_size=model.vocab_size, context_tokens=info.model.max_context_tokens,
        max_output_tokens=info.max_output_tokens, max_prompt_bytes=info.max_prompt_bytes,
        receive_limit_bytes={
            "gateway": prompt_limit, "preprocess": prompt_limit,
            "inference": token_ids_request_bytes(model.max_context_tokens, model.block_size_tokens),
        },
        prompt_ids_in_region=tuple(entry for entry in ring_entries if entry.region_name),  # none without /dev/shm
    )


@pytest.fixture(scope="module")
def baseline_rss(stack, channels) -> dict[str, int]:
    """Each service's memory before fuzzing, after one request through all three (so that what
    the first request allocates, once, is in the baseline)."""
    sampling = common_pb2.SamplingParams(max_tokens=2)
    request = gateway_pb2.GenerateRequest(params=gateway_pb2.GenerateParams(prompt="hello", sampling=sampling))
    gateway_pb2_grpc.GatewayServiceStub(channels["gateway"]).Generate(request, timeout=HANG_GUARD_S)
    return {name: tree_rss_bytes(service.process.pid) for name, service in stack.items()}


def fuzz_settings() -> settings:
    return settings(
        max_examples=int(os.environ.get(EXAMPLES_ENV, DEFAULT_EXAMPLES)),
        deadline=None,  # a case takes what the stack takes; hangs are HANG_GUARD_S's
        derandomize=os.environ.get(RANDOM_ENV) != "1",
        database=None,  # nothing written into the checkout
        suppress_health_check=[
            HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
    )


def read_limits(method: Method) -> st.SearchStrategy[int | None]:
    """After how many responses the client cancels (None: never)."""
    if not method.is_server_streaming:
        return st.none()
    if method.path in ENDLESS_STREAMS:
        return st.integers(0, 1)  # its first message (a snapshot, or a heartbeat) comes at once
    return st.one_of(st.none(), st.none(), st.integers(0, 3))


@pytest.mark.usefixtures("baseline_rss")
@pytest.mark.parametrize("method", METHODS, ids=lambda method: method.name)
def test_every_request_gets_a_precise_status(method, stack, caps, channels):
    log_offsets = {name: service.log_path.stat().st_size for name, service in stack.items()}
    channel = channels[method.service]
    outcomes: Counter[str] = Counter()  # "kind: status" → calls, for the summary
    slowest: list[tuple[float, str, Case]] = []

    @fuzz_settings()
    @given(case=cases(method, caps, read_limits(method)))
    def fuzz(case: Case):
        call_start_s = time.monotonic()
        outcome = send(channel, method, case)
        slowest.append((time.monotonic() - call_start_s, outcome.code.name, case))
        slowest.sort(key=lambda entry: entry[0], reverse=True)
        del slowest[3:]
        outcomes[f"{'+'.join(sorted(set(case.kinds)))}: {outcome.code.name}"] += 1
        check_outcome(method, case, outcome)

    start_s = time.monotonic()
    try:
        fuzz()
    finally:
        # Captured: shown for a failure, and by `make fuzz` (pytest -rP) for every method.
        print(f"{method.path}: {sum(outcomes.values())} calls in {time.monotonic() - start_s:.0f} s; "
              + ", ".join(f"{key} {count}" for key, count in sorted(outcomes.items())))
        for seconds, code, case in slowest:
            print(f"  slow: {seconds:.1f} s, {code}: {case!r}"[:600])
    problems = log_problems(stack, log_offsets)
    assert not problems, "\n".join(problems)
    assert_idle_and_serving(stack, channels)


def test_after_fuzzing_the_stack_serves_logs_short_lines_holds_no_blocks_and_kept_its_memory(
    stack, channels, baseline_rss
):
    assert_idle_and_serving(stack, channels)
    problems = log_problems(stack, {name: 0 for name in stack})
    assert not problems, "\n".join(problems)
    grown = {}
    for name, service in stack.items():
        rss = tree_rss_bytes(service.process.pid)
        if rss > 2 * baseline_rss[name] + MEMORY_SLACK_BYTES:
            grown[name] = f"{baseline_rss[name] >> 20} MiB → {rss >> 20} MiB"
    assert grown == {}


# --- one call --------------------------------------------------------------------------------


@dataclass
class Outcome:
    """How a call ended, as the client saw it."""

    code: grpc.StatusCode
    message: str
    status: status_pb2.Status | None  # the server's google.rpc.Status, when one came
    status_problem: str | None  # why the Status sent could not be read
    is_cancelled_by_client: bool
    responses: list[Message] = field(default_factory=list)


def send(channel: grpc.Channel, method: Method, case: Case) -> Outcome:
    """Send the case's bytes as they are (request_serializer None) and read the replies with the
    method's response type, as any client would."""
    deserialize = method.response_type.FromString
    if not method.is_server_streaming and not method.is_client_streaming:
        try:
            _, call = channel.unary_unary(method.path, response_deserializer=deserialize).with_call(
                case.requests[0], timeout=HANG_GUARD_S
            )
        except grpc.RpcError as error:
            call = error
        return outcome_of(call, is_cancelled_by_client=False, responses=[])
    if method.is_client_streaming:
        call = channel.stream_stream(method.path, response_deserializer=deserialize)(
            iter(case.requests), timeout=HANG_GUARD_S
        )
    else:
        call = channel.unary_stream(method.path, response_deserializer=deserialize)(
            case.requests[0], timeout=HANG_GUARD_S
        )
    responses = read_responses(call, case.read_limit)
    is_cancelled = case.read_limit is not None and call.cancel()  # False once the call had ended
    return outcome_of(call, is_cancelled_by_client=is_cancelled, responses=responses)


def read_responses(call, read_limit: int | None) -> list[Message]:
    """The stream's responses until it ends, or the first `read_limit` of them."""
    responses: list[Message] = []
    if read_limit == 0:
        return responses
    try:
        for response in call:
            responses.append(response)
            if len(responses) == read_limit:
                break
    except grpc.RpcError:
        pass  # the status is read from the call
    return responses


def outcome_of(call, *, is_cancelled_by_client: bool, responses: list[Message]) -> Outcome:
    try:
        status, problem = rpc_status.from_call(call), None
    except ValueError as error:  # a Status whose code or message disagrees with the call's
        status, problem = None, str(error)
    return Outcome(call.code(), call.details() or "", status, problem, is_cancelled_by_client, responses)


# --- what every call must satisfy ------------------------------------------------------------


def check_outcome(method: Method, case: Case, outcome: Outcome) -> None:
    check_status(
        method.name, outcome.code, outcome.message, outcome.status, outcome.status_problem,
        outcome.is_cancelled_by_client,
    )
    if method.request_type is inference_pb2.MultiplexRequest:
        check_multiplex_outputs(method, case, outcome)
    elif method.request_type is preprocess_pb2.PreprocessStreamRequest:
        check_preprocess_stream_answers(method, case, outcome)
    elif outcome.code == grpc.StatusCode.OK:
        broken = contract_violation(parsed(case.requests[0], method.request_type))
        assert broken is None, f"{method.name}: OK for a request the contract refuses ({broken})"


def check_status(
    where: str, code: grpc.StatusCode, message: str, status: status_pb2.Status | None, status_problem: str | None,
    is_cancelled_by_client: bool,
) -> None:
    shown = describe_message(message)
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), f"{where}: {code.name}: {shown}"
    assert not is_transport_error(message), f"{where}: {code.name} from the transport, not the server: {shown}"
    assert code in PRECISE_CODES, f"{where}: {code.name} is not a precise status: {shown}"
    if code == grpc.StatusCode.CANCELLED:
        assert is_cancelled_by_client, f"{where}: CANCELLED though the client did not cancel: {shown}"
    if code == grpc.StatusCode.OK or code == grpc.StatusCode.CANCELLED:
        return
    assert status_problem is None, f"{where}: {code.name} with an unreadable google.rpc.Status: {status_problem}"
    assert status is not None, (
        f"{where}: {code.name} that the server did not send (no google.rpc.Status: a transport error, or no "
        f"answer within {HANG_GUARD_S:.0f} s): {shown}"
    )
    assert status.ByteSize() <= MAX_STATUS_BYTES, (
        f"{where}: a {status.ByteSize()}-byte status (a client value echoed whole?): {shown}"
    )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not is_oversized_refusal(message):
        assert has_retry_info(status), f"{where}: RESOURCE_EXHAUSTED at admission without a RetryInfo: {shown}"


# What grpc's transport writes when it, not the server, ended the call: seen when a reply's
# metadata exceeded the client's limit (the client may then even synthesize a google.rpc.Status
# from the transport's message, so a Status alone does not prove the server sent it).
_TRANSPORT_ERROR_MARKERS = (
    "Stream removed", "received metadata size exceeds", "Received RST_STREAM", "Socket closed",
    "Connection reset", "Received message larger than max", "Failed parsing HTTP/2", "failed to connect",
)


def is_transport_error(message: str) -> bool:
    return any(marker in message for marker in _TRANSPORT_ERROR_MARKERS)


def is_oversized_refusal(message: str) -> bool:
    """Whether RESOURCE_EXHAUSTED refused a request over the receive limit (llmserve.undecodable's
    Oversized, directly or through a hop): the one refusal that carries no RetryInfo, since the
    same request will never fit."""
    return "exceeds the limit of" in message and "not parsed" in message


def has_retry_info(status: status_pb2.Status) -> bool:
    return any(detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for detail in status.details)


def check_multiplex_outputs(method: Method, case: Case, outcome: Outcome) -> None:
    """Each refusal on the stream is a precise status; when the stream ended OK, every request
    started on it had its last output, and none the contract refuses was served."""
    ended: dict[str, bool] = {}  # request id → refused
    for response in outcome.responses:
        for output in response.outputs:
            where = f"{method.name} request {output.request_id[:40]!r}"
            if output.error_status:
                status = status_pb2.Status.FromString(output.error_status)
                check_status(where, _CODES[status.code], status.message, status, None, False)
                ended[output.request_id] = True
            elif output.output.finish_reason:
                ended.setdefault(output.request_id, False)
    if outcome.code != grpc.StatusCode.OK:
        return
    commands = [parsed(data, method.request_type) for data in case.requests]
    started = [command.generate for command in commands if command is not None and command.HasField("generate")]
    missing = {request.request_id for request in started} - set(ended)
    assert not missing, (
        f"{method.name}: the stream ended OK without the last output of {sorted(missing)[:4]}; {case!r}; "
        f"outputs: {summary_of(outcome.responses)}"
    )
    for request in started:
        broken = contract_violation(request)
        is_unique = sum(other.request_id == request.request_id for other in started) == 1
        if broken is not None and is_unique:
            assert ended[request.request_id], f"{method.name}: served a request the contract refuses ({broken})"


def check_preprocess_stream_answers(method: Method, case: Case, outcome: Outcome) -> None:
    """Each refusal on the stream is a precise status; when the stream ended OK (read to its end),
    every request sent on it was answered, once per message."""
    for answer in outcome.responses:
        if answer.HasField("error_status"):
            status = status_pb2.Status.FromString(answer.error_status)
            check_status(f"{method.name} request {answer.request_id[:40]!r}", _CODES[status.code], status.message,
                         status, None, False)
    if outcome.code != grpc.StatusCode.OK or outcome.is_cancelled_by_client:
        return
    sent = [parsed(data, method.request_type) for data in case.requests]
    assert None not in sent, f"{method.name}: the stream ended OK after a message that cannot be read; {case!r}"
    assert len(outcome.responses) == len(sent), (
        f"{method.name}: {len(sent)} requests, {len(outcome.responses)} answers; {case!r}"
    )
    assert sorted(a.request_id for a in outcome.responses) == sorted(m.request.request_id for m in sent), case


def summary_of(responses: list[inference_pb2.MultiplexResponse]) -> list[str]:
    """Each output of a Multiplex stream as `id: tokens/finish reason/status code`."""
    summary = []
    for response in responses:
        for output in response.outputs:
            if output.error_status:
                ending = grpc.StatusCode(_CODES[status_pb2.Status.FromString(output.error_status).code]).name
            else:
                ending = f"{len(output.output.token_ids)} tokens {common_pb2.FinishReason.Name(output.output.finish_reason)}"
            summary.append(f"{output.request_id[:40]!r}: {ending}")
    return summary


def parsed(data: bytes, request_type: type[Message]) -> Message | None:
    try:
        return request_type.FromString(data)
    except DecodeError:
        return None


def contract_violation(request: Message | None) -> str | None:
    """Why the protos' contract says `request` must be refused, for what no single field shows
    (cross-field checks); None when nothing known."""
    sampling = sampling_of(request)
    if sampling is None:
        return None
    if sampling.HasField("min_tokens") and sampling.HasField("max_tokens") and sampling.min_tokens > sampling.max_tokens:
        return f"sampling.min_tokens {sampling.min_tokens} > sampling.max_tokens {sampling.max_tokens}"
    return None


def sampling_of(request: Message | None) -> common_pb2.SamplingParams | None:
    if isinstance(request, (gateway_pb2.GenerateRequest, gateway_pb2.GenerateStreamRequest)):
        return request.params.sampling
    if isinstance(request, inference_pb2.GenerateTokensRequest):
        return request.sampling
    return None


def describe_message(message: str) -> str:
    return repr(message) if len(message) <= 300 else f"{message[:240]!r} … ({len(message)} characters)"


# --- the stack after the cases ---------------------------------------------------------------


def log_problems(stack, offsets: dict[str, int]) -> list[str]:
    """Log lines over MAX_LOG_LINE_BYTES, and tracebacks, written since `offsets` (bytes, by
    service)."""
    problems = []
    for name, service in stack.items():
        with open(service.log_path, "rb") as log_file:
            log_file.seek(offsets[name])
            text = log_file.read()
        for line in text.splitlines():
            if len(line) > MAX_LOG_LINE_BYTES:
                problems.append(f"{name}: a {len(line)}-byte line: {line[:160]!r}…")
        if b"Traceback" in text:
            at = text.index(b"Traceback")
            problems.append(f"{name}: a traceback: {text[max(0, at - 200):at + 1200]!r}")
    return problems


def assert_idle_and_serving(stack, channels) -> None:
    for name, service in stack.items():
        assert service.poll() is None, f"{name} exited: {service.log_tail()}"
        health = health_pb2_grpc.HealthStub(channels[name]).Check(health_pb2.HealthCheckRequest(), timeout=HANG_GUARD_S)
        assert health.status == health_pb2.HealthCheckResponse.SERVING, name
    inference = inference_pb2_grpc.InferenceServiceStub(channels["inference"])
    deadline = time.monotonic() + HANG_GUARD_S  # aborts free their blocks at the next engine step
    while (load := inference.GetLoad(inference_pb2.GetLoadRequest(), timeout=HANG_GUARD_S)).kv_blocks_used or (
        load.num_running or load.num_waiting
    ):
        assert time.monotonic() < deadline, f"requests or KV blocks still held: {load}"
        time.sleep(0.05)


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants (the inference engine core runs in a
    child), read from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    tree, grew = {pid}, True
    while grew:
        children = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return sum(_rss_bytes(member) for member in tree)


def _rss_bytes(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
