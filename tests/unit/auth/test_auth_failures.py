"""tbmq_auth.failures: failed logins per address, the clock passed in."""

from __future__ import annotations

import pytest
from tbmq_auth.failures import LIFTED, FailedLogins, ban_record, bans_in_force, parse_ban


def test_an_address_is_banned_at_its_budget_then_refilled():
    """10 failures a minute: the tenth at once bans the address for the ban time, other addresses untouched;
    after the ban the bucket has refilled for the time it lasted."""
    f = FailedLogins(10, 60.0, 30.0)
    assert f and not FailedLogins(0, 60.0, 30.0)
    assert [f.failed("a", 0.0) for _ in range(9)] == [False] * 9
    assert f.retry_after("a", 0.0) == 0
    assert f.failed("a", 1.0)
    assert f.retry_after("a", 1.0) == pytest.approx(30.0) and f.retry_after("a", 30.9) == pytest.approx(0.1)
    assert f.retry_after("b", 1.0) == 0 and not f.failed("b", 1.0)
    assert f.retry_after("a", 31.0) == 0
    assert [f.failed("a", 31.0) for _ in range(5)] == [False] * 4 + [True]  # 30 s refilled 5 of the 10


def test_failures_at_the_refill_rate_are_never_banned():
    """A device retrying a wrong password every 6 s or slower (10 a minute) never reaches a ban; a little
    faster, it does in the end."""
    f = FailedLogins(10, 60.0, 30.0)
    assert not any(f.failed("dev", 6.0 * i) for i in range(100))
    g = FailedLogins(10, 60.0, 30.0)
    assert any(g.failed("guesser", 5.0 * i) for i in range(100))


def test_at_most_max_addresses_are_kept():
    f = FailedLogins(1, 60.0, 30.0, max_addresses=2)
    assert f.failed("a", 0.0) and f.retry_after("a", 0.0)
    f.failed("b", 0.0)
    f.failed("c", 0.0)
    assert len(f) == 2 and f.retry_after("a", 0.0) == 0  # "a" forgotten: the least recently failed


def test_a_ban_decided_elsewhere_is_imposed_and_never_shortened():
    """`ban`: another connector's ban of an address applies here (retry_after), a shorter one received later
    does not end it sooner, and the address's own failure budget is untouched by it."""
    f = FailedLogins(3, 60.0, 30.0)
    assert f.ban("a", 50.0, 10.0)
    assert f.retry_after("a", 10.0) == pytest.approx(40.0) and f.retry_after("b", 10.0) == 0
    assert not f.ban("a", 20.0, 11.0)  # shorter: kept as it was
    assert f.retry_after("a", 30.0) == pytest.approx(20.0)
    assert f.retry_after("a", 50.0) == 0
    assert [f.failed("a", 50.0) for _ in range(3)] == [False, False, True]  # a full budget: the ban took none
    assert f.ban("a", 200.0, 51.0) and f.retry_after("a", 100.0) == pytest.approx(100.0)  # longer: extended


def test_a_ban_lifted_ends_at_once_and_forgets_the_failures():
    f = FailedLogins(3, 60.0, 30.0)
    assert [f.failed("a", 0.0) for _ in range(3)] == [False, False, True]
    assert f.lift("a", 1.0) and f.retry_after("a", 1.0) == 0
    assert [f.failed("a", 1.0) for _ in range(3)] == [False, False, True]  # a full budget again
    assert not f.lift("b", 1.0)  # nothing in force: nothing lifted
    assert f.lift("a", 2.0) and not f.lift("a", 2.0)


def test_the_ban_records_format_round_trips_and_refuses_what_is_not_one():
    assert parse_ban(ban_record(1_800_000_000_000, "connector-1")) == (1_800_000_000_000, "connector-1")
    assert parse_ban(ban_record(LIFTED, "admin:ops")) == (0, "admin:ops")
    for bad in (b"", b"[]", b"{}", b"{\"until_ms\": \"x\", \"by\": \"c\"}", b"\xff"):
        with pytest.raises(ValueError, match="not a login ban"):
            parse_ban(bad)


def test_bans_in_force_are_those_not_ended_nor_lifted_in_address_order():
    bans = {"10.0.0.9": (2_000, "connector-2"), "10.0.0.1": (1_500, "connector-1"), "10.0.0.5": (999, "connector-1"),
            "10.0.0.7": (LIFTED, "admin:ops")}
    got = bans_in_force(bans, 1_000)
    assert list(got) == ["10.0.0.1", "10.0.0.9"]
    assert got["10.0.0.1"] == {"address": "10.0.0.1", "until_ms": 1_500, "by": "connector-1"}
    assert bans_in_force(bans, 2_000) == {}  # a ban ending now has ended
