"""The API's pure parts: records as JSON, filters, paging, shared-subscription groups, statistics.

Nothing here does I/O: the service hands in its tables (dicts kept by the compacted views) and gets JSON-ready
dicts back.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tbmq.v1 import messages_pb2 as pb

MAX_LIMIT = 1000
DEFAULT_LIMIT = 100

CLIENT_TYPES = {pb.CLIENT_TYPE_DEVICE: "DEVICE", pb.CLIENT_TYPE_APPLICATION: "APPLICATION"}


class BadQuery(ValueError):
    """A bad query parameter (the API answers 400 with its message)."""


class _Row:
    """A protobuf record's fields the admin service needs, copied into slots (a parsed protobuf costs about
    three times as much); string fields many records share (`_interned`) are interned."""

    __slots__ = ()
    _interned: tuple[str, ...] = ()

    @classmethod
    def of(cls, msg):
        row = cls()
        for name in cls.__slots__:
            value = getattr(msg, name)
            setattr(row, name, sys.intern(value) if name in cls._interned else value)
        return row


class SessionRow(_Row):
    """What the admin service keeps of a tbmq.client.session record: the fields its API shows and its writes
    need. A parsed SessionInfo costs about 1,350 bytes of memory, this about 500 (the service holds one per
    session of the cluster: a million devices are a million rows)."""

    __slots__ = ("client_id", "client_type", "connected", "persistent", "service_id", "session_id", "clean_start",
                 "session_expiry_interval", "mqtt_version", "keep_alive", "connected_at_ms", "disconnected_at_ms",
                 "client_address", "username", "connector_incarnation")
    _interned = ("service_id", "connector_incarnation")

    @classmethod
    def parse(cls, value: bytes) -> "SessionRow":
        return cls.of(pb.SessionInfo.FromString(value))


class SubscriptionRow(_Row):
    """One subscription of a tbmq.client.subscriptions record, as the admin service keeps it."""

    __slots__ = ("topic_filter", "qos", "share_name", "no_local", "retain_as_published", "retain_handling",
                 "subscription_id")
    _interned = ("share_name",)


class SubscriptionsRow:
    """A client's subscription set (tbmq.client.subscriptions) as rows: about a third of a parsed
    ClientSubscriptions."""

    __slots__ = ("subscriptions",)

    def __init__(self, subscriptions: tuple[SubscriptionRow, ...]) -> None:
        self.subscriptions = subscriptions

    @classmethod
    def parse(cls, value: bytes) -> "SubscriptionsRow":
        return cls(tuple(SubscriptionRow.of(t) for t in pb.ClientSubscriptions.FromString(value).subscriptions))


@dataclass(frozen=True)
class Page:
    limit: int = DEFAULT_LIMIT
    offset: int = 0

    @classmethod
    def of(cls, params: Mapping[str, str]) -> "Page":
        limit = _int(params, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        offset = _int(params, "offset", 0, 0, None)
        return cls(limit, offset)

    def apply(self, items: list) -> dict:
        """{"items": the page, "total": all matches, "limit", "offset", "next_offset": None on the last page}."""
        chunk = items[self.offset:self.offset + self.limit]
        end = self.offset + len(chunk)
        return {"items": chunk, "total": len(items), "limit": self.limit, "offset": self.offset,
                "next_offset": end if end < len(items) else None}


def _int(params: Mapping[str, str], name: str, default: int, lo: int, hi: int | None) -> int:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadQuery(f"{name}: not an integer: {raw!r}") from None
    if value < lo or (hi is not None and value > hi):
        raise BadQuery(f"{name}: {value} is not in [{lo}, {hi if hi is not None else '∞'}]")
    return value


def _bool(params: Mapping[str, str], name: str) -> bool | None:
    raw = params.get(name)
    if raw is None or raw == "":
        return None
    if raw.lower() in ("true", "1", "yes"):
        return True
    if raw.lower() in ("false", "0", "no"):
        return False
    raise BadQuery(f"{name}: not a boolean: {raw!r}")


def client_type_name(t: int) -> str:
    return CLIENT_TYPES.get(t, str(t))


# -- records as JSON ---------------------------------------------------------------------------------------

def session_json(s: SessionRow | pb.SessionInfo) -> dict:
    return {"client_id": s.client_id, "client_type": client_type_name(s.client_type), "connected": s.connected,
            "persistent": s.persistent, "service_id": s.service_id, "session_id": s.session_id,
            "clean_start": s.clean_start, "session_expiry_interval": s.session_expiry_interval,
            "mqtt_version": s.mqtt_version, "keep_alive": s.keep_alive, "connected_at_ms": s.connected_at_ms,
            "disconnected_at_ms": s.disconnected_at_ms, "client_address": s.client_address,
            "username": s.username}


def subscription_json(client_id: str, t: SubscriptionRow | pb.TopicSubscription) -> dict:
    return {"client_id": client_id, "topic_filter": t.topic_filter, "share_name": t.share_name, "qos": t.qos,
            "no_local": t.no_local, "retain_as_published": t.retain_as_published,
            "retain_handling": t.retain_handling, "subscription_id": t.subscription_id}


def retained_json(m: pb.PublishMsg) -> dict:
    try:
        text = m.payload.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return {"topic": m.topic, "qos": m.qos, "payload_size": len(m.payload), "payload_text": text,
            "payload_hex": m.payload.hex() if text is None else None, "publisher_id": m.publisher_id,
            "created_at_ms": m.created_at_ms,
            "message_expiry_interval": m.message_expiry_interval if m.HasField("message_expiry_interval") else None}


# -- filters ------------------------------------------------------------------------------------------------

def filter_sessions(sessions: Mapping[str, SessionRow], params: Mapping[str, str]) -> list[dict]:
    """Sessions matching `client_id` (prefix), `connected` (true/false) and `client_type` (DEVICE/APPLICATION),
    sorted by client id."""
    prefix = params.get("client_id", "")
    connected = _bool(params, "connected")
    ctype = params.get("client_type", "").upper()
    if ctype and ctype not in CLIENT_TYPES.values():
        raise BadQuery(f"client_type: {params['client_type']!r} is not DEVICE or APPLICATION")
    out = []
    for cid in sorted(sessions):
        s = sessions[cid]
        if prefix and not cid.startswith(prefix):
            continue
        if connected is not None and s.connected != connected:
            continue
        if ctype and client_type_name(s.client_type) != ctype:
            continue
        out.append(session_json(s))
    return out


def all_subscriptions(subs: Mapping[str, SubscriptionsRow]) -> Iterable[dict]:
    for cid in sorted(subs):
        for t in sorted(subs[cid].subscriptions, key=lambda t: (t.share_name, t.topic_filter)):
            yield subscription_json(cid, t)


def filter_subscriptions(subs: Mapping[str, SubscriptionsRow], params: Mapping[str, str]) -> list[dict]:
    """Subscriptions whose filter contains `topic_filter` (substring), of clients with the `client_id` prefix,
    `shared` (true/false), sorted by client id and filter."""
    part = params.get("topic_filter", "")
    prefix = params.get("client_id", "")
    shared = _bool(params, "shared")
    return [s for s in all_subscriptions(subs)
            if part in s["topic_filter"] and s["client_id"].startswith(prefix)
            and (shared is None or bool(s["share_name"]) == shared)]


def filter_retained(retained: Mapping[str, pb.PublishMsg], params: Mapping[str, str]) -> list[dict]:
    """Retained messages whose topic contains `topic` (substring), sorted by topic."""
    part = params.get("topic", "")
    return [retained_json(retained[t]) for t in sorted(retained) if part in t]


def shared_groups(subs: Mapping[str, SubscriptionsRow]) -> list[dict]:
    """Shared-subscription groups ($share/<share name>/<filter>) and their members, sorted."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for s in all_subscriptions(subs):
        if s["share_name"]:
            groups.setdefault((s["share_name"], s["topic_filter"]), []).append(
                {"client_id": s["client_id"], "qos": s["qos"]})
    return [{"share_name": name, "topic_filter": flt, "members": members}
            for (name, flt), members in sorted(groups.items())]


