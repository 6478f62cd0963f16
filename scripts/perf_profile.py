"""Where each process's CPU goes by the code it runs, from the kernel's sampler: the Python interpreter, Kafka's
JIT-compiled Java, the JVM, the kernel, C libraries and C extensions (docs/performance.md, "The thirty-fifth
round"). A measurement tool, not a test: it asserts nothing.

    .venv/bin/python scripts/perf_profile.py [rate=1000] [warmup_s=60] [window_s=20]

Starts the suite as `make bench` does (bench.profile.SteadyLoad: 100 persistent QoS 1 pairs at `rate` msg/s),
and after `warmup_s` runs `perf record -a` (every CPU, 997 samples a second each, no call graphs) for
`window_s`. Then it attributes every sample to the suite's process whose thread took it and to the binary
(perf's "dso") the sampled instruction was in, and prints per process its share of one core and the
shares of that by kind of code:

- `python`: libpython (the interpreter: bytecode, objects, dicts, allocation);
- `jit`: code the JVM compiled (Java methods running as machine code: Kafka's request handling);
- `jvm`: libjvm (the JVM itself: its compilers, GC, runtime);
- `kernel`: system calls, the network stack, wake-ups and scheduling;
- `libc`: the C library (malloc, memcpy, ...);
- `ext`: C extensions and native libraries (uvloop, grpc's core, protobuf's upb, hiredis, Redis itself);
- `other`: anything else (the vDSO, unresolved addresses).

py-spy and cProfile see only Python frames and Java Flight Recorder only Java ones; this sees every
instruction, the kernel's included. It needs `perf` (linux-perf) and perf_event_paranoid <= 2 or root; the
sampling clock is `cpu-clock` where the guest has no PMU, so time the kernel spends with interrupts off
(waking a thread, for one) is counted where they are turned on again (`_raw_spin_unlock_irqrestore`).
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.procmon import process_tree  # noqa: E402
from bench.profile import SteadyLoad  # noqa: E402

FREQ = 997
SAMPLE = re.compile(r"^\s*(\d+)\s+\S+\s+\((.*)\)\s*$")
KINDS = ("python", "jit", "jvm", "kernel", "libc", "ext", "other")


def kind_of(dso: str) -> str:
    """The kind of code a sample's binary is (KINDS)."""
    name = dso.strip("()[]")
    if "libpython" in name:
        return "python"
    if name.startswith("JIT") or "/perf-" in name or "anon" in name:
        return "jit"
    if "libjvm" in name:
        return "jvm"
    if "kernel" in name:
        return "kernel"
    if "libc.so" in name or "libc-" in name or "libm.so" in name:
        return "libc"
    if ".so" in name or "redis" in name:
        return "ext"
    return "other"


def tally(script: str, owner: dict[int, str]) -> dict[str, collections.Counter]:
    """Samples per process and kind of code, from `perf script -F pid,ip,dso` lines ("<pid> <address>
    (<binary>)"); `owner` maps a pid to its process's name, and samples of other pids (the idle task, other
    programs) are left out."""
    samples: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in script.splitlines():
        m = SAMPLE.match(line)
        name = owner.get(int(m.group(1))) if m else None
        if name is not None:
            samples[name][kind_of(m.group(2))] += 1
    return samples


def main() -> None:
    if shutil.which("perf") is None:
        sys.exit("perf is not installed (Debian: linux-perf)")
    args = [float(a) for a in sys.argv[1:4]]
    rate, warmup, window = args + [1000.0, 60.0, 20.0][len(args):]
    data = Path(tempfile.mkdtemp(prefix="perf-profile-")) / "perf.data"
    with SteadyLoad("tbmq", rate=rate, seconds=warmup + window + 10) as load:
        owner = {p.pid: name for name, pid in load.pids.items() for p in process_tree(pid)}
        time.sleep(warmup)
        subprocess.run(["perf", "record", "-a", "-F", str(FREQ), "-o", str(data), "--", "sleep", str(window)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "pid,ip,dso"], check=True,
                            capture_output=True, text=True).stdout
    samples = tally(script, owner)
    per_core = FREQ * window / 100  # samples that make 1 % of one core
    print(f"p2p at {rate:.0f} msg/s, {window:.0f} s sampled after {warmup:.0f} s; % of one core, and the shares "
          f"of each process's CPU by kind of code (perf data: {data})")
    print(f"{'process':22} {'% core':>7} {'µs/msg':>7}  " + "  ".join(f"{k:>6}" for k in KINDS))
    for name, counts in sorted(samples.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(counts.values())
        pct = n / per_core
        shares = "  ".join(f"{100 * counts[k] / n:5.0f}%" for k in KINDS)
        print(f"{name:22} {pct:7.2f} {pct * 10_000 / rate:7.0f}  {shares}")


if __name__ == "__main__":
    main()
