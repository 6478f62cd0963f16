"""A persistent DEVICE client's stored backlog in pages (issue 14: "stored backlogs fetched in pages", the
outbound queue bounded for persistent DEVICE too): the machine holds at most one page of its own stored
messages, asks for the room left after the last serial delivered, fetches the next page once a quarter of a
page is free (`MachineConfig.page_room`), and pages again when device-persistence stops forwarding (`store_paused`). Pure: no
sockets, no loop, no sleeps."""

from __future__ import annotations

from connection_harness import Client, answer
from tbmq.v1 import messages_pb2 as pb
from tbmq_connection import AckStored, FetchStored
from tbmq_mqtt import PubAck, Publish


def stored(serial: int, pid: int | None = None, size: int = 1, redelivery: bool = False) -> pb.DevicePublishMsg:
    return pb.DevicePublishMsg(client_id="dev", packet_id=pid or serial, serial=serial, redelivery=redelivery,
                               msg=pb.PublishMsg(topic="t", payload=b"x" * size, qos=1))


def persistent(**config) -> tuple[Client, FetchStored]:
    c = Client(5, **config)
    c.connect(answer(persistent=True, sei=60))
    (fetch,) = c.take_effects(FetchStored)
    return c, fetch


def ack(c: Client, packets) -> None:
    for p in packets:
        c.send(PubAck(p.packet_id))


def test_pages_after_the_last_serial_once_a_quarter_of_a_page_is_free():
    c, first = persistent(page_messages=10, page_bytes=1 << 20)
    assert first == FetchStored("dev", resync=False, after=0, max_messages=10, max_bytes=1 << 20)
    c.call("stored", first, [stored(s) for s in range(1, 11)])
    c.call("fetch_finished", first, more=True)
    got = c.take()
    # a backlog fetched for the first time: not re-sends [MQTT-3.3.1-1]
    assert [p.packet_id for p in got] == list(range(1, 11)) and all(isinstance(p, Publish) and not p.dup for p in got)
    assert c.take_effects(FetchStored) == []  # ten held: no room
    ack(c, got[:1])
    assert c.take_effects(FetchStored) == []  # nine held: less than a quarter of a page free
    ack(c, got[1:2])
    (page,) = c.take_effects(FetchStored)     # eight held: the room left, after serial 10, read only
    assert page == FetchStored("dev", resync=True, after=10, max_messages=2, max_bytes=(1 << 20) - 8)
    assert [e.packet_id for e in c.take_effects(AckStored)] == [1, 2]
    ack(c, got[2:7])
    assert c.take_effects(FetchStored) == []  # a page is already being fetched
    c.call("stored", page, [stored(s) for s in range(11, 13)])
    c.call("fetch_finished", page, more=True)
    assert [p.packet_id for p in c.take()] == [11, 12]
    assert len(c.m.stored_sizes) == 5         # never more than a page held
    # three held plus the two new: room for a quarter, so the next page is asked for at once (while the
    # client still works through what it holds), sized to all the room there is
    (page,) = c.take_effects(FetchStored)
    assert (page.after, page.max_messages) == (12, 5)
    c.call("stored", page, [stored(s) for s in range(13, 18)])
    c.call("fetch_finished", page, more=False)
    assert [p.packet_id for p in c.take()] == list(range(13, 18))
    assert len(c.m.stored_sizes) == 10        # a full page held, never more
    ack(c, got[7:])
    assert c.take_effects(FetchStored) == []  # the store had no more: nothing to fetch
    assert c.m.stats["stored_pages"] == 2


