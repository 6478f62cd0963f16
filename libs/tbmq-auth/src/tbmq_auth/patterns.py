"""The pattern rules a credential, a token and an HTTP answer share (tbmq_auth.rules, tokens, http). Pure.

* `check_pattern(p)`: a publish / subscribe pattern is an MQTT topic filter once `%c` (client id) and `%u`
  (user name) stand for a level; raises tbmq_routing.TopicError.
* `parse_acl(acl)`: an `acl` object `{"pub": [...], "sub": [...], "all": [...]}` (a token's claim, an HTTP
  answer's member) -> (publish, subscribe) patterns, `all` counting for both; raises ValueError.
* `client_id_allowed(pattern, client_id, username)`: a client-id pattern (shell-style `*`, `?`, `[...]`, `%u` =
  the user name) matches the client id.
"""

from __future__ import annotations

import fnmatch

from tbmq_routing import TopicError, validate_topic_filter


def check_pattern(pattern: str) -> None:
    validate_topic_filter(pattern.replace("%c", "c").replace("%u", "u"))


def parse_acl(acl) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if not isinstance(acl, dict) or not set(acl) <= {"pub", "sub", "all"}:
        raise ValueError('an object of "pub", "sub", "all" lists')
    lists = {}
    for kind in ("pub", "sub", "all"):
        filters = acl.get(kind, [])
        if not isinstance(filters, list) or not all(isinstance(f, str) for f in filters):
            raise ValueError(f"{kind!r} is not a list of topic filters")
        for f in filters:
            try:
                check_pattern(f)
            except TopicError as exc:
                raise ValueError(f"{f!r}: {exc}") from None
        lists[kind] = tuple(filters)
    return lists["pub"] + lists["all"], lists["sub"] + lists["all"]


def client_id_allowed(pattern: str, client_id: str, username: str) -> bool:
    return fnmatch.fnmatchcase(client_id, pattern.replace("%u", username))


__all__ = ["check_pattern", "client_id_allowed", "parse_acl"]
