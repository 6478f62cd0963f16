"""The Will Delay timer of connector.wills on a fake clock: sent exactly when the delay has passed, never
before, and cancelled by a reconnect in time [MQTT-3.1.3-9] — no sleeps, no event loop."""

from __future__ import annotations

from tbmq.v1 import messages_pb2 as pb

from connector.wills import Wills
from fake_timers import FakeTimers


def wills_on_fake_clock():
    sent: list[str] = []
    timers = FakeTimers()
    return Wills(lambda cid, will, level: sent.append(cid), call_later=timers.call_later), timers, sent


def test_delayed_will_is_sent_when_the_delay_has_passed_and_not_before():
    wills, timers, sent = wills_on_fake_clock()
    wills.schedule("a", "s1", object(), 5, 2.0)
    timers.advance(1.999)
    assert sent == [] and "a" in wills.pending
    timers.advance(0.001)
    assert sent == ["a"] and "a" not in wills.pending


def test_reconnect_within_the_delay_cancels_it_for_good():
    wills, timers, sent = wills_on_fake_clock()
    wills.schedule("b", "s1", object(), 5, 3.0)
    timers.advance(2.5)
    wills.on_connected("b", clean_start=False)
    timers.advance(3600)
    assert sent == [] and not wills.pending


def test_reconnect_on_another_connector_within_the_delay_cancels_it():
    wills, timers, sent = wills_on_fake_clock()
    wills.schedule("c", "s1", object(), 5, 3.0)
    timers.advance(1.0)
    info = pb.SessionInfo(client_id="c", session_id="s2", connected=True, clean_start=False)
    wills.on_session_record(b"c", info.SerializeToString())
    timers.advance(3600)
    assert sent == [] and not wills.pending


def test_a_new_schedule_replaces_the_old_timer():
    wills, timers, sent = wills_on_fake_clock()
    wills.schedule("d", "s1", object(), 5, 1.0)
    wills.schedule("d", "s2", object(), 5, 5.0)
    timers.advance(1.0)
    assert sent == []
    timers.advance(4.0)
    assert sent == ["d"]


def test_clean_start_elsewhere_or_session_removal_sends_at_once():
    wills, timers, sent = wills_on_fake_clock()
    wills.schedule("e", "s1", object(), 5, 10.0)
    wills.on_connected("e", clean_start=True)
    wills.schedule("f", "s1", object(), 5, 10.0)
    wills.on_session_record(b"f", None)
    assert sent == ["e", "f"]
    timers.advance(3600)
    assert sent == ["e", "f"]
