"""Dead connectors against a real Kafka (docs/session-registry.md, "Dead connectors"): fake connectors send
heartbeats and requests with an incarnation; the registry (a subprocess) ends the sessions of a run that
was replaced or went silent, publishes their Wills on tbmq.msg.all, fences the dead run, and declares a
connector that died while the registry was down once it is back."""

from __future__ import annotations

import uuid

import pytest
from session_registry_harness import eventually
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics

pytestmark = [pytest.mark.integration]


def will(topic: str) -> pb.PublishMsg:
    return pb.PublishMsg(publisher_id="x", topic=topic, payload=b"gone", qos=1)


async def test_a_new_run_ends_the_old_runs_sessions_and_fences_it(start_registry, connectors, sessions, watch,
                                                                  cid):
    await start_registry({"TBMQ_CONNECTOR_TIMEOUT_MS": "60000"})   # only the replacement declares it here
    (conn,) = await connectors(1)
    msgs = await watch(topics.MSG_ALL)
    conn.incarnation = "run-a"
    await conn.heartbeat()
    plain, kept, fresh = cid("dead"), cid("dead"), cid("dead")
    wtopic = f"wills/{plain}"
    resp, plain_sid = await conn.connect(plain, sei=0, will=will(wtopic))
    assert resp.success
    resp, kept_sid = await conn.connect(kept, sei=60)
    assert resp.success

    conn.incarnation = "run-b"                      # a quick restart under the same service id
    await conn.heartbeat()
    await eventually(lambda: sessions.removed(plain) and sessions.offline(kept), what="the old run's sessions ended")
    assert sessions.get(kept).persistent and sessions.get(kept).session_expiry_interval == 60
    (w,) = await eventually(lambda: msgs.of_key(wtopic), what="the Will on tbmq.msg.all")
    assert pb.PublishMsg.FromString(w.value).payload == b"gone"
    def fenced() -> list[pb.DisconnectCommand] | None:
        out = [d for d in conn.all_disconnects() if d.reason == pb.DISCONNECT_REASON_CONNECTOR_FENCED]
        return out if {d.session_id for d in out} >= {plain_sid, kept_sid} else None
    commands = await eventually(fenced, what="the old run's connections closed")
    assert {d.connector_incarnation for d in commands} == {"run-a"}   # the new run ignores them

    resp, _ = await conn.connect(fresh, sei=60)     # the new run serves
    assert resp.success
    conn.incarnation = "run-a"                      # the old run (paused, say) tries again: refused
    resp, _ = await conn.connect(cid("dead"))
    assert not resp.success and resp.failure == pb.SESSION_FAILURE_CONNECTOR_FENCED
    conn.incarnation = "run-b"
    assert sessions.get(fresh).connected and len(msgs.of_key(wtopic)) == 1


async def test_a_connector_that_died_while_the_registry_was_down_is_declared(start_registry, connectors, sessions,
                                                                           cid):
    suite = await start_registry({"TBMQ_CONNECTOR_TIMEOUT_MS": "1500"})
    (conn,) = await connectors(1)
    conn.incarnation = uuid.uuid4().hex
    await conn.heartbeat()
    client = cid("dead")
    resp, _ = await conn.connect(client, sei=60)
    assert resp.success
    await suite.stop_service("session-registry")
    # the connector dies (sends nothing more); the registry comes back and reads its last heartbeat
    await suite.start_service("session-registry")
    await eventually(lambda: sessions.offline(client), 30, what="the session ended after one timeout")
    assert sessions.get(client).persistent
