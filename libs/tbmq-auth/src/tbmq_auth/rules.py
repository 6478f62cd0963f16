"""Authentication and authorization decisions. Pure: no I/O, no clock (the time is passed in).

* Records: a `Credential` (key = its name, the username) on `tbmq.security.credentials` and a `BlockedRule`
  (key = "<kind>:<value>") on `tbmq.security.blocked`, both JSON; `AuthTables` applies them as a compacted
  topic's records arrive (a null value deletes).
* `Authorizer.authenticate(request, now_ms)`: blocked rules first (0x8A Banned), then the providers in the
  configured order (`password`, `x509`, `jwt`: tbmq_auth.tokens, `http`: tbmq_auth.http, `anonymous`), then
  the credential's client-id pattern and the Will (a publish): 0x87 Not authorized. Refused with no provider
  accepting: 0x86 when a username was sent, else 0x87. Reaching `http`, it returns an `HttpCheck` instead of
  a result: the caller asks the service and calls it again with the `HttpAnswer` (decided, then applied).
* `Authorizer.may_publish` / `may_subscribe`: the credential's publish / subscribe patterns (MQTT topic
  filters; `%c` = client id, `%u` = username), looked up by name at every call, so a changed credential
  applies to the next PUBLISH / SUBSCRIBE of a connected client; a token's (and an HTTP answer's) patterns
  travel in its `Identity`.
  Anonymous clients may publish and subscribe to everything.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tbmq_mqtt import ReasonCode
from tbmq_routing import TopicError, filter_covers, topic_matches

from .passwords import STANDARD, hash_password, verify_password
from .patterns import check_pattern, client_id_allowed
from .http import ALLOW, DENY, HTTP, IGNORE, HttpAnswer, HttpCheck, request_body
from .tokens import JWT, JwtVerifier, PendingKeys, TokenRefused, looks_like_jwt, revoked_until_ms

log = logging.getLogger("tbmq_auth")

PASSWORD, X509, ANONYMOUS = "password", "x509", "anonymous"
PROVIDERS = (PASSWORD, X509, JWT, HTTP, ANONYMOUS)
DEFAULT_PROVIDERS = (PASSWORD, X509, ANONYMOUS)

CLIENT_ID, USERNAME, IP, REGEX = "client_id", "username", "ip", "regex"
BLOCK_KINDS = (CLIENT_ID, USERNAME, IP, REGEX)
REGEX_TARGETS = (CLIENT_ID, USERNAME, IP)

_SUBST_FORBIDDEN = ("/", "+", "#")


# ============================================================================================== records
@dataclass(frozen=True, slots=True)
class Credential:
    """One client identity and its rights. `password_hash` is an argon2id PHC string (None: no password
    login); `cert_cn` matches a client certificate's CN or one of its SANs; `client_id` is a pattern
    (shell-style `*`, `?`, `[...]`, `%u` = the username) the client id must match (None: any)."""

    name: str
    password_hash: str | None = None
    client_id: str | None = None
    cert_cn: str | None = None
    pub: tuple[str, ...] = ()
    sub: tuple[str, ...] = ()

    @property
    def username(self) -> str:
        return self.name

    def to_json(self) -> bytes:
        return json.dumps({"username": self.name, "password_hash": self.password_hash,
                           "client_id": self.client_id, "cert_cn": self.cert_cn,
                           "pub": list(self.pub), "sub": list(self.sub)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, name: str, value: bytes) -> Credential:
        d = json.loads(value)
        return cls(name=name, password_hash=d.get("password_hash"), client_id=d.get("client_id") or None,
                   cert_cn=d.get("cert_cn") or None, pub=tuple(d.get("pub") or ()), sub=tuple(d.get("sub") or ()))

    def public(self) -> dict:
        """What `tbmq credentials list` shows: everything but the hash."""
        return {"username": self.name, "password": self.password_hash is not None, "client_id": self.client_id,
                "cert_cn": self.cert_cn, "pub": list(self.pub), "sub": list(self.sub)}


def make_credential(username: str, password: str | None, *, client_id: str | None = None,
                    cert_cn: str | None = None, pub: Iterable[str] = (), sub: Iterable[str] = (),
                    hash_cost: str = STANDARD, hasher: Callable[[str, str], str] = hash_password) -> Credential:
    """A new credential as an operator asks for it (the `tbmq` command line and the admin API both): every
    pattern a topic filter (with `%c` / `%u`), a password or a certificate name, the password hashed (argon2id,
    at `hash_cost`: tbmq_auth.passwords.HASH_COSTS). ValueError says what is wrong."""
    pub, sub = tuple(pub), tuple(sub)
    if not username:
        raise ValueError("a credential needs a username")
    for f in (*pub, *sub):
        try:
            check_pattern(f)
        except TopicError as exc:
            raise ValueError(f"{f!r}: not a topic filter ({exc})") from None
    if password is None and not cert_cn:
        raise ValueError("a credential needs a password or a certificate name (or both)")
    if password is not None and not password:
        raise ValueError("empty password")
    return Credential(name=username, password_hash=hasher(password, hash_cost) if password is not None else None,
                      client_id=client_id or None, cert_cn=cert_cn or None, pub=pub, sub=sub)


@dataclass(frozen=True, slots=True)
class BlockedRule:
    """A client refused before authentication (CONNACK 0x8A Banned / 3.x return code 5). `kind` client_id,
    username or ip (an address or a network, e.g. 10.0.0.0/8) compare with the value; regex matches the
    whole of `target` (client_id, username or ip). `expires_at_ms` None = for good."""

    kind: str
    value: str
    target: str = CLIENT_ID
    expires_at_ms: int | None = None
    reason: str = ""
    _compiled: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_KINDS:
            raise ValueError(f"unknown blocked kind {self.kind!r}; known: {', '.join(BLOCK_KINDS)}")
        if self.kind == REGEX:
            if self.target not in REGEX_TARGETS:
                raise ValueError(f"unknown regex target {self.target!r}; known: {', '.join(REGEX_TARGETS)}")
            try:
                object.__setattr__(self, "_compiled", re.compile(self.value))
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        elif self.kind == IP:
            object.__setattr__(self, "_compiled", ipaddress.ip_network(self.value, strict=False))

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.value}" if self.kind != REGEX else f"regex:{self.target}:{self.value}"

    def active(self, now_ms: int) -> bool:
        return self.expires_at_ms is None or now_ms < self.expires_at_ms

    def matches(self, client_id: str, username: str | None, ip: str, now_ms: int) -> bool:
        if not self.active(now_ms):
            return False
        kind = self.kind
        if kind == CLIENT_ID:
            return client_id == self.value
        if kind == USERNAME:
            return username is not None and username == self.value
        if kind == IP:
            addr = _ip(ip)
            return addr is not None and addr in self._compiled
        subject = {CLIENT_ID: client_id, USERNAME: username, IP: ip}[self.target]
        return subject is not None and self._compiled.fullmatch(subject) is not None

    def to_json(self) -> bytes:
        return json.dumps({"kind": self.kind, "value": self.value, "target": self.target,
                           "expires_at_ms": self.expires_at_ms, "reason": self.reason}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, value: bytes) -> BlockedRule:
        d = json.loads(value)
        return cls(kind=d["kind"], value=d["value"], target=d.get("target") or CLIENT_ID,
                   expires_at_ms=d.get("expires_at_ms"), reason=d.get("reason") or "")


def _ip(ip: str):
    try:
        return ipaddress.ip_address(ip)
    except ValueError:
        return None


class AuthTables:
    """The credentials and blocked rules as the compacted topics hold them (`apply_*` = CompactedViews'
    apply callbacks). Lookups are dict reads; the blocked rules are replaced, never mutated, so a reader in
    another thread always iterates a complete table."""

    def __init__(self) -> None:
        self.credentials: dict[str, Credential] = {}
        self.by_cert_name: dict[str, str] = {}   # cert CN / SAN -> credential name
        self.blocked: dict[str, BlockedRule] = {}
        self.revoked_tokens: dict[str, int] = {}  # jti -> until when it matters (the token's exp), ms

    def apply_credential(self, key: bytes, value: bytes | None) -> None:
        name = key.decode()
        old = self.credentials.pop(name, None)
        if old is not None and old.cert_cn and self.by_cert_name.get(old.cert_cn) == name:
            del self.by_cert_name[old.cert_cn]
        if value is None:
            return
        try:
            cred = Credential.from_json(name, value)
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("credential %r: unreadable record ignored (%s)", name, exc)
            return
        self.credentials[name] = cred
        if cred.cert_cn:
            self.by_cert_name[cred.cert_cn] = name

    def apply_blocked(self, key: bytes, value: bytes | None) -> None:
        table = dict(self.blocked)
        k = key.decode()
        table.pop(k, None)
        if value is not None:
            try:
                table[k] = BlockedRule.from_json(value)
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("blocked rule %r: unreadable record ignored (%s)", k, exc)
        self.blocked = table

    def apply_revoked_token(self, key: bytes, value: bytes | None, now_ms: int) -> bool:
        """A record of tbmq.security.tokens.revoked (key: the token's jti; value: its exp, tokens.revocation_value;
        null: the revocation withdrawn). One whose token has expired is not kept (the token is refused as
        expired anyway), so the table holds only revocations that still matter. Whether the token is now
        revoked."""
        jti = key.decode()
        self.revoked_tokens.pop(jti, None)
        if value is None:
            return False
        try:
            until = revoked_until_ms(value)
        except ValueError as exc:
            log.warning("revoked token %r: unreadable record ignored (%s)", jti, exc)
            return False
        if until <= now_ms:
            return False
        self.revoked_tokens[jti] = until
        return True

    def token_revoked(self, jti: str | None) -> bool:
        return jti is not None and jti in self.revoked_tokens

    def blocked_by(self, client_id: str, username: str | None, ip: str, now_ms: int) -> BlockedRule | None:
        for rule in self.blocked.values():
            if rule.matches(client_id, username, ip, now_ms):
                return rule
        return None


# ============================================================================================== decisions
@dataclass(frozen=True, slots=True)
class AuthRequest:
    """What a CONNECT (and its transport) present: `cert_names` = the verified client certificate's subject
    CN and subjectAltName values (empty without one)."""

    client_id: str
    username: str | None = None
    password: bytes | None = None
    ip: str = ""
    cert_names: tuple[str, ...] = ()
    will_topic: str | None = None


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a connection is: `provider` that accepted it, `credential` name (None: anonymous, a token or an HTTP
    answer) and the username `%u` stands for. With `carries_patterns` (a token of provider `jwt`, an `http`
    answer with an acl) its own `pub` / `sub` patterns decide; it stops being valid at `expires_at_ms`. A
    token's `key_thumbprint`: the RFC 7638 thumbprint of the JWK Set key that verified it (its connection ends
    when no key of the set has it any more)."""

    provider: str
    credential: str | None
    username: str
    pub: tuple[str, ...] = ()
    sub: tuple[str, ...] = ()
    expires_at_ms: int | None = None
    carries_patterns: bool = False
    key_thumbprint: str | None = None
    token_id: str | None = None  # a token's jti: its connection ends when the token is revoked

    @property
    def restricted(self) -> bool:
        """Patterns decide what it may do (a credential's or its own; not anonymous clients, nor an `http`
        answer without an acl)."""
        return self.credential is not None or self.carries_patterns


