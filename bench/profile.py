"""`python -m bench profile`: py-spy profile of every Python process of a broker under steady p2p load.

For each process: a flame graph (SVG) and collapsed stacks (raw), and a summary of the top costs —
"self" (the leaf function on the CPU) and "inclusive" (on the stack) — as a markdown file. py-spy runs with
--nonblocking (the target is not paused) and without --idle (samples of waiting threads are dropped, so
the percentages are shares of the process's busy time).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

from .brokers import BROKERS, BrokerUnavailable, make_workdir
from .gen import Generator
from .procmon import ProcMonitor, cpu_layout, thread_cpu_pct, thread_stats
from .scenarios import Profile, Runner

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def py_spy() -> str:
    exe = Path(sys.executable).parent / "py-spy"
    return str(exe) if exe.exists() else (shutil.which("py-spy") or "py-spy")


def is_python(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return "python" in os.path.basename(p.exe()) or "python" in " ".join(p.cmdline()[:1])
    except psutil.Error:
        return False


def _short(frame: str) -> str:
    """'handle (/x/y/site-packages/pkg/mod.py:12)' → 'handle (pkg/mod.py:12)'."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    f = m.group("file")
    for marker in ("site-packages/", "/src/", "/lib/python3"):
        if marker in f:
            f = f.split(marker, 1)[1]
            break
    line = m.group("line")
    return f"{m.group('func')} ({f}{':' + line if line else ''})"


def _strip_line(frame: str) -> str:
    return re.sub(r":\d+\)$", ")", frame)


# leaf functions that mean "waiting", not working (py-spy's idle detection misses some under --nonblocking)
IDLE_LEAVES = ("select (selectors.py)", "EpollSelector.select (selectors.py)", "poll (selectors.py)",
               "select (", "EpollSelector.select (", "poll (",
               "sleep (", "wait (threading.py)", "Condition.wait (threading.py)", "_wait_for_tstate_lock (")
# frames that are on every stack of an asyncio program: left out of the inclusive list
ROOT_FILES = ("asyncio/base_events.py)", "asyncio/events.py)", "asyncio/runners.py)", "click/core.py)",
              "typer/main.py)", "typer/core.py)", "runpy.py)", "threading.py)", "__main__.py)", "_script.py)",
              "<frozen runpy>)")


# leaves meaning "inside the C event loop (uvloop): epoll wait or socket I/O, not attributable from Python"
LOOP_LEAVES = ("Runner.run (asyncio/runners.py)", "run_until_complete (", "BaseEventLoop.run_until_complete (",
               "run_forever (", "Loop.run_forever (")


def _is_loop(frame: str) -> bool:
    return frame.startswith(LOOP_LEAVES)


def _is_idle(frame: str) -> bool:
    return any(frame.startswith(x) for x in IDLE_LEAVES)


def _is_root(frame: str) -> bool:
    return frame.startswith("<module> ") or frame.endswith(ROOT_FILES)


