"""Password hashes: argon2id (argon2-cffi), salted, slow on purpose. Only hashes are stored or sent.

`VerifiedPasswords` keeps the passwords verified recently (MQTT_PASSWORD_CACHE_S), so a device reconnecting
with the same password is not verified again: a fleet's reconnect storm after a network outage costs one
argon2id check per device and credential, not one per CONNECT (186 ms of CPU each on the 2-core development
host: 100,000 devices would wait about 2.3 hours on one such connector). What is kept:
* only successes, never a failed guess;
* by a keyed BLAKE2b (a random key made when the process starts, never stored or sent) of the stored hash and
  the password, so a changed password (a new hash, new salt) or a deleted credential is never answered from
  it, and the password itself is not kept;
* for `ttl_s` after the check, at most `max_entries` (the one verified longest ago dropped first; about
  `ENTRY_BYTES` each).
What it costs: whoever can read the connector's memory can test guesses against a kept entry at BLAKE2b speed,
not argon2id's. Such a reader also sees every password as it arrives in a CONNECT; `ttl_s` 0 keeps nothing.
"""

from __future__ import annotations

import hashlib
import os

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from .kept import Kept

# What a hash costs, chosen per credential when it is written (`tbmq credentials add --hash-cost`, the admin API's
# "hash_cost"); a stored hash names its own parameters, so verifying needs no choice. Measured on the 2-core
# development host (docs/security.md): STANDARD, argon2-cffi's defaults (RFC 9106 "low memory": t=3, m=64 MiB,
# p=4, the lanes in parallel), 110 ms and 186 ms of CPU a check; LOW, OWASP's minimum for argon2id (t=2,
# m=19 MiB, p=1), for fleets that must verify many devices at once after a connector restarts. The connector
# verifies off its event loop (connector.service.authenticate).
STANDARD, LOW = "standard", "low"
_HASHERS = {STANDARD: PasswordHasher(), LOW: PasswordHasher(time_cost=2, memory_cost=19 * 1024, parallelism=1)}
HASH_COSTS = tuple(_HASHERS)
_HASHER = _HASHERS[STANDARD]  # verifies a hash of any parameters


def hash_password(password: str | bytes, cost: str = STANDARD) -> str:
    """An argon2id PHC string ("$argon2id$v=19$m=...,t=...,p=...$salt$hash"), with a fresh random salt, at one
    of HASH_COSTS; ValueError for another."""
    hasher = _HASHERS.get(cost)
    if hasher is None:
        raise ValueError(f"hash cost {cost!r}: one of {', '.join(HASH_COSTS)}")
    return hasher.hash(password)


def verify_password(stored_hash: str, password: str | bytes) -> bool:
    """Whether `password` matches `stored_hash`; False for a wrong password or a hash that is not argon2."""
    try:
        return _HASHER.verify(stored_hash, password)
    except (VerificationError, InvalidHashError):
        return False


class VerifiedPasswords:
    """Passwords verified in the last `ttl_s` seconds (see the module docstring); the time is passed in. Not
    thread-safe: the connector asks it under its own lock (its checks run on threads)."""

    ENTRY_BYTES = 250  # measured with tracemalloc: the key, its expiry and the table's slot

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self._kept: Kept[bool] = Kept(ttl_s, max_entries)
        self._secret = os.urandom(32)

    def __bool__(self) -> bool:
        return bool(self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def _key(self, stored_hash: str, password: str | bytes) -> bytes:
        if isinstance(password, str):
            password = password.encode()
        h = hashlib.blake2b(key=self._secret, digest_size=32)
        h.update(stored_hash.encode())
        h.update(b"\0")
        h.update(password)
        return h.digest()

    def known(self, stored_hash: str, password: str | bytes, now: float) -> bool:
        """Whether this password was verified against this stored hash less than `ttl_s` before `now`."""
        return bool(self._kept) and self._kept.get(self._key(stored_hash, password), now) is not None

    def verified(self, stored_hash: str, password: str | bytes, now: float) -> None:
        """This password was verified against this stored hash at `now` (call it for successes only)."""
        if self._kept:
            self._kept.put(self._key(stored_hash, password), True, now)


__all__ = ["HASH_COSTS", "LOW", "STANDARD", "VerifiedPasswords", "hash_password", "verify_password"]
