"""JSON Web Tokens as MQTT passwords: the `jwt` authentication provider. Pure: the time is passed in.

A client sends a JWT (RFC 7519, compact form) as its CONNECT password. The connector checks it against one key,
configured at start-up: an HMAC secret (HS256/384/512) or a PEM public key (RSA: RS*/PS*, EC: ES*, Ed25519 /
Ed448: EdDSA); or against a JWK Set (RFC 7517 5, `jwks_keys`), where the token's `kid` header picks the key (a
set of one key needs none), so an issuer rotates its keys by publishing the next one beside the current one.
The algorithms a token may name follow from the chosen key alone (a JWK's own `alg` narrows them to that one),
so a token signed with the public key as an HMAC secret, or with alg "none", is refused (the classic
algorithm-confusion attacks).

Claims:
* `exp` (required: a token that never expires is a password nobody can take back) and `nbf`, against the
  time passed in; `aud` / `iss` when the connector is configured with an audience / issuer.
* `client_id` (optional): a shell-style pattern (`*`, `?`, `[...]`; `%u` = the user name) the CONNECT's
  client id must match; `username` (optional): the CONNECT's user name must be this one. What `%u` stands
  for is that user name (the claim's, or the CONNECT's when the token has none).
* `acl` (optional): `{"pub": [...], "sub": [...], "all": [...]}`, MQTT topic filters with `%c` / `%u`, as a
  credential's patterns (tbmq_auth.rules); `all` counts for both. No `acl`: nothing is allowed.
* `jti` (optional): the token's id. A token with one can be revoked before its `exp` (`tbmq tokens revoke`:
  tbmq.security.tokens.revoked, `revocation_value` / `revoked_until_ms`; the authorizer refuses it, 0x86, and
  the connectors close the connections it opened).

`JwtVerifier.verify` returns a `TokenGrant` or raises `TokenRefused` with the CONNACK reason code: a bad or
expired token is 0x86 (bad user name or password), one that does not fit the client 0x87 (not authorized).
`PendingKeys` stands in while a key set is not loaded yet: 0x88 (server unavailable), so clients retry.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from tbmq_mqtt import ReasonCode

from .patterns import client_id_allowed, parse_acl

JWT = "jwt"
HMAC_ALGORITHMS = ("HS256", "HS384", "HS512")
MIN_SECRET_BYTES = 32  # RFC 7518 3.2: an HS256 key of at least the hash's size
_COMPACT = re.compile(rb"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")


def looks_like_jwt(password: bytes | None) -> bool:
    """Three base64url parts joined by dots: the provider applies (anything else is left to the others)."""
    return password is not None and _COMPACT.fullmatch(password) is not None


class TokenRefused(Exception):
    def __init__(self, reason_code: int, reason: str) -> None:
        super().__init__(reason)
        self.reason_code, self.reason = reason_code, reason


@dataclass(frozen=True, slots=True)
class TokenGrant:
    """What a valid token grants: the user name `%u` stands for, the publish and subscribe patterns, when it
    expires (ms since the epoch), and the RFC 7638 thumbprint of the JWK Set key that verified it (None: the
    one configured key): the connection ends when no key of the set has it any more (retired, or replaced under
    the same kid)."""

    username: str
    pub: tuple[str, ...]
    sub: tuple[str, ...]
    expires_at_ms: int
    key_thumbprint: str | None = None
    token_id: str | None = None  # the jti claim (a string), what a revocation names


def revocation_value(exp_s: float) -> bytes:
    """A tbmq.security.tokens.revoked record's value: until when the revocation matters, the token's `exp`
    (Unix seconds, decimal text; after it the token is refused as expired anyway). tbmq.admin.tokens.revoked
    has the same form."""
    return str(int(exp_s)).encode()


def revoked_until_ms(value: bytes) -> int:
    """The end of a revocation record's relevance (ms since the epoch); ValueError when it is not one."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"not a token expiry (Unix seconds): {value[:40]!r}") from None
    if not seconds == seconds or seconds < 0 or seconds == float("inf"):
        raise ValueError(f"not a token expiry (Unix seconds): {value[:40]!r}")
    return int(seconds * 1000)


def revocations_in_force(until_by_jti: Mapping[str, int], now_ms: float) -> dict[str, int]:
    """The revocations whose token has not expired (jti -> its exp, ms), sorted by jti: what the admin API and
    `tbmq tokens list` show and what the admin API withdraws (the connectors keep only these:
    AuthTables.apply_revoked_token)."""
    return {jti: until for jti, until in sorted(until_by_jti.items()) if until > now_ms}


def revocation_of(token: bytes | str) -> tuple[str, float]:
    """The (jti, exp) a revocation of this token names, read without checking its signature (an operator
    revoking a token it holds: revoking a forged one costs nothing); ValueError when it is not a token with
    both claims (a token without a jti cannot be revoked alone: block its client id or user name)."""
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.InvalidTokenError as exc:
        raise ValueError(f"not a JSON Web Token: {exc}") from None
    jti, exp = claims.get("jti"), claims.get("exp")
    if not isinstance(jti, str) or not jti:
        raise ValueError("the token has no jti claim: it cannot be revoked alone (block its client id or user "
                         "name instead)")
    if not _number(exp):
        raise ValueError("the token has no exp claim")
    return jti, float(exp)


