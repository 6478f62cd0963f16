"""Idle CPU of every tbmq-py process, by thread name (Kafka's JVM threads included), after the bench's kind of
warm-up (issue 12 goal 4; docs/performance.md, "The thirtieth round"). A measurement tool, not a test: it
asserts nothing.

    .venv/bin/python scripts/idle_threads.py [wait_s=60] [window_s=30] [rate=0]

Starts the suite as `make bench` does (bench.profile.SteadyLoad), runs 25 s of the bench's p2p load at
500 msg/s (its broker warm-up), disconnects the clients, waits `wait_s` with no clients, then reads the CPU
(user + system) of every thread of every process from /proc/<pid>/task/*/stat over `window_s`, and prints each
process's share of one core with its busiest thread names (bench.procmon's thread_stats and thread_cpu_pct:
a process's own thread is "main"). The bench's own idle figure (`make bench`, "idle CPU after 60 s") is the
same sum over a 10 s window.

With a rate above 0 it measures the threads under that load instead (the thirty-first round): the bench's p2p
load runs at `rate` msg/s, and the window starts after `wait_s` of it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.procmon import thread_cpu_pct, thread_stats  # noqa: E402
from bench.profile import SteadyLoad  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def main() -> None:
    args = [float(a) for a in sys.argv[1:4]]
    wait, window, rate = args + [60.0, 30.0, 0.0][len(args):]
    with SteadyLoad("tbmq", rate=rate or 500, seconds=wait + window + 5 if rate else 25) as load:
        if not rate:
            load.finish()
        pids = dict(load.pids)
        time.sleep(wait)
        before = {k: thread_stats(p) for k, p in pids.items()}
        time.sleep(window)
        after = {k: thread_stats(p) for k, p in pids.items()}
    total = 0.0
    if rate:
        print(f"CPU, % of one core, over {window:.0f} s after {wait:.0f} s of p2p at {rate:.0f} msg/s:")
    else:
        print(f"idle CPU, % of one core, over {window:.0f} s after {wait:.0f} s with no clients:")
    for k, pid in pids.items():
        per = thread_cpu_pct(pid, before[k], after[k], window, TICKS, digits=6)
        cpu_pct = sum(v for _, v in per)
        total += cpu_pct
        busiest = ", ".join(f"{n} {v:.2f}" for n, v in per[:8] if v > 0)
        print(f"{k:22} {cpu_pct:5.2f}   {busiest}")
    print(f"{'total':22} {total:5.2f}")


if __name__ == "__main__":
    main()
