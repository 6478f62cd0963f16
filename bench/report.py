"""The comparison table (text/markdown), the JSON file and the PNG chart."""

from __future__ import annotations

import json
import math
from pathlib import Path


# rate scenarios ("fan-in": results written before fan-in-app / fan-in-dev existed)
RATE_SCENARIOS = ("p2p", "fan-in-app", "fan-in-dev", "fan-in", "fan-out-q0", "fan-out-q1")
# the order of tbmq-py's process kinds in tables; other kinds (mosquitto, amqtt, redis-2...) follow
PROCESS_ORDER = ("connector", "router", "device-persistence", "app-delivery", "session-registry", "kafka", "redis")
COLORS = {"tbmq": "#1f77b4", "mosquitto": "#2ca02c", "amqtt": "#ff7f0e"}
LAYOUT_TITLES = {"whole": "whole machine (nothing pinned; broker and generator share both cores, as under `make run`)",
                 "one-core": "one core (broker pinned to cpu0, generator to cpu1)"}


def _num(v, nd=1):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int) or (isinstance(v, float) and abs(v) >= 100):
        return f"{v:,.0f}"
    if isinstance(v, float):
        a = abs(v)
        return f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 1 or a == 0 else f"{v:.3f}"
    return str(v)


def _get(d, path):
    for k in path:
        if d is None:
            return None
        d = d.get(k) if isinstance(d, dict) else None
    return d


# (scenario, metric label, path into the scenario result, higher is better?)
def rows_for(scenario: str, res_by_broker: dict) -> list[tuple[str, tuple, bool | None]]:
    if scenario in RATE_SCENARIOS:
        rate = next((r["fixed"]["rate"] for r in res_by_broker.values() if r and "fixed" in r), None)
        rows = [
            ("max in msg/s (p99≤100ms, 0 lost)", ("search", "best_in"), True),
            ("max in+out msg/s", ("search", "best_in_out"), True),
            (f"@{_num(rate)}/s: in msg/s", ("fixed", "in_rate"), True),
            (f"@{_num(rate)}/s: out msg/s", ("fixed", "out_rate"), True),
            (f"@{_num(rate)}/s: e2e avg ms", ("fixed", "e2e_ms", "avg"), False),
            (f"@{_num(rate)}/s: e2e p50 ms", ("fixed", "e2e_ms", "p50"), False),
            (f"@{_num(rate)}/s: e2e p95 ms", ("fixed", "e2e_ms", "p95"), False),
            (f"@{_num(rate)}/s: e2e p99 ms", ("fixed", "e2e_ms", "p99"), False),
            (f"@{_num(rate)}/s: PUBACK p99 ms", ("fixed", "puback_ms", "p99"), False),
            (f"@{_num(rate)}/s: lost / dup", None, None),
            (f"@{_num(rate)}/s: broker CPU % (1 core=100)", ("fixed", "broker_cpu_pct"), False),
            (f"@{_num(rate)}/s: broker CPU µs/delivered msg", ("fixed", "broker_us_per_msg"), False),
            (f"@{_num(rate)}/s: broker RSS MB", ("fixed", "broker_rss_mb"), False),
            (f"@{_num(rate)}/s: generator CPU %", ("fixed", "generator_cpu_pct"), None),
        ]
        if not any(r and "search" in r for r in res_by_broker.values()):
            rows = rows[2:]
        return rows
    if scenario.startswith("backlog"):
        n = next((r["params"].get("messages") for r in res_by_broker.values() if r and "params" in r), None)
        kind = next((r["params"].get("client_type") for r in res_by_broker.values() if r and "params" in r), None)
        return [
            (f"{_num(n)} msgs{' to ' + kind if kind else ''}: drain s (after reconnect)", ("drain_s",), False),
            ("drain msg/s", ("drain_rate",), True),
            ("CONNACK s (after reconnect)", ("connack_s",), False),
            ("first message s (after reconnect)", ("first_msg_s",), False),
            ("delivered", ("delivered",), True),
            ("lost / dup", None, None),
            ("publish msg/s (offline sub)", ("publish_rate",), True),
            ("broker RSS MB", ("broker_rss_mb",), False),
        ]
    if scenario == "connect":
        return [
            ("max connects/s (p99≤1s, 0 refused)", ("best_rate",), True),
        ]
    if scenario == "connections":
        n = next((r["params"].get("connections") for r in res_by_broker.values() if r and "params" in r), None)
        return [
            (f"{_num(n)} held: connected", ("connected",), True),
            ("still open at the end", ("open_at_end",), True),
            ("connect + SUBSCRIBE all s", ("connect_s",), False),
            ("broker RSS growth MB", ("rss_growth_mb",), False),
            ("broker bytes per connection", ("bytes_per_conn", "total"), False),
            ("broker CPU % with them held (1 core=100)", ("held_cpu_pct", "total"), False),
        ]
    return []


