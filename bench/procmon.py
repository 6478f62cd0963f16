"""CPU and RSS of labelled processes (broker processes, generator workers), sampled with psutil.

Each label is a root pid; its descendants are included (a service that forks counts as one). CPU is the
cpu_times() delta (user+system, seconds) over a window; RSS is the peak of the samples taken by a
background thread every `interval` seconds (sum over the process tree).
"""

from __future__ import annotations

import os
import threading
import time

import psutil

from . import calibrate
from .stats import expand_names


# HotSpot names its JIT compiler threads "C1 CompilerThread<n>" / "C2 CompilerThread<n>" (comm: 15 chars)
_COMPILER_THREADS = ("C1 CompilerThre", "C2 CompilerThre")


def stat_user_system(line: str) -> tuple[int, int]:
    """CPU clock ticks (user, system) of one /proc/<pid>[/task/<tid>]/stat line.

    A stat line is "<tid> (<comm>) <state> ..." with utime and stime the 14th and 15th fields; comm may hold
    spaces and parentheses, so the fields are counted after its last ')'."""
    rest = line[line.rfind(")") + 2:].split()
    return int(rest[11]), int(rest[12])  # fields 14 and 15 of the line


def stat_ticks(line: str) -> int:
    """CPU clock ticks (user + system) of one /proc/<pid>[/task/<tid>]/stat line (stat_user_system)."""
    user, system = stat_user_system(line)
    return user + system


def compiler_ticks(stats: list[str]) -> int:
    """CPU clock ticks (user + system) of the JIT compiler threads among /proc/<pid>/task/*/stat lines."""
    total = 0
    for line in stats:
        open_, close = line.find("("), line.rfind(")")
        if open_ < 0 or close < open_:
            continue
        if line[open_ + 1:close].startswith(_COMPILER_THREADS):
            total += stat_ticks(line)
    return total


def jit_compile_cpu_s(pid: int) -> float | None:
    """CPU seconds so far of a JVM's JIT compiler threads (None: no such process, or not a HotSpot JVM)."""
    stats = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stats.append(f.read())
            except OSError:  # the thread ended meanwhile
                continue
    except OSError:
        return None
    if not any(f"({name}" in line for line in stats for name in _COMPILER_THREADS):
        return None
    return compiler_ticks(stats) / os.sysconf("SC_CLK_TCK")


def thread_stats(pid: int) -> dict[int, tuple[str, int]]:
    """{tid: (comm, CPU clock ticks so far)} of every thread of a process ({} when it is gone)."""
    out: dict[int, tuple[str, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                line = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (line[line.find("(") + 1:line.rfind(")")], stat_ticks(line))
    return out


def thread_cpu_pct(pid: int, before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]],
                   seconds: float, ticks_per_s: float, digits: int = 1) -> list[tuple[str, float]]:
    """Pure: CPU % of one core per thread name over a window, from two `thread_stats` snapshots, busiest
    first, rounded to `digits` decimals. The process's own thread (tid = pid) is "main"; threads of one name
    are summed ("grpc_global_tim" × 3 is one row); a thread that started in the window counts from 0, one that
    ended is left out."""
    if seconds <= 0:
        return []
    per: dict[str, int] = {}
    for tid, (comm, ticks) in after.items():
        name = "main" if tid == pid else comm
        per[name] = per.get(name, 0) + ticks - before.get(tid, (comm, 0))[1]
    return sorted(((n, round(100.0 * t / ticks_per_s / seconds, digits)) for n, t in per.items()),
                  key=lambda x: (-x[1], x[0]))


