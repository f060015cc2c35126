"""The Preprocess service through real gRPC channels: in-process servers on port 0 for the RPCs
and every INVALID_ARGUMENT path, and once as a subprocess for the launcher contract (port file
after SERVING, reflection, SIGTERM → exit 0)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import tokenizers
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoTokenizer

from llmserve import token_id_bytes
from llmserve.block_hash import HASH_VERSION, HashNamespace, fingerprint
from llmserve.buckets import BucketConfig
from llmserve.preprocess.__main__ import build_parser
from llmserve.preprocess.config import PreprocessConfig
from llmserve.preprocess.server import start_server
from llmserve.pb import region_ids_from_pb, scope_to_pb
from llmserve.prompt_ids_region import PromptIdsReader, local_scope
from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import common_pb2, preprocess_pb2, preprocess_pb2_grpc
from tests.rich_status import field_violation

pytestmark = pytest.mark.asyncio(loop_scope="session")

CONTEXT = 256  # the tiny models' max_position_embeddings
MAX_OUTPUT = 100
MAX_PROMPT_BYTES = 16_000  # a little over the tiny model's derived cap, so that none of these tests meet it
BLOCK_SIZE = 4
ROLES = "expected one of system, user, assistant, tool"
STRICT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
)


def _config(model_dir: Path, **overrides) -> PreprocessConfig:
    settings = dict(
        model_path=model_dir,
        model_name="tiny-llama",
        port=0,
        max_output_tokens=MAX_OUTPUT,
        block_size_tokens=BLOCK_SIZE,
        length_buckets=BucketConfig((16, 64)),
        num_tokenizer_threads=4,
        max_prompt_bytes=MAX_PROMPT_BYTES,
    )
    return PreprocessConfig(**{**settings, **overrides})


def _variant(model_dir: Path, path: Path, chat_template: str | None) -> Path:
    """The tiny model's tokenizer files with another chat template (None: none at all)."""
    path.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(model_dir / name, path / name)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template")
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stubs(tiny_model_dir, tmp_path_factory):
    """Stubs of four servers on the tiny model: its ChatML template, no template, a template
    that raises on roles that do not alternate, and its template without a prompt ids ring."""
    root = tmp_path_factory.mktemp("preprocess-variants")
    model_dirs = {
        "main": (tiny_model_dir, {}),
        "no_template": (_variant(tiny_model_dir, root / "no-template", None), {}),
        "strict": (_variant(tiny_model_dir, root / "strict", STRICT_TEMPLATE), {}),
        "no_ring": (tiny_model_dir, {"prompt_ids_region_mib": 0}),
    }
    servers, channels, result = [], [], {}
    for name, (model_dir, overrides) in model_dirs.items():
        server = await start_server(_config(model_dir, **overrides))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS)
        servers.append(server)
        channels.append(channel)
        result[name] = preprocess_pb2_grpc.PreprocessServiceStub(channel)
    result["health"] = health_pb2_grpc.HealthStub(channels[0])
    yield result
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.running.server.stop(1.0)
        await server.close()
        await server.close()


@pytest.fixture(scope="module")
def stub(stubs):
    return stubs["main"]


@pytest.fixture(scope="module")
def namespace(tiny_model_dir) -> HashNamespace:
    """What the main server hashes with."""
    return HashNamespace.of_model_dir(tiny_model_dir, BLOCK_SIZE)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def _chat(*turns: tuple[str, str], add_generation_prompt: bool | None = None) -> common_pb2.ChatInput:
    chat = common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in turns])
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


def _x_prompt(num_tokens: int, reference: tokenizers.Tokenizer) -> str:
    """A prompt of exactly `num_tokens` tokens ("x" is one token and never merges)."""
    prompt = "x" * num_tokens
    assert len(reference.encode(prompt).ids) == num_tokens
    return prompt


async def _invalid_argument(call, request) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The structured detail names the same field as the message ("field: problem").
    field, problem = field_violation(caught.value)
    assert caught.value.details() == f"{field}: {problem}"
    return caught.value.details()


# --- GetPreprocessInfo ------------------------------------------------------------------------