def summarize_collapsed(text: str, top: int = 12) -> dict:
    """Collapsed stacks ('a;b;c N' per line) → {samples, idle_samples, self: [(frame, pct)],
    inclusive: [(frame, pct)]}. Frames are grouped per function (line numbers dropped); samples whose leaf
    is a wait (select, sleep) are counted as idle, samples whose leaf is the event loop's entry (uvloop runs
    in C: epoll wait or socket I/O) as loop_samples, and both are left out; the event loop's own frames are
    left out of the inclusive list. Percentages are of the remaining samples (Python code running)."""
    self_c: Counter = Counter()
    incl: Counter = Counter()
    total = 0
    idle = 0
    loop = 0
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        stack, _, n = line.rpartition(" ")
        try:
            count = int(n)
        except ValueError:
            continue
        frames = [_strip_line(_short(f)) for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        if _is_idle(frames[-1]):
            idle += count
            continue
        if _is_loop(frames[-1]):
            loop += count
            continue
        total += count
        self_c[frames[-1]] += count
        for f in set(frames):
            if not _is_root(f):
                incl[f] += count
    pct = lambda c: [(f, round(100.0 * n / total, 1)) for f, n in c.most_common(top)] if total else []  # noqa: E731
    return {"samples": total, "idle_samples": idle, "loop_samples": loop, "self": pct(self_c),
            "inclusive": pct(incl)}


class SteadyLoad:
    """A broker started afresh under the bench's p2p load at a fixed rate, for measuring it from outside while
    the load runs (`python -m bench profile`, scripts/syscalls_per_message.py). Use as a context manager: on
    entry the broker is up (BrokerUnavailable otherwise) and the load has begun (`pids`: the broker's
    processes); `result` holds the step's figures once the block ended and the load finished (or once
    `finish()` returned: the broker then stays up for more scenarios on `runner` until the block ends).
    tbmq-py is laid out as under `make run` (device-persistence inside the router); the environment variable
    SEPARATE_DEVICE_PERSISTENCE=1 runs it as a process of its own (the scripts/ measurement tools use this)."""

    def __init__(self, broker: str, *, rate: float, seconds: float, pairs: int = 100, mode: str = "p2p",
                 pin: bool = False, workers: int | None = None) -> None:
        self.broker_name, self.rate, self.seconds, self.pairs, self.mode = broker, rate, seconds, pairs, mode
        self.pin, self.workers = pin, workers
        self.result: dict = {}
        self.pids: dict[str, int] = {}
        self._finished = False

    def __enter__(self) -> SteadyLoad:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> SteadyLoad:
        bcpus, gcpus = cpu_layout() if self.pin else (None, None)
        if gcpus:
            os.sched_setaffinity(0, gcpus)
        self.workdir = make_workdir()
        kw = ({"persist_in_router": os.environ.get("SEPARATE_DEVICE_PERSISTENCE", "") != "1"}
              if self.broker_name == "tbmq" else {})
        self.broker = BROKERS[self.broker_name](self.workdir, cpus=bcpus, **kw)
        try:
            self.broker.start()
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.mon = ProcMonitor().start()
        self.gen = Generator(self.workers or max(2, len(gcpus or ())), gcpus)
        try:
            self.pids = self.broker.pids()
            for k, v in {**self.pids, **self.gen.pids()}.items():
                self.mon.add(k, v)
            self.prof = Profile(duration=self.seconds, warmup=1.0, drain=10.0, pairs=self.pairs,
                                rates={"p2p": [self.rate]}, search=())
            self.runner = Runner(self.broker, self.gen, self.mon, self.prof, log=lambda *a: None)
            subs, pubs = self.runner._p2p_clients()
            if self.mode == "publish":  # publishers only: the ingestion path (PUBLISH → PUBACK), nobody subscribed
                subs = []
            elif self.mode == "p2p-clean":  # non-persistent subscribers (no device persistence on the path)
                for sub in subs:
                    sub["clean"] = True
            self.runner._setup(subs, pubs)
            self.thread = threading.Thread(target=lambda: self.result.update(self.runner.step(self.rate)),
                                           daemon=True)
            self.thread.start()
        except BaseException:
            self._close()
            raise
        return self

    def finish(self) -> None:
        """Wait for the load's end and disconnect its clients; the broker stays up (more scenarios may run
        on `runner`, e.g. scripts/drain_loop.py). Once only."""
        if not self._finished:
            self._finished = True
            self.thread.join(self.seconds + 60)
            self.runner._cleanup()

    def stop(self) -> None:
        """Wait for the load's end, then stop everything."""
        try:
            self.finish()
        finally:
            self._close()

    def _close(self) -> None:
        self.gen.close()
        self.mon.stop()
        self.broker.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def profile(args) -> int:
    if args.broker == "mosquitto":
        print("mosquitto is C: py-spy profiles Python processes only (use perf for mosquitto)")
        return 2
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    outdir = args.out / f"profile-{args.broker}-{stamp}"
    outdir.mkdir(parents=True, exist_ok=True)
    load = SteadyLoad(args.broker, rate=args.rate, seconds=args.seconds + 2, pairs=args.pairs, mode=args.mode,
                      pin=not args.no_pin, workers=args.workers)
    try:
        load.start()
    except BrokerUnavailable as e:
        print(f"{args.broker} unavailable: {e}")
        return 3
    try:
        targets = {k: v for k, v in load.pids.items() if is_python(v)}
        print(f"broker {args.broker} on :{load.broker.port}; python processes: {targets}; "
              f"others (not profiled): {[k for k in load.pids if k not in targets]}")
        time.sleep(1.5)  # past the warm-up
        # per-thread CPU from /proc over py-spy's window: py-spy --nonblocking counts some waiting threads as
        # busy (gRPC's poller thread in Thread.run), so its shares are set beside what each thread really used
        threads_before = {label: thread_stats(pid) for label, pid in targets.items()}
        t_before = time.monotonic()
        procs = []
        for label, pid in targets.items():
            for fmt, ext in (("raw", "txt"), ("flamegraph", "svg")):
                cmd = [py_spy(), "record", "--pid", str(pid), "--duration", str(int(args.seconds)),
                       "--rate", str(args.rate_hz), "--nonblocking", "--subprocesses", "--format", fmt,
                       "-o", str(outdir / f"{label}.{ext}")]
                procs.append((label, fmt, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        for label, fmt, p in procs:
            out, _ = p.communicate(timeout=args.seconds + 60)
            if p.returncode != 0:
                print(f"py-spy {label} ({fmt}) failed: {out.decode(errors='replace')[-500:]}")
        window = time.monotonic() - t_before
        threads = {label: thread_cpu_pct(pid, threads_before[label], thread_stats(pid), window,
                                         os.sysconf("SC_CLK_TCK")) for label, pid in targets.items()}
    finally:
        load.stop()
    prof, result = load.prof, load.result
    what = {"p2p": f"{args.pairs} pairs (persistent subscribers)",
            "p2p-clean": f"{args.pairs} pairs (clean-session subscribers)",
            "publish": f"{args.pairs} publishers, no subscribers"}[args.mode]
    lines = [f"# py-spy profile of {args.broker} under {args.mode} load ({stamp})", "",
             f"Load: {what}, QoS 1, {prof.payload} B, {args.rate:.0f} msg/s in; py-spy "
             f"{args.rate_hz} Hz for {args.seconds:.0f} s, --nonblocking, busy samples only.",
             "", "py-spy samples by the wall clock: a thread that is runnable but preempted (waiting for a CPU, "
             "often for the process it has just woken) counts as busy in the frame it stopped in, so on a "
             "loaded host the shares below rank wall time, not CPU (docs/performance.md, the thirty-first "
             "round; scripts/cpu_profile.py ranks by the CPU clock).", ""]
    if result:
        e = result["e2e_ms"]
        lines += [f"During the profile: in {result['in_rate']:.0f}/s, out {result['out_rate']:.0f}/s, "
                  f"e2e p50 {e['p50']:.1f} ms p99 {e['p99']:.1f} ms, lost {result['lost']}.", ""]
        lines += ["| process | CPU % (1 core=100) | RSS MB |", "|---|---:|---:|"]
        lines += [f"| {k} | {v['cpu_pct']} | {v['rss_mb']} |" for k, v in result["processes"].items()]
        lines.append("")
    summaries = {}
    for label in targets:
        raw = outdir / f"{label}.txt"
        if not raw.exists():
            continue
        s = summarize_collapsed(raw.read_text(), args.top)
        summaries[label] = s
        lines += [f"## {label}", "",
                  f"{s['samples']} samples in Python code (the percentages below are of these), "
                  f"{s['loop_samples']} inside the C event loop (uvloop: epoll/socket I/O, or waiting), "
                  f"{s['idle_samples']} waiting in select/sleep.", "",
                  "Per thread (from /proc, CPU % of one core over py-spy's window; py-spy's shares below count "
                  "some waiting threads as busy): "
                  + (", ".join(f"{n} {p}" for n, p in threads.get(label, [])[:6]) or "–"), "",
                  "| self % | function | | inclusive % | function |",
                  "|---:|---|---|---:|---|"]
        for i in range(max(len(s["self"]), len(s["inclusive"]))):
            a = s["self"][i] if i < len(s["self"]) else ("", "")
            b = s["inclusive"][i] if i < len(s["inclusive"]) else ("", "")
            lines.append(f"| {a[1]} | `{a[0]}` | | {b[1]} | `{b[0]}` |")
        lines.append("")
    md = "\n".join(lines)
    (outdir / "summary.md").write_text(md)
    print(md)
    print(f"\nprofile files: {outdir}")
    return 0
