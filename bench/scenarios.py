"""The scenarios (TBMQ's published ones, scaled to one machine) and the runner that measures them."""

from __future__ import annotations

import math
import os
import time
import uuid
from array import array
from dataclasses import dataclass, field

from .faults import FaultProfile, run_faults
from .gen import Generator
from .procmon import JitSettle, ProcMonitor, jit_compile_cpu_s
from .stats import expand_names, judge, latency_summary, merge_ranges, merge_us, search_max_rate, us_per_msg, wait_cool

RATE_SCENARIOS = ("p2p", "fan-in-app", "fan-in-dev", "fan-out-q0", "fan-out-q1")
BACKLOG_SCENARIOS = ("backlog", "backlog-100k", "backlog-app")
# "faults" kills and restarts parts of the broker: always the last scenario of a run
SCENARIOS = (*RATE_SCENARIOS, *BACKLOG_SCENARIOS, "connect", "connections", "faults")
ALIASES = {"fan-out": ("fan-out-q0", "fan-out-q1"), "fanout": ("fan-out-q0", "fan-out-q1"),
           "fan-in": ("fan-in-app", "fan-in-dev"), "fanin": ("fan-in-app", "fan-in-dev"),
           "backlogs": BACKLOG_SCENARIOS, "storm": ("connect",), "connect-storm": ("connect",),
           "held": ("connections",), "all": SCENARIOS}


def expand(names: str) -> list[str]:
    """The scenarios named, in the order given, except "connections" first: its bytes per connection are the
    RSS growth, which memory freed by an earlier scenario (and kept by the allocator) would hide."""
    out = expand_names(names, SCENARIOS, ALIASES, "scenario")
    return sorted(out, key=lambda s: s != "connections")


@dataclass
class Profile:
    """Sizes and times of a run. `quick()` is the CI smoke profile (seconds per scenario)."""
    duration: float = 10.0        # measured seconds per step
    warmup: float = 2.0           # unmeasured seconds at the start of every step
    drain: float = 10.0           # after publishing stops, how long deliveries may still arrive
    pairs: int = 100              # p2p
    fanin_pubs: int = 200
    fanout_subs: int = 1000
    backlog: int = 10_000         # "backlog": offline persistent DEVICE subscriber
    backlog_big: int = 100_000    # "backlog-100k": the same, 0 lost expected
    backlog_app: int = 50_000     # "backlog-app": offline APPLICATION subscriber, drained through the suite
    payload: int = 62
    # fixed-rate steps (msg/s in) of every rate scenario, in order; each is measured and reported
    rates: dict = field(default_factory=lambda: {"p2p": [100.0, 1000.0, 2500.0], "fan-in-app": [1000.0],
                                                 "fan-in-dev": [1000.0], "fan-out-q0": [10.0], "fan-out-q1": [10.0]})
    # where the max-rate search starts (a fixed step at the same rate is reused); default: the first rate
    search_start: dict = field(default_factory=lambda: {"p2p": 1000.0})
    search: tuple = ("p2p", "fan-in-app", "fan-in-dev", "fan-out-q0", "fan-out-q1")
    search_steps: int = 7
    p99_limit_ms: float = 100.0
    storm_rates: tuple = (250, 500, 1000, 2000, 4000, 8000)
    storm_step: float = 1.0
    # "connections": held_connections clean-session clients, each subscribed to its own command topic, held
    # (pinged every 20 s) while the broker's memory and CPU are measured over hold_window s
    held_connections: int = 10_000
    hold_concurrency: int = 64     # CONNECTs in flight per generator worker
    hold_window: float = 10.0
    mqtt_version: int = 4
    # after a broker starts: an unmeasured p2p load of broker_warmup s; then, while a JVM of the broker (Kafka)
    # is still JIT-compiling (its compiler threads above jit_settled_pct % of one core over any of the last
    # jit_quiet_chunks chunks), more of it in chunks of jit_chunk s, at most jit_settle_max s (procmon.JitSettle:
    # C2 compiles for minutes on 2 cores, in bursts)
    broker_warmup: float = 25.0
    broker_warmup_rate: float = 500.0
    jit_settled_pct: float = 3.0
    jit_chunk: float = 10.0
    jit_quiet_chunks: int = 2
    jit_settle_max: float = 120.0
    # idle CPU of the broker's processes: a window of idle_window s after idle_warmup s with no clients
    idle_warmup: float = 60.0
    idle_window: float = 10.0
    # before every measured step: wait until the broker's total CPU ≤ idle + margin (% of one core) over
    # 1 s windows, at most cooldown_max s
    cooldown_margin: float = 5.0
    cooldown_max: float = 30.0
    faults: FaultProfile = field(default_factory=FaultProfile)  # the "faults" scenario (bench/faults.py)

    @classmethod
    def quick(cls) -> "Profile":
        return cls(duration=2.0, warmup=0.5, drain=3.0, pairs=10, fanin_pubs=20, fanout_subs=100, backlog=1000,
                   backlog_big=5000, backlog_app=2000,
                   rates={"p2p": [100.0, 500.0], "fan-in-app": [500.0], "fan-in-dev": [500.0], "fan-out-q0": [10.0],
                          "fan-out-q1": [10.0]},
                   search_start={"p2p": 500.0}, search=("p2p",),
                   search_steps=3, storm_rates=(100, 300, 1000), storm_step=1.0, held_connections=200, hold_window=2.0,
                   broker_warmup=5.0, broker_warmup_rate=200.0, jit_settle_max=0.0, idle_warmup=5.0, idle_window=2.0,
                   cooldown_max=5.0, faults=FaultProfile.quick())

    def start_rate(self, scenario: str) -> float:
        return float(self.search_start.get(scenario) or self.rates[scenario][0])


