"""Pure delivery logic of app-delivery: no I/O, no asyncio.

* ``AckTracker``: per Kafka partition, which offsets were streamed and which acknowledged; the commit
  point is the end of the longest acknowledged prefix, never past an unacknowledged record (TBMQ #320).
* DUP marks: the highest offset that *may* have been streamed is written into the committed offset's
  metadata BEFORE anything beyond it is streamed (``reserve``); on the next assignment every record at
  or below that mark is flagged ``redelivery`` (MQTT DUP=1). Writing the mark ahead of sending makes the
  scheme crash-safe: a record streamed before a crash is always at or below a mark already in Kafka.
  The mark is reserved ahead (``reservation_mark``): up to the batch's last offset plus ``ahead`` (the
  poll size), so that one offset commit covers many polls instead of one per poll. A stream that ends
  (a disconnect, a takeover, a shared partition revoked) writes the exact mark back (``exact_mark``: what
  it streamed, or what an earlier owner may have): the price of reserving ahead, over-flagging, is paid
  only after a crash: records never streamed that are at or below the reserved mark then carry DUP=1 (at
  most ``ahead`` plus one poll; DUP is "may have been sent before", so this is allowed).
* Origins: a router that crashed writes its uncommitted records' copies again; every copy names its
  tbmq.msg.all origin (``PublishMsg.origin_*``) and a partition streams one copy per origin
  (``PartOrigins``, the rule of tbmq_routing.origins). The highest origin offset per origin partition below
  the committed offset goes into the same metadata, so the next stream (another instance, another member)
  knows what was taken before it.
* Batches: one downstream message carries at most the free window slots (so never more than
  ``receive_maximum`` records are unacknowledged) and about ``max_bytes`` (``BatchLimit``).
* Shared subscriptions: QoS cap at the member's granted QoS; the record's MQTT topic must match one of
  the member's filters (several filters can map to one Kafka topic).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from tbmq_routing.origins import OriginMarks
from tbmq_routing.trie import Subscription, SubscriptionTrie

METADATA_PREFIX = "dup:"
ORIGINS_PREFIX = ";o:"
NO_MARK = -1
# Kafka refuses an offset commit whose metadata is over offset.metadata.max.bytes (4,096 by default): past
# this the origins are left out (a replay may then be streamed again, as before; never a refused commit)
METADATA_MAX_CHARS = 4000


class AckTracker:
    """Offsets of one partition in the order they were taken from Kafka.

    ``sent(o)``: streamed, awaiting acknowledgement. ``skipped(o)``: consumed but not streamed (expired,
    topic mismatch): counts as acknowledged. ``ack(o)``: acknowledgement from the connector.
    ``commit_point()``: the offset to commit (Kafka semantics: the next offset to read), or None while
    nothing is known. Offsets must be fed in increasing order (gaps are fine: transaction markers,
    compaction, retention).
    """

    __slots__ = ("_order", "_acked", "_next", "_outstanding")

    def __init__(self) -> None:
        self._order: deque[int] = deque()   # offsets not yet part of the acknowledged prefix
        self._acked: dict[int, bool] = {}   # offset -> acknowledged, for offsets in _order
        self._next: int | None = None       # offset after the last one seen
        self._outstanding = 0               # sent and not acknowledged

    def _push(self, offset: int, acked: bool) -> None:
        if self._next is not None and offset < self._next:
            raise ValueError(f"offset {offset} after {self._next - 1}: offsets must increase")
        self._next = offset + 1
        if acked and not self._order:
            return  # extends the acknowledged prefix directly
        self._order.append(offset)
        self._acked[offset] = acked
        if not acked:
            self._outstanding += 1

    def sent(self, offset: int) -> None:
        self._push(offset, False)

    def skipped(self, offset: int) -> None:
        self._push(offset, True)

    def ack(self, offset: int) -> bool:
        """True when `offset` was outstanding (an unknown or repeated ack changes nothing)."""
        if self._acked.get(offset) is not False:
            return False
        self._acked[offset] = True
        self._outstanding -= 1
        order, acked = self._order, self._acked
        while order and acked[order[0]]:
            del acked[order.popleft()]
        return True

    def commit_point(self) -> int | None:
        if self._order:
            return self._order[0]
        return self._next

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def last_seen(self) -> int | None:
        return None if self._next is None else self._next - 1

    def is_outstanding(self, offset: int) -> bool:
        return self._acked.get(offset) is False


# ------------------------------------------------------------------------------------------ DUP marks

def encode_mark(mark: int, origins: dict[int, int] | None = None) -> str:
    """Committed-offset metadata: the highest offset that may have been streamed, and the highest origin
    offset per tbmq.msg.all partition of the records below the committed offset."""
    text = f"{METADATA_PREFIX}{mark}"
    if origins:
        full = text + ORIGINS_PREFIX + ",".join(f"{p}={o}" for p, o in sorted(origins.items()))
        if len(full) <= METADATA_MAX_CHARS:
            return full
    return text


def decode_mark(metadata: str | None) -> int:
    """NO_MARK (-1) for anything that is not ours (e.g. the registry's clean-start reset writes '')."""
    if not metadata or not metadata.startswith(METADATA_PREFIX):
        return NO_MARK
    try:
        return int(metadata[len(METADATA_PREFIX):].partition(ORIGINS_PREFIX)[0])
    except ValueError:
        return NO_MARK


def decode_origins(metadata: str | None) -> dict[int, int]:
    """The origins written by `encode_mark`; {} when there are none or they cannot be read (nothing is
    then taken for a replay: at worst a duplicate, never a loss)."""
    if not metadata or not metadata.startswith(METADATA_PREFIX) or ORIGINS_PREFIX not in metadata:
        return {}
    out: dict[int, int] = {}
    try:
        for item in metadata.partition(ORIGINS_PREFIX)[2].split(","):
            p, _, o = item.partition("=")
            out[int(p)] = int(o)
    except ValueError:
        return {}
    return out


class PartOrigins:
    """One copy per origin for the records of one partition (tbmq_routing.origins): `first(offset,
    origin partition, origin offset)` is False for a replayed copy, which is then skipped; `at(point)` the
    origins to commit with `point` (every taken record below it folded in). `committed`: from the metadata
    found at assignment."""

    __slots__ = ("committed", "_marks", "_pending")

    def __init__(self, committed: dict[int, int] | None = None) -> None:
        self.committed: dict[int, int] = {}
        self._marks = OriginMarks()
        self._pending: deque[tuple[int, int, int]] = deque()  # (offset, origin partition, origin offset)
        self.merge(committed or {})

    def merge(self, origins: dict[int, int]) -> None:
        """Origins taken elsewhere (another member committed them): their copies are replays here too."""
        for p, o in origins.items():
            self._marks.seed(p, 0, o)
            if o > self.committed.get(p, -1):
                self.committed[p] = o

    def first(self, offset: int, origin_partition: int, origin_offset: int) -> bool:
        if not self._marks.first(origin_partition, 0, origin_offset, offset):
            return False
        self._pending.append((offset, origin_partition, origin_offset))
        return True

    def at(self, point: int) -> dict[int, int]:
        pending, committed = self._pending, self.committed
        while pending and pending[0][0] < point:
            _, p, o = pending.popleft()
            if o > committed.get(p, -1):
                committed[p] = o
        return committed


def is_redelivery(offset: int, mark: int) -> bool:
    """May the record at `offset` have been streamed before (by an earlier stream or owner)?"""
    return offset <= mark


def needs_reservation(last_offset: int, reserved: int) -> bool:
    """A batch ending at `last_offset` must be reserved (mark committed) before it is streamed."""
    return last_offset > reserved


def reservation_mark(reserved: int, last_offset: int, ahead: int) -> int:
    """The DUP mark to commit before streaming a batch ending at `last_offset`: `ahead` offsets past it, so
    that the next polls need no commit until they pass it; never below what is reserved already."""
    return max(reserved, last_offset + max(ahead, 0))


def exact_mark(prev_mark: int, last_seen: int | None) -> int:
    """The DUP mark a stream that ends writes back in place of the one reserved ahead: the highest offset it
    took (`last_seen`), or the mark it found at assignment (`prev_mark`: what an earlier stream or owner may
    have streamed), whichever is higher. Nothing above it was streamed by anyone, so the next stream sends
    those records with DUP=0. Only once the pump has stopped: it may stream up to the reserved mark."""
    return max(prev_mark, NO_MARK if last_seen is None else last_seen)


# ------------------------------------------------------------------------------------------- batches

class BatchLimit:
    """The bounds of one downstream batch message: at most `room` records (the free window slots when
    the batch was started: the window invariant is exact) and at most `max_bytes` of records, except
    that a single record larger than `max_bytes` goes alone (it must go: the window alone holds it back).

    ``fits(size)`` before taking a record, ``take(size)`` when it was taken; a record that does not fit
    starts the next batch.
    """

    __slots__ = ("room", "max_bytes", "count", "size")

    def __init__(self, room: int, max_bytes: int) -> None:
        if room < 1:
            raise ValueError("a batch needs a free window slot")
        self.room = room
        self.max_bytes = max_bytes
        self.count = 0
        self.size = 0

    def fits(self, size: int) -> bool:
        if self.count >= self.room:
            return False
        return self.count == 0 or self.size + size <= self.max_bytes

    def take(self, size: int) -> None:
        self.count += 1
        self.size += size

    @property
    def full(self) -> bool:
        return self.count >= self.room or self.size >= self.max_bytes


def record_size(value: bytes | None, topic: str) -> int:
    """Estimated encoded size of an AppRecord carrying a Kafka record value (its PublishMsg) of `topic`:
    the value, the ref and the framing (exact enough for a byte bound; no encoding per record)."""
    return len(value or b"") + len(topic) + 32


# --------------------------------------------------------------------------------- shared subscriptions

class SharedFilters:
    """The filters (with granted QoS) a member subscribed under one share name; answers, for a record of
    a shared topic, whether it is ours and at which QoS."""

    def __init__(self, client_id: str, filters: Iterable[tuple[str, int | None]]) -> None:
        self._trie = SubscriptionTrie()
        self._qos: dict[str, int | None] = {}
        for topic_filter, qos in filters:
            self._qos[topic_filter] = qos
            self._trie.add(topic_filter, Subscription(client_id, qos=qos if qos is not None else 2))

    @property
    def filters(self) -> list[str]:
        return list(self._qos)

    def delivery_qos(self, mqtt_topic: str, record_qos: int) -> int | None:
        """None when the topic matches none of the filters (another filter's copy on a colliding Kafka
        topic name); else the QoS to deliver: min(record QoS, best granted QoS of the matching filters);
        a filter without a known granted QoS does not cap."""
        matches = self._trie.match(mqtt_topic)
        if not matches:
            return None
        best = 0
        for topic_filter, _sub in matches:
            granted = self._qos.get(topic_filter)
            cap = record_qos if granted is None else min(record_qos, granted)
            best = max(best, cap)
        return best
