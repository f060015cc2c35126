"""The bounded, coalescing buffer of each request between the replica and its client
(gateway.replica_stream.MultiplexedTokens).

In process: what a slow reader receives from a fast replica (merged outputs, the bound, errors,
cancelling). On the real stack (torch backend, tiny model with a long context): a stream still
says what Generate says, and a client that stops reading has its request aborted and its KV
freed.
"""

from __future__ import annotations

import asyncio
import re
import time
from contextlib import aclosing

import grpc
import pytest

from llmserve.errors import ResourceExhausted, rich_status_for
from llmserve.gateway.hop_errors import DownstreamError
from llmserve.gateway.replica_stream import MultiplexedTokens, push_token_columns
from llmserve.gateway.slow_reader import ClientNotReading, SlowReaderBounds
from llmserve.sampling import FinishReason
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.long_streams import MAX_TOKENS, SMALL_WINDOW, long_context_model_dir, params  # noqa: F401 (a fixture)
from tests.procs import stack_fixture

REQUEST_ID = "r1"


def token_output(token_id: int, *, finish: int = common_pb2.FINISH_REASON_UNSPECIFIED) -> inference_pb2.RequestOutput:
    response = inference_pb2.GenerateTokensResponse(token_ids=[token_id], finish_reason=finish)
    response.logprobs.add(token_id=token_id, logprob=-float(token_id))
    return inference_pb2.RequestOutput(request_id=REQUEST_ID, output=response)


class Replica:
    """Pushes outputs into a request's buffer as fast as the loop runs, as the stream's reader
    task does; records what the buffer asked of the stream (forget, with or without abort)."""

    def __init__(self, outputs: list[inference_pb2.RequestOutput], max_unsent_tokens: int = 0):
        self.outputs = outputs
        self.forgotten: list[tuple[str, bool]] = []
        self.tokens = MultiplexedTokens(REQUEST_ID, lambda request_id, abort: self.forgotten.append((request_id, abort)),
                                        SlowReaderBounds(max_unsent_tokens=max_unsent_tokens, max_unread_s=0))
        self.num_pushed = 0

    async def run(self) -> None:
        for output in self.outputs:
            if self.forgotten:
                return  # the stream stopped routing outputs to it
            self.tokens.push(output)
            self.num_pushed += 1
            await asyncio.sleep(0)


async def take_all(replica: Replica, *, read_delay_s: float = 0.0):
    """What a reader that takes `read_delay_s` per output receives."""
    pushing = asyncio.create_task(replica.run())
    received = []
    try:
        async for output in replica.tokens:
            received.append(output)
            await asyncio.sleep(read_delay_s)
    finally:
        await pushing
    return received


def test_a_reader_that_keeps_up_gets_one_token_per_output():
    outputs = [token_output(i) for i in range(5)] + [token_output(5, finish=common_pb2.FINISH_REASON_LENGTH)]
    received = asyncio.run(take_all(Replica(outputs)))
    assert [o.new_token_ids for o in received] == [[i] for i in range(6)]
    assert [o.finish_reason for o in received] == [None] * 5 + [FinishReason.LENGTH]


def test_a_slow_reader_gets_fewer_larger_outputs_with_everything_in_order():
    outputs = [token_output(i) for i in range(99)] + [token_output(99, finish=common_pb2.FINISH_REASON_LENGTH)]
    received = asyncio.run(take_all(Replica(outputs), read_delay_s=0.01))
    assert 1 < len(received) < 100
    assert [t for o in received for t in o.new_token_ids] == list(range(100))
    assert [lp.token_id for o in received for lp in o.logprobs] == list(range(100))
    assert [o.finish_reason for o in received] == [None] * (len(received) - 1) + [FinishReason.LENGTH]


def test_more_unsent_tokens_than_the_bound_aborts_the_request_and_raises():
    replica = Replica([token_output(i) for i in range(1000)], max_unsent_tokens=10)
    with pytest.raises(ClientNotReading) as info:
        asyncio.run(take_all(replica, read_delay_s=1.0))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.message == "client is not reading: 11 tokens unsent (limit 10)"
    assert replica.forgotten == [(REQUEST_ID, True)]  # aborted on the replica
    assert replica.num_pushed < 20  # reading stopped at the bound, not at the end


def test_a_status_from_the_replica_reaches_the_reader_after_the_tokens_before_it():
    refusal = rich_status_for(ResourceExhausted("replica busy", retry_after_ms=250)).SerializeToString()
    outputs = [token_output(0), inference_pb2.RequestOutput(request_id=REQUEST_ID, error_status=refusal)]
    replica = Replica(outputs)
    received = []

    async def read() -> None:
        pushing = asyncio.create_task(replica.run())
        await pushing  # both arrive before the first read: the tokens still come first
        async for output in replica.tokens:
            received.append(output)

    with pytest.raises(DownstreamError) as info:
        asyncio.run(read())
    assert [o.new_token_ids for o in received] == [[0]]
    assert (info.value.code, info.value.retry_after_ms) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 250)


