"""Protobuf decoding of Kafka records on the Python workers (mapInArrow, tbmq.v1 generated classes).

The Kafka source gives binary key/value columns; each function here turns one Arrow batch of Kafka rows into
one Arrow batch of flat rows. Decoding runs record by record with the upb protobuf runtime (a few µs per
record) and never raises: a record that does not parse is counted as a `decode_errors` metric (stats) or
kept with `decode_error = true` (archive) instead of failing the query.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone

import pyarrow as pa
from tbmq_platform import topics as T
from tbmq_platform.marks import is_mark

# Every topic whose records are outgoing copies of a message, and what kind of copy it is.
PATH_BASIC, PATH_PERSISTED, PATH_APP = "basic", "persisted", "app"

KIND_SESSION, KIND_SUBSCRIPTIONS = "session", "subscriptions"

METRIC_SCHEMA = "event_time timestamp, metric string, dimension string, value long"
ENTITY_SCHEMA = ("entity string, kind string, client_id string, event_time timestamp, part int, "
                 "offset long, tombstone boolean, connected boolean, persistent boolean, "
                 "session_id string, n_subs int, decode_error boolean")

_METRIC_ARROW = pa.schema([("event_time", pa.timestamp("us", tz="UTC")), ("metric", pa.string()),
                           ("dimension", pa.string()), ("value", pa.int64())])


def segment(mqtt_topic: str) -> str:
    """Top-level topic segment ('sensors' of 'sensors/a/b'; '' for '/a'; '$SYS' kept)."""
    return mqtt_topic.split("/", 1)[0]


def outgoing_path(kafka_topic: str) -> str | None:
    if kafka_topic.startswith(T.DOWNLINK_BASIC_PREFIX):
        return PATH_BASIC
    if kafka_topic == T.MSG_PERSISTED:
        return PATH_PERSISTED
    if kafka_topic.startswith(T.MSG_APP_PREFIX):
        return PATH_APP
    return None


def _ms_to_dt(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000.0, tz=timezone.utc)


def _ts_ms(ts) -> int:
    """Kafka `timestamp` column value (datetime from Arrow) to Unix ms."""
    if ts is None:
        return 0
    return int(ts.timestamp() * 1000)


def message_metrics(topic: str, value: bytes | None, kafka_ts_ms: int) -> list[tuple[int, str, str, int]]:
    """Metric rows (event time ms, metric, dimension, value) of one record of a message topic."""
    from tbmq.v1 import messages_pb2 as pb

    if value is None:          # tombstones and subscription marks (tbmq_platform.marks) carry no message
        return []
    try:
        if topic == T.MSG_ALL:
            m = pb.PublishMsg.FromString(value)
            t = m.created_at_ms or kafka_ts_ms
            n = len(m.payload)
            q = f"qos={m.qos}"
            s = f"segment={segment(m.topic)}"
            out = [(t, "incoming_msgs", "", 1), (t, "incoming_msgs", q, 1), (t, "incoming_msgs", s, 1),
                   (t, "incoming_bytes", "", n), (t, "incoming_bytes", q, n), (t, "incoming_bytes", s, n)]
            if m.retain:
                out.append((t, "incoming_retained_msgs", "", 1))
            return out
        if topic == T.MSG_PERSISTED_TALLY:
            return tally_metrics(pb.PersistTally.FromString(value))
        path = outgoing_path(topic)
        t = kafka_ts_ms
        if path == PATH_BASIC:
            d = pb.BasicDownlink.FromString(value)
            n = len(d.msg.payload)
            k = len(d.recipients)
            out = [(t, "outgoing_msgs", "", k), (t, "outgoing_msgs", "path=basic", k),
                   (t, "outgoing_bytes", "", k * n), (t, "outgoing_bytes", "path=basic", k * n)]
            per_qos: dict[int, int] = {}
            for r in d.recipients:
                per_qos[r.qos] = per_qos.get(r.qos, 0) + 1
            out += [(t, "outgoing_msgs", f"qos={q}", c) for q, c in sorted(per_qos.items())]
            return out
        if path == PATH_PERSISTED:
            msg = pb.PersistedMsg.FromString(value).msg
        elif path == PATH_APP:
            msg = pb.PublishMsg.FromString(value)
        else:
            return []
        n = len(msg.payload)
        p = f"path={path}"
        return [(t, "outgoing_msgs", "", 1), (t, "outgoing_msgs", p, 1), (t, "outgoing_msgs", f"qos={msg.qos}", 1),
                (t, "outgoing_bytes", "", n), (t, "outgoing_bytes", p, n)]
    except Exception:  # DecodeError and anything odd: count it, never fail the query
        return [(kafka_ts_ms, "decode_errors", f"topic={topic.split('.')[2] if topic.count('.') >= 2 else topic}", 1)]


def tally_metrics(tally) -> list[tuple[int, str, str, int]]:
    """One device-persistence PersistTally (the stored copies its Persist streams brought in one second) as the
    rows tbmq.msg.persisted's records of those copies would give, at the second's start."""
    t, n, size, p = tally.second_ms, tally.copies, tally.payload_bytes, f"path={PATH_PERSISTED}"
    out = [(t, "outgoing_msgs", "", n), (t, "outgoing_msgs", p, n), (t, "outgoing_bytes", "", size),
           (t, "outgoing_bytes", p, size)]
    out += [(t, "outgoing_msgs", f"qos={q}", c) for q, c in enumerate(tally.copies_by_qos) if c]
    return out


def decode_message_batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow: Kafka rows (topic, value, timestamp) -> METRIC_SCHEMA rows."""
    for b in batches:
        topics = b.column("topic").to_pylist()
        values = b.column("value").to_pylist()
        stamps = b.column("timestamp").to_pylist()
        ts, ms, ds, vs = [], [], [], []
        for topic, value, stamp in zip(topics, values, stamps):
            for t, m, d, v in message_metrics(topic, value, _ts_ms(stamp)):
                ts.append(_ms_to_dt(t))
                ms.append(m)
                ds.append(d)
                vs.append(v)
        yield pa.RecordBatch.from_arrays(
            [pa.array(ts, pa.timestamp("us", tz="UTC")), pa.array(ms, pa.string()),
             pa.array(ds, pa.string()), pa.array(vs, pa.int64())], schema=_METRIC_ARROW)


