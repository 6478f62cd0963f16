"""Pure logic of app-delivery: acknowledged prefix, DUP marks, origins, batch bounds, shared filters,
settings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from app_delivery.settings import AppDeliverySettings, load_settings
from app_delivery.tracking import (METADATA_MAX_CHARS, NO_MARK, AckTracker, BatchLimit, PartOrigins, SharedFilters,
                                   decode_mark, decode_origins, encode_mark, exact_mark, is_redelivery,
                                   needs_reservation, record_size, reservation_mark)
from tbmq_platform.settings import SettingsError

pytestmark = pytest.mark.unit


def test_nothing_seen_has_no_commit_point():
    t = AckTracker()
    assert t.commit_point() is None
    assert t.outstanding == 0


def test_commit_point_is_the_first_unacknowledged():
    t = AckTracker()
    for o in range(10, 15):
        t.sent(o)
    assert t.commit_point() == 10
    assert t.ack(11) and t.ack(12)
    assert t.commit_point() == 10  # never past the unacknowledged 10 (TBMQ #320)
    assert t.ack(10)
    assert t.commit_point() == 13
    assert t.ack(14)
    assert t.commit_point() == 13
    assert t.ack(13)
    assert t.commit_point() == 15
    assert t.outstanding == 0


def test_skipped_records_count_as_acknowledged_and_gaps_are_fine():
    t = AckTracker()
    t.skipped(0)
    assert t.commit_point() == 1
    t.sent(1)
    t.skipped(2)
    t.sent(5)  # offsets 3, 4: transaction markers / compacted
    assert t.commit_point() == 1
    t.ack(1)
    assert t.commit_point() == 5
    t.ack(5)
    assert t.commit_point() == 6
    assert t.last_seen == 5


def test_unknown_and_repeated_acks_change_nothing():
    t = AckTracker()
    t.sent(3)
    assert not t.ack(2)
    assert not t.ack(4)
    assert t.ack(3)
    assert not t.ack(3)
    assert t.commit_point() == 4


def test_offsets_must_increase():
    t = AckTracker()
    t.sent(5)
    with pytest.raises(ValueError):
        t.sent(5)


def test_out_of_order_acks_random():
    import random

    rnd = random.Random(7)
    t = AckTracker()
    offsets = list(range(1000))
    for o in offsets:
        t.sent(o)
    order = offsets[:]
    rnd.shuffle(order)
    acked = set()
    for o in order:
        t.ack(o)
        acked.add(o)
        expect = next((x for x in offsets if x not in acked), 1000)
        assert t.commit_point() == expect
        assert t.outstanding == 1000 - len(acked)


def test_marks_round_trip_and_foreign_metadata():
    assert decode_mark(encode_mark(41)) == 41
    assert decode_mark("") == NO_MARK          # the registry's clean-start reset
    assert decode_mark(None) == NO_MARK
    assert decode_mark("dup:xyz") == NO_MARK
    assert decode_mark("something else") == NO_MARK


def test_origins_ride_in_the_metadata_beside_the_mark():
    meta = encode_mark(41, {3: 1000, 0: 7})
    assert meta == "dup:41;o:0=7,3=1000"
    assert decode_mark(meta) == 41 and decode_origins(meta) == {0: 7, 3: 1000}
    assert encode_mark(41, {}) == "dup:41" and decode_origins("dup:41") == {}  # a mark of an older instance
    assert decode_origins("") == {} and decode_origins(None) == {} and decode_origins("dup:1;o:x=1") == {}
    # too many origin partitions for Kafka's metadata bound: the mark alone (never a refused commit)
    many = {p: 10**15 for p in range(400)}
    assert encode_mark(5, many) == "dup:5" and len(encode_mark(5, {p: 1 for p in range(10)})) < METADATA_MAX_CHARS


def test_a_routers_replay_is_taken_once_and_the_commit_carries_what_was_taken():
    o = PartOrigins()
    # offsets 10.. of this partition; origins (tbmq.msg.all partition, offset)
    assert o.first(10, 2, 500) and o.first(11, 2, 501) and o.first(12, 5, 90)
    assert not o.first(13, 2, 500) and not o.first(14, 2, 501)  # the replay, after the originals
    assert o.first(15, 2, 502)
    assert o.at(12) == {2: 501}                  # commit point 12: records 10 and 11 are below it
    assert o.at(16) == {2: 502, 5: 90}
    # the next stream (another instance) starts from the committed metadata: the replay of what was
    # taken before the commit is skipped, what comes after is not
    nxt = PartOrigins(decode_origins(encode_mark(15, o.at(16))))
    assert not nxt.first(16, 2, 501) and not nxt.first(17, 5, 90)
    assert nxt.first(18, 2, 503) and nxt.first(19, 7, 0)
    # origins another member committed meanwhile are merged in
    nxt.merge({7: 40})
    assert not nxt.first(20, 7, 40) and nxt.first(21, 7, 41)


def test_redelivery_decision():
    assert is_redelivery(5, 5)
    assert is_redelivery(0, 5)
    assert not is_redelivery(6, 5)
    assert not is_redelivery(0, NO_MARK)
    assert needs_reservation(10, 9)
    assert not needs_reservation(10, 10)


def test_the_mark_is_reserved_ahead_so_later_polls_need_no_commit():
    mark = reservation_mark(NO_MARK, 4, 500)              # a first batch 0..4
    assert mark == 504
    for last in (9, 250, 504):                            # the next polls stream under it: no commit
        assert not needs_reservation(last, mark)
    assert needs_reservation(505, mark)
    assert reservation_mark(mark, 505, 500) == 1005       # the next reservation, ahead again
    assert reservation_mark(1005, 505, 500) == 1005       # never backwards
    assert reservation_mark(NO_MARK, 4, 0) == 4           # nothing ahead: the batch's last offset


def test_a_stream_that_ends_writes_back_the_exact_mark():
    assert exact_mark(NO_MARK, 9) == 9                    # streamed 0..9, reserved up to 509: 10.. get DUP=0
    assert exact_mark(NO_MARK, None) == NO_MARK           # took nothing
    assert exact_mark(700, 9) == 700                      # an earlier stream (a crash) may have sent up to 700
    assert exact_mark(700, 800) == 800


def test_shared_filters_match_and_cap():
    f = SharedFilters("c", [("a/+/c", 1), ("a/#", 0), ("x/y", None)])
    assert f.delivery_qos("a/b/c", 2) == 1           # best of the matching filters
    assert f.delivery_qos("a/b", 2) == 0
    assert f.delivery_qos("x/y", 2) == 2             # unknown granted QoS: no cap
    assert f.delivery_qos("z", 1) is None            # colliding topic name, not ours
    assert f.delivery_qos("$SYS/a", 1) is None


def test_settings_defaults_and_launcher_port():
    s = load_settings({})
    assert (s.grpc_port, s.health_port, s.service_name) == (9062, 8085, "app-delivery")
    assert load_settings({"GRPC_PORT": "6000"}).grpc_port == 6000
    assert load_settings({"GRPC_PORT": "6000", "APP_DELIVERY_GRPC_PORT": "7000"}).grpc_port == 7000
    with pytest.raises(SettingsError) as e:
        load_settings({"APP_DELIVERY_GRPC_PORT": "x", "APP_DELIVERY_COMMIT_INTERVAL_MS": "1"})
    assert len(e.value.problems) == 2


# ------------------------------------------------------------------------------------------- batches

def _batches(sizes: list[int], window: int, max_bytes: int, acks_between: int) -> list[list[int]]:
    """Split records (their sizes) into batches the way Source._stream does: a batch is started with the
    free window slots, takes records while they fit; `acks_between` records are acknowledged before the next
    batch is started. Returns the indexes of each batch; checks the window is never exceeded."""
    out: list[list[int]] = []
    outstanding = 0
    i = 0
    while i < len(sizes):
        room = window - outstanding
        assert room >= 1
        limit = BatchLimit(room, max_bytes)
        batch = []
        while i < len(sizes) and limit.fits(sizes[i]):
            limit.take(sizes[i])
            batch.append(i)
            i += 1
        assert batch, "a batch started with a free slot takes at least one record"
        outstanding += len(batch)
        assert outstanding <= window
        out.append(batch)
        outstanding -= min(outstanding, acks_between) if outstanding == window else 0
    return out


def test_batch_takes_at_most_the_free_window_slots():
    limit = BatchLimit(3, 1 << 20)
    for _ in range(3):
        assert limit.fits(10)
        limit.take(10)
    assert limit.full and not limit.fits(1)
    with pytest.raises(ValueError):
        BatchLimit(0, 1 << 20)


def test_window_of_one_sends_one_record_per_batch():
    assert _batches([100] * 5, window=1, max_bytes=1 << 20, acks_between=1) == [[0], [1], [2], [3], [4]]


def test_window_smaller_than_a_poll_splits_the_poll():
    got = _batches([100] * 500, window=64, max_bytes=1 << 20, acks_between=64)
    assert [len(b) for b in got] == [64] * 7 + [52]
    assert [i for b in got for i in b] == list(range(500))  # order kept


def test_byte_bound_splits_and_a_large_record_goes_alone():
    limit = BatchLimit(100, 1000)
    limit.take(600)
    assert limit.fits(400) and not limit.fits(401)
    alone = BatchLimit(100, 1000)
    assert alone.fits(5000)  # larger than the bound: alone, never held back for good
    alone.take(5000)
    assert alone.full and not alone.fits(1)
    got = _batches([400, 400, 400, 5000, 10, 10], window=100, max_bytes=1000, acks_between=0)
    assert got == [[0, 1], [2], [3], [4, 5]]


def test_batches_random_never_exceed_window_or_bytes():
    rnd = random.Random(7)
    for _ in range(300):
        window = rnd.randint(1, 40)
        max_bytes = rnd.randint(1024, 8192)
        sizes = [rnd.choice([50, 300, 2000, 10_000]) for _ in range(rnd.randint(1, 200))]
        got = _batches(sizes, window, max_bytes, acks_between=rnd.randint(1, window))
        assert [i for b in got for i in b] == list(range(len(sizes)))
        for b in got:
            assert len(b) <= window
            assert len(b) == 1 or sum(sizes[i] for i in b) <= max_bytes


def test_record_size_counts_value_and_topic():
    assert record_size(b"x" * 100, "tbmq.msg.app.c") > 100 + len("tbmq.msg.app.c")
    assert record_size(None, "t") > 0


def test_docs_list_every_setting():
    from tbmq_platform.settings import CommonSettings, describe

    root = Path(__file__).resolve().parents[3]
    doc = (root / "docs" / "app-delivery.md").read_text()
    readme = (root / "services" / "app-delivery" / "README.md").read_text()
    common = {var for var, _default, _doc in describe(CommonSettings)} - {"HEALTH_PORT"}
    for var, _default, _doc in describe(AppDeliverySettings):
        if var in common:
            continue
        assert f"`{var}`" in doc, var
        assert f"`{var}`" in readme, var