@dataclass(frozen=True, slots=True)
class AuthResult:
    reason_code: int                   # ReasonCode.SUCCESS or the CONNACK refusal
    reason: str = ""
    identity: Identity | None = None

    @property
    def ok(self) -> bool:
        return self.reason_code == ReasonCode.SUCCESS



def anonymous_default(bind_hosts: Iterable[str]) -> bool:
    """MQTT_ALLOW_ANONYMOUS when unset: true only when every MQTT listener binds a loopback address (as
    Mosquitto 2 does without a configuration)."""
    hosts = list(bind_hosts)
    return bool(hosts) and all(_loopback(h) for h in hosts)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    addr = _ip(host.strip("[]"))
    return addr is not None and addr.is_loopback


def parse_providers(raw: str) -> tuple[str, ...]:
    """MQTT_AUTH_PROVIDERS: a comma list of password, x509, jwt, http, anonymous (order = the order they are
    tried)."""
    names = tuple(p.strip().lower() for p in raw.split(",") if p.strip())
    bad = [p for p in names if p not in PROVIDERS]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"{raw!r}: a comma list of distinct {', '.join(PROVIDERS)}")
    return names


def substitute(pattern: str, client_id: str, username: str) -> str | None:
    """`%c` → client id, `%u` → username; None when a value used would change the pattern's levels or
    wildcards ('/', '+', '#' in it) or is empty: such a pattern grants nothing."""
    if "%" not in pattern:
        return pattern
    for token, value in (("%c", client_id), ("%u", username)):
        if token in pattern:
            if not value or any(ch in value for ch in _SUBST_FORBIDDEN):
                return None
            pattern = pattern.replace(token, value)
    return pattern


