"""Kafka's default key partitioning as every producer of the suite applies it (tbmq_platform.kafka): the
KeyPartitioner aiokafka calls and `key_partition`, which DirectSend (the connector's PUBLISH records, the
router's sends) applies itself, put every key where aiokafka's DefaultPartitioner (murmur2, as the Java
client) puts it."""

from __future__ import annotations

import pytest
from aiokafka.partitioner import DefaultPartitioner

from tbmq_platform.kafka import KeyPartitioner, key_partition

pytestmark = pytest.mark.unit

KEYS = (b"", b"a", b"x/y/z", "клієнт".encode(), bytes(range(40)))


@pytest.mark.parametrize("n", [1, 3, 16])
def test_key_partitions_are_aiokafkas_default_partitioner(n):
    default = DefaultPartitioner()
    keys = KeyPartitioner()
    parts = list(range(n))
    for key in KEYS:
        expected = default(key, parts, parts)
        assert key_partition(keys.hash(key), parts) == expected
        assert key_partition(keys.hash(key), parts) == expected  # cached
        assert keys(key, parts, parts) == expected
        assert keys(key, parts, parts) == expected  # cached


def test_key_partition_picks_from_the_list_it_is_given():
    # DirectSend hands it the topic's TopicPartitions: the entry at the default partitioner's index
    keys = KeyPartitioner()
    tps = [("t", p) for p in range(16)]
    for key in KEYS:
        assert key_partition(keys.hash(key), tps) == ("t", DefaultPartitioner()(key, list(range(16)), []))
    assert key_partition(keys.hash(b"anything"), [("t", 0)]) == ("t", 0)


def test_a_record_without_a_key_goes_to_an_available_partition_and_the_cache_stays_bounded():
    default = DefaultPartitioner()
    assert KeyPartitioner()(None, [0, 1, 2], [2]) == 2
    small = KeyPartitioner(max_keys=2)
    for key in (b"a", b"b", b"c", b"a"):
        assert small(key, [0, 1, 2], []) == default(key, [0, 1, 2], [])
    assert len(small._hashes) <= 2