def table(results: dict, brokers: list[str], fmt: str = "text") -> str:
    """results: scenario → broker → result (or {"error": ...})."""
    ran = [b for b in brokers if any(isinstance(results[s].get(b), dict) and "error" not in results[s][b]
                                     for s in results)]
    ref = ran[0] if ran else None
    others = [b for b in ran if b != ref]
    head = ["scenario", "metric", *ran, *[f"{ref}÷{o}" for o in others]]
    lines = []
    for scen, by_b in results.items():
        ok = {b: r for b, r in by_b.items() if isinstance(r, dict) and "error" not in r}
        if not ok:
            continue
        for label, path, higher in rows_for(scen, ok):
            vals = []
            for b in ran:
                r = ok.get(b)
                if r is None:
                    vals.append("n/a" if b in by_b else "–")
                elif path is None:  # lost / dup
                    base = r.get("fixed", r)
                    vals.append(f"{_num(base.get('lost'))} / {_num(base.get('dup'))}")
                else:
                    v = _num(_get(r, path))
                    if path[0] == "search" and _get(r, ("search", "unbounded")):
                        v = "≥" + v  # no step failed: the broker's limit is above what was tried
                    elif path[0] == "search" and _get(r, path) is None and _get(r, ("search", "steps")):
                        low = min(st["rate"] for st in r["search"]["steps"])  # nothing passed
                        v = "<" + _num(low * (1 + r["params"]["out_per_in"]) if path[-1] == "best_in_out" else low)
                    vals.append(v)
            ratios = []
            for o in others:
                a = _get(ok.get(ref), path) if path else None
                c = _get(ok.get(o), path) if path else None
                if isinstance(a, (int, float)) and isinstance(c, (int, float)) and c and not (
                        math.isnan(a) or math.isnan(c)) and higher is not None:
                    ratios.append(f"{a / c:.2f}×")
                else:
                    ratios.append("")
            lines.append([scen, label, *vals, *ratios])
    errors = [f"{scen} / {b}: {r['error']}" for scen, by_b in results.items() for b, r in by_b.items()
              if isinstance(r, dict) and "error" in r]
    # a broker that failed every scenario the same way: say it once
    dedup = []
    for b in brokers:
        msgs = {r["error"] for by_b in results.values() for bb, r in by_b.items()
                if bb == b and isinstance(r, dict) and "error" in r}
        if len(msgs) == 1 and b not in ran:
            dedup.append(f"{b}: {msgs.pop()}")
            errors = [e for e in errors if f" / {b}: " not in e]
    errors = dedup + errors
    if fmt == "md":
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(str(c) for c in ln) + " |" for ln in lines]
        out += [""] + [f"Not measured: {e}" for e in errors] if errors else []
        return "\n".join(out)
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head))]
    fmt_line = lambda ln: "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)  # noqa: E731
                                    for i, (c, w) in enumerate(zip(ln, widths)))
    out = [fmt_line(head), "  ".join("-" * w for w in widths)]
    prev = None
    for ln in lines:
        if prev is not None and ln[0] != prev:
            out.append("")
        prev = ln[0]
        out.append(fmt_line(ln))
    if errors:
        out += ["", *[f"not measured: {e}" for e in errors]]
    return "\n".join(out)


def _render(head: list[str], rows: list[list], fmt: str, left: int = 2) -> str:
    """A table as markdown or aligned text; the first `left` columns are left-aligned, the rest right."""
    rows = [[str(c) for c in r] for r in rows]
    if fmt == "md":
        return "\n".join(["| " + " | ".join(head) + " |",
                          "|" + "".join("---|" if i < left else "---:|" for i in range(len(head)))] +
                         ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) if i < left else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(ln, widths))).rstrip() for ln in [head, *rows])


def _ok_results(results: dict, brokers: list[str]):
    """(scenario, broker, result) of every rate scenario that ran, in table order."""
    for scen, by_b in results.items():
        if scen not in RATE_SCENARIOS:
            continue
        for b in brokers:
            r = by_b.get(b)
            if isinstance(r, dict) and "error" not in r and ("fixed_steps" in r or "fixed" in r):
                yield scen, b, r


def fixed_steps(r: dict) -> list[dict]:
    return r.get("fixed_steps") or ([r["fixed"]] if r.get("fixed") else [])


def step_speed_text(speed: dict | None) -> str:
    """The host's speed during a step (`cpu_speed_us`: cpu -> median µs of the probe's 1,000 Python operations,
    bench.procmon), one figure per cpu ("329 / 364"; "–" for a result file without it). Brokers measured one
    after another can meet the host at different speeds: a CPU figure is comparable only beside its speed."""
    return " / ".join(_num(v) for _, v in sorted((speed or {}).items(), key=lambda kv: int(kv[0]))) or "–"


def jit_us_per_msg(step: dict) -> float | None:
    """CPU µs per delivered message of the broker's JVM JIT compiler threads during a step (counted in its
    µs/msg, in "kafka"): a start-up transient, not the steady state. None for a broker without a JVM."""
    pct, out = step.get("jit_cpu_pct"), step.get("out_rate")
    if pct is None or not out or "kafka" not in (step.get("us_per_msg") or {}):
        return None  # (files of the first interleaved runs gave other brokers' steps tbmq-py's JIT figure)
    return pct * 1e4 / out  # % of one core = pct × 10,000 µs of CPU per second


