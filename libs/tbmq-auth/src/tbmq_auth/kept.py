"""Values kept for a while by key, bounded in number: the one rule of the connector's caches of authentication
results (`tbmq_auth.http.AnswerCache`: the `http` provider's answers; `tbmq_auth.passwords.VerifiedPasswords`:
passwords verified). Pure: the time is passed in (seconds on a monotonic clock); not thread-safe on its own."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class Kept(Generic[V]):
    """Values by key for `ttl_s` after they were put, at most `max_entries` of them (the one put longest ago
    dropped first). `ttl_s` 0 keeps nothing (the instance is then false)."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._values: OrderedDict[bytes, tuple[V, float]] = OrderedDict()

    def __bool__(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: bytes, now: float) -> V | None:
        """The value put under `key` less than `ttl_s` before `now`; None otherwise (an expired one is dropped)."""
        got = self._values.get(key)
        if got is None:
            return None
        if now >= got[1]:
            del self._values[key]
            return None
        return got[0]

    def put(self, key: bytes, value: V, now: float) -> None:
        """Keep `value` until `now` + `ttl_s` (again from now if the key was kept); nothing when off."""
        if not self:
            return
        self._values.pop(key, None)
        self._values[key] = (value, now + self.ttl_s)
        while len(self._values) > self.max_entries:
            self._values.popitem(last=False)


__all__ = ["Kept"]
