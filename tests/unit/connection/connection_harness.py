"""A client driving a `tbmq_connection.ConnectionMachine` with no sockets, no event loop and no sleeps: packets
in, effects out, time passed in (`advance` fires the machine's timers that are due)."""

from __future__ import annotations

import dataclasses

from tbmq.v1 import messages_pb2 as pb
from tbmq_connection import (
    Authenticate,
    CancelTimer,
    Close,
    ConnectionMachine,
    LoadSubscriptions,
    MachineConfig,
    RequestSession,
    Send,
    StartTimer,
)
from tbmq_mqtt import ConnAck, Connect, MqttDecoder, Properties, Role, Will

T0 = 1_700_000_000_000  # epoch ms


def plain(packets: list) -> list:
    """`packets` without their Reason Strings (tests that check reason codes compare these)."""
    out = []
    for p in packets:
        props = getattr(p, "properties", None)
        if props is not None and props.reason_string is not None:
            p = dataclasses.replace(p, properties=dataclasses.replace(props, reason_string=None))
        out.append(p)
    return out


def answer(*, present: bool = False, sei: int = 0, persistent: bool = False,
           client_type: int = pb.CLIENT_TYPE_DEVICE, success: bool = True,
           failure: int = pb.SESSION_FAILURE_UNSPECIFIED_ERROR) -> pb.SessionEventResponse:
    if not success:
        return pb.SessionEventResponse(success=False, failure=failure)
    return pb.SessionEventResponse(success=True, session_present=present, session_expiry_interval=sei,
                                   persistent=persistent, client_type=client_type)


class Client:
    def __init__(self, level: int = 4, *, retained=None, now: int = T0, auth=None, cert_names=(),
                 retained_room=None, total_rate=None, **config) -> None:
        config.setdefault("service_id", "c-1")
        self.cfg = MachineConfig(**config)
        self.m = ConnectionMachine(self.cfg, retained=retained, address="10.0.0.1:50000", auth=auth,
                                   peer_ip="10.0.0.1", cert_names=cert_names, retained_room=retained_room,
                                   total_rate=total_rate)
        self.now = now
        self.level = level
        self.decoder = MqttDecoder(level, role=Role.CLIENT)
        self.received: list = []      # packets the client got, in order
        self.effects: list = []       # every other effect, in order (Send / timers / Close kept apart)
        self.closed: Close | None = None
        self.timers: dict[str, int] = {}
        self.run(self.m.start(now))

    # ---------------------------------------------------------------------------------- running effects
    def run(self, effects) -> None:
        while effects:
            e = effects.pop(0)
            if isinstance(e, Send):
                if self.closed is None:
                    self.received.extend(self.decoder.feed(e.data))
            elif isinstance(e, StartTimer):
                self.timers[e.name] = e.at_ms
            elif isinstance(e, CancelTimer):
                self.timers.pop(e.name, None)
            elif isinstance(e, Close):
                assert self.closed is None, "closed twice"
                self.closed = e
                self.effects.append(e)
            else:
                self.effects.append(e)

    def send(self, packet) -> None:
        self.run(self.m.packet(packet, self.now))

    def call(self, method: str, *args, **kw) -> None:
        """Any other input: `c.call("deliver", msg, 1, False, ())` (now appended)."""
        self.run(getattr(self.m, method)(*args, self.now, **kw))

    def advance(self, ms: int) -> None:
        """Time passes: timers due by then fire, in time order."""
        self.now += ms
        while True:
            due = sorted((at, name) for name, at in self.timers.items() if at <= self.now)
            if not due:
                return
            at, name = due[0]
            del self.timers[name]
            self.run(self.m.timer_fired(name, self.now))

    # ---------------------------------------------------------------------------------- reading results
    def of(self, cls) -> list:
        return [e for e in self.effects if isinstance(e, cls)]

    def take(self) -> list:
        out, self.received = self.received, []
        return out

    def take_effects(self, cls=None) -> list:
        if cls is None:
            out, self.effects = self.effects, []
            return out
        out = [e for e in self.effects if isinstance(e, cls)]
        self.effects = [e for e in self.effects if not isinstance(e, cls)]
        return out

    # ---------------------------------------------------------------------------------- flows
    def connect(self, resp: pb.SessionEventResponse | None = None, *, client_id: str = "dev",
                clean_start: bool = True, keep_alive: int = 0, will: Will | None = None,
                properties: Properties | None = None, subs: dict | None = None, username: str | None = None,
                password: bytes | None = None) -> ConnAck:
        """CONNECT, its authentication (when the machine has an authorizer), the registry's answer (and the
        stored subscriptions when present): the CONNACK."""
        self.send(Connect(protocol_level=self.level, client_id=client_id, clean_start=clean_start,
                          keep_alive=keep_alive, will=will, properties=properties or Properties(),
                          username=username, password=password))
        for a in self.take_effects(Authenticate):
            self.run(self.m.authenticated(self.m.auth.authenticate(a.request, self.now), self.now))
            if self.closed is not None:
                assert not self.of(RequestSession)
                (connack,) = self.take()
                return connack
        (req,) = self.take_effects(RequestSession)
        self.request = req.session
        self.run(self.m.session_answer(resp if resp is not None else answer(), self.now))
        if self.take_effects(LoadSubscriptions):
            self.run(self.m.subscriptions_loaded(subs or {}, self.now))
        packets = self.take()
        assert packets and isinstance(packets[0], ConnAck), packets
        self.received = packets[1:]
        return packets[0]
