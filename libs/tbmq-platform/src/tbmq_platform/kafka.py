"""Kafka client factories and topic creation.

Producers are idempotent with acks=all: a record that a producer reports as sent is on every in-sync
replica and is never duplicated by the producer's own retries. Consumers never auto-commit: each service
commits offsets itself once the work they cover is durable.

Every client made here (make_producer, make_consumer, make_admin) carries the process's Kafka security
settings (`KafkaSecurity`: KAFKA_SECURITY_PROTOCOL, KAFKA_SASL_*, KAFKA_SSL_CAFILE), installed once at
start-up by `configure_security` (tbmq_platform.lifecycle.run; the router's main).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass

import aiokafka
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import GroupIdNotFound, KafkaConnectionError, TopicAlreadyExistsError, UnknownMemberIdError
from aiokafka.partitioner import murmur2
from aiokafka.producer.transaction_manager import NO_PRODUCER_EPOCH, NO_PRODUCER_ID, PidAndEpoch
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Int16, Int32, Schema, String

from .topics import TopicLayout, TopicSpec

log = logging.getLogger(__name__)

# The aiokafka releases whose internals the suite writes or calls (checked at start-up: check_direct_send,
# tbmq_platform.coalesce); requirements.lock pins one of them.
CHECKED_AIOKAFKA = ("0.14.",)

# The long-poll of a consumer that is woken by data: an idle fetch waits this long at the broker for a
# record, and returns as soon as one is there (min bytes 1), so the value costs no latency; it sets how often
# an idle consumer asks (the broker's default fetch wait, 500 ms, made every idle consumer fetch twice a
# second). Used by the compacted views, the connector's control consumer and the idle window of every
# adaptive fetch (tbmq_platform.coalesce). Not for a consumer that seeks while it has nothing to read: a
# seek waits for the parked fetch to return before the next fetch is sent (aiokafka: one per broker).
IDLE_FETCH_WAIT_MS = 5000
LONG_POLL_GROUP_TICK_MS = 1000


@dataclass(frozen=True)
class KafkaSecurity:
    """How the clients authenticate to Kafka and protect the connection (CommonSettings.kafka_security)."""

    protocol: str = "PLAINTEXT"  # PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL
    sasl_mechanism: str = "PLAIN"  # PLAIN, SCRAM-SHA-256, SCRAM-SHA-512
    username: str = ""
    password: str = ""
    cafile: str = ""  # CA of the brokers' certificates (SSL, SASL_SSL); empty = the system's

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol.endswith("SSL")

    def ssl_context(self):
        from aiokafka.helpers import create_ssl_context

        return create_ssl_context(cafile=self.cafile or None) if self.tls else None

    def client_config(self) -> dict:
        """The aiokafka client arguments (producer, consumer and admin take the same ones)."""
        if self.protocol == "PLAINTEXT":
            return {}
        cfg: dict = {"security_protocol": self.protocol}
        if self.sasl:
            cfg.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.username,
                       sasl_plain_password=self.password)
        if self.tls:
            cfg["ssl_context"] = self.ssl_context()
        return cfg


_security = KafkaSecurity()


def configure_security(security: KafkaSecurity) -> None:
    """Install the security settings every client made from now on carries (once, at start-up)."""
    global _security
    _security = security


def client_config(**extra) -> dict:
    """The installed security settings, then `extra` (a caller's own arguments win)."""
    return {**_security.client_config(), **extra}


class KeyPartitioner:
    """Kafka's default key partitioning — murmur2 of the key, masked positive, modulo the partition count,
    as the Java client and aiokafka's DefaultPartitioner do — with each key's hash cached (the same MQTT
    topics and client ids come back again and again, and aiokafka's murmur2 is pure Python) and no hashing
    at all for a topic of one partition. Records without a key go to a random available partition.

    Called by aiokafka as ``partitioner(key, all_partitions, available)`` (``make_producer`` installs one);
    ``hash(key)`` serves code that picks partitions itself (the router)."""

    __slots__ = ("_hashes", "max_keys")

    def __init__(self, max_keys: int = 200_000) -> None:
        self._hashes: dict[bytes, int] = {}
        self.max_keys = max_keys

    def hash(self, key: bytes) -> int:
        h = self._hashes.get(key)
        if h is None:
            if len(self._hashes) >= self.max_keys:
                self._hashes.clear()
            h = self._hashes[key] = murmur2(key) & 0x7FFFFFFF
        return h

    def __call__(self, key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
        if len(all_partitions) == 1:
            return all_partitions[0]
        if key is None:
            return random.choice(available or all_partitions)
        return all_partitions[self.hash(key) % len(all_partitions)]


def key_partition(hash_: int, partitions: list) -> object:
    """The partition (an entry of `partitions`, the topic's partitions in the order aiokafka lists them) of a
    key whose KeyPartitioner hash is `hash_`: Kafka's default key partitioning."""
    return partitions[0] if len(partitions) == 1 else partitions[hash_ % len(partitions)]


def check_direct_send(producer) -> None:
    """The aiokafka internals DirectSend calls exist (MessageAccumulator.add_message, the producer's
    metadata, request timeout, max request size and transaction manager, as in CHECKED_AIOKAFKA)."""
    acc = getattr(producer, "_message_accumulator", None)
    if not aiokafka.__version__.startswith(CHECKED_AIOKAFKA) or not callable(getattr(acc, "add_message", None)) \
            or not callable(getattr(getattr(producer, "_metadata", None), "add_listener", None)) \
            or not all(isinstance(getattr(producer, a, None), int) for a in ("_request_timeout_ms", "_max_request_size")) \
            or not hasattr(producer, "_txn_manager"):
        raise RuntimeError(f"aiokafka {aiokafka.__version__}: DirectSend needs AIOKafkaProducer._message_accumulator"
                           f".add_message, _metadata, _request_timeout_ms, _max_request_size and _txn_manager as in "
                           f"{CHECKED_AIOKAFKA} (requirements.lock)")


# What a one-record batch adds to its key, value and headers at most (DefaultRecordBatchBuilder: the batch
# header, 61 bytes, the record's overhead, 21, and the length varints), with room to spare.
_RECORD_OVERHEAD_BOUND = 256


class DirectSend:
    """aiokafka's ``producer.send(topic, value, key=key, headers=headers)`` for a hot path: the same record
    in the same open batch of the same partition, and the same delivery future, without the work ``send``
    repeats per record for topics it already knows: a metadata wait, the partition sets built twice from the
    metadata (``_partition``), the size estimate, a debug log (docs/performance.md, "The thirty-sixth round").

    ``await direct(topic, value, key, headers)`` returns the record's delivery future (``send``'s). The
    partition is Kafka's default key partitioning (``key_partition`` with KeyPartitioner's cached hashes),
    over the partitions the producer's metadata lists for the topic; the list is cached per topic and dropped
    at every metadata update (a topic given more partitions is seen at the next update, as ``send`` sees it).
    A record goes through ``send`` itself (its waits, its errors) when the metadata does not list the topic
    yet (``send`` waits for it), when it has no key (a random available partition), when it may come near
    the producer's ``max_request_size`` (``send`` raises MessageSizeTooLargeError), and for a transactional
    producer outside a transaction (``send`` raises IllegalOperation). Call once the producer is started."""

    __slots__ = ("_add", "_bound", "_keys", "_parts", "_send", "_timeout", "_txn", "_metadata")

    def __init__(self, producer: AIOKafkaProducer, keys: KeyPartitioner | None = None) -> None:
        check_direct_send(producer)
        self._send = producer.send
        self._add = producer._message_accumulator.add_message
        self._timeout = producer._request_timeout_ms / 1000
        self._bound = producer._max_request_size - _RECORD_OVERHEAD_BOUND
        txn = producer._txn_manager
        self._txn = txn if txn is not None and txn.transactional_id is not None else None
        self._keys = keys or KeyPartitioner()
        self._parts: dict[str, list[TopicPartition]] = {}  # topic -> its partitions, as aiokafka lists them
        self._metadata = producer._metadata
        self._metadata.add_listener(self._metadata_updated)

    def _metadata_updated(self, _cluster) -> None:
        self._parts.clear()

    def partitions(self, topic: str) -> list[TopicPartition] | None:
        """The topic's partitions in the order aiokafka's partitioner sees them (None: not in the metadata)."""
        parts = self._parts.get(topic)
        if parts is None:
            ids = self._metadata.partitions_for_topic(topic)
            if not ids:
                return None
            parts = self._parts[topic] = [TopicPartition(topic, p) for p in list(ids)]
        return parts

    def __call__(self, topic: str, value: bytes, key: bytes | None, headers=None):
        parts = self._parts.get(topic) or self.partitions(topic)
        if parts is None or key is None or value is None or (self._txn is not None
                                                             and not self._txn.is_in_transaction()):
            return self._send(topic, value, key=key, headers=headers)
        size = len(value) + len(key)
        if headers:
            for k, v in headers:  # a str key: at most 4 bytes a character in UTF-8; the varints
                size += 4 * len(k) + len(v or b"") + 10
        if size > self._bound:
            return self._send(topic, value, key=key, headers=headers)
        return self._add(key_partition(self._keys.hash(key), parts), key, value, self._timeout, None,
                         headers or [])

    def close(self) -> None:
        """Stop following the producer's metadata."""
        self._metadata.remove_listener(self._metadata_updated)


def check_sequence_repair(producer) -> None:
    """The aiokafka internals repair_sequence_gaps replaces or resets exist (as in CHECKED_AIOKAFKA)."""
    acc, txn = getattr(producer, "_message_accumulator", None), getattr(producer, "_txn_manager", None)
    if not aiokafka.__version__.startswith(CHECKED_AIOKAFKA) or not callable(getattr(acc, "_pop_batch", None)) \
            or txn is None or not all(hasattr(txn, a) for a in ("_pid_and_epoch", "_pid_waiter", "_sequence_numbers")):
        raise RuntimeError(f"aiokafka {aiokafka.__version__}: repair_sequence_gaps needs MessageAccumulator._pop_batch "
                           f"and TransactionManager._pid_and_epoch, _pid_waiter and _sequence_numbers as in "
                           f"{CHECKED_AIOKAFKA} (requirements.lock)")


def repair_sequence_gaps(producer: AIOKafkaProducer) -> AIOKafkaProducer:
    """An idempotent, non-transactional producer takes a new producer id after a batch that had its sequence
    numbers failed (what Kafka's Java producer does: it resets its producer id). Returns the producer.

    aiokafka gives a batch its sequence numbers when it drains it; if that batch then fails (the broker refuses
    it, or it expires while its partition has no leader: a Kafka restart longer than request_timeout_ms), the
    numbers are spent, the broker never wrote them, and it refuses every later batch of the producer with
    OutOfOrderSequenceNumber, for good: a connector never got a PUBACK from Kafka again until it was restarted
    (found by tests/e2e/durability/test_supervision.py on a slow host). Here each batch drained for the first time
    gets a callback (one per batch, not per record); when it fails while the producer still has the id it was
    sent with, the id and the sequence numbers are dropped, and aiokafka's sender asks for a new id
    (InitProducerId) before it drains the next batch. Batches already in flight with the old id may fail too
    (OutOfOrderSequenceNumber): their records were never written, and their senders see the error (a PUBLISH
    gets no PUBACK), as with the first failure. Nothing written is duplicated: a new id starts a new sequence
    for new batches only. A transactional producer is left alone (its owner drops it after a failed
    transaction, session_registry.service)."""
    txn = producer._txn_manager
    if txn is None or txn.transactional_id is not None:
        return producer
    check_sequence_repair(producer)
    acc = producer._message_accumulator
    pop_batch = acc._pop_batch

    def failed(fut: asyncio.Future, pid: int) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if exc is None or txn.producer_id != pid:
            return
        log.warning("producer %s: a batch with sequence numbers failed (%r); taking a new producer id",
                    producer.client._client_id, exc)
        txn._pid_and_epoch = PidAndEpoch(NO_PRODUCER_ID, NO_PRODUCER_EPOCH)
        txn._pid_waiter = asyncio.get_running_loop().create_future()
        txn._sequence_numbers.clear()

    def pop_and_watch(tp):
        batch = pop_batch(tp)
        if batch.retry_count == 1:  # drained for the first time: it has just got its sequence numbers
            batch.future.add_done_callback(functools.partial(failed, pid=txn.producer_id))
        return batch

    acc._pop_batch = pop_and_watch
    return producer


def make_producer(bootstrap: str, *, client_id: str, transactional_id: str | None = None,
                  linger_ms: int = 1, max_batch_size: int = 256 * 1024, **extra) -> AIOKafkaProducer:
    """An idempotent acks=all producer. ``linger_ms`` is short: records also batch while the previous
    request to the broker is in flight (aiokafka keeps one per broker), so batches grow with the load
    while a quiet producer adds at most this much latency. A failed batch does not stop it for good
    (repair_sequence_gaps)."""
    extra.setdefault("partitioner", KeyPartitioner())
    return repair_sequence_gaps(AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        client_id=client_id,
        acks="all",
        enable_idempotence=True,
        transactional_id=transactional_id,
        linger_ms=linger_ms,
        max_batch_size=max_batch_size,
        request_timeout_ms=30000,
        **client_config(**extra),
    ))


def make_consumer(bootstrap: str, *topics: str, group_id: str | None, client_id: str,
                  auto_offset_reset: str = "earliest", read_committed: bool = False,
                  max_poll_records: int = 2000, long_poll: bool = False, **extra) -> AIOKafkaConsumer:
    """A consumer that never auto-commits. `long_poll`: a consumer woken by data (IDLE_FETCH_WAIT_MS): its
    idle fetch waits that long at the broker, and aiokafka's fetch loop, which otherwise wakes every
    200 ms (`consumer_timeout_ms`) to look for work, wakes on its events only (a fetch answered, records
    consumed, a seek, an assignment), with a 1 s bound for a group member (how soon it notices a
    rebalance) and IDLE_FETCH_WAIT_MS for a consumer without a group."""
    if long_poll:
        extra.setdefault("fetch_max_wait_ms", IDLE_FETCH_WAIT_MS)
        extra.setdefault("consumer_timeout_ms", IDLE_FETCH_WAIT_MS if group_id is None else LONG_POLL_GROUP_TICK_MS)
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        group_id=group_id,
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset=auto_offset_reset,
        isolation_level="read_committed" if read_committed else "read_uncommitted",
        max_poll_records=max_poll_records,
        **client_config(**extra),
    )