async def test_get_info_fills_every_field(stub, reference, tiny_model_dir):
    info = await stub.GetPreprocessInfo(preprocess_pb2.GetPreprocessInfoRequest())
    assert info.chat_template_fingerprint != 0  # its value: test_local_preprocess compares two checkpoints

    preprocess_fields = {
        "model_name", "tokenizer_vocab_size", "max_context_tokens", "eos_token_ids", "block_size_tokens",
        "block_hash_version", "model_fingerprint", "tokenizer_fingerprint",
    }
    assert info == preprocess_pb2.GetPreprocessInfoResponse(
        model=common_pb2.ModelInfo(
            model_name="tiny-llama",
            tokenizer_vocab_size=reference.get_vocab_size(with_added_tokens=True),
            max_context_tokens=CONTEXT,
            eos_token_ids=[reference.token_to_id("<|im_end|>")],
            block_size_tokens=BLOCK_SIZE,
            block_hash_version=HASH_VERSION,
            model_fingerprint=fingerprint((tiny_model_dir / "config.json").read_bytes()),
            tokenizer_fingerprint=fingerprint((tiny_model_dir / "tokenizer.json").read_bytes()),
        ),
        max_output_tokens=MAX_OUTPUT,
        buckets=[
            common_pb2.LengthBucket(index=0, max_prompt_tokens=16),
            common_pb2.LengthBucket(index=1, max_prompt_tokens=64),
            common_pb2.LengthBucket(index=2, max_prompt_tokens=CONTEXT),
        ],
        has_chat_template=True,
        max_prompt_bytes=MAX_PROMPT_BYTES,
        chat_template_fingerprint=info.chat_template_fingerprint,
        shared_memory=scope_to_pb(local_scope()),  # where its prompt ids ring can be mapped
    )
    # No field left at its proto3 default, of those preprocess fills.
    assert {field.name for field, _ in info.ListFields()} == {f.name for f in info.DESCRIPTOR.fields}
    assert {field.name for field, _ in info.model.ListFields()} == preprocess_fields


async def test_get_info_reports_a_missing_chat_template(stubs):
    info = await stubs["no_template"].GetPreprocessInfo(preprocess_pb2.GetPreprocessInfoRequest())
    assert info.has_chat_template is False
    assert info.chat_template_fingerprint == 0


# --- Preprocess ---------------------------------------------------------------------------


async def test_preprocess_prompt(stub, reference, namespace):
    prompt = "The capital of France is Paris. Continuous batching lets new requests join the batch."
    expected_ids = reference.encode(prompt).ids
    assert 16 < len(expected_ids) <= 64

    response = await stub.Preprocess(preprocess_pb2.PreprocessRequest(request_id="r-1", prompt=prompt))

    assert list(response.token_ids) == expected_ids
    assert list(response.block_hashes) == namespace.block_hashes(expected_ids)
    assert len(response.block_hashes) == len(expected_ids) // BLOCK_SIZE
    assert response.block_size_tokens == BLOCK_SIZE
    assert response.block_hash_version == HASH_VERSION
    assert response.max_tokens == MAX_OUTPUT
    assert response.preprocess_time_ns > 0
    assert response.token_id_bytes == b""

    # As the gateway asks: the same ids as bytes, and nothing else changed.
    as_bytes = await stub.Preprocess(
        preprocess_pb2.PreprocessRequest(request_id="r-2", prompt=prompt, token_ids_as_bytes=True)
    )
    assert (list(as_bytes.token_ids), token_id_bytes.unpack(as_bytes.token_id_bytes)) == ([], expected_ids)
    assert (list(as_bytes.block_hashes), as_bytes.max_tokens) == (list(response.block_hashes), MAX_OUTPUT)

    # A long prompt, as a gateway on this host asks: the ids in the ring, nothing else changed; a
    # shorter one than asked for: bytes.
    long_enough = len(expected_ids)
    in_ring = await stub.Preprocess(preprocess_pb2.PreprocessRequest(
        request_id="r-3", prompt=prompt, token_ids_as_bytes=True, token_ids_in_region_from=long_enough
    ))
    assert (list(in_ring.token_ids), in_ring.token_id_bytes) == ([], b"")
    ref = region_ids_from_pb(in_ring.token_ids_in_region)
    assert PromptIdsReader().read(ref).tolist() == expected_ids and ref.valid_for_s > 0
    assert (list(in_ring.block_hashes), in_ring.max_tokens) == (list(response.block_hashes), MAX_OUTPUT)
    too_short = await stub.Preprocess(preprocess_pb2.PreprocessRequest(
        request_id="r-4", prompt=prompt, token_ids_as_bytes=True, token_ids_in_region_from=long_enough + 1
    ))
    assert not too_short.HasField("token_ids_in_region")
    assert token_id_bytes.unpack(too_short.token_id_bytes) == expected_ids


