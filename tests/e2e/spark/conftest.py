"""Fixtures of the Spark end-to-end test: the run's local[2] SparkSession (shared with tests/integration/spark:
whichever fixture creates it stops it) and the Spark tests' Kafka helpers (tests/integration/spark/spark_workload.py)
on sys.path."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[3]
for _p in (_ROOT / "spark", _ROOT / "tests" / "integration" / "spark"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession
    from tbmq_spark.session import get_session, stop_session

    t0 = time.monotonic()
    mine = SparkSession.getActiveSession() is None
    s = get_session("tbmq-spark-tests", "local[2]")
    print(f"\nspark session ready in {time.monotonic() - t0:.1f}s")
    yield s
    if mine:
        stop_session(s)
