"""InferenceService.Multiplex on a real inference server (torch backend, core in its own
process): many requests on one stream, refusals per request, aborts, and a stream that ends."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
from google.rpc import status_pb2

from llmserve.errors import InvalidArgument
from llmserve.inference.multiplex import MultiplexedStream
from llmserve.pb import MULTIPLEX_COLUMNS_METADATA
from llmserve.server import CHANNEL_OPTIONS
from llmserve.undecodable import Undecodable
from llmserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.procs import running_service
from tests.rich_status import field_violation

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = [5, 17, 42, 99, 100, 7, 250, 31]
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def inference_address(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("multiplex")
    with running_service("inference", ["--model", str(tiny_model_dir), "--num-kv-blocks", "64"], log_dir) as service:
        yield service.address


@pytest.fixture
async def stub(inference_address):
    async with grpc.aio.insecure_channel(inference_address, options=CHANNEL_OPTIONS) as channel:
        yield inference_pb2_grpc.InferenceServiceStub(channel)


def generate(request_id: str, max_tokens: int = 12, prompt=PROMPT) -> inference_pb2.MultiplexRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return inference_pb2.MultiplexRequest(
        generate=inference_pb2.GenerateTokensRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
    )


def abort(request_id: str) -> inference_pb2.MultiplexRequest:
    return inference_pb2.MultiplexRequest(abort=inference_pb2.AbortRequest(request_id=request_id))


async def read_until_done(call, request_ids: set[str]) -> dict[str, list[inference_pb2.RequestOutput]]:
    """Outputs by request until each of `request_ids` has its last one."""
    outputs: dict[str, list[inference_pb2.RequestOutput]] = {}
    open_ids = set(request_ids)

    async def read():
        while open_ids:
            response = await call.read()
            assert response is not grpc.aio.EOF, "the stream ended early"
            for output in response.outputs:
                outputs.setdefault(output.request_id, []).append(output)
                if output.error_status or output.output.finish_reason:
                    open_ids.discard(output.request_id)

    await asyncio.wait_for(read(), HANG_GUARD_S)
    return outputs


def tokens_of(outputs: list[inference_pb2.RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.output.token_ids]


async def wait_for_free_blocks(stub) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while (await stub.GetLoad(inference_pb2.GetLoadRequest())).kv_blocks_used:
        assert time.monotonic() < deadline, "KV blocks were never freed"
        await asyncio.sleep(0.02)


async def test_many_requests_on_one_stream_match_their_own_calls(stub):
    call = stub.Multiplex()
    ids = [f"mux-{i}" for i in range(6)]
    for i, request_id in enumerate(ids):
        await call.write(generate(request_id, max_tokens=8 + i))
    outputs = await read_until_done(call, set(ids))
    await call.done_writing()
    for i, request_id in enumerate(ids):
        single = [r async for r in stub.GenerateTokens(generate(f"single-{i}", max_tokens=8 + i).generate)]
        assert tokens_of(outputs[request_id]) == [t for r in single for t in r.token_ids]
        last = outputs[request_id][-1].output
        assert (last.finish_reason, last.usage.completion_tokens) == (common_pb2.FINISH_REASON_LENGTH, 8 + i)
    assert await call.read() is grpc.aio.EOF  # done writing and nothing left in flight: it ends
    assert await call.code() == grpc.StatusCode.OK


async def test_a_bad_request_is_refused_alone_with_its_status(stub):
    call = stub.Multiplex()
    await call.write(generate("bad", prompt=[10**6]))
    await call.write(generate("good"))
    outputs = await read_until_done(call, {"bad", "good"})
    [refusal] = outputs["bad"]
    status = status_pb2.Status.FromString(refusal.error_status)
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert field_violation(status)[0] == "prompt_token_ids[0]"
    assert len(tokens_of(outputs["good"])) == 12
    call.cancel()


async def test_an_abort_on_the_stream_and_the_stream_ending_free_the_blocks(stub):
    call = stub.Multiplex()
    await call.write(generate("stay", max_tokens=240))
    await call.write(generate("go", max_tokens=240))
    await asyncio.wait_for(call.read(), HANG_GUARD_S)
    await call.write(abort("go"))
    outputs = await read_until_done(call, {"go"})
    assert outputs["go"][-1].output.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    call.cancel()  # "stay" is still running: ending the stream aborts it
    await wait_for_free_blocks(stub)


async def test_an_undecodable_command_ends_the_stream_with_invalid_argument(inference_address):
    async with grpc.aio.insecure_channel(inference_address) as channel:
        multiplex = channel.stream_stream("/llmserve.v1.InferenceService/Multiplex")
        call = multiplex()
        await call.write(b"\x0a\x05\x0a\x03\xff\xfe\xfd")  # generate.request_id: invalid UTF-8
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in call:
                pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_oversized_command_ends_the_stream_with_resource_exhausted(stub):
    call = stub.Multiplex()
    await call.write(generate("huge", prompt=[7] * 100_000))  # far over the context's receive limit
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await stub.GetLoad(inference_pb2.GetLoadRequest())).num_running == 0


async def test_a_bad_command_ends_the_stream_at_once_and_frees_its_requests(inference_address, stub):
    async with grpc.aio.insecure_channel(inference_address) as channel:
        call = channel.stream_stream("/llmserve.v1.InferenceService/Multiplex")()
        await call.write(generate("running", max_tokens=240).SerializeToString())
        first = inference_pb2.MultiplexResponse.FromString(await asyncio.wait_for(call.read(), HANG_GUARD_S))
        assert first.outputs[0].request_id == "running"
        await call.write(b"\x0a\x05\x0a\x03\xff\xfe\xfd")  # generate.request_id: invalid UTF-8
        received = []

        async def read_to_the_end():
            while (message := await call.read()) is not grpc.aio.EOF:
                received.extend(inference_pb2.MultiplexResponse.FromString(message).outputs)

        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await asyncio.wait_for(read_to_the_end(), HANG_GUARD_S)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the stream did not wait for its request to run to max_tokens
    assert not any(output.output.finish_reason for output in received)
    await wait_for_free_blocks(stub)


async def test_a_bad_command_read_while_a_response_is_written_still_ends_the_stream():
    """Found by fuzzing: the reader met the bad command while the writer was holding the previous
    response, nothing else was open, and the stream ended OK with the command dropped."""
    stream = MultiplexedStream(SimpleNamespace(model_info=None))  # refusals never reach the engine
    commands: asyncio.Queue = asyncio.Queue()

    async def sent():
        while (command := await commands.get()) is not None:
            yield command

    reader = asyncio.create_task(stream.read_commands(sent()))
    responses = stream.responses()
    commands.put_nowait(inference_pb2.MultiplexRequest(generate=inference_pb2.GenerateTokensRequest()))
    [refusal] = (await asyncio.wait_for(anext(responses), HANG_GUARD_S)).outputs
    assert refusal.error_status
    commands.put_nowait(Undecodable("/llmserve.v1.InferenceService/Multiplex", "Wire format was corrupt"))
    await asyncio.wait_for(reader, HANG_GUARD_S)
    with pytest.raises(InvalidArgument):
        await anext(responses)


# --- plain tokens as TokenColumns (issue 19) -----------------------------------------------------


class Read:
    """What one Multiplex call delivered, by (request, sequence): tokens in order, with the
    outputs and column rows they came in."""

    def __init__(self):
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.logprobs: dict[tuple[str, int], int] = {}
        self.finals: dict[tuple[str, int], inference_pb2.GenerateTokensResponse] = {}
        self.errors: dict[str, status_pb2.Status] = {}
        self.num_column_rows = 0

    def add(self, response: inference_pb2.MultiplexResponse) -> None:
        for output in response.outputs:
            if output.error_status:
                self.errors[output.request_id] = status_pb2.Status.FromString(output.error_status)
                continue
            key = (output.request_id, output.output.sequence_index)
            assert key not in self.finals, f"an output for {key} after its final one"
            self.tokens.setdefault(key, []).extend(output.output.token_ids)
            self.logprobs[key] = self.logprobs.get(key, 0) + len(output.output.logprobs)
            if output.output.finish_reason:
                self.finals[key] = output.output
        columns, start = response.tokens, 0
        seen = {(o.request_id, o.output.sequence_index) for o in response.outputs}
        for request_id, index, num_tokens in zip(columns.request_ids, columns.sequence_indexes, columns.num_tokens):
            key = (request_id, index)
            assert key not in self.finals and key not in seen and request_id not in self.errors, key
            assert num_tokens >= 1
            seen.add(key)
            self.tokens.setdefault(key, []).extend(columns.token_ids[start : start + num_tokens])
            start += num_tokens
            self.num_column_rows += 1
        assert start == len(columns.token_ids)

    def is_done(self, requests: dict[str, int]) -> bool:
        """Every sequence of `requests` (id -> n) has its final output, or its request an error."""
        return all(rid in self.errors or all((rid, i) in self.finals for i in range(n)) for rid, n in requests.items())


async def read_call(call, requests: dict[str, int]) -> Read:
    read = Read()

    async def loop():
        while not read.is_done(requests):
            response = await call.read()
            assert response is not grpc.aio.EOF, "the stream ended early"
            read.add(response)

    await asyncio.wait_for(loop(), HANG_GUARD_S)
    return read


def sampled(request_id: str, max_tokens: int, **fields) -> inference_pb2.MultiplexRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, **fields)
    return inference_pb2.MultiplexRequest(
        generate=inference_pb2.GenerateTokensRequest(request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling)
    )


async def test_token_columns_carry_what_request_outputs_carry(stub):
    """The same requests on a call that asks for columns and on one that does not: the same
    tokens per sequence, finals (with usage) and logprobs as RequestOutputs, plain tokens as
    column rows only where asked."""
    requests = {
        "greedy": sampled("greedy", 20, temperature=0.0, ignore_eos=True),
        "short": sampled("short", 3, temperature=0.0, ignore_eos=True),
        "n2": sampled("n2", 16, temperature=1.0, seed=11, n=2, ignore_eos=True),
        "lp": sampled("lp", 10, temperature=0.0, ignore_eos=True, logprobs=1),
    }
    sizes = {rid: max(1, r.generate.sampling.n) for rid, r in requests.items()}
    reads = {}
    for name, call in (("columns", stub.Multiplex(metadata=(MULTIPLEX_COLUMNS_METADATA,))), ("objects", stub.Multiplex())):
        for command in requests.values():
            await call.write(command)
        reads[name] = await read_call(call, sizes)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
    columns, objects = reads["columns"], reads["objects"]
    assert columns.tokens == objects.tokens and set(columns.finals) == set(objects.finals)
    for key, final in columns.finals.items():
        assert final.usage.completion_tokens == len(columns.tokens[key]) == objects.finals[key].usage.completion_tokens
    assert len(columns.tokens[("greedy", 0)]) == 20 and columns.tokens[("n2", 0)] != columns.tokens[("n2", 1)]
    assert columns.logprobs[("lp", 0)] == objects.logprobs[("lp", 0)] == 10  # every token's, never in columns
    assert columns.num_column_rows > 0 and objects.num_column_rows == 0


async def test_a_deadline_on_a_columns_call_ends_its_request_after_its_tokens(stub):
    """A request whose deadline passes in the engine (240 tokens in 100 ms: far faster than any
    CPU runs this engine) ends with DEADLINE_EXCEEDED after a prefix of its tokens; the
    request beside it on the call runs to its end."""
    call = stub.Multiplex(metadata=(MULTIPLEX_COLUMNS_METADATA,))
    late = generate("late", max_tokens=240)
    late.generate.timeout_ms = 100
    await call.write(late)
    await call.write(generate("beside", max_tokens=40))
    read = await read_call(call, {"late": 1, "beside": 1})
    call.cancel()
    assert read.errors["late"].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    single = [r async for r in stub.GenerateTokens(generate("late-alone", max_tokens=240).generate)]
    alone = [t for r in single for t in r.token_ids]
    late_tokens = read.tokens.get(("late", 0), [])
    assert late_tokens == alone[: len(late_tokens)] and len(late_tokens) < 240
    assert len(read.tokens[("beside", 0)]) == 40
    await wait_for_free_blocks(stub)
