"""`python -m bench kafka-clients`: the pure parts (rounds summarised, the table, percentiles)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.kafka_clients import summarize, table  # noqa: E402

pytestmark = pytest.mark.unit


def _step(client, rate, rnd, client_us, kafka_us, req, ack=(1.0, 2.0), e2e=(3.0, 4.0)):
    return {"client": client, "rate": rate, "round": rnd, "client_us_per_msg": client_us,
            "kafka_us_per_msg": kafka_us, "kafka_system_share": 0.25, "requests_per_s": req,
            "ack_ms": {"p50": ack[0], "p99": ack[1]}, "e2e_ms": {"p50": e2e[0], "p99": e2e[1]}}


def test_summary_is_the_median_of_the_rounds_per_rate_and_client():
    steps = [
        _step("aiokafka", 1000.0, 1, 100.0, 300.0, 500.0),
        _step("aiokafka", 1000.0, 2, 140.0, 200.0, 700.0),
        _step("aiokafka", 1000.0, 3, 120.0, 250.0, 600.0, ack=(5.0, 9.0)),
        _step("librdkafka", 1000.0, 1, 40.0, 100.0, 90.0),
        _step("aiokafka", 2500.0, 1, 60.0, 80.0, 400.0),
    ]
    s = summarize(steps)
    assert [(x["rate"], x["client"], x["rounds"]) for x in s] == [
        (1000.0, "aiokafka", 3), (1000.0, "librdkafka", 1), (2500.0, "aiokafka", 1)]
    aio = s[0]
    assert (aio["client_us_per_msg"], aio["kafka_us_per_msg"], aio["requests_per_s"]) == (120.0, 250.0, 600.0)
    assert (aio["ack_p50"], aio["ack_p99"]) == (1.0, 2.0)
    assert s[1]["client_us_per_msg"] == 40.0


def test_table_has_one_row_per_summary_entry():
    s = summarize([_step("aiokafka", 1000.0, 1, 100.0, 300.0, 500.0),
                   _step("librdkafka", 1000.0, 1, 40.0, 100.0, 90.0)])
    lines = table(s).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| 1,000 | aiokafka | 100.0 | 300.0 (25 %) | 500 |")
    assert lines[3].startswith("| 1,000 | librdkafka | 40.0 | 100.0 (25 %) | 90 |")
