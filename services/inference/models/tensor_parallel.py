"""Tensor parallelism of the Llama-family decoder: which slice of every weight a rank holds, and
the collectives that join the slices (Megatron-style, one all-reduce per attention and per MLP
block).

Per rank r of N (the shapes of models/decoder_config.DecoderConfig):
  attention  q heads [r*H/N, (r+1)*H/N); KV heads split the same way when N divides them, else
             (GQA with fewer KV heads than ranks) each rank holds the one KV head its q heads
             read, replicated on N/KV ranks. qkv_proj is column-split (its rows: this rank's
             heads), o_proj row-split (its columns), so attention is local and one all-reduce
             after o_proj sums the partial outputs;
  MLP        gate_up_proj column-split, down_proj row-split over the intermediate size; one
             all-reduce after down_proj;
  vocabulary the embedding and the lm_head hold rows [r*V'/N, (r+1)*V'/N) of the vocabulary
             padded to V' (a multiple of N; padding rows are zeros): a token's embedding is
             looked up on the rank that holds its row (the others add zeros: an all-reduce), and
             the logits are gathered along the vocabulary and cut back to V;
  the rest   norms (and Qwen3's per-head q/k norms) replicated.
A bias of a row-split projection (o_proj, down_proj) is added once: rank 0 holds it, the other
ranks zeros, so the all-reduce adds it exactly once.

A rank's model is the ordinary decoder built from `local_config()` (its head counts,
intermediate size and vocabulary slice), so attention backends, CUDA graphs and the KV cache
see ordinary shapes; the loader slices every checkpoint tensor with `shard` before copying it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from llmserve.inference.models.decoder_config import DecoderConfig, check_splittable
from llmserve.inference.models.rank_group import SINGLE_RANK, RankGroup

_COLUMN_SPLIT = ("gate_proj", "up_proj")  # rows over the intermediate size
_ROW_SPLIT = ("o_proj", "down_proj")  # weight columns split; bias added once
_VOCABULARY = ("embed_tokens", "lm_head")


class TensorParallel:
    """One rank's slice of a decoder and the collectives the model calls (all identities on a
    single rank)."""

    def __init__(self, config: DecoderConfig, group: RankGroup = SINGLE_RANK):
        check_splittable(config, group.size)
        self.config = config
        self.group = group
        self.rank, self.size = group.rank, group.size
        self.num_heads = config.num_heads // self.size
        self.num_kv_heads = max(1, config.num_kv_heads // self.size)
        # The first KV head this rank holds: its q heads' group (replicated when KV < N).
        self.kv_head_start = self.rank * config.num_kv_heads // self.size
        self.intermediate_size = config.intermediate_size // self.size
        self.padded_vocab_size = -(-config.vocab_size // self.size) * self.size
        self.vocab_size = self.padded_vocab_size // self.size  # rows this rank holds
        self.vocab_start = self.rank * self.vocab_size

    @property
    def is_split(self) -> bool:
        return self.size > 1

    def local_config(self) -> DecoderConfig:
        """The decoder this rank builds: its heads, KV heads, intermediate size and vocabulary rows."""
        return dataclasses.replace(
            self.config, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
        )  # fmt: skip

    # --- the model's collectives ------------------------------------------------------------

    def embed(self, embedding: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden]: each token's row from the rank that holds it (exact: the other
        ranks add zeros)."""
        if not self.is_split:
            return embedding(input_ids)
        local_ids = input_ids - self.vocab_start
        elsewhere = (local_ids < 0) | (local_ids >= self.vocab_size)
        hidden = embedding(local_ids.masked_fill(elsewhere, 0)).masked_fill(elsewhere[:, None], 0)
        return self.group.all_reduce(hidden)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of a row-split projection's partial outputs (after o_proj and down_proj)."""
        return self.group.all_reduce(partial) if self.is_split else partial

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[num_rows, vocab rows here] -> [num_rows, vocab_size] on every rank."""
        if not self.is_split:
            return logits
        return self.group.all_gather(logits)[:, : self.config.vocab_size]

    # --- weights ------------------------------------------------------------------------------

    def shard_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, this rank's slice) for each checkpoint tensor."""
        for name, tensor in named_tensors:
            yield name, self.shard(name, tensor)

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the checkpoint tensor `name` (HF naming); replicated ones whole."""
        if not self.is_split:
            return tensor
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        head_dim = self.config.head_dim
        if module == "q_proj":
            return _rows(tensor, self.rank * self.num_heads * head_dim, self.num_heads * head_dim)
        if module in ("k_proj", "v_proj"):
            return _rows(tensor, self.kv_head_start * head_dim, self.num_kv_heads * head_dim)
        if module in _COLUMN_SPLIT:
            return _rows(tensor, self.rank * self.intermediate_size, self.intermediate_size)
        if module in _ROW_SPLIT:
            if kind == "bias":
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            width = tensor.shape[1] // self.size
            return tensor[:, self.rank * width : (self.rank + 1) * width]
        if module in _VOCABULARY:
            padded = torch.zeros((self.padded_vocab_size, *tensor.shape[1:]), dtype=tensor.dtype)
            padded[: tensor.shape[0]] = tensor
            return _rows(padded, self.vocab_start, self.vocab_size)
        return tensor


def _rows(tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return tensor[start : start + count]
