"""Where a backlog drain's time goes, 10 ms at a time (issue 12 goal 6a): CPU of the connector,
device-persistence, Redis and the bench's subscriber in each 10 ms of one drain, read from the kernel's
per-thread run time (/proc/<pid>/task/*/schedstat) every millisecond.

    .venv/bin/python scripts/drain_timeline.py [drains] [count]

Starts the suite as `make bench` does, runs 10 s of the bench's p2p load at 1,000 msg/s (Kafka's JIT), then
`drains` times `bench.scenarios.Runner.backlog(count)` (default 4 of 10,000) and prints the table of the last
one: a row per 10 ms from the reconnect to the last message, ms of CPU per process (20 = both cores). Kafka
and the router are left out (Kafka's hundred threads would make the sampler itself a load). The sampler runs
in this process and takes CPU from the drain: compare rows, not the drain's time.

A measurement tool (docs/performance.md, "The sixteenth round"), not a test: it asserts nothing."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile import SteadyLoad  # noqa: E402

BUCKET_NS = 10_000_000
KINDS = ("connector", "device-persistence", "redis")


def run_ns(files: list[str]) -> int:
    total = 0
    for f in files:
        try:
            with open(f) as fh:
                total += int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended
    return total


def sample(pids: dict[str, int], stop: threading.Event, out: list) -> None:
    files = {name: [f"/proc/{pid}/task/{t}/schedstat" for t in os.listdir(f"/proc/{pid}/task")]
             for name, pid in pids.items()}
    while not stop.is_set():
        out.append((time.monotonic_ns(), {name: run_ns(fs) for name, fs in files.items()}))
        time.sleep(0.001)


def table(samples: list, drain_s: float, subscriber: str) -> list[str]:
    names = list(samples[0][1])
    t0 = samples[0][0]
    buckets: dict[int, dict[str, int]] = {}
    for (_, before), (t, after) in zip(samples, samples[1:]):
        acc = buckets.setdefault((t - t0) // BUCKET_NS, dict.fromkeys(names, 0))
        for n in names:
            acc[n] += after[n] - before[n]
    # the drain ends with the subscriber's last busy 10 ms; it began drain_s before
    end = max(b for b, acc in buckets.items() if acc[subscriber] > 1_000_000)
    start = end - int(drain_s * 1e9) // BUCKET_NS - 1
    lines = ["    ms " + " ".join(f"{n[:18]:>18}" for n in names) + "   all"]
    for b in range(start, end + 1):
        acc = buckets.get(b, dict.fromkeys(names, 0))
        total = sum(acc.values())
        lines.append(f"{(b - start) * 10:6d} " + " ".join(f"{acc[n] / 1e6:18.1f}" for n in names)
                     + f"  {total / 1e6:5.1f} " + "#" * round(total / 1e6))
    return lines


def main() -> None:
    drains = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    with SteadyLoad("tbmq", rate=1000, seconds=10) as load:
        load.finish()
        pids = {k: v for k, v in load.pids.items() if k.rsplit("-", 1)[0] in KINDS or k in KINDS}
        subscriber = "generator-0"  # Runner.backlog's subscriber is on worker 0
        pids[subscriber] = load.gen.pids()[subscriber]
        for i in range(drains):
            stop, samples = threading.Event(), []
            sampler = threading.Thread(target=sample, args=(pids, stop, samples), daemon=True)
            sampler.start()
            r = load.runner.backlog(count, "dev", f"timeline{i}")
            stop.set()
            sampler.join()
            print(f"drain {i}: {r['drain_s']:.3f} s (CONNACK {r['connack_s']:.3f}), lost {r['lost']}, "
                  f"duplicates {r['dup']}", flush=True)
        print("\n".join(table(samples, r["drain_s"], subscriber)))


if __name__ == "__main__":
    main()