def test_cancelling_a_request_aborts_it_once_and_an_ended_one_not_at_all():
    async def read_one_then_cancel(replica: Replica) -> None:
        pushing = asyncio.create_task(replica.run())
        async with aclosing(replica.tokens.__aiter__()) as outputs:
            await anext(outputs)
        replica.tokens.cancel()
        replica.tokens.cancel()
        await pushing

    replica = Replica([token_output(i) for i in range(1000)])
    asyncio.run(read_one_then_cancel(replica))
    assert replica.forgotten == [(REQUEST_ID, True), (REQUEST_ID, False)]
    assert replica.num_pushed < 1000

    ended = Replica([token_output(0, finish=common_pb2.FINISH_REASON_STOP)])
    asyncio.run(take_all(ended))
    ended.tokens.cancel()
    assert ended.forgotten == [(REQUEST_ID, False)]


def column_row(first: int, num_tokens: int, sequence_index: int = 0) -> inference_pb2.MultiplexResponse:
    """A Multiplex message whose TokenColumns carry one row of this request's plain tokens."""
    columns = inference_pb2.TokenColumns(
        request_ids=[REQUEST_ID], sequence_indexes=[sequence_index], num_tokens=[num_tokens],
        token_ids=list(range(first, first + num_tokens)),
    )
    return inference_pb2.MultiplexResponse(tokens=columns)


class ColumnsReplica(Replica):
    """Pushes column rows and RequestOutputs, in order, as the stream's reader does."""

    async def run(self) -> None:
        for message in self.outputs:
            if self.forgotten:
                return
            if isinstance(message, inference_pb2.MultiplexResponse):
                push_token_columns({REQUEST_ID: self.tokens}, message.tokens)
            else:
                self.tokens.push(message)
            self.num_pushed += 1
            await asyncio.sleep(0)


def test_column_rows_and_outputs_reach_the_reader_in_order_coalesced():
    messages = [column_row(10 * i, 3) for i in range(30)] + [token_output(300, finish=common_pb2.FINISH_REASON_LENGTH)]
    received = asyncio.run(take_all(ColumnsReplica(messages), read_delay_s=0.01))
    expected = [t for i in range(30) for t in range(10 * i, 10 * i + 3)] + [300]
    assert [t for o in received for t in o.new_token_ids] == expected
    assert 1 < len(received) < 31  # a slow reader gets them merged
    assert [o.finish_reason for o in received][-1] is FinishReason.LENGTH
    assert [lp.token_id for o in received for lp in (o.logprobs or [])] == [300]


def test_column_rows_count_towards_the_unsent_bound():
    replica = ColumnsReplica([column_row(4 * i, 4) for i in range(250)], max_unsent_tokens=10)
    with pytest.raises(ClientNotReading) as info:
        asyncio.run(take_all(replica, read_delay_s=1.0))
    assert info.value.message == "client is not reading: 12 tokens unsent (limit 10)"
    assert replica.forgotten == [(REQUEST_ID, True)]


# --- the real stack ------------------------------------------------------------------------------

# Above what test_stream_says_what_generate_says asks for (48), so that a client that reads but is
# scheduled late on a loaded machine can never reach it; far below MAX_TOKENS.
MAX_UNSENT_TOKENS = 64
WAIT_TIMEOUT_S = 60.0


stack = stack_fixture(model="long_context_model_dir", gateway_args=["--max-unsent-tokens", str(MAX_UNSENT_TOKENS)])


def wait_for_load(inference, predicate) -> inference_pb2.GetLoadResponse:
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while not predicate(load := inference.GetLoad(inference_pb2.GetLoadRequest())):
        if time.monotonic() > deadline:
            pytest.fail(f"inference load never satisfied the condition; last: {load}")
        time.sleep(0.05)
    return load


def test_stream_says_what_generate_says(stack):
    gateway = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack["gateway"].address))
    request = params(max_tokens=48)
    unary = gateway.Generate(gateway_pb2.GenerateRequest(params=request))
    messages = list(gateway.GenerateStream(gateway_pb2.GenerateStreamRequest(params=request)))
    assert "".join(m.text for m in messages) == unary.text
    assert [t for m in messages for t in m.token_ids] == list(unary.token_ids)
    assert messages[-1].result.usage.completion_tokens == unary.result.usage.completion_tokens == 48
    assert all(not m.HasField("result") for m in messages[:-1])


def test_a_client_that_stops_reading_is_aborted_within_the_bound(stack):
    inference = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(stack["inference"].address))
    before = inference.GetLoad(inference_pb2.GetLoadRequest())
    channel = grpc.insecure_channel(stack["gateway"].address, options=SMALL_WINDOW)
    stream = gateway_pb2_grpc.GatewayServiceStub(channel).GenerateStream(
        gateway_pb2.GenerateStreamRequest(params=params(max_tokens=MAX_TOKENS))
    )
    num_received_tokens = len(next(stream).token_ids)

    load = wait_for_load(inference, lambda load: load.num_aborted_total == before.num_aborted_total + 1)
    load = wait_for_load(inference, lambda load: load.num_running == 0 and load.kv_blocks_used == 0)
    assert load.num_waiting == 0

    with pytest.raises(grpc.RpcError) as info:
        for message in stream:  # what the window held, then the status
            num_received_tokens += len(message.token_ids)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    unsent = re.fullmatch(rf"client is not reading: (\d+) tokens unsent \(limit {MAX_UNSENT_TOKENS}\)",
                          info.value.details())
    assert unsent is not None, info.value.details()
    assert int(unsent.group(1)) > MAX_UNSENT_TOKENS
    assert num_received_tokens + int(unsent.group(1)) < MAX_TOKENS
    channel.close()
