"""Length buckets (llmserve.buckets): one shared config for preprocess, admission and engine sizing."""

from __future__ import annotations

import pytest

from llmserve.buckets import DEFAULT_BUCKET_BOUNDS, BucketConfig, LengthBucket


def test_default_bounds():
    assert BucketConfig().bounds == DEFAULT_BUCKET_BOUNDS == (128, 512, 2048, 8192, 32768, 131072)


@pytest.mark.parametrize(
    ("text", "bounds"),
    [("128,512,2048", (128, 512, 2048)), (" 16 , 64 ", (16, 64)), ("100,", (100,)), ("7", (7,))],
)
def test_parse(text, bounds):
    assert BucketConfig.parse(text).bounds == bounds


@pytest.mark.parametrize("text", ["", ",", "512,128", "128,128", "a,b"])
def test_parse_rejects_bad_lists(text):
    with pytest.raises(ValueError):
        BucketConfig.parse(text)


@pytest.mark.parametrize("bounds", [(), (512, 128), (64, 64)])
def test_bounds_must_be_non_empty_and_strictly_increasing(bounds):
    with pytest.raises(ValueError, match="non-empty and strictly increasing"):
        BucketConfig(bounds)


@pytest.mark.parametrize(
    ("num_tokens", "bucket"),
    [
        (0, LengthBucket(0, 128)),
        (1, LengthBucket(0, 128)),
        (128, LengthBucket(0, 128)),  # bounds are inclusive
        (129, LengthBucket(1, 512)),
        (512, LengthBucket(1, 512)),
        (513, LengthBucket(2, 2048)),
        (2048, LengthBucket(2, 2048)),
        (5000, LengthBucket(2, 2048)),  # beyond the last bound: the last bucket
    ],
)
def test_bucket_for_picks_the_shortest_bucket_that_holds_the_prompt(num_tokens, bucket):
    assert BucketConfig((128, 512, 2048)).bucket_for(num_tokens) == bucket


@pytest.mark.parametrize(
    ("context", "bounds"),
    [
        (8192, (128, 512, 2048, 8192)),
        (1000, (128, 512, 1000)),
        (128, (128,)),
        (100, (100,)),
        (200_000, (*DEFAULT_BUCKET_BOUNDS, 200_000)),
    ],
)
def test_limited_to_cuts_at_the_context_which_becomes_the_last_bucket(context, bounds):
    assert BucketConfig().limited_to(context).bounds == bounds


def test_buckets_lists_every_bucket_with_its_index():
    assert BucketConfig((16, 64, 256)).buckets() == [LengthBucket(0, 16), LengthBucket(1, 64), LengthBucket(2, 256)]
