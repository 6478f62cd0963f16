"""Fakes for driving connector.connection.Connection (the asyncio adapter) without Kafka or gRPC: a
`ConnectionPort` (FakePort), a device-persistence client whose fetches wait for the test's answer
(FakeDevice) and a transport that records what is written (FakeTransport). Timers on a clock the test
advances: tests/fake_timers.py."""

from __future__ import annotations

import asyncio
import functools
from collections import Counter

from connector.connection import Connection
from connector.settings import ConnectorSettings
from tbmq.v1 import messages_pb2 as pb
from tbmq_connection.limits import Admission
from tbmq_connection import ConnectionMachine, MachineConfig
from tbmq_mqtt import Connect, MqttDecoder, Properties, Role, encode
from tbmq_platform.settings import load
from waits import wait_until


class FakeDevice:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.answers: dict[str, asyncio.Future] = {}
        self.pages: list[tuple] = []  # (client id, after, max_messages, max_bytes) of every fetch
        self.marks: list = []  # the `done` of each mark_pubrec not applied yet
        self.serials: dict[tuple, int] = {}  # ("ack" | "pubrec", client id, packet id) -> the serial sent with it

    async def fetch(self, client_id, service_id, session_id, *, resync=False, after=0, max_messages=0,
                    max_bytes=0):
        self.calls.append(("fetch", client_id, session_id))
        self.pages.append((client_id, after, max_messages, max_bytes))
        if resync:
            self.calls.append(("resync", client_id, session_id))
        fut = self.answers.setdefault(client_id, asyncio.get_running_loop().create_future())
        answer = await fut
        del self.answers[client_id]  # the next fetch waits for its own answer
        yield answer  # the page in one part (grpc_clients.DevicePersistenceClient.fetch: parts as read)

    def answer(self, client_id, messages, more=False) -> None:
        fut = self.answers.setdefault(client_id, asyncio.get_running_loop().create_future())
        fut.set_result((list(messages), more))

    def acknowledge(self, client_id, packet_id, serial=0):
        self.calls.append(("ack", client_id, packet_id))
        self.serials[("ack", client_id, packet_id)] = serial

    def mark_pubrec(self, client_id, packet_id, serial=0, done=None):
        self.calls.append(("pubrec", client_id, packet_id))
        self.serials[("pubrec", client_id, packet_id)] = serial
        self.marks.append(done)

    def apply_marks(self) -> None:
        """The PUBREC marks made so far are applied (AckBatcher calls `done` then)."""
        marks, self.marks = self.marks, []
        for done in marks:
            if done is not None:
                done()

    def detach(self, client_id, session_id):
        self.calls.append(("detach", client_id, session_id))

    def of(self, kind):
        return [c[1:] for c in self.calls if c[0] == kind]


class FakeTransport:
    def __init__(self) -> None:
        self.data = b""
        self.closed = False
        self.aborted = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name, default=None):
        return ("10.0.0.1", 50000) if name == "peername" else default

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def packets(self, level: int) -> list:
        """Everything written so far, decoded as the client sees it (and cleared)."""
        data, self.data = self.data, b""
        return MqttDecoder(level, role=Role.CLIENT).feed(data)


