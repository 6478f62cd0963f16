"""Password hashes: argon2id (argon2-cffi), salted, slow on purpose. Only hashes are stored or sent."""

from __future__ import annotations

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

# argon2-cffi's defaults (RFC 9106 "low memory": t=3, m=64 MiB, p=4, the lanes in parallel): 110 ms and 186 ms of
# CPU per hash on the 2-core development host (docs/security.md). The connector verifies off its event loop
# (connector.service.authenticate).
_HASHER = PasswordHasher()


def hash_password(password: str | bytes) -> str:
    """An argon2id PHC string ("$argon2id$v=19$m=...,t=...,p=...$salt$hash"), with a fresh random salt."""
    return _HASHER.hash(password)


def verify_password(stored_hash: str, password: str | bytes) -> bool:
    """Whether `password` matches `stored_hash`; False for a wrong password or a hash that is not argon2."""
    try:
        return _HASHER.verify(stored_hash, password)
    except (VerificationError, InvalidHashError):
        return False
