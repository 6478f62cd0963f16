"""Per-second tallies of the stored copies received on the routers' Persist streams, for the Spark statistics.

With `ROUTER_PERSIST_VIA=kafka` the statistics job counts the records of tbmq.msg.persisted as outgoing copies
(path=persisted). Over Persist streams (the default) no record of them reaches Kafka, so device-persistence
writes one `PersistTally` per second that had copies to tbmq.msg.persisted.tally (the ended seconds together,
every few seconds), and the job counts those
(spark/tbmq_spark/decode.py). A tally covers one wall-clock second, so it falls in exactly one window of any
whole-second length. Counts are of copies received, as tbmq.msg.persisted's records are of copies written: a
batch a router sends again after its stream reopened is counted again, as a router's replay writes its records
again. What is tallied and not yet written when the process dies (at most the current second and any the
writer could not deliver) is lost to the statistics, never to the messages.
"""

from __future__ import annotations

from tbmq.v1 import messages_pb2 as pb

MAX_PENDING_SECONDS = 3600  # tallies kept while Kafka does not take them; the oldest are dropped beyond


class Tallies:
    """Pure: counts per second (`add`), handed out once their second is over (`take_done`)."""

    __slots__ = ("_by_second", "dropped")

    def __init__(self) -> None:
        self._by_second: dict[int, list[int]] = {}  # second (Unix s) -> [copies, bytes, qos0, qos1, qos2]
        self.dropped = 0  # seconds dropped because too many were pending

    def add(self, second: int, msgs) -> None:
        """Counts `msgs` (PublishMsg copies) in `second`."""
        t = self._by_second.get(second)
        if t is None:
            t = self._by_second[second] = [0, 0, 0, 0, 0]
            self._bound()
        for m in msgs:
            t[0] += 1
            t[1] += len(m.payload)
            t[2 + min(max(m.qos, 0), 2)] += 1

    def __bool__(self) -> bool:
        return bool(self._by_second)

    def take_done(self, now_s: float) -> list[pb.PersistTally]:
        """The tallies of the seconds before `now_s`'s, oldest first, removed from the pending ones."""
        current = int(now_s)
        done = sorted(s for s in self._by_second if s < current)
        return [self._message(s, self._by_second.pop(s)) for s in done]

    def take_all(self) -> list[pb.PersistTally]:
        """Every pending tally, the current second's too (at stop), oldest first."""
        return [self._message(s, self._by_second.pop(s)) for s in sorted(self._by_second)]

    def put_back(self, tallies: list[pb.PersistTally]) -> None:
        """Tallies a write failed to deliver, pending again (merged with any counted since)."""
        for t in tallies:
            cur = self._by_second.setdefault(t.second_ms // 1000, [0, 0, 0, 0, 0])
            cur[0] += t.copies
            cur[1] += t.payload_bytes
            for q, n in enumerate(t.copies_by_qos[:3]):
                cur[2 + q] += n
        self._bound()

    def _bound(self) -> None:
        """At most MAX_PENDING_SECONDS pending, the oldest dropped: whether a new second is counted or a failed
        write's tallies come back (while Kafka refuses writes, each attempt takes the pending ones and puts them
        back with the seconds counted meanwhile)."""
        while len(self._by_second) > MAX_PENDING_SECONDS:
            del self._by_second[min(self._by_second)]
            self.dropped += 1

    @staticmethod
    def _message(second: int, t: list[int]) -> pb.PersistTally:
        return pb.PersistTally(second_ms=second * 1000, copies=t[0], payload_bytes=t[1], copies_by_qos=t[2:])
