"""The real Kafka broker of the test session (tests/conftest.py `kafka`): produce/consume, the topic
catalogue's creation and settings, and transactions on one node (the session-registry needs them)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from tbmq_platform import topics as catalogue
from tbmq_platform.kafka import ensure_topics, make_consumer, make_producer, remove_static_members
from waits import poll, wait_until

pytestmark = pytest.mark.integration


async def _admin(bootstrap: str) -> AIOKafkaAdminClient:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await admin.start()
    return admin


async def _topic_configs(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, dict[str, str]]:
    resources = [ConfigResource(ConfigResourceType.TOPIC, n) for n in names]
    out: dict[str, dict[str, str]] = {}
    for resp in await admin.describe_configs(resources):
        for _code, _msg, _type, name, entries in resp.resources:
            out[name] = {e[0]: e[1] for e in entries}
    return out


async def _values(consumer, n: int) -> list[bytes]:
    """The values of the first `n` (or more) records the consumer fetches, in fetch order, within 30 s."""
    values: list[bytes] = []
    async with asyncio.timeout(30):
        while len(values) < n:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                values.extend(r.value for r in records)
    return values


async def test_a_topic_is_in_the_brokers_metadata_once_ensure_topics_returns(kafka, unique):
    """A client asking right after ensure_topics returns is told of the topic and every partition at once, with
    no refresh: a consumer that subscribed in the moment between Kafka's CreateTopics answer and its broker's
    metadata would join its group with no partition and wait out metadata.max.age.ms (5 minutes; a CI run saw
    app-delivery's shared stream do that). Ten topics, each asked about once, the moment it is returned."""
    admin = await _admin(kafka.bootstrap_servers)
    try:
        for i in range(10):
            topic = unique(f"md{i}")
            spec = catalogue.TopicSpec(topic, "k", "bytes", 4, "test", "test")
            assert await ensure_topics(kafka.bootstrap_servers, [spec]) == [topic]
            (md,) = await admin.describe_topics([topic])
            assert (md["topic"], md["error_code"], len(md["partitions"])) == (topic, 0, 4)
    finally:
        await admin.close()


async def test_produce_and_consume_with_the_idempotent_producer(kafka, unique):
    topic = unique("pc")
    spec = catalogue.TopicSpec(topic, "k", "bytes", 3, "test", "test")
    assert await ensure_topics(kafka.bootstrap_servers, [spec]) == [topic]

    producer = make_producer(kafka.bootstrap_servers, client_id=unique("p"))
    await producer.start()
    try:
        sent = [await producer.send_and_wait(topic, key=f"k{i % 3}".encode(), value=f"v{i}".encode(),
                                             headers=[("traceparent", b"00-x")])
                for i in range(30)]
    finally:
        await producer.stop()
    assert {m.partition for m in sent} <= {0, 1, 2}

    consumer = make_consumer(kafka.bootstrap_servers, topic, group_id=unique("g"), client_id=unique("c"))
    await consumer.start()
    got = []
    try:
        async with asyncio.timeout(30):
            while len(got) < 30:
                batch = await consumer.getmany(timeout_ms=1000)
                for records in batch.values():
                    got.extend(records)
        await consumer.commit()
    finally:
        await consumer.stop()
    assert sorted(r.value for r in got) == sorted(f"v{i}".encode() for i in range(30))
    assert all(dict(r.headers)["traceparent"] == b"00-x" for r in got)
    # per key, order is kept
    by_key: dict[bytes, list[int]] = {}
    for r in sorted(got, key=lambda r: (r.partition, r.offset)):
        by_key.setdefault(r.key, []).append(int(r.value[1:]))
    assert all(v == sorted(v) for v in by_key.values())


async def test_a_batch_the_broker_refuses_does_not_stop_the_idempotent_producer(kafka, unique):
    """A batch that got its sequence numbers and then failed (here refused by the broker: larger than the topic's
    max.message.bytes; in CI, a batch expired while Kafka restarted and its partition had no leader) leaves a gap in
    the producer's sequence. aiokafka 0.14 then sent every later batch with the next numbers and the broker refused
    each one with OutOfOrderSequenceNumber, for good: a connector never again got a PUBACK from Kafka until it was
    restarted. The producers of make_producer take a new producer id after such a failure
    (tbmq_platform.kafka.repair_sequence_gaps), so the next records are written, in order, once each."""
    from aiokafka.admin import NewTopic
    from aiokafka.errors import KafkaError

    topic = unique("gap")
    admin = await _admin(kafka.bootstrap_servers)
    try:
        await admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"max.message.bytes": "1000"})])
    finally:
        await admin.close()
    producer = make_producer(kafka.bootstrap_servers, client_id=unique("p"))
    await producer.start()
    try:
        first = await asyncio.wait_for(producer.send_and_wait(topic, key=b"k", value=b"before"), 30)
        with pytest.raises(KafkaError):
            await producer.send_and_wait(topic, key=b"k", value=b"x" * 5000)
        after = [await asyncio.wait_for(producer.send_and_wait(topic, key=b"k", value=f"after{i}".encode()), 30)
                 for i in range(3)]
    finally:
        await producer.stop()
    assert [m.offset for m in after] == [first.offset + 1, first.offset + 2, first.offset + 3]
    consumer = make_consumer(kafka.bootstrap_servers, topic, group_id=None, client_id=unique("c"))
    await consumer.start()
    try:
        got = await _values(consumer, 4)
    finally:
        await consumer.stop()
    assert got == [b"before", b"after0", b"after1", b"after2"]


