"""PreprocessStream: many Preprocess requests on one call, answered by request id as each
finishes, with what a unary Preprocess call answers; a request's refusal is its answer and the
stream goes on; a message that cannot be read ends it. And the gateway's client of it: back to
unary calls against a server without the RPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
from google.rpc import status_pb2

from llmserve import token_id_bytes
from llmserve.buckets import BucketConfig
from llmserve.errors import ServiceError
from llmserve.gateway.preprocess_client import PreprocessClient
from llmserve.preprocess.config import PreprocessConfig
from llmserve.preprocess.server import start_server
from llmserve.prompt_input import PromptTokenIds
from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import common_pb2, preprocess_pb2, preprocess_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="session")

MAX_OUTPUT = 100


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def address(tiny_model_dir):
    config = PreprocessConfig(
        model_path=tiny_model_dir, model_name="tiny-llama", port=0, max_output_tokens=MAX_OUTPUT, block_size_tokens=4,
        length_buckets=BucketConfig((16, 64)), num_tokenizer_threads=4,
    )
    server = await start_server(config)
    yield f"127.0.0.1:{server.port}"
    await server.running.server.stop(1.0)
    await server.close()


def request(request_id: str, prompt: str, **fields) -> preprocess_pb2.PreprocessRequest:
    return preprocess_pb2.PreprocessRequest(request_id=request_id, prompt=prompt, **fields)


async def exchange(address: str, messages: list) -> tuple[list[preprocess_pb2.PreprocessStreamResponse], grpc.StatusCode]:
    """Send `messages` (PreprocessStreamRequests, or raw bytes) on one stream, then read it to its end."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.stream_stream(
            "/llmserve.v1.PreprocessService/PreprocessStream",
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=preprocess_pb2.PreprocessStreamResponse.FromString,
        )(iter(messages), timeout=30)
        answers = [answer async for answer in _read(call)]
        return answers, await call.code()


async def _read(call):
    try:
        async for answer in call:
            yield answer
    except grpc.aio.AioRpcError:
        return


def status_of(answer: preprocess_pb2.PreprocessStreamResponse) -> status_pb2.Status:
    return status_pb2.Status.FromString(answer.error_status)


async def test_requests_are_answered_by_id_with_what_a_unary_call_answers(address):
    prompts = {f"r{i}": "hello world " * (1 + 5 * (i % 3)) + str(i) for i in range(12)}
    answers, code = await exchange(address, [
        preprocess_pb2.PreprocessStreamRequest(request=request(i, p, max_tokens=8)) for i, p in prompts.items()
    ])
    assert code == grpc.StatusCode.OK
    assert sorted(a.request_id for a in answers) == sorted(prompts)
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
        for answer in answers:
            unary = await stub.Preprocess(request(answer.request_id, prompts[answer.request_id], max_tokens=8))
            answer.response.preprocess_time_ns = unary.preprocess_time_ns = 0
            assert answer.response == unary


async def test_a_refused_request_is_its_answer_and_the_stream_goes_on(address):
    answers, code = await exchange(address, [
        preprocess_pb2.PreprocessStreamRequest(request=request("empty", "")),
        preprocess_pb2.PreprocessStreamRequest(request=request("too-long", "hi", max_tokens=10_000)),
        preprocess_pb2.PreprocessStreamRequest(request=request("", "no id")),
        preprocess_pb2.PreprocessStreamRequest(request=request("fine", "hello")),
    ])
    assert code == grpc.StatusCode.OK
    by_id = {answer.request_id: answer for answer in answers}
    assert set(by_id) == {"empty", "too-long", "", "fine"}
    assert by_id["fine"].HasField("response") and by_id["fine"].response.token_ids
    for request_id, message in (("empty", "prompt: must not be empty"), ("too-long", "max_tokens: "),
                                ("", "request.request_id: required on a stream")):
        status = status_of(by_id[request_id])
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], status
        assert status.message.startswith(message), status.message


async def test_a_message_that_cannot_be_read_ends_the_stream(address):
    answers, code = await exchange(address, [
        preprocess_pb2.PreprocessStreamRequest(request=request("before", "hello")),
        b"\x0a\xff\xff",  # a length past the end
    ])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert all(answer.request_id == "before" for answer in answers)


async def test_the_gateway_client_goes_back_to_unary_calls_without_the_rpc(address):
    """A server that does not know PreprocessStream (here: one that serves nothing) answers
    UNIMPLEMENTED: the client marks it and sends the request as a unary call, whose own status
    the caller then gets; the real server is reached over the stream."""
    empty = grpc.aio.server()
    port = empty.add_insecure_port("127.0.0.1:0")
    await empty.start()
    try:
        lacking = PreprocessClient(f"127.0.0.1:{port}")
        with pytest.raises(ServiceError, match="UNIMPLEMENTED"):
            await lacking.preprocess("x", PromptTokenIds((1, 2, 3)), max_tokens=4, cache_salt="", timeout_s=10)
        assert lacking._stream.is_unsupported
        await lacking.close()
    finally:
        await empty.stop(0)
    client = PreprocessClient(address)
    prepared = await client.preprocess("y", PromptTokenIds((5, 6, 7)), max_tokens=4, cache_salt="", timeout_s=10)
    assert token_id_bytes.unpack(prepared.token_id_bytes) == [5, 6, 7] and prepared.max_tokens == 4
    assert not client._stream.is_unsupported
    await client.close()
