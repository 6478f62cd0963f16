"""held.py: the table of held forwards (pure; the clock is the `now_ms` each call takes)."""

from __future__ import annotations

import random

import pytest

from tbmq_device_persistence.held import MAX_PACKET_ID, Copy, HeldBatch, HeldTable, Released, marks_of
from tbmq_device_persistence.store import Attachment

pytestmark = pytest.mark.unit

LIVE = Attachment("connector-1", "s1")
OTHER = Attachment("connector-2", "s2")


def table(**kw) -> HeldTable:
    args = {"hold_ms": 250, "client_bytes": 1_000, "total_bytes": 10_000, "handed_out_limit": 100}
    args.update(kw)
    return HeldTable(**args)


def copies(*origins, size: int = 10, qos: int = 1) -> list[Copy]:
    return [Copy(payload=f"m{o}", origin=o, size=size, qos=qos) for o in origins]


def test_admitted_copies_take_the_next_serials_and_packet_ids_from_the_cursor():
    t = table()
    assert t.enter("c", LIVE, serial=41, packet_id=7, serial_end=1_000)
    assert not t.enter("c", LIVE, serial=0, packet_id=0, serial_end=1_000)  # in the table already: the cursor is not reset
    b = HeldBatch()
    held = t.admit("c", copies((0, 5), (0, 6)), now_ms=1_000, batch=b)
    assert [(m.serial, m.packet_id, m.payload) for m in held] == [(42, 8, "m(0, 5)"), (43, 9, "m(0, 6)")]
    assert [m.deadline_ms for m in held] == [1_250, 1_250]
    assert (b.pending, t.held_count("c"), t.bytes) == (2, 2, 20)


def test_packet_ids_wrap_to_1_and_skip_the_ids_still_held():
    t = table()
    t.enter("c", LIVE, serial=0, packet_id=MAX_PACKET_ID - 1, serial_end=1_000_000)
    first = t.admit("c", copies((0, 1), (0, 2)), 0, HeldBatch())
    assert [m.packet_id for m in first] == [MAX_PACKET_ID, 1]  # never 0
    assert t.release("c", MAX_PACKET_ID, first[0].serial) is Released.HELD
    for offset in range(3, MAX_PACKET_ID):  # ids 2 .. 65533 handed out and released one by one; 1 stays held
        (m,) = t.admit("c", copies((0, offset)), 0, HeldBatch())
        assert t.release("c", m.packet_id, m.serial) is Released.HELD
    again = t.admit("c", copies((1, 1), (1, 2), (1, 3)), 0, HeldBatch())
    assert [m.packet_id for m in again] == [MAX_PACKET_ID - 1, MAX_PACKET_ID, 2]  # 1 is still held: skipped
    assert len({m.packet_id for m in again + first[1:]}) == 4


@pytest.mark.parametrize("why", ["not entered", "qos 2", "client bytes", "total bytes", "handed-out limit",
                                 "serials used up", "routed again", "spilling", "empty"])
def test_copies_that_cannot_all_be_held_are_refused_and_nothing_is_taken(why):
    t = table(client_bytes=100, total_bytes=150, handed_out_limit=3 if why == "handed-out limit" else 100)
    t.enter("c", LIVE, 0, 0, serial_end=3)
    t.enter("d", LIVE, 0, 0, 1_000_000)
    t.admit("d", copies((1, 1), size=60), 0, HeldBatch())
    t.admit("c", copies((0, 1), size=40), 0, HeldBatch())
    before = (t.bytes, t.held_count("c"), t._clients["c"].serial, t._clients["c"].packet_id)
    b = HeldBatch()
    offer = {
        "not entered": ("x", copies((0, 2))),
        "qos 2": ("c", copies((0, 2)) + copies((0, 3), qos=2)),
        "client bytes": ("c", copies((0, 2), size=61)),  # 40 + 61 > 100
        "total bytes": ("c", copies((0, 2), size=51)),  # 100 + 51 > 150
        "handed-out limit": ("c", copies((0, 2), (0, 3), (0, 4), size=1)),  # 1 + 3 > 3
        "serials used up": ("c", copies((0, 2), (0, 3), (0, 4), size=1)),  # serial 1 + 3 > 3
        "routed again": ("c", copies((0, 2), (0, 1))),  # (0, 1) was held before: a batch sent again
        "spilling": ("c", copies((0, 2))),
        "empty": ("c", []),
    }[why]
    if why == "spilling":
        t.leave("c")
    assert t.admit(offer[0], offer[1], 0, b) is None
    assert (t.bytes, t.held_count("c"), t._clients["c"].serial, t._clients["c"].packet_id) == before
    assert b.pending == 0


