"""Administrators: users from ADMIN_USERS_FILE (argon2id hashes), bearer tokens kept in memory.

A token is 32 random bytes (URL-safe base64) valid for `ttl_s` from the login; the clock is injected
(`clock`, monotonic seconds by default) so its expiry is tested without waiting. Tokens do not survive a
restart of the service: log in again. `Throttle` refuses logins from an address after too many failures.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

_HASHER = PasswordHasher()  # argon2id with argon2-cffi's recommended parameters
# verified when the user is unknown, so an unknown name costs what a wrong password does
_DUMMY = _HASHER.hash(secrets.token_urlsafe(16))


def parse_users(text: str) -> dict[str, str]:
    """{username: argon2 hash} of a users file: `username:hash` per line; blank lines and # comments skipped."""
    users = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, digest = line.partition(":")
        if not sep or not name or not digest.startswith("$argon2"):
            raise ValueError(f"line {n}: not username:argon2-hash")
        users[name] = digest
    return users


def load_users(path: str | Path) -> dict[str, str]:
    return parse_users(Path(path).read_text())


def verify(users: dict[str, str], username: str, password: str) -> bool:
    digest = users.get(username)
    try:
        return _HASHER.verify(digest or _DUMMY, password) and digest is not None
    except (VerificationError, InvalidHashError):
        return False


class Tokens:
    """Bearer tokens of logged-in administrators: `issue(user)`, `user(token)` (None once expired)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._tokens: dict[str, tuple[str, float]] = {}  # token -> (user, expires at)

    def issue(self, user: str) -> tuple[str, float]:
        """A new token of `user` and its lifetime in seconds."""
        self._purge()
        token = secrets.token_urlsafe(32)
        self._tokens[token] = (user, self.clock() + self.ttl_s)
        return token, self.ttl_s

    def user(self, token: str) -> str | None:
        entry = self._tokens.get(token)
        if entry is None:
            return None
        if self.clock() >= entry[1]:
            del self._tokens[token]
            return None
        return entry[0]

    def revoke(self, token: str) -> None:
        self._tokens.pop(token, None)

    def _purge(self) -> None:
        now = self.clock()
        for t in [t for t, (_, exp) in self._tokens.items() if now >= exp]:
            del self._tokens[t]

    def __len__(self) -> int:
        return len(self._tokens)


class Throttle:
    """At most `failures` failed logins per address within `window_s`: the next attempts are refused (the API
    answers 429) until the oldest failure leaves the window. A success does not clear the failures. At most
    `max_addresses` addresses are tracked (the oldest forgotten first)."""

    def __init__(self, failures: int = 5, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 max_addresses: int = 10_000) -> None:
        self.failures, self.window_s, self.clock, self.max_addresses = failures, window_s, clock, max_addresses
        self._seen: dict[str, list[float]] = {}

    def _recent(self, address: str) -> list[float]:
        now = self.clock()
        times = [t for t in self._seen.get(address, ()) if now - t < self.window_s]
        if times:
            self._seen[address] = times
        else:
            self._seen.pop(address, None)
        return times

    def retry_after(self, address: str) -> float:
        """0 when a login from `address` may be tried now, else the seconds to wait."""
        times = self._recent(address)
        if len(times) < self.failures:
            return 0.0
        return max(0.001, self.window_s - (self.clock() - times[-self.failures]))

    def failed(self, address: str) -> None:
        times = self._recent(address)
        times.append(self.clock())
        self._seen.pop(address, None)
        self._seen[address] = times  # newest last: the oldest address is forgotten first
        while len(self._seen) > self.max_addresses:
            del self._seen[next(iter(self._seen))]
