"""tbmq_launcher.redis: real redis-server processes start, fail clearly and never outlive stop()."""

from __future__ import annotations

import os

import pytest
from tbmq_launcher.redis import RedisError, RedisServer, find_free_port, redis_command

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_start_stop_no_orphan(tmp_path):
    server = RedisServer(find_free_port(), tmp_path / "r", appendonly=False)
    await server.start()
    pid = server.pid
    assert server.running and server.url == f"redis://127.0.0.1:{server.port}/0"
    assert await redis_command("127.0.0.1", server.port, "PING") == "PONG"
    assert await redis_command("127.0.0.1", server.port, "CONFIG", "GET", "appendonly") == ["appendonly", "no"]
    await server.stop()
    assert not server.running and not _alive(pid)
    await server.stop()  # idempotent


async def test_port_taken_by_other_redis_fails_clearly(redis_standalone, tmp_path):
    intruder = RedisServer(redis_standalone.port, tmp_path / "r2")
    with pytest.raises(RedisError, match=r"exited with code|another process"):
        await intruder.start()
    assert not intruder.running
    assert await redis_command("127.0.0.1", redis_standalone.port, "PING") == "PONG"


async def test_durable_defaults(redis_standalone):
    port = redis_standalone.port
    assert await redis_command("127.0.0.1", port, "CONFIG", "GET", "appendonly") == ["appendonly", "yes"]
    assert await redis_command("127.0.0.1", port, "CONFIG", "GET", "appendfsync") == ["appendfsync", "everysec"]
    assert await redis_command("127.0.0.1", port, "CONFIG", "GET", "save") == ["save", ""]


async def test_cluster_ok(redis_cluster):
    assert len(redis_cluster.nodes) == 3
    for server in redis_cluster.servers:
        info = await redis_command("127.0.0.1", server.port, "CLUSTER", "INFO")
        assert "cluster_state:ok" in info and "cluster_size:3" in info