def test_the_first_page_is_small_and_the_rest_of_the_room_is_asked_for_as_soon_as_it_arrives():
    c, first = persistent(page_messages=10, page_bytes=1 << 20, first_page_messages=3)
    assert first == FetchStored("dev", resync=False, after=0, max_messages=3, max_bytes=1 << 20)
    c.call("stored", first, [stored(s) for s in range(1, 4)])
    c.call("fetch_finished", first, more=True)
    assert [p.packet_id for p in c.take()] == [1, 2, 3]
    # three held, nothing acknowledged yet: the next page at once, for the rest of the page
    (page,) = c.take_effects(FetchStored)
    assert page == FetchStored("dev", resync=True, after=3, max_messages=7, max_bytes=(1 << 20) - 3)
    c.call("stored", page, [stored(s) for s in range(4, 11)])
    c.call("fetch_finished", page, more=True)
    assert [p.packet_id for p in c.take()] == list(range(4, 11))
    assert c.take_effects(FetchStored) == []  # a full page held: the usual quarter rule from here on


def test_the_byte_bound_sizes_the_page():
    c, first = persistent(page_messages=100, page_bytes=1000)
    assert first.max_bytes == 1000
    c.call("stored", first, [stored(s, size=300) for s in range(1, 4)])
    c.call("fetch_finished", first, more=True)
    got = c.take()
    assert c.take_effects(FetchStored) == []  # 900 bytes held: less than a quarter of the bytes free
    ack(c, got[:1])
    (page,) = c.take_effects(FetchStored)
    assert (page.after, page.max_messages, page.max_bytes) == (3, 98, 400)


def test_store_paused_pages_again_once_there_is_room():
    c, first = persistent(page_messages=10, page_bytes=1 << 20)
    c.call("fetch_finished", first, more=False)  # nothing stored: live
    for s in range(1, 21):                       # forwards of a live client (the store bounds them)
        c.call("persisted", stored(s))
    got = c.take()
    assert len(got) == 20
    c.call("store_paused", "dev")                       # the store's handed-out limit: forwards stopped
    assert c.take_effects(FetchStored) == []
    ack(c, got[:11])
    assert c.take_effects(FetchStored) == []  # nine held: less than a quarter of a page free
    ack(c, got[11:12])
    (page,) = c.take_effects(FetchStored)
    assert (page.resync, page.after, page.max_messages) == (True, 20, 2)
    c.call("stored", page, [stored(21)])
    c.call("fetch_finished", page, more=False)
    assert [p.packet_id for p in c.take()] == [21]


def test_a_resync_while_paging_reads_after_the_last_serial():
    c, first = persistent(page_messages=10, page_bytes=1 << 20)
    c.call("stored", first, [stored(s) for s in range(1, 10)])
    c.call("fetch_finished", first, more=True)           # nine held: no room for a page yet
    c.take()
    assert c.take_effects(FetchStored) == []
    c.call("resync")
    (resync,) = c.take_effects(FetchStored)
    assert (resync.resync, resync.after, resync.max_messages) == (True, 9, 1)
    c.call("stored", resync, [stored(7), stored(8), stored(9), stored(10)])  # overlap skipped by serial
    c.call("fetch_finished", resync, more=True)
    assert [p.packet_id for p in c.take()] == [10]
    assert c.take_effects(FetchStored) == [] and len(c.m.stored_sizes) == 10


def test_forwards_ahead_of_the_backlog_wait_for_the_pages():
    """After a device-persistence restart the re-sync page does not reach the end while forwards of newer
    messages arrive: delivered, they would raise the last serial past the backlog and the next page (after
    it) would skip what lies between. They are left to the pages (the store keeps them)."""
    c, first = persistent(page_messages=10, page_bytes=1 << 20)
    c.call("persisted", stored(50))                      # held during the first fetch
    c.call("stored", first, [stored(s) for s in range(1, 11)])
    c.call("fetch_finished", first, more=True)
    got = c.take()
    assert [p.packet_id for p in got] == list(range(1, 11))  # the held forward is not among them
    c.call("persisted", stored(51))                      # while paging, not fetching: not delivered either
    assert c.take() == [] and c.m.stats["forwards_behind_backlog"] == 2
    ack(c, got)
    (page,) = c.take_effects(FetchStored)
    assert page.after == 10                              # not 51: nothing between is skipped
    c.call("stored", page, [stored(s) for s in range(11, 21)] + [stored(50, redelivery=True), stored(51, redelivery=True)])
    c.call("fetch_finished", page, more=False)
    assert [p.packet_id for p in c.take()] == list(range(11, 21)) + [50, 51]
    c.call("persisted", stored(52))                      # caught up: live forwards go at once
    assert [p.packet_id for p in c.take()] == [52]


