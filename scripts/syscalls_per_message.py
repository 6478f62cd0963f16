"""Exchanges per p2p message, counted: read/write system calls and context switches of every tbmq-py process.

Starts the suite as `make bench` does (bench.brokers), runs the bench's p2p load (100 persistent QoS 1 pairs)
at a fixed rate, and after a warm-up reads each process's counters from /proc (summed over its threads, no
tracer attached): `syscr` / `syscw` (read- and write-type calls: read, write, writev, ...; a socket's
sendmsg/recvmsg, which gRPC's core uses, are not in them), voluntary and involuntary context switches,
and user + system CPU (the system part also alone: the kernel's share, system calls and the network stack
included). With STRACE=<process,...> it also runs `strace -c -f` on those processes for the
window (which slows them: use it for the kinds of calls, not for the CPU figures).

    .venv/bin/python scripts/syscalls_per_message.py [rate=1000] [window_s=20] [warmup_s=60]

MODE=p2p-clean makes the subscribers clean sessions (the live path: no device persistence), MODE=publish
leaves them out (bench.profile.SteadyLoad's modes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.procmon import stat_user_system  # noqa: E402
from bench.profile import SteadyLoad  # noqa: E402

FIELDS = ("syscr", "syscw", "vcs", "nvcs", "cpu_s", "sys_s")


def counters(pid: int) -> dict[str, float]:
    """The process's counters, summed over its threads."""
    out = dict.fromkeys(FIELDS, 0.0)
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            io = dict(line.split(":") for line in Path(f"{base}/io").read_text().splitlines())
            status = Path(f"{base}/status").read_text().splitlines()
            stat = Path(f"{base}/stat").read_text()
        except OSError:  # the thread ended
            continue
        out["syscr"] += int(io["syscr"])
        out["syscw"] += int(io["syscw"])
        for line in status:
            if line.startswith("voluntary_ctxt_switches"):
                out["vcs"] += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                out["nvcs"] += int(line.split()[1])
        user, system = stat_user_system(stat)
        out["cpu_s"] += (user + system) / tick
        out["sys_s"] += system / tick
    return out


def main() -> None:
    args = [float(a) for a in sys.argv[1:4]]
    rate, window, warmup = args + [1000.0, 20.0, 60.0][len(args):]
    mode = os.environ.get("MODE", "p2p")
    with SteadyLoad("tbmq", rate=rate, seconds=warmup + window + 5, mode=mode) as load:
        pids = load.pids
        time.sleep(warmup)
        before = {k: counters(v) for k, v in pids.items()}
        tracers = [subprocess.Popen(["strace", "-c", "-f", "-o", f"strace-{k}.txt", "-p", str(pids[k])])
                   for k in os.environ.get("STRACE", "").split(",") if k]
        t0 = time.monotonic()
        time.sleep(window)
        for p in tracers:
            p.send_signal(2)
        for p in tracers:
            p.wait()
        after = {k: counters(v) for k, v in pids.items()}
        n = rate * (time.monotonic() - t0)
    print(f"{rate:.0f} msg/s {mode}, {window:.0f} s window after {warmup:.0f} s; per message:")
    print(f"{'process':22} {'reads':>7} {'writes':>7} {'vol cs':>7} {'invol cs':>8} {'CPU us':>7}")
    total = dict.fromkeys(FIELDS, 0.0)
    for k in pids:
        d = {f: after[k][f] - before[k][f] for f in FIELDS}
        for f in FIELDS:
            total[f] += d[f]
        print(f"{k:22} {d['syscr'] / n:7.2f} {d['syscw'] / n:7.2f} {d['vcs'] / n:7.2f} {d['nvcs'] / n:8.2f} "
              f"{d['cpu_s'] * 1e6 / n:7.0f} {d['sys_s'] * 1e6 / n:9.0f}")
    print(f"{'total':22} {total['syscr'] / n:7.2f} {total['syscw'] / n:7.2f} {total['vcs'] / n:7.2f} "
          f"{total['nvcs'] / n:8.2f} {total['cpu_s'] * 1e6 / n:7.0f} {total['sys_s'] * 1e6 / n:9.0f}")
    e = load.result.get("e2e_ms", {})
    print(f"step: in {load.result.get('in_rate')}/s, out {load.result.get('out_rate')}/s, e2e p50 {e.get('p50')} "
          f"p99 {e.get('p99')} ms, lost {load.result.get('lost')}")


if __name__ == "__main__":
    main()
