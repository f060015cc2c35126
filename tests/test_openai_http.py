"""The gateway's OpenAI-compatible HTTP API (issue 21's first part), through the official `openai`
client against a real stack on the default model (torch backend): models, chat and completions,
whole and streamed, sync and async, seeds, errors as the client's own exception classes, a body
over the limit refused before it is read, and a client that leaves mid-stream freeing its KV
blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

openai = pytest.importorskip("openai")

from llmserve.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402
from tests.procs import free_port, running_stack, stack_fixture  # noqa: E402

pytestmark = pytest.mark.slow

HTTP_PORT = free_port()
stack = stack_fixture(model="default_model_dir", gateway_args=["--http-port", str(HTTP_PORT)])
BASE_URL = f"http://127.0.0.1:{HTTP_PORT}/v1"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
POOL_FREE_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def test_the_models_endpoint_lists_the_served_model(client):
    [model] = client.models.list().data
    assert model.id == "smollm2-135m-instruct" and model.object == "model"


def test_a_chat_completion_answers_and_its_stream_says_the_same(client, model_name):
    whole = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=16)
    [choice] = whole.choices
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and 0 < whole.usage.completion_tokens <= 16
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(
        model=model_name, messages=QUESTION, temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_text_parts_and_a_system_message_are_read(client, model_name):
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]},
    ]
    response = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=8)
    assert "Paris" in response.choices[0].message.content


async def test_the_async_client_completes_text_and_token_id_prompts(stack, model_name):
    async with openai.AsyncOpenAI(base_url=BASE_URL, api_key="unused", max_retries=0) as client:
        text = await client.completions.create(model=model_name, prompt="The capital of France is", temperature=0, max_tokens=4)
        assert text.object == "text_completion" and text.choices[0].text.strip()
        ids = await client.completions.create(model=model_name, prompt=[504, 3575, 282, 4649, 314], temperature=0, max_tokens=4)
        assert ids.usage.prompt_tokens == 5 and ids.choices[0].text
        streamed = [c async for c in await client.completions.create(
            model=model_name, prompt="The capital of France is", temperature=0, max_tokens=4, stream=True,
        )]  # fmt: skip
        assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_a_seed_makes_sampling_reproducible(client, model_name):
    def sample(seed: int) -> str:
        response = client.chat.completions.create(
            model=model_name, messages=QUESTION, temperature=1.0, seed=seed, max_tokens=12, extra_body={"ignore_eos": True}
        )  # fmt: skip
        return response.choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1


def test_bad_input_is_the_clients_own_exception_with_the_field_named(client, model_name):
    with pytest.raises(openai.BadRequestError) as wrong_type:
        client.chat.completions.create(model=model_name, messages=QUESTION, temperature="hot")
    assert wrong_type.value.status_code == 400 and wrong_type.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as out_of_range:
        client.chat.completions.create(model=model_name, messages=QUESTION, top_p=1.5)
    assert out_of_range.value.body["param"] == "top_p" and "(0, 1]" in out_of_range.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad_role:
        client.chat.completions.create(model=model_name, messages=[{"role": "robot", "content": "hi"}])
    assert bad_role.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as streamed:  # before the stream's headers: a status
        client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=0, stream=True)
    assert streamed.value.body["param"] == "max_tokens"


def test_unknown_fields_are_ignored_and_every_answer_names_its_request(client, model_name):
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=QUESTION, max_tokens=2, extra_body={"some_future_field": {"x": 1}}
    )  # fmt: skip
    assert len(raw.headers["x-request-id"]) == 32 and raw.parse().id == f"chatcmpl-{raw.headers['x-request-id']}"
    with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/health", timeout=10) as health:
        assert health.status == 200 and json.loads(health.read()) == {"status": "ok"}


def test_a_body_over_the_limit_is_refused_before_it_is_read(stack):
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * (10 << 20) + b'"}]}'
    request = urllib.request.Request(f"{BASE_URL}/chat/completions", data=body, headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 413 and "exceeds" in json.loads(refused.value.read())["error"]["message"]
    assert time.monotonic() - started < 10


def test_a_client_that_leaves_mid_stream_frees_its_kv_blocks(client, model_name, stack):
    stream = client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
    )  # fmt: skip
    for _, _ in zip(range(5), stream):
        pass
    with grpc.insecure_channel(stack["inference"].address) as channel:
        inference = inference_pb2_grpc.InferenceServiceStub(channel)
        assert inference.GetLoad(inference_pb2.GetLoadRequest()).kv_blocks_used > 0  # still generating
        stream.close()
    assert_pool_frees(stack)


def assert_pool_frees(stack) -> None:
    """The replica's KV pool is empty, and nothing runs, within POOL_FREE_WITHIN_S."""
    with grpc.insecure_channel(stack["inference"].address) as channel:
        inference = inference_pb2_grpc.InferenceServiceStub(channel)
        deadline = time.monotonic() + POOL_FREE_WITHIN_S
        while (load := inference.GetLoad(inference_pb2.GetLoadRequest())).kv_blocks_used:
            assert time.monotonic() < deadline, load
            time.sleep(0.1)
        assert load.num_running == 0


