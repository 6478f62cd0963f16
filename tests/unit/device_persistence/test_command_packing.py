"""device-persistence's Redis connections pack commands with hiredis (store.packed_by_hiredis): the bytes
must be the ones redis-py's own Python packing writes, for every kind of argument the store sends."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection, SSLConnection

from tbmq_device_persistence.store import packed_by_hiredis

pytestmark = pytest.mark.unit

COMMANDS = [
    ("EVALSHA", "a" * 40, 2, b"{c1}_messages", b"{c1}_state", b"1000000", 268435456,
     b"604800000,6:P\0\0abc" + bytes(range(256))),
    ("SCRIPT LOAD", "return redis.call('TIME')"),  # a command name with a space: split in two
    ("ZRANGEBYSCORE", b"{c}_messages", 0, "+inf", "LIMIT", 0, 500),
    ("SET", "clé-ü", 1.5),  # str as UTF-8, a float as its repr
    ("HSET", memoryview(b"{c}_state"), bytearray(b"pid"), -7),
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_hiredis_packing_writes_what_redis_py_writes(cmd):
    client = packed_by_hiredis(aioredis.Redis())
    packed = client.connection_pool.connection_class()
    assert isinstance(packed, Connection) and type(packed) is not Connection
    assert b"".join(packed.pack_command(*cmd)) == b"".join(bytes(c) for c in Connection().pack_command(*cmd))
    assert b"".join(packed.pack_commands([cmd, cmd])) == b"".join(
        bytes(c) for c in Connection().pack_commands([cmd, cmd]))


def test_a_tls_pool_stays_tls():
    client = packed_by_hiredis(aioredis.Redis.from_url("rediss://localhost:6390/0"))
    cls = client.connection_pool.connection_class
    assert issubclass(cls, SSLConnection)
    assert packed_by_hiredis(client).connection_pool.connection_class is cls  # wrapped once