async def test_a_server_without_a_ring_says_so_and_answers_the_ids_as_asked_otherwise(stubs):
    no_ring = stubs["no_ring"]
    assert not (await no_ring.GetPreprocessInfo(preprocess_pb2.GetPreprocessInfoRequest())).HasField("shared_memory")
    token_ids = list(range(3, 3 + 2 * BLOCK_SIZE))
    request = preprocess_pb2.PreprocessRequest(
        prompt_token_ids=common_pb2.TokenIdsInput(token_ids=token_ids), max_tokens=4, token_ids_in_region_from=1
    )
    as_list = await no_ring.Preprocess(request)
    request.token_ids_as_bytes = True
    as_bytes = await no_ring.Preprocess(request)
    assert not as_list.HasField("token_ids_in_region") and not as_bytes.HasField("token_ids_in_region")
    assert (list(as_list.token_ids), token_id_bytes.unpack(as_bytes.token_id_bytes)) == (token_ids, token_ids)


async def test_the_cache_salt_namespaces_the_block_hashes(stub, namespace):
    token_ids = list(range(3, 3 + 4 * BLOCK_SIZE))

    async def hashes(cache_salt: str) -> list[int]:
        request = preprocess_pb2.PreprocessRequest(
            prompt_token_ids=common_pb2.TokenIdsInput(token_ids=token_ids), max_tokens=4, cache_salt=cache_salt
        )
        return list((await stub.Preprocess(request)).block_hashes)

    unsalted, tenant_a, tenant_a_again, tenant_b = [await hashes(salt) for salt in ("", "a", "a", "b")]
    assert unsalted == namespace.block_hashes(token_ids) and len(unsalted) == 4
    assert tenant_a == tenant_a_again == namespace.block_hashes(token_ids, "a")
    assert not set(tenant_a) & set(unsalted) and not set(tenant_a) & set(tenant_b)


async def test_preprocess_chat_matches_transformers(stub, tiny_model_dir, namespace):
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    turns = [("system", "Be brief."), ("user", "Héllo 東京 🙂"), ("assistant", "Hi."), ("user", "Capital of Italy?")]
    conversation = [{"role": r, "content": c} for r, c in turns]

    # add_generation_prompt unset means true.
    with_prompt = await stub.Preprocess(preprocess_pb2.PreprocessRequest(chat=_chat(*turns)))
    without_prompt = await stub.Preprocess(
        preprocess_pb2.PreprocessRequest(chat=_chat(*turns, add_generation_prompt=False))
    )

    for response, add_generation_prompt in ((with_prompt, True), (without_prompt, False)):
        expected = hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)["input_ids"]
        assert list(response.token_ids) == expected
        assert list(response.block_hashes) == namespace.block_hashes(expected)
    assert len(with_prompt.token_ids) > len(without_prompt.token_ids)


