"""tbmq_auth.failures: failed logins per address, the clock passed in."""

from __future__ import annotations

import pytest
from tbmq_auth.buckets import refilled
from tbmq_auth.failures import (BAN, BAN_LIFTED, BANNED, BANNED_SHARED, FAILED, FAILURE_SHARED, LIFTED,
                                FailedLogins, LoginLedger, ban_record, bans_in_force, failure_record, keep_ban,
                                parse_login_record)


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


def test_the_records_format_round_trips_and_refuses_what_is_neither():
    assert parse_login_record(ban_record(1_800_000_000_000, "connector-1")) == (BAN, 1_800_000_000_000, "connector-1")
    assert parse_login_record(ban_record(LIFTED, "admin:ops")) == (BAN, 0, "admin:ops")
    assert parse_login_record(failure_record(1_700_000_000_123, "connector-2")) == (FAILED, 1_700_000_000_123,
                                                                                   "connector-2")
    for bad in (b"", b"[]", b"{}", b"{\"until_ms\": \"x\", \"by\": \"c\"}", b"{\"failed_ms\": 1}", b"\xff"):
        with pytest.raises(ValueError, match="not a login ban nor a failed login"):
            parse_login_record(bad)


def test_the_bans_table_keeps_each_addresss_last_ban_past_its_failures():
    """keep_ban: the admin API's and the command line's table; a failed login after a ban leaves it listed."""
    bans: dict = {}
    keep_ban(bans, b"10.0.0.1", ban_record(5_000, "connector-1"))
    keep_ban(bans, b"10.0.0.1", failure_record(4_000, "connector-2"))
    keep_ban(bans, b"10.0.0.2", failure_record(4_000, "connector-2"))
    keep_ban(bans, None, ban_record(9_000, "connector-1"))
    assert bans == {"10.0.0.1": (5_000, "connector-1")}
    keep_ban(bans, b"10.0.0.1", ban_record(LIFTED, "admin:ops"))
    assert bans == {"10.0.0.1": (LIFTED, "admin:ops")}
    with pytest.raises(ValueError):
        keep_ban(bans, b"10.0.0.3", b"{}")


def test_failures_counted_late_spend_the_one_budget_without_a_refill():
    """Another connector's failures arrive after this one's later ones: each is spent as of its own time, an
    earlier time crediting no refill, so two connectors' failures at once leave the address one budget."""
    f = FailedLogins(4, 60.0, 30.0)
    assert [f.failed("a", 10.0), f.failed("a", 10.5)] == [False, False]  # this connector's
    assert not f.failed("a", 9.0)  # another's, older: spent, no refill for going back in time
    assert f.failed("a", 10.2)  # the fourth at once: banned from its own time
    assert f.retry_after("a", 10.5) == pytest.approx(29.7)
    g = FailedLogins(4, 60.0, 30.0)
    assert [g.failed("a", t) for t in (10.0, 10.5, 9.0, 26.0)] == [False] * 4  # 15.5 s refilled about one


def test_bans_in_force_are_those_not_ended_nor_lifted_in_address_order():
    bans = {"10.0.0.9": (2_000, "connector-2"), "10.0.0.1": (1_500, "connector-1"), "10.0.0.5": (999, "connector-1"),
            "10.0.0.7": (LIFTED, "admin:ops")}
    got = bans_in_force(bans, 1_000)
    assert list(got) == ["10.0.0.1", "10.0.0.9"]
    assert got["10.0.0.1"] == {"address": "10.0.0.1", "until_ms": 1_500, "by": "connector-1"}
    assert bans_in_force(bans, 2_000) == {}  # a ban ending now has ended


def test_the_refill_rule_caps_at_the_burst_and_never_refills_backwards():
    assert refilled(1.0, 2.0, 0.5, 10.0) == 2.0
    assert refilled(9.5, 2.0, 0.5, 10.0) == 10.0  # capped
    assert refilled(1.0, -5.0, 0.5, 10.0) == 1.0  # an event timed before the last one counted


WALL = 1_800_000_000_000  # Unix ms at monotonic 1000.0 in the ledger tests


def ledger(live: bool = True) -> LoginLedger:
    g = LoginLedger(3, 600.0, 20.0, "connector-1")
    g.live = live
    return g


