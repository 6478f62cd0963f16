"""What a `ConnectionMachine` asks its runner to do: one dataclass per kind of effect.

The machine never performs I/O. Each of its input methods appends the effects it causes, in order, to
`machine.effects` (a list the runner drains in order). The runner (the connector's asyncio adapter, or a test) must
run them in that order: a `Send` queued before a `Close` goes out before the connection closes.

Effects the runner answers with an input call (the machine waits for that answer before it goes on):

* `RequestSession` -> `session_answer(resp, now)` / `session_failed(reason, now)`
* `LoadSubscriptions` -> `subscriptions_loaded(subs, now)`
* `ProducePublish` (QoS 1/2) -> `produced(effect, error, now)` once per record (2 when `retain`)
* `ProduceSubscriptions` -> `subscriptions_written(error, now)`
* `WaitRetained` -> `retained_ready(now)` (after the catch-up `CatchUpRetained` started)
* `FetchStored` -> `stored(store_id, messages, now)` (any number of times) then `fetch_finished(store_id, now)`,
  or `fetch_abandoned(store_id, now)`
* `StartTimer` -> `timer_fired(name, now)` at `at_ms` (unless cancelled or restarted)

`Throttle` asks for no answer: the runner reads and handles no further packet of the client before its time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Send:
    """Write `data` (one or more encoded packets, in order) to the client."""

    data: bytes


@dataclass(slots=True)
class Close:
    """Close the transport after everything sent so far (`abort`: drop it at once, unsent bytes included).
    `reason` is for the log, at `log_level` (a `logging` level)."""

    reason: str
    log_level: int
    abort: bool = False


@dataclass(slots=True)
class StartTimer:
    """Call `timer_fired(name, now)` at `at_ms` (epoch ms); replaces a running timer of the same name."""

    name: str
    at_ms: int


@dataclass(slots=True)
class CancelTimer:
    name: str


@dataclass(slots=True)
class Authenticate:
    """Decide who the CONNECT is (tbmq_auth.Authorizer.authenticate: blocked rules, providers, client-id
    pattern, Will); the runner awaits it (a password hash is verified off the event loop) and reports with
    `authenticated`, before the session is requested."""

    request: Any                   # tbmq_auth.AuthRequest


@dataclass(slots=True)
class RequestSession:
    """CONNECTION_REQUEST to the session registry (the runner routes disconnect commands for
    `session.session_id` to `take_over`)."""

    session: Any                   # tbmq.v1 SessionInfo


@dataclass(slots=True)
class SessionStarted:
    """The registry accepted the session: a Will pending for this client id is cancelled [MQTT-3.1.3-9] (or,
    with clean start, sent now: the old session ended [MQTT-3.1.2-8])."""

    client_id: str
    clean_start: bool


@dataclass(slots=True)
class LoadSubscriptions:
    """The session is present: read the client's stored subscription set."""

    client_id: str


@dataclass(slots=True)
class Online:
    """CONNACK sent: live deliveries for `client_id` come to this connection from now on."""

    client_id: str


@dataclass(slots=True)
class ProducePublish:
    """Hand an inbound PUBLISH to Kafka (tbmq.msg.all, and tbmq.msg.retained when `retain`). For QoS 1/2
    the machine keeps this object as the acknowledgement's place in packet order: `pending` counts the
    Kafka acknowledgements still owed (the runner reports each with `produced`)."""

    msg: Any                       # tbmq.v1 PublishMsg
    topic: str
    retain: bool
    qos: int
    packet_id: int | None
    pending: int = 0
    error: BaseException | None = None
    denied: int = 0                # refused (not authorized, a limit): the v5 PUBACK/PUBREC reason code, nothing produced


@dataclass(slots=True)
class ProduceSubscriptions:
    """Write the client's whole subscription set and report Kafka's acknowledgement."""

    client_id: str
    subscriptions: list
    client_type: int


@dataclass(slots=True)
class CatchUpRetained:
    """A SUBSCRIBE that gets retained messages arrived: start catching the retained view up with every
    retained PUBLISH acknowledged before now (asked now, while its subscriptions are written)."""


@dataclass(slots=True)
class WaitRetained:
    """Wait (bounded) for the catch-up started by the last `CatchUpRetained`, then `retained_ready(now)`:
    the SUBACK and its retained messages follow."""


@dataclass(slots=True)
class FetchStored:
    """FetchUndelivered(store_id) for this session: its own store (store id = client id) or a shared group
    store (`group`); the first fetch attaches the store, a `resync` only reads (so does every page after
    the first). One page: serials after `after`, at most `max_messages` / `max_bytes` (0 = no bound)."""

    store_id: str
    resync: bool = False
    group: bool = False
    after: int = 0
    max_messages: int = 0
    max_bytes: int = 0


@dataclass(slots=True)
class DetachStore:
    """This session no longer takes forwards of `store_id` (its own store or a group store)."""

    store_id: str


@dataclass(slots=True)
class AckStored:
    """The client acknowledged a stored message (PUBACK / PUBCOMP, or it was discarded for the client):
    Acknowledge(store_id, packet_id, serial) to device-persistence."""

    store_id: str
    packet_id: int
    serial: int


@dataclass(slots=True)
class PubrecStored:
    """The client sent PUBREC for a stored QoS 2 message: MarkPubrec(store_id, packet_id, serial), then
    `pubrec_stored(client_packet_id)` once device-persistence applied it (the machine sends PUBREL then)."""

    store_id: str
    packet_id: int
    serial: int
    client_packet_id: int


@dataclass(slots=True)
class OpenAppStream:
    """Open (or reopen) the APPLICATION stream to app-delivery with `opening` (a services AppOpen)."""

    opening: Any


@dataclass(slots=True)
class CloseAppStream:
    pass


@dataclass(slots=True)
class AckApp:
    """The client acknowledged an APPLICATION record: AppAck(ref) upstream."""

    ref: Any                       # services AppRecordRef


@dataclass(slots=True)
class ScheduleWill:
    """Publish the Will after `delay` seconds (0: now) unless the session resumes first [MQTT-3.1.3-9]; the
    delay never outlasts the session [MQTT-3.1.2-8]."""

    client_id: str
    session_id: str
    will: Any                      # tbmq_mqtt.Will
    level: int
    delay: int


@dataclass(slots=True)
class ReportDisconnect:
    """DISCONNECTION_REQUEST to the session registry, with the inbound QoS 2 packet ids whose PUBLISH Kafka
    acknowledged and the client has not released (kept with a persistent session, handed back on resume)."""

    session: Any                   # tbmq.v1 SessionInfo
    graceful: bool
    session_expiry: int | None = None
    awaiting_pubrel: tuple = ()


@dataclass(slots=True)
class Throttle:
    """The client is over its PUBLISH rate (MQTT_MAX_PUBLISH_RATE / _BYTES_RATE): read and handle none of its
    packets before `until_ms` (epoch ms). TCP back-pressure then slows the client down; nothing is dropped."""

    until_ms: int


@dataclass(slots=True)
class Finished:
    """The connection is over (emitted once, last): the runner drops every registration and timer."""


__all__ = [
    "AckApp", "AckStored", "Authenticate", "CancelTimer", "CatchUpRetained", "Close", "CloseAppStream", "DetachStore", "FetchStored", "Finished",
    "LoadSubscriptions", "Online", "OpenAppStream", "ProducePublish", "ProduceSubscriptions", "PubrecStored",
    "ReportDisconnect", "RequestSession", "ScheduleWill", "Send", "SessionStarted", "StartTimer", "Throttle",
    "WaitRetained",
]
