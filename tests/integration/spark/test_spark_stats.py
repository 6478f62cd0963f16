"""The streaming statistics job against the real Kafka: exact counts per window in Parquet and in
tbmq.sys.historical.data, and a restart that continues without double counting."""

from __future__ import annotations

import pytest
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics as T

from spark_workload import MINUTE_MS, read_all

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GAUGES = ("sessions_connected", "sessions_persistent", "sessions", "subscriptions", "subscribed_clients")


def _parquet_windows(output: str) -> dict[int, dict[tuple[str, str], int]]:
    import pyarrow.dataset as ds

    t = ds.dataset(f"{output}/stats", format="parquet", partitioning="hive").to_table().to_pylist()
    out: dict[int, dict] = {}
    seen: dict[tuple, int] = {}
    for r in t:
        ws = int(r["window_start"].timestamp() * 1000)
        key = (ws, r["metric"], r["dimension"])
        assert key not in seen, f"window {key} written by batches {seen[key]} and {r['batch_id']}"
        seen[key] = r["batch_id"]
        out.setdefault(ws, {})[(r["metric"], r["dimension"])] = r["value"]
        assert int(r["window_end"].timestamp() * 1000) - ws == MINUTE_MS
    return out


def _check_window(got: dict, expected: dict, gauges: dict) -> None:
    counters = {k: v for k, v in got.items() if k[0] not in GAUGES and v != 0}
    want = {k: v for k, v in expected.items() if v != 0}
    assert counters == want
    assert {k[0]: v for k, v in got.items() if k[0] in GAUGES} == gauges


def test_parquet_counts_per_window(stats_run):
    windows = _parquet_windows(stats_run.output)
    b = stats_run.base_ms
    mine = {ws: w for ws, w in windows.items() if b <= ws < b + 4 * MINUTE_MS}
    # minutes 0, 1 (first run) and 2 (second run) are closed; minute 4 holds only the last tick (open)
    assert sorted(mine) == [b, b + MINUTE_MS, b + 2 * MINUTE_MS]
    for ws in (b, b + MINUTE_MS):
        _check_window(mine[ws], stats_run.phase1.expected[ws], stats_run.gauges[ws])
    _check_window(mine[b + 2 * MINUTE_MS], stats_run.phase2.expected[b + 2 * MINUTE_MS],
                  stats_run.gauges[b + 2 * MINUTE_MS])
    # spot checks of the workload's arithmetic
    w0 = mine[b]
    assert w0[("incoming_msgs", "")] == 12 and w0[("incoming_bytes", "")] == sum(range(10, 130, 10))
    assert w0[("incoming_msgs", "qos=0")] == 4 and w0[("incoming_msgs", "segment=sensors")] == 6
    assert w0[("outgoing_msgs", "")] == 4 + 3 and w0[("connects", "")] == 3  # 3: device-persistence's tally
    assert w0[("outgoing_msgs", "path=persisted")] == 1 + 3 and w0[("outgoing_bytes", "path=persisted")] == 7 + 11


def test_restart_continues_without_double_counting(stats_run):
    import pyarrow.dataset as ds

    rows = ds.dataset(f"{stats_run.output}/stats", format="parquet", partitioning="hive").to_table().to_pylist()
    b = stats_run.base_ms
    by_window: dict[int, set[int]] = {}
    for r in rows:
        by_window.setdefault(int(r["window_start"].timestamp() * 1000), set()).add(r["batch_id"])
    # the first run's windows were written by its batches only, the second run's by later batches only
    assert by_window[b] <= stats_run.batches_after_phase1
    assert by_window[b + MINUTE_MS] <= stats_run.batches_after_phase1
    assert not (by_window[b + 2 * MINUTE_MS] & stats_run.batches_after_phase1)
    assert all(len(v) == 1 for v in by_window.values())


