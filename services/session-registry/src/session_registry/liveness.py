"""Which connector runs are dead, from their heartbeats (tbmq.connector.heartbeat). Pure: the caller passes
the time (`now_ms`, the registry's own clock when it reads a heartbeat, so connector clocks do not matter).

A connector run (service id + incarnation, one per process start) is declared DEAD when:
  * it has been silent longer than TBMQ_CONNECTOR_TIMEOUT_MS (SIGKILL, crash, partition);
  * it said it stopped (a graceful stop: its last heartbeat has `stopped`): at once, no timeout;
  * a newer run of the same service id sent a heartbeat (the old process cannot be running any more).
Once dead, a run stays dead: a heartbeat of it that comes back later (a paused process) does not revive it
(fencing: its requests are refused, logic.decide(fenced=True)). Sessions still connected on a dead run
(`gone`) are ended by CONNECTOR_GONE_REQUESTs (logic.decide_connector_gone). A service id never heard of is never judged.

After a registry restart the compacted topic gives each service's last heartbeat, counted as seen at the
time it is read: a connector that died while no registry ran is declared dead one timeout later.

Silence counts only while the registry could have heard: the heartbeat channel is confirmed working by
every heartbeat read and by the caller's periodic caught-up checks (`confirm`). A gap in confirmations
longer than `gap_ms` (Kafka unreachable or restarting, the registry itself stalled) is an outage of the
channel, not evidence against the connectors, whose heartbeats could not get through either: every run's
silence is counted again from the end of the outage (a Kafka restart longer than the timeout no longer
gets every connector declared dead and fenced).
"""

from __future__ import annotations

from dataclasses import dataclass

from tbmq.v1 import messages_pb2 as pb


@dataclass(slots=True)
class Run:
    incarnation: str
    last_seen_ms: int
    first_seen_ms: int
    dead_since_ms: int | None = None     # None = alive
    stopped: bool = False                # declared dead because it said so