def revocation(token: bytes | str | None = None, jti: object = None, exp: object = None) -> tuple[str, float]:
    """The (jti, exp) of a revocation an operator asks for (`tbmq tokens revoke`, the admin API): the token
    itself (`revocation_of`), or its jti with its exp (Unix seconds); ValueError naming what is wrong."""
    if (token is None) == (jti is None):
        raise ValueError("give either the token or its jti with its exp")
    if token is not None:
        return revocation_of(token)
    if not isinstance(jti, str) or not jti:
        raise ValueError("jti: a non-empty string")
    if not _number(exp):
        raise ValueError("a jti needs the token's exp (its exp claim, Unix seconds): until when it is refused")
    return jti, float(exp)


@dataclass(frozen=True, slots=True)
class TokenKey:
    """A key tokens are verified with, the JWS algorithms it may be used with and, for a JWK, its RFC 7638
    thumbprint (what the key is, whatever its kid)."""

    key: object
    algorithms: tuple[str, ...]
    thumbprint: str | None = None


# RFC 7638 3.2: the members of each key type a thumbprint covers (RFC 8037 2 for OKP)
_THUMBPRINT_MEMBERS = {"RSA": ("e", "kty", "n"), "EC": ("crv", "kty", "x", "y"), "OKP": ("crv", "kty", "x"),
                       "oct": ("k", "kty")}


