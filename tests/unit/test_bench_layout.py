"""The pure parts of the layouts / fixed rates / cool-down / per-process cost work in bench/."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import calibrate, report  # noqa: E402
from bench.cli import _run_args, profile_from  # noqa: E402
from bench.procmon import layout_cpus, parse_layouts  # noqa: E402
from bench.stats import is_cool, parse_rates, process_group, us_per_msg, wait_cool  # noqa: E402

pytestmark = pytest.mark.unit


# -- layouts ----------------------------------------------------------------------------------------------

def test_parse_layouts():
    assert parse_layouts("both") == ["whole", "one-core"]
    assert parse_layouts("one-core") == ["one-core"]
    assert parse_layouts("one-core,whole,both") == ["one-core", "whole"]
    with pytest.raises(ValueError):
        parse_layouts("half")
    with pytest.raises(ValueError):
        parse_layouts("")


def test_layout_cpus():
    assert layout_cpus("whole", [0, 1]) == (None, None)
    assert layout_cpus("one-core", [1, 0]) == ({0}, {1})
    assert layout_cpus("one-core", [0, 1, 2, 3]) == ({0, 1}, {2, 3})
    assert layout_cpus("one-core", [0]) == (None, None)  # one cpu: nothing to split
    with pytest.raises(ValueError):
        layout_cpus("both", [0, 1])


def _args(*argv):
    ap = argparse.ArgumentParser()
    _run_args(ap)
    return ap.parse_args(list(argv))


def test_layout_default_is_both_and_no_pin_is_whole():
    a = _args()
    assert parse_layouts(a.layout) == ["whole", "one-core"]
    assert _args("--no-pin").no_pin


# -- fixed rates ------------------------------------------------------------------------------------------

def test_parse_rates():
    assert parse_rates("p2p=100,1000,2500") == ("p2p", [100.0, 1000.0, 2500.0])
    assert parse_rates("fan-in=2.5k, 500,500") == ("fan-in", [2500.0, 500.0])
    for bad in ("p2p", "=100", "p2p=", "p2p=0", "p2p=-5"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_profile_rates_and_search_start():
    prof = profile_from(_args())
    assert prof.rates["p2p"] == [100.0, 1000.0, 2500.0] and prof.start_rate("p2p") == 1000.0
    assert prof.start_rate("fan-out-q0") == 10.0
    prof = profile_from(_args("--rates", "p2p=500,3000", "--rate", "fan-in=700"))
    assert prof.rates["p2p"] == [500.0, 3000.0] and prof.start_rate("p2p") == 500.0  # nearest 1000 (log scale)
    assert prof.rates["fan-in-app"] == prof.rates["fan-in-dev"] == [700.0]
    prof = profile_from(_args("--rates", "p2p=100,2500", "--search-start", "p2p=400"))
    assert prof.start_rate("p2p") == 400.0
    # the defaults of the class are not changed by a run's arguments
    assert profile_from(_args()).rates["p2p"] == [100.0, 1000.0, 2500.0]


def test_quick_profile_is_short():
    q = profile_from(_args("--quick"))
    assert q.idle_warmup < 60 and q.broker_warmup < 25 and q.cooldown_max < 30
    assert profile_from(_args("--quick", "--idle-warmup", "0")).idle_warmup == 0


# -- per-process cost -------------------------------------------------------------------------------------

def test_process_group():
    assert process_group("connector-1") == "connector"
    assert process_group("device-persistence-2") == "device-persistence"
    assert process_group("redis-3") == "redis"
    assert process_group("kafka") == "kafka"
    assert process_group("app-delivery") == "app-delivery"


def test_us_per_msg_sums_instances_and_leaves_the_generator_out():
    procs = {"connector-1": {"cpu_s": 0.2}, "connector-2": {"cpu_s": 0.1}, "router-1": {"cpu_s": 0.1},
             "kafka": {"cpu_s": 0.4}, "generator-0": {"cpu_s": 5.0}}
    u = us_per_msg(procs, 1000)
    assert u == {"connector": 300.0, "router": 100.0, "kafka": 400.0, "total": 800.0}
    assert us_per_msg(procs, 0) == {}


def _step(rate, us, ok=True, cool=None, speed=None):
    return {"rate": rate, "in_rate": rate, "out_rate": rate, "e2e_ms": {"p50": 1.0, "p95": 2.0, "p99": 3.0},
            "lost": 0, "dup": 0, "ok": ok, "reason": "" if ok else "p99 200 ms > 100", "broker_cpu_pct": 50.0,
            "broker_us_per_msg": us.get("total"), "us_per_msg": us, "cooldown": cool,
            **({"cpu_speed_us": speed} if speed is not None else {})}


TBMQ_US = {"kafka": 300.0, "connector": 200.0, "redis": 20.0, "router": 150.0, "device-persistence": 180.0,
           "app-delivery": 5.0, "session-registry": 2.0, "total": 857.0}


def test_process_us_table_orders_tbmq_processes_and_lists_every_step():
    res = {"p2p": {"tbmq": {"fixed_steps": [_step(100.0, TBMQ_US), _step(1000.0, TBMQ_US)]},
                   "mosquitto": {"fixed_steps": [_step(100.0, {"mosquitto": 60.0, "total": 60.0})]}},
           "backlog": {"tbmq": {"params": {"messages": 10}, "us_per_msg": TBMQ_US}}}
    text = report.process_us_table(res, "tbmq")
    head, *rows = text.splitlines()
    assert head.split()[:9] == ["scenario", "step", "connector", "router", "device-persistence", "app-delivery",
                                "session-registry", "kafka", "redis"]
    assert head.split()[-1] == "total"
    assert len(rows) == 3 and rows[-1].startswith("backlog") and "857" in rows[-1]
    assert "100/s" in rows[0] and "1,000/s" in rows[1]
    md = report.process_us_table(res, "mosquitto", "md")
    assert md.splitlines()[0] == "| scenario | step | mosquitto | total |"
    assert report.process_us_table(res, "amqtt") == ""


def test_fixed_steps_table_shows_cooldown_and_failures():
    res = {"p2p": {"tbmq": {"fixed_steps": [
        _step(100.0, TBMQ_US, cool={"waited_s": 1.0, "reached": True}),
        _step(2500.0, TBMQ_US, ok=False, cool={"waited_s": 30.0, "reached": False})]}}}
    rows = report.fixed_steps_table(res, ["tbmq"]).splitlines()[1:]
    assert len(rows) == 2
    assert "857" in rows[0] and rows[0].rstrip().endswith("yes")
    assert "30.0 (not reached)" in rows[1] and "no: p99 200 ms" in rows[1]


def test_fixed_steps_table_shows_the_host_speed_of_each_step():
    """The per-step probe beside the CPU figure, cpus in order (cpu 10 after cpu 2); "–" for an older result
    file without it."""
    res = {"p2p": {"tbmq": {"fixed_steps": [_step(1000.0, TBMQ_US, speed={"10": 712.4, "2": 329.0}),
                                            _step(2500.0, TBMQ_US)]}}}
    md = report.fixed_steps_table(res, ["tbmq"], "md").splitlines()
    cols = [c.strip() for c in md[0].strip("|").split("|")]
    at = cols.index("host µs")
    assert cols[at - 2] == "µs/msg"
    assert [c.strip() for c in md[2].strip("|").split("|")][at] == "329 / 712"
    assert [c.strip() for c in md[3].strip("|").split("|")][at] == "–"


def test_fixed_steps_table_shows_the_jit_part_of_the_cpu_per_message():
    """Kafka's JIT compiler at 2.8 % of one core during a 1,000 msg/s step is 28 µs per message; a broker
    without a JVM (or an older result file) has none."""
    res = {"p2p": {"tbmq": {"fixed_steps": [{**_step(1000.0, TBMQ_US), "jit_cpu_pct": 2.8},
                                            {**_step(2500.0, TBMQ_US), "jit_cpu_pct": 0.0}]},
                   "mosquitto": {"fixed_steps": [{**_step(1000.0, {"mosquitto": 38.0, "total": 38.0}),
                                                  "jit_cpu_pct": 0.2}]}}}  # another broker's JVM
    md = report.fixed_steps_table(res, ["tbmq", "mosquitto"], "md").splitlines()
    cols = [c.strip() for c in md[0].strip("|").split("|")]
    at = cols.index("of it JIT")
    assert [[c.strip() for c in row.strip("|").split("|")][at] for row in md[2:]] == ["28.0", "0.00", "–"]


def test_idle_table_new_and_old_format():
    meta = {"tbmq": {"idle": {"processes": {"kafka": {"cpu_pct": 20.0, "rss_mb": 300.0},
                                            "router-1": {"cpu_pct": 3.0, "rss_mb": 50.0}}, "total_pct": 23.0}},
            "amqtt": {"idle": {"amqtt": {"cpu_pct": 0.5, "rss_mb": 30.0}}}}
    text = report.idle_table(meta, ["tbmq", "amqtt"])
    assert "23.0" in next(ln for ln in text.splitlines() if ln.startswith("tbmq") and "total" in ln)
    assert "0.500" in next(ln for ln in text.splitlines() if ln.startswith("amqtt") and "total" in ln)


# -- cool-down --------------------------------------------------------------------------------------------

def test_is_cool():
    assert is_cool(35.0, 31.0, 5.0)
    assert is_cool(36.0, 31.0, 5.0)
    assert not is_cool(36.1, 31.0, 5.0)


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _measures(clock, values):
    it = iter(values)

    def measure():
        clock.t += 1.0  # a 1 s window
        return next(it)
    return measure


def test_wait_cool_stops_when_near_idle():
    clock = _Clock()
    r = wait_cool(_measures(clock, [90.0, 60.0, 34.0, 10.0]), 30.0, margin_pct=5.0, max_wait=30.0, clock=clock)
    assert r == {"waited_s": 3.0, "cpu_pct": 34.0, "idle_pct": 30.0, "reached": True, "windows": 3}


def test_wait_cool_already_idle_costs_one_window():
    clock = _Clock()
    r = wait_cool(_measures(clock, [1.0]), 0.5, clock=clock)
    assert r["reached"] and r["windows"] == 1 and r["waited_s"] == 1.0


def test_wait_cool_is_bounded():
    clock = _Clock()
    r = wait_cool(_measures(clock, [99.0] * 100), 30.0, max_wait=5.0, clock=clock)
    assert not r["reached"] and r["windows"] == 5 and r["waited_s"] == 5.0 and r["cpu_pct"] == 99.0


# -- results with layouts, the docs section -----------------------------------------------------------------

def _doc(layouts):
    return {"timestamp": "20261123-120000", "command": ".venv/bin/python -m bench --quick", "elapsed_s": 1.0,
            "machine": {"nproc": 2, "cpu_model": "x", "mem_gib": 1, "kernel": "k", "python": "3.11",
                        "loadavg_at_start": [0, 0, 0]},
            "profile": {"rates": {"p2p": [100.0, 1000.0]}}, "broker_order": ["tbmq"],
            "layouts": {lay: {"layout": lay, "pinning": {"broker": [0] if lay == "one-core" else None,
                                                         "generator": [1] if lay == "one-core" else None,
                                                         "workers": 2},
                              "brokers": {"tbmq": {"notes": ["n"]}},
                              "results": {"p2p": {"tbmq": {"fixed_steps": [_step(100.0, TBMQ_US)],
                                                           "fixed": _step(100.0, TBMQ_US),
                                                           "params": {"out_per_in": 1.0}}}}}
                        for lay in layouts}}


def test_runs_of_old_and_new_results():
    old = {"pinning": {"broker": [0], "generator": [1]}, "results": {"p2p": {}}, "brokers": {"tbmq": {}}}
    assert list(report.runs_of(old)) == ["one-core"]
    assert list(report.runs_of({**old, "pinning": {"broker": None}})) == ["whole"]
    assert report.broker_order(old) == ["tbmq"]
    assert list(report.runs_of(_doc(["whole", "one-core"]))) == ["whole", "one-core"]


def test_doc_section_has_markers_and_a_part_per_layout():
    sec = report.doc_section(_doc(["whole", "one-core"]))
    assert sec.startswith(report.DOC_BEGIN) and sec.rstrip().endswith(report.DOC_END)
    assert sec.count("### Layout: ") == 2
    assert sec.index("### Layout: whole") < sec.index("### Layout: one core")
    assert "| connector |" in sec.replace(" connector |", "| connector |") or "connector" in sec


def test_doc_section_names_the_host_speed_when_the_run_measured_it():
    doc = _doc(["whole"])
    assert "host speed" not in report.doc_section(doc).lower()  # results from before bench/calibrate.py
    doc["machine"]["host_speed"] = {"python_us": [404.7, 751.4], "exchange_us": 26.7, "exchange_cpu_us": 26.5}
    doc["host_speed_at_end"] = {"python_us": [409.0, 1809.0], "exchange_us": 31.2, "exchange_cpu_us": 30.9}
    sec = report.doc_section(doc)
    assert ("Host speed (bench/calibrate.py): Python 405 / 751 µs per 1,000 operations (per cpu), a process-to-process "
            "round trip 26.7 µs (26.5 µs of CPU) at the start; 409 / 1,809 µs, 31.2 µs (30.9) at the end.") in sec


def test_calibration_round_trips_through_a_second_process():
    wall, cpu = calibrate.exchange_us(rounds=2, repeat=50)
    # both processes' CPU, the echo's as it reported it: more than nothing, at most both cores for the time
    assert 0 < cpu <= 2.2 * wall
    assert calibrate.python_us(rounds=1, repeat=2) > 0
    before = os.sched_getaffinity(0)
    assert len(calibrate.python_us_per_cpu()) == len(before) and os.sched_getaffinity(0) == before


def test_replace_section_keeps_the_rest_and_is_repeatable():
    text = f"# Perf\n\nbefore\n\n{report.DOC_BEGIN}\nold\n{report.DOC_END}\n\n### Reading these figures\nafter\n"
    sec = report.doc_section(_doc(["whole"]))
    once = report.replace_section(text, sec)
    assert "old" not in once and once.startswith("# Perf\n\nbefore\n\n") and once.endswith(
        "\n\n### Reading these figures\nafter\n")
    assert report.replace_section(once, sec) == once
    with pytest.raises(ValueError):
        report.replace_section("no markers", sec)


def test_latency_points_merge_fixed_and_search_steps():
    r = {"fixed_steps": [_step(100.0, {}), _step(1000.0, {}, ok=False)],
         "search": {"steps": [{"rate": 1000.0, "ok": False, "p99_ms": 3.0, "extra": {}},
                              {"rate": 500.0, "ok": True, "p99_ms": 9.0,
                               "extra": {"in_rate": 499.0, "e2e_ms": {"p50": 4.0, "p99": 9.0}}}]}}
    pts = report.latency_points(r)
    assert [p[0] for p in pts] == [100.0, 499.0, 1000.0]
    assert pts[1] == (499.0, 4.0, 9.0, True) and pts[2][3] is False
    assert math.isnan(report.latency_points({"search": {"steps": [{"rate": 5.0, "ok": True, "p99_ms": 1.0}]}})[0][1])


def test_latency_chart_renders(tmp_path):
    pytest.importorskip("matplotlib")
    doc = _doc(["whole", "one-core"])
    out = tmp_path / "x.png"
    report.latency_chart(out, report.runs_of(doc), ["tbmq"], title="t")
    assert out.exists() and out.stat().st_size > 1000


def test_per_process_tables_only_for_multi_process_brokers():
    res = {"p2p": {"tbmq": {"fixed_steps": [_step(100.0, TBMQ_US)]},
                   "mosquitto": {"fixed_steps": [_step(100.0, {"mosquitto": 60.0, "total": 60.0})]}}}
    for fmt in ("text", "md"):
        assert [b for b, _ in report.per_process_tables(res, ["tbmq", "mosquitto"], fmt)] == ["tbmq"]


def test_doc_section_says_when_p2p_steps_were_interleaved():
    doc = _doc(["whole", "one-core"])
    assert report.INTERLEAVED_TEXT not in report.doc_section(doc)  # results of runs before --interleave
    doc["layouts"]["whole"]["interleaved"] = ["p2p"]
    sec = report.doc_section(doc)
    whole, one_core = sec.split("### Layout: one core")
    assert report.INTERLEAVED_TEXT in whole and report.INTERLEAVED_TEXT not in one_core


def test_relative_cpu_table_divides_the_first_brokers_cpu_by_each_others_at_the_same_rate():
    """tbmq-py ÷ Mosquitto and ÷ amqtt per scenario and rate; a rate another broker did not pass (amqtt overloaded
    at 2,500) shows "–" for it, a rate only tbmq-py ran is left out, and a run of one broker has no table."""
    res = {"p2p": {"tbmq": {"fixed_steps": [_step(1000.0, {"total": 400.0}), _step(2500.0, {"total": 300.0}),
                                            _step(100.0, {"total": 2000.0})]},
                   "mosquitto": {"fixed_steps": [_step(1000.0, {"mosquitto": 50.0, "total": 50.0}),
                                                 _step(2500.0, {"mosquitto": 40.0, "total": 40.0})]},
                   "amqtt": {"fixed_steps": [_step(1000.0, {"amqtt": 500.0, "total": 500.0}),
                                             _step(2500.0, {"amqtt": 900.0, "total": 900.0}, ok=False)]}}}
    md = report.relative_cpu_table(res, ["tbmq", "mosquitto", "amqtt"], "md").splitlines()
    cols = [c.strip() for c in md[0].strip("|").split("|")]
    assert cols == ["scenario", "rate/s", "tbmq µs/msg", "mosquitto µs/msg", "amqtt µs/msg", "tbmq ÷ mosquitto",
                    "tbmq ÷ amqtt"]
    rows = [[c.strip() for c in row.strip("|").split("|")] for row in md[2:]]
    assert rows == [["p2p", "1,000", "400", "50.0", "500", "8.00", "0.80"],
                    ["p2p", "2,500", "300", "40.0", "–", "7.50", "–"]]
    assert report.relative_cpu_table(res, ["tbmq"]) == ""
