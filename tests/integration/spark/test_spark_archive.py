"""The archive job: the event log lands in Parquet partitioned by date; the session and subscription
projections rebuilt from that history equal the compacted topics' state; an injected difference is found."""

from __future__ import annotations

import datetime as dt

import pytest
from tbmq_platform import topics as T

from spark_workload import produce, session, subscriptions

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_archive_and_rebuild(stats_run, spark, tmp_path):
    import pyarrow.dataset as ds

    from tbmq_spark.archive import ArchiveConfig, run_archive

    cfg = ArchiveConfig(bootstrap=stats_run.bootstrap, output=str(tmp_path))
    report = run_archive(spark, cfg)
    # 1. the event log: the whole topic history (shared broker: at least our workload), by date
    def date_of(ms: int) -> str:
        return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).strftime("%Y-%m-%d")

    day = date_of(stats_run.base_ms)
    # the workload's five minutes may straddle midnight (UTC): its records are then in two date partitions
    days = sorted({day, date_of(stats_run.base_ms + 5 * 60_000)})
    msgs = ds.dataset(cfg.messages_path, format="parquet", partitioning="hive").to_table(
        filter=ds.field("date").isin(days)).to_pylist()
    ours = [m for m in msgs if m["publisher_id"] == stats_run.publisher and
            stats_run.base_ms <= m["created_at"].timestamp() * 1000 < stats_run.base_ms + 5 * 60_000]
    assert len(ours) == 12 + 5 + 1 + 3 + 1          # both runs' publishes and ticks
    assert not [m for m in msgs if m["key"] == stats_run.mark_key.decode()]  # the subscription mark is not a message
    assert sorted(m["payload_size"] for m in ours if m["mqtt_topic"] == "alarms/y") == [33, 33, 33]
    assert (tmp_path / "archive" / "messages" / f"date={day}").is_dir()
    states = ds.dataset(cfg.state_path, format="parquet", partitioning="hive").to_table().to_pylist()
    dev = [s for s in states if s["topic"] == T.CLIENT_SESSION and s["client_id"] in ("dev1", "dev2", "dev3", "dev4")]
    assert len(dev) >= 7 and any(s["tombstone"] for s in dev)

    # 2. the rebuild equals the compacted state
    assert report is not None and report.consistent, report.text()
    assert report.counts["sessions"]["history"] == report.counts["sessions"]["compacted"] >= 3

    # 3. an injected difference: records written to the topics after the archive ran, compared without
    #    archiving them (the history lacks them); and a client whose archived state is altered
    import time

    now = int(time.time() * 1000)
    await produce(stats_run.bootstrap, [
        (T.CLIENT_SESSION, b"ghost1", session("ghost1", connected=True, persistent=False, session_id="g",
                                              t_ms=now).SerializeToString(), now),
        (T.CLIENT_SUBSCRIPTIONS, b"dev1", subscriptions("dev1", ["only/compacted"]).SerializeToString(), now),
    ])
    diff = run_archive(spark, cfg, ingest=False)
    assert not diff.consistent
    kinds = {(d["projection"], d["client_id"]): d["kind"] for d in diff.differences}
    assert kinds == {("sessions", "ghost1"): "only_in_compacted", ("subscriptions", "dev1"): "value_differs"}
    d = next(d for d in diff.differences if d["client_id"] == "dev1")
    assert d["history"] == {"subscriptions": 2} and d["compacted"] == {"subscriptions": 1}
    assert "DIFFERENCES FOUND" in diff.text() and "ghost1" in diff.text()
    # archiving catches up and the check is clean again
    assert run_archive(spark, cfg).consistent
