"""The adaptive fetch window (tbmq_platform.coalesce): pure decisions on an injected clock."""

import asyncio
import pytest
from fake_timers import FakeTimers
from tbmq_platform.coalesce import AdaptiveFetch, FetchWindow, check_fetcher
from tbmq_platform.kafka import IDLE_FETCH_WAIT_MS


def feed(w: FetchWindow, rate: float, seconds: float, t0: float = 0.0, poll_s: float | None = None):
    """Polls of a consumer seeing `rate` records/s: one poll per record when idle (the broker answers at the
    first record), one per window when busy. Returns the time reached."""
    t = t0
    end = t0 + seconds
    while t < end:
        if poll_s is not None:
            step = poll_s
        elif w.window.busy:
            step = w.max_wait_s
        else:
            step = 1.0 / rate if rate else 0.5
        t += step
        w.observe(round(rate * step) if rate else 0, t)
    return t


def test_quiet_consumer_long_polls_and_answers_at_the_first_record():
    w = FetchWindow(max_wait_s=0.005)
    feed(w, 100, 2.0)  # 100 msg/s: half a record per 5 ms window
    assert not w.window.busy
    assert w.window.min_bytes == 1 and w.window.max_wait_ms == IDLE_FETCH_WAIT_MS  # the long poll
    assert 80 < w.rate < 120


def test_load_switches_to_the_window_and_back_when_it_goes():
    w = FetchWindow(max_wait_s=0.005)
    t = feed(w, 100, 1.0)
    assert not w.window.busy
    t = feed(w, 2000, 0.5, t)  # 10 records per window
    assert w.window.busy
    assert w.window.max_wait_ms == 5 and w.window.min_bytes == 1 << 20
    feed(w, 0, 3.0, t, poll_s=0.5)  # idle: empty polls
    assert not w.window.busy
    assert w.switches == 2


def test_hysteresis_keeps_the_mode_between_the_thresholds():
    w = FetchWindow(max_wait_s=0.005, enter_records=3, leave_records=1)
    t = feed(w, 1000, 1.0)  # 5 per window: busy
    assert w.window.busy
    feed(w, 400, 2.0, t)  # 2 per window: below enter, above leave
    assert w.window.busy
    w2 = FetchWindow(max_wait_s=0.005, enter_records=3, leave_records=1)
    feed(w2, 400, 2.0)
    assert not w2.window.busy


def test_one_odd_poll_does_not_flip_the_mode():
    w = FetchWindow(max_wait_s=0.005, tau_s=0.05)
    t = feed(w, 100, 1.0)
    w.observe(5, t + 0.001)  # a burst of five in one poll
    assert not w.window.busy


def test_zero_window_never_waits():
    w = FetchWindow(max_wait_s=0)
    feed(w, 5000, 1.0)
    assert not w.window.busy


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        FetchWindow(max_wait_s=0.01, tau_s=0)
    with pytest.raises(ValueError):
        FetchWindow(max_wait_s=0.01, enter_records=1, leave_records=2)


class _Fetcher:
    def __init__(self):
        self._fetch_min_bytes = 1
        self._fetch_max_wait_ms = 1500


class _Consumer:
    def __init__(self):
        self._fetcher = _Fetcher()


def test_adaptive_fetch_writes_the_window_into_the_fetcher():
    c = _Consumer()
    a = AdaptiveFetch(c, FetchWindow(max_wait_s=0.004))
    assert (c._fetcher._fetch_min_bytes, c._fetcher._fetch_max_wait_ms) == (1, IDLE_FETCH_WAIT_MS)
    t = 0.0
    for _ in range(50):
        t += 0.0005
        a.polled(1, t)  # 2000 records/s
    assert (c._fetcher._fetch_min_bytes, c._fetcher._fetch_max_wait_ms) == (1 << 20, 4)


def test_a_consumer_without_the_internals_is_refused():
    with pytest.raises(RuntimeError, match="adaptive fetch window"):
        check_fetcher(object())


def test_the_real_aiokafka_fetcher_has_the_internals():
    """The pinned aiokafka builds each FetchRequest from these two attributes."""
    import inspect

    from aiokafka.consumer import fetcher

    src = inspect.getsource(fetcher.Fetcher._get_actions_per_node)
    assert "self._fetch_max_wait_ms" in src and "self._fetch_min_bytes" in src


