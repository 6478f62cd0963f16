"""A service asked to stop while its start-up still runs stops at once (tbmq_platform.lifecycle.serve).

The real session-registry process, pointed at a Kafka that is not there: its start-up keeps retrying the
bootstrap for up to 60 s. SIGTERM (what the launcher's death signal sends when the launcher dies) used to wait
for that start-up to give up; a bench helper that died this way left a session-registry behind, retrying an
unreachable Kafka at a few % of a core for as long as nobody noticed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from tbmq_launcher.redis import find_free_port
from tbmq_launcher.services import http_get
from waits import wait_until

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


async def test_sigterm_during_start_up_stops_the_service_at_once(tmp_path):
    health = find_free_port()
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{find_free_port()}", "HEALTH_PORT": str(health),
           "TBMQ_SERVICE_ID": "session-registry-stoptest"}
    log = tmp_path / "session-registry.log"
    with log.open("wb") as f:  # a file, not a pipe nobody reads while the start-up retries and logs
        proc = await asyncio.create_subprocess_exec(str(BIN / "session-registry"), env=env, cwd=tmp_path,
                                                    stdout=f, stderr=asyncio.subprocess.STDOUT)
    try:
        async def alive() -> bool:
            try:
                return (await http_get("127.0.0.1", health, "/healthz"))[0] == 200
            except OSError:
                return False

        await wait_until(alive, 30, "the health endpoint (up before start-up begins)")
        ready = await http_get("127.0.0.1", health, "/readyz")
        assert ready[0] == 503  # still starting: no Kafka
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 20)  # the bootstrap retries alone would take 60 s
        out = log.read_text(errors="replace")
        assert code == 0, out
        assert "stop requested while starting" in out, out
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
