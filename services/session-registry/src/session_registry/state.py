"""The session map: the compacted tbmq.client.session as followed by a CompactedTopicView, plus what this
instance has committed but the view has not read back yet (the overlay), plus a batch's uncommitted
changes (Batch). Pure data structures; no I/O.

Overlay rule: every committed write of a client bumps `pending[client]` and sets `overlay[client]`; every
record the view applies for that client lowers it; at 0 the overlay entry goes and the view's value (the
same record) is used. The overlay is dropped entirely after a partition assignment, once the view has
caught up (all writes are committed before partitions are revoked).
"""

from __future__ import annotations

from tbmq.v1 import messages_pb2 as pb

from .logic import APPLICATION, Counts

_MISSING = object()


class SessionStore:
    def __init__(self) -> None:
        self.view: dict[str, pb.SessionInfo] = {}
        self.overlay: dict[str, pb.SessionInfo | None] = {}
        self.pending: dict[str, int] = {}
        self.sessions = 0
        self.applications = 0

    # -- reads ---------------------------------------------------------------------------------------
    def get(self, client_id: str) -> pb.SessionInfo | None:
        if client_id in self.overlay:
            return self.overlay[client_id]
        return self.view.get(client_id)

    def counts(self) -> Counts:
        return Counts(self.sessions, self.applications)

    def items(self):
        """(client id, session) of every effective session (a snapshot)."""
        out = dict(self.view)
        for cid, s in self.overlay.items():
            if s is None:
                out.pop(cid, None)
            else:
                out[cid] = s
        return list(out.items())

    # -- changes -------------------------------------------------------------------------------------
    def _count(self, s: pb.SessionInfo | None, sign: int) -> None:
        if s is not None:
            self.sessions += sign
            if s.client_type == APPLICATION:
                self.applications += sign

    def apply_record(self, key: bytes | None, value: bytes | None) -> None:
        """CompactedTopicView callback."""
        if key is None:
            return
        cid = key.decode("utf-8")
        before = self.get(cid)
        if value is None:
            self.view.pop(cid, None)
        else:
            self.view[cid] = pb.SessionInfo.FromString(value)
        n = self.pending.get(cid, 0)
        if n > 1:
            self.pending[cid] = n - 1
        elif n == 1:
            del self.pending[cid]
            self.overlay.pop(cid, None)
        self._count(before, -1)
        self._count(self.get(cid), +1)

    def committed(self, client_id: str, session: pb.SessionInfo | None) -> None:
        """This instance committed `session` (None = removed) for the client."""
        before = self.get(client_id)
        self.overlay[client_id] = session
        self.pending[client_id] = self.pending.get(client_id, 0) + 1
        self._count(before, -1)
        self._count(session, +1)

    def drop_overlay(self) -> None:
        """After the view caught up with everything committed: the view alone is the truth."""
        for cid in list(self.overlay):
            before = self.get(cid)
            del self.overlay[cid]
            self._count(before, -1)
            self._count(self.get(cid), +1)
        self.pending.clear()


class Batch:
    """One transaction's view of the store: its own writes first, then the store."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self.writes: dict[str, pb.SessionInfo | None] = {}
        self.order: list[tuple[str, pb.SessionInfo | None]] = []
        self._sessions = 0
        self._applications = 0

    def get(self, client_id: str) -> pb.SessionInfo | None:
        if client_id in self.writes:
            return self.writes[client_id]
        return self.store.get(client_id)

    def counts(self) -> Counts:
        c = self.store.counts()
        return Counts(c.sessions + self._sessions, c.applications + self._applications)

    def put(self, client_id: str, session: pb.SessionInfo | None) -> None:
        before = self.get(client_id)
        for s, sign in ((before, -1), (session, +1)):
            if s is not None:
                self._sessions += sign
                if s.client_type == APPLICATION:
                    self._applications += sign
        self.writes[client_id] = session
        self.order.append((client_id, session))

    def commit_to_store(self) -> None:
        for cid, s in self.order:
            self.store.committed(cid, s)
