"""Outbound flow control of one connection: packet ids, the in-flight window and the bounded queue.

Pure (no I/O) so that it is unit-tested on its own.

Two packet-id spaces share one connection:

* **fixed ids** — messages of persistent DEVICE sessions carry the packet id that device-persistence's
  save script assigned (1..65535, wrapping). The connector must send them with exactly that id, because
  the store acknowledges by (client id, packet id).
* **allocated ids** — everything else (live deliveries from tbmq.msg.downlink.basic, APPLICATION records,
  retained messages on SUBSCRIBE) gets an id from the connection's own allocator.

Collisions are avoided like this: the allocator only hands out ids that are not in flight (in-flight
fixed ids included), and walks the id space *downwards* from 65535 while the store's ids grow upwards
from 1, so the two rarely meet. When a fixed-id message reaches the head of the queue while its id is
still held by an earlier in-flight message, the queue waits (in order) until that id is acknowledged;
ids are freed by the client's PUBACK/PUBCOMP, so the wait is bounded by the client's round trip.

Messages of a shared DEVICE group's store (``ss_<share>_<filter>``, fetched by a persistent member) are NOT
fixed-id messages: their packet ids belong to the group store's own id space and would collide with the
member's own stored ids. They get an allocated id like a live delivery (kind ``GROUP``) and carry a
``GroupRef`` (store id, store packet id, serial) as ``ref``: the in-flight map, keyed by the local packet id,
is the mapping local id -> (store id, store packet id) used to acknowledge the group store entry.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tbmq_mqtt import ReasonCode

LIVE = 0     # tbmq.msg.downlink.basic / retained on subscribe: connector-assigned id, nothing to ack upstream
DEVICE = 1   # persistent DEVICE message: fixed id, Acknowledge/MarkPubrec to device-persistence
APP = 2      # APPLICATION record: connector-assigned id, AppAck(ref) upstream
GROUP = 3    # shared DEVICE group store message: connector-assigned id, Acknowledge/MarkPubrec(ref) upstream

AWAIT_PUBACK = 1
AWAIT_PUBREC = 2
AWAIT_PUBCOMP = 3

MAX_PACKET_ID = 65535


@dataclass(frozen=True, slots=True)
class GroupRef:
    """Where a GROUP delivery came from: the group store id (the device-persistence "client id"), the packet
    id the store assigned (its own id space, never sent to the member) and the store's serial."""

    store_id: str
    packet_id: int
    serial: int


def upstream_ack(msg: "OutMsg", client_id: str) -> tuple[str, int, int] | None:
    """The (store client id, store packet id, store serial) a client's PUBACK/PUBCOMP/PUBREC of `msg`
    acknowledges in device-persistence: the member's own store for DEVICE (fixed id; the ref is the serial),
    the group store for GROUP (the local packet id is mapped back through the ref); None for anything else.
    The serial lets the store apply it only to that message (services.proto PacketRequest.serial)."""
    if msg.kind == DEVICE:
        return client_id, msg.packet_id or msg.fixed_id, msg.ref
    if msg.kind == GROUP:
        ref = msg.ref
        return ref.store_id, ref.packet_id, ref.serial
    return None


@dataclass(slots=True)
class OutMsg:
    """One outbound QoS 1/2 delivery (or a PUBREL owed for a stored DEVICE message)."""

    qos: int
    kind: int = LIVE
    publish: Any = None            # the Publish packet to send (packet_id filled when it goes in flight)
    fixed_id: int | None = None    # DEVICE: the store's packet id
    pubrel_only: bool = False      # DEVICE: PUBREC already received before; only PUBREL is owed
    ref: Any = None                # APP: AppRecordRef; DEVICE: serial; GROUP: GroupRef
    packet_id: int = 0
    state: int = 0
    size: int = 0                  # what it holds while queued (`_size`), set by `OutboundWindow.offer`
    expires_at: int = 0            # Message Expiry Interval: the deadline (ms; tbmq_routing.expiry.deadline_ms),
                                   # checked again when it leaves the queue; 0 = none


def _size(msg: OutMsg) -> int:
    """What a queued message holds: its payload and topic (a PUBREL owed holds nothing)."""
    pkt = msg.publish
    return 0 if pkt is None else len(pkt.payload) + len(pkt.topic)