def step_us_per_msg(step: dict) -> float | None:
    """A fixed step's CPU µs per delivered message over all the broker's processes (older result files: the
    broker-wide figure)."""
    return (step.get("us_per_msg") or {}).get("total", step.get("broker_us_per_msg"))


def passed_us_per_msg(results: dict, brokers: list[str]) -> dict[tuple[str, float], dict[str, float]]:
    """{(scenario, rate): {broker: CPU µs per delivered message}} of every fixed step that passed: what the
    brokers' ratios are drawn from (relative_cpu_table; scripts/cpu_by_host_speed.py --against). An overloaded
    broker's CPU per delivered message compares with nothing, so a failed step is left out."""
    by: dict[tuple[str, float], dict[str, float]] = {}
    for scen, b, r in _ok_results(results, brokers):
        for st in fixed_steps(r):
            us = step_us_per_msg(st)
            if us and st.get("ok"):
                by.setdefault((scen, st["rate"]), {})[b] = us
    return by


def relative_cpu_table(results: dict, brokers: list[str], fmt: str = "text") -> str:
    """The first broker's CPU per delivered message as a multiple of each other broker's, at every fixed rate of
    every scenario where both were measured. The host's speed moves a step's µs/msg by up to a factor of two
    (the probe in `fixed_steps_table`); it moves the two Python brokers' alike (Mosquitto's, C, less), and the
    brokers' steps at one rate run minutes apart (p2p interleaved), so the ratio to amqtt compares across hosts
    and runs where the µs/msg does not. Issue 12's goal 2b (400 µs per message at 1,000 msg/s) was set on a host
    where Mosquitto used 7 % and amqtt 71 % of a core at that rate (70 and 710 µs per message): 5.7 and 0.56
    times their cost. Only steps that passed count (a failed step's figure is "–"). Empty with one broker."""
    if len(brokers) < 2:
        return ""
    first, others = brokers[0], brokers[1:]
    rows = []
    for (scen, rate), us in passed_us_per_msg(results, brokers).items():
        if first not in us or not any(o in us for o in others):
            continue
        rows.append([scen, _num(rate), _num(us[first]), *[_num(us.get(o)) for o in others],
                     *[f"{us[first] / us[o]:.2f}" if o in us else "–" for o in others]])
    head = ["scenario", "rate/s", f"{first} µs/msg", *[f"{o} µs/msg" for o in others],
            *[f"{first} ÷ {o}" for o in others]]
    return _render(head, rows, fmt) if rows else ""


def fixed_steps_table(results: dict, brokers: list[str], fmt: str = "text") -> str:
    """Every fixed-rate step: rates, e2e percentiles, loss, the cool-down before it, broker CPU per message (of
    it, the JVM's JIT compiling) and the host's speed while it ran."""
    head = ["scenario", "broker", "rate/s", "in/s", "out/s", "p50 ms", "p95 ms", "p99 ms", "lost / dup",
            "cool-down s", "broker CPU %", "µs/msg", "of it JIT", "host µs", "ok"]
    rows = []
    for scen, b, r in _ok_results(results, brokers):
        for st in fixed_steps(r):
            e = st.get("e2e_ms") or {}
            cool = st.get("cooldown")
            cd = "–" if not cool else _num(cool["waited_s"]) + ("" if cool["reached"] else " (not reached)")
            total = step_us_per_msg(st)
            rows.append([scen, b, _num(st["rate"]), _num(st.get("in_rate")), _num(st.get("out_rate")),
                         _num(e.get("p50")), _num(e.get("p95")), _num(e.get("p99")),
                         f"{_num(st.get('lost'))} / {_num(st.get('dup'))}", cd, _num(st.get("broker_cpu_pct")),
                         _num(total), _num(jit_us_per_msg(st)), step_speed_text(st.get("cpu_speed_us")),
                         "yes" if st.get("ok") else "no: " + str(st.get("reason", ""))])
    return _render(head, rows, fmt) if rows else ""


def process_kinds(steps: list[dict]) -> list[str]:
    """The process kinds found in steps' us_per_msg, tbmq-py's in PROCESS_ORDER first, "total" left out."""
    seen: list[str] = []
    for st in steps:
        for k in st.get("us_per_msg") or {}:
            if k != "total" and k not in seen:
                seen.append(k)
    return sorted(seen, key=lambda k: (PROCESS_ORDER.index(k) if k in PROCESS_ORDER else len(PROCESS_ORDER), k))


def process_us_table(results: dict, broker: str, fmt: str = "text") -> str:
    """CPU µs per delivered message of each of `broker`'s processes (instances of a kind summed) and the
    total, for every fixed-rate step and backlog drain. Empty for a broker without per-step figures."""
    items = _process_items(results, broker)
    kinds = process_kinds([st for _, _, st in items])
    if not kinds:
        return ""
    rows = [[scen, rate, *[_num((st.get("us_per_msg") or {}).get(k)) for k in kinds],
             _num((st.get("us_per_msg") or {}).get("total"))] for scen, rate, st in items]
    return _render(["scenario", "step", *kinds, "total"], rows, fmt)


