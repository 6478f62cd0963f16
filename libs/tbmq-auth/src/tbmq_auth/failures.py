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

The budget is one per address across every connector (`LoginLedger`, a connector's two tables): each
connector writes its failed logins to tbmq.security.login.bans (`failure_record`) and spends every connector's
as it reads them (`failed` with the failure's own time, which may be earlier than the last one counted: no
refill is then credited), so a guesser spreading its attempts over N connectors gets one budget, not N.
`ban(address, until, now)` imposes a ban decided elsewhere (another connector's, read from the same topic), so
every connector bans the address once one does; `lift(address, now)` ends one early (an administrator's). `ban_record` /
`failure_record` / `parse_login_record`: the one format of that topic's values, written by the connectors, the
admin API and `tbmq login-bans`; `bans_in_force`: which bans are still in force (the admin API's list and lift,
the command line's).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping

from .buckets import refilled

LIFTED = 0  # a tbmq.security.login.bans record ending at 0: the ban lifted by an administrator
BAN = "ban"  # the kinds of tbmq.security.login.bans records (parse_login_record)
FAILED = "failed"


def ban_record(until_ms: int, by: str) -> bytes:
    """A tbmq.security.login.bans value: when the ban ends (Unix ms; LIFTED: lifted) and who wrote it."""
    return json.dumps({"until_ms": until_ms, "by": by}, separators=(",", ":")).encode()


def failure_record(at_ms: int, by: str) -> bytes:
    """A tbmq.security.login.bans value: one failed login (Unix ms) on connector `by`."""
    return json.dumps({"failed_ms": at_ms, "by": by}, separators=(",", ":")).encode()


def parse_login_record(value: bytes) -> tuple[str, int, str]:
    """(BAN, until_ms, by) or (FAILED, at_ms, by) of a tbmq.security.login.bans value; ValueError when it is
    neither."""
    try:
        record = json.loads(value)
        if "failed_ms" in record:
            return FAILED, int(record["failed_ms"]), str(record["by"])
        return BAN, int(record["until_ms"]), str(record["by"])
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"not a login ban nor a failed login: {value[:80]!r}") from exc


def keep_ban(bans: dict[str, tuple[int, str]], key: bytes | None, value: bytes | None) -> None:
    """Keep in `bans` (address -> (until_ms, by)) the last ban record of each address of tbmq.security.login.bans,
    the table `bans_in_force` reads; its failed logins are skipped. ValueError when `value` is neither."""
    if key is None or not value:
        return
    kind, ms, by = parse_login_record(value)
    if kind == BAN:
        bans[key.decode()] = (ms, by)


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
        """One more failed login from `address` at `now`: True when it starts a ban. `now` may be earlier than
        the address's last failure (another connector's, read late): it is then spent without a refill."""
        tokens, at, until = self._addresses.pop(address, (self.burst, now, 0.0))
        tokens = refilled(tokens, now - at, self.rate, self.burst) - 1.0
        starts = tokens < 1.0 and now >= until
        if starts:
            until = now + self.ban_s
        self._addresses[address] = (max(tokens, 0.0), max(now, at), until)
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


# What a connector does after `LoginLedger.failed` / `LoginLedger.record` (its counters are named after them).
BANNED = "login_bans"  # a ban started by this connector's failure: write it (ban_record) and count it
BANNED_SHARED = "login_bans_shared"  # a ban started here by another connector's failure or ban record
FAILURE_SHARED = "login_failures_shared"  # another connector's failed login spent here
BAN_LIFTED = "login_bans_lifted"  # a ban in force here lifted by an administrator


class LoginLedger:
    """One connector's failed logins and bans, kept from its own CONNECTs and from tbmq.security.login.bans
    (pure: `now` is a monotonic clock in seconds, `wall_ms` the Unix time in ms; `me` the connector's id).

    * `failed(address, now)`: one of this connector's failed logins, counted at once in `own` (a guesser on one
      connector is banned at its budget without waiting for Kafka). The caller writes its failure_record.
    * `record(address, value, now, wall_ms)`: a record of the topic, every connector's, this one's too. A failed
      login is spent in `shared` as of the time it happened (one older than the window is refilled already):
      every connector spends the same failures in the topic's order, so all of them ban at the same failure,
      the budget is one across them, and the connector whose failure it was writes the ban (BANNED). A ban
      refuses the address until it ends; LIFTED ends it at once, both tables forgetting its failures.
    * Until `live` (the caller's catch-up to the topic's end at start), records change the tables only: a
      restarted connector's bans and budgets hold again, and nothing is written or counted twice.

    Each returns the events that happened (BANNED, BANNED_SHARED, FAILURE_SHARED, BAN_LIFTED)."""

    def __init__(self, max_failures: int, window_s: float, ban_s: float, me: str,
                 max_addresses: int = 100_000) -> None:
        self.own = FailedLogins(max_failures, window_s, ban_s, max_addresses)
        self.shared = FailedLogins(max_failures, window_s, ban_s, max_addresses)
        self.window_s = window_s
        self.me = me
        self.live = False

    def __bool__(self) -> bool:
        return bool(self.own)

    def ban_left(self, address: str, now: float) -> float:
        """Seconds the ban of `address` has left (0: none)."""
        return max(self.own.retry_after(address, now), self.shared.retry_after(address, now))

    def failed(self, address: str, now: float) -> tuple[str, ...]:
        return (BANNED,) if self.own.failed(address, now) else ()

    def record(self, address: str, value: bytes, now: float, wall_ms: int) -> tuple[str, ...]:
        """ValueError when `value` is not a record of the topic."""
        kind, ms, by = parse_login_record(value)
        own, age_s = by == self.me, (wall_ms - ms) / 1000
        if kind == FAILED:
            if age_s >= self.window_s:
                return ()
            events = () if own or not self.live else (FAILURE_SHARED,)
            was_banned = self.ban_left(address, now) > 0
            if self.shared.failed(address, now - max(0.0, age_s)) and self.live and not was_banned:
                events += (BANNED,) if own else (BANNED_SHARED,)
            return events
        if ms == LIFTED:
            lifted = [f.lift(address, now) for f in (self.own, self.shared)]
            return (BAN_LIFTED,) if any(lifted) and self.live else ()
        if age_s >= 0:
            return ()  # ended
        was_banned = self.ban_left(address, now) > 0
        if self.own.ban(address, now - age_s, now) and self.live and not was_banned and not own:
            return (BANNED_SHARED,)
        return ()


__all__ = ["BAN", "BANNED", "BANNED_SHARED", "BAN_LIFTED", "FAILED", "FAILURE_SHARED", "FailedLogins", "LIFTED",
           "LoginLedger", "ban_record", "bans_in_force", "failure_record", "keep_ban", "parse_login_record"]
