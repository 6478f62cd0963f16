"""The `http` authentication provider: an HTTP service of the operator's decides who connects and with which
rights (as EMQX's HTTP authenticator). Pure: what is asked and how an answer reads; the connector does the I/O.

The connector POSTs `request_body(req)` as JSON to MQTT_AUTH_HTTP_URL:
    {"clientid": ..., "username": ... | null, "password": ... | null, "peerhost": ..., "cert_names": [...]}
(`password` is the CONNECT's password as UTF-8 text; one that is not UTF-8 comes as `password_base64`).

The answer (`parse_answer(status, body)`):
* 200 with a JSON object `{"result": "allow" | "deny" | "ignore", ...}`:
  - `allow`: connected. `acl` (optional) `{"pub": [...], "sub": [...], "all": [...]}` (topic filters with
    `%c` / `%u`, as a credential's patterns) then decides PUBLISH and SUBSCRIBE; without `acl`, every right.
    `username` (optional) is what `%u` stands for (default: the CONNECT's); `expire_at` (optional, seconds
    since the epoch) ends the connection then, as a token's `exp` does (one already passed refuses it, 0x86).
  - `deny`: refused, 0x86 Bad user name or password (3.x: 4).
  - `ignore`: the next provider decides.
* 204 No Content: `allow` with every right.
* anything else (another status, a body that is not such an object, a timeout, the service unreachable):
  refused with 0x88 Server unavailable (3.x: 3), so the client retries later; never passed to the next
  provider, which could be `anonymous` (fail closed; EMQX passes an error on as `ignore`).

`AnswerCache` keeps the service's allow / deny / ignore answers for a while (MQTT_AUTH_HTTP_CACHE_S), by the
SHA-256 of the question (the password is part of the question and is not kept), so a fleet reconnecting at
once after an outage asks the service once per device and credential, not at every retry. An error is
never kept.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass

from .kept import Kept
from .patterns import parse_acl

HTTP = "http"
ALLOW, DENY, IGNORE, ERROR = "allow", "deny", "ignore", "error"


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    """What the service answered: `result` (allow, deny, ignore, or error: no usable answer), the rights of an
    `allow` (`pub` / `sub`; None: every right), the user name `%u` stands for (None: the CONNECT's) and when
    the connection ends (ms since the epoch; None: never), and `reason` for the log and the CONNACK."""

    result: str
    pub: tuple[str, ...] | None = None
    sub: tuple[str, ...] | None = None
    username: str | None = None
    expires_at_ms: int | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HttpCheck:
    """`Authorizer.authenticate`'s question when it reaches the `http` provider: the caller asks the service
    (`request_body`), then calls `authenticate` again with the `HttpAnswer`."""

    body: dict


def request_body(client_id: str, username: str | None, password: bytes | None, ip: str,
                 cert_names: tuple[str, ...]) -> dict:
    body = {"clientid": client_id, "username": username, "password": None, "peerhost": ip,
            "cert_names": list(cert_names)}
    if password is not None:
        try:
            body["password"] = password.decode("utf-8")
        except UnicodeDecodeError:
            body["password_base64"] = base64.b64encode(password).decode("ascii")
    return body


def error(reason: str) -> HttpAnswer:
    return HttpAnswer(ERROR, reason=reason)


def parse_answer(status: int, body: bytes) -> HttpAnswer:
    if status == 204:
        return HttpAnswer(ALLOW)
    if status != 200:
        return error(f"the authentication service answered HTTP {status}")
    try:
        doc = json.loads(body)
    except ValueError:
        return error("the authentication service's answer is not JSON")
    if not isinstance(doc, dict) or doc.get("result") not in (ALLOW, DENY, IGNORE):
        return error('the authentication service\'s answer has no "result" of allow, deny or ignore')
    result = doc["result"]
    if result != ALLOW:
        return HttpAnswer(result, reason=str(doc.get("reason", ""))[:200])
    username, expire_at = doc.get("username"), doc.get("expire_at")
    if username is not None and not isinstance(username, str):
        return error('the authentication service\'s "username" is not a string')
    if expire_at is not None and (isinstance(expire_at, bool) or not isinstance(expire_at, int | float)):
        return error('the authentication service\'s "expire_at" is not a number (seconds since the epoch)')
    acl = doc.get("acl")
    if acl is None:
        return HttpAnswer(ALLOW, username=username, expires_at_ms=_ms(expire_at))
    try:
        pub, sub = parse_acl(acl)
    except ValueError as exc:
        return error(f"the authentication service's acl: {exc}")
    return HttpAnswer(ALLOW, pub, sub, username, _ms(expire_at))


class AnswerCache(Kept[HttpAnswer]):
    """Answers by question for `ttl_s` (seconds on the clock passed in), at most `max_entries` (the oldest
    dropped first: about 200 bytes each); an error is never kept (tbmq_auth.kept.Kept)."""

    def __init__(self, ttl_s: float, max_entries: int = 100_000) -> None:
        super().__init__(ttl_s, max_entries)

    @staticmethod
    def key(body: dict) -> bytes:
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).digest()

    def put(self, key: bytes, answer: HttpAnswer, now: float) -> None:
        if answer.result != ERROR:
            super().put(key, answer, now)


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1000)


__all__ = ["ALLOW", "DENY", "ERROR", "HTTP", "IGNORE", "AnswerCache", "HttpAnswer", "HttpCheck", "error",
           "parse_answer", "request_body"]
