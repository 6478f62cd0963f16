"""`python -m tbmq_launcher run` (what `make run` calls) as a real process: it starts its own Kafka and
Redis, prints where they listen and "ready", and SIGINT / SIGTERM leave no process behind (no orphan JVM,
no redis-server)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import psutil
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


async def _run_until_ready(tmp_path, *args: str):
    if "--services" not in args:
        args = ("--services", "none", *args)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tbmq_launcher", "run", "--free-ports", "--quiet",
        "--run-dir", str(tmp_path / "run"), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        async with asyncio.timeout(120):
            while True:
                line = (await proc.stdout.readline()).decode()
                if not line:
                    raise AssertionError("launcher exited before ready:\n" + "".join(lines))
                lines.append(line)
                if line.startswith("launcher: ready"):
                    break
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc, lines


async def _finish(proc, sig: int) -> tuple[int, str]:
    descendants = [p for p in psutil.Process(proc.pid).children(recursive=True)]
    assert any("kafka.Kafka" in " ".join(p.cmdline()) for p in descendants)
    assert any("redis-server" in " ".join(p.cmdline()) for p in descendants)
    proc.send_signal(sig)
    async with asyncio.timeout(60):
        out, _ = await proc.communicate()
    gone, alive = psutil.wait_procs(descendants, timeout=5)
    assert alive == [], f"left behind: {[p.pid for p in alive]}"
    return proc.returncode, out.decode()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_run_prints_ready_and_a_signal_stops_everything(tmp_path, sig):
    proc, lines = await _run_until_ready(tmp_path)
    text = "".join(lines)
    assert "kafka" in text and "localhost:" in text and "redis" in text
    code, rest = await _finish(proc, sig)
    assert code == 0, text + rest
    assert "launcher: stopped" in rest
    assert (tmp_path / "run" / "kafka" / "kafka.log").exists()


async def test_run_with_a_redis_cluster(tmp_path):
    proc, lines = await _run_until_ready(tmp_path, "--redis-cluster")
    assert "redis cluster" in "".join(lines)
    code, _ = await _finish(proc, signal.SIGINT)
    assert code == 0


async def test_unknown_service_is_a_usage_error(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tbmq_launcher", "run", "--services", "nope", "--run-dir", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    assert proc.returncode == 2 and b"unknown services" in out


async def test_run_makes_the_development_certificates_and_prints_every_listener(tmp_path):
    proc, lines = await _run_until_ready(tmp_path, "--services", "connector", "--redis-password", "pw")
    text = "".join(lines)
    tls = tmp_path / "run" / "tls"
    assert {"ca.pem", "server.pem", "server-key.pem"} <= {p.name for p in tls.iterdir()}
    connector_line = next(line for line in lines if line.startswith("launcher: connector-1: "))
    for kind in ("MQTT localhost:", "MQTT/TLS localhost:", "WS ws://localhost:", "WSS wss://localhost:"):
        assert kind in connector_line, connector_line
    assert connector_line.count("/mqtt") == 2
    assert f"--cafile {tls / 'ca.pem'}" in text
    assert "redis://:pw@127.0.0.1:" in text  # the launcher's Redis runs with requirepass
    code, rest = await _finish(proc, signal.SIGTERM)
    assert code == 0, text + rest
