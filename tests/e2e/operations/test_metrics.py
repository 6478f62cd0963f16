"""Issue 16, deliverable 3: every service serves Prometheus text at GET /metrics on its health port (parsed
here with prometheus-client's own parser), with what operators look at: connections, messages in/out per
QoS, drops by reason, consumer lag per group, Redis and gRPC latency, queue depths, the process's CPU and
memory. The figures follow real traffic from paho-mqtt clients."""

from __future__ import annotations

import pytest
from mqtt_clients import Client, routed, run, wait_until
from scraped import scrape, value

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SERVICES = ["session-registry", "device-persistence", "app-delivery", "router", "connector"]


async def test_every_service_serves_prometheus_metrics_that_follow_the_traffic(make_suite, unique):
    # a Kafka of its own: the metrics count the work of the services' consumer groups, which a suite still
    # alive on the session's Kafka would share (docs/testing.md, "Suites that share the session's Kafka")
    suite = await make_suite(services=SERVICES, topic_profile="single-node", kafka=None)
    port = suite.mqtt_ports[0]
    u = unique("m")
    sub = Client(u + "-sub", v5=False, clean=False)  # a persistent DEVICE subscriber
    pub = Client(u + "-pub")
    await run(sub.connect, port)
    await run(sub.subscribe, f"{u}/t", 2)
    await run(pub.connect, port)
    await routed(pub, sub, f"{u}/t", 1)
    for qos in (0, 1, 2):
        for i in range(5):
            await run(pub.publish, f"{u}/t", f"{qos}-{i}".encode(), qos)
    assert await run(sub.wait, lambda: len([m for m in sub.messages_on(f"{u}/t")
                                            if not m.payload.startswith(b"probe-")]) >= 15)

    conn = await scrape(suite.health_port("connector"))
    for qos in ("0", "1", "2"):
        assert value(conn, "tbmq_messages_received_total", qos=qos) >= 5
    assert value(conn, "tbmq_messages_sent_total") >= 15
    assert value(conn, "tbmq_connections") == 2 and value(conn, "tbmq_clients") == 2
    assert "tbmq_consumer_lag" in conn and "process_cpu_seconds_total" in conn
    assert "tbmq_outbound_queued_messages" in conn and "tbmq_retained_messages" in conn
    # the persistent subscriber's stored messages were fetched and acknowledged over gRPC
    assert value(conn, "tbmq_grpc_call_seconds_count", method="FetchUndeliveredParts") >= 1

    async def router_routed():
        return value(await scrape(suite.health_port("router")), "tbmq_routed_messages_total") >= 15
    await wait_until(router_routed, 30, "the router's routed counter")
    rt = await scrape(suite.health_port("router"))
    assert value(rt, "tbmq_subscriptions") >= 1
    assert any(s.labels.get("group") for s in rt.get("tbmq_consumer_lag", []))  # the router's group

    dp = await scrape(suite.health_port("device-persistence"))
    # the QoS 1 and 2 copies of the persistent client: saved in Redis, or (QoS 1, once it is live with nothing
    # stored) held in memory until acknowledged (docs/device-persistence.md, "Held forwards")
    assert value(dp, "tbmq_stored_messages_total") + value(dp, "tbmq_held_messages_total") >= 10
    assert value(dp, "tbmq_stored_messages_total") >= 5  # QoS 2 is never held
    assert value(dp, "tbmq_held_released_total") <= value(dp, "tbmq_held_messages_total")
    assert "tbmq_held_clients" in dp and "tbmq_held_bytes" in dp
    assert value(dp, "tbmq_redis_call_seconds_count", script="save_messages") >= 1
    # the router's copies came over its Persist stream (ROUTER_PERSIST_VIA=grpc), none through tbmq.msg.persisted
    assert value(dp, "tbmq_persist_batches_total") >= 1 and value(dp, "tbmq_persist_records_total") >= 10
    assert value(rt, "tbmq_router_persist_unanswered") == 0

    reg = await scrape(suite.health_port("session-registry"))
    assert value(reg, "tbmq_sessions") >= 2 and value(reg, "tbmq_session_requests_total") >= 2

    app = await scrape(suite.health_port("app-delivery"))
    assert "tbmq_app_streams" in app and "process_resident_memory_bytes" in app
    await run(pub.close)
    await run(sub.close)
