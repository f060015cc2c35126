"""Parameter-holding building blocks of the decoder: RMSNorm and the fused (merged) linear."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm op for op: normalize in float32, round to the input dtype,
    scale by the weight. The forward is the reference; a backend's LayerOps may run the norm of
    the hidden states as a kernel over the same weight and eps."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


class MergedLinear(nn.Linear):
    """Several projections of the same input stacked on the output dimension (one matmul).

    `shard_names` name the checkpoint's separate matrices in output order; the loader copies
    each into its rows with `load_shard`.
    """

    def __init__(self, in_features: int, output_sizes: list[int], shard_names: list[str], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes
        self.shard_names = shard_names

    def load_shard(self, param: nn.Parameter, shard_name: str, loaded: torch.Tensor) -> None:
        index = self.shard_names.index(shard_name)
        offset = sum(self.output_sizes[:index])
        param.data[offset : offset + self.output_sizes[index]].copy_(loaded)
