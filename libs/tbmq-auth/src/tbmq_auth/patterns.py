"""The pattern rules a credential and a token share (tbmq_auth.rules, tbmq_auth.tokens). Pure.

* `check_pattern(p)`: a publish / subscribe pattern is an MQTT topic filter once `%c` (client id) and `%u`
  (user name) stand for a level; raises tbmq_routing.TopicError.
* `client_id_allowed(pattern, client_id, username)`: a client-id pattern (shell-style `*`, `?`, `[...]`, `%u` =
  the user name) matches the client id.
"""

from __future__ import annotations

import fnmatch

from tbmq_routing import validate_topic_filter


def check_pattern(pattern: str) -> None:
    validate_topic_filter(pattern.replace("%c", "c").replace("%u", "u"))


def client_id_allowed(pattern: str, client_id: str, username: str) -> bool:
    return fnmatch.fnmatchcase(client_id, pattern.replace("%u", username))


__all__ = ["check_pattern", "client_id_allowed"]
