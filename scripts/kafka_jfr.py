"""Where the local Kafka's CPU goes under the bench's p2p load: a Java Flight Recorder profile of the broker
(docs/performance.md, "The thirty-first round"). A measurement tool, not a test: it asserts nothing.

    .venv/bin/python scripts/kafka_jfr.py [rate=1000] [warmup_s=90] [window_s=30]

Starts the suite as `make bench` does (bench.profile.SteadyLoad: 100 persistent QoS 1 pairs), lets the broker's
JIT settle for `warmup_s`, records `window_s` with `jcmd <pid> JFR.start` (Java code sampled every millisecond),
and prints:
- the broker's CPU in the window from /proc (user and system separately, % of one core);
- how much of it JFR saw in Java code (its samples; a thread in a system call, in the JIT or in the garbage
  collector is not sampled, so the rest is the kernel's and the JVM's own work);
- the sampled threads, and the Java frames by their own and by their inclusive share of the samples.
Needs the JDK's `jcmd` and `jfr` (Java 17, as `make bootstrap` installs it)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.procmon import stat_user_system  # noqa: E402
from bench.profile import SteadyLoad  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def user_system(pid: int) -> tuple[int, int]:
    """The process's user and system CPU so far, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        return stat_user_system(f.read())


def frame_name(frame: dict) -> str:
    m = frame["method"]
    return f"{m['type']['name'].replace('/', '.')}.{m['name']}"


def summarize(events: list[dict], top: int = 25) -> tuple[collections.Counter, list, list]:
    """Pure: (samples per thread, [(self share %, frame)], [(inclusive share %, frame)]) of JFR
    ExecutionSample events as `jfr print --json` writes them."""
    threads: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    for e in events:
        v = e["values"]
        threads[(v.get("sampledThread") or {}).get("javaName") or "?"] += 1
        frames = [frame_name(f) for f in (v.get("stackTrace") or {}).get("frames") or []]
        if frames:
            own[frames[0]] += 1
            for name in set(frames):
                incl[name] += 1
    n = max(len(events), 1)
    return (threads, [(100.0 * c / n, f) for f, c in own.most_common(top)],
            [(100.0 * c / n, f) for f, c in incl.most_common(top)])


def main() -> None:
    args = [float(a) for a in sys.argv[1:4]]
    rate, warmup, window = args + [1000.0, 90.0, 30.0][len(args):]
    out = Path(tempfile.mkdtemp(prefix="kafka-jfr-"))
    jfr = out / "kafka.jfr"
    with SteadyLoad("tbmq", rate=rate, seconds=warmup + window + 10) as load:
        pid = load.pids["kafka"]
        time.sleep(warmup)
        u0, s0 = user_system(pid)
        subprocess.run(["jcmd", str(pid), "JFR.start", "name=tbmq", "settings=profile",
                        "jdk.ExecutionSample#period=1ms", f"duration={int(window)}s", f"filename={jfr}"],
                       check=True, capture_output=True)
        time.sleep(window)
        u1, s1 = user_system(pid)
        deadline = time.monotonic() + 30
        while not jfr.exists() and time.monotonic() < deadline:  # written when the recording ends
            time.sleep(0.5)
    dump = subprocess.run(["jfr", "print", "--json", "--stack-depth", "64", "--events", "jdk.ExecutionSample",
                           str(jfr)], check=True, capture_output=True, text=True).stdout
    events = json.loads(dump)["recording"]["events"]
    threads, own, incl = summarize(events)
    user, system = 100.0 * (u1 - u0) / TICKS / window, 100.0 * (s1 - s0) / TICKS / window
    java = 100.0 * len(events) / 1000.0 / window  # one sample per millisecond of Java code run
    e = load.result.get("e2e_ms", {})
    print(f"{rate:.0f} msg/s p2p, {window:.0f} s window after {warmup:.0f} s (e2e p50 {e.get('p50')} p99 "
          f"{e.get('p99')} ms, lost {load.result.get('lost')}); recording {jfr}")
    print(f"Kafka's CPU, % of one core: user {user:.2f}, system {system:.2f}, total {user + system:.2f}; "
          f"in Java code (JFR's samples) about {java:.2f}")
    print("samples by thread: " + ", ".join(f"{t} {c}" for t, c in threads.most_common(8)))
    print("own share of the samples:")
    for pct, name in own:
        print(f"  {pct:5.1f} {name}")
    print("inclusive share of the samples:")
    for pct, name in incl:
        print(f"  {pct:5.1f} {name}")


if __name__ == "__main__":
    main()
