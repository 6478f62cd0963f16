"""Redis as the launcher runs it: a Lua script on the real Redis, standalone and Cluster. (A Suite that owns
its Kafka broker and leaves no JVM behind is covered by test_launcher_cli.py.)"""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as ClusterClient

pytestmark = pytest.mark.integration

# Appends to a list and trims it, returning the new length: the shape of the device-persistence scripts.
LUA_PUSH = """
local n = redis.call('RPUSH', KEYS[1], ARGV[1])
if n > tonumber(ARGV[2]) then redis.call('LPOP', KEYS[1]); n = n - 1 end
redis.call('SET', KEYS[2], ARGV[1])
return n
"""


async def test_lua_script_on_the_real_redis(redis_server, unique):
    r = aioredis.from_url(redis_server.url)
    try:
        key = unique("msgs")
        assert await r.eval(LUA_PUSH, 2, key, key + ":last", "a", 2) == 1
        assert await r.eval(LUA_PUSH, 2, key, key + ":last", "b", 2) == 2
        script = r.register_script(LUA_PUSH)
        assert await script(keys=[key, key + ":last"], args=["c", 2]) == 2
        assert await r.lrange(key, 0, -1) == [b"b", b"c"]
        assert await r.get(key + ":last") == b"c"
    finally:
        await r.aclose()


async def test_lua_script_on_the_real_redis_cluster(redis_cluster, unique):
    host, port = redis_cluster.nodes[0].split(":")
    rc = ClusterClient(host=host, port=int(port))
    try:
        for client_id in (unique("c1"), unique("c2"), unique("c3")):
            key = "{%s}:msgs" % client_id  # one hash tag: one slot
            script = rc.register_script(LUA_PUSH)
            assert await script(keys=[key, "{%s}:last" % client_id], args=["x", 5]) == 1
            assert await rc.get("{%s}:last" % client_id) == b"x"
    finally:
        await rc.aclose()