def make_admin(bootstrap: str, **extra) -> AIOKafkaAdminClient:
    """An admin client (with the installed security settings)."""
    return AIOKafkaAdminClient(bootstrap_servers=bootstrap, **client_config(**extra))


async def topic_partitions(consumer: AIOKafkaConsumer, topic: str, *, attempts: int = 100,
                           interval_s: float = 0.1) -> list[TopicPartition]:
    """Every partition of `topic`, sorted, once the consumer's metadata knows it (a topic created a moment
    ago by another process may take a few refreshes to appear). RuntimeError when it never does."""
    for _ in range(attempts):
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return [TopicPartition(topic, p) for p in sorted(parts)]
        await consumer._client.force_metadata_update()
        await asyncio.sleep(interval_s)
    raise RuntimeError(f"topic {topic} does not exist")


async def ensure_topics(bootstrap: str, specs: Iterable[TopicSpec], *, layout: TopicLayout = TopicLayout(),
                        timeout_s: float = 60.0) -> list[str]:
    """Create the topics that do not exist yet, with the catalogue's settings, the partition counts of
    `layout.profile` (TBMQ_TOPIC_PROFILE) and its replication factor and min.insync.replicas. Returns the
    created names.

    Idempotent: an existing topic is left as it is (TopicAlreadyExists is not an error).

    Returns only once the broker serves every topic it had to create in its metadata. Kafka answers
    CreateTopics when its controller has committed the topics; a broker's metadata cache takes them in a
    moment later, and a consumer that subscribes in between (app-delivery's shared streams, right after this)
    is told "not found in cluster metadata", joins its group with no partition of the topic, and learns of them
    only at its next periodic metadata refresh (metadata.max.age.ms, 5 minutes): a CI run on a slow host saw
    exactly that. A topic another process created a moment ago is waited for the same way.
    """
    specs = list(specs)
    admin = await _admin(bootstrap, timeout_s)
    try:
        existing = set(await admin.list_topics())
        todo = [s for s in specs if s.name not in existing]
        if not todo:
            return []
        new = [NewTopic(name=s.name, num_partitions=s.partitions_in(layout.profile),
                        replication_factor=layout.replication_factor, topic_configs=s.configs(layout))
               for s in todo]
        created = []
        try:
            response = await admin.create_topics(new)
            for name, code, *_ in getattr(response, "topic_errors", ()):
                if code == 0:
                    created.append(name)
                elif code != TopicAlreadyExistsError.errno:
                    raise RuntimeError(f"creating topic {name} failed with Kafka error {code}")
        except TopicAlreadyExistsError:
            pass
        if created:
            log.info("created topics %s", ", ".join(created))
        await _until_served(admin, [t.name for t in todo], timeout_s)
        return created
    finally:
        await admin.close()