# -- statistics ---------------------------------------------------------------------------------------------

STAT_KEYS = ("incoming_msgs", "outgoing_msgs", "incoming_bytes", "outgoing_bytes", "connects", "disconnects",
             "sessions_connected", "sessions", "subscriptions")


def stats_json(windows: Mapping[int, pb.UsageStats], since_ms: int = 0, limit: int = 1440) -> list[dict]:
    """The newest `limit` windows starting at or after `since_ms`, oldest first: the totals (dimension "") of
    each window, and the dimensioned values under "dimensions"."""
    out = []
    for start in sorted(w for w in windows if w >= since_ms)[-limit:]:
        w = windows[start]
        totals: dict[str, int] = {}
        dims: dict[str, dict[str, int]] = {}
        for st in w.stats:
            if st.dimension:
                dims.setdefault(st.key, {})[st.dimension] = st.value
            else:
                totals[st.key] = st.value
        out.append({"window_start_ms": w.window_start_ms, "window_end_ms": w.window_end_ms, "source": w.source,
                    "totals": totals, "dimensions": dims})
    return out


def overview(sessions: Mapping[str, SessionRow], subs: Mapping[str, SubscriptionsRow],
             retained: Mapping[str, pb.PublishMsg]) -> dict:
    """Counts of the tables."""
    return {"sessions": len(sessions), "connected": sum(1 for s in sessions.values() if s.connected),
            "application_sessions": sum(1 for s in sessions.values() if s.client_type == pb.CLIENT_TYPE_APPLICATION),
            "subscriptions": sum(len(c.subscriptions) for c in subs.values()),
            "shared_groups": len({(t.share_name, t.topic_filter) for c in subs.values() for t in c.subscriptions
                                  if t.share_name}),
            "retained": len(retained)}
