"""The gateway's own preprocessing of small prompts (services/gateway/local_preprocess.py) against
the preprocess tier: a real preprocess server on the tiny model answers the same requests, and the
two must agree on every field (token ids, block hashes, resolved max_tokens) and on every refusal
(status, field, message). Then the rule for when the gateway answers, the checkpoints it refuses
to answer for, and a real stack (torch backend) whose counters say which side did the work."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
from pathlib import Path

import grpc
import pytest

from llmserve.errors import ServiceError
from llmserve.gateway.local_preprocess import LocalPreprocess, LocalPreprocessConfig
from llmserve.gateway.preprocess_client import PreparedPrompt, PreprocessClient
from llmserve.preprocessing.tokenizer import ModelTokenizer
from llmserve.prompt_input import Chat, PromptTokenIds
from llmserve.sampling import ChatMessage
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.metrics_scrape import scrape
from tests.procs import running_service
from tests.test_gateway_metrics import metrics_url, scrape_when

SMALL = "The gateway tokenizes this prompt itself."
CHAT = Chat((ChatMessage("system", "Answer briefly."), ChatMessage("user", "Which colour is the sky?")))
# (input, max_tokens, cache_salt): text, chat and token ids, with and without a salt or a max_tokens.
ACCEPTED = [
    (SMALL, None, ""),
    (SMALL, 8, "tenant-a"),
    ("word " * 20, 16, ""),  # several full blocks of 16: hashes to compare
    (CHAT, None, ""),
    (CHAT, 4, "tenant-b"),
    (PromptTokenIds(list(range(3, 43))), None, ""),
]
REFUSED = [
    ("word " * 400, None),  # over the 256-token context
    (SMALL, 100_000),  # max_tokens over the output limit: named as the client's field
    (PromptTokenIds([]), None),
    (PromptTokenIds([5, 10**7]), None),  # outside the vocabulary
    (Chat((ChatMessage("robot", "beep"),)), None),
    (Chat(()), None),
]


def without_time(prompt: PreparedPrompt) -> PreparedPrompt:
    return dataclasses.replace(prompt, preprocess_time_ns=0)


@pytest.fixture(scope="module")
def tier(tiny_model_dir, tmp_path_factory):
    """A preprocess server, and its card as the gateway reads it at start-up."""
    log_dir = tmp_path_factory.mktemp("local-preprocess-logs")
    with running_service("preprocess", ["--model", str(tiny_model_dir), "--metrics-port", "0"], log_dir) as service:
        card = asyncio.run(_card(service.address))
        yield service, card


async def _card(address: str):
    client = PreprocessClient(address)
    try:
        return await client.get_info()
    finally:
        await client.close()


def load_local(model_dir: Path, card, config: LocalPreprocessConfig = LocalPreprocessConfig()) -> LocalPreprocess | None:
    """As the gateway does: the tokenizer it loaded from --model, then the rest."""
    tokenizer = ModelTokenizer.load(model_dir)
    return LocalPreprocess.load(model_dir, tokenizer, card, config)


def tier_answers(address: str, cases) -> list[PreparedPrompt | ServiceError]:
    async def run():
        client = PreprocessClient(address)
        answers = []
        try:
            for i, (prompt_input, max_tokens, *salt) in enumerate(cases):
                try:
                    answers.append(await client.preprocess(
                        f"r{i}", prompt_input, max_tokens=max_tokens, cache_salt=salt[0] if salt else "", timeout_s=30,
                    ))
                except ServiceError as error:
                    answers.append(error)
        finally:
            await client.close()
        return answers

    return asyncio.run(run())


def test_the_gateway_answers_what_the_tier_answers(tiny_model_dir, tier):
    service, card = tier
    local = load_local(tiny_model_dir, card)
    assert local is not None
    for (prompt_input, max_tokens, cache_salt), remote in zip(ACCEPTED, tier_answers(service.address, ACCEPTED)):
        assert isinstance(remote, PreparedPrompt), remote
        here = local.preprocess(prompt_input, max_tokens=max_tokens, cache_salt=cache_salt)
        assert without_time(here) == without_time(remote), prompt_input
        assert here.preprocess_time_ns > 0
    # The long prompt has full blocks, so the hashes compared above were not all empty.
    assert len(local.preprocess(ACCEPTED[2][0], max_tokens=None, cache_salt="").block_hashes) >= 3


def test_the_gateway_refuses_what_the_tier_refuses_with_the_same_field_and_message(tiny_model_dir, tier):
    service, card = tier
    local = load_local(tiny_model_dir, card)
    for (prompt_input, max_tokens), remote in zip(REFUSED, tier_answers(service.address, REFUSED)):
        assert isinstance(remote, ServiceError), (prompt_input, remote)
        with pytest.raises(ServiceError) as here:
            local.preprocess(prompt_input, max_tokens=max_tokens, cache_salt="")
        assert (type(here.value), here.value.code, here.value.message) == (type(remote), remote.code, remote.message)
        assert here.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ServiceError, match=r"^sampling\.max_tokens: "):
        local.preprocess(SMALL, max_tokens=100_000, cache_salt="")


def test_small_prompts_at_light_load_only(tiny_model_dir, tier):
    _, card = tier
    local = load_local(tiny_model_dir, card, LocalPreprocessConfig(max_prompt_bytes=16, max_in_flight=2))
    assert local.takes("a" * 16, num_in_flight=1)
    assert local.takes("a" * 16, num_in_flight=2)
    assert not local.takes("a" * 16, num_in_flight=3)  # this worker is busy: the tier's
    assert not local.takes("a" * 17, num_in_flight=1)
    assert not local.takes("é" * 9, num_in_flight=1)  # 18 UTF-8 bytes
    assert local.takes(PromptTokenIds([1, 2, 3]), num_in_flight=1)  # 5 bytes an id, as the tier counts
    assert not local.takes(PromptTokenIds([1, 2, 3, 4]), num_in_flight=1)
    assert local.takes(Chat((ChatMessage("user", "hi"),)), num_in_flight=1)  # 4 + 2 + 8 of framing: 14
    assert not local.takes(Chat((ChatMessage("user", "hi!!!"),)), num_in_flight=1)  # 17
    assert not local.takes(None, num_in_flight=1)  # the tier says what is missing


def test_off_or_another_checkpoint_leaves_every_prompt_to_the_tier(tiny_model_dir, tier, tmp_path, caplog):
    _, card = tier
    assert load_local(tiny_model_dir, card, LocalPreprocessConfig(max_prompt_bytes=0)) is None
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = other / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + "\n")  # the same tokenizer, other bytes: another fingerprint
    with caplog.at_level(logging.WARNING):
        assert load_local(other, card) is None
    assert "tokenizer_fingerprint" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert load_local(tiny_model_dir, dataclasses.replace(card, chat_template_fingerprint=0)) is None
    assert "chat_template_fingerprint" in caplog.text and "vs 0" in caplog.text  # the tier has none
    caplog.clear()
    retemplated = tmp_path / "retemplated"  # the same files but a chat template that renders otherwise
    shutil.copytree(tiny_model_dir, retemplated)
    tokenizer_config = json.loads((retemplated / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "System: " + tokenizer_config["chat_template"]
    (retemplated / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with caplog.at_level(logging.WARNING):
        assert load_local(retemplated, card) is None
    assert "chat_template_fingerprint" in caplog.text
    caplog.clear()
    tokenizer_only = tmp_path / "tokenizer-only"  # enough to detokenize, not to preprocess
    shutil.copytree(tiny_model_dir, tokenizer_only)
    (tokenizer_only / "config.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert load_local(tokenizer_only, card) is None
    assert "cannot preprocess them itself" in caplog.text and "config.json is missing" in caplog.text


def _text_params(prompt: str) -> gateway_pb2.GenerateParams:
    return gateway_pb2.GenerateParams(
        prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        return_token_ids=True,
    )


def test_a_stack_preprocesses_small_prompts_in_the_gateway_and_large_ones_in_the_tier(tiny_model_dir, tier, tmp_path):
    """Real processes, torch backend: the counters of both sides say who answered; the tokens
    generated do not depend on it."""
    service, _ = tier
    preprocess_url = metrics_url(service)
    small, large = SMALL, "word " * 30  # 37 and 150 bytes
    with running_service(
        "inference", ["--model", str(tiny_model_dir), "--num-kv-blocks", "64"], tmp_path, module="llmserve.inference"
    ) as inference:
        results = {}
        for limit in (64, 0):
            with running_service(f"gateway-{limit}", [
                "--model", str(tiny_model_dir), "--preprocess", service.address, "--inference", inference.address,
                "--metrics-port", "0", "--local-preprocess-max-bytes", str(limit),
            ], tmp_path, module="llmserve.gateway") as gateway:
                url = metrics_url(gateway)
                stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gateway.address))
                gateway_before, tier_before = scrape(url), scrape(preprocess_url)
                results[limit] = [
                    stub.Generate(gateway_pb2.GenerateRequest(params=_text_params(p)), timeout=60)
                    for p in (small, large)
                ]
                gateway_after = scrape_when(url, lambda s: s.delta(gateway_before, "llmserve_gateway_requests_total",
                                                                   finish_reason="length") == 2)
                tier_after = scrape(preprocess_url)
                in_gateway = gateway_after.delta(gateway_before, "llmserve_gateway_preprocessed_in_gateway_total")
                in_tier = tier_after.delta(tier_before, "llmserve_preprocess_requests_total", code="OK")
                assert (in_gateway, in_tier) == ((1, 1) if limit else (0, 2)), limit
    for here, there in zip(results[64], results[0]):
        assert list(here.token_ids) == list(there.token_ids)
        assert here.result.usage.prompt_tokens == there.result.usage.prompt_tokens > 0