async def test_token_ids_are_preprocessed_exactly_as_the_text_they_encode(stub, reference):
    prompt = "The capital of France is Paris. Continuous batching lets new requests join the batch."
    from_text = await stub.Preprocess(preprocess_pb2.PreprocessRequest(prompt=prompt, max_tokens=50))
    token_ids = common_pb2.TokenIdsInput(token_ids=reference.encode(prompt).ids)

    from_ids = await stub.Preprocess(preprocess_pb2.PreprocessRequest(prompt_token_ids=token_ids, max_tokens=50))

    from_text.ClearField("preprocess_time_ns")
    assert from_ids.preprocess_time_ns > 0
    from_ids.ClearField("preprocess_time_ns")
    assert from_ids == from_text  # same ids, block hashes and max_tokens
    # Used as they are: no BOS or other special token is added around them.
    one = await stub.Preprocess(preprocess_pb2.PreprocessRequest(prompt_token_ids=_token_ids(7)))
    assert list(one.token_ids) == [7] and one.max_tokens == MAX_OUTPUT


async def test_max_tokens_is_kept_when_it_fits(stub, reference):
    prompt = _x_prompt(200, reference)
    response = await stub.Preprocess(preprocess_pb2.PreprocessRequest(prompt=prompt, max_tokens=CONTEXT - 200))
    assert response.max_tokens == CONTEXT - 200


async def test_unset_max_tokens_fills_the_context_up_to_the_output_limit(stub, reference):
    short = await stub.Preprocess(preprocess_pb2.PreprocessRequest(prompt=_x_prompt(10, reference)))
    long = await stub.Preprocess(preprocess_pb2.PreprocessRequest(prompt=_x_prompt(200, reference)))
    assert short.max_tokens == MAX_OUTPUT
    assert long.max_tokens == CONTEXT - 200


async def test_32_concurrent_requests_equal_sequential_ones(stub):
    requests = []
    for i in range(32):
        if i % 2:
            request = preprocess_pb2.PreprocessRequest(
                request_id=f"c-{i}", chat=_chat(("user", f"Question {i}: " + "why? " * i))
            )
        else:
            request = preprocess_pb2.PreprocessRequest(
                request_id=f"p-{i}", prompt=f"Prompt {i}. " + "The capital of Italy is Rome. " * (i // 2)
            )
        if i % 3 == 0:
            request.max_tokens = 1 + i
        requests.append(request)

    sequential = [await stub.Preprocess(r) for r in requests]
    concurrent = await asyncio.gather(*(stub.Preprocess(r) for r in requests))

    for response in (*sequential, *concurrent):
        response.preprocess_time_ns = 0
    assert list(concurrent) == sequential
    assert len({tuple(r.token_ids) for r in sequential}) == 32


# --- Tokenize and Detokenize --------------------------------------------------------------


async def test_tokenize_text(stub, reference):
    text = "Héllo wörld — 東京 🙂"
    encoding = reference.encode(text)

    response = await stub.Tokenize(preprocess_pb2.TokenizeRequest(text=text))
    plain = await stub.Tokenize(preprocess_pb2.TokenizeRequest(text=text, add_special_tokens=False))

    assert list(response.token_ids) == encoding.ids
    assert list(response.tokens) == encoding.tokens
    assert response.rendered_prompt == ""
    assert list(plain.token_ids) == reference.encode(text, add_special_tokens=False).ids


async def test_tokenize_chat_returns_the_rendered_prompt(stub, reference):
    response = await stub.Tokenize(preprocess_pb2.TokenizeRequest(chat=_chat(("user", "Hi"))))

    rendered = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert response.rendered_prompt == rendered
    assert list(response.token_ids) == reference.encode(rendered, add_special_tokens=False).ids
    assert list(response.tokens) == reference.encode(rendered, add_special_tokens=False).tokens
    assert response.tokens[0] == "<|im_start|>"


async def test_detokenize_round_trips_and_skips_special_tokens_by_default(stub, reference):
    text = "Héllo wörld — 東京 🙂"
    token_ids = reference.encode("<|im_start|>" + text + "<|im_end|>").ids

    skipped = await stub.Detokenize(preprocess_pb2.DetokenizeRequest(token_ids=token_ids))
    kept = await stub.Detokenize(preprocess_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=False))

    assert skipped.text == text
    assert kept.text == "<|im_start|>" + text + "<|im_end|>"


# --- Every INVALID_ARGUMENT path ----------------------------------------------------------


