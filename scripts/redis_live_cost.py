"""Where Redis's CPU goes under the bench's live p2p load, by Redis's own counters (docs/performance.md, "The
fortieth round"). A measurement tool, not a test: it asserts nothing.

    .venv/bin/python scripts/redis_live_cost.py [rate=1000] [window_s=30] [warmup_s=60]

Starts the suite as `make bench` does (bench.profile.SteadyLoad: 100 persistent QoS 1 pairs at `rate` msg/s,
Redis with its append-only file as under `make run`) and, after `warmup_s`, reads `INFO all` at both ends of a
`window_s` window: Redis's user and system CPU per message (its main thread and all), commands per message, and
per command its calls a second and its time per message (`INFO commandstats`). EVALSHA's time includes the
commands its scripts call; what is left of it is the Lua code and the glue around each `redis.call`.
scripts/redis_script_cost.py measures the same scripts on an idle Redis without persistence, in isolation.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile import SteadyLoad  # noqa: E402
from redis_script_cost import NOT_SCRIPTS  # noqa: E402  (this folder is on sys.path: the script's own)


def snapshot(r: redis.Redis) -> dict:
    info = r.info("all")
    return {"time": time.monotonic(), "info": info,
            "commands": {k.removeprefix("cmdstat_"): v for k, v in info.items() if k.startswith("cmdstat_")}}


def main() -> None:
    nums = [float(a) for a in sys.argv[1:4]]
    rate, window, warmup = nums + [1000.0, 30.0, 60.0][len(nums):]
    with SteadyLoad("tbmq", rate=rate, seconds=warmup + window + 20) as load:
        r = redis.Redis(port=load.broker.suite.redis.port)
        time.sleep(warmup)
        a = snapshot(r)
        time.sleep(window)
        b = snapshot(r)
    seconds = b["time"] - a["time"]
    messages = rate * seconds
    ia, ib = a["info"], b["info"]

    def per_msg(key: str) -> float:
        return 1e6 * (ib[key] - ia[key]) / messages

    print(f"Redis at {rate:.0f} msg/s p2p, {seconds:.0f} s after {warmup:.0f} s; CPU µs per message: "
          f"user {per_msg('used_cpu_user'):.1f} (main thread {per_msg('used_cpu_user_main_thread'):.1f}), "
          f"system {per_msg('used_cpu_sys'):.1f} (main thread {per_msg('used_cpu_sys_main_thread'):.1f})")
    calls = (ib["total_commands_processed"] - ia["total_commands_processed"]) / messages
    print(f"{calls:.2f} commands per message (the scripts' own calls included)")
    print(f"{'command':>12} {'calls/s':>9} {'per msg':>8} {'µs/msg':>7}")
    rows = []
    for name, stats in b["commands"].items():
        before = a["commands"].get(name, {"calls": 0, "usec": 0})
        n = stats["calls"] - before["calls"]
        if n:
            rows.append((name, n / seconds, n / messages, (stats["usec"] - before["usec"]) / messages))
    for name, per_s, per_m, us in sorted(rows, key=lambda row: -row[3]):
        print(f"{name:>12} {per_s:9.1f} {per_m:8.2f} {us:7.2f}")
    # split as scripts/redis_script_cost.py splits it: what is not a script call or an admin command ran
    # inside the scripts
    inner = sum(us for name, _, _, us in rows if f"cmdstat_{name}" not in NOT_SCRIPTS)
    script = sum(us for name, _, _, us in rows if name in ("evalsha", "evalsha_ro"))
    print(f"scripts: {script:.1f} µs per message, of which the commands they call {inner:.1f}, "
          f"Lua and glue {script - inner:.1f}")


if __name__ == "__main__":
    main()
