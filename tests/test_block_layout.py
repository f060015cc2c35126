"""Preprocess and inference started with different --block-size or on different checkpoint
files: the gateway refuses to start, inference refuses hashes of another block size from a
direct caller (real servers, hf backend), and a replica restarted in place with another block
size is left out of routing until one with the gateway's serves there again (torch backend)."""

from __future__ import annotations

import json
import shutil
import time

import grpc
import pytest

from llmserve.block_hash import HashNamespace
from llmserve.gateway.block_layout import BlockLayout, BlockLayoutMismatch, check_block_layouts
from llmserve.v1 import (
    common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc, preprocess_pb2, preprocess_pb2_grpc,
)
from llmserve.tools.service_process import ServiceProcess, start_service, stop_service
from tests.procs import free_port
from tests.rich_status import field_violation

EXIT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def mismatched(tiny_model_dir, tmp_path_factory):
    """Preprocess hashing 16-token blocks, inference caching 32-token blocks."""
    log_dir = tmp_path_factory.mktemp("block-layout")
    preprocess = start_service("preprocess", ["--model", str(tiny_model_dir), "--block-size", "16"], log_dir)
    inference = None
    try:
        inference = start_service(
            "inference", ["--model", str(tiny_model_dir), "--backend", "hf", "--block-size", "32"], log_dir
        )
        yield preprocess, inference
    finally:
        for service in (inference, preprocess):
            if service is not None:
                stop_service(service)


def gateway_start_error(preprocess, inference, model_dir, tmp_path) -> str:
    """The one ERROR line of a gateway that exits 1 at start-up without serving."""
    gateway = ServiceProcess(
        "gateway",
        "llmserve.gateway",
        [
            "--host", "127.0.0.1", "--port", "0", "--model", str(model_dir),
            "--preprocess", preprocess.address, "--inference", inference.address,
        ],
        port_file=tmp_path / "gateway.port",
        log_path=tmp_path / "gateway.log",
    )
    gateway.start()
    try:
        assert gateway.wait(EXIT_TIMEOUT_S) == 1
    finally:
        gateway.kill()
    assert not (tmp_path / "gateway.port").exists()
    error_lines = [line for line in (tmp_path / "gateway.log").read_text().splitlines() if " ERROR " in line]
    assert len(error_lines) == 1, error_lines
    return error_lines[0]


def test_the_gateway_refuses_to_start_naming_both_block_sizes(mismatched, tiny_model_dir, tmp_path):
    preprocess, inference = mismatched
    assert gateway_start_error(preprocess, inference, tiny_model_dir, tmp_path).endswith(
        f"cannot start: block size mismatch: preprocess uses 16 tokens per block, inference at "
        f"{inference.address} uses 32; start both with the same --block-size"
    )


def test_the_gateway_refuses_to_start_on_another_model_config(tiny_model_dir, tmp_path):
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    preprocess = start_service("preprocess", ["--model", str(tiny_model_dir)], tmp_path)
    try:
        inference = start_service("inference", ["--model", str(other), "--backend", "hf"], tmp_path)
        try:
            error = gateway_start_error(preprocess, inference, tiny_model_dir, tmp_path)
        finally:
            stop_service(inference)
    finally:
        stop_service(preprocess)
    ours, theirs = HashNamespace.of_model_dir(tiny_model_dir, 16), HashNamespace.of_model_dir(other, 16)
    assert error.endswith(
        f"cannot start: block hash namespace mismatch: preprocess hashes for a model whose config.json has "
        f"fingerprint {ours.model_fingerprint:016x}, inference at {inference.address} serves one with "
        f"{theirs.model_fingerprint:016x}; start both with the same --model (the same checkpoint, byte for byte)"
    )


