"""Pure routing rules: (publish, trie matches, session view) -> RoutingPlan.

No I/O: the router turns a ``RoutingPlan`` into Kafka records. Summary (see ``plan_routing``):

1. Shared subscriptions (``share_name != ''``) are grouped per (share name, filter); all others
   are merged per client: max QoS, union of subscription ids, Retain-As-Published if any matching
   subscription has it. Subscriptions of the publisher with No Local are skipped [MQTT-3.8.3-3].
2. Delivered QoS = min(publish QoS, subscription QoS); delivered RETAIN = publish RETAIN if
   Retain-As-Published else False [MQTT-3.3.1-12] [MQTT-3.3.1-13].
3. Per subscriber session:
   * QoS > 0 (both sides) and persistent: DEVICE -> ``persisted`` (tbmq.msg.persisted, whether
     connected or not); APPLICATION -> ``app`` (``tbmq.msg.app.<id>``);
   * otherwise (QoS 0 on either side, or a non-persistent session) connected -> ``live`` under
     its connector's service id (tbmq.msg.downlink.basic.<svc>);
   * otherwise (offline, or no known session) -> dropped (counted).
4. Shared groups. Members that are persistent APPLICATION clients form the APPLICATION part:
   ONE copy per Kafka topic ``tbmq.msg.app.shared.<filter>`` (one topic per filter, consumed by one
   consumer group per share name, so several share names on the same filter still produce one
   record). All other members (DEVICE, non-persistent APPLICATION) form the DEVICE part: one
   connected member is picked round-robin and routed like a normal subscriber (rule 3); if no
   member is connected but one is persistent and QoS > 0, the copy is persisted under the group
   store id ``ss_<share name>_<filter>`` (``shared_store_id``) for members to fetch later; else
   dropped.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar, Union

from .trie import Subscription

__all__ = [
    "APP_TOPIC_PREFIX",
    "SHARED_APP_TOPIC_PREFIX",
    "SHARED_STORE_PREFIX",
    "DEVICE",
    "APPLICATION",
    "app_topic_name",
    "shared_app_topic_name",
    "shared_store_id",
    "APP_CLIENT_GROUP_PREFIX",
    "APP_SHARED_GROUP_PREFIX",
    "app_client_group",
    "app_shared_group",
    "SessionView",
    "PublishInfo",
    "Delivery",
    "AppDelivery",
    "SharedAppCopy",
    "SharedDeviceChoice",
    "RoutingPlan",
    "RoundRobin",
    "plan_routing",
]

# ---------------------------------------------------------------------------- naming
APP_TOPIC_PREFIX = "tbmq.msg.app."
SHARED_APP_TOPIC_PREFIX = "tbmq.msg.app.shared."
#: a name derived from a hash starts with this: "-" is in no name derived from the text itself, so a client id
#: or filter that looks like a hash can never take another's topic
HASHED_PREFIX = "h-"
#: the store id of a shared DEVICE group is "$share/<share name>/<filter>" (the subscription as the clients
#: write it: a share name cannot contain "/" [MQTT-4.8.2-2], so the id is unambiguous); client ids that start
#: with it are refused, so no client can connect as a group's store
SHARED_STORE_PREFIX = "$share/"
RESERVED_CLIENT_ID_PREFIXES = (SHARED_STORE_PREFIX,)
#: Kafka consumer groups of app-delivery: one per APPLICATION client ("c."), one per shared share name ("s.");
#: the two fixed prefixes keep a client id from naming a share's group
APP_CLIENT_GROUP_PREFIX = "app-delivery.c."
APP_SHARED_GROUP_PREFIX = "app-delivery.s."
#: Kafka's limit on topic name length.
KAFKA_TOPIC_MAX_LEN = 249

_APP_ID_RE = re.compile(r"[A-Za-z0-9]+")
_SHARED_FILTER_RE = re.compile(r"[a-zA-Z0-9/+#]+")
# "+" and "#" become "_slw" / "_mlw": "_" is not in the literal characters kept, so a literal level "slw"
# ("slw") and a wildcard ("_slw") stay apart (TBMQ maps both to "slw")
_SHARED_MAP = str.maketrans({"/": ".", "+": "_slw", "#": "_mlw"})


def _sha256_hex(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def app_topic_name(client_id: str) -> str:
    """Kafka topic of a persistent APPLICATION client: ``tbmq.msg.app.<client id>`` if the id
    matches ``^[A-Za-z0-9]+$`` and fits Kafka's name limit, else ``tbmq.msg.app.h-<sha256 hex of the
    UTF-8 client id>``. Injective: a 64-hex client id keeps its own name, apart from every hashed one
    (TBMQ's MqttApplicationClientUtil hashes without the ``h-``, so such an id could take another
    client's topic)."""
    if _APP_ID_RE.fullmatch(client_id) and len(APP_TOPIC_PREFIX) + len(client_id) <= KAFKA_TOPIC_MAX_LEN:
        return APP_TOPIC_PREFIX + client_id
    return APP_TOPIC_PREFIX + HASHED_PREFIX + _sha256_hex(client_id)


def shared_app_topic_name(topic_filter: str) -> str:
    """Kafka topic of shared APPLICATION subscriptions on ``topic_filter`` (without ``$share/``).

    If the filter matches ``^[a-zA-Z0-9/+#]+$``: ``/`` -> ``.``, ``+`` -> ``_slw``, ``#`` -> ``_mlw``
    (``home/+/t/#`` -> ``tbmq.msg.app.shared.home._slw.t._mlw``); else (or when the result exceeds Kafka's
    249 characters) ``h-`` + the sha256 hex of the UTF-8 filter. Injective: distinct filters get distinct
    topics (TBMQ maps ``a/+`` and ``a/slw`` to one topic)."""
    if _SHARED_FILTER_RE.fullmatch(topic_filter):
        name = SHARED_APP_TOPIC_PREFIX + topic_filter.translate(_SHARED_MAP)
        if len(name) <= KAFKA_TOPIC_MAX_LEN:
            return name
    return SHARED_APP_TOPIC_PREFIX + HASHED_PREFIX + _sha256_hex(topic_filter)


def shared_store_id(share_name: str, topic_filter: str) -> str:
    """Pseudo client id under which a shared DEVICE group's messages are persisted while no
    member is connected: ``$share/<share name>/<filter>``. Injective (a share name has no ``/``), and no
    client can use it: client ids starting with ``$share/`` are refused (``is_reserved_client_id``). Used as
    the key of the tbmq.msg.persisted record and as the device-persistence store id. (TBMQ's
    ``ss_<share>_<filter>`` is neither: ``$share/a_b/c`` and ``$share/a/b_c`` share one store.)"""
    return f"{SHARED_STORE_PREFIX}{share_name}/{topic_filter}"


def is_reserved_client_id(client_id: str) -> bool:
    """A client id that names something internal (a shared group's store): refused at CONNECT, by the
    connector (CONNACK Client Identifier not valid) and by the session registry."""
    return client_id.startswith(RESERVED_CLIENT_ID_PREFIXES)


def app_client_group(client_id: str) -> str:
    """Kafka consumer group that reads ``app_topic_name(client_id)`` for the APPLICATION client (its
    committed offsets are the client's acknowledged backlog): ``app-delivery.c.<client id>``. app-delivery
    consumes with it; the session registry moves its offsets when a session's backlog is skipped."""
    return APP_CLIENT_GROUP_PREFIX + client_id


def app_shared_group(share_name: str) -> str:
    """Kafka consumer group of the APPLICATION members of one share name, across the
    ``tbmq.msg.app.shared.<filter>`` topics of their filters: ``app-delivery.s.<share name>``."""
    return APP_SHARED_GROUP_PREFIX + share_name


# ---------------------------------------------------------------------------- inputs
DEVICE = "DEVICE"
APPLICATION = "APPLICATION"


@dataclass(frozen=True, slots=True)
class SessionView:
    """What routing needs to know about a subscriber's session (from tbmq.client.session)."""

    connected: bool
    service_id: str = ""  # connector instance holding the connection ('' when offline)
    client_type: str = DEVICE  # DEVICE | APPLICATION
    persistent: bool = False


class PublishInfo(NamedTuple):
    """The message routed (a NamedTuple: built per message on the router's hot path, half the cost of a frozen
    dataclass)."""

    client_id: str  # publisher
    topic: str
    qos: int
    retain: bool = False


SessionLookup = Union[Callable[[str], "SessionView | None"], Mapping[str, SessionView]]

# ---------------------------------------------------------------------------- outputs


@dataclass(slots=True)
class Delivery:
    """One copy for one client (or, in ``persisted``, possibly a shared group store id)."""

    client_id: str
    qos: int
    retain: bool
    subscription_ids: tuple[int, ...] = ()
    share_name: str = ""  # set when the copy is for a shared subscription
    topic_filter: str = ""  # the shared subscription's filter (only when share_name is set)


@dataclass(slots=True)
class AppDelivery:
    """A copy for a persistent APPLICATION client's Kafka topic."""

    client_id: str
    topic: str  # app_topic_name(client_id)
    qos: int
    retain: bool
    subscription_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SharedAppCopy:
    """ONE record for the Kafka topic of shared APPLICATION subscriptions on ``topic_filter``.

    ``share_names``: the groups (one Kafka consumer group each) that will consume it. ``qos`` is
    min(publish QoS, highest member QoS); each consumer caps it at its member's own QoS.
    ``subscription_ids``: union over the members (each consumer should use its own).
    """

    topic_filter: str
    topic: str  # shared_app_topic_name(topic_filter)
    share_names: tuple[str, ...]
    qos: int
    retain: bool
    subscription_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SharedDeviceChoice:
    """Outcome for the DEVICE part of one shared group: ``client_id`` (the chosen connected
    member), or ``store_id`` (persisted for later), or neither (dropped)."""

    share_name: str
    topic_filter: str
    client_id: str | None = None
    store_id: str | None = None


@dataclass(slots=True)
class RoutingPlan:
    live: dict[str, list[Delivery]] = field(default_factory=dict)  # connector service id -> copies
    persisted: list[Delivery] = field(default_factory=list)  # -> tbmq.msg.persisted (key client/store id)
    app: list[AppDelivery] = field(default_factory=list)  # -> tbmq.msg.app.<id>
    shared_app: list[SharedAppCopy] = field(default_factory=list)  # -> tbmq.msg.app.shared.<filter>
    shared_device: list[SharedDeviceChoice] = field(default_factory=list)  # informational
    dropped: int = 0  # copies not delivered (offline non-persistent / unknown session / no member)
    dropped_clients: list[str] = field(default_factory=list)  # client or store ids dropped
    no_local_skipped: int = 0

    @property
    def copies(self) -> int:
        """Number of records the plan produces (live + persisted + app + shared app)."""
        return (sum(len(v) for v in self.live.values()) + len(self.persisted) + len(self.app)
                + len(self.shared_app))

    def is_empty(self) -> bool:
        return self.copies == 0


# ---------------------------------------------------------------------------- round robin
T = TypeVar("T")


class RoundRobin:
    """Stateful round-robin picker per key (the router owns one, keyed by (share name, filter)).

    Pure: no clocks, no randomness. ``pick`` returns candidates in turn; the candidate list may
    change between calls (the position is kept modulo its current length).
    """

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next: dict[Hashable, int] = {}

    def pick(self, key: Hashable, candidates: Sequence[T]) -> T:
        n = len(candidates)
        if n == 0:
            raise ValueError("no candidates")
        i = self._next.get(key, 0) % n
        self._next[key] = i + 1
        return candidates[i]

    def forget(self, key: Hashable) -> None:
        """Drop the position of a group that no longer exists."""
        self._next.pop(key, None)

    def __len__(self) -> int:
        return len(self._next)


# ---------------------------------------------------------------------------- planning
def _route(plan: RoutingPlan, d: Delivery, session: SessionView | None) -> None:
    if session is None:
        plan.dropped += 1
        plan.dropped_clients.append(d.client_id)
        return
    if d.qos > 0 and session.persistent:
        if session.client_type == APPLICATION:
            plan.app.append(AppDelivery(d.client_id, app_topic_name(d.client_id), d.qos, d.retain,
                                        d.subscription_ids))
        else:
            plan.persisted.append(d)
        return
    if session.connected and session.service_id:
        lst = plan.live.get(session.service_id)
        if lst is None:
            plan.live[session.service_id] = [d]
        else:
            lst.append(d)
        return
    plan.dropped += 1
    plan.dropped_clients.append(d.client_id)


def plan_routing(
    publish: PublishInfo,
    matches: Iterable[tuple[str, Subscription]],
    sessions: SessionLookup,
    round_robin: RoundRobin | None = None,
) -> RoutingPlan:
    """Decide where copies of ``publish`` go. ``matches`` is ``SubscriptionTrie.match(topic)``.

    ``sessions``: a mapping or a callable ``client_id -> SessionView | None``.
    ``round_robin``: the router's long-lived ``RoundRobin`` (a fresh one if None).
    """
    lookup: Callable[[str], SessionView | None] = (
        sessions.get if isinstance(sessions, Mapping) else sessions  # type: ignore[assignment]
    )
    plan = RoutingPlan()
    pub_qos = publish.qos
    pub_retain = publish.retain
    publisher = publish.client_id
    merged: dict[str, list] = {}  # client -> [qos, rap, ids]
    groups: dict[tuple[str, str], list[Subscription]] = {}

    for topic_filter, sub in matches:
        # [MQTT-3.8.3-3] No Local: not forwarded to the publishing client. (Not allowed on shared
        # subscriptions [MQTT-3.8.3-4]; skipped there too should one slip through.)
        if sub.no_local and sub.client_id == publisher:
            plan.no_local_skipped += 1
            continue
        if sub.share_name:
            key = (sub.share_name, topic_filter)
            g = groups.get(key)
            if g is None:
                groups[key] = [sub]
            else:
                g.append(sub)
            continue
        m = merged.get(sub.client_id)
        sid = sub.subscription_id
        if m is None:
            merged[sub.client_id] = [sub.qos, sub.retain_as_published, [sid] if sid else None]
        else:
            if sub.qos > m[0]:
                m[0] = sub.qos
            if sub.retain_as_published:
                m[1] = True
            if sid:
                if m[2] is None:
                    m[2] = [sid]
                elif sid not in m[2]:
                    m[2].append(sid)

    for client_id, (qos, rap, ids) in merged.items():
        d = Delivery(
            client_id,
            qos if qos < pub_qos else pub_qos,  # QoS = min(publish, subscription)
            pub_retain and rap,  # [MQTT-3.3.1-12] RAP=0 -> 0; [MQTT-3.3.1-13] RAP=1 -> as published
            tuple(sorted(ids)) if ids else (),
        )
        _route(plan, d, lookup(client_id))

    if groups:
        _plan_shared(plan, publish, groups, lookup, round_robin if round_robin is not None else RoundRobin())
    return plan


def _plan_shared(
    plan: RoutingPlan,
    publish: PublishInfo,
    groups: dict[tuple[str, str], list[Subscription]],
    lookup: Callable[[str], SessionView | None],
    rr: RoundRobin,
) -> None:
    pub_qos = publish.qos
    pub_retain = publish.retain
    # APPLICATION parts, merged per filter (one Kafka topic per filter): filter -> [names, qos, rap, ids]
    app_parts: dict[str, list] = {}
    for (share_name, topic_filter), subs in groups.items():
        connected: list[tuple[Subscription, SessionView]] = []
        persistent: list[Subscription] = []
        has_device_part = False
        has_app_part = False
        for sub in subs:
            s = lookup(sub.client_id)
            if s is None:
                has_device_part = True  # a member without a session: nowhere to deliver
                continue
            if s.persistent and s.client_type == APPLICATION:
                part = app_parts.get(topic_filter)
                if part is None:
                    app_parts[topic_filter] = part = [[], 0, False, set()]
                if share_name not in part[0]:
                    part[0].append(share_name)
                if sub.qos > part[1]:
                    part[1] = sub.qos
                if sub.retain_as_published:
                    part[2] = True
                if sub.subscription_id:
                    part[3].add(sub.subscription_id)
                has_app_part = True
                continue
            has_device_part = True
            if s.connected and s.service_id:
                connected.append((sub, s))
            elif s.persistent:
                persistent.append(sub)
        if not has_device_part or (has_app_part and not connected and not persistent):
            # only APPLICATION members (or the rest have no session): the shared app copy covers it
            continue
        if connected:
            sub, s = rr.pick((share_name, topic_filter), connected)
            d = Delivery(sub.client_id, min(pub_qos, sub.qos), pub_retain and sub.retain_as_published,
                         (sub.subscription_id,) if sub.subscription_id else (), share_name, topic_filter)
            plan.shared_device.append(SharedDeviceChoice(share_name, topic_filter, client_id=sub.client_id))
            _route(plan, d, s)
            continue
        store = shared_store_id(share_name, topic_filter)
        qos = min(pub_qos, max((sub.qos for sub in persistent), default=0))
        if persistent and qos > 0:
            ids = tuple(sorted({sub.subscription_id for sub in persistent if sub.subscription_id}))
            rap = any(sub.retain_as_published for sub in persistent)
            plan.persisted.append(Delivery(store, qos, pub_retain and rap, ids, share_name, topic_filter))
            plan.shared_device.append(SharedDeviceChoice(share_name, topic_filter, store_id=store))
        else:
            plan.shared_device.append(SharedDeviceChoice(share_name, topic_filter))
            plan.dropped += 1
            plan.dropped_clients.append(store)

    for topic_filter, (names, qos, rap, ids) in app_parts.items():
        plan.shared_app.append(SharedAppCopy(
            topic_filter, shared_app_topic_name(topic_filter), tuple(names), min(pub_qos, qos),
            pub_retain and rap, tuple(sorted(ids))))
