"""tbmq_auth: who may connect, publish and subscribe. Pure (no I/O; the time is passed in).

* ``tbmq_auth.rules``     -- ``Credential``, ``BlockedRule``, ``AuthTables`` (the compacted topics as tables),
  ``Authorizer`` (authenticate a CONNECT, ``may_publish`` / ``may_subscribe``), ``anonymous_default``
* ``tbmq_auth.passwords`` -- argon2id ``hash_password`` / ``verify_password``, ``VerifiedPasswords`` (recent
  successes kept, so a reconnect is not verified again)
* ``tbmq_auth.kept``      -- ``Kept``: values kept for a while by key, bounded (the caches' one rule)
* ``tbmq_auth.tokens``    -- ``JwtVerifier``: JSON Web Tokens as passwords (provider ``jwt``)
* ``tbmq_auth.http``      -- provider ``http``: what is asked of the operator's service, how its answer reads
* ``tbmq_auth.patterns``  -- the client-id, topic-pattern and acl rules credentials, tokens and answers share

The ``tbmq`` command line (``tbmq_platform.cli``) writes the records; the connector follows them.
"""

from .passwords import hash_password, verify_password
from .rules import (
    ANONYMOUS,
    BLOCK_KINDS,
    CLIENT_ID,
    DEFAULT_PROVIDERS,
    IP,
    JWT,
    PASSWORD,
    PROVIDERS,
    REGEX,
    REGEX_TARGETS,
    USERNAME,
    X509,
    AuthRequest,
    AuthResult,
    AuthTables,
    Authorizer,
    BlockedRule,
    Credential,
    Identity,
    anonymous_default,
    make_credential,
    parse_providers,
    substitute,
)
from .http import HTTP, HttpAnswer, HttpCheck, parse_answer, request_body
from .tokens import (
    JwtVerifier,
    PendingKeys,
    TokenGrant,
    TokenRefused,
    jwk_thumbprint,
    jwks_keys,
    looks_like_jwt,
    public_key_algorithms,
    revocation,
    revocation_of,
    revocation_value,
    revocations_in_force,
    revoked_until_ms,
)

__all__ = [
    "ANONYMOUS", "BLOCK_KINDS", "CLIENT_ID", "DEFAULT_PROVIDERS", "HTTP", "IP", "JWT", "PASSWORD", "PROVIDERS",
    "REGEX", "REGEX_TARGETS", "USERNAME", "X509", "AuthRequest", "AuthResult", "AuthTables", "Authorizer",
    "BlockedRule", "Credential", "HttpAnswer", "HttpCheck", "Identity", "JwtVerifier", "PendingKeys", "TokenGrant",
    "TokenRefused", "anonymous_default", "hash_password", "jwk_thumbprint", "jwks_keys", "looks_like_jwt",
    "make_credential", "parse_answer", "parse_providers", "public_key_algorithms", "request_body", "revocation",
    "revocation_of", "revocation_value", "revocations_in_force", "revoked_until_ms", "substitute", "verify_password",
]