def test_adaptive_fetch_factory_and_batches():
    from tbmq_platform.coalesce import adaptive_fetch

    assert adaptive_fetch(_Consumer(), 0) is None  # the setting's 0 = off
    c = _Consumer()
    a = adaptive_fetch(c, 5)
    assert a.window.max_wait_s == 0.005
    a.polled_batches({"p0": [1, 2], "p1": [3]})
    a.polled_batches({})
    assert set(a.health()) == {"fetch_busy", "fetch_rate", "fetch_switches"}


def _producer():
    """A real (unstarted) aiokafka producer: its accumulator is made in the constructor."""
    from aiokafka import AIOKafkaProducer

    return AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", linger_ms=1)


async def test_adaptive_linger_lingers_under_load_and_not_when_quiet():
    from tbmq_platform.coalesce import AdaptiveLinger

    p = _producer()
    acc = p._message_accumulator
    a = AdaptiveLinger(p, busy_ms=5)  # quiet: the producer's own linger (1 ms)
    assert acc._linger_time == 0.001
    t = 0.0
    for _ in range(200):              # 100 records/s: half a record per 5 ms window
        t += 0.01
        a.sending(t)
    assert acc._linger_time == 0.001 and not a.health()["linger_busy"]
    for _ in range(500):              # 2,000 records/s: ten per window
        t += 0.0005
        a.sending(t)
    assert acc._linger_time == 0.005 and a.health()["linger_busy"]
    t += 1.0                          # the load stops: the next record does not wait for company
    a.sending(t)
    assert acc._linger_time == 0.001
    assert a.health()["linger_switches"] == 2


async def test_adaptive_linger_enters_and_leaves_at_the_same_rates_whatever_its_window():
    """Busy from 300 records a second, quiet again under 100, for a 10 ms and a 20 ms window alike: a longer
    window does not make slower traffic linger (with 3 and 1 records per window, 20 ms would linger from 150
    a second)."""
    from tbmq_platform.coalesce import AdaptiveLinger
    from tbmq_platform.settings import LINGER_ENTER_RATE, LINGER_LEAVE_RATE

    assert (LINGER_ENTER_RATE, LINGER_LEAVE_RATE) == (300.0, 100.0)

    def run(a, rate, seconds, t):
        for _ in range(int(rate * seconds)):
            t += 1 / rate
            a.sending(t)
        return t

    for busy_ms in (10, 20):
        p = _producer()
        acc = p._message_accumulator
        a = AdaptiveLinger(p, busy_ms=busy_ms)
        t = run(a, 200, 1.0, 0.0)      # 4 records per 20 ms window, under 300 a second: quiet
        assert acc._linger_time == 0.001 and not a.health()["linger_busy"], busy_ms
        t = run(a, 400, 1.0, t)        # over 300 a second: busy
        assert acc._linger_time == busy_ms / 1000 and a.health()["linger_busy"], busy_ms
        t = run(a, 150, 1.0, t)        # between the two rates: stays busy (hysteresis)
        assert a.health()["linger_busy"], busy_ms
        run(a, 50, 1.0, t)             # under 100 a second: quiet again
        assert acc._linger_time == 0.001 and a.health()["linger_switches"] == 2, busy_ms


async def test_adaptive_linger_observes_once_per_millisecond_and_counts_every_record():
    from tbmq_platform.coalesce import AdaptiveLinger

    a = AdaptiveLinger(_producer(), busy_ms=5)
    observed = []
    observe = a.window.observe
    a.window.observe = lambda n, now: observed.append(n) or observe(n, now)
    t = 0.0
    for _ in range(3000):             # 10,000 records/s for 0.3 s: ten records per millisecond
        t += 0.0001
        a.sending(t)
    assert len(observed) <= 301       # once per millisecond, not once per record
    assert sum(observed) + a._pending == 3000  # the records between observations are not lost
    assert 8000 < a.window.rate < 11000 and a.health()["linger_busy"]


async def test_adaptive_linger_lapses_to_the_short_linger_when_the_load_stops_without_another_record():
    """The producer's other records (session requests, marks, subscriptions: the CONNACK and SUBACK path)
    are not counted, so after a burst nothing but time tells the linger the load stopped: within a few
    windows it is back to 1 ms, and it keeps no timer while quiet."""
    from tbmq_platform.coalesce import AdaptiveLinger

    clock = FakeTimers()
    p = _producer()
    acc = p._message_accumulator
    a = AdaptiveLinger(p, busy_ms=20, clock=lambda: clock.now, call_later=clock.call_later)
    for _ in range(5000):                 # a burst of 5,000 records/s for a second
        clock.advance(0.0002)
        a.sending(clock.now)
    assert acc._linger_time == 0.02 and a.health()["linger_busy"]
    assert clock.pending() == 1           # one lapse check while busy, however many records
    clock.advance(0.02)                   # one window without a record: still busy (hysteresis, EWMA)
    assert acc._linger_time == 0.02
    clock.advance(0.5)                    # half a second without one: quiet again, no record needed
    assert acc._linger_time == 0.001 and not a.health()["linger_busy"]
    assert clock.pending() == 0           # and no timer left while quiet
    for _ in range(2000):                 # busy again; closing cancels the check
        clock.advance(0.0002)
        a.sending(clock.now)
    assert a.health()["linger_busy"] and clock.pending() == 1
    a.close()
    assert clock.pending() == 0


