"""How fast this host is at the two things tbmq-py spends its CPU on, measured before the brokers start, so
that runs on different machines, or on the same VM type another day, can be compared.

- `python_us`: a fixed pure-Python workload (dict, str, bytes and int operations, like the services'
  per-message code), µs per round of 1,000 operations, on each cpu in turn: the two vCPUs of the bench's
  VM were seen to differ by up to 1.9× (405 against 751 µs) for seconds or minutes at a time, the slow one
  changing, with no steal time in /proc/stat;
- `exchange_us` / `exchange_cpu_us`: one 64-byte message there and back between two processes over a
  loopback TCP connection, each blocked in recv until the other writes (so every message wakes a
  sleeping process, as every hop between the suite's processes, Kafka and Redis does): wall time and the
  CPU both processes used, per round trip.

The two answer different questions: a broker in one process (Mosquitto, amqtt) pays mostly the first, tbmq-py
(six services, Kafka and Redis exchanging a few messages per MQTT message) also the second, which depends on
the hypervisor (waking a process on another vCPU) more than on the CPU's speed. Each is the best of `rounds`
timings (the least disturbed).
"""

from __future__ import annotations

import os
import resource
import socket
import time

MSG = b"x" * 64
ASK = b"?" * 64  # "your CPU time?"


def _python_round() -> int:
    d: dict[str, int] = {}
    total = 0
    for i in range(1000):
        key = "client-%d" % (i % 97)
        d[key] = d.get(key, 0) + i
        total += len(key.encode()) + (i * 31) % 7
    return total + len(d)


def python_round_cpu_us() -> float:
    """One `_python_round` in this thread's own CPU time, µs (the per-step probe of bench.procmon)."""
    t0 = time.thread_time()
    _python_round()
    return round((time.thread_time() - t0) * 1e6, 1)


def python_us(rounds: int = 7, repeat: int = 200) -> float:
    """µs per `_python_round`, best of `rounds`."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeat):
            _python_round()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return round(best * 1e6, 1)


def _recv_exactly(s: socket.socket, n: int) -> bytes | None:
    """`n` bytes from `s`; None when the connection closed first."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def process_cpu_s() -> float:
    """This process's CPU time so far (user + system, every thread), seconds."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def exchange_us(rounds: int = 7, repeat: int = 2000) -> tuple[float, float]:
    """(wall µs, CPU µs of both processes) per round trip between this process and a forked echo process,
    best of `rounds` (by wall time)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    addr = srv.getsockname()
    pid = os.fork()
    if pid == 0:  # the echo process: answers each message (ASK with its CPU time) until the connection closes
        try:
            srv.close()
            c = socket.create_connection(addr)
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while (m := _recv_exactly(c, len(MSG))) is not None:
                c.sendall(b"%-64.9f" % process_cpu_s() if m == ASK else MSG)
        finally:
            os._exit(0)
    a = None
    try:
        a, _ = srv.accept()
        a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def cpu_both() -> float:
            a.sendall(ASK)
            return process_cpu_s() + float(_recv_exactly(a, len(MSG)))

        best = (float("inf"), float("inf"))
        for _ in range(rounds):
            cpu0 = cpu_both()
            t0 = time.perf_counter()
            for _ in range(repeat):
                a.sendall(MSG)
                _recv_exactly(a, len(MSG))
            wall = (time.perf_counter() - t0) / repeat
            cpu = (cpu_both() - cpu0) / repeat
            if wall < best[0]:
                best = (wall, cpu)
        return round(best[0] * 1e6, 1), round(best[1] * 1e6, 1)
    finally:
        if a is not None:
            a.close()
        srv.close()
        os.waitpid(pid, 0)


def python_us_per_cpu() -> list[float]:
    """`python_us` on each cpu this process may use, in cpu order (pinned in turn; the affinity is restored)."""
    cpus = sorted(os.sched_getaffinity(0))
    out = []
    try:
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            out.append(python_us())
    finally:
        os.sched_setaffinity(0, cpus)
    return out


def host_speed() -> dict:
    """The figures of the module docstring (about 3 s on 2 cpus)."""
    wall, cpu = exchange_us()
    return {"python_us": python_us_per_cpu(), "exchange_us": wall, "exchange_cpu_us": cpu}


if __name__ == "__main__":
    print(host_speed())
