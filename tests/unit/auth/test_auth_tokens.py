"""The `jwt` provider (tbmq_auth.tokens, tbmq_auth.Authorizer): real tokens signed with PyJWT and keys made by
`cryptography`; the time is passed in."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from tbmq_auth import (
    JWT,
    AuthRequest,
    AuthTables,
    Authorizer,
    BlockedRule,
    JwtVerifier,
    TokenRefused,
    jwk_thumbprint,
    looks_like_jwt,
    parse_providers,
    revocation,
    revocation_of,
    revocation_value,
    revocations_in_force,
    revoked_until_ms,
)
from tbmq_mqtt import ReasonCode as RC

pytestmark = pytest.mark.unit

NOW = 1_800_000_000_000  # ms
SECRET = b"s" * 32


def pem(public_key) -> bytes:
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture(scope="module")
def ec_key():
    return ec.generate_private_key(ec.SECP256R1())


def token(key=SECRET, alg="HS256", **claims) -> bytes:
    claims.setdefault("exp", NOW // 1000 + 60)
    return jwt.encode(claims, key, algorithm=alg).encode()


def authorizer(verifier, providers=("password", JWT), **kw) -> Authorizer:
    return Authorizer(AuthTables(), providers=providers, tokens=verifier, **kw)


def connect(auth: Authorizer, password: bytes | None, client_id="dev-1", username=None, will_topic=None):
    return auth.authenticate(AuthRequest(client_id=client_id, username=username, password=password,
                                         will_topic=will_topic), NOW)


def test_a_valid_token_grants_its_acl_and_expiry(ec_key):
    auth = authorizer(JwtVerifier(public_key_pem=pem(ec_key.public_key())))
    t = token(ec_key, "ES256", client_id="dev-*", acl={"pub": ["up/%c/#"], "sub": ["down/%u/+"], "all": ["x/y"]},
              username="alice")
    r = connect(auth, t, username="alice", will_topic="up/dev-1/will")
    assert r.ok and r.identity.provider == JWT and r.identity.credential is None and r.identity.restricted
    assert r.identity.username == "alice" and r.identity.expires_at_ms == NOW + 60_000
    i = r.identity
    assert auth.may_publish(i, "dev-1", "up/dev-1/t") and auth.may_publish(i, "dev-1", "x/y")
    assert not auth.may_publish(i, "dev-1", "up/dev-2/t") and not auth.may_publish(i, "dev-1", "down/alice/a")
    assert auth.may_subscribe(i, "dev-1", "down/alice/+") and auth.may_subscribe(i, "dev-1", "x/y")
    assert not auth.may_subscribe(i, "dev-1", "down/bob/a") and not auth.may_subscribe(i, "dev-1", "#")


def test_without_an_acl_claim_nothing_is_allowed():
    r = connect(authorizer(JwtVerifier(secret=SECRET)), token())
    assert r.ok and not r.identity.pub and not r.identity.sub
    assert not authorizer(None).may_publish(r.identity, "dev-1", "a")
    # and a Will is a publish: refused at CONNECT
    assert connect(authorizer(JwtVerifier(secret=SECRET)), token(), will_topic="a").reason_code == RC.NOT_AUTHORIZED


@pytest.mark.parametrize("what, make, code", [
    ("another secret", lambda: token(b"t" * 32), RC.BAD_USER_NAME_OR_PASSWORD),
    ("expired", lambda: token(exp=NOW // 1000), RC.BAD_USER_NAME_OR_PASSWORD),
    ("no exp", lambda: jwt.encode({"sub": "x"}, SECRET, algorithm="HS256").encode(), RC.BAD_USER_NAME_OR_PASSWORD),
    ("not before", lambda: token(nbf=NOW // 1000 + 5), RC.BAD_USER_NAME_OR_PASSWORD),
    ("alg none", lambda: jwt.encode({"exp": NOW // 1000 + 60}, None, algorithm="none").encode() + b"x",
     RC.BAD_USER_NAME_OR_PASSWORD),
    ("client id pattern", lambda: token(client_id="other-*"), RC.NOT_AUTHORIZED),
    ("user name", lambda: token(username="bob"), RC.NOT_AUTHORIZED),
    ("acl not a filter", lambda: token(acl={"pub": ["a/#/b"]}), RC.NOT_AUTHORIZED),
    ("acl unknown key", lambda: token(acl={"publish": ["a"]}), RC.NOT_AUTHORIZED),
])
def test_refusals_name_the_reason(what, make, code):
    r = connect(authorizer(JwtVerifier(secret=SECRET)), make(), username="alice")
    assert r.reason_code == code, (what, r)
    assert r.identity is None


def test_a_token_signed_with_the_public_key_as_an_hmac_secret_is_refused():
    """Algorithm confusion: the verifier's algorithms come from its key, never from the token."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = pem(key.public_key())
    v = JwtVerifier(public_key_pem=public)
    assert "HS256" not in v.algorithms
    forged = token(key, "RS256")  # the genuine one passes
    assert v.verify(forged, "dev-1", None, NOW).expires_at_ms == NOW + 60_000
    def b64(b: bytes) -> bytes:
        return base64.urlsafe_b64encode(b).rstrip(b"=")
    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = b64(json.dumps({"exp": NOW // 1000 + 60}).encode())
    sig = b64(hmac.new(public, head + b"." + body, hashlib.sha256).digest())
    with pytest.raises(TokenRefused) as e:
        v.verify(head + b"." + body + b"." + sig, "dev-1", None, NOW)
    assert e.value.reason_code == RC.BAD_USER_NAME_OR_PASSWORD


def test_audience_and_issuer_when_configured():
    v = JwtVerifier(secret=SECRET, audience="tbmq", issuer="https://id.example")
    assert v.verify(token(aud="tbmq", iss="https://id.example"), "c", None, NOW)
    for claims in ({"aud": "other", "iss": "https://id.example"}, {"iss": "https://id.example"},
                   {"aud": "tbmq", "iss": "https://evil.example"}):
        with pytest.raises(TokenRefused):
            v.verify(token(**claims), "c", None, NOW)


def test_the_provider_applies_to_tokens_only_and_keeps_its_place_in_the_order():
    auth = authorizer(JwtVerifier(secret=SECRET), providers=(JWT, "anonymous"), allow_anonymous=True)
    assert connect(auth, b"a plain password").identity.provider == "anonymous"  # not a token: the next one
    assert connect(auth, token()).identity.provider == JWT
    assert connect(auth, token(b"t" * 32)).reason_code == RC.BAD_USER_NAME_OR_PASSWORD  # a bad token decides
    # without a verifier the provider never applies; blocked rules still come first
    assert connect(authorizer(None, providers=(JWT, "anonymous"), allow_anonymous=True),
                   token()).identity.provider == "anonymous"
    t = AuthTables()
    t.apply_blocked(b"client_id:dev-1", BlockedRule("client_id", "dev-1").to_json())
    assert Authorizer(t, providers=(JWT,), tokens=JwtVerifier(secret=SECRET)).authenticate(
        AuthRequest(client_id="dev-1", password=token()), NOW).reason_code == RC.BANNED


def test_keys_and_providers_setting():
    assert parse_providers("jwt,password") == (JWT, "password")
    with pytest.raises(ValueError, match="32 bytes"):
        JwtVerifier(secret=b"short")
    with pytest.raises(ValueError):
        JwtVerifier(secret=SECRET, public_key_pem=b"x")
    with pytest.raises(ValueError):
        JwtVerifier(public_key_pem=b"-----BEGIN PUBLIC KEY-----\nnot a key\n-----END PUBLIC KEY-----\n")
    ed = ed25519.Ed25519PrivateKey.generate()
    assert JwtVerifier(public_key_pem=pem(ed.public_key())).algorithms == ("EdDSA",)
    assert JwtVerifier(public_key_pem=pem(ed.public_key())).verify(token(ed, "EdDSA"), "c", None, NOW)
    assert looks_like_jwt(token()) and not looks_like_jwt(b"pw") and not looks_like_jwt(None)


# ------------------------------------------------------------------------------------------------ JWK Sets
def jwk(private_key, kid: str | None, **extra) -> dict:
    """The public JWK of `private_key` (PyJWT's own encoder), with `kid` and `extra` members."""
    if isinstance(private_key, bytes):
        out = json.loads(jwt.algorithms.HMACAlgorithm.to_jwk(private_key))
    elif isinstance(private_key, rsa.RSAPrivateKey):
        out = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private_key.public_key()))
    elif isinstance(private_key, ec.EllipticCurvePrivateKey):
        out = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(private_key.public_key()))
    else:
        out = json.loads(jwt.algorithms.OKPAlgorithm.to_jwk(private_key.public_key()))
    return {**out, **({"kid": kid} if kid is not None else {}), **extra}