async def test_a_replica_full_at_admission_is_a_429_with_retry_after(tiny_model_dir, tmp_path):
    """One waiting request at most (--max-waiting-requests 1): of a burst, the refused get the
    client's RateLimitError with the replica's hint as Retry-After (whole seconds, at least 1)."""
    port = free_port()
    with running_stack(
        tiny_model_dir, tmp_path, inference_args=["--max-waiting-requests", "1"], gateway_args=["--http-port", str(port)]
    ):  # fmt: skip
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as client:
            model = (await client.models.list()).data[0].id

            async def one(index: int):
                try:
                    return await client.completions.create(
                        model=model, prompt=f"burst {index}", max_tokens=32, extra_body={"ignore_eos": True}
                    )  # fmt: skip
                except openai.RateLimitError as refused:
                    return refused

            outcomes = await asyncio.gather(*(one(i) for i in range(24)))
    refusals = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    assert refusals and len(refusals) < len(outcomes)
    for refused in refusals:
        assert refused.status_code == 429 and int(refused.response.headers["Retry-After"]) >= 1
        assert refused.body["type"] == "rate_limit_error" and "replica busy" in refused.body["message"]


def test_logprobs_come_in_each_endpoints_shape(client, model_name):
    chat = client.chat.completions.create(
        model=model_name, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2
    )  # fmt: skip
    [choice] = chat.choices
    entries = choice.logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    assert "".join(e.token for e in entries) == choice.message.content  # byte-level BPE: pieces add up
    for entry in entries:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
    assert client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=2).choices[0].logprobs is None

    text = client.completions.create(model=model_name, prompt="The capital of France is", temperature=0, max_tokens=5, logprobs=1)
    lists = text.choices[0].logprobs
    assert len(lists.tokens) == len(lists.token_logprobs) == len(lists.top_logprobs) == text.usage.completion_tokens
    assert lists.text_offset == [sum(len(t) for t in lists.tokens[:i]) for i in range(len(lists.tokens))]
    assert all(len(top) == 1 for top in lists.top_logprobs)
    streamed = client.completions.create(
        model=model_name, prompt="The capital of France is", temperature=0, max_tokens=5, logprobs=1, stream=True
    )  # fmt: skip
    streamed_tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed_tokens == lists.tokens


def test_n_choices_whole_and_streamed(client, model_name):
    """n = 3: three choices (index 0-2), each ending on its own; the stream interleaves them and
    says the same per index; usage counts every choice's tokens once the prompt."""
    ask = dict(model=model_name, messages=QUESTION, temperature=1.0, seed=11, max_tokens=8, n=3,
               extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**ask)
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    assert all(choice.finish_reason == "length" for choice in whole.choices)
    assert whole.usage.completion_tokens == 3 * 8
    assert len({choice.message.content for choice in whole.choices}) > 1  # sampled, not copies

    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(part.delta.content or "" for part in mine) == choice.message.content
        assert [part.finish_reason for part in mine][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * 8

    text = client.completions.create(model=model_name, prompt="The capital of France is", temperature=0, max_tokens=4,
                                     n=2, logprobs=1)
    assert [choice.index for choice in text.choices] == [0, 1]
    assert text.choices[0].text == text.choices[1].text  # greedy: the same twice
    for choice in text.choices:  # each choice's offsets start at 0
        assert choice.logprobs.text_offset[0] == 0


def test_several_prompts_are_answered_as_one(client, model_name, stack):
    """A completions prompt list: prompt i's sequence j is choice i x n + j, each what that
    prompt alone answers; usage counts every prompt; streamed, the same per index."""
    prompts = ["The capital of France is", "Once upon a time"]
    ask = dict(model=model_name, temperature=0, max_tokens=4, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=prompt, **ask) for prompt in prompts]
    whole = client.completions.create(prompt=prompts, n=2, **ask)
    assert [choice.index for choice in whole.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in whole.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert whole.usage.completion_tokens == 4 * 4

    chunks = list(client.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True}, **ask))
    for choice in whole.choices:
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == choice.index) == choice.text
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(prompt=["fine", [1, 10**9]], **ask)
    assert "vocabulary" in str(error.value)
    with pytest.raises(openai.BadRequestError) as error:  # one bad prompt ends the others too
        client.completions.create(prompt=["Hello", ""], model=model_name, max_tokens=2000, extra_body={"ignore_eos": True})
    assert "must not be empty" in str(error.value)
    assert_pool_frees(stack)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(prompt=["x"] * 33, **ask)
    assert error.value.body["param"] == "prompt" and "at most 32 prompts" in error.value.body["message"]


def test_a_request_past_its_deadline_is_a_504_and_frees_its_blocks(client, model_name, stack):
    """x-request-timeout-ms goes down as a gRPC client's deadline does: a request that cannot
    finish in time ends with 504 (refused by admission's estimate, or ended by the engine), and
    its KV blocks are freed; a bad value is a 400 naming the header; a deadline that is met
    changes nothing (Envoy's header too)."""
    with pytest.raises(openai.APIStatusError) as error:
        client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=2000, extra_body={"ignore_eos": True},
                                       extra_headers={"x-request-timeout-ms": "500"})
    assert error.value.status_code == 504 and error.value.body["code"] == "deadline_exceeded"
    assert_pool_frees(stack)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=2,
                                       extra_headers={"x-request-timeout-ms": "soon"})
    assert error.value.body["param"] == "x-request-timeout-ms"
    answer = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=4, temperature=0,
                                            extra_headers={"x-envoy-expected-rq-timeout-ms": "120000"})
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
