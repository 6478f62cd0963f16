"""Administrators: users from ADMIN_USERS_FILE (argon2id hashes), bearer tokens signed with ADMIN_TOKEN_SECRET.

A token is a JSON Web Token valid for `ttl_s` from the login; the clock is injected (`clock`, wall-clock
seconds by default) so its expiry is tested without waiting. With a secret of its own (ADMIN_TOKEN_SECRET
unset: random per start) an instance's tokens work on it alone and not after its restart; with a shared one,
on every instance and across restarts. A token names its user and a stamp of that user's password hash
(`password_stamp`): `token_user` takes it only while the users file still has the user with that password, so
removing an administrator or changing a password ends the tokens issued before, on every instance. The
secret is rotated without logging anyone out by moving it to ADMIN_TOKEN_SECRET_PREVIOUS (still accepted)
while the new one signs. Failed logins per address: tbmq_auth.failures, the connector's rule.

Each user has a role, the file's optional third field: `admin` (the default: everything) or `viewer` (the
reads, api.Route.role). The role is looked up in the users file at each request, not carried by the token, so
a changed role applies at once, as a changed password does.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jwt
from argon2 import PasswordHasher
from tbmq_auth.tokens import MIN_SECRET_BYTES  # the HS256 key rule the jwt provider's secrets follow
from argon2.exceptions import InvalidHashError, VerificationError

_HASHER = PasswordHasher()  # argon2id with argon2-cffi's recommended parameters
# verified when the user is unknown, so an unknown name costs what a wrong password does
_DUMMY = _HASHER.hash(secrets.token_urlsafe(16))


ADMIN = "admin"
VIEWER = "viewer"
ROLES = (ADMIN, VIEWER)  # each role may do what the roles after it may


@dataclass(frozen=True)
class User:
    digest: str          # argon2id hash of the password
    role: str = ADMIN


def parse_users(text: str) -> dict[str, User]:
    """{username: User} of a users file: `username:argon2-hash[:role]` per line (role `admin`, the default, or
    `viewer`); blank lines and # comments skipped."""
    users = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, rest = line.partition(":")
        digest, _, role = rest.partition(":")
        if not sep or not name or not digest.startswith("$argon2"):
            raise ValueError(f"line {n}: not username:argon2-hash[:role]")
        if role and role not in ROLES:
            raise ValueError(f"line {n}: role {role!r} is not one of {', '.join(ROLES)}")
        users[name] = User(digest, role or ADMIN)
    return users


def allows(role: str, needed: str) -> bool:
    """Whether a user of `role` may call a route that needs `needed` (admin may do everything, a viewer reads)."""
    return role in ROLES and needed in ROLES and ROLES.index(role) <= ROLES.index(needed)


def users_file_problem(path: str) -> str | None:
    """Why ADMIN_USERS_FILE cannot be used (missing, readable by others), or None: checked at start-up and each
    time the file is read again."""
    if not os.path.isfile(path):
        return "no such file"
    if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
        return "readable by others (chmod 600)"
    return None


def load_users(path: str | Path) -> dict[str, User]:
    return parse_users(Path(path).read_text())


def password_stamp(digest: str) -> str:
    """What a token carries of its user's password hash (claim `pwd`): 16 hex digits of its SHA-256, enough to
    tell a changed hash, nothing to guess the password from."""
    return hashlib.sha256(digest.encode()).hexdigest()[:16]


def token_user(claims: dict | None, users: dict[str, User]) -> str | None:
    """The user of a valid token's `claims` while the users file has that user with the password the token was
    issued for; None otherwise (no claims, the user removed, the password changed)."""
    if claims is None:
        return None
    user = users.get(claims["sub"])
    return claims["sub"] if user is not None and claims.get("pwd") == password_stamp(user.digest) else None


def verify(users: dict[str, User], username: str, password: str) -> bool:
    user = users.get(username)
    digest = user.digest if user is not None else None
    try:
        return _HASHER.verify(digest or _DUMMY, password) and digest is not None
    except (VerificationError, InvalidHashError):
        return False


class Tokens:
    """Bearer tokens of logged-in administrators: signed JSON Web Tokens (HS256 with `secret`; claims `sub` the
    user, `exp`, `jti` a random id), so every admin instance with the same secret (ADMIN_TOKEN_SECRET) takes a
    token any of them issued: behind one address a client need not stick to one instance. `revoke(jti, exp)`
    refuses a token before its expiry (a logout; the service spreads it to every instance through
    tbmq.admin.tokens.revoked); a revoked id is kept until the token would have expired. Times are the wall
    clock (`clock`, seconds), shared by the instances."""

    ALGORITHM = "HS256"

    def __init__(self, ttl_s: float, secret: bytes, clock: Callable[[], float] = time.time,
                 previous: tuple[bytes, ...] = ()) -> None:
        if any(len(s) < MIN_SECRET_BYTES for s in (secret, *previous)):
            raise ValueError(f"the token secret needs at least {MIN_SECRET_BYTES} bytes")
        self.ttl_s = ttl_s
        self.secrets = (secret, *previous)  # verified with any, the first signs
        self.clock = clock
        self._revoked: dict[str, float] = {}  # jti -> when the token expires (s)

    def issue(self, user: str, stamp: str = "") -> tuple[str, float]:
        """A new token of `user` (with `stamp`: its password hash's `password_stamp`) and its lifetime in
        seconds."""
        claims = {"sub": user, "exp": int(self.clock() + self.ttl_s), "jti": secrets.token_urlsafe(16),
                  "pwd": stamp}
        return jwt.encode(claims, self.secrets[0], algorithm=self.ALGORITHM), self.ttl_s

    def claims(self, token: str) -> dict | None:
        """The claims of a valid token (signed with this secret or a previous one, not expired, not revoked),
        else None."""
        for secret in self.secrets:
            try:
                claims = jwt.decode(token, secret, algorithms=[self.ALGORITHM],
                                    options={"verify_exp": False, "require": ["exp"]})
                break
            except jwt.InvalidSignatureError:
                continue
            except jwt.InvalidTokenError:
                return None
        else:
            return None
        sub, exp, jti = claims.get("sub"), claims.get("exp"), claims.get("jti")
        if not (isinstance(sub, str) and isinstance(exp, int) and isinstance(jti, str)):
            return None
        if self.clock() >= exp or jti in self._revoked:
            return None
        return claims

    def revoke(self, jti: str, expires_s: float) -> None:
        self._purge()
        if expires_s > self.clock():
            self._revoked[jti] = expires_s

    def _purge(self) -> None:
        now = self.clock()
        for t in [t for t, exp in self._revoked.items() if now >= exp]:
            del self._revoked[t]

    def __len__(self) -> int:
        """Revoked tokens not expired yet."""
        self._purge()
        return len(self._revoked)
