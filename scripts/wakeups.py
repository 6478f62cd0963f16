"""Wake-ups per message of every process of tbmq-py's path, by rate (issue 12 goal 2b; docs/performance.md,
"The seventeenth round"). A measurement tool, not a test: it asserts nothing.

    .venv/bin/python scripts/wakeups.py [rate ...]

Starts the suite as `make bench` does, runs 20 s of the bench's p2p load at 1,000 msg/s (Kafka's JIT;
bench.profile.SteadyLoad), then one bench p2p step per rate (default 1000 and 2500 msg/s: 100 pairs, QoS 1,
2 s warm-up + 20 s measured). Over each step's measured window it reads, for every process, the context
switches of all its threads from /proc/<pid>/task/*/status and their CPU from .../stat. A voluntary switch is a
thread going to sleep (epoll, a futex, a condition), so each is followed by a wake-up: the voluntary switches
per second are the process's wake-ups per second, the thread hops of gRPC's own threads included. Prints per
process: wake-ups per second, per delivered message, CPU µs per message and CPU µs per wake-up, then the
wake-ups per second of each thread name (a process's own thread is "main")."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.procmon import stat_ticks  # noqa: E402
from bench.profile import SteadyLoad  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def switches(pid: int) -> tuple[int, int, int, dict[str, int]]:
    """(voluntary, involuntary context switches, CPU ticks) summed over the threads of `pid` alive now, and
    the voluntary switches per thread name."""
    vol = invol = ticks = 0
    per: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0, 0, per
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("Name:"):
                        name = "main" if tid == str(pid) else line.split(None, 1)[1].strip()
                    elif line.startswith("voluntary_ctxt_switches"):
                        n = int(line.split()[1])
                        vol += n
                        per[name] = per.get(name, 0) + n
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol += int(line.split()[1])
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                ticks += stat_ticks(f.read())
        except OSError:  # the thread ended meanwhile
            continue
    return vol, invol, ticks, per


def main() -> None:
    rates = [float(r) for r in sys.argv[1:]] or [1000.0, 2500.0]
    with SteadyLoad("tbmq", rate=1000, seconds=20) as load:
        load.finish()
        runner, pids = load.runner, load.pids
        for rate in rates:
            runner._setup(*runner._p2p_clients(f"w{int(rate)}"))
            out: dict = {}
            t = threading.Thread(target=lambda: out.update(runner.step(rate)), daemon=True)
            t.start()
            time.sleep(runner.prof.warmup + 0.5)   # the step's own warm-up (and its 0.3 s start offset)
            before = {k: switches(p) for k, p in pids.items()}
            t0 = time.monotonic()
            time.sleep(runner.prof.duration - 0.5)
            after = {k: switches(p) for k, p in pids.items()}
            secs = time.monotonic() - t0
            t.join()
            runner._cleanup()
            msgs = out.get("out_rate", rate) * secs
            print(f"\n{rate:.0f} msg/s in: p50 {out['e2e_ms']['p50']:.1f} / p99 {out['e2e_ms']['p99']:.1f} ms, "
                  f"lost {out['lost']}, window {secs:.1f} s, {msgs:.0f} messages")
            print(f"{'process':<22}{'wake-ups/s':>11}{'per msg':>9}{'involuntary/s':>15}{'CPU µs/msg':>12}"
                  f"{'CPU µs/wake-up':>16}")
            total_w = total_cpu = 0.0
            for k in pids:
                vol = after[k][0] - before[k][0]
                invol = after[k][1] - before[k][1]
                cpu_us = (after[k][2] - before[k][2]) / TICKS * 1e6
                total_w += vol
                total_cpu += cpu_us
                print(f"{k:<22}{vol / secs:>11.0f}{vol / msgs:>9.2f}{invol / secs:>15.0f}{cpu_us / msgs:>12.0f}"
                      f"{cpu_us / vol if vol else 0:>16.0f}")
            print(f"{'total':<22}{total_w / secs:>11.0f}{total_w / msgs:>9.2f}{'':>15}{total_cpu / msgs:>12.0f}"
                  f"{total_cpu / total_w if total_w else 0:>16.0f}")
            print("wake-ups/s per thread name (a thread that started or ended in the window is left out):")
            for k in pids:
                b, a = before[k][3], after[k][3]
                rows = sorted(((n, (a[n] - b[n]) / secs) for n in a if n in b), key=lambda r: -r[1])
                print(f"  {k}: " + ", ".join(f"{n} {w:.0f}" for n, w in rows if w >= 1))


if __name__ == "__main__":
    main()