def jwks(*keys: dict) -> bytes:
    return json.dumps({"keys": list(keys)}).encode()


def signed(key, alg: str, kid: str | None = None, **claims) -> bytes:
    claims.setdefault("exp", NOW // 1000 + 60)
    return jwt.encode(claims, key, algorithm=alg, headers={"kid": kid} if kid is not None else None).encode()


def test_a_key_set_picks_the_key_by_kid_so_issuers_rotate_keys(ec_key):
    """Rotation: the set holds the current key and the next one; a token names its key with `kid`."""
    nxt = ec.generate_private_key(ec.SECP256R1())
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    v = JwtVerifier(jwks=jwks(jwk(ec_key, "2026-11"), jwk(nxt, "2026-12"), jwk(rsa_key, "r", alg="RS256"),
                              jwk(ec.generate_private_key(ec.SECP256R1()), "e", use="enc")))
    assert set(v.keys) == {"2026-11", "2026-12", "r"}  # the encryption key is not one to verify with
    current = v.verify(signed(ec_key, "ES256", "2026-11"), "c", None, NOW).key_thumbprint
    assert current == jwk_thumbprint(jwk(ec_key, None))  # what a retirement ends
    assert v.verify(signed(nxt, "ES256", "2026-12"), "c", None, NOW).key_thumbprint == jwk_thumbprint(jwk(nxt, None))
    assert v.thumbprints == {jwk_thumbprint(jwk(k, None)) for k in (ec_key, nxt, rsa_key)}
    assert v.verify(signed(rsa_key, "RS256", "r"), "c", None, NOW)
    refused = {
        "another key's kid": signed(ec_key, "ES256", "2026-12"),
        "an unknown kid": signed(ec_key, "ES256", "2027-01"),
        "no kid": signed(ec_key, "ES256"),
        "an alg the JWK does not allow": signed(rsa_key, "PS256", "r"),
        "not a token": b"a.b.c",
    }
    for what, t in refused.items():
        with pytest.raises(TokenRefused) as e:
            v.verify(t, "c", None, NOW)
        assert e.value.reason_code == RC.BAD_USER_NAME_OR_PASSWORD, what
    one = JwtVerifier(jwks=jwks(jwk(ec_key, None)))  # a set of one key: no kid needed
    assert one.verify(signed(ec_key, "ES256"), "c", None, NOW).key_thumbprint == current
    named = JwtVerifier(jwks=jwks(jwk(ec_key, "only")))
    assert named.verify(signed(ec_key, "ES256"), "c", None, NOW).key_thumbprint == current
    fixed = JwtVerifier(secret=SECRET)  # one configured key: nothing to retire it
    assert fixed.verify(token(), "c", None, NOW).key_thumbprint is None and fixed.thumbprints == frozenset()


def test_a_key_is_known_by_its_thumbprint_not_its_kid(ec_key):
    """RFC 7638: the thumbprint covers the key's required members only, so a key replaced under the same kid
    (or the one key of a set without kids) has another one, and the same key under another kid or with other
    optional members has the same."""
    rfc_key = {"kty": "RSA", "alg": "RS256", "kid": "2011-04-29", "e": "AQAB",
               "n": "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_BJECPeb"
                    "WKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2QvzqY368QQ"
                    "MicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh6WeZu0fM4lFd2Nc"
                    "Rwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDKgw"}
    assert jwk_thumbprint(rfc_key) == "NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9Xs"  # RFC 7638 3.1
    assert jwk_thumbprint({**rfc_key, "kid": "other", "use": "sig"}) == jwk_thumbprint(rfc_key)
    replaced = JwtVerifier(jwks=jwks(jwk(ec.generate_private_key(ec.SECP256R1()), "2026-11")))
    before = JwtVerifier(jwks=jwks(jwk(ec_key, "2026-11")))
    assert replaced.thumbprints.isdisjoint(before.thumbprints)
    assert jwk_thumbprint(jwk(SECRET, None)) in JwtVerifier(jwks=jwks(jwk(SECRET, None))).thumbprints


def test_a_key_set_refuses_hmac_forgeries_with_its_public_keys():
    """Algorithm confusion through a set: the RSA key's JWK member `n` or its PEM as an HMAC secret."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    v = JwtVerifier(jwks=jwks(jwk(key, "r")))
    assert not set(v.algorithms) & {"HS256", "HS384", "HS512", "none"}
    def b64(b: bytes) -> bytes:
        return base64.urlsafe_b64encode(b).rstrip(b"=")

    head = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "r"}).encode())
    body = b64(json.dumps({"exp": NOW // 1000 + 60}).encode())
    for secret in (pem(key.public_key()), jwk(key, "r")["n"].encode()):
        forged = head + b"." + body + b"." + b64(hmac.new(secret, head + b"." + body, hashlib.sha256).digest())
        with pytest.raises(TokenRefused):
            v.verify(forged, "c", None, NOW)
    hmac_set = JwtVerifier(jwks=jwks(jwk(SECRET, "h")))  # a shared secret in a (file) set
    assert hmac_set.algorithms == ("HS256", "HS384", "HS512")
    assert hmac_set.verify(signed(SECRET, "HS256", "h"), "c", None, NOW)


def test_bad_key_sets_are_named(ec_key):
    from tbmq_auth import jwks_keys

    private = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(ec_key))
    cases = {
        b"not json": "not JSON",
        b'{"keys": {}}': "not a JWK Set",
        jwks(jwk(ec_key, "e", use="enc")): "no key to verify signatures with",
        jwks({**private, "kid": "p"}): "key 'p': it holds a private key",
        jwks(jwk(ec_key, "a"), jwk(ec_key, "a")): "two keys with kid 'a'",
        jwks(jwk(ec_key, "a"), jwk(ec_key, None)): "key 1 has no kid",
        jwks(jwk(b"short", "h")): "key 'h': an HMAC secret needs at least 32 bytes",
        jwks(jwk(ec_key, "x", alg="RS256")): "key 'x': ",
        jwks({"kty": "RSA", "kid": "n"}): "key 'n': not a usable key",
        jwks({**jwk(ec_key, None), "kid": ["a"]}): "key 0: its kid is not a string",
    }
    for document, message in cases.items():
        with pytest.raises(ValueError) as e:
            jwks_keys(document)
        assert message in str(e.value), (document[:60], str(e.value))
    with pytest.raises(ValueError, match="one key source"):
        JwtVerifier(secret=SECRET, jwks=jwks(jwk(ec_key, "a")))


def test_until_a_key_set_is_loaded_tokens_get_server_unavailable():
    from tbmq_auth import PendingKeys

    res = connect(authorizer(PendingKeys(), providers=(JWT,)), token())
    assert res.reason_code == RC.SERVER_UNAVAILABLE and res.identity is None


def test_a_revoked_token_is_refused_until_its_exp_and_others_are_not():
    """tbmq.security.tokens.revoked as AuthTables applies it: a revoked jti gets 0x86 "token revoked"; another
    token, or the same claims under another jti, still connects; a revocation withdrawn (null) or one whose token
    has expired is not kept; an unreadable record is ignored."""
    auth = authorizer(JwtVerifier(secret=SECRET))
    tables = auth.tables
    ok = connect(auth, token(jti="t-1", acl={"all": ["#"]}))
    assert ok.reason_code == RC.SUCCESS and ok.identity.token_id == "t-1"
    exp_s = NOW // 1000 + 60
    assert tables.apply_revoked_token(b"t-1", revocation_value(exp_s), NOW)
    refused = connect(auth, token(jti="t-1"))
    assert (refused.reason_code, refused.reason) == (RC.BAD_USER_NAME_OR_PASSWORD, "token revoked")
    assert connect(auth, token(jti="t-2")).reason_code == RC.SUCCESS
    assert connect(auth, token()).identity.token_id is None  # no jti: nothing to revoke it by
    assert not tables.apply_revoked_token(b"t-1", None, NOW)  # withdrawn
    assert connect(auth, token(jti="t-1")).reason_code == RC.SUCCESS
    assert not tables.apply_revoked_token(b"t-3", revocation_value(NOW // 1000), NOW)  # expired: not kept
    assert not tables.apply_revoked_token(b"t-4", b"soon", NOW) and tables.revoked_tokens == {}
    assert revoked_until_ms(b"1800000060") == 1_800_000_060_000
    assert list(revocations_in_force({"b": NOW + 1, "a": NOW + 2, "gone": NOW}, NOW).items()) == [
        ("a", NOW + 2), ("b", NOW + 1)]  # sorted by jti, the expired one left out
    for bad in (b"", b"-1", b"nan", b"inf", b"x"):
        with pytest.raises(ValueError):
            revoked_until_ms(bad)


def test_what_a_revocation_of_a_token_names():
    assert revocation_of(token(jti="t-1", exp=1_900_000_000)) == ("t-1", 1_900_000_000.0)
    assert revocation_of(token(key=b"k" * 32, jti="t-1").decode())[0] == "t-1"  # any key: not verified
    for bad, why in ((token(), "no jti"), (jwt.encode({"jti": "t"}, SECRET, algorithm="HS256"), "no exp"),
                     (b"not.a.token", "not a JSON Web Token")):
        with pytest.raises(ValueError, match=why):
            revocation_of(bad)


def test_a_revocation_asked_for_by_the_token_or_by_its_jti_and_exp():
    assert revocation(token(jti="t-1", exp=1_900_000_000)) == ("t-1", 1_900_000_000.0)
    assert revocation(None, "t-2", 1_900_000_000) == ("t-2", 1_900_000_000.0)
    for args, why in (((None, None, None), "either"), ((token(jti="t"), "t", 1), "either"),
                      ((None, "t", None), "exp"), ((None, "t", "soon"), "exp"), ((None, "", 1), "jti"),
                      ((None, 7, 1), "jti")):
        with pytest.raises(ValueError, match=why):
            revocation(*args)
