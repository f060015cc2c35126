"""Model definitions for the torch backend: decoders that read and write the paged KV cache.

`llama.py` covers the Llama family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3); `loader.py` maps an
HF checkpoint (config.json + *.safetensors) onto them.
"""

from llmserve.inference.models.llama import DecoderConfig, LlamaForCausalLM
from llmserve.inference.models.loader import load_model

__all__ = ["DecoderConfig", "LlamaForCausalLM", "load_model"]