def _process_items(results: dict, broker: str) -> list[tuple[str, str, dict]]:
    """(scenario, step label, step or backlog result) of `broker` that carry us_per_msg."""
    items = []
    for scen, by_b in results.items():
        r = by_b.get(broker)
        if not isinstance(r, dict) or "error" in r:
            continue
        if scen in RATE_SCENARIOS:
            items += [(scen, _num(st["rate"]) + "/s", st) for st in fixed_steps(r)]
        elif scen.startswith("backlog") and r.get("us_per_msg"):
            items.append((scen, "drain", r))
    return items


def per_process_tables(results: dict, brokers: list[str], fmt: str = "text") -> list[tuple[str, str]]:
    """(broker, process_us_table) of the brokers with more than one process kind (for a one-process broker
    the fixed-rate steps table's µs/msg is that process)."""
    return [(b, process_us_table(results, b, fmt)) for b in brokers
            if len(process_kinds([st for _, _, st in _process_items(results, b)])) > 1]


def held_table(results: dict, brokers: list[str], fmt: str = "text") -> str:
    """Per broker process: RSS before, with the "connections" scenario's clients held and after they closed,
    bytes per connection and CPU % while held."""
    rows = []
    for b in brokers:
        r = (results.get("connections") or {}).get(b)
        if not isinstance(r, dict) or "error" in r:
            continue
        for label in r["rss_held_mb"]:
            rows.append([b, label, _num(r["rss_before_mb"].get(label)), _num(r["rss_held_mb"][label]),
                         _num(r["rss_released_mb"].get(label)), _num(r["bytes_per_conn"].get(label), 0),
                         _num(r["held_cpu_pct"].get(label))])
        rows.append([b, "**total**" if fmt == "md" else "total", "", "", "", _num(r["bytes_per_conn"]["total"], 0),
                     _num(r["held_cpu_pct"]["total"])])
    return _render(["broker", "process", "RSS before MB", "RSS held MB", "RSS after closing MB", "bytes per connection",
                    "CPU % held"], rows, fmt) if rows else ""


def idle_table(meta: dict, brokers: list[str], fmt: str = "text") -> str:
    """Idle CPU (% of one core) and RSS of every broker process, and the total per broker."""
    rows = []
    for b in brokers:
        idle = (meta.get(b) or {}).get("idle")
        if not idle:
            continue
        procs = idle.get("processes", idle)  # results written before idle had "processes" / "total_pct"
        total = idle.get("total_pct", sum(v["cpu_pct"] for v in procs.values()))
        for label, v in procs.items():
            rows.append([b, label, _num(v["cpu_pct"]), _num(v.get("rss_mb"))])
        rows.append([b, "**total**" if fmt == "md" else "total", _num(total), ""])
    return _render(["broker", "process", "idle CPU %", "RSS MB"], rows, fmt) if rows else ""


def runs_of(doc: dict) -> dict:
    """layout → {layout, pinning, brokers (meta), results}; a results file from before layouts existed
    is one run, named after its pinning."""
    if doc.get("layouts"):
        return doc["layouts"]
    pin = doc.get("pinning") or {}
    layout = "one-core" if pin.get("broker") else "whole"
    return {layout: {"layout": layout, "pinning": pin, "brokers": doc.get("brokers") or {},
                     "results": doc.get("results") or {}, "elapsed_s": doc.get("elapsed_s")}}


def broker_order(doc: dict) -> list[str]:
    if doc.get("broker_order"):
        return list(doc["broker_order"])
    out: list[str] = []
    for r in runs_of(doc).values():
        for b in [*r.get("brokers", {}), *[b for by_b in r["results"].values() for b in by_b]]:
            if b not in out:
                out.append(b)
    return out


def faults_table(results: dict, brokers: list[str], fmt: str = "text") -> str:
    """The "faults" scenario (bench/faults.py): one row per broker and fault. Empty when it did not run."""
    by_b = results.get("faults") or {}
    head = ["broker", "fault", "acked", "lost", "duplicates", "resumed after s", "longest stall s",
            "new CONNECT after s", "restarts"]
    lines = []
    for b in brokers:
        r = by_b.get(b)
        if not isinstance(r, dict):
            continue
        if "error" in r or "skipped" in r:
            lines.append([b, r.get("error") or r.get("skipped"), "", "", "", "", "", "", ""])
            continue
        for f in r.get("faults", []):
            resume = "never" if f.get("resume_s") is None else _num(f["resume_s"], 2)
            # runs from before the probe have no connect_s: "–"; a probe that never got in: "never"
            connect = "–" if "connect_s" not in f else "never" if f["connect_s"] is None else _num(f["connect_s"], 2)
            lines.append([b, f["fault"], _num(f["acked"]), _num(f["lost"]) + ("" if f.get("settled", True) else "*"),
                          _num(f["duplicates"]), resume, _num(f.get("stalled_s"), 2), connect,
                          _num(f["restarts"]) if "restarts" in f else ""])
    if not lines:
        return ""
    return _render(head, lines, fmt)


