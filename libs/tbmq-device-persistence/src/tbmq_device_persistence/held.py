"""Held forwards: a live persistent DEVICE client's QoS 1 copies forwarded from memory, written to Redis only when
their acknowledgement does not come back in time (docs/performance.md, "The fifty-first round": the Redis save and
removal of a live message are 24-33 % of the stack's CPU at 1,000 msg/s).

Pure: no I/O and no clock of its own (every call that needs the time takes `now_ms`). The service decides with this
table and applies what it answers: forwards, Redis writes (a spill, the origin marks), the Persist batches' futures.

A client is in the table ("held mode") only while Redis stores nothing of it beyond what it spilled: it enters
(`enter`) when Redis reports its store empty while it is live, with Redis's serial and packet-id cursor, and it leaves
(`leave`) by writing its held tail to Redis first. So a client's state is always Redis's, or Redis's followed by a
held tail in serial order, never the two interleaved.

Guarantees the service builds on:
  * A copy counts for its Persist batch (HeldBatch) until it is released (acknowledged: PUBACK of its packet id AND
    serial) or spilled (written to Redis); a batch finishes only when every copy it holds is, and its origin marks
    are taken out (`collect`) before its finish is reported, so the router commits tbmq.msg.all only after the work
    is durable: delivered and acknowledged, or saved.
  * The origin mark of a (client, tbmq.msg.all partition) never reaches a copy still held: save_messages.lua drops a
    replayed copy at or below the mark, so a router's replay after a crash drops only what was acknowledged.
  * Packet ids: the next free id after the cursor (1..65535, wrapping, skipping the ids still held); at most
    `handed_out_limit` held per client, so one is always free.
  * Every limit is in bytes or counts: `client_bytes` per client, `total_bytes` for the table; a copy over a limit
    is refused (the client leaves held mode and is saved as today).
  * An acknowledgement that arrives while the client's tail is being spilled is deferred (`release` answers
    DEFERRED) and handed back by `spilled`, to be applied in Redis after the spill, never before it.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

MAX_PACKET_ID = 65535


class Released(enum.Enum):
    HELD = "held"  # it was held: done in memory, no Redis call
    DEFERRED = "deferred"  # the client's tail is being spilled: apply it in Redis once `spilled` returns it
    NOT_HELD = "not held"  # not a held copy: apply it in Redis as today


class HeldBatch:
    """The held copies of one Persist batch still in flight. `seal()` once every copy of the batch was admitted (or
    saved); `finished` when sealed and none is left."""

    __slots__ = ("pending", "sealed", "token")

    def __init__(self, token: Any = None) -> None:
        self.pending = 0
        self.sealed = False
        self.token = token  # the service's own handle (e.g. the batch's future)

    @property
    def finished(self) -> bool:
        return self.sealed and self.pending == 0


@dataclass(slots=True)
class HeldMsg:
    serial: int
    packet_id: int
    payload: Any  # the service's message (opaque here)
    origin: tuple[int, int] | None  # the tbmq.msg.all (partition, offset) it was routed from
    size: int
    deadline_ms: int
    batch: HeldBatch


class Copy(NamedTuple):
    """One routed copy offered to `admit` (a NamedTuple: built per copy on the hot path, half the cost of a frozen
    dataclass)."""

    payload: Any
    origin: tuple[int, int] | None
    size: int
    qos: int


@dataclass(slots=True)
class _Origins:
    """One tbmq.msg.all partition's copies of a client not yet under its mark: their offsets in offset order, those
    of them done (released), and the highest offset whose prefix is done."""

    offsets: deque = field(default_factory=deque)
    done: set = field(default_factory=set)
    mark: int = -1
    high: int = -1  # the highest offset admitted


@dataclass(slots=True)
class _Client:
    attached: Any  # the service's Attachment: .service_id names the connector it is live on
    serial: int
    packet_id: int
    serial_end: int  # the last serial of the block Redis reserved
    held: dict[int, HeldMsg] = field(default_factory=dict)  # serial -> copy, in serial order
    pids: dict[int, int] = field(default_factory=dict)  # packet id -> serial of the held copy
    bytes: int = 0
    origins: dict[int, _Origins] = field(default_factory=dict)
    spilling: bool = False
    deferred: list[tuple[int, int]] = field(default_factory=list)  # (packet id, serial) acked while spilling


@dataclass(frozen=True, slots=True)
class Spill:
    """A client's held tail to write to Redis (in serial order, with the serials and packet ids they were handed out
    with) and the marks it carries (partition -> highest origin offset among them)."""

    client_id: str
    attached: Any
    messages: list[HeldMsg]
    serial: int  # the last serial and packet id handed out
    packet_id: int
    serial_end: int  # the end of the reserved block: Redis's cursor is there already


@dataclass(frozen=True, slots=True)
class Collected:
    """What releases made ready: origin marks to write ({client id: {partition: offset}}), then batches finished."""

    marks: dict[str, dict[int, int]]
    batches: list[HeldBatch]


class HeldTable:
    """Every client in held mode on this device-persistence instance."""

    def __init__(self, *, hold_ms: int, client_bytes: int, total_bytes: int, handed_out_limit: int) -> None:
        if hold_ms <= 0 or client_bytes <= 0 or total_bytes <= 0:
            raise ValueError("hold_ms, client_bytes and total_bytes must be > 0")
        if not 1 <= handed_out_limit <= MAX_PACKET_ID - 1:
            raise ValueError(f"handed_out_limit must be 1..{MAX_PACKET_ID - 1}")
        self.hold_ms = hold_ms
        self.client_bytes = client_bytes
        self.total_bytes = total_bytes
        self.handed_out_limit = handed_out_limit
        self.bytes = 0
        self._clients: dict[str, _Client] = {}
        # (deadline, client, last serial) per admitted group, admit order: the group is past its deadline while the
        # client's oldest held serial is at or below its last (an older group's copy is past its own too)
        self._deadlines: deque[tuple[int, str, int]] = deque()
        self._marks: dict[str, dict[int, int]] = {}  # marks moved since the last `collect`
        self._finished: list[HeldBatch] = []

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, client_id: str) -> bool:
        return client_id in self._clients

    def held_count(self, client_id: str) -> int:
        c = self._clients.get(client_id)
        return len(c.held) if c is not None else 0

    def enter(self, client_id: str, attached: Any, serial: int, packet_id: int, serial_end: int) -> bool:
        """The client's Redis store is empty and it is live on `attached`, and Redis reserved it the serials
        `serial`+1 .. `serial_end` and the packet ids after `packet_id` as many (its state's cursor moved past them,
        so whatever Redis hands out next, after a crash of this instance too, comes after every held copy): its
        next QoS 1 copies may be held, until that block is used up. False when it is in the table already."""
        if client_id in self._clients:
            return False
        if not 0 <= packet_id <= MAX_PACKET_ID or not 0 <= serial <= serial_end:
            raise ValueError(f"bad cursor: serials {serial}..{serial_end}, packet id {packet_id}")
        self._clients[client_id] = _Client(attached, serial, packet_id, serial_end)
        return True

    def admit(self, client_id: str, copies: Sequence[Copy], now_ms: int, batch: HeldBatch) -> list[HeldMsg] | None:
        """The client's copies (routing order) held and handed out, each with the next serial and packet id: the
        messages to forward now. None when they cannot all be held (the client is not in held mode or is spilling,
        a copy is not QoS 1, a limit would be passed): nothing is taken, and a client in the table must `leave`
        before its copies are saved as today, behind its tail."""
        c = self._clients.get(client_id)
        if c is None or c.spilling or not copies:
            return None
        size = 0
        for copy in copies:
            if copy.qos != 1:
                return None
            if copy.origin is not None:
                origins = c.origins.get(copy.origin[0])
                if origins is not None and copy.origin[1] <= origins.high:
                    return None  # routed again (a Persist batch sent again): the tail's spill marks it applied
            size += copy.size
        if (c.bytes + size > self.client_bytes or self.bytes + size > self.total_bytes
                or len(c.held) + len(copies) > self.handed_out_limit or c.serial + len(copies) > c.serial_end):
            return None
        deadline = now_ms + self.hold_ms
        out = []
        for copy in copies:
            c.serial += 1
            pid = self._next_pid(c)
            msg = HeldMsg(c.serial, pid, copy.payload, copy.origin, copy.size, deadline, batch)
            c.held[c.serial] = msg
            c.pids[pid] = c.serial
            if copy.origin is not None:
                part, offset = copy.origin
                origins = c.origins.get(part)
                if origins is None:
                    origins = c.origins[part] = _Origins()
                origins.offsets.append(offset)
                origins.high = offset
            out.append(msg)
        self._deadlines.append((deadline, client_id, c.serial))
        c.bytes += size
        self.bytes += size
        batch.pending += len(out)
        return out

    @staticmethod
    def _next_pid(c: _Client) -> int:
        pid = c.packet_id
        while True:
            pid = pid % MAX_PACKET_ID + 1
            if pid not in c.pids:
                c.packet_id = pid
                return pid

    def release(self, client_id: str, packet_id: int, serial: int) -> Released:
        """An acknowledgement (PUBACK) of the client's `packet_id` for the message of `serial` (0: whatever holds the
        id, as in Redis)."""
        c = self._clients.get(client_id)
        if c is None:
            return Released.NOT_HELD
        if serial == 0:
            serial = c.pids.get(packet_id, 0)
        if c.spilling:
            msg = c.held.get(serial)
            if msg is not None and msg.packet_id == packet_id:
                c.deferred.append((packet_id, serial))
                return Released.DEFERRED
            return Released.NOT_HELD
        msg = c.held.get(serial)
        if msg is None or msg.packet_id != packet_id:
            return Released.NOT_HELD
        del c.held[serial]
        del c.pids[packet_id]
        c.bytes -= msg.size
        self.bytes -= msg.size
        if msg.origin is not None:
            self._done_origin(client_id, c, msg.origin)
        self._batch_done(msg.batch)
        return Released.HELD

    def _done_origin(self, client_id: str, c: _Client, origin: tuple[int, int]) -> None:
        part, offset = origin
        origins = c.origins[part]
        origins.done.add(offset)
        offsets, done = origins.offsets, origins.done
        if offsets[0] != offset:
            return  # an earlier copy of the partition is still held: the mark stays below it
        while offsets and offsets[0] in done:
            origins.mark = offsets.popleft()
            done.discard(origins.mark)
        self._marks.setdefault(client_id, {})[part] = origins.mark

    def _batch_done(self, batch: HeldBatch) -> None:
        batch.pending -= 1
        if batch.finished:
            self._finished.append(batch)

    def seal(self, batch: HeldBatch) -> bool:
        """Every copy of the batch was admitted or saved: True when it is finished already (nothing held)."""
        batch.sealed = True
        return batch.pending == 0

    def collect(self) -> Collected:
        """The origin marks the releases since the last call moved, and the batches they finished: write the marks
        to Redis, then report the batches finished."""
        out = Collected(self._marks, self._finished)
        self._marks, self._finished = {}, []
        return out

    def attached(self, client_id: str) -> Any:
        """The attachment the client entered with (its copies are forwarded to its connector)."""
        return self._clients[client_id].attached

    def next_deadline(self) -> int | None:
        """The earliest deadline of a group admitted and not yet checked by `due` (it may be released already)."""
        return self._deadlines[0][0] if self._deadlines else None

    def due(self, now_ms: int) -> list[str]:
        """The clients with a copy held past its deadline, each once: they are to `leave`."""
        out: dict[str, None] = {}
        dl = self._deadlines
        while dl and dl[0][0] <= now_ms:
            _, cid, last = dl.popleft()
            c = self._clients.get(cid)
            if c is not None and not c.spilling and c.held and next(iter(c.held)) <= last:
                out[cid] = None
        return list(out)

    def attached_to(self, service_id: str) -> list[str]:
        """The clients live on the connector `service_id` (its Forward stream ended: they are to `leave`)."""
        return [cid for cid, c in self._clients.items() if not c.spilling and c.attached.service_id == service_id]

    def clients(self) -> list[str]:
        return [cid for cid, c in self._clients.items() if not c.spilling]

    def leave(self, client_id: str) -> Spill | None:
        """The client leaves held mode: its held tail (maybe empty) is to be written to Redis, then `spilled`
        called. None when it is not in the table (or is spilling already)."""
        c = self._clients.get(client_id)
        if c is None or c.spilling:
            return None
        c.spilling = True
        return Spill(client_id, c.attached, list(c.held.values()), c.serial, c.packet_id, c.serial_end)

    def spilled(self, client_id: str) -> list[tuple[int, int]]:
        """The tail `leave` gave is written to Redis: the client is out of the table; returns the acknowledgements
        (packet id, serial) deferred meanwhile, to apply in Redis now."""
        c = self._clients.pop(client_id, None)
        if c is None:
            return []
        self.bytes -= c.bytes
        for msg in c.held.values():
            self._batch_done(msg.batch)
        return c.deferred

    def unspill(self, client_id: str) -> None:
        """The spill failed and the service gives up on it for now (stopping): the client stays in the table as it
        was, its deferred acknowledgements applied in memory."""
        c = self._clients.get(client_id)
        if c is None or not c.spilling:
            return
        c.spilling = False
        deferred, c.deferred = c.deferred, []
        for pid, serial in deferred:
            self.release(client_id, pid, serial)


def marks_of(spill: Spill) -> dict[int, int]:
    """The highest origin offset per tbmq.msg.all partition among a spill's messages (written with them)."""
    out: dict[int, int] = {}
    for msg in spill.messages:
        if msg.origin is not None:
            part, offset = msg.origin
            if offset > out.get(part, -1):
                out[part] = offset
    return out

