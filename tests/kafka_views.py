"""What the services acknowledge through Kafka, as the tests observe it instead of pausing: the session table
(tbmq.client.session), a consumer group's committed offsets and its membership.

`tests/` is on sys.path (tests/conftest.py), so integration and end-to-end tests import it as `kafka_views`.
Wait on these with `waits.wait_until` (tests/waits.py)."""

from __future__ import annotations

import uuid

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_platform.compacted import CompactedTopicView
from tbmq_platform.kafka import ensure_topics


class SessionTable:
    """tbmq.client.session as a dict (read_committed), to check what the registry saved: a client id maps to
    its SessionInfo, or to None once the record was removed (absent: never seen)."""

    def __init__(self, bootstrap: str):
        self.bootstrap = bootstrap
        self.sessions: dict[str, pb.SessionInfo | None] = {}
        self.updates: dict[str, int] = {}  # records applied per client id (a change since a count)
        self.view = CompactedTopicView(bootstrap, topics.CLIENT_SESSION, self._apply,
                                       client_id=f"table-{uuid.uuid4().hex[:6]}", read_committed=True)

    def _apply(self, key, value):
        cid = key.decode()
        self.sessions[cid] = None if value is None else pb.SessionInfo.FromString(value)
        self.updates[cid] = self.updates.get(cid, 0) + 1

    def get(self, cid: str) -> pb.SessionInfo | None:
        return self.sessions.get(cid)

    def offline(self, cid: str) -> bool:
        """The registry recorded the client's disconnect: its session kept and not connected, or removed."""
        if cid not in self.sessions:
            return False
        s = self.sessions[cid]
        return s is None or not s.connected

    def removed(self, cid: str) -> bool:
        """The registry removed the client's session (expired, or ended at the disconnect)."""
        return cid in self.sessions and self.sessions[cid] is None

    async def start(self) -> "SessionTable":
        await ensure_topics(self.bootstrap, topics.static_topics())
        await self.view.start()
        return self

    async def stop(self):
        await self.view.stop()

    async def __aenter__(self) -> "SessionTable":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()


async def committed_metadata(bootstrap: str, group: str) -> dict:
    """What `group` has committed, per partition: OffsetAndMetadata (offset and metadata); empty when the group
    has none or does not exist."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        found = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {tp: om for tp, om in found.items() if om is not None and om.offset >= 0}


async def committed(bootstrap: str, group: str) -> dict[TopicPartition, int]:
    """The offsets `group` has committed, per partition (empty when the group has none or does not exist)."""
    return {tp: om.offset for tp, om in (await committed_metadata(bootstrap, group)).items()}


async def group_members(bootstrap: str, group: str) -> tuple[str, int]:
    """(state, number of members) of a consumer group as its coordinator describes it ("Stable" once a
    rebalance has completed and every member has its assignment)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        responses = await admin.describe_consumer_groups([group])
    finally:
        await admin.close()
    for resp in responses:
        for g in resp.to_object()["groups"]:
            if g["group"] == group:
                return g["state"], len(g["members"])
    return "Dead", 0


async def stable_with(bootstrap: str, group: str, n: int) -> bool:
    """Whether `group` is Stable with exactly `n` members (a predicate for `waits.wait_until`)."""
    return await group_members(bootstrap, group) == ("Stable", n)


async def partitions_of(consumer, topic: str, timeout: float = 10.0) -> set[int]:
    """The partitions of `topic` as an aiokafka consumer learns them (metadata refreshed until it knows the
    topic; fails when it does not within `timeout`)."""
    from waits import wait_until

    async def known():
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            await consumer._client.force_metadata_update()
        return parts

    return await wait_until(known, timeout, f"the partitions of {topic}")
