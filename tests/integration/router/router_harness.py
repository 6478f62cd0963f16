"""Helpers of the router integration tests: write state and publishes as the connector/registry would,
start router instances through the launcher Suite, read output topics with bounded polling."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition

from tbmq.v1 import messages_pb2 as pb
from tbmq_launcher.services import readyz
from tbmq_platform import topics
from tbmq_platform.kafka import make_producer
from waits import wait_until


def hexid() -> str:
    return uuid.uuid4().hex[:10]


class StateWriter:
    """Produces tbmq.client.session / tbmq.client.subscriptions / tbmq.msg.all records."""

    def __init__(self, bootstrap: str):
        self.producer = make_producer(bootstrap, client_id="router-test-writer", linger_ms=1)

    async def start(self):
        await self.producer.start()

    async def stop(self):
        await self.producer.stop()

    async def session(self, client_id: str, *, service_id: str = "", connected: bool = True,
                      app: bool = False, persistent: bool = False) -> None:
        info = pb.SessionInfo(client_id=client_id, service_id=service_id, connected=connected,
                              client_type=pb.CLIENT_TYPE_APPLICATION if app else pb.CLIENT_TYPE_DEVICE,
                              persistent=persistent, clean_start=not persistent)
        await self.producer.send_and_wait(topics.CLIENT_SESSION, info.SerializeToString(), key=client_id.encode())

    async def subscriptions(self, client_id: str, *subs: pb.TopicSubscription, app: bool = False) -> None:
        cs = pb.ClientSubscriptions(client_id=client_id, subscriptions=list(subs),
                                    client_type=pb.CLIENT_TYPE_APPLICATION if app else pb.CLIENT_TYPE_DEVICE)
        await self.producer.send_and_wait(topics.CLIENT_SUBSCRIPTIONS, cs.SerializeToString(),
                                          key=client_id.encode())

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                      publisher: str = "publisher", wait: bool = True, headers=None, **kw):
        msg = pb.PublishMsg(publisher_id=publisher, topic=topic, payload=payload, qos=qos, retain=retain,
                            created_at_ms=kw.pop("created_at_ms", int(time.time() * 1000)),
                            publisher_mqtt_version=5, **kw)
        fut = await self.producer.send(topics.MSG_ALL, msg.SerializeToString(), key=topic.encode(),
                                        headers=headers)
        if wait:
            await fut
        return fut


def sub(topic_filter: str, qos: int = 1, **kw) -> pb.TopicSubscription:
    return pb.TopicSubscription(topic_filter=topic_filter, qos=qos, **kw)


class TopicReader:
    """Reads a topic from the beginning (no group); `records` grows as `poll_until` runs."""

    def __init__(self, bootstrap: str, topic: str):
        self.bootstrap, self.topic = bootstrap, topic
        self.consumer: AIOKafkaConsumer | None = None
        self.records: list = []

    async def _attach(self) -> bool:
        if self.consumer is None:
            self.consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None,
                                             enable_auto_commit=False, auto_offset_reset="earliest")
            await self.consumer.start()
        parts = self.consumer.partitions_for_topic(self.topic)
        if not parts:
            await self.consumer._client.force_metadata_update()
            parts = self.consumer.partitions_for_topic(self.topic)
            if not parts:
                return False
        if not self.consumer.assignment():
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            self.consumer.assign(tps)
            await self.consumer.seek_to_beginning(*tps)
        return True

    async def poll_until(self, done: Callable[[list], bool], timeout: float = 30.0) -> list:
        """Read on (`waits.wait_until`: one fetch of up to 200 ms per check) until `done(records)`."""
        async def read_and_check() -> bool:
            if await self._attach():
                batches = await self.consumer.getmany(timeout_ms=200)
                for recs in batches.values():
                    self.records.extend(recs)
            return done(self.records)

        await wait_until(read_and_check, timeout,
                         lambda: f"{self.topic}: condition; {len(self.records)} records read", step=0.01)
        return self.records

    async def stop(self):
        if self.consumer is not None:
            await self.consumer.stop()


async def health(port: int) -> dict:
    """GET /readyz of an instance as JSON (its details: counters of the router)."""
    return await readyz(port)


def downlinks(records) -> list[pb.BasicDownlink]:
    return [pb.BasicDownlink.FromString(r.value) for r in records]
