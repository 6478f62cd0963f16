"""One copy per origin: the rule that keeps a router's replay from reaching a client twice.

A router that crashes (or loses a partition) routes its uncommitted tbmq.msg.all records again, so every
copy it made of them is made a second time. Each copy names its origin, the tbmq.msg.all (partition,
offset) it was routed from: `BasicDownlink.origin_*` on the live path, `PublishMsg.origin_*` in APPLICATION
topics (`PersistedMsg.origin_*` for persistent DEVICE clients, checked in Redis by device-persistence).

On one destination partition (a connector's downlink partition, an APPLICATION topic's partition) the
copies of one origin partition arrive in origin order: one router at a time owns the origin partition and
produces in order with an idempotent producer, and a replay lands after the copies it repeats. So, per
(origin partition, destination partition), the highest origin offset taken so far, with the destination
offset of the record that brought it, tells a replayed copy (an origin offset at or below it, in another
record) from a new one. Reading the same record again (same destination offset) is not a replay, and one
record may carry several copies for one client (its own subscriptions and shared groups that picked it):
all are taken.

Used by the connector's connections (live deliveries) and app-delivery (APPLICATION records, with the
marks carried across streams in the committed offset's metadata). Holds one entry per (origin partition,
destination partition) pair seen: bounded by the topics' partition counts, whatever a client does.
"""

from __future__ import annotations

__all__ = ["OriginMarks"]


class OriginMarks:
    __slots__ = ("_marks",)

    def __init__(self) -> None:
        self._marks: dict[tuple[int, int], tuple[int, int]] = {}

    def first(self, origin_partition: int, partition: int, origin_offset: int, offset: int) -> bool:
        """Is the record at `offset` of destination `partition` the first to bring this origin (deliver it)?"""
        key = (origin_partition, partition)
        mark = self._marks.get(key)
        if mark is None or origin_offset > mark[0]:
            self._marks[key] = (origin_offset, offset)
            return True
        return origin_offset == mark[0] and offset == mark[1]

    def seed(self, origin_partition: int, partition: int, origin_offset: int) -> None:
        """Origins up to `origin_offset` were taken before (a committed mark): their copies are replays."""
        key = (origin_partition, partition)
        mark = self._marks.get(key)
        if mark is None or origin_offset > mark[0]:
            self._marks[key] = (origin_offset, -1)

    def __len__(self) -> int:
        return len(self._marks)
