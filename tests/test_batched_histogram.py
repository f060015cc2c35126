"""BatchedHistogram adds to a Prometheus histogram exactly what observing each value would."""

from prometheus_client import CollectorRegistry, Histogram

from llmserve.batched_histogram import BatchedHistogram

BUCKETS = (0.001, 0.005, 0.01, 0.1)
VALUES = [0.0, 0.001, 0.0011, 0.005, 0.0049, 0.01, 0.05, 0.1, 0.2, 7.0]


def samples(histogram: Histogram) -> dict:
    return {(s.name, s.labels.get("le")): s.value for metric in histogram.collect() for s in metric.samples
            if not s.name.endswith("_created")}


def test_a_flushed_batch_equals_each_value_observed_one_by_one():
    registry = CollectorRegistry()
    direct = Histogram("direct", "d", buckets=BUCKETS, registry=registry)
    batched_target = Histogram("batched", "b", buckets=BUCKETS, registry=registry)
    batched = BatchedHistogram(batched_target, max_pending=10_000, max_age_s=3600)
    for value in VALUES:
        direct.observe(value)
        direct.observe(value)
        batched.observe(value, count=2)
    assert samples(batched_target)[("batched_count", None)] == 0  # nothing added before a flush
    batched.flush()
    renamed = {(name.replace("batched", "direct"), le): v for (name, le), v in samples(batched_target).items()}
    assert renamed == samples(direct)
    batched.flush()  # an empty flush adds nothing
    assert samples(batched_target)[("batched_count", None)] == 2 * len(VALUES)


def test_a_full_batch_is_added_without_a_flush():
    target = Histogram("full", "f", buckets=BUCKETS, registry=CollectorRegistry())
    batched = BatchedHistogram(target, max_pending=4, max_age_s=3600)
    for _ in range(3):
        batched.observe(0.002)
    assert samples(target)[("full_count", None)] == 0
    batched.observe(0.002)
    assert samples(target)[("full_count", None)] == 4
    assert samples(target)[("full_bucket", "0.005")] == 4


def test_an_old_batch_is_added_at_the_next_observation():
    target = Histogram("old", "o", buckets=BUCKETS, registry=CollectorRegistry())
    batched = BatchedHistogram(target, max_pending=10_000, max_age_s=0.0)
    batched.observe(0.002)
    assert samples(target)[("old_count", None)] == 1
