"""The layout `make run` starts (`python -m tbmq_launcher run`, every service by default): device-persistence runs
inside the router's process (ROUTER_PERSIST_VIA=local, docs/router.md), so there is no device-persistence process,
and a persistent subscriber still gets what was published while it was away, with clients nobody here wrote
(paho-mqtt 3.1.1, mosquitto_pub); SIGINT stops everything."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import pytest
from mqtt_clients import Client, payloads, routed, run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


async def _launch(tmp_path, *args: str):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tbmq_launcher", "run", "--free-ports", "--quiet", "--run-dir", str(tmp_path / "run"),
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        async with asyncio.timeout(240):
            while not (lines and lines[-1].startswith("launcher: ready")):
                line = (await proc.stdout.readline()).decode()
                assert line, "launcher exited before ready:\n" + "".join(lines)
                lines.append(line)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc, "".join(lines)


async def test_make_run_runs_device_persistence_in_the_router_and_keeps_an_offline_clients_messages(tmp_path):
    proc, text = await _launch(tmp_path)
    try:
        ids = re.findall(r"^  (\S+-\d+)\s", text, re.M)
        assert "router-1" in ids and "connector-1" in ids and "session-registry-1" in ids, text
        assert not [i for i in ids if i.startswith("device-persistence")], text
        assert re.search(r"^  router-1 .*gRPC :\d+", text, re.M), text  # the API the connectors attach through
        port = int(re.search(r"MQTT localhost:(\d+)", text).group(1))

        sub = Client("layout-sub", v5=False, clean=False)
        await run(sub.connect, port)
        await run(sub.subscribe, "layout/t", 1)
        probe = Client("layout-probe", v5=False)
        await run(probe.connect, port)
        await routed(probe, sub, "layout/t", 1)
        await run(probe.close)
        await run(sub.close)
        for i in range(5):
            done = await run(subprocess.run, ["mosquitto_pub", "-p", str(port), "-t", "layout/t", "-q", "1",
                                              "-m", f"m{i}"], capture_output=True, timeout=30)
            assert done.returncode == 0, done.stderr
        back = Client("layout-sub", v5=False, clean=False)
        connack = await run(back.connect, port)
        assert connack[0].session_present
        assert await run(back.wait, lambda: len(payloads(back, "layout/t")) >= 5)
        assert payloads(back, "layout/t") == [f"m{i}".encode() for i in range(5)]  # stored, in order, once
        await run(back.close)
    finally:
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(90):
            out, _ = await proc.communicate()
    assert proc.returncode == 0 and "launcher: stopped" in out.decode()