class JitSettle:
    """Pure rule: has a JVM's JIT compilation settled? Fed the compiler threads' CPU seconds so far after
    every chunk of warm-up load; settled once `quiet_chunks` chunks in a row, each of at least `min_chunk_s`,
    used at most `max_pct` % of one core in them. C2 keeps compiling for minutes on a 2-core host (about 20 s
    of compiler CPU for Kafka), so a fixed warm-up leaves it inside the first measured steps; and it compiles
    in bursts, so one quiet chunk can be a lull between two (a chunk at 1 % was followed by chunks at 6, 11 and
    6 %: docs/performance.md, "The twenty-second round")."""

    def __init__(self, max_pct: float = 3.0, min_chunk_s: float = 5.0, quiet_chunks: int = 1) -> None:
        self.max_pct = max_pct
        self.min_chunk_s = min_chunk_s
        self.quiet_chunks = quiet_chunks
        self._last: tuple[float, float] | None = None  # (compiler cpu s, time)
        self.last_pct: float | None = None
        self._quiet = 0  # quiet chunks in a row so far

    def feed(self, compile_cpu_s: float, now: float) -> bool:
        last, self._last = self._last, (compile_cpu_s, now)
        if last is None or now - last[1] < self.min_chunk_s:
            if last is not None:
                self._last = last  # too short to judge: keep measuring from the earlier point
            return False
        self.last_pct = 100.0 * (compile_cpu_s - last[0]) / (now - last[1])
        self._quiet = self._quiet + 1 if self.last_pct <= self.max_pct else 0
        return self._quiet >= self.quiet_chunks


def process_tree(pid: int) -> list[psutil.Process]:
    """`pid`'s process and its descendants ([] once it has ended)."""
    try:
        p = psutil.Process(pid)
        return [p] + p.children(recursive=True)
    except psutil.Error:
        return []


