"""Follow a compacted topic as a table: read it from the beginning, report ready at its end, keep following.

Every instance of every service that needs the session map, the subscription set or the retained
messages reads the whole compacted topic itself (no consumer group: each instance gets every partition).
`wait_caught_up()` returns once every record that existed when it was called has been applied, which is
how a service knows its state is rebuilt before it serves, and how a service that just wrote a record can
wait until its own view contains it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition

from .kafka import make_consumer, topic_partitions

log = logging.getLogger(__name__)

Apply = Callable[[bytes, bytes | None], None]


class CompactedTopicView:
    # read_committed by default: the session-registry writes sessions and subscription clears in Kafka
    # transactions, and a view must never apply a record of a transaction that was aborted.
    def __init__(self, bootstrap: str, topic: str, apply: Apply, *, client_id: str,
                 read_committed: bool = True):
        self.topic = topic
        self._apply = apply
        self._consumer: AIOKafkaConsumer = make_consumer(
            bootstrap, group_id=None, client_id=client_id, read_committed=read_committed)
        self._partitions: list[TopicPartition] = []
        self._positions: dict[TopicPartition, int] = {}
        self._progress = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self.records = 0

    async def start(self) -> None:
        await self._consumer.start()
        self._partitions = await topic_partitions(self._consumer, self.topic)
        self._consumer.assign(self._partitions)
        await self._consumer.seek_to_beginning(*self._partitions)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"follow {self.topic}")
        await self.wait_caught_up()
        log.info("%s: %d records applied", self.topic, self.records)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._consumer.stop()

    async def wait_caught_up(self, timeout: float = 60.0) -> None:
        """Wait until everything written to the topic before this call has been applied."""
        ends = await self._consumer.end_offsets(self._partitions)

        def done() -> bool:
            return all(self._positions.get(tp, 0) >= end for tp, end in ends.items())

        async with self._progress:
            await asyncio.wait_for(self._progress.wait_for(done), timeout)

    async def _run(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=200, max_records=5000)
            for tp, records in batches.items():
                for record in records:
                    try:
                        self._apply(record.key, record.value)
                    except Exception:  # a bad record must not stop the view; it is logged and skipped
                        log.exception("%s: cannot apply record at offset %d", self.topic, record.offset)
                    self.records += 1
            async with self._progress:
                for tp in self._partitions:
                    self._positions[tp] = await self._consumer.position(tp)
                self._progress.notify_all()
