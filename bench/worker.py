"""Load-generator worker process: uvloop, a command loop on a multiprocessing Pipe, many MQTT connections.

Commands (tuple (name, args) → reply dict):
    setup      connect the worker's subscribers (SUBSCRIBE) and publishers
    run        publish at a fixed rate for warm-up + duration from a shared start time; wait for PUBACKs
    burst      publish `count` messages per publisher as fast as the QoS 1 window allows; wait for PUBACKs
    collect    wait until the subscribers saw the expected ranges (or a deadline); report and reset stats
    disconnect / reconnect   close / reopen the subscribers (backlog scenario)
    storm      open clean-session connections at a rate; report connect latencies and failures
    hold       open clean-session connections, each subscribed to its own command topic, and keep them
               (pinged like every other connection); `held` counts those still open, `release` closes them
    cleanup    close everything; reconnect persistent subscribers with a clean session to drop their state
    stop       exit
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
import traceback

from . import client as mc
from .client import WARM, MqttConn, Publisher, Recorder, SubState

_ns = time.monotonic_ns


def worker_main(conn, index: int, cpus: list[int] | None) -> None:
    if cpus:
        try:
            os.sched_setaffinity(0, set(cpus))
        except OSError:
            pass
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    mc._puback_table()
    asyncio.run(Worker(conn, index).serve())


class Worker:
    def __init__(self, pipe, index: int) -> None:
        self.pipe = pipe
        self.index = index
        self.rec = Recorder()
        self.cfg: dict = {}
        self.subs: list[SubState] = []
        self.pubs: list[Publisher] = []
        self.storm_conns: list[MqttConn] = []
        self.held_conns: list[MqttConn] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pinger: asyncio.Task | None = None

    async def _recv(self):
        loop = self.loop
        fd = self.pipe.fileno()
        while not self.pipe.poll():
            fut = loop.create_future()
            loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                loop.remove_reader(fd)
                os.set_blocking(fd, True)  # uvloop made it non-blocking; large replies need a blocking send
        return self.pipe.recv()

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._pinger = asyncio.create_task(self._ping_loop())
        while True:
            name, args = await self._recv()
            if name == "stop":
                await self._close_all()
                self.pipe.send({"ok": True})
                return
            try:
                reply = await getattr(self, "cmd_" + name)(**args)
                reply.setdefault("ok", True)
            except Exception as e:
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            self.pipe.send(reply)

    async def _ping_loop(self) -> None:
        ka = 20.0
        while True:
            await asyncio.sleep(ka)
            for c in self._all_conns():
                if not c.closed:
                    c.write(b"\xc0\x00")

    def _all_conns(self):
        for s in self.subs:
            if s.conn is not None:
                yield s.conn
        for p in self.pubs:
            if p.conn is not None:
                yield p.conn
        yield from self.storm_conns
        yield from self.held_conns

    # -- setup -----------------------------------------------------------------------------------------
    async def _connect_sub(self, st: SubState, clean: bool | None = None, timeout: float = 10.0) -> tuple[bool, int]:
        c = self.cfg
        spec = st.spec
        t0 = _ns()
        if st.conn is not None:  # a retry after a timeout: drop the half-open attempt
            st.conn.abort()
            st.conn = None
        conn, present = await mc.open_conn(
            self.loop, c["host"], c["port"], spec["client_id"], self.rec, version=c["version"],
            clean=spec["clean"] if clean is None else clean,
            session_expiry=spec.get("session_expiry"), username=c.get("username"), sub=st, timeout=timeout)
        st.conn = conn
        if not present or spec["clean"]:
            await mc.subscribe(conn, spec["filter"], spec["qos"], timeout=timeout)
        return present, _ns() - t0

    async def _connect_pub(self, p: Publisher, timeout: float = 10.0) -> None:
        c = self.cfg
        if p.conn is not None:
            p.conn.abort()
            p.conn = None
        conn, _ = await mc.open_conn(
            self.loop, c["host"], c["port"], p.spec["client_id"], self.rec, version=c["version"],
            clean=True, username=c.get("username"), pub=p, timeout=timeout)
        p.conn = conn

    async def _gather_limited(self, coros, limit: int):
        sem = asyncio.Semaphore(limit)

        async def one(co):
            async with sem:
                return await co

        return await asyncio.gather(*(one(co) for co in coros), return_exceptions=True)

    async def cmd_setup(self, cfg: dict, subs: list[dict], pubs: list[dict]) -> dict:
        self.cfg = cfg
        t0 = _ns()
        self.subs = [SubState(s) for s in subs]
        self.pubs = [Publisher(p, cfg["payload_size"], cfg["version"], cfg.get("max_inflight", 20000))
                     for p in pubs]
        lim = cfg.get("connect_concurrency", 64)
        retries = 0
        # a slow broker (still busy with the previous scenario) gets two more, more patient, attempts
        for attempt, timeout in enumerate((10.0, 30.0, 60.0)):
            errors = []
            subs = [s for s in self.subs if s.conn is None or s.conn.closed or attempt == 0]
            res = await self._gather_limited([self._connect_sub(s, timeout=timeout) for s in subs], lim)
            failed_subs = [s for s, r in zip(subs, res) if isinstance(r, BaseException)]
            errors += [repr(r) for r in res if isinstance(r, BaseException)]
            for s in failed_subs:
                if s.conn is not None:
                    s.conn.abort()
                    s.conn = None
            pubs = [p for p in self.pubs if p.conn is None or p.conn.closed or attempt == 0]
            res = await self._gather_limited([self._connect_pub(p, timeout=timeout) for p in pubs], lim)
            for p, r in zip(pubs, res):
                if isinstance(r, BaseException) and p.conn is not None:
                    p.conn.abort()
                    p.conn = None
            errors += [repr(r) for r in res if isinstance(r, BaseException)]
            if not errors:
                break
            retries += len(errors)
            await asyncio.sleep(1.0)
        return {"ok": not errors, "errors": errors[:5], "n_errors": len(errors), "retried": retries,
                "connect_s": (_ns() - t0) / 1e9}

    # -- publishing ------------------------------------------------------------------------------------
    async def cmd_run(self, rate: float, start_ns: int, warmup: float, duration: float, step: int,
                      ack_timeout: float = 10.0, tick: float = 0.002) -> dict:
        rec = self.rec
        rec.reset()
        rec.step = step
        w0 = start_ns + int(warmup * 1e9)
        w1 = w0 + int(duration * 1e9)
        rec.w0, rec.w1 = w0, w1
        ranges0 = {p.pub_id: p.seq for p in self.pubs}
        acked0 = {p.pub_id: p.acked for p in self.pubs}
        thr0 = sum(p.throttled for p in self.pubs)
        disc0 = rec.disconnects
        now = _ns()
        if start_ns > now:
            await asyncio.sleep((start_ns - now) / 1e9)
        pubs = self.pubs
        n = len(pubs)
        sent_total = 0
        sent_window = 0
        attempted = 0
        idx = 0
        sleep = asyncio.sleep
        if n and rate > 0:
            while True:
                now = _ns()
                if now >= w1:
                    break
                due = int((now - start_ns) * rate / 1e9) - attempted
                if due > 0:
                    attempted += due
                    tag = step if now >= w0 else WARM
                    q, r = divmod(due, n)
                    if q:
                        for p in pubs:
                            k = p.send(q + (1 if r > 0 else 0), tag)
                            r -= 1
                            sent_total += k
                            if tag != WARM:
                                sent_window += k
                        idx = (idx + due) % n
                    else:
                        for _ in range(r):
                            k = pubs[idx].send(1, tag)
                            sent_total += k
                            if tag != WARM:
                                sent_window += k
                            idx += 1
                            if idx == n:
                                idx = 0
                await sleep(tick)
        t_pub_end = _ns()
        # wait for the QoS 1 window to empty
        deadline = t_pub_end + int(ack_timeout * 1e9)
        while any(p.inflight for p in pubs) and _ns() < deadline:
            await sleep(0.01)
        return {
            "ranges": {p.pub_id: (ranges0[p.pub_id], p.seq) for p in pubs},
            "sent": sent_total, "sent_window": sent_window, "attempted": attempted,
            "acked": sum(p.acked - acked0[p.pub_id] for p in pubs),
            "unacked": sum(p.inflight for p in pubs),
            "throttled": sum(p.throttled for p in pubs) - thr0,
            "puback_us": rec.puback_us.tobytes(),
            "disconnects": rec.disconnects - disc0,
        }

    async def cmd_burst(self, count: int, step: int, window: int = 1000, ack_timeout: float = 60.0) -> dict:
        """Each publisher sends `count` QoS 1 messages keeping at most `window` in flight."""
        rec = self.rec
        rec.reset()
        rec.step = step
        rec.w0, rec.w1 = 0, 1 << 62
        ranges0 = {p.pub_id: p.seq for p in self.pubs}
        t0 = _ns()
        left = {p.pub_id: count for p in self.pubs}
        while any(left.values()):
            for p in self.pubs:
                room = min(window - p.inflight, left[p.pub_id])
                if room > 0:
                    left[p.pub_id] -= p.send(room, step)
            await asyncio.sleep(0.001)
            if _ns() - t0 > ack_timeout * 1e9:
                break
        deadline = _ns() + int(ack_timeout * 1e9)
        while any(p.inflight for p in self.pubs) and _ns() < deadline:
            await asyncio.sleep(0.005)
        return {"ranges": {p.pub_id: (ranges0[p.pub_id], p.seq) for p in self.pubs},
                "publish_s": (_ns() - t0) / 1e9, "unacked": sum(p.inflight for p in self.pubs),
                "puback_us": rec.puback_us.tobytes()}

    # -- collecting ------------------------------------------------------------------------------------
    async def cmd_collect(self, ranges: dict, timeout: float, reset: bool = True) -> dict:
        ranges = {int(k): tuple(v) for k, v in ranges.items()}
        deadline = _ns() + int(timeout * 1e9)
        expected = sum(sum(ranges[p][1] - ranges[p][0] for p in s.expected_pubs(ranges)) for s in self.subs)
        while True:
            missing = sum(s.missing(ranges) for s in self.subs)
            if missing == 0 or _ns() >= deadline:
                break
            await asyncio.sleep(0.02)
        rec = self.rec
        out = {
            "expected": expected, "missing": missing, "dups": rec.dups, "late": rec.late,
            "received": rec.received, "in_window": rec.in_window, "lat_us": rec.lat_us.tobytes(),
            "first_recv_ns": rec.first_recv_ns, "last_recv_ns": rec.last_recv_ns, "disconnects": rec.disconnects,
        }
        if reset:
            rec.reset()
        return out

    async def cmd_quiesce(self, quiet: float = 1.0, timeout: float = 30.0) -> dict:
        """Wait until no delivery arrived for `quiet` s (a broker still draining an overload), max `timeout` s."""
        t0 = _ns()
        deadline = t0 + int(timeout * 1e9)
        last = self.rec.received
        last_change = _ns()
        while _ns() < deadline:
            await asyncio.sleep(0.1)
            if self.rec.received != last:
                last = self.rec.received
                last_change = _ns()
            elif _ns() - last_change >= quiet * 1e9:
                break
        got = self.rec.received
        self.rec.reset()
        return {"waited_s": (_ns() - t0) / 1e9, "stragglers": got}

    # -- backlog ---------------------------------------------------------------------------------------
    async def cmd_disconnect(self) -> dict:
        for s in self.subs:
            if s.conn is not None:
                s.conn.close()
                s.conn = None
        await asyncio.sleep(0.05)
        return {}

    async def cmd_reconnect(self, step: int) -> dict:
        self.rec.reset()
        self.rec.step = step
        self.rec.w0, self.rec.w1 = 0, 1 << 62
        t0 = _ns()
        res = await asyncio.gather(*(self._connect_sub(s) for s in self.subs), return_exceptions=True)
        errors = [repr(r) for r in res if isinstance(r, BaseException)]
        present = [r[0] for r in res if not isinstance(r, BaseException)]
        connack_ns = max((r[1] for r in res if not isinstance(r, BaseException)), default=0)
        return {"ok": not errors, "errors": errors[:5], "start_ns": t0, "session_present": present,
                "connack_ns": connack_ns}

    # -- connect storm ---------------------------------------------------------------------------------
    async def cmd_storm(self, rate: float, start_ns: int, duration: float, prefix: str,
                        timeout: float = 5.0) -> dict:
        c = self.cfg
        lat_us = []
        errors: list[str] = []
        tasks = []
        rec = Recorder()

        async def one(i: int) -> None:
            t0 = _ns()
            try:
                conn, _ = await mc.open_conn(self.loop, c["host"], c["port"], f"{prefix}-{i}", rec,
                                             version=c["version"], clean=True, username=c.get("username"),
                                             timeout=timeout)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
                return
            lat_us.append((_ns() - t0) // 1000)
            self.storm_conns.append(conn)

        now = _ns()
        if start_ns > now:
            await asyncio.sleep((start_ns - now) / 1e9)
        end = start_ns + int(duration * 1e9)
        started = 0
        while True:
            now = _ns()
            if now >= end:
                break
            due = int((now - start_ns) * rate / 1e9) - started
            for _ in range(due):
                tasks.append(asyncio.ensure_future(one(started)))
                started += 1
            await asyncio.sleep(0.002)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout + 1)
        for t in tasks:
            t.cancel()
        elapsed = (_ns() - start_ns) / 1e9
        for conn in self.storm_conns:
            conn.abort()
        self.storm_conns = []
        await asyncio.sleep(0.05)
        return {"started": started, "ok_count": len(lat_us), "errors": len(errors), "error_samples": errors[:3],
                "lat_us": lat_us, "elapsed": elapsed}

    # -- held connections ------------------------------------------------------------------------------
    async def cmd_hold(self, count: int, prefix: str, concurrency: int = 64, timeout: float = 30.0) -> dict:
        """Open `count` clean-session connections (`<prefix>-<i>`), each subscribed at QoS 1 to
        `<prefix>/<i>/cmd` (a device waiting for its commands), at most `concurrency` connecting at a time,
        and keep them."""
        c = self.cfg
        rec = Recorder()

        async def one(i: int) -> MqttConn:
            conn, _ = await mc.open_conn(self.loop, c["host"], c["port"], f"{prefix}-{i}", rec,
                                         version=c["version"], clean=True, username=c.get("username"),
                                         timeout=timeout)
            try:
                await mc.subscribe(conn, f"{prefix}/{i}/cmd", 1, timeout=timeout)
            except BaseException:
                conn.abort()
                raise
            return conn

        t0 = _ns()
        res = await self._gather_limited([one(i) for i in range(count)], concurrency)
        errors = [f"{type(r).__name__}: {r}" for r in res if isinstance(r, BaseException)]
        self.held_conns.extend(r for r in res if isinstance(r, MqttConn))
        return {"ok_count": count - len(errors), "errors": len(errors), "error_samples": errors[:3],
                "seconds": (_ns() - t0) / 1e9}

    async def cmd_held(self) -> dict:
        return {"open": sum(1 for c in self.held_conns if not c.closed), "held": len(self.held_conns)}

    async def cmd_release(self) -> dict:
        for conn in self.held_conns:
            conn.close()
        n = len(self.held_conns)
        self.held_conns = []
        await asyncio.sleep(0.05)
        return {"released": n}

    # -- teardown --------------------------------------------------------------------------------------
    async def cmd_cleanup(self, drop_sessions: bool = True) -> dict:
        await self.cmd_release()
        for p in self.pubs:
            if p.conn is not None:
                p.conn.close()
                p.conn = None
        persistent = [s for s in self.subs if not s.spec["clean"]]
        for s in self.subs:
            if s.conn is not None:
                s.conn.close()
                s.conn = None
        await asyncio.sleep(0.05)
        errors = []
        if drop_sessions and persistent:
            async def drop(s: SubState) -> None:
                c = self.cfg
                conn, _ = await mc.open_conn(self.loop, c["host"], c["port"], s.spec["client_id"], Recorder(),
                                             version=c["version"], clean=True, session_expiry=0,
                                             username=c.get("username"))
                conn.close()

            res = await self._gather_limited([drop(s) for s in persistent], 32)
            errors = [repr(r) for r in res if isinstance(r, BaseException)]
        self.subs, self.pubs = [], []
        self.rec = Recorder()
        return {"errors": errors[:3]}

    async def _close_all(self) -> None:
        for c in list(self._all_conns()):
            c.abort()
        await asyncio.sleep(0)
