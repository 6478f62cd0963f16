"""tbmq_platform.metrics without a service: sources read at scrape time (nothing per message), labels, a broken
source isolated, histograms, the process collector; parsed back with prometheus-client's parser."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tbmq_platform.metrics import Metrics

pytestmark = pytest.mark.unit


def parse(text: bytes) -> dict:
    return {s.name + str(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


async def test_sources_are_read_when_scraped():
    m = Metrics()
    stats = Counter()
    m.counters_by("messages_received", "doc", stats, "qos", {"0": "in_q0", "1": "in_q1"})
    m.gauge("connections", "doc", lambda: len(conns))
    conns = ["a", "b"]

    async def lag():
        return {("g", "t", "0"): 7}

    m.gauge("consumer_lag", "doc", lag, ("group", "topic", "partition"))
    m.gauge("broken", "doc", lambda: 1 / 0)
    h = m.histogram("redis_call", "doc", ("script",))
    h.labels("save").observe(0.002)
    stats["in_q1"] += 3
    got = parse(await m.exposition())
    assert got["tbmq_messages_received_total[('qos', '1')]"] == 3
    assert got["tbmq_messages_received_total[('qos', '0')]"] == 0
    assert got["tbmq_connections[]"] == 2
    assert got["tbmq_consumer_lag[('group', 'g'), ('partition', '0'), ('topic', 't')]"] == 7
    assert got["tbmq_redis_call_seconds_count[('script', 'save')]"] == 1
    assert not any(k.startswith("tbmq_broken") for k in got)  # a broken source is left out, the rest stays
    assert any(k.startswith("process_cpu_seconds_total") for k in got)
    stats["in_q1"] += 2  # counted between scrapes: the next scrape sees it
    conns.append("c")
    got = parse(await m.exposition())
    assert got["tbmq_messages_received_total[('qos', '1')]"] == 5 and got["tbmq_connections[]"] == 3


class FakeConsumer:
    """What `Metrics.lag` reads of an aiokafka consumer."""

    def __init__(self, topic: str, high: int, pos: int):
        from aiokafka.structs import TopicPartition
        self.tp, self.high, self.pos = TopicPartition(topic, 0), high, pos

    def assignment(self):
        return {self.tp}

    def highwater(self, tp):
        return self.high

    async def position(self, tp):
        return self.pos


async def test_two_lags_of_one_name_are_one_metric_with_both_groups():
    # a router running device-persistence registers both services' consumer lag under one name
    m = Metrics()
    m.lag("consumer_lag", lambda: [("router", FakeConsumer("tbmq.msg.all", 10, 4))])
    m.lag("consumer_lag", lambda: [("device-persistence", FakeConsumer("tbmq.msg.persisted", 3, 3))])
    text = (await m.exposition()).decode()
    assert text.count("# TYPE tbmq_consumer_lag gauge") == 1
    got = parse(text.encode())
    assert got["tbmq_consumer_lag[('group', 'router'), ('partition', '0'), ('topic', 'tbmq.msg.all')]"] == 6
    assert got["tbmq_consumer_lag[('group', 'device-persistence'), ('partition', '0'), "
               "('topic', 'tbmq.msg.persisted')]"] == 0
