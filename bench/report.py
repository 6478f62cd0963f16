"""The comparison table (text/markdown), the JSON file and the PNG chart."""

from __future__ import annotations

import json
import math
from pathlib import Path


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
    if scenario in ("p2p", "fan-in", "fan-out-q0", "fan-out-q1"):
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
    if scenario == "backlog":
        return [
            ("drain s (after reconnect)", ("drain_s",), False),
            ("delivered", ("delivered",), True),
            ("lost / dup", None, None),
            ("publish msg/s (offline sub)", ("publish_rate",), True),
            ("broker RSS MB", ("broker_rss_mb",), False),
        ]
    if scenario == "connect":
        return [
            ("max connects/s (p99≤1s, 0 refused)", ("best_rate",), True),
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


def process_table(results: dict, fmt: str = "text") -> str:
    """CPU % and peak RSS of every process of each broker during one fixed-rate step: p2p's when that ran,
    else the first scenario that has one."""
    rows = []
    brokers = []
    for by_b in results.values():
        for b in by_b:
            if b not in brokers:
                brokers.append(b)
    order = sorted(results, key=lambda s: s != "p2p")
    for b in brokers:
        for scen in order:
            r = results[scen].get(b)
            procs = _get(r, ("fixed", "processes")) if isinstance(r, dict) and "error" not in r else None
            if procs:
                for label, v in procs.items():
                    rows.append([scen, b, label, _num(v["cpu_pct"]), _num(v["rss_mb"])])
                break
    head = ["scenario", "broker", "process", "CPU %", "RSS MB"]
    if fmt == "md":
        return "\n".join(["| " + " | ".join(head) + " |", "|---|---|---|---:|---:|"] +
                          ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(ln, widths)) for ln in [head, *rows])


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
        if scen == "backlog":
            panels.append((f"backlog {next(iter(ok.values()))['params']['messages']:,}: drain s (lower=better)",
                           {b: _get(r, ("drain_s",)) for b, r in ok.items()}, "bar"))
        elif scen == "connect":
            panels.append(("connect storm: max connects/s", {b: _get(r, ("best_rate",)) for b, r in ok.items()}, "bar"))
        else:
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
    colors = {"tbmq": "#1f77b4", "mosquitto": "#2ca02c", "amqtt": "#ff7f0e"}
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


def doc_section(doc: dict, profile_md: str | None = None) -> str:
    """The "## Broker comparison" section of docs/performance.md from a results JSON (and a profile summary).
    The tables are rebuilt from the results with this version of the report code."""
    brokers = list(doc.get("brokers") or [])
    doc = {**doc, "table_md": table(doc["results"], brokers, "md"), "processes_md": process_table(doc["results"], "md")}
    m = doc["machine"]
    pin = doc.get("pinning", {})
    prof = doc.get("profile", {})
    lines = [
        "## Broker comparison",
        "",
        f"Run `{doc['timestamp']}` (`bench/results/{doc['timestamp']}.json`, chart `bench/results/{doc['timestamp']}.png`), "
        f"{doc.get('elapsed_s', '?')} s wall.",
        "",
        f"Machine: `nproc` = {m['nproc']}, `lscpu` model {m['cpu_model']}, {m['mem_gib']} GiB, kernel {m['kernel']}, "
        f"CPython {m['python']}. Load average at start {m['loadavg_at_start']}, at end {doc.get('loadavg_at_end')} "
        "(other engineers' test suites were running on the same 2 cores: every figure below shares the CPU with "
        "them).",
        "",
        f"Pinning: broker processes (for tbmq-py: every service, Kafka's JVM and Redis) on cpu {pin.get('broker')}, "
        f"load generator ({pin.get('workers')} worker processes, uvloop, raw asyncio.Protocol client) on cpu "
        f"{pin.get('generator')}.",
        "",
        "Command:",
        "",
        "```",
        f"cd /work/main && {doc['command']}",
        "```",
        "",
        f"Load: p2p {prof.get('pairs')} pairs (persistent subscribers, MQTT 3.1.1 clean session false, QoS 1), "
        f"fan-in {prof.get('fanin_pubs')} publishers → 1 persistent subscriber on a wildcard (client id "
        f"`bench-app-…`, APPLICATION in tbmq-py), fan-out 1 publisher → {prof.get('fanout_subs')} clean-session "
        f"subscribers, backlog {prof.get('backlog')} QoS 1 messages to an offline persistent subscriber, connect "
        f"storm of clean-session connections for {prof.get('storm_step')} s per rate; {prof.get('payload')}-byte "
        f"payloads; steps of {prof.get('warmup')} s warm-up + {prof.get('duration')} s measured; \"lost\" = not "
        f"delivered within {prof.get('drain')} s after publishing stopped. Max rate = highest step with p99 ≤ "
        f"{prof.get('p99_limit_ms')} ms, nothing lost and ≥ 95 % of the target really sent (×2 steps, then "
        "bisection); ≥ means no step failed. Ratios are the first broker ÷ the others (for \"lower is better\" "
        "rows a ratio > 1 means the first broker is worse).",
        "",
        doc["table_md"],
        "",
        "CPU (% of one core) and peak RSS of every process during a fixed-rate step:",
        "",
        doc["processes_md"],
        "",
    ]
    for b, meta in doc.get("brokers", {}).items():
        notes = meta.get("notes") or ([meta["error"]] if meta.get("error") else [])
        if notes:
            lines.append(f"- {b}: " + "; ".join(notes))
    if profile_md:
        lines += ["", profile_md]
    return "\n".join(lines) + "\n"
