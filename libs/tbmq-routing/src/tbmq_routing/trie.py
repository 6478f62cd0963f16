"""Subscription trie (router) and retained-message store (connector).

Both are plain, single-threaded data structures: no locks, no I/O. The owner (the router's
event loop, the connector's retained cache) serialises access.

Matching rules (MQTT 5.0 §4.7):

* levels are separated by ``/``; empty levels are real levels (``a//b`` has 3 levels, ``/a`` 2);
* ``+`` matches exactly one level (including an empty one);
* ``#`` matches any number of levels including zero, so ``a/#`` matches ``a`` (section 4.7.1.2);
* a filter whose first level is a wildcard does not match a topic starting with ``$``
  [MQTT-4.7.2-1] (``$SYS/#`` still matches ``$SYS/x``);
* no normalisation of names or filters [MQTT-4.7.3-4]: comparison is exact string equality.

Filters are stored *without* the ``$share/<name>/`` prefix; the share name lives in the
``Subscription``. Callers validate filters (``tbmq_routing.topics``) before adding them.

Memory: one node per distinct filter level (prefix-shared), level strings interned, nodes with
``__slots__`` and a shared read-only empty dict for "no children"/"no values", empty nodes pruned
on removal. Per subscription the trie keeps one ``(filter, Subscription)`` pair, referenced from the
node and from the per-client index (the filter string object is shared by all subscriptions of
the same filter).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

__all__ = ["Subscription", "SubscriptionTrie", "RetainedStore", "Match"]

_intern = sys.intern


@dataclass(frozen=True, slots=True)
class Subscription:
    """One client's subscription to one filter (the value stored in the trie).

    ``share_name``: '' when not shared. ``subscription_id``: 0 when none (v5 ids are 1..268435455).
    ``retain_handling``: 0 send retained on subscribe, 1 only if new, 2 never (connector concern).
    """

    client_id: str
    qos: int = 0
    share_name: str = ""
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    subscription_id: int = 0


#: A match result: (filter without ``$share/`` prefix, Subscription)
Match = tuple[str, Subscription]

# Shared, never-mutated empty dict used for "no children" so that leaf nodes do
# not each own an empty dict, and lookups in the hot path need no None checks.
_EMPTY: dict = {}


#: up to this many values a node keeps them in a tuple (cheap memory); above, in a dict index
_SMALL = 8


class _Node:
    __slots__ = ("children", "plus", "hash", "vals", "index")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = _EMPTY  # literal level -> node
        self.plus: _Node | None = None  # '+' child
        self.hash: _Node | None = None  # '#' child
        # The (filter, Subscription) pairs, directly extendable by match(): a tuple while there
        # are at most _SMALL of them, else the live values() view of ``index``.
        self.vals: Any = ()
        # None while small; else value key -> pair, where the key is client_id for non-shared
        # subscriptions and (share_name, client_id) for shared ones.
        self.index: dict[Any, Match] | None = None

    def is_empty(self) -> bool:
        return not self.vals and not self.children and self.plus is None and self.hash is None

    def find(self, client_id: str, share_name: str) -> int:
        """Position of the client's pair in the small tuple, or -1 (only when index is None)."""
        for i, (_f, sub) in enumerate(self.vals):
            if sub.client_id == client_id and sub.share_name == share_name:
                return i
        return -1

    def put(self, pair: Match) -> bool:
        """Insert or replace; True if new."""
        sub = pair[1]
        index = self.index
        if index is not None:
            vk = _vkey(sub.client_id, sub.share_name)
            is_new = vk not in index
            index[vk] = pair
            return is_new
        vals = self.vals
        i = self.find(sub.client_id, sub.share_name)
        if i >= 0:
            self.vals = vals[:i] + (pair,) + vals[i + 1:]
            return False
        if len(vals) < _SMALL:
            self.vals = vals + (pair,)
        else:
            self.index = index = {_vkey(s.client_id, s.share_name): (f, s) for f, s in vals}
            index[_vkey(sub.client_id, sub.share_name)] = pair
            self.vals = index.values()
        return True

    def pop(self, client_id: str, share_name: str) -> bool:
        """Remove; False if absent."""
        index = self.index
        if index is not None:
            if index.pop(_vkey(client_id, share_name), None) is None:
                return False
            if len(index) <= _SMALL // 2:  # hysteresis: back to the tuple form
                self.vals = tuple(index.values())
                self.index = None
            return True
        i = self.find(client_id, share_name)
        if i < 0:
            return False
        vals = self.vals
        self.vals = vals[:i] + vals[i + 1:]
        return True


def _vkey(client_id: str, share_name: str) -> Any:
    return (share_name, client_id) if share_name else client_id


def _ckey(topic_filter: str, share_name: str) -> Any:
    # key of a subscription in its client's index
    return (share_name, topic_filter) if share_name else topic_filter