class Authorizer:
    """The decisions of one connector, over its `AuthTables`."""

    def __init__(self, tables: AuthTables, *, providers: tuple[str, ...] = DEFAULT_PROVIDERS,
                 allow_anonymous: bool = False, verify: Callable[[str, bytes], bool] = verify_password,
                 tokens: JwtVerifier | PendingKeys | None = None) -> None:
        self.tables = tables
        self.providers = providers
        self.tokens = tokens  # the `jwt` provider's key (None: the provider never applies)
        self.allow_anonymous = allow_anonymous and ANONYMOUS in providers
        self.verify = verify

    # ------------------------------------------------------------------------------------------ CONNECT
    def authenticate(self, req: AuthRequest, now_ms: int,
                     http: HttpAnswer | None = None) -> AuthResult | HttpCheck:
        rule = self.tables.blocked_by(req.client_id, req.username, req.ip, now_ms)
        if rule is not None:
            log.info("client %r (%s): blocked by rule %r", req.client_id, req.ip, rule.key)
            return AuthResult(ReasonCode.BANNED, "banned")  # the rule is not told to the client
        identity = None
        for provider in self.providers:
            if provider == PASSWORD:
                cred = self.tables.credentials.get(req.username) if req.username is not None else None
                if cred is None or cred.password_hash is None:
                    continue  # not a password credential: the next provider decides
                if req.password is None or not self.verify(cred.password_hash, req.password):
                    return AuthResult(ReasonCode.BAD_USER_NAME_OR_PASSWORD, "bad user name or password")
                identity = Identity(PASSWORD, cred.name, cred.username)
            elif provider == X509:
                by_name = self.tables.by_cert_name
                name = next((c for c in map(by_name.get, req.cert_names) if c is not None), None)
                if name is None:
                    continue
                identity = Identity(X509, name, name)
            elif provider == JWT:
                if self.tokens is None or not looks_like_jwt(req.password):
                    continue
                try:
                    grant = self.tokens.verify(req.password, req.client_id, req.username, now_ms)
                except TokenRefused as exc:
                    return AuthResult(exc.reason_code, exc.reason)
                if self.tables.token_revoked(grant.token_id):
                    return AuthResult(ReasonCode.BAD_USER_NAME_OR_PASSWORD, "token revoked")
                identity = Identity(JWT, None, grant.username, grant.pub, grant.sub, grant.expires_at_ms, True,
                                    grant.key_thumbprint, grant.token_id)
            elif provider == HTTP:
                if http is None:
                    return HttpCheck(request_body(req.client_id, req.username, req.password, req.ip, req.cert_names))
                if http.result == IGNORE:
                    continue
                if http.result == DENY:
                    return AuthResult(ReasonCode.BAD_USER_NAME_OR_PASSWORD,
                                      "denied by the authentication service" + (f": {http.reason}" if http.reason
                                                                                 else ""))
                if http.result != ALLOW:  # ERROR: no usable answer, the client is to come back
                    return AuthResult(ReasonCode.SERVER_UNAVAILABLE, http.reason)
                if http.expires_at_ms is not None and http.expires_at_ms <= now_ms:
                    return AuthResult(ReasonCode.BAD_USER_NAME_OR_PASSWORD,
                                      "the authentication service's expire_at has passed")
                identity = Identity(HTTP, None, http.username or req.username or "", http.pub or (), http.sub or (),
                                    http.expires_at_ms, http.pub is not None)
            elif provider == ANONYMOUS:
                if not self.allow_anonymous:
                    continue
                identity = Identity(ANONYMOUS, None, req.username or "")
            break
        if identity is None:
            if req.username is not None:
                return AuthResult(ReasonCode.BAD_USER_NAME_OR_PASSWORD, "bad user name or password")
            return AuthResult(ReasonCode.NOT_AUTHORIZED, "not authorized (no credentials and anonymous not allowed)")
        if identity.credential is not None:
            cred = self.tables.credentials.get(identity.credential)
            if cred is not None and cred.client_id and not self.client_id_allowed(cred, req.client_id):
                return AuthResult(ReasonCode.NOT_AUTHORIZED,
                                  f"client id not allowed for credential {cred.name!r}")
        if req.will_topic is not None and not self.may_publish(identity, req.client_id, req.will_topic):
            return AuthResult(ReasonCode.NOT_AUTHORIZED, f"will topic {req.will_topic!r} not allowed")
        return AuthResult(ReasonCode.SUCCESS, identity=identity)

    @staticmethod
    def client_id_allowed(cred: Credential, client_id: str) -> bool:
        return client_id_allowed(cred.client_id, client_id, cred.username)

    # ------------------------------------------------------------------------------------------ ACL
    def _allowed(self, identity: Identity, client_id: str, kind: str, subject: str,
                 match: Callable[[str, str], bool]) -> bool:
        if identity.carries_patterns:
            patterns = identity.pub if kind == "pub" else identity.sub
        elif identity.credential is None:
            return True  # anonymous: everything
        else:
            cred = self.tables.credentials.get(identity.credential)
            if cred is None:
                return False  # deleted since: nothing
            patterns = cred.pub if kind == "pub" else cred.sub
        for p in patterns:
            f = substitute(p, client_id, identity.username)
            if f is not None and match(f, subject):
                return True
        return False

    def may_publish(self, identity: Identity, client_id: str, topic: str) -> bool:
        """A publish pattern matches `topic` (`tbmq_routing.topic_matches`)."""
        return self._allowed(identity, client_id, "pub", topic, topic_matches)

    def may_subscribe(self, identity: Identity, client_id: str, topic_filter: str) -> bool:
        """`topic_filter` without its `$share/<name>/` prefix: allowed when a subscribe pattern covers every
        topic it can match (`tbmq_routing.filter_covers`: `#` needs a pattern `#`, `$SYS/#` one that starts
        with `$SYS`)."""
        return self._allowed(identity, client_id, "sub", topic_filter, filter_covers)
