"""Length buckets: one shared config that groups prompts by length.

One flag, `--length-buckets`, sets it for preprocess (its per-bucket metrics, GetPreprocessInfo)
and for the engine (one waiting queue per bucket); `llmserve serve` and the chart pass the one
value to both, so they agree.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

DEFAULT_BUCKET_BOUNDS = (128, 512, 2048, 8192, 32768, 131072)
LENGTH_BUCKETS_FLAG = "--length-buckets"

# Decode batch sizes that get a CUDA graph (the torch engine captures those <= max_num_seqs,
# plus max_num_seqs itself). A decode step of n sequences replays the smallest graph >= n with
# the spare rows padded: dense at small sizes, where a step is latency-bound, and every 32-64
# above, where padding costs a few percent of a weight-bandwidth-bound step.
DECODE_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass(frozen=True, slots=True)
class LengthBucket:
    index: int
    max_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class BucketConfig:
    """Upper bounds (inclusive, in tokens), strictly increasing."""

    bounds: tuple[int, ...] = DEFAULT_BUCKET_BOUNDS

    def __post_init__(self) -> None:
        if not self.bounds or any(b <= a for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"bucket bounds must be non-empty and strictly increasing: {self.bounds}")

    @classmethod
    def parse(cls, text: str) -> "BucketConfig":
        """From a comma-separated list, e.g. "128,512,2048"."""
        return cls(tuple(int(part) for part in text.split(",") if part.strip()))

    def limited_to(self, max_context_tokens: int) -> "BucketConfig":
        """Buckets up to the model's context, the last one ending exactly there."""
        kept = tuple(b for b in self.bounds if b < max_context_tokens)
        return BucketConfig((*kept, max_context_tokens))

    def buckets(self) -> list[LengthBucket]:
        return [LengthBucket(i, b) for i, b in enumerate(self.bounds)]

    def bucket_for(self, num_tokens: int) -> LengthBucket:
        """The shortest bucket that holds `num_tokens` (the last one if none does)."""
        i = min(bisect.bisect_left(self.bounds, num_tokens), len(self.bounds) - 1)
        return LengthBucket(i, self.bounds[i])