INTERLEAVED_TEXT = (
    "p2p's fixed-rate steps interleaved (`--interleave p2p`): every broker was started, warmed up, measured "
    "idle and put through the scenarios listed before p2p first, then the brokers took turns at each rate (each step with its own clients, connected before it "
    "and gone after it; every broker back near its idle CPU before each step), so that the brokers' steps at "
    "one rate meet the host minutes apart, not an hour. The brokers not measured wait idle beside the one "
    "measured. The other scenarios ran one broker after the other.")


def layout_text(run: dict, brokers: list[str]) -> str:
    """Everything printed for one layout at the end of a run."""
    res, meta = run["results"], run.get("brokers") or {}
    parts = [table(res, brokers)]
    if "p2p" in (run.get("interleaved") or ()):
        parts.append(INTERLEAVED_TEXT)
    ft = faults_table(res, brokers)
    if ft:
        parts.append("faults (acknowledged messages lost must be 0; * = owed messages still missing at the end "
                     "of the drain):\n" + ft)
    fs = fixed_steps_table(res, brokers)
    if fs:
        parts.append("fixed-rate steps:\n" + fs)
    rt = relative_cpu_table(res, brokers)
    if rt:
        parts.append(f"CPU per message against the other brokers at the same rate ({brokers[0]} ÷ each):\n" + rt)
    for b, pt in per_process_tables(res, brokers):
        parts.append(f"{b}: CPU µs per delivered message, per process:\n" + pt)
    ht = held_table(res, brokers)
    if ht:
        parts.append("held connections, per process:\n" + ht)
    it = idle_table(meta, brokers)
    if it:
        parts.append("idle (no clients):\n" + it)
    return "\n\n".join(parts)


def latency_points(r: dict) -> list[tuple[float, float, float, bool]]:
    """(in msg/s, p50 ms, p99 ms, passed) of every fixed and search step of a rate scenario, by in-rate."""
    pts = {}
    for st in fixed_steps(r):
        e = st.get("e2e_ms") or {}
        pts[st["rate"]] = (st.get("in_rate") or st["rate"], e.get("p50"), e.get("p99"), bool(st.get("ok")))
    for st in _get(r, ("search", "steps")) or []:
        if st["rate"] in pts:
            continue
        x = st.get("extra") or {}
        e = x.get("e2e_ms") or {}
        pts[st["rate"]] = (x.get("in_rate") or st.get("achieved") or st["rate"], e.get("p50", math.nan),
                           e.get("p99", st.get("p99_ms")), bool(st.get("ok")))
    clean = [(a, b if b is not None else math.nan, c if c is not None else math.nan, ok)
             for a, b, c, ok in pts.values() if a]
    return sorted(clean)