async def _until_served(admin: AIOKafkaAdminClient, names: list[str], timeout_s: float) -> None:
    """Return once a metadata request names every topic of `names` with its partitions (ensure_topics);
    RuntimeError naming the missing ones after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline, backoff = loop.time() + timeout_s, 0.005
    while True:
        served = {t["topic"] for t in await admin.describe_topics(names)
                  if t.get("error_code") == 0 and t.get("partitions")}
        missing = [n for n in names if n not in served]
        if not missing:
            return
        if loop.time() > deadline:
            raise RuntimeError(f"topics created but not in the broker's metadata after {timeout_s:g} s: "
                               + ", ".join(missing))
        await asyncio.sleep(backoff)  # a retry's backoff (the broker's metadata catches up within milliseconds)
        backoff = min(backoff * 2, 0.2)


async def delete_topics(bootstrap: str, names: Iterable[str], *, timeout_s: float = 30.0) -> None:
    names = list(names)
    if not names:
        return
    admin = await _admin(bootstrap, timeout_s)
    try:
        existing = set(await admin.list_topics())
        names = [n for n in names if n in existing]
        if names:
            await admin.delete_topics(names)
    finally:
        await admin.close()


class _LeaveGroupResponse_v3(Response):
    API_KEY = 13
    API_VERSION = 3
    SCHEMA = Schema(("throttle_time_ms", Int32), ("error_code", Int16),
                    ("members", Array(("member_id", String("utf-8")), ("group_instance_id", String("utf-8")),
                                      ("error_code", Int16))))


class _LeaveGroupRequest_v3(RequestStruct):
    """LeaveGroup v3 (KIP-345): members named by group.instance.id, which aiokafka's own LeaveGroup (v0/v1,
    one member id) cannot say."""
    API_KEY = 13
    API_VERSION = 3
    RESPONSE_TYPE = _LeaveGroupResponse_v3
    SCHEMA = Schema(("group_id", String("utf-8")),
                    ("members", Array(("member_id", String("utf-8")), ("group_instance_id", String("utf-8")))))


class _RemoveStaticMembers(Request[_LeaveGroupRequest_v3]):
    API_KEY = 13

    def __init__(self, group_id: str, instance_ids: list[str]):
        self._group_id = group_id
        self._instance_ids = instance_ids

    def build(self, request_struct_class: type[_LeaveGroupRequest_v3]) -> _LeaveGroupRequest_v3:
        return request_struct_class(self._group_id, [("", i) for i in self._instance_ids])


async def remove_static_members(bootstrap: str, group_id: str, instance_ids: Iterable[str], *,
                                timeout_s: float = 10.0, admin: AIOKafkaAdminClient | None = None) -> list[str]:
    """Take the static members `instance_ids` (group.instance.id, TBMQ_KAFKA_STATIC_MEMBERSHIP) out of
    consumer group `group_id` now, as Kafka's AdminClient.removeMembersFromConsumerGroup does; returns the
    ones that were members.

    A static member does not leave its group when it stops: its partitions wait, up to the session timeout,
    for an instance of the same id to come back (a restart then gets them at once). When the instance is
    not coming back (its deployment was stopped for good), every other member's rebalance waits out that
    timeout instead; this ends the wait. Call it only once the instances have stopped: a running member
    named here is fenced and has to join again. An id that is no member is not an error. `admin`: a started
    admin client of the caller's to send the request with (kept open) instead of one of its own."""
    instance_ids = list(instance_ids)
    if not instance_ids:
        return []
    own = admin is None
    if own:
        admin = await _admin(bootstrap, timeout_s)
    try:
        coordinator = await admin.find_coordinator(group_id)
        response = await admin._send_request_to_node(coordinator, _RemoveStaticMembers(group_id, instance_ids))
        if response.error_code in (UnknownMemberIdError.errno, GroupIdNotFound.errno):  # none of them is a member
            return []
        if response.error_code:
            raise RuntimeError(f"removing members of group {group_id} failed with Kafka error {response.error_code}")
        removed = []
        for _member_id, instance_id, code in response.members:
            if code == 0:
                removed.append(instance_id)
            elif code != UnknownMemberIdError.errno:  # not a member (any more): nothing to remove
                raise RuntimeError(f"removing {instance_id} from group {group_id} failed with Kafka error {code}")
        return removed
    finally:
        if own:
            await admin.close()


async def _admin(bootstrap: str, timeout_s: float) -> AIOKafkaAdminClient:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        admin = make_admin(bootstrap, request_timeout_ms=10000)
        try:
            await admin.start()
            return admin
        except KafkaConnectionError:
            await admin.close()
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.5)
