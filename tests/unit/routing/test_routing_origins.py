"""tbmq_routing.origins: one copy per tbmq.msg.all record on each destination partition."""

from __future__ import annotations

import random

import pytest

from tbmq_routing.origins import OriginMarks

pytestmark = pytest.mark.unit


def test_replays_after_the_originals_are_dropped_and_nothing_else_is():
    """A model of what the router produces: the records of origin partitions interleaved on destination
    partitions in origin order, then after a crash a replay of the uncommitted tail of each origin
    partition, itself followed by new records. Every origin is taken exactly once."""
    rnd = random.Random(7)
    for _ in range(200):
        dest: dict[int, list[tuple[int, int]]] = {d: [] for d in range(3)}  # partition -> [(op, oo)]
        routes = {}  # (op, oo) -> destination partition (by MQTT topic: fixed per message)
        next_off = {op: 0 for op in range(4)}

        def route(op: int, oo: int) -> None:
            d = routes.setdefault((op, oo), rnd.randrange(3))
            dest[d].append((op, oo))

        for _ in range(rnd.randrange(1, 40)):
            op = rnd.randrange(4)
            route(op, next_off[op])
            next_off[op] += 1
        for op in range(4):  # the crash: each origin partition replayed from a committed offset
            for oo in range(rnd.randrange(0, next_off[op] + 1), next_off[op]):
                route(op, oo)
        for _ in range(rnd.randrange(0, 20)):
            op = rnd.randrange(4)
            route(op, next_off[op])
            next_off[op] += 1
        marks = OriginMarks()
        taken = [(op, oo) for d, recs in dest.items() for offset, (op, oo) in enumerate(recs)
                 if marks.first(op, d, oo, offset)]
        assert sorted(taken) == sorted({(op, oo) for op in range(4) for oo in range(next_off[op])})


def test_the_same_record_read_again_or_carrying_a_client_twice_is_not_a_replay():
    m = OriginMarks()
    assert m.first(0, 1, 5, 100) and m.first(0, 1, 5, 100)  # read again / a second recipient of one client
    assert not m.first(0, 1, 5, 101)
    m.seed(0, 1, 9)  # committed elsewhere up to 9
    assert not m.first(0, 1, 9, 102) and m.first(0, 1, 10, 103)
    m.seed(0, 1, 3)  # a lower seed changes nothing
    assert not m.first(0, 1, 10, 104) and len(m) == 1