def latency_chart(path: Path, runs: dict, brokers: list[str], title: str = "") -> None:
    """e2e latency p50 (dashed) and p99 (solid) against in-rate, every broker, one row per layout and one
    column per rate scenario; failing steps are marked with a red x."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scens = [s for s in RATE_SCENARIOS if any(s in r["results"] for r in runs.values())]
    if not scens:
        return
    fig, axes = plt.subplots(len(runs), len(scens), figsize=(4.6 * len(scens), 3.6 * len(runs)), squeeze=False)
    for i, (layout, run) in enumerate(runs.items()):
        for j, scen in enumerate(scens):
            ax = axes[i][j]
            ax.set_title(f"{layout}: {scen}", fontsize=9)
            drawn = False
            for b in brokers:
                r = run["results"].get(scen, {}).get(b)
                if not isinstance(r, dict) or "error" in r:
                    continue
                pts = latency_points(r)
                if not pts:
                    continue
                drawn = True
                xs = [p[0] for p in pts]
                color = COLORS.get(b, "grey")
                ax.plot(xs, [p[2] if p[2] == p[2] else None for p in pts], "-o", color=color, ms=3, label=f"{b} p99")
                ax.plot(xs, [p[1] if p[1] == p[1] else None for p in pts], "--.", color=color, ms=3, alpha=0.7,
                        label=f"{b} p50")
                for x, _, p99, ok in pts:
                    if not ok and p99 == p99:
                        ax.plot([x], [p99], "x", color="red", ms=6)
            if not drawn:
                ax.axis("off")
                continue
            ax.axhline(100, color="red", lw=0.6, ls=":")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("in msg/s", fontsize=8)
            ax.set_ylabel("e2e ms", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6)
    if title:
        fig.suptitle("e2e latency against in-rate (p99 solid, p50 dashed, x = step failed) — " + title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96) if title else None)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)

    def default(o):
        if isinstance(o, (set, tuple)):
            return list(o)
        return str(o)

    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=default, allow_nan=True))
    tmp.replace(path)


def chart(path: Path, results: dict, brokers: list[str], title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for scen, by_b in results.items():
        ok = {b: r for b, r in by_b.items() if isinstance(r, dict) and "error" not in r}
        if not ok:
            continue
        if scen.startswith("backlog"):
            panels.append((f"{scen} {next(iter(ok.values()))['params']['messages']:,}: drain s (lower=better)",
                           {b: _get(r, ("drain_s",)) for b, r in ok.items()}, "bar"))
        elif scen == "connect":
            panels.append(("connect storm: max connects/s", {b: _get(r, ("best_rate",)) for b, r in ok.items()}, "bar"))
        elif scen == "connections":
            panels.append(("held connections: broker bytes per connection (lower=better)",
                           {b: _get(r, ("bytes_per_conn", "total")) for b, r in ok.items()}, "bar"))
        elif scen in RATE_SCENARIOS:
            if any("search" in r for r in ok.values()):
                def best(r):
                    v = _get(r, ("search", "best_in"))
                    steps = _get(r, ("search", "steps")) or []
                    if v is None and steps:  # nothing passed: show the lowest rate tried, marked "<"
                        return ("<", min(st["rate"] for st in steps))
                    return v
                panels.append((f"{scen}: max in msg/s at p99≤100ms, 0 lost",
                               {b: best(r) for b, r in ok.items()}, "bar"))
                panels.append((f"{scen}: search steps (p99 ms vs in msg/s)",
                               {b: [(s["rate"], s["p99_ms"], s["ok"]) for s in _get(r, ("search", "steps")) or []]
                                for b, r in ok.items()}, "line"))
            rate = next(iter(ok.values()))["fixed"]["rate"]
            panels.append((f"{scen} @{rate:,.0f}/s in: e2e p99 ms",
                           {b: _get(r, ("fixed", "e2e_ms", "p99")) for b, r in ok.items()}, "bar"))
    cpu = {scen: {b: _get(r, ("fixed", "broker_us_per_msg")) for b, r in by_b.items()
                  if isinstance(r, dict) and "error" not in r and "fixed" in r}
           for scen, by_b in results.items()}
    cpu = {k: v for k, v in cpu.items() if v}
    if cpu:
        panels.append(("broker CPU µs per delivered msg at the fixed rate (lower=better)", cpu, "group"))
    if not panels:
        return
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    colors = COLORS
    for ax, (ttl, data, kind) in zip(axes.flat, panels):
        ax.set_title(ttl, fontsize=9)
        if kind == "group":
            scens = list(data)
            names = [b for b in brokers if any(b in data[sc] for sc in scens)]
            w = 0.8 / max(len(names), 1)
            for k, b in enumerate(names):
                vals = [data[sc].get(b) for sc in scens]
                vals = [v if isinstance(v, (int, float)) and not math.isnan(v) else 0 for v in vals]
                ax.bar([i + k * w for i in range(len(scens))], vals, w, label=b, color=colors.get(b, "grey"))
            ax.set_xticks([i + w * (len(names) - 1) / 2 for i in range(len(scens))])
            ax.set_xticklabels(scens, fontsize=7)
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        elif kind == "bar":
            names = [b for b in brokers if b in data]
            labels = []
            vals = []
            for b in names:
                v = data[b]
                if isinstance(v, tuple):  # ("<", lowest rate tried)
                    labels.append("<" + _num(v[1]))
                    vals.append(0)
                    continue
                ok_num = isinstance(v, (int, float)) and not math.isnan(v)
                labels.append(_num(v) if ok_num else "–")
                vals.append(v if ok_num else 0)
            bars = ax.bar(names, vals, color=[colors.get(b, "grey") for b in names])
            for bar, lab in zip(bars, labels):
                ax.annotate(lab, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=8)
            if vals and max(vals) > 0 and min(v for v in vals) > 0 and max(vals) / min(vals) > 30:
                ax.set_yscale("log")
        else:
            for b in brokers:
                pts = sorted(data.get(b) or [])
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                ys = [p[1] if not math.isnan(p[1]) else None for p in pts]
                ax.plot(xs, ys, "-o", label=b, color=colors.get(b, "grey"), ms=3)
                for x, y, ok in pts:
                    if not ok and not math.isnan(y):
                        ax.plot([x], [y], "x", color="red", ms=6)
            ax.axhline(100, color="red", lw=0.6, ls="--")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("in msg/s", fontsize=8)
            ax.legend(fontsize=7)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97) if title else None)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


DOC_BEGIN = "<!-- bench:results:begin (generated: python -m bench doc <results.json> --write) -->"
DOC_END = "<!-- bench:results:end -->"


def replace_section(text: str, section: str) -> str:
    """`text` with everything from the begin marker to the end marker replaced by `section` (which carries
    both markers). ValueError when the markers are missing."""
    b = text.find(DOC_BEGIN.split(" (")[0])
    e = text.find(DOC_END, b if b >= 0 else 0)
    if b < 0 or e < 0:
        raise ValueError(f"markers {DOC_BEGIN.split(' (')[0]} … {DOC_END} not found")
    return text[:b] + section.strip() + text[e + len(DOC_END):]


def host_speed_text(speed: dict | None) -> str:
    """bench/calibrate.py's figures in words ("" for results from before it existed)."""
    if not speed:
        return ""
    return (f"host speed (bench/calibrate.py): Python {_per_cpu(speed['python_us'])} µs per 1,000 operations "
            f"(per cpu), a process-to-process round trip {speed['exchange_us']:.1f} µs "
            f"({speed['exchange_cpu_us']:.1f} µs of CPU)")