def failure(at: float, by: str = "connector-2") -> bytes:
    """A failed login at monotonic `at` (WALL at 1000.0)."""
    return failure_record(int(WALL + (at - 1000.0) * 1000), by)


def test_the_ledger_bans_at_the_budget_spread_over_the_connectors():
    """Two failures on connector 2, read here, then one here: the budget (3) is used up by this connector's
    failure read back, so this connector bans and writes the ban; the same failures read on connector 2 ban it
    there as another's (no second ban record)."""
    here, there = ledger(), LoginLedger(3, 600.0, 20.0, "connector-2")
    there.live = True
    records = [failure(1000.0), failure(1000.5), failure(1001.0, "connector-1")]
    assert here.record("a", records[0], 1000.1, WALL + 100) == (FAILURE_SHARED,)
    assert here.record("a", records[1], 1000.6, WALL + 600) == (FAILURE_SHARED,)
    assert here.failed("a", 1001.0) == ()  # its own, at once: one failure in its own table
    assert here.ban_left("a", 1001.0) == 0
    assert here.record("a", records[2], 1001.1, WALL + 1100) == (BANNED,)  # read back: the third of three
    assert here.ban_left("a", 1001.1) == pytest.approx(19.9)
    for i, r in enumerate(records):
        got = there.record("a", r, 1001.2 + i / 10, WALL + 1200 + i * 100)
        assert got == ((FAILURE_SHARED, BANNED_SHARED) if i == 2 else ())  # its own two, then connector 1's
    assert there.ban_left("a", 1001.5) > 19 and there.ban_left("b", 1001.5) == 0


def test_the_ledger_bans_its_own_failures_at_once_and_once():
    g = ledger()
    assert [g.failed("a", 1000.0) for _ in range(3)] == [(), (), (BANNED,)]
    for _ in range(3):  # read back: already banned, nothing more
        assert g.record("a", failure(1000.0, "connector-1"), 1000.2, WALL + 200) == ()
    assert g.record("a", ban_record(WALL + 20_000, "connector-1"), 1000.3, WALL + 300) == ()


def test_the_ledger_applies_another_connectors_ban_and_a_lifting():
    g = ledger()
    assert g.record("a", ban_record(WALL + 30_000, "connector-2"), 1000.0, WALL) == (BANNED_SHARED,)
    assert g.ban_left("a", 1010.0) == pytest.approx(20.0)
    assert g.record("a", ban_record(WALL - 1, "connector-2"), 1000.0, WALL) == ()  # ended already
    assert g.record("a", ban_record(LIFTED, "admin:ops"), 1011.0, WALL + 11_000) == (BAN_LIFTED,)
    assert g.ban_left("a", 1011.0) == 0
    assert g.record("a", ban_record(LIFTED, "admin:ops"), 1012.0, WALL + 12_000) == ()  # none in force
    assert [g.failed("a", 1012.0) for _ in range(3)] == [(), (), (BANNED,)]  # a full budget again


def test_the_ledger_skips_failures_older_than_the_window_and_refuses_what_is_not_a_record():
    g = ledger()
    for _ in range(3):
        assert g.record("a", failure(400.0), 1000.0, WALL) == ()  # 600 s old: refilled already
    assert g.ban_left("a", 1000.0) == 0
    with pytest.raises(ValueError):
        g.record("a", b"{}", 1000.0, WALL)


def test_a_restarted_ledger_rebuilds_bans_and_budgets_before_it_is_live():
    """Read before `live` (a restart's catch-up), the topic's records change the tables and return nothing:
    the ban still holds, an address two failures in has one left, and nothing is written or counted."""
    g = ledger(live=False)
    records = [("a", failure(990.0 + i, "connector-1" if i % 2 else "connector-2")) for i in range(3)]
    records += [("a", ban_record(WALL + 10_000, "connector-2"))]
    records += [("b", failure(995.0)), ("b", failure(996.0, "connector-1"))]
    assert [g.record(addr, r, 1000.0, WALL) for addr, r in records] == [()] * len(records)
    assert g.ban_left("a", 1000.0) == pytest.approx(12.0)  # the failures' own ban: 992 + 20
    g.live = True
    assert g.ban_left("b", 1000.0) == 0 and g.failed("b", 1000.0) == ()  # its own table: one failure
    assert g.record("b", failure(1000.0, "connector-1"), 1000.1, WALL + 100) == (BANNED,)  # the third in all