def entity_row(topic: str, key: bytes | None, value: bytes | None) -> dict:
    """One record of tbmq.client.session / tbmq.client.subscriptions as projection input."""
    from tbmq.v1 import messages_pb2 as pb

    kind = KIND_SESSION if topic == T.CLIENT_SESSION else KIND_SUBSCRIPTIONS
    row = {"kind": kind, "client_id": key.decode("utf-8", "replace") if key is not None else "",
           "tombstone": value is None, "connected": False, "persistent": False, "session_id": "",
           "n_subs": 0, "decode_error": False}
    if value is None:
        return row
    try:
        if kind == KIND_SESSION:
            s = pb.SessionInfo.FromString(value)
            row.update(connected=s.connected, persistent=s.persistent, session_id=s.session_id)
            row["client_id"] = row["client_id"] or s.client_id
        else:
            c = pb.ClientSubscriptions.FromString(value)
            row["n_subs"] = len(c.subscriptions)
            row["client_id"] = row["client_id"] or c.client_id
    except Exception:
        row["decode_error"] = True
    return row


_ENTITY_ARROW = pa.schema([
    ("entity", pa.string()), ("kind", pa.string()), ("client_id", pa.string()),
    ("event_time", pa.timestamp("us", tz="UTC")), ("part", pa.int32()), ("offset", pa.int64()),
    ("tombstone", pa.bool_()), ("connected", pa.bool_()), ("persistent", pa.bool_()),
    ("session_id", pa.string()), ("n_subs", pa.int32()), ("decode_error", pa.bool_())])


