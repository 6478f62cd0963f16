"""bench/stats.py: latency summaries, loss/duplicate accounting, the max-rate search."""

from __future__ import annotations

import math
import random
import sys
from array import array
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.client import SubState  # noqa: E402
from bench.stats import (StepResult, judge, latency_summary, loss_from_seen, merge_ranges, merge_us,  # noqa: E402
                         percentile, search_max_rate)

pytestmark = pytest.mark.unit


def test_percentile_nearest_rank():
    vals = list(range(1, 101))  # 1..100
    assert percentile(vals, 50) == 50
    assert percentile(vals, 99) == 99
    assert percentile(vals, 100) == 100
    assert percentile(vals, 0) == 1
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))


def test_latency_summary_ms():
    s = latency_summary([1000, 2000, 3000, 4000, 100_000])  # µs
    assert s["count"] == 5
    assert s["avg"] == pytest.approx(22.0)
    assert s["p50"] == 3.0
    assert s["p99"] == 100.0
    assert s["max"] == 100.0
    empty = latency_summary([])
    assert empty["count"] == 0 and math.isnan(empty["p99"])


def test_merge_us_and_ranges():
    a, b = array("q", [1, 2]), array("q", [3])
    assert list(merge_us([a.tobytes(), b.tobytes()])) == [1, 2, 3]
    assert merge_ranges([{"ranges": {1: (0, 5)}}, {"ranges": {"2": [3, 9]}}]) == {1: (0, 5), 2: (3, 9)}


def test_loss_from_seen_reference():
    lost, dups = loss_from_seen({1: (0, 10), 2: (5, 8)}, {1: [0, 1, 2, 2, 2, 9], 2: [5, 6, 7]})
    assert lost == 6  # 3..8 of publisher 1
    assert dups == 2


def test_bitmap_accounting_matches_reference():
    rng = random.Random(7)
    for _ in range(50):
        expected = {p: (a, a + rng.randint(0, 300)) for p, a in ((p, rng.randint(0, 100)) for p in range(4))}
        seen = {p: [rng.randint(0, 450) for _ in range(rng.randint(0, 400))] for p in range(4)}
        st = SubState({"expects": "all"})
        for p, seqs in seen.items():
            bm = st.seen.setdefault(p, bytearray(0))
            for s in seqs:
                if s >= len(bm):
                    bm.extend(bytes(s + 1 - len(bm)))
                bm[s] = 1
        ref_lost, _ = loss_from_seen(expected, {p: [s for s in v] for p, v in seen.items()})
        assert st.missing(expected) == ref_lost


def test_missing_only_counts_expected_publishers():
    st = SubState({"expects": [2]})
    assert st.missing({1: (0, 10), 2: (0, 3)}) == 3


def test_judge():
    assert judge(1000, 50.0, 0, 990).ok
    r = judge(1000, 150.0, 2, 500, disconnects=1)
    assert not r.ok
    for part in ("lost 2", "disconnects", "p99 150.0", "achieved"):
        assert part in r.reason
    assert not judge(1000, math.nan, 0, 1000).ok  # no latency samples: nothing was delivered


def _probe(limit, calls):
    def probe(rate):
        calls.append(rate)
        return StepResult(rate=rate, ok=rate <= limit)
    return probe


def test_search_brackets_then_bisects():
    calls: list[float] = []
    best, steps = search_max_rate(_probe(5000, calls), 1000, factor=2, max_steps=20, resolution=0.05)
    assert calls[:4] == [1000, 2000, 4000, 8000]
    assert best is not None and 5000 / 1.05 <= best <= 5000
    assert all(s.ok == (s.rate <= 5000) for s in steps)
    assert len(steps) == len(calls)


def test_search_walks_down_when_first_step_fails():
    calls: list[float] = []
    best, _ = search_max_rate(_probe(300, calls), 1000, factor=2, max_steps=20, resolution=0.1)
    assert calls[:3] == [1000, 500, 250]
    assert 300 / 1.1 <= best <= 300


def test_search_respects_step_budget_and_max_rate():
    calls: list[float] = []
    best, steps = search_max_rate(_probe(1e9, calls), 1000, factor=2, max_steps=3)
    assert len(steps) == 3 and best == 4000
    calls.clear()
    best, steps = search_max_rate(_probe(1e9, calls), 1000, factor=10, max_rate=5000, max_steps=10)
    assert calls == [1000, 5000] and best == 5000


def test_search_nothing_passes():
    best, steps = search_max_rate(_probe(0, []), 8, factor=2, max_steps=10)
    assert best is None
    assert [s.rate for s in steps] == [8, 4, 2, 1]
