"""The batch path of the router without a broker: RecordBatch -> handle_batch -> pipeline -> acks in
Faust's consumer bookkeeping; the spliced protobuf records."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.structs import ConsumerRecord
from faust.types import TP

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_routing.rules import Delivery, RoutingPlan

from router.app import Pipeline, RecordBatch, create_app
from router.convert import plan_records, receiver_copy
from router.settings import RouterSettings

pytestmark = pytest.mark.unit

TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class FakeKafka:
    def __init__(self):
        self.sent: list[tuple[str, bytes, bytes, list]] = []
        self.futures: list[asyncio.Future] = []
        self.created: list[str] = []

    async def send(self, topic, key, value, headers):
        fut = asyncio.get_running_loop().create_future()
        self.sent.append((topic, key, value, headers))
        self.futures.append(fut)
        return fut

    async def ensure(self, specs):
        self.created.extend(s.name for s in specs)


def _record(partition: int, offset: int, value: bytes | None, key: bytes | None = b"x/y",
            headers=()) -> ConsumerRecord:
    return ConsumerRecord(topics.MSG_ALL, partition, offset, 0, 0, key, value, None,
                          -1 if key is None else len(key), -1 if value is None else len(value), tuple(headers))


def _publish(topic: str, **kw) -> bytes:
    return pb.PublishMsg(publisher_id="p", topic=topic, qos=1, payload=b"hi", **kw).SerializeToString()


@pytest.fixture
def router(tmp_path):
    app, runtime = create_app(RouterSettings(data_dir=str(tmp_path)))
    app.flow_control.resume()  # as after a rebalance
    app.topics._acking_topics.add(topics.MSG_ALL)  # as once the agent's stream subscribed (acks on)
    kafka = FakeKafka()
    failures: list = []
    runtime.pipeline = Pipeline(kafka.send, kafka.ensure, 100, failures.append)
    st = runtime.routing
    for cid, conn in (("a", "conn-1"), ("b", "conn-2")):
        st.apply_subscriptions(cid.encode(), pb.ClientSubscriptions(client_id=cid, subscriptions=[
            pb.TopicSubscription(topic_filter="x/+", qos=1, subscription_id=9)]).SerializeToString())
        st.apply_session(cid.encode(), pb.SessionInfo(client_id=cid, service_id=conn,
                                                      connected=True).SerializeToString())
    return app, runtime, kafka, failures


async def test_batch_is_acked_only_after_every_record_of_every_message(router):
    app, runtime, kafka, failures = router
    consumer = app.consumer
    tp0, tp1 = TP(topics.MSG_ALL, 0), TP(topics.MSG_ALL, 1)
    batch = RecordBatch({
        tp0: [_record(0, 10, _publish("x/1"), headers=[("traceparent", TRACEPARENT), ("other", b"z")]),
              _record(0, 11, _publish("nobody/here")), _record(0, 12, b"\xff\xff\xff")],
        tp1: [_record(1, 5, _publish("x/2"))],
    }, app.consumer_generation_id)
    await runtime.handle_batch(batch)
    # 2 routed messages x 2 connectors; the unmatched and the undecodable ones produce nothing
    assert len(kafka.sent) == 4
    assert {s[0] for s in kafka.sent} == {topics.downlink_basic_topic("conn-1"), topics.downlink_basic_topic("conn-2")}
    # trace context forwarded as is (only the trace headers)
    assert kafka.sent[0][3] == [("traceparent", TRACEPARENT)]
    assert batch in consumer.unacked and not batch.acked  # a rebalance/shutdown waits for it
    assert runtime.pipeline.inflight == 4
    for f in kafka.futures[:3]:
        f.set_result(None)
    await asyncio.sleep(0)
    assert not consumer._acked[tp0] and not batch.acked
    kafka.futures[3].set_result(None)
    await asyncio.sleep(0)
    assert batch.acked and batch not in consumer.unacked
    assert sorted(consumer._acked[tp0]) == [10, 11, 12] and consumer._acked[tp1] == [5]
    assert runtime.pipeline.inflight == 0 and runtime.pipeline.acked_events == 4 and not failures
    assert runtime.routing.counters["undecodable"] == 1


async def test_failed_send_never_acks_the_batch(router):
    app, runtime, kafka, failures = router
    tp = TP(topics.MSG_ALL, 0)
    batch = RecordBatch({tp: [_record(0, 1, _publish("x/1"))]}, app.consumer_generation_id)
    await runtime.handle_batch(batch)
    kafka.futures[0].set_result(None)
    kafka.futures[1].set_exception(RuntimeError("broker gone"))
    await asyncio.sleep(0)
    assert len(failures) == 1 and not batch.acked and not app.consumer._acked[tp]
    with pytest.raises(RuntimeError):
        await runtime.handle_batch(RecordBatch({tp: [_record(0, 2, _publish("x/1"))]}, app.consumer_generation_id))


async def test_batch_without_records_is_acked_at_once_and_stale_batches_are_skipped(router):
    app, runtime, kafka, _ = router
    tp = TP(topics.MSG_ALL, 3)
    empty = RecordBatch({tp: [_record(3, 7, _publish("nobody/here"))]}, app.consumer_generation_id)
    await runtime.handle_batch(empty)
    assert empty.acked and app.consumer._acked[tp] == [7]
    stale = RecordBatch({tp: [_record(3, 8, _publish("x/1"))]}, app.consumer_generation_id - 1)
    await runtime.handle_batch(stale)  # fetched before a rebalance: neither routed nor acked
    assert kafka.sent == [] and app.consumer._acked[tp] == [7] and runtime.stale_batches == 1
    app.flow_control.suspend()  # rebalancing
    await runtime.handle_batch(RecordBatch({tp: [_record(3, 8, _publish("x/1"))]}, app.consumer_generation_id))
    assert kafka.sent == [] and runtime.stale_batches == 2


@pytest.mark.parametrize("committed", [10, None, 0])
async def test_a_batch_done_before_an_earlier_one_of_its_partition_is_not_committed_before_it(router, committed):
    """Batches complete out of order (one without copies at once, one waiting for its copies' acknowledgements
    later); Faust's commit bookkeeping would commit past the earlier one's records when nothing is committed
    yet, at offset 0, or when the earlier one is a single record (it accepts acked offsets starting one past
    the committed offset): a crash then loses their copies. The later batch's offsets reach Faust only once
    the earlier one is done."""
    app, runtime, kafka, _ = router
    consumer = app.consumer
    tp, other = TP(topics.MSG_ALL, 3), TP(topics.MSG_ALL, 4)
    start = committed or 0
    if committed is not None:
        consumer._committed_offset[tp] = committed
    first = RecordBatch({tp: [_record(3, start, _publish("x/1"))]}, app.consumer_generation_id)
    await runtime.handle_batch(first)
    second = RecordBatch({tp: [_record(3, start + 1, _publish("nobody/here"))],
                          other: [_record(4, 7, _publish("nobody/here"))]}, app.consumer_generation_id)
    await runtime.handle_batch(second)
    assert second.acked and not first.acked and second not in consumer.unacked
    assert consumer._filter_committable_offsets([tp]) == {}  # nothing of tp is committable yet
    assert consumer._acked[other] == [7]  # another partition is not held back
    for f in kafka.futures:
        f.set_result(None)
    await asyncio.sleep(0)
    assert first.acked and sorted(consumer._acked[tp]) == [start, start + 1]
    assert consumer._filter_committable_offsets([tp]) == {tp: start + 2}


async def test_ack_batch_skips_committed_and_already_acked_offsets(router):
    app, _, _, _ = router
    consumer = app.consumer
    tp = TP(topics.MSG_ALL, 0)
    consumer._committed_offset[tp] = 5
    consumer._acked_index[tp].add(6)
    consumer._acked[tp].append(6)
    b = RecordBatch({tp: [_record(0, o, b"") for o in (4, 5, 6, 7)]}, 0)
    assert consumer.ack_batch(b) == 2
    assert sorted(consumer._acked[tp]) == [5, 6, 7]
    assert consumer.ack_batch(b) == 0  # acked once


async def test_agent_routes_batches_put_into_its_stream(router):
    app, runtime, kafka, _ = router
    async with runtime.agent.test_context() as agent:
        await agent.put(RecordBatch({TP(topics.MSG_ALL, 0): [_record(0, 1, _publish("x/1"))]},
                                    app.consumer_generation_id))
    assert len(kafka.sent) == 2 and runtime.batches == 1


def test_spliced_records_equal_the_serialized_messages():
    msg = pb.PublishMsg(publisher_id="p", topic="a/b", payload=b"\x00" * 300, qos=2, retain=True,
                        created_at_ms=123, message_expiry_interval=60,
                        user_properties=[pb.UserProperty(key="k", value="v")])
    live = [Delivery("c1", 1, False, (1, 2)), Delivery("c2", 2, True, ())]
    persisted = [Delivery("d1", 1, True, (3,)), Delivery("d2", 1, True, (3,)), Delivery("", 2, False, ())]
    plan = RoutingPlan(live={"s1": live, "s2": live[:1]}, persisted=persisted)
    recs = plan_records(msg, plan, b"a/b", msg.SerializeToString())
    expected = [pb.BasicDownlink(msg=msg, recipients=[
        pb.Recipient(client_id=d.client_id, qos=d.qos, retain=d.retain, subscription_ids=d.subscription_ids)
        for d in ds]).SerializeToString() for ds in (live, live[:1])]
    expected += [pb.PersistedMsg(client_id=d.client_id, msg=receiver_copy(msg, d.qos, d.retain, d.subscription_ids))
                 .SerializeToString() for d in persisted]
    assert [r.value for r in recs] == expected
    assert [r.topic for r in recs] == [topics.downlink_basic_topic("s1"), topics.downlink_basic_topic("s2")] + \
        [topics.MSG_PERSISTED] * 3
    assert [r.key for r in recs] == [b"a/b", b"a/b", b"d1", b"d2", b""]
    # without the received bytes, msg is serialized here: same records
    assert [r.value for r in plan_records(msg, plan, b"a/b")] == expected
    # with the origin: every BasicDownlink and PersistedMsg names it (one copy per origin downstream)
    with_origin = plan_records(msg, plan, b"a/b", msg.SerializeToString(), origin=(7, 123456789))
    for r in with_origin:
        cls = pb.BasicDownlink if r.topic != topics.MSG_PERSISTED else pb.PersistedMsg
        v = cls.FromString(r.value)
        assert (v.origin_partition, v.origin_offset) == (7, 123456789)
        v.ClearField("origin_partition")
        v.ClearField("origin_offset")
        assert v.SerializeToString() == expected[with_origin.index(r)]


async def test_the_pinned_faust_has_the_internals_the_batch_consumer_uses():
    from router.app import check_faust_internals
    from router.settings import RouterSettings
    from tbmq_platform.settings import load

    app, _runtime = create_app(load(RouterSettings, {}))
    check_faust_internals(app.consumer)  # raises when an upgrade moved one of them


def test_a_changed_faust_stops_the_router_with_a_message(monkeypatch):
    import faust
    from router import app as router_app

    monkeypatch.setattr(faust, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match="faust-streaming 0.99.0"):
        router_app.check_faust_internals()

    class Bare:
        pass

    monkeypatch.setattr(faust, "__version__", router_app.FAUST_CHECKED)
    with pytest.raises(RuntimeError, match="consumer._read_offset is missing"):
        router_app.check_faust_internals(Bare())

    # the worker's shutdown step RouterWorker replaces (its 1 s sleep): renamed by an upgrade, the override
    # would silently stop applying
    import mode.worker

    monkeypatch.delattr(mode.worker.Worker, "_sentinel_task")
    with pytest.raises(RuntimeError, match="Worker._sentinel_task is missing"):
        router_app.check_faust_internals()


async def test_the_router_has_no_table_and_starts_its_table_manager_without_fausts_wait():
    """RouterTableManager replaces TableManager.on_start, whose only other work is the 1 s sleep (kept for tables
    defined while an app starts; the router defines none)."""
    import inspect

    from faust.tables.manager import TableManager
    from router.app import RouterTableManager
    from router.settings import RouterSettings
    from tbmq_platform.settings import load

    app, _runtime = create_app(load(RouterSettings, {}))
    assert type(app.tables) is RouterTableManager and len(app.tables) == 0
    faust_start = inspect.getsource(TableManager.on_start)
    assert "self.sleep(1.0)" in faust_start and "_update_channels()" in faust_start
    assert "recovery.start()" in faust_start
    assert "sleep" not in inspect.getsource(RouterTableManager.on_start)


def test_the_router_worker_replaces_the_shutdown_step_mode_names():
    """RouterWorker's override is the method mode's Worker._shutdown_loop runs (not a name of our own)."""
    import inspect

    import mode.worker
    from router.__main__ import RouterWorker

    assert "self._sentinel_task()" in inspect.getsource(mode.worker.Worker._shutdown_loop)
    assert RouterWorker._sentinel_task is not mode.worker.Worker._sentinel_task


async def test_the_consumer_runs_on_the_worker_loop_when_asked():
    from router.app import InLoopConsumerThread
    from router.settings import RouterSettings
    from tbmq_platform.settings import load

    app, _runtime = create_app(load(RouterSettings, {}))
    thread = app.consumer._thread
    assert type(thread) is InLoopConsumerThread
    assert thread.thread_loop is thread.parent_loop is asyncio.get_running_loop()

    async def coro(x):
        return x + 1

    assert await thread.call_thread(coro, 1) == 2
    assert await thread.call_thread(lambda x: x * 3, 2) == 6  # mode's method queue takes sync calls too
    app2, _ = create_app(load(RouterSettings, {"ROUTER_CONSUMER_IN_LOOP": "false"}))
    assert type(app2.consumer._thread) is not InLoopConsumerThread


def test_a_poll_of_several_partitions_is_routed_in_arrival_order():
    from router.app import in_arrival_order

    def rec(partition, offset, ts):
        return ConsumerRecord(topics.MSG_ALL, partition, offset, ts, 0, b"k", b"v", None, 1, 1, ())

    p0 = [rec(0, 10, 100), rec(0, 11, 103), rec(0, 12, 103)]
    p1 = [rec(1, 5, 101), rec(1, 6, 102), rec(1, 7, 104)]
    p2 = [rec(2, 1, 99), rec(2, 2, 98)]  # another producer's clock: still in offset order
    got = [(r.partition, r.offset) for r in in_arrival_order({"a": p0, "b": p1, "c": p2})]
    assert got == [(2, 1), (2, 2), (0, 10), (1, 5), (1, 6), (0, 11), (0, 12), (1, 7)]
    for part in (0, 1, 2):  # each partition's records stay in offset order
        offs = [o for p, o in got if p == part]
        assert offs == sorted(offs)
    assert list(in_arrival_order({"a": p0})) == p0


async def test_a_batch_is_routed_only_once_the_views_reached_its_barrier(router):
    """handle_batch waits for the barrier asked when the batch arrived (RouterRuntime.deliver), so a
    subscription applied meanwhile (written before the batch's records) is used for it."""
    app, runtime, kafka, failures = router

    class FakeBarrier:  # the views "apply" client c's subscription when the end offsets are reached
        requests = 0

        def __init__(self):
            self.answer = asyncio.get_running_loop().create_future()

        def ends(self):
            self.requests += 1
            return self.answer

        async def wait(self, ends, timeout=None):
            await ends
            runtime.routing.apply_subscriptions(b"c", pb.ClientSubscriptions(client_id="c", subscriptions=[
                pb.TopicSubscription(topic_filter="x/1", qos=1)]).SerializeToString())
            runtime.routing.apply_session(b"c", pb.SessionInfo(client_id="c", service_id="conn-3",
                                                                connected=True).SerializeToString())

    runtime.barrier = FakeBarrier()
    batch = RecordBatch({TP(topics.MSG_ALL, 0): [_record(0, 1, _publish("x/1"))]}, app.consumer_generation_id)
    batch.barrier = runtime.barrier.ends()  # what deliver() does first
    task = asyncio.create_task(runtime.handle_batch(batch))
    await asyncio.sleep(0)
    assert not task.done() and kafka.sent == []  # not routed before the views caught up
    runtime.barrier.answer.set_result({})
    await task
    assert {s[0] for s in kafka.sent} == {topics.downlink_basic_topic(c) for c in ("conn-1", "conn-2", "conn-3")}
    assert runtime.health_details()["barrier_requests"] == 1 and not failures


async def test_only_a_batch_with_a_mark_or_the_first_of_an_assignment_waits_for_the_barrier(router):
    """RouterRuntime.deliver asks the barrier for the first batch of each assignment and for a batch that
    holds a subscription mark (tbmq_platform.marks: a null value); any other batch is routed at once. A
    mark is acked with its batch, routes nothing and is counted."""
    app, runtime, kafka, failures = router

    class CountingBarrier:
        requests = 0

        def ends(self):
            self.requests += 1
            fut = asyncio.get_running_loop().create_future()
            fut.set_result({})
            return fut

        async def wait(self, ends, timeout=None):
            await ends

    runtime.barrier = CountingBarrier()
    queue: asyncio.Queue = asyncio.Queue()
    runtime.attach(queue)
    gen = app.consumer_generation_id
    tp = TP(topics.MSG_ALL, 0)
    offsets = iter(range(100, 200))

    async def deliver(*values, generation=gen) -> RecordBatch:
        # a mark: a null value keyed by its connector (tbmq_platform.marks.MarkWriter)
        batch = RecordBatch({tp: [_record(0, next(offsets), v, key=b"conn-1" if v is None else b"x/y")
                                  for v in values]}, generation)
        await runtime.deliver(batch)
        assert queue.get_nowait() is batch
        return batch

    first = await deliver(_publish("x/1"))
    plain = await deliver(_publish("x/2"), _publish("x/3"))
    marked = await deliver(_publish("x/4"), None, _publish("x/5"))
    after = await deliver(_publish("x/6"))
    assert [b.barrier is not None for b in (first, plain, marked, after)] == [True, False, True, False]
    assert runtime.barrier.requests == 2
    next_assignment = await deliver(_publish("x/7"), generation=gen + 1)
    assert next_assignment.barrier is not None and runtime.barrier.requests == 3
    assert runtime.health_details()["marked_batches"] == 3

    for batch in (first, plain, marked, after):
        await runtime.handle_batch(batch)
    for fut in kafka.futures:
        fut.set_result(None)
    await runtime.pipeline.drain(5)
    # six PUBLISHes, two connectors each; the mark produced nothing, was counted, and is acked
    assert len(kafka.sent) == 12 and not failures
    assert runtime.routing.counters["marks"] == 1 and runtime.routing.counters["empty"] == 0
    assert all(b.acked for b in (first, plain, marked, after))


@pytest.mark.parametrize("raw", ["3", "120"])
def test_a_session_timeout_kafka_or_faust_would_refuse_stops_start_up_naming_it(raw):
    """Below Kafka's group.min.session.timeout.ms (6 s) the group join fails; above Faust's broker_request_timeout
    (90 s) Faust refuses it once the worker starts. Both are refused with the other settings, before anything
    starts."""
    from router.settings import RouterSettings
    from tbmq_platform.settings import SettingsError, load

    with pytest.raises(SettingsError, match="ROUTER_SESSION_TIMEOUT_S"):
        load(RouterSettings, {"ROUTER_SESSION_TIMEOUT_S": raw})
    assert load(RouterSettings, {"ROUTER_SESSION_TIMEOUT_S": "90"}).session_timeout_s == 90.0
