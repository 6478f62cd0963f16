"""Will messages waiting for their v5 Will Delay.

A Will scheduled with a delay is cancelled when the client reconnects to the same session before the delay
passes [MQTT-3.1.3-9], and sent at once when the session ends first [MQTT-3.1.2-8]. Both are seen:

* on this connector: `on_connected(client_id, clean_start)` when a new connection of the client is accepted;
* on another connector: the connector follows tbmq.client.session (`on_session_record`) and looks only at
  the client ids that have a pending Will: a newer connected session cancels it (or, with clean start,
  sends it: the old session ended), a removed session (null record) sends it.

The delay runs on `call_later(delay, fn, *args)` (default: the running asyncio loop's), so unit tests drive
it with a fake timer instead of waiting [MQTT-3.1.3-9].
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tbmq.v1 import messages_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingWill:
    session_id: str
    will: object          # tbmq_mqtt.Will
    level: int
    handle: "Cancellable | None"


class Cancellable(Protocol):
    def cancel(self) -> None: ...


CallLater = Callable[..., Cancellable]  # (delay_s, fn, *args) -> a handle with cancel(), as loop.call_later


def _loop_call_later(delay: float, fn: Callable[..., Any], *args: Any) -> Cancellable:
    return asyncio.get_running_loop().call_later(delay, fn, *args)


class Wills:
    def __init__(self, publish: Callable[[str, object, int], None], call_later: CallLater = _loop_call_later) -> None:
        self._publish = publish   # (client_id, will, level) -> None: produces it like a PUBLISH
        self._call_later = call_later
        self.pending: dict[str, PendingWill] = {}
        self.sent = 0

    def schedule(self, client_id: str, session_id: str, will, level: int, delay: float) -> None:
        old = self.pending.pop(client_id, None)
        if old is not None and old.handle is not None:
            old.handle.cancel()
        if delay <= 0:
            self._fire(client_id, will, level)
            return
        handle = self._call_later(delay, self._timer, client_id, session_id)
        self.pending[client_id] = PendingWill(session_id, will, level, handle)

    def _timer(self, client_id: str, session_id: str) -> None:
        p = self.pending.get(client_id)
        if p is not None and p.session_id == session_id:
            del self.pending[client_id]
            self._fire(client_id, p.will, p.level)

    def _fire(self, client_id: str, will, level: int) -> None:
        self.sent += 1
        try:
            self._publish(client_id, will, level)
        except Exception:
            log.exception("will of %r not published", client_id)

    def fire_now(self, client_id: str) -> None:
        p = self.pending.pop(client_id, None)
        if p is not None:
            if p.handle is not None:
                p.handle.cancel()
            self._fire(client_id, p.will, p.level)

    def cancel(self, client_id: str) -> None:
        p = self.pending.pop(client_id, None)
        if p is not None and p.handle is not None:
            p.handle.cancel()

    def on_connected(self, client_id: str, clean_start: bool) -> None:
        """A new connection of `client_id` was accepted (here or, via the session topic, elsewhere)."""
        if client_id not in self.pending:
            return
        if clean_start:
            self.fire_now(client_id)   # the old session ended: its Will goes now
        else:
            self.cancel(client_id)     # reconnected to the session in time: no Will [MQTT-3.1.3-9]

    def on_session_record(self, key: bytes | None, value: bytes | None) -> None:
        """Apply function of the tbmq.client.session view: only clients with a pending Will matter."""
        if not self.pending or key is None:
            return
        client_id = key.decode("utf-8", "replace")
        p = self.pending.get(client_id)
        if p is None:
            return
        if value is None:
            self.fire_now(client_id)
            return
        info = pb.SessionInfo.FromString(value)
        if info.session_id != p.session_id and info.connected:
            self.on_connected(client_id, info.clean_start)

    def stop(self, send: bool) -> None:
        """Shutdown: pending Wills are sent now when `send` (their connector is going away), else dropped."""
        for client_id in list(self.pending):
            if send:
                self.fire_now(client_id)
            else:
                self.cancel(client_id)