class Liveness:
    def __init__(self, timeout_ms: int) -> None:
        self.timeout_ms = timeout_ms
        # a longer gap between confirmations of the channel is an outage (see the module docstring)
        self.gap_ms = max(timeout_ms // 4, min(1000, timeout_ms // 2))
        self.heard_since_ms: int | None = None  # start of the current stretch of confirmations
        self.confirmed_ms: int | None = None    # the latest confirmation
        self.current: dict[str, Run] = {}                     # service id -> its latest run
        self.dead: dict[tuple[str, str], int] = {}            # (service id, incarnation) -> declared at
        self.last_seen_dead: dict[tuple[str, str], int] = {}  # (service id, incarnation) -> its last heartbeat

    def observe(self, hb: pb.ConnectorHeartbeat, now_ms: int) -> list[tuple[str, str]]:
        """A heartbeat read; returns the runs this declares dead [(service id, incarnation)]."""
        self.confirm(now_ms)
        svc, inc = hb.service_id, hb.incarnation
        if not svc:
            return []
        declared = []
        if (svc, inc) in self.dead:
            return []                                         # a declared-dead run stays dead (fencing)
        cur = self.current.get(svc)
        if cur is not None and cur.incarnation != inc and cur.dead_since_ms is None:
            declared.append(self._declare(svc, cur, now_ms))  # replaced by a newer run
        if cur is not None and cur.incarnation == inc:
            run = cur
            run.last_seen_ms = now_ms
        else:
            run = self.current[svc] = Run(inc, now_ms, now_ms)
        if hb.stopped and run.dead_since_ms is None:
            run.stopped = True
            declared.append(self._declare(svc, run, now_ms))
        return declared

    def confirm(self, now_ms: int) -> None:
        """The heartbeat channel works at `now_ms` (a heartbeat was read, or the caller read the topic up to
        its end). After a gap longer than `gap_ms` since the previous confirmation, silence is counted from
        now: nobody's heartbeat could have been read during the gap."""
        if self.confirmed_ms is None or now_ms - self.confirmed_ms > self.gap_ms:
            self.heard_since_ms = now_ms
        self.confirmed_ms = now_ms

    def needs_confirmation(self, now_ms: int) -> bool:
        """Whether the caller should check the channel now (half a gap without a confirmation, and a run to
        judge): without heartbeats flowing, its checks are what lets silence count."""
        return any(run.dead_since_ms is None for run in self.current.values()) and (
            self.confirmed_ms is None or now_ms - self.confirmed_ms >= self.gap_ms // 2)

    def silent(self, now_ms: int) -> list[str]:
        """Services whose live run has been silent longer than the timeout, counting only the time since
        the channel's last outage (nothing declared yet: the caller first makes sure it has read every
        heartbeat sent so far, then `sweep`s)."""
        if self.heard_since_ms is None:
            return []
        since = self.heard_since_ms
        return [svc for svc, run in self.current.items()
                if run.dead_since_ms is None and now_ms - max(run.last_seen_ms, since) > self.timeout_ms]

    def sweep(self, now_ms: int) -> list[tuple[str, str]]:
        """Declare dead every run silent longer than the timeout; returns them."""
        return [self._declare(svc, self.current[svc], now_ms) for svc in self.silent(now_ms)]

    def _declare(self, svc: str, run: Run, now_ms: int) -> tuple[str, str]:
        run.dead_since_ms = now_ms
        self.dead[(svc, run.incarnation)] = now_ms
        self.last_seen_dead[(svc, run.incarnation)] = run.last_seen_ms
        return svc, run.incarnation

    def fenced(self, service_id: str, incarnation: str) -> bool:
        """A request of this run is refused: the run was declared dead (only an explicit declaration: the
        first requests of a new run may be read before its first heartbeat)."""
        return (service_id, incarnation) in self.dead

    def gone(self, service_id: str, incarnation: str, now_ms: int) -> bool:
        """Whether a session record naming this run belongs to a dead connector run (the scan ends it)."""
        if (service_id, incarnation) in self.dead:
            return True
        cur = self.current.get(service_id)
        if cur is None:
            return False                                      # never heard of: not judged
        if incarnation == cur.incarnation:
            return cur.dead_since_ms is not None
        # a run we hold no heartbeat of (an earlier one compacted away, none for a connector older than
        # heartbeats, or a newer one whose first heartbeat is not read yet): dead when nothing of it was
        # heard for a whole timeout since the service's latest change
        changed = cur.dead_since_ms if cur.dead_since_ms is not None else cur.first_seen_ms
        return now_ms - changed > self.timeout_ms

    def taken_over_will_fate(self, service_id: str, incarnation: str, taken_over_at_ms: int,
                             now_ms: int) -> bool | None:
        """What becomes of the Will of a connection taken over at `taken_over_at_ms` while its connector run
        may have been dead (SessionInfo.taken_over_will): False (drop) once a heartbeat of the run was read
        after the takeover (it was alive then and sent the Will on the takeover command); True (publish) once
        the run is dead without one (it died before the takeover: nobody sent it); None: not known yet. A run
        that dies within one heartbeat interval after a takeover it handled has its Will sent twice."""
        cur = self.current.get(service_id)
        if cur is not None and cur.incarnation == incarnation:
            last = cur.last_seen_ms
        else:
            last = self.last_seen_dead.get((service_id, incarnation))
        if last is not None and last > taken_over_at_ms:
            return False
        if self.gone(service_id, incarnation, now_ms):
            return True
        return None

    def dead_services(self, now_ms: int, for_ms: int) -> list[str]:
        """Services whose latest run has been dead at least `for_ms` (their per-connector topics can go)."""
        return [svc for svc, run in self.current.items()
                if run.dead_since_ms is not None and now_ms - run.dead_since_ms >= for_ms]

    def forget(self, service_id: str) -> None:
        """The service's topics were deleted: it is not followed any more (a new run starts afresh)."""
        self.current.pop(service_id, None)

