"""MQTT over WebSocket (the WS and WSS listeners): a thin asyncio.Protocol around `wsproto` (sans-io) that
does the HTTP upgrade and the framing, and hands the MQTT bytes to an ordinary `connection.Connection` (the
same per-connection machine as the TCP and TLS listeners) through `_FramingTransport`, which writes each
chunk as one binary message.

Rules (MQTT 5.0 §6 / 3.1.1 §6): the upgrade must ask for `path` and offer the subprotocol "mqtt" (the old
"mqttv3.1" is accepted too), else it is refused (404 / 400); MQTT travels in binary messages only (a text
message closes with 1003); a message may carry any part of a packet (the decoder reassembles them). Pings
are answered by wsproto's Pong. The upgrade must arrive within `handshake_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

log = logging.getLogger("connector.websocket")

SUBPROTOCOLS = ("mqtt", "mqttv3.1")


class _FramingTransport(asyncio.Transport):
    """What the Connection sees as its transport: writes become binary WebSocket messages on the real one."""

    def __init__(self, adapter: WebSocketAdapter, transport: asyncio.Transport) -> None:
        super().__init__()
        self._a = adapter
        self._t = transport

    def write(self, data) -> None:
        if not self._t.is_closing():
            self._t.write(self._a.ws.send(BytesMessage(data=bytes(data))))

    def close(self) -> None:
        self._a.close(1000)

    def abort(self) -> None:
        self._t.abort()

    def is_closing(self) -> bool:
        return self._t.is_closing()

    def pause_reading(self) -> None:
        self._t.pause_reading()

    def resume_reading(self) -> None:
        self._t.resume_reading()

    def get_write_buffer_size(self) -> int:
        return self._t.get_write_buffer_size()

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self._t.set_write_buffer_limits(high=high, low=low)

    def get_extra_info(self, name, default=None):
        return self._t.get_extra_info(name, default)


class WebSocketAdapter(asyncio.Protocol):
    def __init__(self, new_connection: Callable[[], asyncio.Protocol], path: str = "/mqtt",
                 handshake_timeout_s: float = 10.0) -> None:
        self.new_connection = new_connection
        self.path = path
        self.handshake_timeout_s = handshake_timeout_s
        self.ws = WSConnection(ConnectionType.SERVER)
        self.transport: asyncio.Transport | None = None
        self.conn: asyncio.Protocol | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._timer = asyncio.get_running_loop().call_later(self.handshake_timeout_s, self._handshake_expired)

    def _handshake_expired(self) -> None:
        self._timer = None
        if self.conn is None and self.transport is not None:
            log.info("WebSocket %s: no upgrade within %gs; closing", self._peer(), self.handshake_timeout_s)
            self.transport.abort()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)

    def data_received(self, data: bytes) -> None:
        t = self.transport
        try:
            self.ws.receive_data(data)
            for event in self.ws.events():
                cls = event.__class__
                if cls is BytesMessage:
                    if self.conn is not None:
                        self.conn.data_received(event.data)
                elif cls is Request:
                    self._upgrade(event)
                elif cls is Ping:
                    t.write(self.ws.send(event.response()))
                elif cls is CloseConnection:
                    if self.ws.state is ConnectionState.REMOTE_CLOSING:
                        t.write(self.ws.send(event.response()))
                    t.close()
                elif cls is TextMessage:
                    self.close(CloseReason.UNSUPPORTED_DATA, "MQTT uses binary messages")
                if t.is_closing():
                    return
        except RemoteProtocolError as exc:
            log.info("WebSocket %s: %s; closing", self._peer(), exc)
            if self.conn is None and exc.event_hint is not None:
                try:
                    t.write(self.ws.send(exc.event_hint))
                except LocalProtocolError:
                    pass
                t.close()
            else:
                self.close(CloseReason.PROTOCOL_ERROR, str(exc)[:100])

    def _upgrade(self, req: Request) -> None:
        t = self.transport
        path = req.target.split("?", 1)[0]
        offered = [p for p in SUBPROTOCOLS if p in req.subprotocols]
        if path != self.path or not offered:
            status = 404 if path != self.path else 400
            log.info("WebSocket %s: refused upgrade (path %r, subprotocols %s): %d", self._peer(), req.target,
                     req.subprotocols, status)
            t.write(self.ws.send(RejectConnection(status_code=status, has_body=False)))
            t.close()
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        t.write(self.ws.send(AcceptConnection(subprotocol=offered[0])))
        self.conn = self.new_connection()
        self.conn.connection_made(_FramingTransport(self, t))

    def close(self, code: int, reason: str = "") -> None:
        """Close frame (when the WebSocket is open), then the TCP connection."""
        t = self.transport
        if t is None or t.is_closing():
            return
        if self.ws.state is ConnectionState.OPEN:
            t.write(self.ws.send(CloseConnection(code=code, reason=reason or None)))
        t.close()

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.conn.pause_writing()

    def resume_writing(self) -> None:
        if self.conn is not None:
            self.conn.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.conn is not None:
            self.conn.connection_lost(exc)


__all__ = ["WebSocketAdapter", "SUBPROTOCOLS"]