class ProcMonitor:
    """Samples the CPU and RSS of labelled process trees every `interval` s (`window_start`/`window_end`), and
    with `probe_speed` also each cpu's speed: at every sample its thread moves to the next cpu and times one
    fixed Python workload (bench.calibrate, about 0.4-0.8 ms) in its own CPU time, so waiting for a busy cpu
    does not count but a slow vCPU does (the bench's two vCPUs were seen at 405 and 751 µs for it, the slow
    one changing: docs/performance.md, the ninth round); `window_speed` gives the median per cpu. Under load
    the figure also grows with the load itself (caches shared with the broker: 391-680 µs idle, 717-887 in a
    500 msg/s step on the same host), so it compares the same step between runs, not a step with the idle
    calibration. The probe visits every cpu, the broker's too in the one-core layout (about 0.5 ms of CPU
    per second there)."""

    def __init__(self, interval: float = 0.5, *, probe_speed: bool = False) -> None:
        self.interval = interval
        self._probe_cpus = sorted(os.sched_getaffinity(0)) if probe_speed else []
        self._speed: list[tuple[float, int, float]] = []  # (monotonic time, cpu, µs per round)
        self._probe_next = 0
        self.labels: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._dead_cpu: dict[str, float] = {}  # cpu of children seen earlier that have exited
        self._last_cpu: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, label: str, pid: int | None) -> None:
        if pid:
            with self._lock:
                self.labels[label] = pid

    def remove_prefix(self, prefix: str) -> None:
        with self._lock:
            for k in [k for k in self.labels if k.startswith(prefix)]:
                del self.labels[k]

    def start(self) -> "ProcMonitor":
        self._thread = threading.Thread(target=self._run, name="procmon", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(2)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
            if self._probe_cpus:
                self._probe()

    def _probe(self) -> None:
        """Time the calibration workload on the next cpu (this thread only is moved: Linux affinity is per
        thread)."""
        cpu = self._probe_cpus[self._probe_next % len(self._probe_cpus)]
        self._probe_next += 1
        try:
            os.sched_setaffinity(0, {cpu})
            us = calibrate.python_round_cpu_us()
        except OSError:  # the cpu went offline
            return
        with self._lock:
            self._speed.append((time.monotonic(), cpu, us))
            if len(self._speed) > 100_000:
                del self._speed[:50_000]

    def speed_between(self, t0: float, t1: float) -> dict[str, float]:
        """cpu → median µs of the probe's workload between monotonic times t0 and t1 ({} without a probe)."""
        with self._lock:
            samples = [(cpu, us) for t, cpu, us in self._speed if t0 <= t <= t1]
        out = {}
        for cpu in sorted({c for c, _ in samples}):
            vals = sorted(us for c, us in samples if c == cpu)
            out[str(cpu)] = round(vals[len(vals) // 2], 1)
        return out

    def sample(self) -> dict[str, tuple[float, int]]:
        """label → (cpu seconds so far, rss bytes now); updates peaks."""
        out = {}
        with self._lock:
            items = list(self.labels.items())
        for label, pid in items:
            cpu = 0.0
            rss = 0
            for p in process_tree(pid):
                try:
                    t = p.cpu_times()
                    c = t.user + t.system
                    rss += p.memory_info().rss
                except psutil.Error:
                    continue
                self._last_cpu[(label, p.pid)] = c
                cpu += c
            # include the last known cpu of processes of this label that are gone
            alive = {p.pid for p in process_tree(pid)}
            gone = [k for k in self._last_cpu if k[0] == label and k[1] not in alive]
            for k in gone:
                self._dead_cpu[label] = self._dead_cpu.get(label, 0.0) + self._last_cpu.pop(k)
            cpu += self._dead_cpu.get(label, 0.0)
            with self._lock:
                if rss > self._peak.get(label, 0):
                    self._peak[label] = rss
            out[label] = (cpu, rss)
        return out

    def window_start(self) -> dict:
        with self._lock:
            self._peak = {}
        snap = self.sample()
        return {"t": time.monotonic(), "cpu": {k: v[0] for k, v in snap.items()}}

    def window_end(self, start: dict) -> dict:
        """→ {label: {cpu_s, cpu_pct, rss_mb}} for the window since `start` (cpu_pct: % of one core)."""
        snap = self.sample()
        wall = max(time.monotonic() - start["t"], 1e-6)
        with self._lock:
            peaks = dict(self._peak)
        res = {}
        for label, (cpu, rss) in snap.items():
            d = cpu - start["cpu"].get(label, cpu)
            res[label] = {"cpu_s": round(d, 3), "cpu_pct": round(100.0 * d / wall, 1),
                          "rss_mb": round(max(peaks.get(label, 0), rss) / 2**20, 1)}
        return res

    def window_speed(self, start: dict) -> dict[str, float]:
        """`speed_between` the window's start and now."""
        return self.speed_between(start["t"], time.monotonic())


def set_affinity_tree(pid: int, cpus: set[int]) -> int:
    """Pin every thread of `pid` and of its descendants (sched_setaffinity acts per thread). → threads pinned."""
    n = 0
    for p in process_tree(pid):
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus)
                n += 1
            except OSError:
                pass
    return n


def cpu_layout(n_cpus: int | None = None) -> tuple[set[int] | None, set[int] | None]:
    """(broker cpus, generator cpus): split the cpus we may use in two halves; None when only one cpu."""
    try:
        avail = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return None, None
    if n_cpus:
        avail = avail[:n_cpus]
    return layout_cpus("one-core", avail)


def renice_tree(pid: int, nice: int) -> None:
    """Set the nice value of `pid` and its descendants (negative values need root)."""
    for p in process_tree(pid):
        try:
            p.nice(nice)
        except psutil.Error:
            pass


LAYOUTS = ("whole", "one-core")
LAYOUT_ALIASES = {"both": LAYOUTS, "all": LAYOUTS, "whole-machine": ("whole",), "onecore": ("one-core",),
                  "one": ("one-core",), "pinned": ("one-core",)}


def parse_layouts(spec: str) -> list[str]:
    """"both" → ["whole", "one-core"]; "one-core,whole" keeps the order given."""
    out = expand_names(spec, LAYOUTS, LAYOUT_ALIASES, "layout")
    if not out:
        raise ValueError("no layout given")
    return out


def layout_cpus(layout: str, avail: list[int] | None = None) -> tuple[set[int] | None, set[int] | None]:
    """(broker cpus, generator cpus) of a layout. "whole": nothing pinned (None, None), broker and generator
    share every cpu as under `make run`. "one-core": the broker on the first half of the cpus (cpu0 on a
    2-core machine), the generator on the second half; (None, None) with a single cpu."""
    if layout == "whole":
        return None, None
    if layout != "one-core":
        raise ValueError(layout)
    if avail is None:
        return cpu_layout()
    avail = sorted(avail)
    if len(avail) < 2:
        return None, None
    half = len(avail) // 2
    return set(avail[:half]), set(avail[half:])