class SubscriptionTrie:
    """Topic-filter trie. Values: one ``Subscription`` per (client_id, share_name) per filter.

    ``match(topic)`` returns every ``(filter, Subscription)`` whose filter matches ``topic``; a
    client may appear several times (several filters, or shared and non-shared) -- merging is
    ``tbmq_routing.rules``' job.
    """

    __slots__ = ("_root", "_clients", "_size", "_nodes", "_filters")

    def __init__(self) -> None:
        self._root = _Node()
        # client_id -> its single pair, or dict ckey -> pair when it has several subscriptions
        self._clients: dict[str, Match | dict[Any, Match]] = {}
        self._size = 0  # subscriptions
        self._nodes = 0  # nodes excluding the root
        self._filters = 0  # nodes holding at least one subscription

    # ------------------------------------------------------------------ counts
    def __len__(self) -> int:
        """Number of stored subscriptions."""
        return self._size

    @property
    def node_count(self) -> int:
        """Trie nodes, excluding the root (0 when empty)."""
        return self._nodes

    @property
    def filter_count(self) -> int:
        """Distinct filters (nodes) that hold at least one subscription."""
        return self._filters

    @property
    def client_count(self) -> int:
        """Clients with at least one subscription."""
        return len(self._clients)

    def stats(self) -> dict[str, int]:
        return {"subscriptions": self._size, "clients": len(self._clients),
                "filters": self._filters, "nodes": self._nodes}

    # ------------------------------------------------------------------ reads
    def subscriptions_of(self, client_id: str) -> list[Match]:
        """The client's current subscriptions as (filter, Subscription) pairs."""
        entry = self._clients.get(client_id)
        if entry is None:
            return []
        if type(entry) is tuple:
            return [entry]
        return list(entry.values())  # type: ignore[union-attr]

    def get(self, topic_filter: str, client_id: str, share_name: str = "") -> Subscription | None:
        entry = self._clients.get(client_id)
        if entry is None:
            return None
        ck = _ckey(topic_filter, share_name)
        if type(entry) is tuple:
            f, sub = entry  # type: ignore[misc]
            return sub if _ckey(f, sub.share_name) == ck else None
        pair = entry.get(ck)  # type: ignore[union-attr]
        return None if pair is None else pair[1]

    def clients(self) -> Iterator[str]:
        return iter(self._clients)

    def __iter__(self) -> Iterator[Match]:
        """Every (filter, Subscription), grouped by client."""
        for entry in self._clients.values():
            if type(entry) is tuple:
                yield entry  # type: ignore[misc]
            else:
                yield from entry.values()  # type: ignore[union-attr]

    def match(self, topic: str) -> list[Match]:
        """All (filter, Subscription) whose filter matches the topic name ``topic``."""
        out: list[Match] = []
        levels = topic.split("/")
        if topic[:1] == "$":
            # [MQTT-4.7.2-1] no wildcard match in the first level of a '$' topic.
            node = self._root.children.get(levels[0])
            if node is None:
                return out
            if len(levels) == 1:
                if node.vals:
                    out.extend(node.vals)
                h = node.hash
                if h is not None:
                    out.extend(h.vals)
                return out
            nodes = [node]
            levels = levels[1:]
        else:
            nodes = [self._root]
        extend = out.extend
        for lvl in levels:
            if len(nodes) == 1:
                # fast path: the common case of a single live branch
                n = nodes[0]
                h = n.hash
                if h is not None:
                    extend(h.vals)
                c = n.children.get(lvl)
                p = n.plus
                if c is None:
                    if p is None:
                        return out
                    nodes = [p]
                elif p is None:
                    nodes = [c]
                else:
                    nodes = [c, p]
                continue
            nxt = []
            append = nxt.append
            for n in nodes:
                h = n.hash
                if h is not None:
                    extend(h.vals)
                c = n.children.get(lvl)
                if c is not None:
                    append(c)
                p = n.plus
                if p is not None:
                    append(p)
            if not nxt:
                return out
            nodes = nxt
        for n in nodes:
            v = n.vals
            if v:
                extend(v)
            h = n.hash
            if h is not None:
                # 'a/#' matches 'a'
                extend(h.vals)
        return out

    # ------------------------------------------------------------------ writes
    def add(self, topic_filter: str, sub: Subscription) -> bool:
        """Add or replace ``sub`` at ``topic_filter`` (keyed by client_id, share_name).

        Returns True if it is new, False if it replaced an existing subscription.
        """
        node = self._root
        for lvl in topic_filter.split("/"):
            if lvl == "+":
                nxt = node.plus
                if nxt is None:
                    node.plus = nxt = _Node()
                    self._nodes += 1
            elif lvl == "#":
                nxt = node.hash
                if nxt is None:
                    node.hash = nxt = _Node()
                    self._nodes += 1
            else:
                ch = node.children
                nxt = ch.get(lvl)
                if nxt is None:
                    if ch is _EMPTY:
                        node.children = ch = {}
                    ch[_intern(lvl)] = nxt = _Node()
                    self._nodes += 1
            node = nxt
        vals = node.vals
        if vals:
            canonical = next(iter(vals))[0]  # share one filter string per node
        else:
            self._filters += 1
            canonical = topic_filter
        client_id = sub.client_id
        share_name = sub.share_name
        pair = (canonical, sub)
        is_new = node.put(pair)
        # client index
        clients = self._clients
        entry = clients.get(client_id)
        ck = _ckey(canonical, share_name)
        if entry is None:
            clients[client_id] = pair
        elif type(entry) is tuple:
            old_ck = _ckey(entry[0], entry[1].share_name)  # type: ignore[index,union-attr]
            if old_ck == ck:
                clients[client_id] = pair
            else:
                clients[client_id] = {old_ck: entry, ck: pair}
        else:
            entry[ck] = pair  # type: ignore[index]
        if is_new:
            self._size += 1
        return is_new

    def remove(self, topic_filter: str, client_id: str, share_name: str = "") -> bool:
        """Remove one subscription; prunes nodes left empty. Returns False if it was absent."""
        if not self._remove_from_trie(topic_filter, client_id, share_name):
            return False
        clients = self._clients
        entry = clients[client_id]
        if type(entry) is tuple:
            del clients[client_id]
            if not clients:
                self._clients = {}  # release the dict's peak capacity
        else:
            del entry[_ckey(topic_filter, share_name)]  # type: ignore[union-attr]
            if len(entry) == 1:  # back to the compact single-pair form
                clients[client_id] = next(iter(entry.values()))  # type: ignore[union-attr]
        return True

    def remove_client(self, client_id: str) -> int:
        """Remove every subscription of ``client_id``; returns how many were removed."""
        entry = self._clients.pop(client_id, None)
        if entry is None:
            return 0
        if not self._clients:
            self._clients = {}  # release the dict's peak capacity
        pairs = [entry] if type(entry) is tuple else list(entry.values())  # type: ignore[union-attr]
        for f, sub in pairs:  # type: ignore[misc]
            self._remove_from_trie(f, client_id, sub.share_name)
        return len(pairs)

    def replace_client(self, client_id: str, subs: Iterable[tuple[str, Subscription]]) -> tuple[int, int]:
        """Make ``subs`` the client's WHOLE subscription set (a ``tbmq.client.subscriptions`` record).

        Only the difference is applied: subscriptions no longer present are removed, new or
        changed ones are added, unchanged ones are left alone. An empty ``subs`` removes the
        client. Every Subscription must carry ``client_id``. If the same (filter, share name)
        appears twice the last one wins. Returns (added_or_changed, removed).
        """
        new: dict[Any, tuple[str, Subscription]] = {}
        for f, sub in subs:
            if sub.client_id != client_id:
                raise ValueError(f"subscription of {sub.client_id!r} in the set of {client_id!r}")
            new[_ckey(f, sub.share_name)] = (f, sub)
        old_entry = self._clients.get(client_id)
        if old_entry is None:
            old: dict[Any, Match] = {}
        elif type(old_entry) is tuple:
            old = {_ckey(old_entry[0], old_entry[1].share_name): old_entry}  # type: ignore[index,union-attr,dict-item]
        else:
            old = dict(old_entry)  # type: ignore[arg-type]
        removed = 0
        for ck, (f, sub) in old.items():
            if ck not in new:
                self.remove(f, client_id, sub.share_name)
                removed += 1
        changed = 0
        for ck, (f, sub) in new.items():
            prev = old.get(ck)
            if prev is not None and prev[1] == sub:
                continue
            self.add(f, sub)
            changed += 1
        return changed, removed

    def clear(self) -> None:
        self._root = _Node()
        self._clients = {}
        self._size = self._nodes = self._filters = 0

    # ------------------------------------------------------------------ internals
    def _remove_from_trie(self, topic_filter: str, client_id: str, share_name: str) -> bool:
        node = self._root
        path: list[tuple[_Node, str]] = []  # (parent, level) for every node below the root
        for lvl in topic_filter.split("/"):
            if lvl == "+":
                nxt = node.plus
            elif lvl == "#":
                nxt = node.hash
            else:
                nxt = node.children.get(lvl)
            if nxt is None:
                return False
            path.append((node, lvl))
            node = nxt
        if not node.pop(client_id, share_name):
            return False
        self._size -= 1
        if node.vals:
            return True
        self._filters -= 1
        # prune empty nodes bottom-up
        for parent, lvl in reversed(path):
            if not node.is_empty():
                break
            if lvl == "+":
                parent.plus = None
            elif lvl == "#":
                parent.hash = None
            else:
                ch = parent.children
                del ch[lvl]
                if not ch:
                    parent.children = _EMPTY
            self._nodes -= 1
            node = parent
        return True