def _per_cpu(us) -> str:
    # a list per cpu; one number in results written before the per-cpu figure (20261129-015157.json)
    return " / ".join(f"{u:,.0f}" for u in (us if isinstance(us, list) else [us]))


def _host_speed_lines(start: dict | None, end: dict | None) -> list[str]:
    """The doc's line on the host's speed, at the start of the run and at its end (runs on hosts of another
    speed are not comparable figure by figure: docs/performance.md, the ninth round)."""
    if not start:
        return []
    text = host_speed_text(start)
    line = text[0].upper() + text[1:] + " at the start"
    if end:
        line += (f"; {_per_cpu(end['python_us'])} µs, {end['exchange_us']:.1f} µs ({end['exchange_cpu_us']:.1f}) "
                 "at the end")
    return ["", line + "."]


def doc_section(doc: dict, profile_md: str | None = None) -> str:
    """The "## Broker comparison" section of docs/performance.md from a results JSON (and a profile summary),
    between the markers `replace_section` looks for. The tables are rebuilt from the results with this
    version of the report code; results files from before layouts existed render as one layout."""
    runs = runs_of(doc)
    brokers = broker_order(doc)
    m = doc["machine"]
    prof = doc.get("profile", {})
    rates = "; ".join(f"{k} " + ", ".join(_num(float(x)) for x in (v if isinstance(v, list) else [v]))
                      for k, v in (prof.get("rates") or {}).items())
    stem = doc["timestamp"]
    lines = [
        DOC_BEGIN,
        "## Broker comparison",
        "",
        f"Run `{stem}` (`bench/results/{stem}.json`; charts `bench/results/{stem}.png`: e2e latency against "
        f"in-rate, `bench/results/{stem}-<layout>.png`: summary per layout), {doc.get('elapsed_s', '?')} s wall.",
        "",
        f"Machine: `nproc` = {m['nproc']}, `lscpu` model {m['cpu_model']}, {m['mem_gib']} GiB, kernel {m['kernel']}, "
        f"CPython {m['python']}. Load average at start {m['loadavg_at_start']}, at end {doc.get('loadavg_at_end')} "
        "(other engineers' work shares the machine: every figure below shares the CPU with it).",
        *_host_speed_lines(m.get("host_speed"), doc.get("host_speed_at_end")),
        "",
        "Command:",
        "",
        "```",
        f"{doc['command']}",
        "```",
        "",
        f"Load: p2p {prof.get('pairs')} pairs (persistent subscribers, MQTT 3.1.1 clean session false, QoS 1); "
        f"fan-in {prof.get('fanin_pubs')} publishers → 1 persistent subscriber on a wildcard, as an APPLICATION "
        "client (`bench-app-…`, fan-in-app) and as a DEVICE client (`bench-dev-…`, fan-in-dev) in tbmq-py (for "
        f"Mosquitto and amqtt both are plain persistent subscribers); fan-out 1 publisher → {prof.get('fanout_subs')} "
        f"clean-session subscribers; backlogs of {_num(prof.get('backlog'))} and {_num(prof.get('backlog_big'))} "
        f"QoS 1 messages to an offline persistent DEVICE subscriber and {_num(prof.get('backlog_app'))} to an "
        f"offline APPLICATION subscriber, drained on reconnect; connect storm for {prof.get('storm_step')} s per "
        f"rate; {_num(prof.get('held_connections'))} held connections (table below); "
        f"{prof.get('payload')}-byte payloads. Fixed-rate steps: {rates or '?'} msg/s in, each "
        f"{prof.get('warmup')} s warm-up + {prof.get('duration')} s measured; \"lost\" = not delivered within "
        f"{prof.get('drain')} s after publishing stopped. Max rate = highest step with p99 ≤ "
        f"{prof.get('p99_limit_ms')} ms, nothing lost and ≥ 95 % of the target really sent (×2 steps, then "
        "bisection); ≥ means no step failed. Ratios are the first broker ÷ the others (for \"lower is better\" "
        "rows a ratio > 1 means the first broker is worse).",
        "",
        f"Per broker start: {prof.get('broker_warmup', '–')} s of unmeasured p2p load at "
        f"{prof.get('broker_warmup_rate', '–')} msg/s, "
        + (f"continued in {prof.get('jit_chunk')} s chunks while Kafka's JVM is still JIT-compiling (its compiler "
           f"threads above {prof.get('jit_settled_pct')} % of a core over any of the last "
           f"{prof.get('jit_quiet_chunks', 1)} chunks; at most "
           f"{prof.get('jit_settle_max')} s more), " if prof.get("jit_settle_max") else "")
        + f"then the idle CPU of every process over {prof.get('idle_window', '–')} s after "
        f"{prof.get('idle_warmup', '–')} s with no clients. Before every measured step the run waits until the "
        f"broker's processes are back within idle + {prof.get('cooldown_margin', '–')} % of one core (1 s windows, "
        f"at most {prof.get('cooldown_max', '–')} s; the wait is in the \"cool-down\" column). CPU µs per delivered "
        "message = CPU seconds of the broker's processes during the measured window ÷ messages delivered in it.",
        "",
    ]
    for layout, run in runs.items():
        res, meta = run["results"], run.get("brokers") or {}
        pin = run.get("pinning") or {}
        lines += [f"### Layout: {LAYOUT_TITLES.get(layout, layout)}", ""]
        if pin.get("broker"):
            lines.append(f"Broker processes (for tbmq-py: every service, Kafka's JVM and Redis) pinned to cpu "
                         f"{pin.get('broker')}, load generator ({pin.get('workers')} worker processes, uvloop, raw "
                         f"asyncio.Protocol client) to cpu {pin.get('generator')}.")
        else:
            lines.append(f"Nothing pinned: the broker's processes and the load generator ({pin.get('workers')} "
                         "worker processes) share every cpu.")
        if "p2p" in (run.get("interleaved") or ()):
            lines += ["", INTERLEAVED_TEXT]
        lines.append("")
        for b in brokers:
            w = (meta.get(b) or {}).get("warmup_load")
            if w:
                lines.append(f"- {b}: warm-up load {_num(w['seconds'])} s at {_num(w['rate'])} msg/s: broker "
                             f"{_num(w['broker_cpu_pct'])} % of a core, {_num((w.get('us_per_msg') or {}).get('total'))}"
                             f" µs/msg, p99 {_num((w.get('e2e_ms') or {}).get('p99'))} ms"
                             + (f"; then {_num(w['jit']['extra_s'])} s more until Kafka's JIT "
                                + ("settled" if w["jit"]["settled"] else "was still compiling (limit reached)")
                                + f" ({_num(w['jit']['compile_cpu_s'])} s of compiler CPU since its start)"
                                if w.get("jit") else ""))
        lines += ["", "Summary (max-rate search, the fixed step at the search's start rate, backlogs, connect storm):",
                  "", table(res, brokers, "md"), ""]
        fs = fixed_steps_table(res, brokers, "md")
        if fs:
            lines += ["Fixed-rate steps (µs/msg: CPU of all the broker's processes per delivered message; of it "
                      "JIT: the part that was the JVM's JIT compiler threads (Kafka's, tbmq-py only), a start-up "
                      "transient the warm-up waits out but that comes back in bursts; host µs: "
                      "the host's speed during the step, the median µs of bench/calibrate.py's 1,000 Python "
                      "operations on each cpu, higher = slower, so the µs/msg of steps at different speeds of the "
                      "host are not comparable):", "", fs, ""]
        rt = relative_cpu_table(res, brokers, "md")
        if rt:
            lines += [f"CPU per message against the other brokers at the same fixed rate ({brokers[0]}'s µs/msg "
                      "÷ each other's; the host's speed moves the two Python brokers' figures alike, Mosquitto's less, "
                      "so the ratio to amqtt compares across hosts where the µs/msg does not; issue 12's goal 2b, "
                      "400 µs/msg at 1,000 msg/s, was set where Mosquitto used 70 and amqtt 710: 5.7 and 0.56 "
                      "times theirs):", "", rt, ""]
        for b, pt in per_process_tables(res, brokers, "md"):
            lines += [f"{b}: CPU µs per delivered message of each process (instances of a service summed), "
                      "fixed-rate steps and backlog drains:", "", pt, ""]
        ht = held_table(res, brokers, "md")
        if ht:
            hp = next((r["params"] for r in (res.get("connections") or {}).values()
                       if isinstance(r, dict) and "params" in r), {})
            lines += [f"Held connections ({_num(hp.get('connections'))} clean-session MQTT 3.1.1 clients, each "
                      f"subscribed at QoS 1 to its own command topic, keep alive 60 s, pinged every 20 s; RSS before "
                      "the first CONNECT, once the broker is back near its idle CPU with all of them held, and after "
                      f"they closed; CPU over {_num(hp.get('window_s'))} s held):", "", ht, ""]
        ft = faults_table(res, brokers, "md")
        if ft:
            fp = prof.get("faults") or {}
            lines += [f"Faults (bench/faults.py: p2p {fp.get('pairs')} pairs + fan-in {fp.get('fanin')} publishers → 1 "
                      f"subscriber at {_num(fp.get('rate'))} msg/s in, QoS 1, publishers re-send what is "
                      "unacknowledged after a reconnect; \"lost\" = acknowledged during the fault's window and never "
                      "delivered, must be 0; * = still owed at the end of the drain):", "", ft, ""]
        it = idle_table(meta, brokers, "md")
        if it:
            lines += ["Idle CPU (% of one core) with no clients:", "", it, ""]
        for b, bm in meta.items():
            notes = bm.get("notes") or ([bm["error"]] if bm.get("error") else [])
            if notes:
                lines.append(f"- {b}: " + "; ".join(notes))
        lines.append("")
    if profile_md:
        lines += [profile_md, ""]
    lines.append(DOC_END)
    return "\n".join(lines) + "\n"
