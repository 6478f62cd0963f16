"""Pure statistics: latency summaries, loss/duplicate accounting, the max-rate search. No I/O."""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field


def percentile(sorted_vals, q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an ascending sequence; nan when empty."""
    n = len(sorted_vals)
    if n == 0:
        return math.nan
    if q <= 0:
        return float(sorted_vals[0])
    k = math.ceil(q / 100.0 * n) - 1
    return float(sorted_vals[min(max(k, 0), n - 1)])


def latency_summary(values_us: Iterable[int]) -> dict:
    """µs samples → {count, avg, p50, p95, p99, max} in milliseconds."""
    vals = sorted(values_us)
    n = len(vals)
    if n == 0:
        return {"count": 0, "avg": math.nan, "p50": math.nan, "p95": math.nan, "p99": math.nan, "max": math.nan}
    return {
        "count": n,
        "avg": sum(vals) / n / 1000.0,
        "p50": percentile(vals, 50) / 1000.0,
        "p95": percentile(vals, 95) / 1000.0,
        "p99": percentile(vals, 99) / 1000.0,
        "max": vals[-1] / 1000.0,
    }


def merge_us(chunks: Iterable[bytes]) -> array:
    """Concatenate array('q').tobytes() chunks sent by workers."""
    out = array("q")
    for c in chunks:
        out.frombytes(c)
    return out


def merge_ranges(replies: Iterable[dict]) -> dict[int, tuple[int, int]]:
    ranges: dict[int, tuple[int, int]] = {}
    for r in replies:
        for k, v in r.get("ranges", {}).items():
            ranges[int(k)] = (int(v[0]), int(v[1]))
    return ranges


def loss_from_seen(expected: dict[int, tuple[int, int]], seen: dict[int, Iterable[int]]) -> tuple[int, int]:
    """Reference implementation of the accounting (used by the tests to check the fast bitmap path).

    expected: publisher → [a, b) range of sequence numbers sent; seen: publisher → sequence numbers received
    (with repetitions). Returns (lost, duplicated)."""
    lost = dups = 0
    for pub, (a, b) in expected.items():
        got: dict[int, int] = {}
        for s in seen.get(pub, ()):
            got[s] = got.get(s, 0) + 1
        lost += sum(1 for s in range(a, b) if s not in got)
        dups += sum(c - 1 for c in got.values())
    return lost, dups


# -- max-rate search -----------------------------------------------------------------------------------

@dataclass
class StepResult:
    rate: float                   # target rate (msg/s in)
    ok: bool                      # passed the criteria
    p99_ms: float = math.nan
    lost: int = 0
    achieved: float = 0.0         # msg/s in actually sent and acknowledged in the window
    reason: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def judge(rate: float, p99_ms: float, lost: int, achieved: float, *, p99_limit_ms: float = 100.0,
          min_achieved: float = 0.95, disconnects: int = 0, extra: dict | None = None) -> StepResult:
    """A step passes when p99 ≤ limit, nothing is lost, nobody was disconnected and ≥95% of the target
    rate was really sent (a generator or broker that cannot keep up is a failure, not a pass)."""
    reasons = []
    if lost > 0:
        reasons.append(f"lost {lost}")
    if disconnects:
        reasons.append(f"{disconnects} disconnects")
    if not (p99_ms <= p99_limit_ms):  # nan fails
        reasons.append(f"p99 {p99_ms:.1f} ms > {p99_limit_ms:g}")
    if achieved < min_achieved * rate:
        reasons.append(f"achieved {achieved:.0f}/s < {min_achieved:.0%} of {rate:.0f}/s")
    return StepResult(rate=rate, ok=not reasons, p99_ms=p99_ms, lost=lost, achieved=achieved,
                      reason="; ".join(reasons), extra=extra or {})


def search_max_rate(probe: Callable[[float], StepResult], start: float, *, factor: float = 2.0,
                    max_rate: float = 1e6, max_steps: int = 10, resolution: float = 0.1,
                    ) -> tuple[float | None, list[StepResult]]:
    """Find the highest passing rate: multiply by `factor` until a step fails (or max_rate), then bisect
    between the best pass and the lowest fail until they are within `resolution` (relative) or the step
    budget is spent. Returns (best passing rate or None, every step in order).

    If the first step fails, it walks down by `factor` instead (until something passes)."""
    steps: list[StepResult] = []
    best: float | None = None
    fail: float | None = None
    rate = float(start)
    # phase 1: bracket
    while len(steps) < max_steps:
        r = probe(rate)
        steps.append(r)
        if r.ok:
            best = rate
            if fail is not None or rate >= max_rate:
                break
            rate = min(rate * factor, max_rate)
        else:
            fail = rate
            if best is not None:
                break
            rate = rate / factor
            if rate < 1:
                break
    # phase 2: bisect (geometric mean: rates span orders of magnitude)
    while best is not None and fail is not None and len(steps) < max_steps and fail / best > 1 + resolution:
        rate = math.sqrt(best * fail)
        r = probe(rate)
        steps.append(r)
        if r.ok:
            best = rate
        else:
            fail = rate
    return best, steps


# -- fixed rates, per-process cost, cool-down (pure) ---------------------------------------------------

def expand_names(spec: str, known: tuple, aliases: dict, what: str) -> list[str]:
    """A comma list of names and aliases → the names, in the order given, without repeats.
    ValueError on an unknown name."""
    out: list[str] = []
    for n in [x.strip() for x in spec.split(",") if x.strip()]:
        for s in aliases.get(n, (n,)):
            if s not in known:
                raise ValueError(f"unknown {what} {n!r}; known: {', '.join(known)}, {', '.join(aliases)}")
            if s not in out:
                out.append(s)
    return out


def parse_rates(spec: str) -> tuple[str, list[float]]:
    """"p2p=100,1000,2500" → ("p2p", [100.0, 1000.0, 2500.0]); rates kept in the order given, no duplicates."""
    name, sep, vals = spec.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"expected SCENARIO=RATE[,RATE...], got {spec!r}")
    rates: list[float] = []
    for v in vals.split(","):
        v = v.strip().replace("_", "")
        if not v:
            continue
        r = float(v[:-1]) * 1000 if v.lower().endswith("k") else float(v)
        if not r > 0:
            raise ValueError(f"rate must be > 0: {spec!r}")
        if r not in rates:
            rates.append(r)
    if not rates:
        raise ValueError(f"no rate in {spec!r}")
    return name.strip(), rates


def process_group(label: str) -> str:
    """A monitored process label → its kind: "connector-1" → "connector", "redis-2" → "redis"."""
    head, sep, tail = label.rpartition("-")
    return head if sep and tail.isdigit() else label


def us_per_msg(procs: dict, delivered: int) -> dict[str, float]:
    """CPU µs per delivered message of every broker process kind (instances summed) and their "total";
    generator workers are left out. Empty when nothing was delivered."""
    if not delivered:
        return {}
    out: dict[str, float] = {}
    for label, v in procs.items():
        if label.startswith("generator-"):
            continue
        g = process_group(label)
        out[g] = out.get(g, 0.0) + v["cpu_s"]
    total = sum(out.values())
    res = {g: round(s * 1e6 / delivered, 1) for g, s in out.items()}
    res["total"] = round(total * 1e6 / delivered, 1)
    return res


def is_cool(cpu_pct: float, idle_pct: float, margin_pct: float = 5.0) -> bool:
    """The broker is back near idle: its processes' total CPU (% of one core) ≤ idle + margin."""
    return cpu_pct <= idle_pct + margin_pct


def wait_cool(measure: Callable[[], float], idle_pct: float, *, margin_pct: float = 5.0, max_wait: float = 30.0,
              clock: Callable[[], float] | None = None) -> dict:
    """Cool-down before a measured step: call `measure()` (which itself takes a window, e.g. 1 s, and returns
    the broker's total CPU % of one core over it) until `is_cool` or `max_wait` seconds have passed.
    → {waited_s, cpu_pct (the last window), idle_pct, reached, windows}."""
    import time as _time
    clock = clock or _time.monotonic
    t0 = clock()
    n = 0
    while True:
        pct = measure()
        n += 1
        reached = is_cool(pct, idle_pct, margin_pct)
        waited = clock() - t0
        if reached or waited >= max_wait:
            return {"waited_s": round(waited, 1), "cpu_pct": round(pct, 1), "idle_pct": round(idle_pct, 1),
                    "reached": reached, "windows": n}