async def test_preprocess_invalid_arguments(stub, reference):
    request = preprocess_pb2.PreprocessRequest
    vocab_size = reference.get_vocab_size(with_added_tokens=True)
    long_chat = _chat(("user", _x_prompt(300, reference)))
    num_long_chat_tokens = len((await stub.Tokenize(preprocess_pb2.TokenizeRequest(chat=long_chat))).token_ids)
    cases = [
        (request(), "input: set one of prompt, chat or prompt_token_ids"),
        (request(prompt=""), "prompt: must not be empty"),
        (request(chat=common_pb2.ChatInput()), "chat.messages: must not be empty"),
        (request(chat=_chat(("", "hi"))), f"chat.messages[0].role: must not be empty; {ROLES}"),
        (
            request(chat=_chat(("user", "a"), ("assistant", "b"), ("robot", "c"))),
            f"chat.messages[2].role: unknown role 'robot'; {ROLES}",
        ),
        (request(chat=_chat(("User", "a"))), f"chat.messages[0].role: unknown role 'User'; {ROLES}"),
        (
            request(prompt=_x_prompt(300, reference)),
            "prompt: 300 tokens exceeds the model context of 256 tokens",
        ),
        (
            request(prompt=_x_prompt(256, reference)),
            "prompt: 256 tokens leaves no room for output in the model context of 256 tokens",
        ),
        (
            request(chat=long_chat),
            f"chat: {num_long_chat_tokens} tokens exceeds the model context of 256 tokens",
        ),
        (
            request(prompt=_x_prompt(200, reference), max_tokens=57),
            "max_tokens: prompt (200 tokens) + max_tokens (57) exceeds the model context of 256 tokens",
        ),
        (request(prompt="hi", max_tokens=101), "max_tokens: 101 exceeds the server limit of 100 output tokens"),
        (request(prompt="hi", max_tokens=0), "max_tokens: must be at least 1, got 0"),
        (request(prompt_token_ids=common_pb2.TokenIdsInput()), "prompt_token_ids.token_ids: must not be empty"),
        (
            request(prompt_token_ids=_token_ids(5, vocab_size + 3, 6, vocab_size)),
            f"prompt_token_ids.token_ids[1]: {vocab_size + 3} is outside the vocabulary of {vocab_size} tokens",
        ),
        (
            request(prompt_token_ids=_token_ids(*[5] * 300)),
            "prompt_token_ids: 300 tokens exceeds the model context of 256 tokens",
        ),
        (
            request(prompt_token_ids=_token_ids(*[5] * 200), max_tokens=57),
            "max_tokens: prompt (200 tokens) + max_tokens (57) exceeds the model context of 256 tokens",
        ),
    ]
    for case, message in cases:
        assert await _invalid_argument(stub.Preprocess, case) == message


def _token_ids(*token_ids: int) -> common_pb2.TokenIdsInput:
    return common_pb2.TokenIdsInput(token_ids=token_ids)


async def test_tokenize_and_detokenize_invalid_arguments(stub, reference):
    vocab_size = reference.get_vocab_size(with_added_tokens=True)
    cases = [
        (stub.Tokenize, preprocess_pb2.TokenizeRequest(), "input: set one of text or chat"),
        (
            stub.Tokenize,
            preprocess_pb2.TokenizeRequest(chat=_chat(("user", "a"), ("robot", "b"))),
            f"chat.messages[1].role: unknown role 'robot'; {ROLES}",
        ),
        (
            stub.Tokenize,
            preprocess_pb2.TokenizeRequest(chat=common_pb2.ChatInput()),
            "chat.messages: must not be empty",
        ),
        (
            stub.Detokenize,
            preprocess_pb2.DetokenizeRequest(token_ids=[5, vocab_size, vocab_size + 7]),
            f"token_ids[1]: {vocab_size} is outside the vocabulary of {vocab_size} tokens",
        ),
    ]
    for call, request, message in cases:
        assert await _invalid_argument(call, request) == message


