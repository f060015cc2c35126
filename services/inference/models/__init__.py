"""Model definitions for the torch backend: decoders that read and write the paged KV cache.

`llama.py` covers the Llama family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3), configured by
`decoder_config.py`; `loader.py` maps an HF checkpoint (config.json + *.safetensors) onto them.
Attention and the small ops run through the attention backend the model is built with
(`attention_backend.py`: `portable_attention.py`, `triton_attention.py`).
"""
