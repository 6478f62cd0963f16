"""Failed logins per address, the one rule of the connector's CONNECTs (MQTT_LOGIN_FAILURES_PER_IP) and the
admin API's logins (ADMIN_LOGIN_FAILURES). Pure: the time is passed in (seconds, any monotonic clock).

An address may fail `max_failures` times at once, and then once more every `window_s / max_failures` seconds
(a token bucket holding `max_failures`, refilled over `window_s`). The failure that leaves less than one in the
bucket bans the address for `ban_s`: `retry_after(address, now)` is then the seconds left, and the caller
refuses the address's attempts whatever their credentials (the connector: CONNACK 0x8A Banned; the admin API:
429 with Retry-After) without checking them, so a guesser gets `max_failures` tries per window and costs no
password hashing beyond that, while a device retrying a wrong password with back-off is never banned. At most
`max_addresses` addresses are tracked (the least recently failed forgotten first), so a flood from many
addresses costs bounded memory.

`ban(address, until, now)` imposes a ban decided elsewhere (the connector: another connector's, read from
tbmq.security.login.bans), so a guesser spreading its attempts over several connectors is banned on all of
them once one bans it; `lift(address, now)` ends one early (an administrator's). `ban_record` / `parse_ban`:
the one format of that topic's values, written by the connectors, the admin API and `tbmq login-bans`;
`bans_in_force`: which of them still ban (the admin API's list and lift, the command line's).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping

LIFTED = 0  # a tbmq.security.login.bans record ending at 0: the ban lifted by an administrator


def ban_record(until_ms: int, by: str) -> bytes:
    """A tbmq.security.login.bans value: when the ban ends (Unix ms; LIFTED: lifted) and who wrote it."""
    return json.dumps({"until_ms": until_ms, "by": by}, separators=(",", ":")).encode()


def parse_ban(value: bytes) -> tuple[int, str]:
    """(until_ms, by) of a tbmq.security.login.bans value; ValueError when it is not one."""
    try:
        ban = json.loads(value)
        return int(ban["until_ms"]), str(ban["by"])
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"not a login ban: {value[:80]!r}") from exc


def bans_in_force(bans: Mapping[str, tuple[int, str]], now_ms: int) -> dict[str, dict]:
    """{address: {"address", "until_ms", "by"}} of the parsed records `bans` (address -> (until_ms, by)) whose
    ban has not ended at `now_ms` (a lifted one has: it ends at LIFTED), in address order."""
    return {a: {"address": a, "until_ms": until, "by": by}
            for a, (until, by) in sorted(bans.items()) if until > now_ms}


class FailedLogins:
    def __init__(self, max_failures: int, window_s: float, ban_s: float, max_addresses: int = 100_000) -> None:
        self.burst = float(max_failures)
        self.rate = max_failures / window_s if window_s > 0 else 0.0
        self.ban_s = ban_s
        self.max_addresses = max_addresses
        self._addresses: OrderedDict[str, tuple[float, float, float]] = OrderedDict()  # -> (tokens, at, until)

    def __bool__(self) -> bool:
        """Whether failures are limited at all (max_failures 0: no limit)."""
        return self.burst > 0

    def retry_after(self, address: str, now: float) -> float:
        """0 when `address` may try now, else the seconds its ban has left."""
        got = self._addresses.get(address)
        return got[2] - now if got is not None and now < got[2] else 0.0

    def failed(self, address: str, now: float) -> bool:
        """One more failed login from `address`: True when it starts a ban."""
        tokens, at, until = self._addresses.pop(address, (self.burst, now, 0.0))
        tokens = min(self.burst, tokens + (now - at) * self.rate) - 1.0
        starts = tokens < 1.0 and now >= until
        if starts:
            until = now + self.ban_s
        self._addresses[address] = (max(tokens, 0.0), now, until)
        if len(self._addresses) > self.max_addresses:
            self._addresses.popitem(last=False)
        return starts

    def ban(self, address: str, until: float, now: float) -> bool:
        """A ban of `address` until `until` (the clock of `now`), kept if it already lasts longer: True when it
        bans longer than before."""
        tokens, at, current = self._addresses.pop(address, (self.burst, now, 0.0))
        self._addresses[address] = (tokens, at, max(current, until))
        if len(self._addresses) > self.max_addresses:
            self._addresses.popitem(last=False)
        return until > current

    def lift(self, address: str, now: float) -> bool:
        """The ban of `address` ended now, and its failures forgotten: True when a ban was in force."""
        got = self._addresses.pop(address, None)
        return got is not None and now < got[2]

    def __len__(self) -> int:
        return len(self._addresses)


__all__ = ["FailedLogins", "LIFTED", "ban_record", "bans_in_force", "parse_ban"]
