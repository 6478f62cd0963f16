"""Repeated backlog drains against ONE started tbmq-py (issue 12 goal 6a), for A/B comparisons of the drain
path: a whole `make bench` run measures one drain per scenario, and single drains on a 2-vCPU host spread by
a third.

    .venv/bin/python scripts/drain_loop.py [drains] [count]

Starts the suite as `make bench` does, runs 10 s of the bench's p2p load at 1,000 msg/s (Kafka's JIT;
bench.profile.SteadyLoad), then `drains` times `bench.scenarios.Runner.backlog(count)`: `count` QoS 1
messages to an offline persistent DEVICE subscriber, then its reconnect, timed to the last message. Prints each drain
(seconds, CONNACK and first message, lost / duplicates) and the median of the drains after the first two.
Defaults: 8 drains of 10,000."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile import SteadyLoad  # noqa: E402


def main() -> None:
    drains = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    with SteadyLoad("tbmq", rate=1000, seconds=10) as load:
        load.finish()
        times = []
        for i in range(drains):
            r = load.runner.backlog(count, "dev", f"drain{i}")
            times.append(r["drain_s"])
            print(f"drain {i}: {r['drain_s']:.3f} s (CONNACK {r['connack_s']:.3f}, first message "
                  f"{r['first_msg_s']:.3f}), lost {r['lost']}, duplicates {r['dup']}", flush=True)
        if len(times) > 2:
            print(f"median of drains 2..{len(times) - 1}: {statistics.median(times[2:]):.3f} s")


if __name__ == "__main__":
    main()
