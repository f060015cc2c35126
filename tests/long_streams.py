"""What the real-stack tests of slow clients share: a tiny model with room for long generations,
a request for one, and a client window that fills at once (test_client_stream, test_slow_readers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmserve.v1 import common_pb2, gateway_pb2
from tests.factories import with_context

CONTEXT_TOKENS = 4096
MAX_TOKENS = 4000  # with ignore_eos: far more than a small window and the bounds hold
# A client whose HTTP/2 receive window stays ~1 KiB (no BDP growth), so that the gateway's writes
# block after a few messages when it does not read (grpc's default window starts at 64 KiB and
# grows to ~4 MiB: docs/reliability.md, "Slow readers").
SMALL_WINDOW = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))


@pytest.fixture(scope="module")
def long_context_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return with_context(tiny_model_dir, tmp_path_factory.mktemp("tiny-llama-long"), CONTEXT_TOKENS)


def params(max_tokens: int) -> gateway_pb2.GenerateParams:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return gateway_pb2.GenerateParams(prompt="Hello there", sampling=sampling, return_token_ids=True)
