"""The faults scenario's accounting (bench/faults.py) on hand-made publishers and subscribers: what counts as
acknowledged and lost per fault window, when deliveries resumed, the longest stall. No broker."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.faults import FaultProfile, Load  # noqa: E402
from bench.report import faults_table  # noqa: E402

pytestmark = pytest.mark.unit


class Pub:
    def __init__(self, pid: str) -> None:
        self.id, self.next, self.acked, self.sent_at, self.inflight = pid, 0, {}, {}, {}


class Sub:
    def __init__(self) -> None:
        self.first, self.deliveries, self.lock = {}, 0, threading.Lock()


def load_with(pubs, subs) -> Load:
    load = Load("127.0.0.1", 0, FaultProfile(), "t")
    load.pubs = pubs
    load.subs = subs
    return load


def test_lost_counts_only_messages_acknowledged_in_the_window_and_missing_at_their_subscriber():
    a, b = Pub("a"), Pub("b")
    s = Sub()
    load = load_with([a, b], {"a": s, "b": s})
    a.acked = {0: 1.0, 1: 1.0}
    before = load.snapshot()
    a.acked.update({2: 5.0, 3: 5.0})
    b.acked = {0: 5.0}
    s.first = {("a", 0): 1.0, ("a", 2): 5.5, ("b", 0): 5.5}  # a:1 was acked before the window: not counted
    v = load.verdict(before)
    assert v["acked"] == 3 and v["lost"] == 1 and v["lost_examples"] == ["a:3"]
    assert not load.all_acked_arrived()
    s.first[("a", 3)] = 6.0
    s.first[("a", 1)] = 6.0
    assert load.all_acked_arrived() and load.owed_settled()


def test_resume_is_the_first_delivery_of_a_message_published_after_the_fault_and_the_longest_stall():
    a = Pub("a")
    s = Sub()
    load = load_with([a], {"a": s})
    a.sent_at = {0: 9.0, 1: 10.5, 2: 11.0}
    s.first = {("a", 0): 12.0, ("a", 2): 13.0, ("a", 1): 14.0}  # 0 was published before the fault at 10
    assert load.resumed_after(10.0) == 13.0
    assert load.resumed_after(14.0) is None
    assert load.longest_gap(10.0, 20.0) == 6.0  # 14 → 20: nothing delivered


def test_faults_table_rows_per_broker_and_fault():
    results = {"faults": {
        "tbmq": {"faults": [{"fault": "kill -9 router", "acked": 1000, "lost": 0, "duplicates": 3, "resume_s": 8.2,
                             "stalled_s": 8.0, "restarts": 1, "settled": True}]},
        "amqtt": {"skipped": "amqtt: not applicable"}}}
    text = faults_table(results, ["tbmq", "mosquitto", "amqtt"])
    assert "kill -9 router" in text and "1,000" in text and "amqtt: not applicable" in text
    assert faults_table({}, ["tbmq"]) == ""


def test_faults_table_shows_when_a_new_connect_got_in_and_marks_runs_without_the_probe():
    row = {"fault": "kill -9 session-registry", "acked": 10, "lost": 0, "duplicates": 0, "resume_s": 0.5,
           "stalled_s": 0.4, "restarts": 1, "settled": True}
    text = faults_table({"faults": {"tbmq": {"faults": [{**row, "connect_s": 2.34},
                                                        {**row, "fault": "restart Kafka", "connect_s": None},
                                                        {**row, "fault": "older run"}]}}}, ["tbmq"])
    assert "new CONNECT after s" in text
    by_fault = {f: next(line for line in text.splitlines() if f in line)
                for f in ("kill -9 session-registry", "restart Kafka", "older run")}
    assert "2.34" in by_fault["kill -9 session-registry"]
    assert "never" in by_fault["restart Kafka"] and "never" not in by_fault["older run"]
