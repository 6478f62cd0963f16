"""The statistics job over a real workload: paho-mqtt clients (3.1.1 and 5.0) publish through the real suite
(session-registry, device-persistence, router, connector) on the shared Kafka, then the stats job (local[2], availableNow, the
real 1-minute windows) runs over what the suite wrote, and every window in Parquet and in
tbmq.sys.historical.data holds exactly the expected counts.

The workload is known: M connections of known clients, N messages of known sizes, QoS and topics (every
QoS > 0 publish waited for its PUBACK/PUBCOMP), one subscriber. Its records carry real times (the connector
stamps created_at_ms, Kafka the others), so the expected value of each window is computed from the times of
the records read back, after checking that those records are exactly the workload (same publishers, topics,
sizes, QoS; one connect and one disconnect per connection; one copy per message the subscriber received).
The last window is closed by a tick produced at its end (watermark 0).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from mqtt_clients import Client, run, wait_until
from spark_workload import end_offsets, partitions, produce, publish
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics as T
from tbmq_platform.marks import is_mark

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

WINDOW_MS = 60_000
GAUGES = ("sessions_connected", "sessions_persistent", "sessions", "subscriptions", "subscribed_clients")
PROBE = b"probe-"


@dataclass
class Expected:
    """Window start (ms) → {(metric, dimension): value}; gauge metrics hold per-window deltas."""
    windows: dict[int, dict[tuple[str, str], int]] = field(default_factory=dict)

    def add(self, t_ms: int, metric: str, dim: str, value: int) -> None:
        if not value:
            return
        w = self.windows.setdefault(t_ms - t_ms % WINDOW_MS, {})
        w[(metric, dim)] = w.get((metric, dim), 0) + value

    def total(self, metric: str, dim: str = "") -> int:
        return sum(w.get((metric, dim), 0) for w in self.windows.values())

    def final(self) -> dict[int, dict[tuple[str, str], int]]:
        """Counters as they are, gauges as running totals at each window's end (the job starts them at 0)."""
        running = {g: 0 for g in GAUGES}
        out = {}
        for ws in sorted(self.windows):
            w = dict(self.windows[ws])
            for g in GAUGES:
                running[g] += w.pop((g, ""), 0)
                w[(g, "")] = running[g]
            out[ws] = w
        return out


def publishes(records: list) -> list:
    """The PUBLISH records of tbmq.msg.all: without the connectors' subscription marks (tbmq_platform.marks)."""
    return [r for r in records if not is_mark(r.value)]


