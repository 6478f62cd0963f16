"""The health endpoint's readiness follows its checks for as long as the service runs (issue 15: readiness
was set once at start-up and never cleared)."""

from __future__ import annotations

import json

import pytest
from tbmq_launcher.services import http_get
from tbmq_platform.health import HealthServer

pytestmark = pytest.mark.unit


async def readyz(h: HealthServer) -> tuple[int, dict]:
    status, body = await http_get("127.0.0.1", h.port, "/readyz")
    return status, json.loads(body)


async def test_readiness_is_ready_and_every_check():
    state = {"views": None}
    h = HealthServer("127.0.0.1", 0, "svc", lambda: {"x": 1}, instance="svc-2")
    h.check("views", lambda: state["views"])
    h.check("broken check", lambda: 1 / 0 if state.get("raise") else None)
    await h.start()
    try:
        assert (await readyz(h))[0] == 503  # not ready yet
        h.ready = True
        status, body = await readyz(h)
        assert status == 200 and body["ready"] is True and body["x"] == 1 and "not_ready" not in body
        assert (body["service"], body["instance"]) == ("svc", "svc-2")
        state["views"] = "follower stopped: KafkaError()"
        status, body = await readyz(h)
        assert status == 503 and body["ready"] is False
        assert body["not_ready"] == {"views": "follower stopped: KafkaError()"}
        assert (await http_get("127.0.0.1", h.port, "/healthz"))[0] == 200  # alive all the same
        state["views"] = None
        state["raise"] = True
        status, body = await readyz(h)
        assert status == 503 and "ZeroDivisionError" in body["not_ready"]["broken check"]
        state["raise"] = False
        assert (await readyz(h))[0] == 200
    finally:
        await h.stop()