class FakePort:
    """connector.port.ConnectionPort with recording fakes; the registry answers every request with `answer`."""

    def __init__(self, answer: pb.SessionEventResponse | None = None, *, subs: dict | None = None,
                 env: dict | None = None) -> None:
        self.settings = load(ConnectorSettings, env or {})
        self.admission = Admission(self.settings.max_connections, self.settings.connect_rate_per_ip,
                                   self.settings.connect_burst_per_ip)
        self.clock = 0.0  # the admission's time (the test advances it)
        self.stats: Counter = Counter()
        self.spans = False
        self.device = FakeDevice()
        self.answer = answer or pb.SessionEventResponse(success=True)
        self.subs = subs or {}
        self.connections: set = set()
        self.by_session: dict = {}
        self.by_client: dict = {}
        self.by_store: dict = {}
        self.requests: list[pb.SessionInfo] = []
        self.disconnects: list[tuple[pb.SessionInfo, bool, int | None]] = []
        self.wills: list[tuple] = []
        self.started: list[tuple] = []
        self.app_streams: list = []
        self.produced: list[tuple] = []
        self.subscription_sets: list = []
        self.bg: list = []

    auth = None  # a tbmq_auth.Authorizer: CONNECT authenticated, PUBLISH / SUBSCRIBE authorized

    def new_machine(self, address: str, peer_ip: str = "", cert_names: tuple[str, ...] = ()) -> ConnectionMachine:
        return ConnectionMachine(MachineConfig(service_id="c-1"), stats=self.stats, address=address,
                                 auth=self.auth, peer_ip=peer_ip, cert_names=cert_names)

    async def authenticate(self, request):
        return self.auth.authenticate(request, 0)

    def admit(self, ip: str):
        return self.admission.admit(len(self.connections), ip, self.clock)  # the service's rule, a fake clock

    def connection_opened(self, conn) -> None:
        self.connections.add(conn)

    def connection_closed(self, conn) -> None:
        self.connections.discard(conn)
        for table in (self.by_session, self.by_client):
            for k in [k for k, v in table.items() if v is conn]:
                del table[k]

    def route_session(self, session_id, conn) -> None:
        self.by_session[session_id] = conn

    def route_client(self, client_id, conn) -> None:
        self.by_client[client_id] = conn

    def route_store(self, store_id, conn) -> None:
        self.by_store[store_id] = conn

    def unroute_store(self, store_id, conn) -> None:
        if self.by_store.get(store_id) is conn:
            del self.by_store[store_id]

    produce_gate: asyncio.Future | None = None  # while set and not done, a hand-over waits for it (a full batch)
    produce_error: BaseException | None = None  # raised by the hand-over, before any wait

    async def produce_publish(self, msg, topic, retain, headers=None):
        if self.produce_error is not None:
            raise self.produce_error
        if self.produce_gate is not None:
            await self.produce_gate
        self.produced.append((msg, topic, retain))
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(2 if retain else 1)]
        for f in futs:
            f.set_result(None)
        return futs[0], (futs[1] if retain else None)

    async def produce_subscriptions(self, client_id, subs, client_type) -> None:
        self.subscription_sets.append(list(subs))

    async def request_session(self, session):
        self.requests.append(pb.SessionInfo.FromString(session.SerializeToString()))
        return self.answer

    def report_disconnect(self, session, graceful, session_expiry, awaiting_pubrel=()) -> None:
        self.disconnects.append((pb.SessionInfo.FromString(session.SerializeToString()), graceful, session_expiry))
        self.awaiting_pubrel = getattr(self, "awaiting_pubrel", []) + [list(awaiting_pubrel)]

    async def subscriptions_of(self, client_id) -> dict:
        return dict(self.subs)

    def retained_caught_up(self):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        self.retained_waits = getattr(self, "retained_waits", 0) + 1
        return fut

    def session_started(self, client_id, clean_start) -> None:
        self.started.append((client_id, clean_start))

    def schedule_will(self, client_id, session_id, will, level, delay) -> None:
        self.wills.append((client_id, will, delay))

    def open_app_stream(self, opening, on_record, on_records):
        stream = FakeAppStream(opening)
        self.app_streams.append(stream)
        return stream

    def spawn_bg(self, coro) -> None:
        self.bg.append(asyncio.get_running_loop().create_task(coro))


class FakeAppStream:
    def __init__(self, opening) -> None:
        self.opening = opening
        self.acks: list = []
        self.stopped = False

    def ack(self, ref) -> None:
        self.acks.append(ref)

    async def stop(self) -> None:
        self.stopped = True


# the one bounded wait (tests/waits.py), polling at every event-loop turn: the fakes answer without I/O
until = functools.partial(wait_until, timeout=5, step=0)


async def connected(port: FakePort, connect: Connect) -> tuple[Connection, FakeTransport, list]:
    """A Connection on a FakeTransport that received `connect` and the registry's answer: (conn, transport,
    packets the client got, CONNACK first)."""
    conn = Connection(port)
    transport = FakeTransport()
    conn.connection_made(transport)
    conn.data_received(encode(connect, connect.protocol_level))
    await until(lambda: bool(transport.data) or transport.closed)
    return conn, transport, transport.packets(connect.protocol_level)


def v5_connect(*, client_id: str = "dev", clean_start: bool, sei: int | None, keep_alive: int = 30) -> Connect:
    props = Properties(session_expiry_interval=sei) if sei is not None else Properties()
    return Connect(protocol_level=5, client_id=client_id, clean_start=clean_start, keep_alive=keep_alive,
                   properties=props)
