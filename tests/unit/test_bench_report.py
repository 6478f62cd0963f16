"""bench/report.py table and bench/profile.py's collapsed-stack summary (pure functions)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import report  # noqa: E402
from bench.profile import summarize_collapsed  # noqa: E402
from bench.scenarios import expand  # noqa: E402

pytestmark = pytest.mark.unit


def _fixed(p99, rate=100.0):
    return {"rate": rate, "in_rate": rate, "out_rate": rate, "e2e_ms": {"avg": 1.0, "p50": 1.0, "p95": 2.0, "p99": p99},
            "puback_ms": {"p99": 1.0}, "lost": 0, "dup": 0, "broker_cpu_pct": 10.0, "broker_us_per_msg": 50.0,
            "broker_rss_mb": 10.0, "generator_cpu_pct": 5.0, "processes": {"x": {"cpu_pct": 1.0, "rss_mb": 2.0}}}


def test_table_ratios_and_errors():
    results = {"p2p": {"tbmq": {"fixed": _fixed(40.0), "search": {"best_in": 2000.0, "best_in_out": 4000.0,
                                                                      "unbounded": False, "steps": []}},
                       "mosquitto": {"fixed": _fixed(4.0), "search": {"best_in": 8000.0, "best_in_out": 16000.0,
                                                                          "unbounded": True, "steps": []}},
                       "amqtt": {"error": "start failed: boom"}}}
    text = report.table(results, ["tbmq", "mosquitto", "amqtt"])
    line = next(ln for ln in text.splitlines() if "max in msg/s" in ln)
    assert "2,000" in line and "≥8,000" in line and "0.25×" in line
    assert "10.00×" in next(ln for ln in text.splitlines() if "e2e p99" in ln)
    assert "start failed: boom" in text
    md = report.table(results, ["tbmq", "mosquitto", "amqtt"], "md")
    assert md.splitlines()[0].startswith("| scenario | metric | tbmq | mosquitto |")


def test_summarize_collapsed():
    text = "\n".join([
        "process 1:\"python x\";<module> (x.py:1);run (asyncio/runners.py:3);handle (svc/conn.py:10);encode (svc/codec.py:5) 6",
        "process 1:\"python x\";<module> (x.py:1);run (asyncio/runners.py:3);handle (svc/conn.py:12) 2",
        "process 1:\"python x\";<module> (x.py:1);run (asyncio/runners.py:3);select (selectors.py:468) 10",
    ])
    s = summarize_collapsed(text, top=5)
    assert s["samples"] == 8 and s["idle_samples"] == 10
    assert s["self"][0] == ("encode (svc/codec.py)", 75.0)
    assert ("handle (svc/conn.py)", 100.0) in s["inclusive"]
    assert not any("runners" in f or "<module>" in f for f, _ in s["inclusive"])


def test_expand_scenarios():
    assert expand("fan-out,p2p") == ["fan-out-q0", "fan-out-q1", "p2p"]
    assert len(expand("all")) == 11 and expand("all")[-1] == "faults"  # faults kills things: always last
    # memory freed by another scenario would hide the held connections' growth: "connections" runs first
    assert expand("all")[0] == "connections" and expand("p2p,held") == ["connections", "p2p"]
    assert expand("fan-in") == ["fan-in-app", "fan-in-dev"]
    assert expand("backlogs") == ["backlog", "backlog-100k", "backlog-app"]
    with pytest.raises(ValueError):
        expand("nope")


def test_table_marks_a_search_where_nothing_passed():
    steps = [{"rate": r, "ok": False, "p99_ms": 500.0} for r in (1000.0, 500.0, 250.0)]
    results = {"p2p": {"tbmq": {"fixed": _fixed(500.0, 1000.0), "params": {"out_per_in": 1.0},
                                "search": {"best_in": None, "best_in_out": None, "unbounded": False, "steps": steps}}}}
    text = report.table(results, ["tbmq"])
    assert "<250" in next(ln for ln in text.splitlines() if "max in msg/s" in ln)
    assert "<500" in next(ln for ln in text.splitlines() if "max in+out" in ln)


def _held(per_conn: dict[str, int], growth_mb: float) -> dict:
    return {"params": {"connections": 1000, "window_s": 2.0}, "connected": 1000, "open_at_end": 1000,
            "connect_s": 1.5, "rss_growth_mb": growth_mb,
            "bytes_per_conn": {**per_conn, "total": sum(per_conn.values())},
            "held_cpu_pct": {k: 1.0 for k in per_conn} | {"total": float(len(per_conn))},
            "rss_before_mb": {k: 10.0 for k in per_conn}, "rss_held_mb": {k: 12.0 for k in per_conn},
            "rss_released_mb": {k: 11.0 for k in per_conn}}


def test_held_connections_rows_and_per_process_table():
    results = {"connections": {"tbmq": _held({"connector-1": 7000, "router": 500}, 7.2),
                               "mosquitto": _held({"mosquitto": 1750}, 1.7)}}
    text = report.table(results, ["tbmq", "mosquitto"])
    line = next(ln for ln in text.splitlines() if "bytes per connection" in ln)
    assert "7,500" in line and "1,750" in line and "4.29×" in line  # tbmq ÷ mosquitto, lower is better
    assert "1,000 held: connected" in text
    per = report.held_table(results, ["tbmq", "mosquitto"])
    rows = [ln.split() for ln in per.splitlines()[1:]]
    assert ["tbmq", "connector-1", "10.0", "12.0", "11.0", "7,000", "1.00"] in rows
    assert ["tbmq", "total", "7,500", "2.00"] in rows and ["mosquitto", "total", "1,750", "1.00"] in rows
    assert report.held_table({"connections": {"tbmq": {"error": "x"}}}, ["tbmq"]) == ""
