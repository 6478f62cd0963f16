"""Shared APPLICATION subscriptions: members of one share name split tbmq.msg.app.shared.<filter>, a member
leaving hands its share over without loss, QoS cap and filter check."""

from __future__ import annotations

from collections import defaultdict

import pytest
from tbmq_routing.naming import app_shared_group as shared_group
from app_delivery_harness import payload_ints, publish_msg
from kafka_views import stable_with
from waits import wait_until

pytestmark = pytest.mark.integration


def alnum(unique, prefix: str) -> str:
    return unique(prefix).replace("-", "")[:50]


async def test_three_members_split_the_load_and_one_leaving_hands_over(ad_suite, connector, producer, unique):
    share = alnum(unique, "g")
    base = alnum(unique, "sh")
    topic_filter = f"{base}/+"
    n = 1200
    # m1 acknowledges only even payloads: its odd ones must go to m2/m3 when it leaves
    m1 = connector.open(alnum(unique, "m1"), receive_maximum=1000, shared=[(share, topic_filter, 1)],
                        auto_ack=lambda r: int(r.msg.payload) % 2 == 0)
    m2 = connector.open(alnum(unique, "m2"), receive_maximum=1000, shared=[(share, topic_filter, 1)], auto_ack=True)
    m3 = connector.open(alnum(unique, "m3"), receive_maximum=1000, shared=[(share, topic_filter, 1)], auto_ack=True)
    group = shared_group(share)
    await wait_until(lambda: stable_with(ad_suite.bootstrap_servers, group, 3), 60,
                     "the three members joined and the rebalance done", step=0.2)
    await producer.to_shared(topic_filter, [publish_msg(i, topic=f"{base}/{i}") for i in range(n)],
                             partition_of=lambda i: i % 4)
    members = (m1, m2, m3)
    await wait_until(lambda: set().union(*(payload_ints(m.all) for m in members)) >= set(range(n)), timeout=60,
                     what=lambda: f"all {n} records (got {[len(m.all) for m in members]})")
    counts = [len(set(payload_ints(m.all))) for m in members]
    assert all(c > 0 for c in counts), f"every member gets a share: {counts}"
    # per partition, each member sees its records in offset order
    for m in members:
        per_part = defaultdict(list)
        for r in m.all:
            per_part[r.ref.partition].append(r.ref.offset)
        for offsets in per_part.values():
            assert offsets == sorted(offsets)
    odd_at_m1 = {i for i in payload_ints(m1.all) if i % 2}
    assert odd_at_m1, "m1 holds unacknowledged records"
    await m1.half_close()  # m1 leaves: its partitions go to m2/m3 from its acknowledged prefix
    await wait_until(lambda: odd_at_m1 <= set(payload_ints(m2.all)) | set(payload_ints(m3.all)), timeout=60,
                     what="m1's unacknowledged records handed over")
    redelivered = [r for m in (m2, m3) for r in m.all if int(r.msg.payload) in odd_at_m1]
    assert all(r.redelivery for r in redelivered), "handed-over records that m1 had streamed carry DUP"
    acked = {i for i in payload_ints(m1.all) if i % 2 == 0} | set(payload_ints(m2.all)) | set(payload_ints(m3.all))
    assert acked >= set(range(n))
    # and new records still flow to the two remaining members
    await producer.to_shared(topic_filter, [publish_msg(n + i, topic=f"{base}/x") for i in range(40)],
                             partition_of=lambda i: i % 4)
    await wait_until(lambda: set(payload_ints(m2.all)) | set(payload_ints(m3.all)) >= set(range(n, n + 40)),
                     timeout=30, what="records after the hand-over")
    await m2.cancel()
    await m3.cancel()


async def test_qos_cap_and_foreign_topics_are_skipped(ad_suite, connector, producer, unique):
    share = alnum(unique, "g")
    base = alnum(unique, "q")
    topic_filter = f"{base}/a/+"
    m = connector.open(alnum(unique, "m"), receive_maximum=100, shared=[(share, topic_filter, 0)], auto_ack=True)
    await wait_until(lambda: stable_with(ad_suite.bootstrap_servers, shared_group(share), 1), 60,
                     "the member joined", step=0.2)
    await producer.to_shared(topic_filter, [
        publish_msg(0, topic=f"{base}/a/1", qos=1),
        publish_msg(1, topic=f"{base}/b/1", qos=1),   # a colliding name's copy: not this filter's
        publish_msg(2, topic=f"{base}/a/2", qos=2),
        publish_msg(3, topic=f"{base}/a/3", qos=0),   # marker: the foreign copy would come before it
    ], partition_of=lambda i: 0)
    got = await m.take(3)
    assert payload_ints(got) == [0, 2, 3]
    assert [r.msg.qos for r in got] == [0, 0, 0]
    await m.cancel()