async def test_adaptive_linger_lapse_counts_the_records_handed_over_since_the_last_observation():
    """A lapse check between two observations takes the records sent meanwhile into the rate: at a steady
    busy load the checks do not make it look quieter than it is."""
    from tbmq_platform.coalesce import AdaptiveLinger

    clock = FakeTimers()
    a = AdaptiveLinger(_producer(), busy_ms=20, observe_every_s=0.01, clock=lambda: clock.now,
                       call_later=clock.call_later)
    for _ in range(20000):                # 2,000 records/s for 10 s, observed at most every 10 ms
        clock.advance(0.0005)
        a.sending(clock.now)
    assert a.health()["linger_busy"] and 1800 < a.window.rate < 2200
    assert a.health()["linger_switches"] == 1


async def test_an_urgent_record_opens_a_batch_with_the_short_linger_while_busy():
    """A session request or a subscription set sent while PUBLISHes keep the producer busy does not wait out
    the busy window: its batch gets the short linger, and the PUBLISHes after it the window again."""
    from aiokafka.producer.message_accumulator import MessageBatch
    from tbmq_platform.coalesce import AdaptiveLinger

    clock = FakeTimers()
    p = _producer()
    acc = p._message_accumulator
    a = AdaptiveLinger(p, busy_ms=20, clock=lambda: clock.now, call_later=clock.call_later)
    for _ in range(5000):
        clock.advance(0.0002)
        a.sending(clock.now)
    assert acc._linger_time == 0.02
    opened = {}

    def open_batch(topic: str) -> MessageBatch:  # what add_message does for a partition without a batch
        opened[topic] = acc._append_batch(acc.create_builder(), _tp(topic))
        return opened[topic]

    open_batch("tbmq.msg.all")            # PUBLISHes lingering the busy window on a partition
    opened["tbmq.msg.all"].append(b"k", b"publish", None)
    open_batch("tbmq.client.session")     # and on another one
    opened["tbmq.client.session"].append(b"k", b"v", None)
    with a.urgent():
        open_batch("tbmq.session.event.request")
    assert opened["tbmq.session.event.request"]._linger_time == 0.001
    waiter = acc._waiter_future = asyncio.get_running_loop().create_future()  # as the sender leaves it
    with a.urgent():
        opened["tbmq.msg.all"].append(b"k", None, None)  # a mark joins the lingering batch
    assert opened["tbmq.msg.all"]._linger_time == 0.001   # it leaves without waiting out the window
    assert waiter.done()                  # the sender is woken to see it
    assert opened["tbmq.client.session"]._linger_time == 0.02  # what the urgent records did not join waits
    waiter = acc._waiter_future = asyncio.get_running_loop().create_future()
    with a.urgent():
        pass                              # nothing joined: nothing hurried, nobody woken
    assert not waiter.done()
    open_batch("tbmq.msg.all.next")
    assert opened["tbmq.msg.all.next"]._linger_time == 0.02  # PUBLISHes after it: the window again
    clock.advance(1.0)                    # quiet by now: urgent() leaves the short linger as it was
    with a.urgent():
        pass
    assert acc._linger_time == 0.001


def _tp(topic: str):
    from aiokafka.structs import TopicPartition

    return TopicPartition(topic, 0)


async def test_the_real_aiokafka_accumulator_reads_the_linger_when_it_opens_a_batch():
    """The pinned aiokafka gives each new MessageBatch the accumulator's _linger_time."""
    import inspect

    from aiokafka.producer import message_accumulator
    from tbmq_platform.coalesce import check_producer

    src = inspect.getsource(message_accumulator.MessageAccumulator._append_batch)
    assert "self._linger_time" in src
    check_producer(_producer())
    src = inspect.getsource(message_accumulator.MessageBatch.remaining_linger)
    assert "self._linger_time" in src     # urgent(): a batch's own linger, read whenever the sender drains
    with pytest.raises(RuntimeError, match="adaptive linger"):
        check_producer(object())