async def read_range(bootstrap: str, start: dict[str, dict[str, int]], topics: list[str],
                     timeout: float = 30.0) -> dict[str, list]:
    """Committed records of `topics` from `start` (Spark offsets JSON, parsed; absent = 0) to their current
    end, per topic in (partition, offset) order. Transaction markers take offsets: the end is reached when the
    position passes the end offset, not when a record at end - 1 was seen."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed")
    await c.start()
    out: dict[str, list] = {t: [] for t in topics}
    try:
        parts = await partitions(bootstrap, topics)
        tps = [TopicPartition(t, p) for t in topics for p in parts.get(t, [])]
        c.assign(tps)
        for tp in tps:
            c.seek(tp, int(start.get(tp.topic, {}).get(str(tp.partition), 0)))
        ends = await c.end_offsets(tps)
        deadline = time.monotonic() + timeout
        while True:
            pending = [tp for tp in tps if await c.position(tp) < ends[tp]]
            if not pending:
                break
            assert time.monotonic() < deadline, f"could not read {pending} to their end within {timeout}s"
            for tp, recs in (await c.getmany(*pending, timeout_ms=500)).items():
                out[tp.topic].extend(recs)
    finally:
        await c.stop()
    for recs in out.values():
        recs.sort(key=lambda r: (r.partition, r.offset))
    return out


async def wait_records(bootstrap: str, start, topics, pred, what: str, timeout: float = 30.0) -> dict[str, list]:
    """read_range() until pred(records) holds (`waits.wait_until`)."""
    async def read_and_check():
        recs = await read_range(bootstrap, start, topics)
        return (recs,) if pred(recs) else None  # truthy even when recs is empty

    (recs,) = await wait_until(read_and_check, timeout, what, step=0.3)
    return recs


def project_entities(records: list, expected: Expected) -> dict[str, Counter]:
    """The session and subscription records as the job defines its metrics (docs/spark.md): per client its
    last state, each record's change at the record's Kafka time. Returns per-client connects/disconnects."""
    state: dict[str, dict] = {}
    per_client: dict[str, Counter] = {}
    for r in records:
        cid = r.key.decode()
        s = state.setdefault(cid, {"present": False, "connected": False, "persistent": False, "sid": "",
                                   "subs": 0})
        t = r.timestamp
        if r.topic == T.CLIENT_SESSION:
            info = pb.SessionInfo.FromString(r.value) if r.value is not None else None
            present = info is not None
            connected = present and info.connected
            persistent = present and info.persistent
            sid = info.session_id if present else ""
            c = per_client.setdefault(cid, Counter())
            if connected and (not s["connected"] or sid != s["sid"]):
                expected.add(t, "connects", "", 1)
                c["connects"] += 1
            if s["connected"] and (not connected or sid != s["sid"]):
                expected.add(t, "disconnects", "", 1)
                c["disconnects"] += 1
            expected.add(t, "sessions_connected", "", int(connected) - int(s["connected"]))
            expected.add(t, "sessions_persistent", "", int(persistent) - int(s["persistent"]))
            expected.add(t, "sessions", "", int(present) - int(s["present"]))
            s.update(present=present, connected=connected, persistent=persistent, sid=sid)
        else:
            n = 0 if r.value is None else len(pb.ClientSubscriptions.FromString(r.value).subscriptions)
            expected.add(t, "subscriptions", "", n - s["subs"])
            expected.add(t, "subscribed_clients", "", int(n > 0) - int(s["subs"] > 0))
            s.update(subs=n)
    return per_client


def check_window(got: dict[tuple[str, str], int], want: dict[tuple[str, str], int], where: str) -> None:
    """Counters: every non-zero one equal (the job writes the main totals as 0 when nothing happened);
    gauges: all five equal."""
    gauges = {(g, "") for g in GAUGES}
    got_c = {k: v for k, v in got.items() if k not in gauges and v != 0}
    want_c = {k: v for k, v in want.items() if k not in gauges and v != 0}
    assert got_c == want_c, f"{where}: counters differ"
    assert {k: got.get(k) for k in gauges} == {k: want[k] for k in gauges}, f"{where}: gauges differ"


async def test_paho_workload_exact_counts_per_window(make_suite, spark, tmp_path):
    from tbmq_spark.kafka_io import ENTITY_TOPICS, MESSAGE_TOPICS_PATTERN
    from tbmq_spark.stats import StatsConfig, run_stats

    t0 = time.monotonic()
    # device-persistence too: the registry clears a client's stored messages when it connects again
    suite = await make_suite(services=["session-registry", "device-persistence", "router", "connector"])
    bootstrap, port = suite.bootstrap_servers, suite.mqtt_ports[0]
    downlink = T.downlink_basic_topic(suite.connector_ids[0])
    # the broker is shared by the whole test run: the job and the checks start at the current ends
    start_msgs = await end_offsets(bootstrap, pattern=MESSAGE_TOPICS_PATTERN)
    start_ents = await end_offsets(bootstrap, topics=ENTITY_TOPICS)
    start_hist = await end_offsets(bootstrap, topics=[T.SYS_HISTORICAL_DATA])
    msg_topics = sorted(json.loads(start_msgs))
    assert T.MSG_ALL in msg_topics and downlink in msg_topics

    tag = uuid.uuid4().hex[:8]
    seg_a, seg_b = f"spka{tag}", f"spkb{tag}"      # the top-level segments (segment=<first level>)
    sent: list[tuple[str, str, int, int, bool]] = []   # (publisher, MQTT topic, payload size, QoS, retain)
    connections: Counter = Counter()

    async def connect(c: Client, cid: str) -> None:
        await run(c.connect, port)
        connections[cid] += 1

    async def pub(c: Client, cid: str, topic: str, payload: bytes, qos: int, retain: bool = False) -> None:
        await run(c.publish, topic, payload, qos, retain)   # QoS > 0: waits for PUBACK / PUBCOMP
        sent.append((cid, topic, len(payload), qos, retain))

    # M = 6 connections: a 5.0 subscriber, four publishers (5.0, 3.1.1, 5.0, 3.1.1), one of them twice
    sub_id = f"sub-{tag}"
    sub = Client(sub_id)
    await connect(sub, sub_id)
    await run(sub.subscribe, f"{seg_a}/#", 1)
    ids = [f"pub{i}-{tag}" for i in range(4)]
    pubs = [Client(cid, v5=(i % 2 == 0)) for i, cid in enumerate(ids)]
    for c, cid in zip(pubs, ids):
        await connect(c, cid)

    # the router learns the subscription asynchronously: QoS 1 probes until one arrives (they count too)
    probe_topic = f"{seg_a}/probe"
    deadline = time.monotonic() + 30
    n = 0
    while True:
        payload = PROBE + str(n).encode()
        await pub(pubs[0], ids[0], probe_topic, payload, 1)
        n += 1
        if await run(sub.wait, lambda p=payload: any(m.payload == p for m in sub.messages_on(probe_topic)), 0.5):
            break
        assert time.monotonic() < deadline, "subscription not routed within 30 s"

    # N = 24 messages of known sizes, QoS 0/1/2, half on each segment, from all four publishers
    for i in range(24):
        seg = seg_a if i % 2 == 0 else seg_b
        await pub(pubs[i % 4], ids[i % 4], f"{seg}/d{i % 5}", bytes([97 + i]) * (5 + 11 * i), i % 3)
    # a retained message and its removal (an empty retained PUBLISH is a message too: 0 bytes)
    await pub(pubs[1], ids[1], f"{seg_b}/r", b"R" * 9, 1, retain=True)
    await pub(pubs[1], ids[1], f"{seg_b}/r", b"", 1, retain=True)
    # the 3.1.1 publisher 3 disconnects and connects again, and publishes once more
    await run(pubs[3].close, wait=True)
    pubs[3] = Client(ids[3], v5=False)
    await connect(pubs[3], ids[3])
    await pub(pubs[3], ids[3], f"{seg_b}/again", b"Z" * 3, 2)

    n_a = sum(1 for s in sent if s[1].startswith(seg_a + "/") and not s[1] == probe_topic)
    assert n_a == 12
    assert await run(sub.wait, lambda: sum(1 for m in sub.snapshot() if not m.payload.startswith(PROBE)) >= n_a,
                     20), "the subscriber did not receive every message"
    for c in (sub, *pubs):
        await run(c.close, wait=True)
    mine = {sub_id, *ids}
    n_msgs = len(sent)
    assert n_msgs == n + 24 + 2 + 1 and sum(connections.values()) == 6

    # everything the workload wrote is in Kafka: every message, and the end of every connection
    def sessions_done(recs) -> bool:
        last: dict[str, object] = {}
        ups: Counter = Counter()
        for r in recs[T.CLIENT_SESSION]:
            cid = r.key.decode()
            if cid in mine:
                info = pb.SessionInfo.FromString(r.value) if r.value is not None else None
                last[cid] = info
                ups[cid] += bool(info is not None and info.connected)
        return (set(last) == mine and all(v is None or not v.connected for v in last.values())
                and all(ups[c] >= connections[c] for c in mine))

    await wait_records(bootstrap, json.loads(start_ents), ENTITY_TOPICS, sessions_done,
                       "the session records of every connect and disconnect")
    await wait_records(bootstrap, json.loads(start_msgs), [T.MSG_ALL],
                       lambda recs: len(publishes(recs[T.MSG_ALL])) >= n_msgs, "every message in tbmq.msg.all")
    received = sub.snapshot()
    await suite.stop()         # nothing writes to the topics any more; the CPU is Spark's
    t_workload = time.monotonic() - t0

    # ---- expected values per window, from the records read back (checked to be exactly the workload) ----
    exp = Expected()
    msgs = await read_range(bootstrap, json.loads(start_msgs), msg_topics)
    assert {t for t, recs in msgs.items() if recs} <= {T.MSG_ALL, downlink}
    incoming = [pb.PublishMsg.FromString(r.value) for r in publishes(msgs[T.MSG_ALL])]
    assert Counter((m.publisher_id, m.topic, len(m.payload), m.qos, m.retain) for m in incoming) == Counter(sent)
    for m in incoming:
        t, size = m.created_at_ms, len(m.payload)
        for dim in ("", f"qos={m.qos}", f"segment={m.topic.split('/')[0]}"):
            exp.add(t, "incoming_msgs", dim, 1)
            exp.add(t, "incoming_bytes", dim, size)
        if m.retain:
            exp.add(t, "incoming_retained_msgs", "", 1)
    copies = []
    for r in msgs[downlink]:
        d = pb.BasicDownlink.FromString(r.value)
        assert [x.client_id for x in d.recipients] == [sub_id]
        q = d.recipients[0].qos
        copies.append((d.msg.topic, bytes(d.msg.payload)))
        for dim in ("", "path=basic"):
            exp.add(r.timestamp, "outgoing_msgs", dim, 1)
            exp.add(r.timestamp, "outgoing_bytes", dim, len(d.msg.payload))
        exp.add(r.timestamp, "outgoing_msgs", f"qos={q}", 1)
    # one copy per message the subscriber received (duplicates would show here), and it got all of seg_a
    assert Counter(copies) == Counter((m.topic, m.payload) for m in received)
    ents = await read_range(bootstrap, json.loads(start_ents), ENTITY_TOPICS)
    per_client = project_entities(sorted(ents[T.CLIENT_SESSION] + ents[T.CLIENT_SUBSCRIPTIONS],
                                         key=lambda r: (r.topic, r.partition, r.offset)), exp)
    for cid in mine:
        assert per_client[cid] == Counter(connects=connections[cid], disconnects=connections[cid]), cid

    # the known totals, literally
    sizes = sum(s[2] for s in sent)
    assert exp.total("incoming_msgs") == n_msgs and exp.total("incoming_bytes") == sizes
    assert sizes == sum(5 + 11 * i for i in range(24)) + sum(len(PROBE) + len(str(i)) for i in range(n)) + 9 + 3
    assert exp.total("incoming_msgs", "qos=0") == 8 and exp.total("incoming_msgs", "qos=2") == 8 + 1
    assert exp.total("incoming_msgs", f"segment={seg_a}") == 12 + n
    assert exp.total("incoming_msgs", f"segment={seg_b}") == 12 + 3
    assert exp.total("incoming_retained_msgs") == 2
    assert exp.total("outgoing_msgs") == len(received) >= 12 + 1
    assert exp.total("connects") >= 6 and exp.total("disconnects") >= 6   # ≥: other clients' records count too
    expected = exp.final()
    last = max(expected)
    assert expected[last][("sessions_connected", "")] == 0

    # ---- the job: availableNow over exactly these records, closed by a tick at the end of the last window ----
    tick_ms = last + WINDOW_MS
    await produce(bootstrap, [(T.MSG_ALL, b"tick", publish("tick", f"tick{tag}", b"", 0, tick_ms)
                               .SerializeToString(), tick_ms)])
    output = str(tmp_path / "spark")
    cfg = StatsConfig(bootstrap=bootstrap, output=output, window="1 minute", watermark="0 seconds",
                      trigger="availableNow", starting_offsets=start_msgs, entity_starting_offsets=start_ents)
    t1 = time.monotonic()
    await asyncio.to_thread(run_stats, spark, cfg)
    t_job = time.monotonic() - t1

    # ---- Parquet: exactly the expected windows, each written once, with exactly the expected values ----
    import pyarrow.dataset as ds

    rows = ds.dataset(f"{output}/stats", format="parquet", partitioning="hive").to_table().to_pylist()
    got: dict[int, dict[tuple[str, str], int]] = {}
    for r in rows:
        ws = int(r["window_start"].timestamp() * 1000)
        assert int(r["window_end"].timestamp() * 1000) - ws == WINDOW_MS
        w = got.setdefault(ws, {})
        assert (r["metric"], r["dimension"]) not in w, f"window {ws} {r['metric']} written twice"
        w[(r["metric"], r["dimension"])] = r["value"]
    assert sorted(got) == sorted(expected)
    for ws in expected:
        check_window(got[ws], expected[ws], f"parquet window {ws}")

    # ---- tbmq.sys.historical.data: one UsageStats per window with the same values ----
    hist = (await read_range(bootstrap, json.loads(start_hist), [T.SYS_HISTORICAL_DATA]))[T.SYS_HISTORICAL_DATA]
    published: dict[int, pb.UsageStats] = {}
    for r in hist:
        m = pb.UsageStats.FromString(r.value)
        assert r.key == str(m.window_start_ms).encode() and m.source == "spark-stats"
        assert m.window_start_ms not in published, "a window published twice"
        published[m.window_start_ms] = m
    assert sorted(published) == sorted(expected)
    for ws, m in published.items():
        assert m.window_end_ms == ws + WINDOW_MS
        check_window({(s.key, s.dimension): s.value for s in m.stats}, expected[ws], f"historical window {ws}")
    print(f"\nworkload {t_workload:.1f}s ({n_msgs} messages, {n} probes, {len(expected)} windows), "
          f"stats job {t_job:.1f}s")