async def test_chat_without_a_chat_template_is_rejected(stubs):
    message = "chat: the model has no chat template; send a prompt instead"
    no_template = stubs["no_template"]
    chat = _chat(("user", "hi"))
    assert await _invalid_argument(no_template.Preprocess, preprocess_pb2.PreprocessRequest(chat=chat)) == message
    assert await _invalid_argument(no_template.Tokenize, preprocess_pb2.TokenizeRequest(chat=chat)) == message
    response = await no_template.Preprocess(preprocess_pb2.PreprocessRequest(prompt="hi"))
    assert len(response.token_ids) > 0


async def test_template_errors_carry_the_template_message(stubs):
    strict = stubs["strict"]
    chat = _chat(("user", "a"), ("user", "b"))
    message = (
        "chat: the model's chat template rejected the conversation: "
        "Conversation roles must alternate user/assistant/user/assistant/..."
    )
    assert await _invalid_argument(strict.Preprocess, preprocess_pb2.PreprocessRequest(chat=chat)) == message
    assert await _invalid_argument(strict.Tokenize, preprocess_pb2.TokenizeRequest(chat=chat)) == message
    ok = await strict.Preprocess(preprocess_pb2.PreprocessRequest(chat=_chat(("user", "a"), ("assistant", "b"))))
    assert len(ok.token_ids) > 0


async def test_server_stays_serving_after_bad_requests(stubs):
    for _ in range(3):
        await _invalid_argument(stubs["main"].Preprocess, preprocess_pb2.PreprocessRequest(prompt=""))
    response = await stubs["health"].Check(health_pb2.HealthCheckRequest(service="llmserve.v1.PreprocessService"))
    assert response.status == health_pb2.HealthCheckResponse.SERVING


# --- As a subprocess: the launcher contract -----------------------------------------------


async def _wait_for_port_file(path: Path, process: asyncio.subprocess.Process) -> int:
    for _ in range(600):  # up to a minute: imports on a busy machine
        if path.exists():
            return int(path.read_text())
        if process.returncode is not None:
            break
        await asyncio.sleep(0.1)
    raise AssertionError(f"no port file; server exited with {process.returncode}")


async def _list_services(channel: grpc.aio.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    async for response in call:
        return [service.name for service in response.list_services_response.service]
    return []


async def test_subprocess_serves_reflects_and_exits_0_on_sigterm(tiny_model_dir, tmp_path):
    port_file, log_file = tmp_path / "port", tmp_path / "stderr.log"
    with log_file.open("w") as stderr:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "llmserve.preprocess", "--model", str(tiny_model_dir),
            "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file), "--log-level", "DEBUG",
            "--grace-period-s", "5", "--block-size", "4", "--length-buckets", "16,64", "--tokenizer-threads", "2",
            stderr=stderr,
        )  # fmt: skip
    try:
        port = await _wait_for_port_file(port_file, process)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert "llmserve.v1.PreprocessService" in await _list_services(channel)
            response = await preprocess_pb2_grpc.PreprocessServiceStub(channel).Preprocess(
                preprocess_pb2.PreprocessRequest(request_id="sub-1", prompt="Hello there", cache_salt="salt-4711")
            )
            assert response.block_size_tokens == 4
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=60) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    log = log_file.read_text()
    assert "sub-1" in log and "salt-4711" not in log  # the request is logged at DEBUG, its salt never
    (preprocessed,) = [line for line in log.splitlines() if "preprocessed:" in line]
    assert f"prompt_tokens={len(response.token_ids)} bucket=0" in preprocessed and preprocessed.endswith(" request_id=sub-1")
    assert "draining" in log


async def test_subprocess_with_a_bad_model_dir_exits_1_with_the_reason(tmp_path):
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmserve.preprocess", "--model", str(tmp_path / "missing"), "--port", "0",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 1
    assert f"cannot start: {tmp_path / 'missing'} is not a model directory: config.json is missing" in stderr.decode()


async def test_help_explains_every_flag():
    text = build_parser().format_help()
    for flag in (
        "--model", "--model-name", "--host", "--port", "--port-file", "--log-level", "--grace-period-s",
        "--block-size", "--length-buckets", "--max-output-tokens", "--max-context-tokens", "--tokenizer-threads",
    ):  # fmt: skip
        assert flag in text
    assert text.count("default:") >= 9