async def test_catalogue_topics_are_created_idempotently_with_their_settings(kafka):
    specs = catalogue.static_topics() + catalogue.service_topics("connector-kt1")
    await ensure_topics(kafka.bootstrap_servers, specs)
    assert await ensure_topics(kafka.bootstrap_servers, specs) == []  # second run: nothing to do

    admin = await _admin(kafka.bootstrap_servers)
    try:
        names = [s.name for s in specs]
        described = {t["topic"]: t for t in await admin.describe_topics(names)}
        configs = await _topic_configs(admin, names)
    finally:
        await admin.close()
    for s in specs:
        assert described[s.name]["error_code"] == 0, s.name
        assert len(described[s.name]["partitions"]) == s.partitions, s.name
        cfg = configs[s.name]
        assert cfg["cleanup.policy"] == ("compact" if s.compact else "delete"), s.name
        if not s.compact and s.retention_ms is not None:
            assert cfg["retention.ms"] == str(s.retention_ms), s.name
        if not s.compact and s.retention_bytes is not None:
            assert cfg["retention.bytes"] == str(s.retention_bytes), s.name
    assert any(s.compact for s in specs)


async def test_transactions_work_on_the_single_node(kafka, unique):
    topic = unique("tx")
    await ensure_topics(kafka.bootstrap_servers, [catalogue.TopicSpec(topic, "k", "bytes", 1, "t", "t")])
    producer = make_producer(kafka.bootstrap_servers, client_id=unique("p"), transactional_id=unique("tid"))
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(topic, key=b"a", value=b"committed")
        await producer.begin_transaction()
        await producer.send_and_wait(topic, key=b"a", value=b"aborted")
        await producer.abort_transaction()
        async with producer.transaction():
            await producer.send_and_wait(topic, key=b"a", value=b"committed-2")
    finally:
        await producer.stop()

    consumer = make_consumer(kafka.bootstrap_servers, group_id=None, client_id=unique("c"),
                             read_committed=True)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        values = await _values(consumer, 2)
    finally:
        await consumer.stop()
    assert values == [b"committed", b"committed-2"]


async def test_a_restart_on_a_formatted_log_dir_skips_the_format_tool_and_keeps_the_data(tmp_path, unique):
    """The supervisor's restart (and make run on a kept dir): no StorageTool JVM when meta.properties is
    there, the same cluster id, and what was acknowledged before the restart is read after it."""
    from tbmq_launcher.kafka import KafkaBroker
    from tbmq_launcher.redis import find_free_port

    broker = KafkaBroker(port=find_free_port(), controller_port=find_free_port(), workdir=tmp_path / "kafka",
                         heap="256m", cds=False)
    topic = unique("restart")
    await broker.start()
    try:
        first_id = broker.cluster_id
        await ensure_topics(broker.bootstrap_servers, [catalogue.TopicSpec(topic, "k", "bytes", 1, "test", "test")])
        producer = make_producer(broker.bootstrap_servers, client_id=unique("p"))
        await producer.start()
        try:
            await producer.send_and_wait(topic, key=b"k", value=b"before the restart")
        finally:
            await producer.stop()
    finally:
        await broker.stop(timeout=10)

    await broker.start()
    try:
        consumer = make_consumer(broker.bootstrap_servers, group_id=None, client_id=unique("c"))
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, 0)])
            await consumer.seek_to_beginning(TopicPartition(topic, 0))
            async with asyncio.timeout(30):
                got = []
                while not got:
                    for records in (await consumer.getmany(timeout_ms=1000)).values():
                        got.extend(r.value for r in records)
        finally:
            await consumer.stop()
    finally:
        await broker.stop(timeout=10)
    log = broker.log_path.read_text(errors="replace")
    assert log.count("--- StorageTool format ---") == 1
    assert log.count("--- StorageTool format: skipped, the log dir is formatted") == 1
    assert broker.cluster_id == first_id
    assert got == [b"before the restart"]


async def test_a_stopped_static_member_taken_out_of_its_group_hands_its_partitions_over_at_once(kafka, unique):
    """A static member (group.instance.id) that stops keeps its partitions until its session times out: a
    new member with another id gets nothing meanwhile. remove_static_members ends that wait: the new member is
    given every partition at once, far inside the old member's 45 s session. Removing it again, or from a
    group that does not exist, removes nothing and is no error."""
    topic, group = unique("t"), unique("g")
    await ensure_topics(kafka.bootstrap_servers, [catalogue.TopicSpec(topic, "k", "bytes", 4, "t", "t")])
    every = {TopicPartition(topic, p) for p in range(4)}

    def member(instance_id: str):
        return make_consumer(kafka.bootstrap_servers, topic, group_id=group, client_id=instance_id,
                             group_instance_id=instance_id, session_timeout_ms=45000, heartbeat_interval_ms=3000,
                             rebalance_timeout_ms=60000, request_timeout_ms=70000)

    old = member("old-1")
    await old.start()
    try:
        await wait_until(lambda: old.assignment() == every, 30, "the first member owns every partition")
    finally:
        await old.stop()  # a static member: no LeaveGroup

    new = member("new-1")
    joining = asyncio.create_task(new.start())  # start() returns once the member has joined its group
    try:
        assert not await poll(joining.done, 3), "the new member joined while the old one held its partitions"
        assert await remove_static_members(kafka.bootstrap_servers, group, ["old-1", "never-1"]) == ["old-1"]
        await asyncio.wait_for(joining, 10)
        await wait_until(lambda: new.assignment() == every, 10, "the new member owns every partition")
        assert await remove_static_members(kafka.bootstrap_servers, group, ["old-1"]) == []
        assert await remove_static_members(kafka.bootstrap_servers, unique("nogroup"), ["old-1"]) == []
    finally:
        joining.cancel()
        await new.stop()