def decode_entity_batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow: Kafka rows (topic, key, value, timestamp, partition, offset) -> ENTITY_SCHEMA rows."""
    for b in batches:
        cols = {name: b.column(name).to_pylist() for name in ("topic", "key", "value", "timestamp",
                                                               "partition", "offset")}
        out: dict[str, list] = {f.name: [] for f in _ENTITY_ARROW}
        for topic, key, value, stamp, part, off in zip(cols["topic"], cols["key"], cols["value"],
                                                       cols["timestamp"], cols["partition"], cols["offset"]):
            r = entity_row(topic, key, value)
            r["entity"] = f"{r['kind']}:{r['client_id']}"
            r["event_time"] = stamp
            r["part"] = part
            r["offset"] = off
            for k in out:
                out[k].append(r[k])
        yield pa.RecordBatch.from_arrays([pa.array(out[f.name], f.type) for f in _ENTITY_ARROW],
                                         schema=_ENTITY_ARROW)


# ------------------------------------------------------------------------------------------------------
# Archive rows (event log)
# ------------------------------------------------------------------------------------------------------

MESSAGE_ARCHIVE_SCHEMA = (
    "topic string, part int, offset long, kafka_ts timestamp, key string, publisher_id string, "
    "mqtt_topic string, qos int, retain boolean, payload_size int, payload binary, created_at timestamp, "
    "publisher_service_id string, decode_error boolean, date string")

STATE_ARCHIVE_SCHEMA = (
    "topic string, part int, offset long, kafka_ts timestamp, client_id string, tombstone boolean, "
    "value binary, connected boolean, persistent boolean, session_id string, n_subs int, "
    "event_type string, decode_error boolean, date string")


def _arrow_schema(ddl: str) -> pa.Schema:
    types = {"string": pa.string(), "int": pa.int32(), "long": pa.int64(), "boolean": pa.bool_(),
             "binary": pa.binary(), "timestamp": pa.timestamp("us", tz="UTC")}
    return pa.schema([(n, types[t]) for n, t in (f.strip().split() for f in ddl.split(","))])


_MSG_ARCH = _arrow_schema(MESSAGE_ARCHIVE_SCHEMA)
_STATE_ARCH = _arrow_schema(STATE_ARCHIVE_SCHEMA)


def _date(ts) -> str:
    return ts.strftime("%Y-%m-%d") if ts is not None else "1970-01-01"


def decode_message_archive(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow: tbmq.msg.all Kafka rows → MESSAGE_ARCHIVE_SCHEMA (date = UTC day of created_at)."""
    from tbmq.v1 import messages_pb2 as pb

    for b in batches:
        c = {n: b.column(n).to_pylist() for n in ("topic", "partition", "offset", "timestamp", "key", "value")}
        out: dict[str, list] = {f.name: [] for f in _MSG_ARCH}
        for topic, part, off, ts, key, value in zip(c["topic"], c["partition"], c["offset"], c["timestamp"],
                                                     c["key"], c["value"]):
            if is_mark(value):  # a connector's subscription mark, not a message (tbmq_platform.marks)
                continue
            r = {"topic": topic, "part": part, "offset": off, "kafka_ts": ts,
                 "key": key.decode("utf-8", "replace") if key is not None else None,
                 "publisher_id": None, "mqtt_topic": None, "qos": None, "retain": None, "payload_size": None,
                 "payload": None, "created_at": ts, "publisher_service_id": None, "decode_error": False}
            try:
                m = pb.PublishMsg.FromString(value)
                r.update(publisher_id=m.publisher_id, mqtt_topic=m.topic, qos=m.qos, retain=m.retain,
                         payload_size=len(m.payload), payload=m.payload,
                         publisher_service_id=m.publisher_service_id,
                         created_at=_ms_to_dt(m.created_at_ms) if m.created_at_ms else ts)
            except Exception:
                r["decode_error"] = True
            r["date"] = _date(r["created_at"])
            for k in out:
                out[k].append(r[k])
        yield pa.RecordBatch.from_arrays([pa.array(out[f.name], f.type) for f in _MSG_ARCH], schema=_MSG_ARCH)


def decode_state_archive(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow: tbmq.client.session / tbmq.client.subscriptions / tbmq.client.session.event.request
    Kafka rows → STATE_ARCHIVE_SCHEMA (raw value kept: the projections are rebuilt from it)."""
    from tbmq.v1 import messages_pb2 as pb

    for b in batches:
        c = {n: b.column(n).to_pylist() for n in ("topic", "partition", "offset", "timestamp", "key", "value")}
        out: dict[str, list] = {f.name: [] for f in _STATE_ARCH}
        for topic, part, off, ts, key, value in zip(c["topic"], c["partition"], c["offset"], c["timestamp"],
                                                     c["key"], c["value"]):
            r = {"topic": topic, "part": part, "offset": off, "kafka_ts": ts, "value": value,
                 "event_type": None, "date": _date(ts)}
            if topic == T.SESSION_EVENT_REQUEST:
                e = entity_row(T.CLIENT_SESSION, key, None)
                e["tombstone"] = value is None
                if value is not None:
                    try:
                        req = pb.SessionEventRequest.FromString(value)
                        r["event_type"] = pb.SessionEventType.Name(req.type)
                        e.update(connected=req.session.connected, persistent=req.session.persistent,
                                 session_id=req.session.session_id)
                        e["client_id"] = e["client_id"] or req.session.client_id
                    except Exception:
                        e["decode_error"] = True
            else:
                e = entity_row(topic, key, value)
            for k in ("client_id", "tombstone", "connected", "persistent", "session_id", "n_subs", "decode_error"):
                r[k] = e[k]
            for k in out:
                out[k].append(r[k])
        yield pa.RecordBatch.from_arrays([pa.array(out[f.name], f.type) for f in _STATE_ARCH],
                                         schema=_STATE_ARCH)
