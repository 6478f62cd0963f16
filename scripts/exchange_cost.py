"""CPU per exchange between two processes, by rate: a gRPC stream round trip (one message written, one answer
read, as the router's Persist stream and device-persistence's Forward stream do) against the same round trip
over a plain asyncio TCP connection, and, with no exchange at all, a small fixed piece of Python work (a dict
of 300 entries built, about 40 µs) timed alone (`time.thread_time` around it) after the same pauses. When
grpclib is installed (it is not in requirements.lock: `.venv/bin/pip install grpclib`), the same stream spoken
by grpclib too (HTTP/2 in Python on the event loop, no gRPC threads). A measurement tool (docs/performance.md,
"The fifteenth round" and "The seventeenth round"), not a test: it asserts nothing.

    .venv/bin/python scripts/exchange_cost.py [round trips per step] [rate ...]

Rates are round trips (or pieces of work) per second; 0 = back to back. Default: 300 round trips at 0, 1000,
200 and 70 per second. The client runs here, the server in a spawned process, both on uvloop; each side's CPU
(user + system, every thread) is read with getrusage around the step. The message is a PersistBatch of 14
records of 150 bytes (what a router batch carries at 1,000 msg/s in the bench's p2p load); the answer a
PersistAnswer."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.calibrate import process_cpu_s  # noqa: E402

RECORDS = [b"x" * 150] * 14
PERSIST = "/tbmq.v1.DevicePersistence/Persist"


def _serve(kind: str, conn) -> None:
    import uvloop

    async def main() -> None:
        if kind == "grpc":
            import grpc
            from tbmq.v1 import services_pb2 as spb
            from tbmq.v1 import services_pb2_grpc as sgrpc

            class Servicer(sgrpc.DevicePersistenceServicer):
                async def Persist(self, requests, context):
                    async for batch in requests:
                        await context.write(spb.PersistAnswer(seq=batch.seq, saved=len(batch.records)))

            server = grpc.aio.server()
            sgrpc.add_DevicePersistenceServicer_to_server(Servicer(), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
        elif kind == "grpclib":  # the same stream, spoken by grpclib (HTTP/2 in Python on the event loop)
            from grpclib.const import Cardinality, Handler
            from grpclib.server import Server
            from tbmq.v1 import services_pb2 as spb

            class Service:
                async def persist(self, stream) -> None:
                    async for batch in stream:
                        await stream.send_message(spb.PersistAnswer(seq=batch.seq, saved=len(batch.records)))

                def __mapping__(self):
                    return {PERSIST: Handler(self.persist, Cardinality.STREAM_STREAM, spb.PersistBatch,
                                             spb.PersistAnswer)}

            sock = socket.create_server(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            server = Server([Service()])
            await server.start(sock=sock)
        else:
            async def handle(reader, writer):
                try:
                    while True:
                        (n,) = struct.unpack(">I", await reader.readexactly(4))
                        await reader.readexactly(n)
                        writer.write(struct.pack(">I", 8) + b"answered")
                except asyncio.IncompleteReadError:
                    writer.close()

            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
        conn.send(port)
        loop = asyncio.get_running_loop()
        while True:  # "cpu" -> this process's CPU so far; "stop" -> exit
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd == "stop":
                return
            conn.send(process_cpu_s())

    uvloop.run(main())


async def _client(kind: str, port: int, n: int, rates: list[float], server) -> list[tuple[float, float, float]]:
    if kind == "grpc":
        import grpc
        from tbmq.v1 import services_pb2 as spb
        from tbmq.v1 import services_pb2_grpc as sgrpc

        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call = sgrpc.DevicePersistenceStub(channel).Persist()

        async def round_trip(i: int) -> None:
            await call.write(spb.PersistBatch(seq=i, records=RECORDS))
            await call.read()
    elif kind == "grpclib":
        from grpclib.client import Channel
        from grpclib.const import Cardinality
        from tbmq.v1 import services_pb2 as spb

        gchannel = Channel("127.0.0.1", port)
        stream = gchannel.request(PERSIST, Cardinality.STREAM_STREAM, spb.PersistBatch, spb.PersistAnswer)
        await stream.__aenter__()
        await stream.send_request()

        async def round_trip(i: int) -> None:
            await stream.send_message(spb.PersistBatch(seq=i, records=RECORDS))
            await stream.recv_message()
    else:
        from tbmq.v1 import services_pb2 as spb

        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def round_trip(i: int) -> None:
            body = spb.PersistBatch(seq=i, records=RECORDS).SerializeToString()
            writer.write(struct.pack(">I", len(body)) + body)
            (m,) = struct.unpack(">I", await reader.readexactly(4))
            await reader.readexactly(m)

    for i in range(20):  # connected and warm
        await round_trip(i)
    out = []
    for rate in rates:
        server.send("cpu")
        s0, c0 = server.recv(), process_cpu_s()
        for i in range(n):
            await round_trip(i)
            if rate:
                await asyncio.sleep(1 / rate)
        c1 = process_cpu_s()
        server.send("cpu")
        s1 = server.recv()
        out.append((rate, (c1 - c0) / n * 1e6, (s1 - s0) / n * 1e6))
    if kind == "grpc":
        await channel.close()
    elif kind == "grpclib":
        gchannel.close()
    else:
        writer.close()
    return out


def _work() -> int:
    d = {}
    for i in range(300):
        d[i] = str(i)
    return len(d)


async def _alone(n: int, rates: list[float]) -> list[float]:
    out = []
    for rate in rates:
        spent = 0.0
        for _ in range(n):
            t = time.thread_time()
            _work()
            spent += time.thread_time() - t
            if rate:
                await asyncio.sleep(1 / rate)
        out.append(spent / n * 1e6)
    return out


def _label(rate: float) -> str:
    return "back2back" if not rate else f"{rate:g}"


def main() -> None:
    import uvloop

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    rates = [float(r) for r in sys.argv[2:]] or [0.0, 1000.0, 200.0, 70.0]
    ctx = mp.get_context("spawn")  # never fork a process that has started gRPC
    print(f"{n} round trips per step; CPU in us per round trip (user + system, all threads)")
    print(f"{'exchange':10s} {'rate/s':>8s} {'client':>8s} {'server':>8s} {'both':>8s}")
    try:
        import grpclib  # noqa: F401
        kinds = ("grpc", "grpclib", "tcp")
    except ImportError:  # not in requirements.lock: `.venv/bin/pip install grpclib` for its rows
        kinds = ("grpc", "tcp")
        print("(grpclib not installed: no grpclib rows)")
    for kind in kinds:
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(kind, there), daemon=True)
        proc.start()
        port = here.recv()
        for rate, client, server in uvloop.run(_client(kind, port, n, rates, here)):
            print(f"{kind:10s} {_label(rate):>8s} {client:8.0f} {server:8.0f} {client + server:8.0f}", flush=True)
        here.send("stop")
        proc.join(10)
    for rate, us in zip(rates, uvloop.run(_alone(n, rates))):
        print(f"{'work':10s} {_label(rate):>8s} {us:8.0f} {'-':>8s} {us:8.0f}", flush=True)


if __name__ == "__main__":
    main()
