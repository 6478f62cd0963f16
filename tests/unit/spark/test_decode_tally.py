"""device-persistence's per-second tallies (tbmq_device_persistence.tally) as the statistics job reads them
(tbmq_spark.decode): a tally of N copies gives the rows the N tbmq.msg.persisted records of those copies give
(ROUTER_PERSIST_VIA=kafka), summed, at the tally's second."""

from __future__ import annotations

import random
from collections import Counter

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics as T
from tbmq_spark.decode import message_metrics

from tbmq_device_persistence.tally import Tallies


def _copies(rng: random.Random, n: int) -> list[pb.PublishMsg]:
    return [pb.PublishMsg(topic=f"t/{i}", payload=bytes(rng.randrange(0, 300)), qos=rng.randrange(0, 3))
            for i in range(n)]


def _summed(rows) -> Counter:
    out: Counter = Counter()
    for _, metric, dim, value in rows:
        out[(metric, dim)] += value
    return out


def test_a_tally_counts_what_the_records_of_its_copies_count():
    rng = random.Random(7)
    for n in (1, 5, 200):
        copies = _copies(rng, n)
        tallies = Tallies()
        tallies.add(1_700_000_000, copies[: n // 2])
        tallies.add(1_700_000_000, copies[n // 2:])
        [tally] = tallies.take_done(1_700_000_001.0)
        assert tally.second_ms == 1_700_000_000_000
        rows = message_metrics(T.MSG_PERSISTED_TALLY, tally.SerializeToString(), 0)
        assert {t for t, *_ in rows} == {tally.second_ms}
        records = [row for m in copies for row in message_metrics(
            T.MSG_PERSISTED, pb.PersistedMsg(client_id="c", msg=m).SerializeToString(), 5)]
        assert _summed(rows) == _summed(records)


def test_tallies_are_handed_out_once_their_second_is_over_and_kept_when_a_write_fails():
    copies = _copies(random.Random(1), 6)
    tallies = Tallies()
    tallies.add(10, copies[:2])
    tallies.add(11, copies[2:3])
    assert tallies.take_done(10.99) == [] and tallies
    first = tallies.take_done(11.0)
    assert [(t.second_ms, t.copies) for t in first] == [(10_000, 2)]
    tallies.put_back(first)                 # the write failed
    tallies.add(10, copies[3:])             # a late batch of the same second
    again = tallies.take_done(12.5)
    assert [(t.second_ms, t.copies) for t in again] == [(10_000, 5), (11_000, 1)]
    assert sum(again[0].copies_by_qos) == 5
    assert again[0].payload_bytes == sum(len(m.payload) for m in copies[:2] + copies[3:])
    assert not tallies and tallies.take_all() == []
    tallies.add(12, copies[:1])
    assert [t.second_ms for t in tallies.take_all()] == [12_000]  # at stop: the current second too


def test_pending_tallies_are_bounded():
    from tbmq_device_persistence.tally import MAX_PENDING_SECONDS

    tallies = Tallies()
    one = _copies(random.Random(2), 1)
    for s in range(MAX_PENDING_SECONDS + 3):
        tallies.add(s, one)
    assert tallies.dropped == 3
    done = tallies.take_done(10**9)
    assert len(done) == MAX_PENDING_SECONDS and done[0].second_ms == 3000
    # a write that keeps failing: each attempt takes the pending tallies and puts them back with the seconds
    # counted meanwhile; the bound holds across the attempts, the oldest dropped
    tallies.put_back(done)
    for attempt in range(4):
        failed = tallies.take_done(10**9)
        tallies.add(10**6 + attempt, one)
        tallies.put_back(failed)
    kept = tallies.take_all()
    assert len(kept) == MAX_PENDING_SECONDS and tallies.dropped == 3 + 4
    assert [t.second_ms // 1000 for t in kept[-4:]] == [10**6 + a for a in range(4)]