def test_a_tokenizer_mismatch_is_named_too():
    preprocess = BlockLayout(block_size_tokens=16, block_hash_version=2, model_fingerprint=1, tokenizer_fingerprint=2)
    same = {"a:1": preprocess, "b:2": preprocess}
    check_block_layouts(preprocess, same)
    other_tokenizer = BlockLayout(block_size_tokens=16, block_hash_version=2, model_fingerprint=1, tokenizer_fingerprint=3)
    with pytest.raises(BlockLayoutMismatch) as raised:
        check_block_layouts(preprocess, {**same, "c:3": other_tokenizer})
    assert str(raised.value) == (
        "block hash namespace mismatch: preprocess hashes for a tokenizer whose tokenizer.json has fingerprint "
        "0000000000000002, inference at c:3 serves one with 0000000000000003; start both with the same --model "
        "(the same checkpoint, byte for byte)"
    )


def test_inference_refuses_hashes_of_another_block_size(mismatched):
    preprocess, inference = mismatched
    prompt = preprocess_pb2_grpc.PreprocessServiceStub(grpc.insecure_channel(preprocess.address)).Preprocess(
        preprocess_pb2.PreprocessRequest(prompt="x" * 40, max_tokens=4)
    )
    assert prompt.block_size_tokens == 16 and len(prompt.block_hashes) >= 2
    request = inference_pb2.GenerateTokensRequest(
        request_id="direct",
        prompt_token_ids=prompt.token_ids,
        sampling=common_pb2.SamplingParams(max_tokens=prompt.max_tokens, ignore_eos=True),
        block_hashes=prompt.block_hashes,
        block_size_tokens=prompt.block_size_tokens,
        block_hash_version=prompt.block_hash_version,
    )
    stub = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(inference.address))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateTokens(request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violation(info.value) == (
        "block_size_tokens",
        "must be this replica's block size of 32 tokens when block_hashes are given, got 16",
    )
    # Without the hashes the same request runs.
    del request.block_hashes[:]
    assert sum(len(r.token_ids) for r in stub.GenerateTokens(request)) == prompt.max_tokens


def _generate(gateway) -> gateway_pb2.GenerationResult:
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gateway.address))
    params = gateway_pb2.GenerateParams(prompt="x" * 40, sampling=common_pb2.SamplingParams(max_tokens=2))
    return stub.Generate(gateway_pb2.GenerateRequest(params=params), timeout=60).result


def _wait_for_log(service, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in service.log_path.read_text():
        assert time.monotonic() < deadline, f"{text!r} never logged:\n{service.log_tail()}"
        time.sleep(0.1)


def test_a_replica_restarted_in_place_with_another_block_size_is_left_out_until_it_matches(tiny_model_dir, tmp_path):
    model = ["--model", str(tiny_model_dir)]
    port = free_port()
    replica_args = [*model, "--port", str(port)]
    preprocess = start_service("preprocess", [*model, "--block-size", "16"], tmp_path / "preprocess")
    replica = start_service("inference", [*replica_args, "--block-size", "16"], tmp_path / "first")
    gateway = None
    try:
        gateway = start_service("gateway", [*model, "--preprocess", preprocess.address, "--inference",
                                            replica.address], tmp_path / "gateway", module="llmserve.gateway")
        assert _generate(gateway).usage.completion_tokens == 2
        stop_service(replica)
        replica = start_service("inference", [*replica_args, "--block-size", "32"], tmp_path / "second")
        _wait_for_log(gateway, f"inference at {replica.address} left out of routing: block size mismatch: "
                               f"preprocess uses 16 tokens per block, inference at {replica.address} uses 32")
        with pytest.raises(grpc.RpcError) as refused:  # not the replica's INVALID_ARGUMENT for every request
            _generate(gateway)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        stop_service(replica)
        replica = start_service("inference", [*replica_args, "--block-size", "16"], tmp_path / "third")
        _wait_for_log(gateway, f"inference at {replica.address} matches the block layout again")
        deadline = time.monotonic() + 60.0
        while True:  # live again once its event stream's first batch has come
            try:
                assert _generate(gateway).usage.completion_tokens == 2
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, error
                time.sleep(0.1)
        assert gateway.log_path.read_text().count("left out of routing") == 1  # once per layout, not per retry
    finally:
        for service in (gateway, replica, preprocess):
            if service is not None:
                stop_service(service)