async def test_historical_data_topic(stats_run):
    recs = await read_all(stats_run.bootstrap, T.SYS_HISTORICAL_DATA, stats_run.historical_start)
    b = stats_run.base_ms
    got: dict[int, pb.UsageStats] = {}
    for r in recs:
        m = pb.UsageStats.FromString(r.value)
        assert r.key == str(m.window_start_ms).encode()
        if b <= m.window_start_ms < b + 4 * MINUTE_MS:
            assert m.window_start_ms not in got, "a window published twice"
            got[m.window_start_ms] = m
    assert sorted(got) == [b, b + MINUTE_MS, b + 2 * MINUTE_MS]
    for ws, m in got.items():
        assert m.source == "spark-stats" and m.window_end_ms == ws + MINUTE_MS
        values = {(s.key, s.dimension): s.value for s in m.stats}
        expected = (stats_run.phase1 if ws < b + 2 * MINUTE_MS else stats_run.phase2).expected[ws]
        _check_window(values, expected, stats_run.gauges[ws])


async def test_available_now_run_goes_on_when_an_application_topic_is_deleted(kafka, spark, tmp_path):
    """An availableNow run whose pattern loses a topic while it runs (app-delivery deletes the topic of an
    APPLICATION session that expired) fails in Spark's Kafka source (LOST_TOPIC_PARTITIONS_IN_END_OFFSET_WITH_
    TRIGGER_AVAILABLENOW); run_stats drops the planned batch that names the deleted topic, starts the query
    again from its checkpoint, and the run reads the other topics to their end."""
    import asyncio
    import json
    import time
    import uuid
    from pathlib import Path

    from aiokafka.admin import AIOKafkaAdminClient
    from spark_workload import create_topics, end_offsets, produce, publish
    from tbmq_spark.kafka_io import ENTITY_TOPICS, MESSAGE_TOPICS_PATTERN
    from tbmq_spark.stats import StatsConfig, run_stats
    from waits import wait_until

    bootstrap = kafka.bootstrap_servers
    tag = uuid.uuid4().hex[:8]
    gone, kept = T.app_topic_name(f"gone-{tag}"), T.app_topic_name(f"kept-{tag}")
    await create_topics(bootstrap, extra=[f"gone-{tag}", f"kept-{tag}"])
    start_msgs = await end_offsets(bootstrap, pattern=MESSAGE_TOPICS_PATTERN)
    start_ents = await end_offsets(bootstrap, topics=ENTITY_TOPICS)
    base = (int(time.time() * 1000) - 48 * 3600 * 1000) // MINUTE_MS * MINUTE_MS  # two days ago: no other test
    value = publish("pub-x", "alarms/x", b"z" * 5, 1, base).SerializeToString()
    kept_n = 12
    await produce(bootstrap, [(gone, b"alarms/x", value, base + i) for i in range(3)]
                  + [(kept, b"alarms/x", value, base + 100 + i) for i in range(kept_n)])

    # one record per partition and batch: the run takes kept_n batches, so the topic goes while it runs
    cfg = StatsConfig(bootstrap=bootstrap, output=str(tmp_path), watermark="0 seconds", trigger="availableNow",
                      starting_offsets=start_msgs, entity_starting_offsets=start_ents, max_offsets_per_trigger=1,
                      publish=False)
    run = asyncio.ensure_future(asyncio.to_thread(run_stats, spark, cfg))
    ckpt = Path(cfg.checkpoint_path)
    await wait_until(lambda: (ckpt / "commits" / "0").exists() or run.done(), 180, "the run's first batch")
    assert not run.done(), "the run ended before its first batch was committed"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([gone])
    finally:
        await admin.close()
    restarts = await asyncio.wait_for(run, 240)

    assert restarts >= 1, "the run never saw the deleted topic: the deletion came after its last batch"
    logged = [int(f.name) for f in (ckpt / "offsets").iterdir() if f.name.isdigit()]
    # an offsets log entry: a version line, the batch's metadata, then one line per source
    sources = (ckpt / "offsets" / str(max(logged))).read_text().splitlines()[2:]
    ends = [json.loads(s) for s in sources if s.startswith("{")]
    assert any(e.get(kept) == {"0": kept_n} for e in ends), ends
    assert max(logged) in {int(f.name) for f in (ckpt / "commits").iterdir() if f.name.isdigit()}
