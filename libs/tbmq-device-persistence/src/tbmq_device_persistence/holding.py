"""Held forwards applied (DEVICE_PERSISTENCE_HELD; docs/device-persistence.md, "Held forwards"): the pure table (held.py) decides, this
adapter does the Redis calls, the forwards and the Persist batches' futures.

Guarantee (on top of service.py's): a Persist batch with held copies is answered (the router commits its
tbmq.msg.all offsets) only when each held copy is acknowledged by its client (and the origin marks of those are in
Redis) or written to Redis (`spill_held.lua`); so nothing acknowledged to a publisher depends on memory alone. A
client enters held mode only while Redis stores nothing of it (`reserve_held.lua`, under the batch lock, so no save
of the client runs between the check and the entry), and leaves it by writing its held tail to Redis first: before
any of its session's fetches, detaches and clears is served, when its connector's Forward stream ends, at its
copies' deadline, on a copy the table refuses, before a revoke and at stop. Every spill runs under the batch lock, so
a client's spill and its next save are ordered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from redis.exceptions import RedisError
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb
from tbmq_platform.backoff import Backoff

from .forward import ForwardRegistry
from .held import Copy, HeldBatch, HeldTable, Released, marks_of
from .store import Attachment, DeviceMsgStore, SaveResult

log = logging.getLogger(__name__)

MAX_CANDIDATES = 100_000  # clients remembered as live with everything forwarded (an LRU): they may enter
SPILL_ATTEMPTS_AT_STOP = 3
PUBLISH_TYPE = pb.DEVICE_PACKET_TYPE_PUBLISH


class Holding:
    def __init__(self, store: DeviceMsgStore, forwards: ForwardRegistry, lock: asyncio.Lock, *, hold_ms: int,
                 block: int, client_bytes: int, total_bytes: int, handed_out_limit: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.forwards = forwards
        self.lock = lock  # the service's batch lock: saves and spills one at a time
        self.block = block
        self.table = HeldTable(hold_ms=hold_ms, client_bytes=client_bytes, total_bytes=total_bytes,
                               handed_out_limit=handed_out_limit)
        self._clock = clock
        self._candidates: OrderedDict[str, Attachment] = OrderedDict()
        self._marks: dict[str, dict[int, int]] = {}  # collected, not yet written
        self._batches: list[HeldBatch] = []  # finished, waiting for their marks to be written
        self._wake = asyncio.Event()  # set by an admit while the deadline loop sleeps without a deadline
        self._idle = False
        self._marks_lock = asyncio.Lock()  # one marks write at a time: a batch is answered after ITS marks
        self._task: asyncio.Task | None = None
        self._spilling: set[asyncio.Task] = set()  # spills for session events and stream ends
        self._stopping = False
        self.stats: Counter = Counter()

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._deadlines(), name="held deadlines")

    async def stop(self) -> None:
        """Every held tail written to Redis (a few attempts: what is not stays uncommitted and is routed again)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._spilling:
            await asyncio.gather(*self._spilling, return_exceptions=True)
        async with self.lock:
            await self.spill(self.table.clients(), "stop")

    def health(self) -> dict:
        return {"held_clients": len(self.table), "held_bytes": self.table.bytes,
                **{f"held_{k}": v for k, v in self.stats.items()}}

    # ------------------------------------------------------------------------------------ the persist path

    def admit(self, groups: dict[str, list[pb.PublishMsg]], origins: dict, batch: HeldBatch) -> tuple[int, list[str]]:
        """(Caller holds the batch lock.) The copies of clients in held mode taken out of `groups` / `origins`,
        handed out and forwarded at once. Returns (how many were held, the held clients whose copies the table
        refused: the caller spills them before their copies are saved as today)."""
        table = self.table
        now = self._now_ms()
        by_service: dict[str, spb.ForwardBatch] = {}
        held = 0
        refused = []
        for cid in [c for c in groups if c in table]:
            msgs = groups[cid]
            origs = origins.get(cid) or [None] * len(msgs)
            got = table.admit(cid, [Copy(m, o, m.ByteSize(), m.qos) for m, o in zip(msgs, origs)], now, batch)
            if got is None:
                refused.append(cid)
                continue
            del groups[cid]
            origins.pop(cid, None)
            service = table.attached(cid).service_id
            fb = by_service.get(service)
            if fb is None:
                fb = by_service[service] = spb.ForwardBatch()
            for h in got:
                dmsg = pb.DevicePublishMsg(client_id=cid, packet_id=h.packet_id, serial=h.serial,
                                           packet_type=PUBLISH_TYPE, msg=h.payload)
                h.payload = dmsg  # kept as handed out: a spill writes it as it is
                # appended as a copy: a held copy built in place inside the ForwardDown made p2p at 2,500 msg/s
                # slower (p99 105-402 ms against 62-74 in four runs each, docs/performance.md, "The fifty-second
                # round"), for a few us saved
                fb.messages.append(dmsg)
            held += len(got)
        if by_service:
            self.forwards.forward(by_service)
            if self._idle:
                self._wake.set()
        self.stats["held"] += held
        return held, refused

    def saved(self, results: dict[str, SaveResult]) -> None:
        """A save's results: a client live with everything forwarded may enter held mode once its store is empty."""
        cands = self._candidates
        for cid, res in results.items():
            if res.attached is not None and res.messages and res.forwarded == len(res.messages) and not res.paused:
                cands[cid] = res.attached
                cands.move_to_end(cid)
                if len(cands) > MAX_CANDIDATES:
                    cands.popitem(last=False)
            else:
                cands.pop(cid, None)

    # ------------------------------------------------------------------------------------ acknowledgements

    async def apply_acks(self, acks: list[tuple[str, int, int]], pubrecs: list[tuple[str, int, int]]) -> tuple[int, int]:
        """store.apply_acks with held copies released in memory first. Raises as store.apply_acks does (then
        nothing of Redis's part is known to be applied; the held releases stand: they need no Redis)."""
        table = self.table
        rest = []
        released = 0
        for ack in acks:
            outcome = table.release(*ack)
            if outcome is Released.NOT_HELD:
                rest.append(ack)
            else:
                released += 1
        self.stats["released"] += released
        acknowledged, marked = await self.store.apply_acks(rest, pubrecs) if rest or pubrecs else (0, 0)
        if rest and not self._stopping:
            cands = {cid: att for cid, _, _ in rest
                     if (att := self._candidates.get(cid)) is not None and cid not in table}
            if cands:
                await self._enter(cands)
        await self.write_marks()
        return acknowledged + released, marked

    async def _enter(self, cands: dict[str, Attachment]) -> None:
        async with self.lock:  # no save of these clients between Redis's check and the entry
            cands = {cid: att for cid, att in cands.items() if cid not in self.table}
            try:
                got = await self.store.reserve_held(cands, self.block)
            except (RedisError, OSError) as exc:
                log.debug("reserve_held failed (%r): the clients stay as they are", exc)
                return
            for cid, cursor in got.items():
                self._candidates.pop(cid, None)
                if cursor is not None:
                    serial, pid, end = cursor
                    self.table.enter(cid, cands[cid], serial, pid, end)
                    self.stats["entered"] += 1

    async def write_marks(self) -> None:
        """The origin marks the releases moved written to Redis, then the batches they finished answered (one write
        at a time, so a batch is never answered while its marks are still being written). On a Redis error both
        wait for the next call (the deadline loop retries)."""
        async with self._marks_lock:
            got = self.table.collect()
            _merge(self._marks, got.marks)
            self._batches += got.batches
            if self._marks:
                marks, self._marks = self._marks, {}
                try:
                    await self.store.held_marks(marks)
                except (RedisError, OSError) as exc:
                    log.warning("writing the origin marks of %d held clients failed (%r): retried", len(marks), exc)
                    _merge(self._marks, marks)
                    return
            batches, self._batches = self._batches, []
            for b in batches:
                if not b.token.done():
                    b.token.set_result(None)

    # ------------------------------------------------------------------------------------ leaving held mode

    async def leave(self, client_id: str, reason: str) -> None:
        """Before a session event of the client (fetch, detach, clear) is served: its held tail in Redis."""
        self._candidates.pop(client_id, None)
        if client_id in self.table:
            await self._spill_apart(lambda: [client_id], reason)

    async def leave_service(self, service_id: str) -> None:
        """A connector's Forward stream ended: its held clients' tails in Redis (its resync reads them)."""
        if self.table.attached_to(service_id):
            await self._spill_apart(lambda: self.table.attached_to(service_id), "stream ended")

    async def _spill_apart(self, clients: Callable[[], list[str]], reason: str) -> None:
        """A spill under the batch lock in a task of its own: a gRPC handler cancelled meanwhile (its call ended)
        does not stop it halfway."""
        async def run() -> None:
            async with self.lock:
                await self.spill(clients(), reason)

        task = asyncio.get_running_loop().create_task(run(), name=f"held spill ({reason})")
        self._spilling.add(task)
        task.add_done_callback(self._spilling.discard)
        await asyncio.shield(task)

    async def spill(self, client_ids: Iterable[str], reason: str) -> None:
        """(Caller holds the batch lock.) The clients' held tails written to Redis, retried while Redis fails (a
        few attempts when stopping: the copies not written stay unanswered, their router routes them again)."""
        spills = [s for cid in client_ids if (s := self.table.leave(cid)) is not None]
        if not spills:
            return
        batch = {s.client_id: (marks_of(s), [m.payload for m in s.messages]) for s in spills}
        cursors = {s.client_id: (s.serial_end, s.packet_id) for s in spills}
        backoff = Backoff()
        attempts = 0
        while True:
            try:
                await self.store.spill_held(batch, cursors=cursors)
                break
            except asyncio.CancelledError:  # stopping: they stay held (and are spilled again, or replayed)
                for s in spills:
                    self.table.unspill(s.client_id)
                raise
            except (RedisError, OSError) as exc:
                attempts += 1
                if self._stopping and attempts >= SPILL_ATTEMPTS_AT_STOP:
                    log.warning("spilling %d held clients failed at stop (%r): left unanswered", len(spills), exc)
                    for s in spills:
                        self.table.unspill(s.client_id)
                    return
                delay = backoff.next()
                log.warning("spilling %d held clients failed (%r); retrying in %.1fs", len(spills), exc, delay)
                await asyncio.sleep(delay)
        deferred = []
        for s in spills:
            deferred += [(s.client_id, pid, serial) for pid, serial in self.table.spilled(s.client_id)]
        self.stats[f"spilled_{reason.replace(' ', '_')}"] += sum(len(s.messages) for s in spills)
        if deferred:
            with contextlib.suppress(RedisError, OSError):  # not applied: stored, handed out again next session
                await self.store.apply_acks(deferred)
        await self.write_marks()

    async def _deadlines(self) -> None:
        """Spills the clients whose copies passed their deadline, at most every hold/4 (a copy is written at most
        that late), and retries marks Redis refused; sleeps while nothing is held."""
        table = self.table
        tick = table.hold_ms / 4000
        while True:
            nxt = table.next_deadline()
            if nxt is None and not (self._marks or self._batches):
                self._idle = True
                self._wake.clear()
                await self._wake.wait()
                self._idle = False
                continue
            await asyncio.sleep(tick if nxt is None else max((nxt - self._now_ms()) / 1000, tick))
            due = table.due(self._now_ms())
            if due:
                async with self.lock:
                    await self.spill(due, "deadline")
            if self._marks or self._batches:
                await self.write_marks()


def _merge(into: dict[str, dict[int, int]], marks: dict[str, dict[int, int]]) -> None:
    """Marks merged per client and partition, the higher offset kept."""
    for cid, parts in marks.items():
        mine = into.setdefault(cid, {})
        for part, offset in parts.items():
            if offset > mine.get(part, -1):
                mine[part] = offset
