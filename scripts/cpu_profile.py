"""Where one service's CPU goes under the bench's p2p load, by the CPU clock (docs/performance.md, "The
thirty-first round"). A measurement tool, not a test: it asserts nothing.

    .venv/bin/python scripts/cpu_profile.py [service=connector] [rate=1000] [warmup_s=60] [window_s=20] [top=30]

py-spy (`bench profile`) samples by the wall clock and counts a thread that is runnable but waiting for a
CPU as busy. On this 2-vCPU host a write that wakes another process is often preempted by it, so py-spy
puts the wait on the writing frame (the twenty-first and thirty-first rounds). This tool profiles the
service's main thread (its event loop) with cProfile timed by `time.thread_time`, the thread's own CPU, so
waiting for a CPU counts nothing. It starts the suite as `make bench` does (bench.profile.SteadyLoad: 100
persistent QoS 1 pairs) with scripts/cpu_profile_site on PYTHONPATH (its sitecustomize.py switches the
profiler on in that one service, from `warmup_s` for `window_s`) and prints the functions by their own CPU.

cProfile is deterministic: it roughly doubles the profiled process's CPU and inflates small, often-called
functions most. Read the shares and call counts per message, not the absolute times. Time spent inside a C
method that cProfile does not see as a call (uvloop's `transport.write`, for one) is the caller's own time.
"""

from __future__ import annotations

import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile import SteadyLoad  # noqa: E402

SITE = Path(__file__).resolve().parent / "cpu_profile_site"


def main() -> None:
    argv = sys.argv[1:]
    service = argv[0] if argv else "connector"
    nums = [float(a) for a in argv[1:5]]
    rate, warmup, window, top = nums + [1000.0, 60.0, 20.0, 30.0][len(nums):]
    out = Path(tempfile.mkdtemp(prefix="cpu-profile-")) / f"{service}.prof"
    os.environ.update(CPU_PROFILE_SERVICE=service, CPU_PROFILE_AT=str(warmup), CPU_PROFILE_FOR=str(window),
                      CPU_PROFILE_OUT=str(out),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")])))
    # the profile's clock starts when the service does, a few seconds before the load: run on past it
    with SteadyLoad("tbmq", rate=rate, seconds=warmup + window + 15):
        deadline = time.monotonic() + warmup + window + 60
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(1)
    if not out.exists():
        sys.exit(f"no profile written to {out} (is {service!r} an OTEL_SERVICE_NAME of the suite?)")
    stats = pstats.Stats(str(out))
    messages = rate * window
    print(f"{service} at {rate:.0f} msg/s p2p: {stats.total_tt:.2f} s of main-thread CPU under cProfile in "
          f"{window:.0f} s ({1e6 * stats.total_tt / messages:.0f} us per message with the profiler's overhead); "
          f"stats in {out}")
    print(f"{'own %':>6} {'calls/msg':>9}  function")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:int(top)]
    for (path, line, name), (_, calls, own, _cum, _) in rows:
        where = f"{Path(path).name}:{line}" if line else path
        print(f"{100 * own / stats.total_tt:6.1f} {calls / messages:9.2f}  {name} ({where})")


if __name__ == "__main__":
    main()