def test_a_batch_finishes_once_sealed_and_every_copy_it_holds_is_released():
    t = table()
    t.enter("a", LIVE, 0, 0, 1_000_000)
    t.enter("b", LIVE, 0, 0, 1_000_000)
    batch = HeldBatch("token")
    ma = t.admit("a", copies((0, 10)), 0, batch)
    mb = t.admit("b", copies((0, 11)), 0, batch)
    assert t.release("a", ma[0].packet_id, ma[0].serial) is Released.HELD
    assert t.release("b", mb[0].packet_id, mb[0].serial) is Released.HELD
    assert t.collect().batches == []  # not sealed: the batch may still be admitting
    assert t.seal(batch) is True  # nothing left: finished at once
    empty = HeldBatch()
    assert t.seal(empty) is True
    other = HeldBatch()
    m = t.admit("a", copies((0, 12)), 0, other)
    assert t.seal(other) is False
    t.release("a", m[0].packet_id, m[0].serial)
    assert [b.token for b in t.collect().batches] == [None]
    assert t.collect().batches == []  # reported once


@pytest.mark.parametrize("pid_delta, serial_delta", [(1, 0), (0, 1), (0, -1)])
def test_an_acknowledgement_that_does_not_name_a_held_copy_exactly_is_not_held(pid_delta, serial_delta):
    t = table()
    t.enter("c", LIVE, 5, 0, 1_000_000)
    (m,) = t.admit("c", copies((0, 1)), 0, HeldBatch())
    assert t.release("c", m.packet_id + pid_delta, m.serial + serial_delta) is Released.NOT_HELD
    assert t.release("x", m.packet_id, m.serial) is Released.NOT_HELD
    assert t.held_count("c") == 1
    assert t.release("c", m.packet_id, m.serial) is Released.HELD
    assert t.release("c", m.packet_id, m.serial) is Released.NOT_HELD  # once
    (m2,) = t.admit("c", copies((0, 2)), 0, HeldBatch())
    assert t.release("c", m2.packet_id, 0) is Released.HELD  # serial 0: whatever holds the id


def test_the_origin_mark_never_reaches_a_copy_still_held():
    t = table()
    t.enter("c", LIVE, 0, 0, 1_000_000)
    m = t.admit("c", copies((0, 10), (1, 20), (0, 11), (0, 12), (1, 21)), 0, HeldBatch())
    t.release("c", m[2].packet_id, m[2].serial)  # (0, 11) before (0, 10): partition 0 stays below 10
    assert t.collect().marks == {}
    t.release("c", m[1].packet_id, m[1].serial)  # (1, 20): partition 1's first
    assert t.collect().marks == {"c": {1: 20}}
    t.release("c", m[0].packet_id, m[0].serial)  # (0, 10): 10 and 11 done, 12 held
    assert t.collect().marks == {"c": {0: 11}}
    t.release("c", m[4].packet_id, m[4].serial)
    t.release("c", m[3].packet_id, m[3].serial)
    assert t.collect().marks == {"c": {0: 12, 1: 21}}


def test_clients_past_their_deadline_are_due_once_and_released_copies_never():
    t = table(hold_ms=100)
    t.enter("a", LIVE, 0, 0, 1_000_000)
    t.enter("b", LIVE, 0, 0, 1_000_000)
    ma = t.admit("a", copies((0, 1), (0, 2)), 1_000, HeldBatch())
    t.admit("b", copies((0, 3)), 1_050, HeldBatch())
    assert t.due(1_099) == []
    t.release("a", ma[0].packet_id, ma[0].serial)
    assert t.due(1_100) == ["a"]  # its second copy is still held; listed once
    assert t.due(1_100) == []
    assert t.due(1_200) == ["b"]
    t.release("a", ma[1].packet_id, ma[1].serial)
    t.admit("a", copies((0, 4)), 1_300, HeldBatch())
    t.release("a", t._clients["a"].packet_id, t._clients["a"].serial)
    assert t.due(10_000) == []  # everything released


def test_a_spill_hands_over_the_tail_defers_its_acknowledgements_and_finishes_its_batches():
    t = table()
    t.enter("c", LIVE, 5, 5, 1_000_000)
    batch = HeldBatch()
    m = t.admit("c", copies((0, 10), (0, 11), (0, 12)), 0, batch)
    t.seal(batch)
    t.release("c", m[0].packet_id, m[0].serial)
    spill = t.leave("c")
    assert [x.serial for x in spill.messages] == [7, 8]
    assert (spill.serial, spill.packet_id, spill.serial_end, spill.attached) == (8, 8, 1_000_000, LIVE)
    assert marks_of(spill) == {0: 12}
    assert t.leave("c") is None  # spilling already
    assert t.clients() == []
    assert t.admit("c", copies((0, 13)), 0, HeldBatch()) is None  # saved as today, behind the tail
    assert t.release("c", m[1].packet_id, m[1].serial) is Released.DEFERRED
    assert t.release("c", m[0].packet_id, m[0].serial) is Released.NOT_HELD  # released before the spill
    assert t.collect().batches == []
    assert t.spilled("c") == [(m[1].packet_id, m[1].serial)]
    assert "c" not in t and t.bytes == 0
    assert t.collect().batches == [batch]
    assert t.release("c", m[2].packet_id, m[2].serial) is Released.NOT_HELD  # in Redis now
    assert t.enter("c", OTHER, 1_000_000, 8, 2_000_000)