def test_a_resync_answers_paging_again():
    c, first = persistent(page_messages=10, page_bytes=1 << 20)
    c.call("stored", first, [stored(s) for s in range(1, 10)])
    c.call("fetch_finished", first, more=True)           # paging; nine held: no room for a page yet
    c.take()
    c.call("resync")                                     # a forward stream opened
    (resync,) = c.take_effects(FetchStored)
    assert (resync.resync, resync.after) == (True, 9)
    c.call("stored", resync, [stored(10)])
    c.call("fetch_finished", resync, more=False)         # reached the end: the store made the client live
    assert [p.packet_id for p in c.take()] == [10]
    c.call("persisted", stored(11))                      # so forwards go at once again
    assert [p.packet_id for p in c.take()] == [11]


def test_a_group_store_is_paged_the_same_way():
    from tbmq_connection.convert import topic_subscription
    from tbmq_routing import shared_store_id

    store = shared_store_id("g", "jobs/#")
    c = Client(5, page_messages=10, page_bytes=1 << 20)
    c.connect(answer(persistent=True, sei=60, present=True), clean_start=False,
              subs={("g", "jobs/#"): topic_subscription("g", "jobs/#", 1)})
    own, group = sorted(c.take_effects(FetchStored), key=lambda f: f.group)
    assert group == FetchStored(store, resync=False, group=True, after=0, max_messages=10, max_bytes=1 << 20)
    c.call("fetch_finished", own)
    c.call("stored", group, [pb.DevicePublishMsg(client_id=store, packet_id=s, serial=s,
                                                 msg=pb.PublishMsg(topic="jobs/1", payload=b"x", qos=1))
                             for s in range(1, 11)])
    c.call("fetch_finished", group, more=True)
    got = c.take()
    assert len(got) == 10 and c.take_effects(FetchStored) == []
    # a forward of a newer message while the store still holds more: left to the pages (not delivered,
    # so the next page is still fetched after serial 10)
    c.call("group_persisted", pb.DevicePublishMsg(client_id=store, packet_id=60, serial=60,
                                                  msg=pb.PublishMsg(topic="jobs/1", payload=b"x", qos=1)))
    assert c.take() == [] and c.m.stats["forwards_behind_backlog"] == 1
    ack(c, got[:1])
    assert c.take_effects(FetchStored) == []
    ack(c, got[1:2])
    (page,) = c.take_effects(FetchStored)
    assert page == FetchStored(store, resync=True, group=True, after=10, max_messages=2, max_bytes=(1 << 20) - 8)
    assert sorted(e.packet_id for e in c.take_effects(AckStored)) == [1, 2]  # the store's ids
    c.call("fetch_finished", page, more=False)
    ack(c, got[2:])
    assert c.take_effects(FetchStored) == []
    c.call("store_paused", store)              # the group store's forwards stopped: page when there is room
    (again,) = c.take_effects(FetchStored)
    assert (again.store_id, again.group, again.after) == (store, True, 10)


def test_messages_handed_out_before_go_with_dup_the_others_without():
    c, first = persistent(page_messages=10, page_bytes=1 << 20)
    c.call("stored", first, [stored(1, redelivery=True), stored(2, redelivery=True), stored(3)])
    c.call("fetch_finished", first)
    assert [(p.packet_id, p.dup) for p in c.take()] == [(1, True), (2, True), (3, False)]