def jwk_thumbprint(entry: dict) -> str:
    """The RFC 7638 SHA-256 thumbprint of a JWK, base64url without padding: its required members as JSON with
    sorted keys and no white space, hashed. KeyError for a member it lacks."""
    members = {m: entry[m] for m in _THUMBPRINT_MEMBERS[entry["kty"]]}
    digest = hashlib.sha256(json.dumps(members, separators=(",", ":"), sort_keys=True).encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def public_key_algorithms(key) -> tuple[str, ...]:
    """The JWS algorithms a public key can verify; ValueError for another kind of key."""
    if isinstance(key, rsa.RSAPublicKey):
        return ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512")
    if isinstance(key, ec.EllipticCurvePublicKey):
        return ("ES256", "ES384", "ES512")
    if isinstance(key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        return ("EdDSA",)
    raise ValueError(f"a {type(key).__name__} cannot verify JSON Web Tokens (RSA, EC or Ed25519/Ed448 only)")


def _secret(secret: bytes) -> TokenKey:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"an HMAC secret needs at least {MIN_SECRET_BYTES} bytes (RFC 7518 3.2)")
    return TokenKey(secret, HMAC_ALGORITHMS)


def _jwk(entry: dict) -> TokenKey:
    if "d" in entry:
        raise ValueError("it holds a private key (a key set to verify with publishes public keys only)")
    try:
        parsed = jwt.PyJWK(entry, entry.get("alg"))
    except (jwt.PyJWKError, jwt.InvalidKeyError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a usable key ({exc})") from None
    found = _secret(parsed.key) if entry.get("kty") == "oct" else TokenKey(parsed.key,
                                                                          public_key_algorithms(parsed.key))
    alg = entry.get("alg")
    if alg is not None and alg not in found.algorithms:
        raise ValueError(f"alg {alg!r} does not fit its {entry.get('kty')} key")
    return TokenKey(found.key, (alg,) if alg is not None else found.algorithms, jwk_thumbprint(entry))


def jwks_keys(document: bytes | str) -> dict[str | None, TokenKey]:
    """The verification keys of a JWK Set (RFC 7517 5: `{"keys": [...]}`) by key id (`kid`), skipping keys for
    encryption (`use` "enc"). ValueError for a set that is not one, holds no key to verify with, a private key,
    two keys of one kid, or several keys of which one has no kid (a token could not name it)."""
    try:
        doc = json.loads(document)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise ValueError('not a JWK Set (an object with a "keys" list)')
    usable = [e for e in doc["keys"] if isinstance(e, dict) and e.get("use", "sig") == "sig"]
    if not usable:
        raise ValueError("no key to verify signatures with")
    keys: dict[str | None, TokenKey] = {}
    for i, entry in enumerate(usable):
        kid = entry.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise ValueError(f"key {i}: its kid is not a string")
        if kid is None and len(usable) > 1:
            raise ValueError(f"key {i} has no kid, and the set has {len(usable)} keys")
        if kid in keys:
            raise ValueError(f"two keys with kid {kid!r}")
        try:
            keys[kid] = _jwk(entry)
        except ValueError as exc:
            raise ValueError(f"key {kid if kid is not None else i!r}: {exc}") from None
    return keys


class JwtVerifier:
    """Checks tokens against one key, `secret` (bytes, at least 32) or `public_key_pem` (bytes), or against the
    keys of a JWK Set, `jwks` (its JSON)."""

    def __init__(self, *, secret: bytes | None = None, public_key_pem: bytes | None = None,
                 jwks: bytes | str | None = None, audience: str | None = None, issuer: str | None = None) -> None:
        if sum(k is not None for k in (secret, public_key_pem, jwks)) != 1:
            raise ValueError("one key source: an HMAC secret, a public key or a JWK Set")
        self.keys: dict[str | None, TokenKey] | None = None  # a JWK Set's, by kid
        if secret is not None:
            only = _secret(secret)
        elif public_key_pem is not None:
            public = load_pem_public_key(public_key_pem)
            only = TokenKey(public, public_key_algorithms(public))
        else:
            self.keys = jwks_keys(jwks)
            only = next(iter(self.keys.items())) if len(self.keys) == 1 else None
        self._only: tuple[str | None, TokenKey] | None = (None, only) if self.keys is None else only
        self.audience, self.issuer = audience or None, issuer or None

    @property
    def thumbprints(self) -> frozenset[str]:
        """The thumbprints of the set's keys (empty for one configured key): a connection whose token a key not
        among them verified is to end."""
        return frozenset(k.thumbprint for k in (self.keys or {}).values() if k.thumbprint is not None)

    @property
    def algorithms(self) -> tuple[str, ...]:
        """What a token may be signed with, over every key."""
        keys = self.keys.values() if self.keys is not None else (self._only[1],)
        return tuple(dict.fromkeys(a for k in keys for a in k.algorithms))

    def _key(self, token: bytes) -> TokenKey:
        """The key that verifies `token`: the one key, or the set's key its `kid` header names."""
        if self.keys is None:
            return self._only[1]
        bad = ReasonCode.BAD_USER_NAME_OR_PASSWORD
        try:
            kid = jwt.get_unverified_header(token).get("kid")
        except jwt.InvalidTokenError as exc:
            raise TokenRefused(bad, f"token refused: {exc}") from None
        if kid is None:
            if self._only is None:
                raise TokenRefused(bad, "token refused: no kid, and the key set has several keys")
            return self._only[1]
        if not isinstance(kid, str) or kid not in self.keys:
            raise TokenRefused(bad, f"token refused: no key with kid {kid!r}")
        return self.keys[kid]

    def verify(self, token: bytes, client_id: str, username: str | None, now_ms: int) -> TokenGrant:
        bad = ReasonCode.BAD_USER_NAME_OR_PASSWORD
        chosen = self._key(token)
        try:
            claims = jwt.decode(token, chosen.key, algorithms=list(chosen.algorithms), audience=self.audience,
                                issuer=self.issuer, options={"verify_exp": False, "verify_nbf": False,
                                                             "verify_iat": False, "verify_aud": bool(self.audience),
                                                             "verify_iss": bool(self.issuer)})
        except jwt.InvalidTokenError as exc:
            raise TokenRefused(bad, f"token refused: {exc}") from None
        exp, nbf = claims.get("exp"), claims.get("nbf")
        if not _number(exp):
            raise TokenRefused(bad, "token refused: no exp claim")
        if now_ms >= exp * 1000:
            raise TokenRefused(bad, "token expired")
        if nbf is not None and (not _number(nbf) or now_ms < nbf * 1000):
            raise TokenRefused(bad, "token not valid yet (nbf)")
        denied = ReasonCode.NOT_AUTHORIZED
        bound_user = claims.get("username")
        if bound_user is not None and bound_user != username:
            raise TokenRefused(denied, "user name not the token's")
        user = bound_user if isinstance(bound_user, str) else (username or "")
        pattern = claims.get("client_id")
        if pattern is not None and (not isinstance(pattern, str) or not client_id_allowed(pattern, client_id, user)):
            raise TokenRefused(denied, "client id not allowed by the token")
        pub, sub = _acl(claims.get("acl"))
        jti = claims.get("jti")
        return TokenGrant(user, pub, sub, int(exp * 1000), chosen.thumbprint, jti if isinstance(jti, str) else None)


class PendingKeys:
    """The `jwt` provider while its key set is not loaded yet (a JWKS URL not reached since start-up): every token
    is refused with 0x88 Server unavailable (3.1.1: return code 3), so a client retries instead of taking its
    token for bad."""

    def verify(self, token: bytes, client_id: str, username: str | None, now_ms: int) -> TokenGrant:
        raise TokenRefused(ReasonCode.SERVER_UNAVAILABLE, "token keys not loaded yet")


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _acl(acl) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if acl is None:
        return (), ()
    try:
        return parse_acl(acl)
    except ValueError as exc:
        raise TokenRefused(ReasonCode.NOT_AUTHORIZED, f"token acl: {exc}") from None


__all__ = ["HMAC_ALGORITHMS", "JWT", "JwtVerifier", "MIN_SECRET_BYTES", "PendingKeys", "TokenGrant", "TokenKey",
           "TokenRefused", "jwk_thumbprint", "jwks_keys", "looks_like_jwt", "public_key_algorithms"]