class PacketIds:
    """Allocator of packet ids that are not in use. Walks downwards from 65535, wrapping."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = MAX_PACKET_ID

    def allocate(self, in_use) -> int | None:
        """A free id (not in `in_use`), or None when all 65535 are taken."""
        if len(in_use) >= MAX_PACKET_ID:
            return None
        pid = self._next
        while pid in in_use:
            pid = pid - 1 if pid > 1 else MAX_PACKET_ID
        self._next = pid - 1 if pid > 1 else MAX_PACKET_ID
        return pid


class OutboundWindow:
    """In-flight window (≤ the client's Receive Maximum) plus a FIFO queue behind it, bounded in messages and
    in bytes (what one client that does not read can make the connector hold)."""

    def __init__(self, window: int, max_queued: int, max_queued_bytes: int = 1 << 62) -> None:
        self.window = max(1, min(window, MAX_PACKET_ID))
        self.max_queued = max_queued
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0   # payload + topic bytes of the queue (not of the in-flight window)
        self.inflight: dict[int, OutMsg] = {}
        # the FIFO behind the window: a deque while a message waits, None when empty (a deque is 760 bytes
        # empty, and most connections hold none most of the time)
        self.queue: deque[OutMsg] | None = None
        self.ids = PacketIds()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.inflight) + (len(self.queue) if self.queue else 0)

    def offer(self, msg: OutMsg, *, force: bool = False) -> bool:
        """Queue `msg` for sending. False (and counted as dropped) when the queue is full, unless `force`
        (stored messages, which must not be lost: their count is bounded by the store)."""
        size = msg.size = _size(msg)
        queue = self.queue
        if not force and ((len(queue) if queue else 0) >= self.max_queued
                          or self.queued_bytes + size > self.max_queued_bytes):
            self.dropped += 1
            return False
        if queue is None:
            queue = self.queue = deque()
        self.queued_bytes += size
        queue.append(msg)
        return True

    def ready(self) -> list[OutMsg]:
        """Move as many queued messages as the window allows into flight (ids assigned, states set)
        and return them in order: the caller sends each one."""
        out: list[OutMsg] = []
        inflight = self.inflight
        queue = self.queue
        if not queue:
            return out
        while queue and len(inflight) < self.window:
            msg = queue[0]
            if msg.fixed_id is not None:
                pid = msg.fixed_id
                if pid in inflight:
                    break  # held by an earlier message: keep order, wait for its acknowledgement
            else:
                pid = self.ids.allocate(inflight)
                if pid is None:
                    break
            queue.popleft()
            self.queued_bytes -= msg.size
            msg.packet_id = pid
            if msg.pubrel_only:
                msg.state = AWAIT_PUBCOMP
            else:
                msg.state = AWAIT_PUBACK if msg.qos == 1 else AWAIT_PUBREC
            inflight[pid] = msg
            out.append(msg)
        if not queue:
            self.queue = None
        return out

    def on_puback(self, packet_id: int) -> OutMsg | None:
        msg = self.inflight.get(packet_id)
        if msg is None or msg.state != AWAIT_PUBACK:
            return None
        del self.inflight[packet_id]
        return msg

    def on_pubrec(self, packet_id: int, failed: bool = False) -> OutMsg | None:
        """PUBREC: the message moves to awaiting PUBCOMP (the caller sends PUBREL). A PUBREC with a
        failure reason code (v5, >= 0x80) ends the flow: the message leaves the window."""
        msg = self.inflight.get(packet_id)
        if msg is None or msg.state != AWAIT_PUBREC:
            return None
        if failed:
            del self.inflight[packet_id]
        else:
            msg.state = AWAIT_PUBCOMP
        return msg

    def on_pubcomp(self, packet_id: int) -> OutMsg | None:
        msg = self.inflight.get(packet_id)
        if msg is None or msg.state != AWAIT_PUBCOMP:
            return None
        del self.inflight[packet_id]
        return msg

    def clear(self) -> None:
        self.inflight.clear()
        self.queue = None
        self.queued_bytes = 0


class GroupStores:
    """The shared DEVICE group stores one persistent member has attached (store id -> state). Pure.

    Per store: the subscription key (share name, filter) it serves, whether its FetchUndelivered is still
    running (forwards that arrive meanwhile are held and delivered after the answer), whether a re-sync
    asked for another fetch while one was running, and the highest serial delivered (a forward of a
    message that was also in the answer is skipped). The serial survives a detach, so a re-subscribe
    within the same connection does not send again what is still in flight. Paging: whether the store
    holds more than was fetched (`more`), and the store's messages this connection holds until they are
    acknowledged (`out`: serial -> payload bytes), which bound the next page.
    """

    __slots__ = ("_key", "_held", "_serial", "_again", "_more", "_out")

    def __init__(self) -> None:
        self._key: dict[str, tuple[str, str]] = {}        # attached store id -> (share name, filter)
        self._held: dict[str, list] = {}                  # store id -> forwards held while fetching
        self._serial: dict[str, int] = {}                 # store id -> highest serial delivered
        # dicts used as sets (key -> None): an empty dict is 64 bytes, an empty set 216, in every connection
        self._again: dict[str, None] = {}                 # fetching stores a re-sync wants fetched again
        self._more: dict[str, None] = {}                  # stores with more than fetched: page when there is room
        self._out: dict[str, dict[int, int]] = {}         # store id -> serial -> payload bytes held (unacknowledged)

    def __contains__(self, store_id: str) -> bool:
        return store_id in self._key

    def __len__(self) -> int:
        return len(self._key)

    def attached(self) -> list[str]:
        return list(self._key)

    def key(self, store_id: str) -> tuple[str, str] | None:
        return self._key.get(store_id)

    def begin(self, store_id: str, key: tuple[str, str]) -> bool:
        """Attach `store_id` (serving subscription `key`): True when a fetch must be made now (False: already
        attached on this connection)."""
        if store_id in self._key:
            return False
        self._key[store_id] = key
        self._held[store_id] = []
        return True

    def fetching(self, store_id: str) -> bool:
        return store_id in self._held

    def hold(self, store_id: str, item) -> bool:
        """Hold a forward while the store's fetch runs: True when held (else deliver it now)."""
        held = self._held.get(store_id)
        if held is None:
            return False
        held.append(item)
        return True

    def fetched(self, store_id: str) -> list:
        """The fetch answered: the forwards held meanwhile, in arrival order (delivered after the answer).
        When a re-sync asked for another fetch meanwhile, holding goes on (see `again`)."""
        held = self._held.pop(store_id, [])
        if store_id in self._again:
            self._held[store_id] = []
        return held

    def refetch(self, store_id: str) -> bool:
        """A re-sync (a forward stream opened or ended): True when a fetch must be started now (holding
        begins; the store's `more` is answered again by it); False when the store is not attached, or a
        fetch is running (it is repeated after)."""
        if store_id not in self._key:
            return False
        if store_id in self._held:
            self._again[store_id] = None
            return False
        self._more.pop(store_id, None)
        self._held[store_id] = []
        return True

    def behind(self, store_id: str) -> bool:
        """The store holds messages not fetched yet (`more`): a forward would jump ahead of them (and the
        next page, fetched after the highest serial delivered, would skip them), so it is not delivered;
        it stays stored and comes in a later page."""
        return store_id in self._more

    def again(self, store_id: str) -> bool:
        """After `fetched`: True (once) when another fetch must follow (forwards are still held)."""
        if store_id in self._again:
            self._again.pop(store_id, None)
            if store_id in self._held:
                self._more.pop(store_id, None)  # answered again by the fetch that follows
                return True
        return False

    def accept(self, store_id: str, serial: int) -> bool:
        """True (and remembered) when `serial` is past the highest delivered from this store."""
        if serial <= self._serial.get(store_id, -1):
            return False
        self._serial[store_id] = serial
        return True

    def last_serial(self, store_id: str) -> int:
        """The highest serial delivered from the store (0: none)."""
        return max(self._serial.get(store_id, 0), 0)

    def set_more(self, store_id: str) -> None:
        if store_id in self._key:
            self._more[store_id] = None

    def holding(self, store_id: str, serial: int, size: int) -> None:
        """A message of the store is handed to the client: held until acknowledged (`release`)."""
        self._out.setdefault(store_id, {})[serial] = size

    def release(self, store_id: str, serial: int) -> bool:
        """The client acknowledged (or was spared) a held message of the store: True when it was held."""
        out = self._out.get(store_id)
        return out is not None and out.pop(serial, None) is not None

    def room(self, store_id: str) -> tuple[int, int]:
        """(messages, payload bytes) of the store held by this connection."""
        out = self._out.get(store_id)
        return (len(out), sum(out.values())) if out else (0, 0)

    def page_due(self, store_id: str, fits: Callable[[int, int], bool]) -> bool:
        """True (once: `more` is consumed and holding begins, as for a re-sync) when the store has more, no
        fetch runs and what is held (messages, bytes) `fits` the next page: the caller fetches it."""
        if store_id not in self._more or store_id in self._held:
            return False
        if not fits(*self.room(store_id)):
            return False
        self._more.pop(store_id, None)
        self._held[store_id] = []
        return True

    def detach(self, store_id: str) -> bool:
        """Forget the attachment (the serial is kept): True when it was attached."""
        self._held.pop(store_id, None)
        self._again.pop(store_id, None)
        self._more.pop(store_id, None)
        return self._key.pop(store_id, None) is not None


class InboundAliases:
    """Topic aliases a v5 client sets on its PUBLISHes (Topic Alias Maximum is ours)."""

    __slots__ = ("maximum", "_topics")

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self._topics: dict[int, str] = {}

    def resolve(self, topic: str, alias: int | None) -> str:
        """The topic of a PUBLISH; raises AliasError(reason code) when the alias use is invalid."""
        if alias is None:
            if not topic:
                raise AliasError(ReasonCode.PROTOCOL_ERROR, "empty topic name without a topic alias")
            return topic
        if alias == 0 or alias > self.maximum:
            raise AliasError(ReasonCode.TOPIC_ALIAS_INVALID, f"topic alias {alias} outside 1..{self.maximum}")
        if topic:
            self._topics[alias] = topic
            return topic
        known = self._topics.get(alias)
        if known is None:
            raise AliasError(ReasonCode.PROTOCOL_ERROR, f"topic alias {alias} used before it was set")
        return known


class OutboundAliases:
    """Topic aliases the connector sets on PUBLISHes to a v5 client whose Topic Alias Maximum is > 0: the most
    recently used topics keep an alias (LRU); a new topic takes a free alias, else the least recently used
    topic's. Aliases stay within 1..the client's maximum [MQTT-3.3.2-8, MQTT-3.3.2-11] and belong to this
    connection only [MQTT-3.3.2-7]."""

    __slots__ = ("maximum", "_alias", "_free", "_next")

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self._alias: dict[str, int] = {}     # topic -> alias, least recently used first
        self._free: list[int] = []
        self._next = 1

    def assign(self, topic: str) -> tuple[int, bool]:
        """(alias, known): `known` -> the client has the mapping already (send an empty topic name); else the
        PUBLISH carries both the topic and the alias, which (re)maps it."""
        alias = self._alias.pop(topic, None)
        if alias is not None:
            self._alias[topic] = alias
            return alias, True
        if self._free:
            alias = self._free.pop()
        elif self._next <= self.maximum:
            alias = self._next
            self._next += 1
        else:
            alias = self._alias.pop(next(iter(self._alias)))
        self._alias[topic] = alias
        return alias, False

    def forget(self, topic: str) -> None:
        """The PUBLISH that was to set `topic`'s alias was not sent: the client does not have that mapping."""
        alias = self._alias.pop(topic, None)
        if alias is not None:
            self._free.append(alias)


class AliasError(Exception):
    def __init__(self, reason_code: int, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code
        self.message = message


class InboundQos:
    """Inbound QoS 1/2 bookkeeping: the Receive Maximum we advertised, and QoS 2 ids awaiting PUBREL
    (exactly-once receive [MQTT-4.3.3-10]: a PUBLISH with an id already awaiting PUBREL is not forwarded
    again)."""

    __slots__ = ("receive_maximum", "pending_acks", "awaiting_pubrel")

    def __init__(self, receive_maximum: int) -> None:
        self.receive_maximum = receive_maximum
        self.pending_acks = 0            # QoS 1/2 PUBLISHes whose PUBACK/PUBREC is not sent yet
        self.awaiting_pubrel: set[int] = set()

    def in_use(self) -> int:
        return self.pending_acks + len(self.awaiting_pubrel)

    def over_quota(self) -> bool:
        """True when one more QoS 1/2 PUBLISH would exceed the advertised Receive Maximum."""
        return self.in_use() >= self.receive_maximum
