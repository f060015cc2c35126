"""The trtllm backend without TensorRT-LLM: a clear error, and the sampling translation.

TensorRT-LLM cannot be installed on our machines, so its generation path is untested (README
says so). What can be checked here is the import guard and how our SamplingParams map onto the
documented tensorrt_llm.SamplingParams keywords.
"""

from __future__ import annotations

import importlib.util

import pytest

from llmserve.inference.backends import create_engine
from llmserve.inference.engine.cores import BackendUnavailable
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.trtllm_engine import trt_sampling
from llmserve.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed here"
)


def test_missing_tensorrt_llm_is_a_clear_error(tiny_model_dir):
    config = EngineConfig(model_path=tiny_model_dir, model_name="tiny", backend="trtllm")
    with pytest.raises(BackendUnavailable, match="tensorrt_llm"):
        create_engine(config)


class _Keywords:
    """Records the keywords it is built with, like tensorrt_llm.SamplingParams takes them."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs


def test_greedy_maps_to_top_k_one_and_eos_to_end_id():
    params = SamplingParams(max_tokens=7, temperature=0.0, stop_token_ids=(11,), min_tokens=2, seed=5)
    kw = trt_sampling(_Keywords, params, eos_token_ids=(2, 3)).kwargs
    assert kw["max_tokens"] == 7 and kw["top_k"] == 1 and kw["temperature"] is None
    assert kw["end_id"] == 2 and kw["stop_token_ids"] == [11, 3]
    assert kw["min_tokens"] == 2 and kw["seed"] == 5 and kw["detokenize"] is False


def test_sampling_and_ignore_eos():
    params = SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, top_k=40, ignore_eos=True, logprobs=2, n=2)
    kw = trt_sampling(_Keywords, params, eos_token_ids=(2,)).kwargs
    assert kw["temperature"] == 0.8 and kw["top_p"] == 0.9 and kw["top_k"] == 40
    assert kw["end_id"] == -1 and kw["stop_token_ids"] == []
    assert kw["logprobs"] == 2 and kw["n"] == 2
