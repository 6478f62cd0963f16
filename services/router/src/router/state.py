"""The router's state and its routing step (no Faust, no Kafka: unit-testable).

``RoutingState`` holds every subscription (trie) and every session view; it is fed by the two
compacted topics. ``RoutingState.route`` turns one tbmq.msg.all record into the records to produce.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform.marks import is_mark
from tbmq_routing.rules import PublishInfo, RoundRobin, SessionView, plan_routing
from tbmq_routing.trie import SubscriptionTrie

from .convert import OutRecord, is_expired, plan_records, session_from_record, subscriptions_from_record

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Routed:
    records: list[OutRecord]
    msg: pb.PublishMsg | None = None
    expired: bool = False
    dropped: int = 0  # copies not delivered (offline non-persistent subscribers, ...)


@dataclass
class RoutingState:
    trie: SubscriptionTrie = field(default_factory=SubscriptionTrie)
    sessions: dict[str, SessionView] = field(default_factory=dict)
    round_robin: RoundRobin = field(default_factory=RoundRobin)
    counters: Counter = field(default_factory=Counter)

    # -- state topics ---------------------------------------------------------------------------
    def apply_subscriptions(self, key: bytes | None, value: bytes | None) -> None:
        client_id, pairs = subscriptions_from_record(key, value)
        if pairs:
            self.trie.replace_client(client_id, pairs)
        else:
            self.trie.remove_client(client_id)
        self.counters["subscription_records"] += 1

    def apply_session(self, key: bytes | None, value: bytes | None) -> None:
        if key is None:
            return
        client_id = key.decode("utf-8")
        view = session_from_record(value)
        if view is None:
            self.sessions.pop(client_id, None)
        else:
            self.sessions[client_id] = view
        self.counters["session_records"] += 1

    # -- routing --------------------------------------------------------------------------------
    def route(self, key: bytes | None, value: bytes | None, now_ms: int | None = None,
              origin: tuple[int, int] | None = None) -> Routed:
        """Route one tbmq.msg.all record; ``origin`` = its (partition, offset), carried by every
        PersistedMsg (convert.plan_records)."""
        if not value:  # a subscription mark (tbmq_platform.marks: the runtime's barrier) or an empty record
            self.counters["marks" if is_mark(value) else "empty"] += 1
            return Routed([])
        msg = pb.PublishMsg.FromString(value)
        if now_ms is None:
            now_ms = int(time.time() * 1000)
        if is_expired(msg, now_ms):
            self.counters["expired"] += 1
            return Routed([], msg, expired=True)
        plan = plan_routing(PublishInfo(msg.publisher_id, msg.topic, msg.qos, msg.retain),
                            self.trie.match(msg.topic), self.sessions.get, self.round_robin)
        records = plan_records(msg, plan, key or None, value, origin)
        self.counters["routed"] += 1
        self.counters["records"] += len(records)
        self.counters["dropped_copies"] += plan.dropped
        return Routed(records, msg, dropped=plan.dropped)

    def stats(self) -> dict:
        return {"subscriptions": len(self.trie), "clients": self.trie.client_count,
                "sessions": len(self.sessions), **self.counters}
