"""Subscription marks on tbmq.msg.all: the router's subscription barrier, paid per subscription change
instead of per fetched batch.

Guarantee (docs/router.md, "Routing after SUBACK"): a PUBLISH sent after a SUBACK, UNSUBACK or CONNACK is
routed, on every router instance, with the subscriptions and session that answer stands for.

A mark is a record with a null value on EVERY partition of tbmq.msg.all (`is_mark`; a PUBLISH is never null:
its value is a PublishMsg), keyed by the writer's id (Kafka needs a key or a value; the key is for people).
A connector writes one round of marks (`MarkWriter.mark`) after Kafka acknowledged a change that routing
must see and before it answers the client:
- SUBSCRIBE / UNSUBSCRIBE (and a credential change that removes filters): after the client's new set on
  tbmq.client.subscriptions was acknowledged, before SUBACK / UNSUBACK;
- a CONNECT that replaced or resumed a session the registry already held (`SessionEventResponse.
  mark_routing`: its session record, and the cleared subscriptions of a new session, were committed with
  the answer), before CONNACK.
A PUBLISH sent after that answer is appended to its partition after the mark. A router that reads a mark
asks the high watermarks of tbmq.client.subscriptions and tbmq.client.session (a ListOffsets sent after
the mark was read, so after the change was appended) and routes the mark's batch, and every later one,
only once its views reached them. It does the same for the first batch after every assignment: a mark
consumed and committed by the partition's previous owner was appended before that assignment.

Cost: one produce of `partitions` records per round (one request to each leader; sent `urgent` through a
connector's adaptive linger: the PUBLISH batches a round joins leave without waiting out the busy window),
at most one round in flight per connector (`tbmq_platform.inflight.AfterCall`: the changes acknowledged while a round is on its
way share the next one), and one ListOffsets per router batch that holds a mark. A batch without a mark
is routed at once. Readers of tbmq.msg.all other than the router skip marks (Spark: tbmq_spark.decode).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from .inflight import AfterCall
from .topics import MSG_ALL

if TYPE_CHECKING:  # the router's pure state (router.state) imports is_mark: no Kafka client here
    from aiokafka import AIOKafkaProducer


def is_mark(value: bytes | None) -> bool:
    """A tbmq.msg.all record value that is a subscription mark, not a PUBLISH."""
    return value is None


class MarkWriter:
    """One round of marks on every partition of `topic` per `mark()`, coalesced (module docstring)."""

    def __init__(self, producer: "AIOKafkaProducer", writer: str, topic: str = MSG_ALL,
                 urgent: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> None:
        self._producer = producer
        self._key = writer.encode("utf-8")
        self._topic = topic
        self._urgent = urgent  # around the round's sends: a producer's adaptive linger (coalesce.AdaptiveLinger)
        self._after = AfterCall(self._round)

    @property
    def rounds(self) -> int:
        return self._after.requests

    async def mark(self) -> None:
        """Return once a round of marks sent after this call is acknowledged on every partition."""
        await self._after.wait()

    async def _round(self) -> None:
        send, key = self._producer.send, self._key
        partitions = sorted(await self._producer.partitions_for(self._topic))
        with self._urgent():  # someone waits for the round (a CONNACK, a SUBACK): no busy window
            futs = [await send(self._topic, None, key=key, partition=p) for p in partitions]
        await asyncio.gather(*futs)
