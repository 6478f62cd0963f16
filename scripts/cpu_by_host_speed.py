"""tbmq-py's CPU per message at one fixed rate, split by the host's speed during each step (issue 12, goal 2b: the
whole stack at most 400 µs of CPU per message at 1,000 msg/s). Every fixed step of `make bench` records the
bench's probe of each cpu's speed while it ran (`cpu_speed_us`: µs per 1,000 Python operations); this reads the
result files given, takes tbmq-py's p2p steps at `--rate` in `--layout`, and prints each step (stamp, µs per
message, the slower cpu's probe, p99) and a summary for the steps whose every cpu's probe was at most
`--threshold` (the host's normal speed) and for the others.

With `--against BROKER` (amqtt, mosquitto) it prints instead, for every result file where that broker ran the same
step, tbmq-py's µs per message divided by the broker's and the median of those ratios: the host's speed moves
the two Python brokers alike, so this is the figure that compares across hosts (issue 12's goal 2b was set on a
host where amqtt used 710 and Mosquitto 70 µs per message at 1,000 msg/s: 0.56 and 5.7 times theirs).

    .venv/bin/python scripts/cpu_by_host_speed.py bench/results/20261206-*.json \\
        [--rate 1000] [--layout whole] [--threshold 450] [--goal 400] [--exclude STAMP ...] [--against amqtt]

A reading tool (docs/performance.md, "The forty-fifth round" to "The forty-seventh round"), not a test."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import fixed_steps, passed_us_per_msg, step_us_per_msg  # noqa: E402


def _results(paths: list[str], layout: str, exclude: set[str]):
    """(stamp, the layout's results by scenario) of every readable result file, in file order."""
    for p in sorted(paths):
        stamp = Path(p).stem
        if stamp in exclude:
            continue
        try:
            data = json.loads(Path(p).read_text())
        except (OSError, ValueError):
            continue
        yield stamp, data.get("layouts", {}).get(layout, {}).get("results", {})


def steps(paths: list[str], rate: float, layout: str, exclude: set[str]) -> list[tuple[str, float, float, float]]:
    """(stamp, µs per message, slower cpu's probe, p99 ms) of every matching step, in file order."""
    found = []
    for stamp, results in _results(paths, layout, exclude):
        for s in fixed_steps(results.get("p2p", {}).get("tbmq", {})):
            speed = s.get("cpu_speed_us") or {}
            if s.get("rate") == rate and speed and step_us_per_msg(s):
                found.append((stamp, step_us_per_msg(s), max(speed.values()), s["e2e_ms"]["p99"]))
    return found


def ratios(paths: list[str], rate: float, layout: str, exclude: set[str],
           other: str) -> list[tuple[str, float, float, float]]:
    """(stamp, tbmq-py's µs per message, `other`'s, their ratio) of every file where both passed the p2p step
    (bench.report.passed_us_per_msg, as the run's own table)."""
    found = []
    for stamp, results in _results(paths, layout, exclude):
        us = passed_us_per_msg({"p2p": results.get("p2p", {})}, ["tbmq", other]).get(("p2p", rate), {})
        if "tbmq" in us and other in us:
            found.append((stamp, us["tbmq"], us[other], us["tbmq"] / us[other]))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--layout", default="whole")
    ap.add_argument("--threshold", type=float, default=450.0, help="the probe (µs) up to which a step counts as normal speed")
    ap.add_argument("--goal", type=float, default=400.0, help="µs per message")
    ap.add_argument("--exclude", nargs="*", default=[], help="result stamps to leave out (A/B variants of other code)")
    ap.add_argument("--against", help="another broker of the same runs (amqtt, mosquitto): print tbmq-py ÷ it")
    a = ap.parse_args()
    if a.against:
        pairs = ratios(a.files, a.rate, a.layout, set(a.exclude), a.against)
        for stamp, t, o, r in pairs:
            print(f"{stamp}  tbmq {t:7.1f}  {a.against} {o:7.1f} µs/msg  ratio {r:5.2f}")
        if pairs:
            rs = [p[3] for p in pairs]
            print(f"{len(rs)} runs: tbmq ÷ {a.against} {min(rs):.2f}-{max(rs):.2f}, median {statistics.median(rs):.2f}")
        else:
            print(f"no run with both tbmq and {a.against} at {a.rate:g} msg/s")
        return
    found = steps(a.files, a.rate, a.layout, set(a.exclude))
    for stamp, us, probe, p99 in found:
        print(f"{stamp}  {us:7.1f} µs/msg  probe {probe:6.1f}  p99 {p99:6.1f} ms")
    for name, group in (("normal speed", [f for f in found if f[2] <= a.threshold]),
                        ("slow", [f for f in found if f[2] > a.threshold])):
        if not group:
            print(f"{name}: no step")
            continue
        us = [f[1] for f in group]
        print(f"{name} (probe {'<=' if name == 'normal speed' else '>'} {a.threshold:g}): {len(us)} steps, "
              f"{min(us):.0f}-{max(us):.0f} µs, median {statistics.median(us):.0f}, "
              f"{sum(u <= a.goal for u in us)} at or under {a.goal:g}; p99 {min(f[3] for f in group):.1f}-"
              f"{max(f[3] for f in group):.1f} ms")


if __name__ == "__main__":
    main()
