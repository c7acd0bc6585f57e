"""Kafka's default key partitioner (Java `Utils.murmur2`), bit for bit.

Per-key order only holds if every writer puts a key on the same partition:
the daemon (kafka-python), confluent-kafka (partitioner=murmur2_random) and any
Java client. So the hash is Kafka's murmur2 exactly, including Java's signed
32-bit result, and the partition is `toPositive(murmur2(key)) % partitions`.

Runs once per record: the body works on whole 4-byte words unpacked by a
precompiled struct, with arithmetic masked to 32 bits; there is no per-byte
Python loop.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from types import ModuleType
from typing import Any

from cdc import accel

__all__ = ["fast_partition_for", "murmur2", "partition_for"]

_SEED = 0x9747B28C  # m = 0x5BD1E995 and r = 24 are written inline: constants beat globals

# Unpackers for n little-endian uint32 words, built once for common key sizes
# (up to 256 bytes); longer keys fall back to struct's own format cache.
_WORDS: list[Callable[[Any], tuple[int, ...]]] = [
    struct.Struct(f"<{n}I").unpack_from for n in range(65)
]


def _hash32(data: bytes, _words=_WORDS, _from_bytes=int.from_bytes) -> int:
    """Kafka's murmur2 as an unsigned 32-bit int (the bits Java's int holds)."""
    n = len(data)
    h = _SEED ^ n  # Java: seed ^ length, both ints; n < 2**31 keeps it in 32 bits
    nwords = n >> 2
    if nwords:
        unpack = _words[nwords] if nwords < 65 else struct.Struct(f"<{nwords}I").unpack_from
        for k in unpack(data):
            k = (k * 0x5BD1E995) & 0xFFFFFFFF
            # k ^= k >>> 24; k *= m; h *= m; h ^= k  (h*m masked after the xor)
            h = ((h * 0x5BD1E995) ^ (((k ^ (k >> 24)) * 0x5BD1E995) & 0xFFFFFFFF)) & 0xFFFFFFFF
    tail = n & 3
    if tail:
        # Java's fall-through switch xors the last 1-3 bytes in little-endian order.
        h = ((h ^ _from_bytes(data[n - tail :], "little")) * 0x5BD1E995) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0x5BD1E995) & 0xFFFFFFFF
    return h ^ (h >> 15)


def murmur2(data: bytes) -> int:
    """Kafka's `Utils.murmur2(data)`: the signed 32-bit int Java returns."""
    h = _hash32(data)
    return h - 0x100000000 if h & 0x80000000 else h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner picks for a non-null key.

    `toPositive(murmur2(key)) % partitions`, where toPositive is `x & 0x7fffffff`
    (not abs(): abs(MIN_VALUE) would stay negative in Java).
    """
    if partitions <= 0:
        raise ValueError(f"partition count must be positive, got {partitions}")
    return (_hash32(key) & 0x7FFFFFFF) % partitions


#: `partition_for` in C (cdc/_speedups.c) when the accelerator is selected: it runs once per
#: record. Rebound by the switch: look it up as `partitioner.fast_partition_for`.
fast_partition_for: Callable[[bytes, int], int] = partition_for


def _bind_accel(native: ModuleType | None) -> None:
    global fast_partition_for
    fast_partition_for = partition_for if native is None else native.partition_for


accel.bind(_bind_accel)