def test_a_spill_given_up_puts_the_client_back_and_applies_its_deferred_acknowledgements():
    t = table()
    t.enter("c", LIVE, 0, 0, 1_000_000)
    m = t.admit("c", copies((0, 1), (0, 2)), 0, HeldBatch())
    t.leave("c")
    assert t.release("c", m[0].packet_id, m[0].serial) is Released.DEFERRED
    t.unspill("c")
    assert t.held_count("c") == 1 and t.clients() == ["c"]
    assert t.collect().marks == {"c": {0: 1}}


def test_the_clients_of_a_connector_are_listed_for_their_streams_end():
    t = table()
    t.enter("a", LIVE, 0, 0, 1_000_000)
    t.enter("b", OTHER, 0, 0, 1_000_000)
    t.enter("c", LIVE, 0, 0, 1_000_000)
    t.leave("c")
    assert t.attached_to("connector-1") == ["a"]
    assert sorted(t.clients()) == ["a", "b"]


def test_bad_limits_and_cursors_are_refused():
    with pytest.raises(ValueError):
        table(hold_ms=0)
    with pytest.raises(ValueError):
        table(handed_out_limit=MAX_PACKET_ID)
    with pytest.raises(ValueError):
        table().enter("c", LIVE, 0, MAX_PACKET_ID + 1, serial_end=9)


@pytest.mark.parametrize("seed", range(20))
def test_random_traffic_keeps_every_invariant(seed):
    """Random admits, releases (some wrong), deadlines, spills and re-entries against a plain model: the bytes, the
    packet ids in use, the marks below every held copy, and each batch finished exactly when all its copies are
    released or spilled."""
    rnd = random.Random(seed)
    t = table(hold_ms=50, client_bytes=200, total_bytes=500, handed_out_limit=8)
    cids = ["a", "b", "c"]
    for cid in cids:
        t.enter(cid, LIVE, 0, MAX_PACKET_ID - 3, 7)
    offsets = {0: 0, 1: 0}
    live: dict[int, tuple] = {}  # id(msg) -> (cid, msg)
    batches: list[tuple[HeldBatch, list]] = []
    finished: list[HeldBatch] = []
    marks: dict[tuple[str, int], int] = {}
    now = 0
    for _ in range(400):
        now += rnd.randint(0, 20)
        op = rnd.random()
        cid = rnd.choice(cids)
        if op < 0.45:
            batch, msgs = HeldBatch(), []
            for _ in range(rnd.randint(1, 3)):
                part = rnd.randint(0, 1)
                offsets[part] += 1
                got = t.admit(cid, copies((part, offsets[part]), size=rnd.randint(1, 40)), now, batch)
                if got is None and cid in t and cid in t.clients():
                    spill = t.leave(cid)
                    for m in spill.messages:
                        live.pop(id(m))
                    t.spilled(cid)
                    t.enter(cid, LIVE, spill.serial_end, spill.packet_id, spill.serial_end + 7)
                for m in got or []:
                    live[id(m)] = (cid, m)
                    msgs.append(m)
            if t.seal(batch):
                finished.append(batch)  # nothing held: finished at once
            batches.append((batch, msgs))
        elif op < 0.85 and live:
            key = rnd.choice(list(live))
            owner, m = live[key]
            if rnd.random() < 0.1:
                assert t.release(owner, m.packet_id, m.serial + 1) is Released.NOT_HELD
            else:
                assert t.release(owner, m.packet_id, m.serial) is Released.HELD
                del live[key]
        else:
            for due in t.due(now):
                spill = t.leave(due)
                assert all(m.deadline_ms > 0 for m in spill.messages)
                for m in spill.messages:
                    live.pop(id(m))
                t.spilled(due)
                t.enter(due, LIVE, spill.serial_end, spill.packet_id, spill.serial_end + 7)
            assert all(m.deadline_ms > now for _, m in live.values())  # nothing past its deadline stays held
        got = t.collect()
        finished += got.batches
        for c, parts in got.marks.items():
            for part, mark in parts.items():
                assert mark > marks.get((c, part), -1)
                marks[(c, part)] = mark
        # invariants
        assert t.bytes == sum(m.size for _, m in live.values())
        for cid2 in cids:
            mine = [m for c, m in live.values() if c == cid2]
            assert len({m.packet_id for m in mine}) == len(mine) and all(1 <= m.packet_id <= MAX_PACKET_ID
                                                                          for m in mine)
            for m in mine:
                assert m.origin[1] > marks.get((cid2, m.origin[0]), -1)
        for batch, msgs in batches:
            done = all(id(m) not in live for m in msgs)
            assert (batch in finished) == done
        assert len(finished) == len(set(map(id, finished)))
