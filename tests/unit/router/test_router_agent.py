"""The Faust agent and the send pipeline, without a broker (agent.test_context())."""

from __future__ import annotations

import asyncio

import pytest

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics

from router.app import Pipeline, create_app
from router.settings import RouterSettings

pytestmark = pytest.mark.unit


class FakeEvent:
    def __init__(self):
        self.acks = 0

    def ack(self):
        self.acks += 1


class FakeKafka:
    """send() returns a future that the test resolves (acknowledged) or fails."""

    def __init__(self, auto: bool = True):
        self.auto = auto
        self.sent: list[tuple[str, bytes, bytes, list]] = []
        self.futures: list[asyncio.Future] = []
        self.created: list[str] = []

    async def send(self, topic, key, value, headers):
        fut = asyncio.get_running_loop().create_future()
        self.sent.append((topic, key, value, headers))
        self.futures.append(fut)
        if self.auto:
            fut.set_result(None)
        return fut

    async def ensure(self, specs):
        self.created.extend(s.name for s in specs)


def _records(n):
    from router.convert import OutRecord
    return [OutRecord(f"t{i}", b"k", b"v") for i in range(n)]


async def test_event_is_acked_only_after_every_record_is_acknowledged():
    kafka = FakeKafka(auto=False)
    failures = []
    p = Pipeline(kafka.send, kafka.ensure, 100, failures.append)
    ev = FakeEvent()
    await p.submit(ev, _records(3), [])
    assert ev.acks == 0 and p.inflight == 1
    kafka.futures[0].set_result(None)
    kafka.futures[2].set_result(None)
    await asyncio.sleep(0)
    assert ev.acks == 0
    kafka.futures[1].set_result(None)
    await asyncio.sleep(0)
    assert ev.acks == 1 and p.inflight == 0 and not failures


async def test_failed_send_never_acks_and_reports_failure():
    kafka = FakeKafka(auto=False)
    failures = []
    p = Pipeline(kafka.send, kafka.ensure, 100, failures.append)
    ev = FakeEvent()
    await p.submit(ev, _records(2), [])
    kafka.futures[0].set_result(None)
    kafka.futures[1].set_exception(RuntimeError("broker gone"))
    await asyncio.sleep(0)
    assert ev.acks == 0 and len(failures) == 1
    with pytest.raises(RuntimeError):
        await p.submit(FakeEvent(), _records(1), [])


async def test_a_record_refused_before_it_is_queued_is_a_failure_not_a_stall():
    # e.g. aiokafka's MessageSizeTooLargeError, raised by send() itself: the same end as a refused ack
    # (on_failure: the router exits without committing and is restarted), never an event left in flight
    kafka = FakeKafka(auto=False)
    failures = []

    async def send(topic, key, value, headers):
        if value == b"too large":
            raise ValueError("record too large")
        return await kafka.send(topic, key, value, headers)

    p = Pipeline(send, kafka.ensure, 100, failures.append)
    from router.convert import OutRecord
    with pytest.raises(ValueError):
        await p.submit(FakeEvent(), [OutRecord("t", b"k", b"ok"), OutRecord("t", b"k", b"too large")], [])
    assert len(failures) == 1 and isinstance(failures[0], ValueError)
    with pytest.raises(RuntimeError):
        await p.submit(FakeEvent(), _records(1), [])


async def test_no_records_acks_immediately_and_inflight_is_bounded():
    kafka = FakeKafka(auto=False)
    p = Pipeline(kafka.send, kafka.ensure, 2, lambda e: None)
    ev = FakeEvent()
    await p.submit(ev, [], None)
    assert ev.acks == 1
    await p.submit(FakeEvent(), _records(1), [])
    blocked = asyncio.ensure_future(p.submit(FakeEvent(), _records(1), []))
    for _ in range(10):  # let it run as far as it can (all in memory: no clock involved)
        await asyncio.sleep(0)
    assert not blocked.done()  # 2 in flight: waits for room
    kafka.futures[0].set_result(None)
    await asyncio.wait_for(blocked, 1)


async def test_topics_with_spec_are_created_once():
    from router.convert import OutRecord
    kafka = FakeKafka()
    p = Pipeline(kafka.send, kafka.ensure, 10, lambda e: None)
    spec = topics.app_topic("abc")
    for _ in range(3):
        await p.submit(FakeEvent(), [OutRecord(spec.name, b"k", b"v", spec)], [])
    assert kafka.created == ["tbmq.msg.app.abc"]


@pytest.mark.parametrize("spans", [False, True])
async def test_agent_routes_records_and_acks(tmp_path, spans):
    app, runtime = create_app(RouterSettings(data_dir=str(tmp_path), trace_spans=spans))
    kafka = FakeKafka()
    runtime.pipeline = Pipeline(kafka.send, kafka.ensure, 100, lambda e: None)
    st = runtime.routing
    st.apply_subscriptions(b"a", pb.ClientSubscriptions(client_id="a", subscriptions=[
        pb.TopicSubscription(topic_filter="x/+", qos=1, subscription_id=9)]).SerializeToString())
    st.apply_session(b"a", pb.SessionInfo(client_id="a", service_id="conn-1", connected=True).SerializeToString())
    traceparent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with runtime.agent.test_context() as agent:
        msg = pb.PublishMsg(publisher_id="p", topic="x/y", qos=1, payload=b"hi")
        await agent.put(msg.SerializeToString(), key=b"x/y", headers=[("traceparent", traceparent)])
        await agent.put(pb.PublishMsg(topic="nobody/here").SerializeToString(), key=b"nobody/here")
        await agent.put(b"\xff\xff\xff", key=b"garbage")
    assert [s[0] for s in kafka.sent] == [topics.downlink_basic_topic("conn-1")]
    topic, key, value, headers = kafka.sent[0]
    assert key == b"x/y"
    d = pb.BasicDownlink.FromString(value)
    assert [(r.client_id, r.qos, list(r.subscription_ids)) for r in d.recipients] == [("a", 1, [9])]
    assert runtime.pipeline.acked_events == 3
    assert st.counters["undecodable"] == 1
    # the trace continues: the produced record carries the same trace id
    assert dict(headers)["traceparent"].split(b"-")[1] == traceparent.split(b"-")[1]