class Runner:
    """Runs scenarios against one broker that is already started."""

    def __init__(self, broker, gen: Generator, mon: ProcMonitor, prof: Profile, log=print,
                 idle_pct: float | None = None) -> None:
        self.broker = broker
        self.gen = gen
        self.mon = mon
        self.prof = prof
        self.log = log
        self.idle_pct = idle_pct  # the broker's idle CPU (% of one core); None: no cool-down between steps
        self.token = uuid.uuid4().hex[:6]
        self.step_no = 0
        self.cfg = {"host": broker.host, "port": broker.port, "payload_size": prof.payload,
                    "version": broker.client_cfg.get("version") or prof.mqtt_version,
                    "username": broker.client_cfg.get("username")}
        self.broker_labels = list(broker.pids())

    # -- helpers ---------------------------------------------------------------------------------------
    def _split(self, items: list[dict]) -> list[list[dict]]:
        n = len(self.gen)
        out: list[list[dict]] = [[] for _ in range(n)]
        for i, it in enumerate(items):
            out[it.get("worker", i % n)].append(it)
        return out

    def _setup(self, subs: list[dict], pubs: list[dict]) -> None:
        s, p = self._split(subs), self._split(pubs)
        t0 = time.monotonic()
        rs = self.gen.call("setup", [{"cfg": self.cfg, "subs": s[i], "pubs": p[i]} for i in range(len(self.gen))],
                           timeout=200)
        retried = sum(r.get("retried", 0) for r in rs)
        self.log(f"    connected {len(subs)} subscribers + {len(pubs)} publishers in {time.monotonic() - t0:.1f}s"
                 + (f" ({retried} connects retried after a timeout)" if retried else ""))
        self._pub_share = [len(x) / max(len(pubs), 1) for x in p]

    def _cleanup(self) -> None:
        try:
            self.gen.call("cleanup", {}, timeout=60, check=False)
        except Exception as e:  # a broken broker must not stop the run
            self.log(f"    cleanup: {e}")

    def _procs(self, win: dict) -> dict:
        return win

    def _mine(self, procs: dict) -> dict:
        """`procs` without other brokers' processes (they run beside this one when steps are interleaved)."""
        labels = self.broker_labels
        return {k: v for k, v in procs.items() if k in labels or k.startswith("generator-")}

    def _broker_cpu(self, procs: dict) -> tuple[float, float, float]:
        """(cpu seconds, cpu % of one core, peak RSS MB) summed over the broker's processes."""
        labels = [k for k in procs if k in self.broker_labels]
        return (sum(procs[k]["cpu_s"] for k in labels), sum(procs[k]["cpu_pct"] for k in labels),
                sum(procs[k]["rss_mb"] for k in labels))

    def _broker_window(self, win: dict) -> dict:
        """The window since `win` (ProcMonitor.window_end) of the broker's processes only."""
        return {k: v for k, v in self.mon.window_end(win).items() if k in self.broker_labels}

    def measure_idle(self) -> dict:
        """Idle CPU of the broker's processes: nothing connected for `idle_warmup` s, then a window of
        `idle_window` s. → {"processes": {label: {cpu_s, cpu_pct, rss_mb}}, "total_pct", "after_s"}; also
        sets the baseline of the cool-down."""
        p = self.prof
        time.sleep(max(p.idle_warmup, 0.0))
        win = self.mon.window_start()
        time.sleep(max(p.idle_window, 0.5))
        procs = self._broker_window(win)
        total = round(self._broker_cpu(procs)[1], 1)
        self.idle_pct = total
        return {"processes": procs, "total_pct": total, "after_s": p.idle_warmup, "window_s": p.idle_window}

    def cooldown(self) -> dict | None:
        """Before a measured step: wait (bounded) until the broker's processes are back near their idle CPU."""
        if self.idle_pct is None or self.prof.cooldown_max <= 0:
            return None

        def measure() -> float:
            win = self.mon.window_start()
            time.sleep(1.0)
            return self._broker_cpu(self.mon.window_end(win))[1]

        return wait_cool(measure, self.idle_pct, margin_pct=self.prof.cooldown_margin,
                         max_wait=self.prof.cooldown_max)

    def _jvm_pid(self) -> int | None:
        """The broker's JVM (tbmq-py's Kafka), if it has one."""
        return self.mon.labels.get("kafka") if "kafka" in self.broker_labels else None

    def warm_up(self) -> dict | None:
        """Unmeasured p2p load right after the broker started: `broker_warmup` s, then more in chunks of
        `jit_chunk` s while the broker's JVM is still JIT-compiling (procmon.JitSettle), at most
        `jit_settle_max` s more, so the measured steps see Kafka's steady state.

        Every chunk starts with the clients connecting again, as a live fleet's sessions come and go while
        messages flow. The session registry writes each connect and disconnect in a Kafka transaction, and
        HotSpot's C2 compiles Kafka's produce path (KafkaApis.handleProduceRequest, LogValidator,
        UnifiedLog.append, DelayedFetch) from the branches it has seen: compiled under pure message load,
        the first transactional batch afterwards (the warm-up's clients leaving, the next step's arriving)
        deoptimises all of it at once, and the recompilation used to land in the measured steps
        (docs/performance.md, "The thirty-seventh round")."""
        p = self.prof
        if p.broker_warmup <= 0 or p.broker_warmup_rate <= 0:
            return None
        saved = (p.duration, p.warmup, self.idle_pct)
        self.idle_pct = None
        t0 = time.monotonic()
        jvm = self._jvm_pid()
        settle = JitSettle(max_pct=p.jit_settled_pct, quiet_chunks=p.jit_quiet_chunks)
        c0 = jit_compile_cpu_s(jvm) if jvm else None
        jit = None
        self._setup(*self._p2p_clients("warm"))
        try:
            p.duration, p.warmup = p.broker_warmup, 0.0
            if c0 is not None:
                settle.feed(c0, time.monotonic())
            r = self.step(p.broker_warmup_rate, label="warm-up ")
            if c0 is not None:
                extra = 0.0
                compiled = jit_compile_cpu_s(jvm) or 0.0
                settled = settle.feed(compiled, time.monotonic())
                p.duration = p.jit_chunk
                while not settled and extra + p.jit_chunk <= p.jit_settle_max:
                    self._cleanup()
                    self._setup(*self._p2p_clients("warm"))
                    r = self.step(p.broker_warmup_rate, label="warm-up (JIT) ")
                    extra += p.jit_chunk
                    compiled = jit_compile_cpu_s(jvm) or 0.0
                    settled = settle.feed(compiled, time.monotonic())
                jit = {"settled": settled, "extra_s": extra, "last_chunk_pct": round(settle.last_pct or 0.0, 1),
                       "compile_cpu_s": round(compiled, 1)}
        finally:
            p.duration, p.warmup, self.idle_pct = saved
            self._cleanup()
        return {"rate": p.broker_warmup_rate, "seconds": p.broker_warmup, "took_s": round(time.monotonic() - t0, 1),
                "e2e_ms": r["e2e_ms"], "lost": r["lost"], "broker_cpu_pct": r["broker_cpu_pct"],
                "us_per_msg": r["us_per_msg"], "jit": jit}

    # -- a fixed-rate step -----------------------------------------------------------------------------
    def step(self, rate: float, *, label: str = "") -> dict:
        p = self.prof
        cool = self.cooldown()
        self.step_no += 1
        step = self.step_no & 0x7FFF
        start_ns = time.monotonic_ns() + int(0.3e9)
        started_at = time.time() + 0.3  # wall clock of the step's start (the order of interleaved steps)
        args = [{"rate": rate * share, "start_ns": start_ns, "warmup": p.warmup, "duration": p.duration,
                 "step": step, "ack_timeout": p.drain} for share in self._pub_share]
        self.gen.send("run", args)
        # CPU/RSS window = the measured part of the step
        w0 = start_ns / 1e9 + p.warmup
        time.sleep(max(w0 - time.monotonic(), 0))
        jvm = self._jvm_pid()
        jit0 = jit_compile_cpu_s(jvm) if jvm else None
        win = self.mon.window_start()
        time.sleep(max(w0 + p.duration - time.monotonic(), 0))
        procs = self._mine(self.mon.window_end(win))
        speed = self.mon.window_speed(win)
        jit1 = jit_compile_cpu_s(jvm) if jit0 is not None else None
        runs = self.gen.recv(p.warmup + p.duration + p.drain + 30)
        ranges = merge_ranges(runs)
        cols = self.gen.call("collect", {"ranges": ranges, "timeout": p.drain}, timeout=p.drain + 30)
        lat = merge_us(c["lat_us"] for c in cols)
        pa = merge_us(r["puback_us"] for r in runs)
        e2e = latency_summary(lat)
        puback = latency_summary(pa)
        sent_w = sum(r["sent_window"] for r in runs)
        out_w = sum(c["in_window"] for c in cols)
        lost = sum(c["missing"] for c in cols)
        dups = sum(c["dups"] for c in cols)
        disc = sum(r["disconnects"] for r in runs)
        cpu_s, cpu_pct, rss = self._broker_cpu(procs)
        gen_pct = sum(v["cpu_pct"] for k, v in procs.items() if k.startswith("generator-"))
        achieved = sent_w / p.duration
        res = {
            "rate": rate, "in_rate": round(achieved, 1), "out_rate": round(out_w / p.duration, 1),
            "e2e_ms": e2e, "puback_ms": puback, "sent": sum(r["sent"] for r in runs),
            "expected": sum(c["expected"] for c in cols), "lost": lost, "dup": dups,
            "late": sum(c["late"] for c in cols), "unacked": sum(r["unacked"] for r in runs),
            "throttled": sum(r["throttled"] for r in runs), "disconnects": disc,
            "broker_cpu_pct": round(cpu_pct, 1), "broker_rss_mb": round(rss, 1),
            "broker_us_per_msg": round(cpu_s * 1e6 / out_w, 1) if out_w else math.nan,
            "us_per_msg": us_per_msg(procs, out_w),
            "generator_cpu_pct": round(gen_pct, 1), "processes": procs, "cooldown": cool,
            # of the broker's CPU: its JVM's JIT compiler threads (counted in "kafka" too)
            "jit_cpu_pct": None if jit1 is None else round(100.0 * (jit1 - jit0) / p.duration, 1),
            # median µs of bench.calibrate's workload per cpu during the window (ProcMonitor's probe)
            "cpu_speed_us": speed,
            "started_at": round(started_at, 3),
        }
        # rate × duration is not an integer: allow one message per publishing worker of rounding
        slack = sum(1 for share in self._pub_share if share > 0) / p.duration
        res["achieved_for_judge"] = min(rate, achieved + slack)
        ok = judge(rate, e2e["p99"], lost, res["achieved_for_judge"], p99_limit_ms=p.p99_limit_ms,
                   disconnects=disc)
        res["ok"], res["reason"] = ok.ok, ok.reason
        if not ok.ok:  # an overloaded broker may still be delivering: let it go quiet before the next step
            q = self.gen.call("quiesce", {"quiet": 1.0, "timeout": 30.0}, timeout=60)
            res["quiesce_s"] = round(max(x["waited_s"] for x in q), 1)
            res["stragglers"] = sum(x["stragglers"] for x in q)
        # the generator must not be the bottleneck: flag steps where it used ≥85% of its cpus
        gen_cpus = getattr(self.gen, "cpus", None)
        res["generator_saturated"] = gen_pct >= 85.0 * (len(gen_cpus) if gen_cpus else (os.cpu_count() or 1))
        self.log(f"    {label}rate {rate:8.0f}/s  in {res['in_rate']:8.0f}/s out {res['out_rate']:9.0f}/s  "
                 f"p50 {e2e['p50']:7.1f} p99 {e2e['p99']:7.1f} ms  lost {lost} dup {dups}  "
                 f"broker {cpu_pct:5.0f}% {res['broker_us_per_msg']:.0f} µs/msg "
                 f"gen {gen_pct:4.0f}%{' (SATURATED)' if res['generator_saturated'] else ''}  "
                 + (f"JIT {res['jit_cpu_pct']:.0f}%  " if res["jit_cpu_pct"] else "")
                 + (f"vCPU µs {'/'.join(f'{v:.0f}' for v in speed.values())}  " if speed else "")
                 + (f"cool-down {cool['waited_s']:.0f}s{'' if cool['reached'] else ' (not reached)'}  " if cool else "")
                 + f"{'PASS' if ok.ok else 'FAIL: ' + ok.reason}"
                 + (f" (then {res['stragglers']} late deliveries over {res['quiesce_s']}s)"
                    if res.get("stragglers") else ""))
        return res

    def interleaved_step(self, rate: float) -> dict:
        """One fixed-rate p2p step with its own clients (connected before, their sessions dropped after), for
        `bench run --interleave p2p`: the brokers take turns at each rate, so that they meet the host at the
        same moment (a 2-vCPU guest's speed moves by a factor of two within the hour)."""
        self._setup(*self._p2p_clients())
        try:
            return self.step(rate, label="fixed ")
        finally:
            self._cleanup()

    def _rate_scenario(self, name: str, subs: list[dict], pubs: list[dict], out_factor: float, search: bool,
                       steps: list[dict] | None = None) -> dict:
        """`steps`: the fixed-rate steps, measured already (interleaved with the other brokers')."""
        p = self.prof
        result: dict = {"params": {"subscribers": len(subs), "publishers": len(pubs), "payload": p.payload,
                                   "duration": p.duration, "warmup": p.warmup, "out_per_in": out_factor,
                                   "interleaved": steps is not None}}
        connected = steps is None or search
        if connected:
            self._setup(subs, pubs)
        try:
            if steps is None:
                steps = [self.step(rate, label="fixed ") for rate in p.rates[name]]
            result["fixed_steps"] = steps
            start = p.start_rate(name)
            # "fixed": the step at the search's start rate (the table's "@rate" rows), else the first
            result["fixed"] = next((st for st in steps if st["rate"] == start), steps[0])
            if search:
                def probe(rate):
                    # a fixed-rate step doubles as a search step when the rates agree
                    r = next((st for st in steps if st["rate"] == rate), None) or self.step(rate, label="search ")
                    return judge(rate, r["e2e_ms"]["p99"], r["lost"], r["achieved_for_judge"],
                                 p99_limit_ms=p.p99_limit_ms,
                                 disconnects=r["disconnects"], extra={k: r[k] for k in (
                                     "in_rate", "out_rate", "e2e_ms", "broker_cpu_pct", "generator_cpu_pct",
                                     "broker_us_per_msg", "us_per_msg", "lost", "dup", "cooldown")})

                best, sst = search_max_rate(probe, start, factor=2.0, max_steps=p.search_steps, resolution=0.15)
                result["search"] = {"best_in": best, "best_in_out": (best * (1 + out_factor)) if best else None,
                                    "unbounded": bool(sst) and all(x.ok for x in sst),
                                    "steps": [x.to_dict() for x in sst]}
        finally:
            if connected:
                self._cleanup()
        return result

    # -- scenarios -------------------------------------------------------------------------------------
    def _p2p_clients(self, tag: str = "p2p") -> tuple[list[dict], list[dict]]:
        t = f"{self.token}-{tag}" if tag != "p2p" else self.token
        n = self.prof.pairs
        w = len(self.gen)
        subs = [{"id": i, "client_id": f"bench-dev-{t}-s{i}", "filter": f"bench/{t}/p2p/{i}", "qos": 1,
                 "clean": False, "session_expiry": 3600, "expects": [i], "worker": i % w} for i in range(n)]
        pubs = [{"id": i, "client_id": f"bench-{t}-p{i}", "topic": f"bench/{t}/p2p/{i}", "qos": 1, "worker": i % w}
                for i in range(n)]
        return subs, pubs

    def p2p(self, search: bool, steps: list[dict] | None = None) -> dict:
        return self._rate_scenario("p2p", *self._p2p_clients(), 1.0, search, steps)

    def fan_in(self, kind: str, search: bool) -> dict:
        """kind "app": the subscriber's client id matches bench-app-… (an APPLICATION client in tbmq-py);
        "dev": bench-dev-… (a persistent DEVICE client). Both persistent; for Mosquitto and amqtt the same."""
        t = self.token
        n = self.prof.fanin_pubs
        subs = [{"id": 0, "client_id": f"bench-{kind}-{t}-fanin", "filter": f"bench/{t}/fanin{kind}/+", "qos": 1,
                 "clean": False, "session_expiry": 3600, "expects": "all", "worker": 0}]
        pubs = [{"id": i, "client_id": f"bench-{t}-fi{kind}{i}", "topic": f"bench/{t}/fanin{kind}/{i}", "qos": 1}
                for i in range(n)]
        return self._rate_scenario(f"fan-in-{kind}", subs, pubs, 1.0, search)

    def fan_out(self, qos: int, search: bool) -> dict:
        t = self.token
        n = self.prof.fanout_subs
        subs = [{"id": i, "client_id": f"bench-{t}-fo{qos}-s{i}", "filter": f"bench/{t}/fanout{qos}", "qos": qos,
                 "clean": True, "expects": [0]} for i in range(n)]
        pubs = [{"id": 0, "client_id": f"bench-{t}-fo{qos}-p", "topic": f"bench/{t}/fanout{qos}", "qos": qos,
                 "worker": 0}]
        return self._rate_scenario(f"fan-out-q{qos}", subs, pubs, float(n), search)

    def backlog(self, count: int, kind: str = "dev", tag: str = "backlog") -> dict:
        """`count` QoS 1 messages to an offline persistent subscriber (kind "dev": DEVICE client id, "app":
        APPLICATION), then reconnect it and time the drain."""
        t = self.token
        sub = {"id": 0, "client_id": f"bench-{kind}-{t}-{tag}", "filter": f"bench/{t}/{tag}", "qos": 1,
               "clean": False, "session_expiry": 3600, "expects": [0], "worker": 0}
        pub = {"id": 0, "client_id": f"bench-{t}-{tag}-p", "topic": f"bench/{t}/{tag}", "qos": 1, "worker": 0}
        self._setup([sub], [pub])
        only0 = lambda a, rest=None: [a] + [rest if rest is not None else {}] * (len(self.gen) - 1)  # noqa: E731
        try:
            self.gen.call("disconnect", {}, timeout=30)
            time.sleep(1.0)  # amqtt can lose a session reconnected < ~1 s after its first connect
            cool = self.cooldown()
            self.step_no += 1
            step = self.step_no
            ack_timeout = max(60.0, count / 500)
            b = self.gen.call("burst", only0({"count": count, "step": step, "ack_timeout": ack_timeout},
                                             {"count": 0, "step": step}),
                              timeout=2 * ack_timeout + count / 100 + 60)
            ranges = merge_ranges(b)
            # the backlog stored before the reconnect: the broker back near its idle CPU (a fixed 0.5 s was
            # sometimes inside tbmq-py's storing of the burst, so the drain timed the tail of the storing too)
            settled = self.cooldown()
            if settled is None:
                time.sleep(0.5)
            win = self.mon.window_start()
            rc = self.gen.call("reconnect", {"step": step}, timeout=60)
            collect_s = max(60.0, count / 200)
            cols = self.gen.call("collect", {"ranges": ranges, "timeout": collect_s}, timeout=collect_s + 30)
            procs = self._mine(self.mon.window_end(win))
            start_ns = rc[0]["start_ns"]
            last = max(c["last_recv_ns"] for c in cols)
            lost = sum(c["missing"] for c in cols)
            cpu_s, cpu_pct, rss = self._broker_cpu(procs)
            delivered = sum(c["received"] for c in cols)
            drain_s = (last - start_ns) / 1e9 if last > start_ns else math.nan
            firsts = [c.get("first_recv_ns", 0) for c in cols if c.get("first_recv_ns")]
            res = {
                "params": {"messages": count, "qos": 1, "payload": self.prof.payload,
                           "subscriber": f"bench-{kind}-…",
                           "client_type": "APPLICATION" if kind == "app" else "DEVICE"},
                "publish_s": round(b[0]["publish_s"], 3), "publish_rate": round(count / b[0]["publish_s"], 1),
                "unacked": sum(x["unacked"] for x in b), "session_present": rc[0]["session_present"],
                "drain_s": round(drain_s, 4),
                # where the drain's time went: the CONNACK, then the first stored message, after the reconnect
                "connack_s": round(max(r.get("connack_ns", 0) for r in rc) / 1e9, 4),
                "first_msg_s": round((min(firsts) - start_ns) / 1e9, 4) if firsts else math.nan,
                "drain_rate": round(delivered / drain_s, 1) if delivered and drain_s > 0 else math.nan,
                "delivered": delivered, "lost": lost, "dup": sum(c["dups"] for c in cols),
                "e2e_ms": latency_summary(merge_us(c["lat_us"] for c in cols)),
                "broker_cpu_s": round(cpu_s, 3), "broker_rss_mb": rss, "processes": procs,
                "us_per_msg": us_per_msg(procs, delivered), "cooldown": cool, "settled": settled,
            }
            self.log(f"    {tag} {count} ({res['params']['client_type']}): published in {res['publish_s']:.2f}s, "
                     f"session_present={res['session_present']}, drained in {res['drain_s']:.3f}s "
                     f"({res['drain_rate']:,.0f} msg/s; CONNACK {res['connack_s']:.3f}s, first "
                     f"{res['first_msg_s']:.3f}s), lost {lost} dup {res['dup']}")
            return res
        finally:
            self._cleanup()

    def connect_storm(self) -> dict:
        p = self.prof
        self.gen.call("setup", {"cfg": self.cfg, "subs": [], "pubs": []}, timeout=30)
        steps = []
        best = None
        rates = list(p.storm_rates)
        i = 0
        while i < len(rates):
            rate = rates[i]
            i += 1
            cool = self.cooldown()
            start_ns = time.monotonic_ns() + int(0.3e9)
            win = None
            self.gen.send("storm", [{"rate": rate / len(self.gen), "start_ns": start_ns, "duration": p.storm_step,
                                     "prefix": f"bench-{self.token}-c{rate}-w{w}"} for w in range(len(self.gen))])
            time.sleep(0.3)
            win = self.mon.window_start()
            rs = self.gen.recv(p.storm_step + 60)
            procs = self._mine(self.mon.window_end(win))
            lat = latency_summary(x for r in rs for x in r["lat_us"])
            started = sum(r["started"] for r in rs)
            okc = sum(r["ok_count"] for r in rs)
            errs = sum(r["errors"] for r in rs)
            cpu_s, cpu_pct, rss = self._broker_cpu(procs)
            ok = errs == 0 and lat["p99"] <= 1000.0
            st = {"rate": rate, "started": started, "connected": okc, "errors": errs,
                  "error_samples": [e for r in rs for e in r["error_samples"]][:3],
                  "achieved": round(okc / p.storm_step, 1), "connect_ms": lat, "ok": ok,
                  "broker_cpu_pct": round(cpu_pct, 1), "broker_rss_mb": rss, "cooldown": cool}
            steps.append(st)
            self.log(f"    connect {rate:6d}/s: {okc}/{started} ok, errors {errs}, p50 {lat['p50']:.1f} "
                     f"p99 {lat['p99']:.1f} ms, broker {cpu_pct:.0f}%  {'PASS' if ok else 'FAIL'}")
            if not ok:
                if best is None and rate // 2 >= 10 and len(steps) < 8:
                    rates.insert(i, rate // 2)  # the first rate already fails: walk down
                    time.sleep(2.0)
                    continue
                break
            best = rate
            if any(not x["ok"] for x in steps):
                break  # walked down from a failing first rate: this is the answer
            time.sleep(1.0)  # let the broker close the sockets
        self._cleanup()
        return {"params": {"step_s": p.storm_step, "rates": list(p.storm_rates)}, "best_rate": best,
                "steps": steps}

    def _rss_now(self) -> dict[str, int]:
        """The broker's processes' RSS in bytes now (label → bytes)."""
        return {k: rss for k, (_, rss) in self.mon.sample().items() if k in self.broker_labels}

    def held_connections(self) -> dict:
        """Memory and CPU per connection held: `held_connections` clean-session clients, each subscribed at
        QoS 1 to its own command topic, connected (at most `hold_concurrency` CONNECTs in flight per worker)
        and held. RSS of every broker process before the first CONNECT, once the broker is back near its idle
        CPU with all of them held, and after they are closed; CPU over `hold_window` s while they are held
        (the generator pings each every 20 s). Bytes per connection = RSS growth ÷ connections held: run it
        before scenarios that leave freed memory behind for the allocator to reuse (the bench runs it first)."""
        p = self.prof
        self.gen.call("setup", {"cfg": self.cfg, "subs": [], "pubs": []}, timeout=30)
        n, workers = p.held_connections, len(self.gen)
        counts = [n // workers + (1 if w < n % workers else 0) for w in range(workers)]
        try:
            self.cooldown()
            before = self._rss_now()
            rs = self.gen.call("hold", [{"count": k, "prefix": f"bench-{self.token}-h{w}",
                                         "concurrency": p.hold_concurrency} for w, k in enumerate(counts)],
                               timeout=120 + n / 20)
            connected = sum(r["ok_count"] for r in rs)
            errors = sum(r["errors"] for r in rs)
            connect_s = max(r["seconds"] for r in rs)
            settle = self.cooldown()
            held_rss = self._rss_now()
            win = self.mon.window_start()
            time.sleep(p.hold_window)
            procs = self._broker_window(win)
            still = sum(r["open"] for r in self.gen.call("held", {}, timeout=30))
            self.gen.call("release", {}, timeout=60)
            self.cooldown()
            released = self._rss_now()
        finally:
            self._cleanup()
        mb = lambda b: round(b / 2**20, 1)  # noqa: E731
        per = {k: round((held_rss.get(k, 0) - before.get(k, 0)) / max(connected, 1)) for k in held_rss}
        per["total"] = sum(per.values())
        cpu = {k: v["cpu_pct"] for k, v in procs.items()}
        cpu["total"] = round(sum(cpu.values()), 1)
        res = {"params": {"connections": n, "concurrency": p.hold_concurrency, "window_s": p.hold_window},
               "connected": connected, "errors": errors,
               "error_samples": [e for r in rs for e in r["error_samples"]][:3],
               "connect_s": round(connect_s, 2), "connects_per_s": round(connected / max(connect_s, 1e-6), 1),
               "open_at_end": still, "settle": settle,
               "rss_before_mb": {k: mb(v) for k, v in before.items()},
               "rss_held_mb": {k: mb(v) for k, v in held_rss.items()},
               "rss_released_mb": {k: mb(v) for k, v in released.items()},
               "rss_growth_mb": mb(sum(held_rss.values()) - sum(before.values())),
               "bytes_per_conn": per, "held_cpu_pct": cpu, "idle_pct": self.idle_pct,
               "ok": errors == 0 and still == connected}
        self.log(f"    held {connected}/{n} connections (connected in {connect_s:.1f}s, errors {errors}), still open "
                 f"{still}; broker RSS +{res['rss_growth_mb']} MB = {per['total']} B per connection; CPU held "
                 f"{cpu['total']}% of a core  {'PASS' if res['ok'] else 'FAIL'}")
        return res

    def run(self, scenario: str, search: bool) -> dict:
        if scenario == "p2p":
            return self.p2p(search)
        if scenario in ("fan-in-app", "fan-in-dev"):
            return self.fan_in(scenario[-3:], search)
        if scenario.startswith("fan-out-q"):
            return self.fan_out(int(scenario[-1]), search)
        if scenario == "backlog":
            return self.backlog(self.prof.backlog)
        if scenario == "backlog-100k":
            return self.backlog(self.prof.backlog_big, tag="backlog-100k")
        if scenario == "backlog-app":
            return self.backlog(self.prof.backlog_app, kind="app", tag="backlog-app")
        if scenario == "connect":
            return self.connect_storm()
        if scenario == "connections":
            return self.held_connections()
        if scenario == "faults":
            self.cooldown()
            return run_faults(self.broker, self.prof.faults, self.log)
        raise ValueError(scenario)
