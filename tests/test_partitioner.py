"""The partitioner must agree with Kafka's Java client, kafka-python and librdkafka:
a key on two different partitions loses per-key order, and compaction with it."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest

from cdc import accel
from cdc.kafka import partitioner
from cdc.kafka.partitioner import murmur2, partition_for


@pytest.fixture(params=["c", "python"])
def fast_partition_for(request: pytest.FixtureRequest) -> Iterator[Callable[[bytes, int], int]]:
    """What the producer calls once per record, on each side of the accelerator switch."""
    if request.param == "c" and accel.speedups is None:
        pytest.skip("the C accelerator is not built")
    with accel.selected(request.param == "c"):
        yield partitioner.fast_partition_for


# Kafka's own vectors: clients/src/test/java/org/apache/kafka/common/utils/UtilsTest.java
# (testMurmur2).
JAVA_VECTORS = [
    (b"21", -973932308),
    (b"foobar", -790332482),
    (b"a-little-bit-long-string", -985981536),
    (b"a-little-bit-longer-string", -1486304829),
    (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    (bytes([ord("a"), ord("b"), ord("c")]), 479470107),
]


def _random_keys(count: int = 10_000, max_len: int = 200, seed: int = 20240601) -> list[bytes]:
    rng = random.Random(seed)
    keys = [rng.randbytes(rng.randint(0, max_len)) for _ in range(count)]
    # Make sure every tail length and the word-count edges are present.
    keys += [bytes(range(n)) for n in range(0, 17)]
    keys += [b"\xff" * n for n in range(0, 17)]
    return keys


KEYS = _random_keys()
PARTITION_COUNTS = [1, 2, 3, 6, 7, 12, 64, 100, 1000]


@pytest.mark.parametrize(("key", "expected"), JAVA_VECTORS)
def test_java_vectors(key: bytes, expected: int) -> None:
    assert murmur2(key) == expected


@pytest.mark.parametrize(("key", "expected"), JAVA_VECTORS)
def test_partition_uses_to_positive_not_abs(key: bytes, expected: int) -> None:
    for n in PARTITION_COUNTS:
        assert partition_for(key, n) == (expected & 0x7FFFFFFF) % n


def test_result_is_a_signed_32_bit_int() -> None:
    values = [murmur2(k) for k in KEYS]
    assert all(-(2**31) <= v < 2**31 for v in values)
    assert any(v < 0 for v in values) and any(v >= 0 for v in values)


def test_empty_key_is_hashed_not_rejected() -> None:
    # An empty key is a real key (seed ^ 0, no words, no tail), unlike a null key.
    assert murmur2(b"") == 275646681
    assert partition_for(b"", 7) == 275646681 % 7


def test_bytes_like_inputs_agree() -> None:
    for key in KEYS[:500]:
        expected = murmur2(key)
        assert murmur2(bytearray(key)) == expected
        assert murmur2(memoryview(key)) == expected


def test_keys_longer_than_the_precompiled_unpackers(fast_partition_for) -> None:
    kp = pytest.importorskip("kafka.partitioner.default")
    rng = random.Random(5)
    for n in (255, 256, 257, 259, 260, 1000, 4099, 65536 + 3):
        key = rng.randbytes(n)
        assert murmur2(key) & 0xFFFFFFFF == kp.murmur2(key)
        for partitions in (1, 7, 2**31 - 1):
            assert fast_partition_for(key, partitions) == partition_for(key, partitions)
            assert fast_partition_for(memoryview(key), partitions) == partition_for(key, partitions)


def test_partition_count_must_be_positive(fast_partition_for) -> None:
    for bad in (0, -1):
        for function in (partition_for, fast_partition_for):
            with pytest.raises(ValueError, match=f"^partition count must be positive, got {bad}$"):
                function(b"k", bad)


def test_matches_kafka_python_on_random_keys() -> None:
    kp = pytest.importorskip("kafka.partitioner.default")
    for i, key in enumerate(KEYS):
        theirs = kp.murmur2(key)  # unsigned 32-bit int of the same bits
        assert murmur2(key) & 0xFFFFFFFF == theirs, key
        n = PARTITION_COUNTS[i % len(PARTITION_COUNTS)]
        assert partition_for(key, n) == (theirs & 0x7FFFFFFF) % n, (key, n)


def test_matches_confluent_kafka_on_random_keys(fast_partition_for) -> None:
    from confluent_kafka import murmur2 as hash_partition

    for i, key in enumerate(KEYS):
        positive = murmur2(key) & 0x7FFFFFFF
        for n in PARTITION_COUNTS:
            assert hash_partition(key, n) == positive % n, (key, n)
        n = PARTITION_COUNTS[i % len(PARTITION_COUNTS)]
        assert partition_for(key, n) == hash_partition(key, n), (key, n)
        assert fast_partition_for(key, n) == partition_for(key, n), (key, n)