_NOVAL = object()


class _RNode:
    __slots__ = ("children", "value")

    def __init__(self) -> None:
        self.children: dict[str, _RNode] = _EMPTY
        self.value: Any = _NOVAL


class RetainedStore:
    """Retained messages by topic name; ``match_filter`` finds those a new subscription receives.

    Values are opaque (e.g. the ``RetainedMsgProto``). Topics are topic *names* (no wildcards).
    Note: retained messages are not sent when a shared subscription is established (MQTT 5.0
    §4.8.2): the connector calls ``match_filter`` for non-shared subscriptions only, honouring
    Retain Handling.
    """

    __slots__ = ("_root", "_size", "_nodes")

    def __init__(self) -> None:
        self._root = _RNode()
        self._size = 0
        self._nodes = 0

    def __len__(self) -> int:
        return self._size

    @property
    def node_count(self) -> int:
        return self._nodes

    def set(self, topic: str, value: Any) -> bool:
        """Store (or replace) the retained value of ``topic``; True if the topic was new."""
        node = self._root
        for lvl in topic.split("/"):
            ch = node.children
            nxt = ch.get(lvl)
            if nxt is None:
                if ch is _EMPTY:
                    node.children = ch = {}
                ch[_intern(lvl)] = nxt = _RNode()
                self._nodes += 1
            node = nxt
        is_new = node.value is _NOVAL
        node.value = value
        if is_new:
            self._size += 1
        return is_new

    def get(self, topic: str, default: Any = None) -> Any:
        node: _RNode | None = self._root
        for lvl in topic.split("/"):
            node = node.children.get(lvl)  # type: ignore[union-attr]
            if node is None:
                return default
        return default if node.value is _NOVAL else node.value  # type: ignore[union-attr]

    def __contains__(self, topic: str) -> bool:
        return self.get(topic, _NOVAL) is not _NOVAL

    def delete(self, topic: str) -> bool:
        """Remove the retained value of ``topic`` (pruning empty nodes); False if there was none."""
        node = self._root
        path: list[tuple[_RNode, str]] = []
        for lvl in topic.split("/"):
            nxt = node.children.get(lvl)
            if nxt is None:
                return False
            path.append((node, lvl))
            node = nxt
        if node.value is _NOVAL:
            return False
        node.value = _NOVAL
        self._size -= 1
        for parent, lvl in reversed(path):
            if node.value is not _NOVAL or node.children:
                break
            ch = parent.children
            del ch[lvl]
            if not ch:
                parent.children = _EMPTY
            self._nodes -= 1
            node = parent
        return True

    def clear(self) -> None:
        self._root = _RNode()
        self._size = self._nodes = 0

    def items(self) -> Iterator[tuple[str, Any]]:
        """Every (topic, value)."""
        stack: list[tuple[_RNode, str | None]] = [(self._root, None)]
        while stack:
            node, topic = stack.pop()
            if topic is not None and node.value is not _NOVAL:
                yield topic, node.value
            for lvl, child in node.children.items():
                stack.append((child, lvl if topic is None else f"{topic}/{lvl}"))

    def match_filter(self, topic_filter: str) -> list[Any]:
        """Values of every stored topic matched by the (non-shared, valid) ``topic_filter``."""
        out: list[Any] = []
        levels = topic_filter.split("/")
        nodes = [self._root]
        first = True
        for lvl in levels:
            if lvl == "#":
                for n in nodes:
                    if not first and n.value is not _NOVAL:
                        out.append(n.value)  # 'a/#' matches 'a'
                    if first:
                        # [MQTT-4.7.2-1] '#' as first level does not match '$' topics
                        stack = [c for k, c in n.children.items() if k[:1] != "$"]
                    else:
                        stack = list(n.children.values())
                    while stack:
                        m = stack.pop()
                        if m.value is not _NOVAL:
                            out.append(m.value)
                        if m.children:
                            stack.extend(m.children.values())
                return out
            if lvl == "+":
                if first:
                    # [MQTT-4.7.2-1] '+' as first level does not match '$' topics
                    nxt = [c for k, c in self._root.children.items() if k[:1] != "$"]
                else:
                    nxt = [c for n in nodes for c in n.children.values()]
            else:
                nxt = [c for n in nodes if (c := n.children.get(lvl)) is not None]
            if not nxt:
                return out
            nodes = nxt
            first = False
        for n in nodes:
            if n.value is not _NOVAL:
                out.append(n.value)
        return out
