"""Redis store of persistent DEVICE sessions' undelivered messages (standalone Redis or Redis Cluster).

Guarantee: a client's messages are kept (up to the count and byte limits, oldest trimmed first) and handed
out in serial order, in pages; a packet id is given to a message only when it is first handed to a
connection and kept until it is acknowledged (a re-send keeps it, MQTT-4.4.0-1), so the 65535 packet ids
bound what is in flight, never the backlog.

Keys per client (``<p>`` = optional key prefix, ``{tag}`` = the client id as a Redis Cluster hash tag, so
every key of one client is in one slot and each Lua script touches one slot):

    <p>{tag}_messages          ZSET  member = "<serial>:<size>", score = serial (grows forever)
    <p>{tag}_messages_<serial> STRING with a TTL: the stored value (below)
    <p>{tag}_pids              HASH  packet id -> member: handed out and not acknowledged
    <p>{tag}_state             HASH  pid (last handed out), serial (last), bytes (stored), live (the
                               attachment value whose last page reached the end: forwarded to; only
                               ever equal to _attached, removed with it by detach.lua)
    <p>{tag}_attached          STRING "<service_id>|<session_id>": the connection of the client (set by
                               fetch_undelivered.lua, read by save_messages.lua, deleted by detach.lua /
                               clear_all.lua)

``tag`` is the client id itself, except that an empty client id or one starting with ``}`` or ``%`` is
prefixed with ``%`` (an empty hash tag would hash each whole key to a different slot). The mapping is
one-to-one, so two clients never share keys.

Stored value: one packet-type byte, the 2-byte big-endian packet id (0 = not handed out yet), then a
serialized ``tbmq.v1.PublishMsg``::

    b"P" + pid + PublishMsg   -> DEVICE_PACKET_TYPE_PUBLISH   (PUBLISH owed)
    b"R" + pid + PublishMsg   -> DEVICE_PACKET_TYPE_PUBREL    (PUBREC received, only PUBREL owed)

A PUBREC is one ``SETRANGE key 0 R`` and a hand-out one ``SETRANGE key 1 <pid>`` (both keep the TTL,
never parse protobuf). The scripts live in the repository's top-level ``lua/`` directory (override:
``TBMQ_LUA_DIR`` or ``StoreConfig.lua_dir``); each file documents its KEYS/ARGV/return; ``packet_ids.lua``
is the shared part (layout, packet-id hand-out) prepended to the scripts that need it.

TTL of a stored message: the MQTT 5 Message Expiry Interval remaining at save time, to the millisecond
(``tbmq_routing.expiry.store_ttl_ms``, the rule every service applies [MQTT-3.3.2-5]; already expired ->
not stored), else the configured TTL (default 7 days).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.connection import HiredisRespSerializer
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import HIREDIS_AVAILABLE
from tbmq.v1 import messages_pb2, services_pb2
from tbmq_platform.wire import varint
from tbmq_routing import expiry

if HIREDIS_AVAILABLE:
    from hiredis import pack_command as _pack_command

__all__ = [
    "MAX_PACKET_ID",
    "SCRIPT_NAMES",
    "Attachment",
    "ClientKeys",
    "DeviceMsgStore",
    "StoreConfig",
    "SaveResult",
    "StoreStats",
    "client_keys",
    "default_lua_dir",
    "hash_tag",
    "packed_by_hiredis",
    "refused_for_data",
    "script_source",
]

MAX_PACKET_ID = 65535
MAX_MESSAGES_LIMIT = 1_000_000  # per client (save_messages.lua checks it too)
MAX_HANDED_OUT_LIMIT = MAX_PACKET_ID - 1  # packet ids in use per client: one is always free
SAVE_REPLY = 8  # save_messages.lua's reply elements per client
SCRIPT_NAMES = ("save_messages", "fetch_undelivered", "remove_message", "mark_pubrec", "clear_all", "detach",
                "reserve_held", "spill_held", "held_marks")
LIBRARY = "packet_ids"  # lua/packet_ids.lua, prepended to every script

_TYPE_PUBLISH = b"P"
_TYPE_PUBREL = b"R"


def refused_for_data(exc: BaseException) -> bool:
    """Redis refused a script call for what is in the keys or the arguments it was given, not for the state
    of Redis: the same call fails the same way however often it is retried. A key of another type
    (WRONGTYPE), or an error raised inside a script (Redis 7 ends those with "script: <sha>, on
    @user_script:<line>."; the scripts' own checks answer "ERR <script>: ...", which redis-py gives without
    "ERR "). Every other error (a connection, a timeout, BUSY, LOADING, OOM, READONLY, TRYAGAIN,
    CLUSTERDOWN, NOSCRIPT, NOPERM, ...) is about Redis and passes when Redis does."""
    if not isinstance(exc, ResponseError) or isinstance(exc, NoScriptError):
        return False
    text = str(exc)
    return text.startswith("WRONGTYPE") or "@user_script:" in text or any(
        text.startswith(f"{name}: ") for name in SCRIPT_NAMES)


class _HiredisPacker:
    """redis-py's HiredisRespSerializer without its per-argument pass in Python (a generator turning
    bytearray/memoryview arguments into bytes, about a third of what packing a save cost): a command whose
    name is one word goes to hiredis as it is, and only one hiredis refuses (a bytearray, or any other type it
    does not take) goes through redis-py's serializer. hiredis packs a memoryview as its bytes itself, so the
    bytes are the same either way (tests/unit/device_persistence/test_command_packing.py)."""

    __slots__ = ("_slow",)

    def __init__(self) -> None:
        self._slow = HiredisRespSerializer()

    def pack(self, *args):
        name = args[0]
        if name.__class__ is str and " " not in name:
            try:
                return [_pack_command(args)]
            except TypeError:
                pass
        return self._slow.pack(*args)


class _HiredisPacking:
    """Packs commands with hiredis (C) instead of redis-py's asyncio connection, which packs in Python although
    hiredis is installed (its sync client uses hiredis; `redis.connection.HiredisRespSerializer` is that
    packer). The bytes are the same; a save batch of 20 clients packs in about 14 µs instead of 99
    (docs/performance.md, "The twenty-eighth round"). Mixed in before the pool's own connection class, so a
    TLS (rediss://) pool stays TLS."""

    _packer: Any = None

    def pack_command(self, *args):
        return self._packer.pack(*args)


_PACKED_CLASSES: dict[type, type] = {}


def packed_by_hiredis(client: Any) -> Any:
    """`client` (a redis.asyncio.Redis) with its pool's connections packing commands by hiredis; unchanged
    when hiredis is not installed."""
    if not HIREDIS_AVAILABLE:
        return client
    pool = client.connection_pool
    base = pool.connection_class
    if not issubclass(base, _HiredisPacking):
        cls = _PACKED_CLASSES.get(base)
        if cls is None:
            cls = _PACKED_CLASSES[base] = type(f"HiredisPacked{base.__name__}", (_HiredisPacking, base),
                                               {"_packer": _HiredisPacker()})
        pool.connection_class = cls
    return client


def default_lua_dir() -> Path:
    """``TBMQ_LUA_DIR`` when set, else the repository's top-level ``lua/`` found above this file."""
    env = os.environ.get("TBMQ_LUA_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "lua"
        if (candidate / "save_messages.lua").is_file():
            return candidate
    return here.parents[4] / "lua"


def script_source(name: str, lua_dir: Path | None = None) -> str:
    """The source of lua/<name>.lua as loaded into Redis: lua/packet_ids.lua (the shared part) in front."""
    lua_dir = lua_dir or default_lua_dir()
    parts = [LIBRARY, name]
    texts = []
    for part in parts:
        path = lua_dir / f"{part}.lua"
        try:
            texts.append(path.read_text())
        except OSError as exc:
            raise FileNotFoundError(f"Lua script {path} not readable (TBMQ_LUA_DIR?)") from exc
    return "\n".join(texts)


@dataclass(frozen=True)
class StoreConfig:
    """Pure configuration of the store; the service settings object fills it from the environment
    (MQTT_PERSISTENT_SESSION_DEVICE_PERSISTED_MESSAGES_LIMIT / _TTL, REDIS_URL, REDIS_CLUSTER_NODES)."""

    redis_url: str = "redis://localhost:6380/0"
    cluster_nodes: tuple[str, ...] = ()  # "host:port"; non-empty = Redis Cluster mode
    redis_password: str | None = None  # AUTH password; None = the one in redis_url, if any
    messages_limit: int = MAX_MESSAGES_LIMIT  # per client (and the byte limit below)
    bytes_limit: int = 256 * 1024 * 1024  # stored bytes per client (oldest trimmed first)
    handed_out_limit: int = 20000  # packet ids in use per client (handed out, unacknowledged), < 65535
    messages_ttl_s: int = 604800  # default TTL of a stored message (7 days)
    key_prefix: str = ""
    lua_dir: Path | None = None  # None = default_lua_dir()
    pipeline_chunk: int = 500  # script calls per pipeline in save_many (chunks run concurrently)
    # a page is read in script calls of at most this many messages: a script blocks Redis (every client's
    # saves and acknowledgements wait) for one part, not a whole page; each part's call is sent before the
    # previous part is encoded
    fetch_chunk_messages: int = 500
    save_clients_per_call: int = 200  # clients per multi-client script call (save, acks; a script blocks Redis)
    max_in_flight: int = 64  # Redis requests/pipelines in flight at once (redis-py pools refuse >100)
    # a Redis that stops answering (black-holed, a hung host) fails the call after this long instead of
    # hanging the save loop: the batch is retried, its offsets stay uncommitted (REDIS_SOCKET_TIMEOUT_MS)
    socket_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        errors = []
        if not isinstance(self.messages_limit, int) or not 1 <= self.messages_limit <= MAX_MESSAGES_LIMIT:
            errors.append(
                f"MQTT_PERSISTENT_SESSION_DEVICE_PERSISTED_MESSAGES_LIMIT must be 1..{MAX_MESSAGES_LIMIT}, "
                f"got {self.messages_limit!r}"
            )
        if not isinstance(self.bytes_limit, int) or self.bytes_limit < 1024:
            errors.append(
                "MQTT_PERSISTENT_SESSION_DEVICE_PERSISTED_BYTES_LIMIT must be at least 1024 bytes, "
                f"got {self.bytes_limit!r}"
            )
        if not isinstance(self.handed_out_limit, int) or not 1 <= self.handed_out_limit <= MAX_HANDED_OUT_LIMIT:
            errors.append(
                f"DEVICE_PERSISTENCE_HANDED_OUT_LIMIT must be 1..{MAX_HANDED_OUT_LIMIT} (packet ids in use "
                f"per client), got {self.handed_out_limit!r}"
            )
        if not isinstance(self.messages_ttl_s, int) or self.messages_ttl_s <= 0:
            errors.append(
                "MQTT_PERSISTENT_SESSION_DEVICE_PERSISTED_MESSAGES_TTL must be a positive number of "
                f"seconds, got {self.messages_ttl_s!r}"
            )
        if "{" in self.key_prefix or "}" in self.key_prefix:
            errors.append(f"key prefix must not contain braces (hash tags), got {self.key_prefix!r}")
        if self.pipeline_chunk < 1:
            errors.append("pipeline_chunk must be >= 1")
        if self.fetch_chunk_messages < 1:
            errors.append("fetch_chunk_messages must be >= 1")
        if self.save_clients_per_call < 1:
            errors.append("save_clients_per_call must be >= 1")
        if not 1 <= self.max_in_flight <= 90:
            errors.append("max_in_flight must be 1..90")
        for node in self.cluster_nodes:
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit():
                errors.append(f"cluster node must be host:port, got {node!r}")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def cluster(self) -> bool:
        return bool(self.cluster_nodes)


@dataclass(frozen=True)
class ClientKeys:
    messages: str
    pids: str
    state: str
    attached: str

    def message(self, serial: int) -> str:
        return f"{self.messages}_{serial}"


@dataclass(frozen=True)
class Attachment:
    """The connection a client is attached to: its new messages are forwarded on the Forward stream of
    <service_id>."""

    service_id: str
    session_id: str

    def encode(self) -> str:
        return f"{self.service_id}|{self.session_id}"

    @classmethod
    def decode(cls, raw: bytes | str | None) -> Attachment | None:
        if not raw:
            return None
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "replace")
        service_id, sep, session_id = raw.partition("|")
        return cls(service_id, session_id) if sep else None


@dataclass(frozen=True)
class Source:
    """Where a client's batch came from: its tbmq.msg.persisted partition and the offset of each message
    (aligned with the batch, ascending). save_messages.lua applies a batch with a source once per offset."""

    partition: int
    offsets: Sequence[int]


@dataclass
class SaveResult:
    """What one client's save produced: the stored messages (serial assigned, in order; the first
    `forwarded` of them handed out with a packet id, the others have packet_id 0) and the attachment
    the client is live on, read atomically with the save (None = not live: nothing to forward)."""

    messages: list[messages_pb2.DevicePublishMsg]
    attached: Attachment | None = None
    indexes: list[int] = field(default_factory=list)  # index in the input batch of each stored message
    forwarded: int = 0
    paused: bool = False  # the handed-out limit stopped forwarding: the client pages again
    applied_before: int = 0  # records of the batch found applied before (source or origin): not stored again
    again: list[messages_pb2.DevicePublishMsg] = field(default_factory=list)  # stored before, forwarded again

    @property
    def forwards(self) -> list[messages_pb2.DevicePublishMsg]:
        """The messages to forward to `attached` (handed out with packet ids), in order: those stored before and
        forwarded again first (tbmq_device_persistence.service), then the ones stored now."""
        if self.attached is None:
            return []
        return self.again + self.messages[:self.forwarded] if self.again else self.messages[:self.forwarded]


def hash_tag(client_id: str) -> str:
    if not client_id or client_id[0] in "}%":
        return "%" + client_id
    return client_id


def client_keys(client_id: str, prefix: str = "") -> ClientKeys:
    base = f"{prefix}{{{hash_tag(client_id)}}}"
    return ClientKeys(f"{base}_messages", f"{base}_pids", f"{base}_state", f"{base}_attached")


@dataclass
class StoreStats:
    saved: int = 0
    trimmed: int = 0  # stored references dropped because of the limit (oldest first)
    dropped_on_save: int = 0  # not stored: already expired, or beyond the limit within one batch
    replayed: int = 0  # not stored again: their source offsets were applied before (a replay after a crash)
    routed_again: int = 0  # not stored again: their tbmq.msg.all origin was applied before (a router's replay)
    save_calls: int = 0  # save_messages.lua calls made by save_many (one per group of clients)
    ack_calls: int = 0  # remove_message.lua calls made by apply_acks (one per group of clients)
    noscript_reloads: int = 0


class DeviceMsgStore:
    """Async store over redis.asyncio (standalone) or redis.asyncio.cluster.RedisCluster.

    ``await start()`` (or ``async with``) connects and loads the scripts (a Lua error fails start-up);
    calls use EVALSHA and reload a script after NOSCRIPT (e.g. SCRIPT FLUSH, failover to a fresh node).
    """

    def __init__(self, config: StoreConfig, *, client: Any | None = None) -> None:
        self.config = config
        self.stats = StoreStats()
        self._client = client
        self._own_client = client is None
        self._lua_dir = Path(config.lua_dir) if config.lua_dir else default_lua_dir()
        self._sources = {name: script_source(name, self._lua_dir) for name in SCRIPT_NAMES}
        self._scripts: dict[str, Any] = {}
        self._node_clients: dict[str, Any] = {}  # cluster mode: "host:port" -> plain client (pipelines)
        self._lock = asyncio.Lock()
        # Callers may gather thousands of calls; redis-py's pools raise MaxConnectionsError beyond 100
        # connections, so requests queue here instead.
        self._in_flight = asyncio.Semaphore(config.max_in_flight)
        # (script name, seconds) per script call or pipelined batch of calls: the service's Redis latency
        # histogram (tbmq_platform.metrics); None = not observed
        self.observe: Callable[[str, float], None] | None = None

    # ------------------------------------------------------------------------------------ lifecycle

    @property
    def redis(self) -> Any:
        if self._client is None:
            raise RuntimeError("DeviceMsgStore.start() was not called")
        return self._client

    async def start(self) -> None:
        if self._client is None:
            if self.config.cluster:
                nodes = []
                for node in self.config.cluster_nodes:
                    host, _, port = node.rpartition(":")
                    nodes.append(ClusterNode(host, int(port)))
                self._client = RedisCluster(startup_nodes=nodes, decode_responses=False,
                                            **self._client_options())
                await self._client.initialize()
            else:
                self._client = packed_by_hiredis(aioredis.Redis.from_url(
                    self.config.redis_url, decode_responses=False, **self._client_options()))
        self._scripts = {name: self._client.register_script(src) for name, src in self._sources.items()}
        for script in self._scripts.values():  # fail fast on a Lua syntax error / unreachable Redis
            loaded = await self._client.script_load(script.script)
            if isinstance(loaded, bytes):
                loaded = loaded.decode()
            script.sha = loaded

    def _client_options(self) -> dict:
        """Socket timeouts and the password, for every client this store makes."""
        auth = {"password": self.config.redis_password} if self.config.redis_password else {}
        return {"socket_timeout": self.config.socket_timeout_s,
                "socket_connect_timeout": self.config.connect_timeout_s, **auth}

    async def close(self) -> None:
        clients, self._node_clients = list(self._node_clients.values()), {}
        for c in clients:
            await c.aclose()
        if self._client is not None and self._own_client:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> DeviceMsgStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    # ------------------------------------------------------------------------------------ keys

    def keys(self, client_id: str) -> ClientKeys:
        return client_keys(client_id, self.config.key_prefix)

    # ------------------------------------------------------------------------------------ encoding

    def _ttl_ms(self, msg: messages_pb2.PublishMsg, default_ttl_s: int, now_ms: int) -> int:
        if msg.HasField("message_expiry_interval"):  # the one rule: tbmq_routing.expiry
            return expiry.store_ttl_ms(msg.created_at_ms, msg.message_expiry_interval, now_ms)
        return default_ttl_s * 1000

    def _save_args(
        self, messages: Sequence[messages_pb2.PublishMsg], default_ttl_s: int | None, now_ms: int,
        source: Source | None = None, origins: Sequence[tuple[int, int] | None] | None = None,
    ) -> tuple[list[Any], list[int]]:
        """ARGV for save_messages.lua (limits, records) and the indexes (into `messages`) of what is
        sent; a record is b"<ttl_ms>,<len>:" + b"P\\0\\0" + PublishMsg bytes (no packet id yet). With
        `source` the batch starts with its header, b"@<partition>:<offset>,...;" (the offsets of the records
        sent), and the script stores it once (a replay of applied offsets is skipped). With `origins`
        (aligned with `messages`: the tbmq.msg.all (partition, offset) each was routed from, or None) an
        origin header follows, b"#<partition>:<offset>,-,...;", and a record whose origin the client's
        store already applied (the router routed it again) is not stored."""
        ttl_s = self.config.messages_ttl_s if default_ttl_s is None else default_ttl_s
        records: list[bytes] = []
        sent: list[int] = []
        for i, msg in enumerate(messages):
            ttl = self._ttl_ms(msg, ttl_s, now_ms)
            if ttl <= 0:
                self.stats.dropped_on_save += 1
                continue
            body = msg.SerializeToString()
            records.append(b"%d,%d:P\x00\x00" % (ttl, len(body) + 3))
            records.append(body)
            sent.append(i)
        if origins is not None and sent:
            records.insert(0, b"#%s;" % b",".join(
                b"%d:%d" % origins[i] if origins[i] is not None else b"-" for i in sent))
        if source is not None and sent:
            offsets = source.offsets
            records.insert(0, b"@%d:%s;" % (source.partition, b",".join(b"%d" % offsets[i] for i in sent)))
        return [*self._limits(), b"".join(records)], sent

    def _limits(self) -> list[int]:
        """save_messages.lua's ARGV[1..3]."""
        c = self.config
        return [c.messages_limit, c.bytes_limit, c.handed_out_limit]

    def _save_result(
        self,
        client_id: str,
        messages: Sequence[messages_pb2.PublishMsg],
        sent: list[int],
        reply: list[Any],
    ) -> SaveResult:
        """reply = {trimmed, skipped, first_serial, pids of the forwarded (2-byte big-endian), attached,
        paused, replayed, routed_again}: of `sent`, the first `replayed` were applied before; of the rest,
        those marked b"1" in `routed_again` (one byte each, b"" = none) had an origin applied before; of
        what remains, the first `skipped` were beyond a limit, the rest is stored."""
        trimmed, skipped, serial, blob = int(reply[0]), int(reply[1]), int(reply[2]), reply[3]
        replayed = int(reply[6])
        again = reply[7]
        self.stats.trimmed += trimmed
        self.stats.dropped_on_save += skipped
        self.stats.replayed += replayed
        sent = sent[replayed:]
        if again:
            if len(again) != len(sent):
                raise RuntimeError(f"save_messages.lua marked {len(again)} of {len(sent)} records")
            self.stats.routed_again += again.count(b"1")
            sent = [i for i, a in zip(sent, again) if a == 0x30]  # b"0": not applied before
        pids = memoryview(blob).cast("B")
        forwarded = len(blob) // 2
        out = []
        for j, i in enumerate(sent[skipped:]):
            dmsg = messages_pb2.DevicePublishMsg(
                client_id=client_id,
                packet_id=(pids[2 * j] << 8) | pids[2 * j + 1] if j < forwarded else 0,
                serial=serial + j,
                packet_type=messages_pb2.DEVICE_PACKET_TYPE_PUBLISH,
            )
            dmsg.msg.CopyFrom(messages[i])
            out.append(dmsg)
        if forwarded > len(out):
            raise RuntimeError(f"save_messages.lua returned {forwarded} packet ids for {len(out)} messages")
        self.stats.saved += len(out)
        return SaveResult(out, Attachment.decode(reply[4]), sent[skipped:], forwarded, bool(int(reply[5])),
                          replayed + (again.count(b"1") if again else 0))

    # ------------------------------------------------------------------------------------ script calls

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA through redis-py's registered script, which reloads it after NOSCRIPT."""
        async with self._in_flight:
            t0 = time.perf_counter()
            try:
                return await self._scripts[name](keys=keys, args=args)
            finally:
                if self.observe is not None:
                    self.observe(name, time.perf_counter() - t0)

    async def _call_many(self, name: str, calls: list[tuple[list[str], list[Any]]], *,
                         ordered: bool = False) -> list[Any]:
        """One EVALSHA per call, pipelined (chunks of pipeline_chunk run concurrently, or with `ordered` one
        after the other, none after one that failed; in cluster mode the pipeline is split per node). Calls
        refused with NOSCRIPT are retried after reloading the script (NOSCRIPT means the script did not run,
        so the retry cannot apply anything twice)."""
        script = self._scripts[name]
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        t0 = time.perf_counter()
        try:
            return await self._call_many_attempts(name, script, calls, results, todo, ordered)
        finally:
            if self.observe is not None:
                self.observe(name, time.perf_counter() - t0)

    async def _call_many_attempts(self, name: str, script: Any, calls, results: list[Any], todo: list[int],
                                  ordered: bool = False):
        for attempt in range(3):
            chunk = self.config.pipeline_chunk
            parts = [todo[i : i + chunk] for i in range(0, len(todo), chunk)]
            if ordered:
                replies = [await self._pipeline(script, calls, p) for p in parts]
            else:
                replies = await asyncio.gather(*(self._pipeline(script, calls, p) for p in parts))
            retry = []
            for part, rep in zip(parts, replies):
                for idx, r in zip(part, rep):
                    if isinstance(r, NoScriptError) or (
                        isinstance(r, ResponseError) and str(r).startswith("NOSCRIPT")
                    ):
                        retry.append(idx)
                    elif isinstance(r, Exception):
                        raise r
                    else:
                        results[idx] = r
            if not retry:
                return results
            async with self._lock:
                loaded = await self.redis.script_load(script.script)
                script.sha = loaded.decode() if isinstance(loaded, bytes) else loaded
                self.stats.noscript_reloads += 1
            todo = retry
        raise NoScriptError(f"{name}: script still missing after reloading it")

    async def _pipeline(self, script: Any, calls: list[tuple[list[str], list[Any]]], idxs: list[int]):
        if self.config.cluster:
            return await self._cluster_pipeline(script, calls, idxs)
        async with self._in_flight:
            pipe = self.redis.pipeline(transaction=False)
            async with pipe:
                for i in idxs:
                    keys, args = calls[i]
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                return await pipe.execute(raise_on_error=False)

    async def _cluster_pipeline(self, script: Any, calls: list[tuple[list[str], list[Any]]], idxs: list[int]):
        """redis-py's ClusterPipeline refuses EVALSHA, so: group the calls by the master owning their slot
        (all keys of a call share one slot), pipeline each group over a plain connection to that master,
        all masters concurrently. Calls answered with a redirection (MOVED/ASK during resharding) or hit
        by a connection error are re-run one by one through the cluster client, which follows
        redirections and refreshes the slot map."""
        rc = self.redis
        groups: dict[str, list[int]] = {}
        for i in idxs:
            node = rc.get_node_from_key(calls[i][0][0])
            groups.setdefault(node.name, []).append(i)

        async def run_node(name: str, group: list[int]) -> list[Any]:
            client = self._node_clients.get(name)
            if client is None:
                host, _, port = name.rpartition(":")
                client = packed_by_hiredis(aioredis.Redis(host=host, port=int(port), decode_responses=False,
                                                          **self._client_options()))
                self._node_clients[name] = client
            try:
                async with self._in_flight:
                    pipe = client.pipeline(transaction=False)
                    async with pipe:
                        for i in group:
                            keys, args = calls[i]
                            pipe.evalsha(script.sha, len(keys), *keys, *args)
                        return await pipe.execute(raise_on_error=False)
            except (ConnectionError, TimeoutError, RedisConnectionError, RedisTimeoutError) as exc:
                return [exc] * len(group)

        replies = await asyncio.gather(*(run_node(n, g) for n, g in groups.items()))
        by_idx: dict[int, Any] = {}
        for group, rep in zip(groups.values(), replies):
            by_idx.update(zip(group, rep))
        for i, r in by_idx.items():
            if isinstance(r, (MovedError, AskError, TryAgainError, ClusterDownError, RedisConnectionError,
                              RedisTimeoutError, ConnectionError, TimeoutError)):
                keys, args = calls[i]
                try:
                    async with self._in_flight:
                        by_idx[i] = await script(keys=keys, args=args)
                except Exception as exc:  # handed back like a pipeline error
                    by_idx[i] = exc
        return [by_idx[i] for i in idxs]

    def _per_call(self, items: list, first_key) -> list[list]:
        """`items` (one per client) split into the groups one multi-client script call takes: all of
        them on standalone Redis, those whose `first_key(item)` is in one hash slot on a cluster (a
        script's keys must share a slot), at most save_clients_per_call per group (a script blocks
        Redis while it runs). Order within a group is the order of `items`."""
        if self.config.cluster:
            by_slot: dict[int, list] = {}
            for item in items:
                by_slot.setdefault(key_slot(first_key(item).encode("utf-8")), []).append(item)
            groups = list(by_slot.values())
        else:
            groups = [items]
        n = self.config.save_clients_per_call
        return [g[i:i + n] for g in groups for i in range(0, len(g), n)]

    # ------------------------------------------------------------------------------------ API

    async def save_batch(
        self,
        client_id: str,
        messages: Sequence[messages_pb2.PublishMsg],
        default_ttl: int | None = None,
    ) -> list[messages_pb2.DevicePublishMsg]:
        """Store `messages` (oldest first) for one client in one atomic script call. Returns the stored
        ones, in order, with packet_id and serial assigned (what to forward to a connected client).
        Already expired messages, and the oldest ones of a batch larger than the limit, are not stored
        and not returned. `default_ttl` (seconds) overrides the configured TTL for messages without an
        MQTT 5 expiry."""
        return (await self.save_batch_attached(client_id, messages, default_ttl)).messages

    async def save_batch_attached(
        self,
        client_id: str,
        messages: Sequence[messages_pb2.PublishMsg],
        default_ttl: int | None = None,
    ) -> SaveResult:
        """save_batch, also returning the client's attachment read atomically with the save."""
        if not messages:
            return SaveResult([])
        args, sent = self._save_args(messages, default_ttl, int(time.time() * 1000))
        if not sent:
            return SaveResult([])
        k = self.keys(client_id)
        reply = await self._call("save_messages", [k.messages, k.pids, k.state, k.attached], args)
        return self._save_result(client_id, messages, sent, reply)

    async def save_many(
        self,
        batches: Mapping[str, Sequence[messages_pb2.PublishMsg]],
        default_ttl: int | None = None,
    ) -> dict[str, list[messages_pb2.DevicePublishMsg]]:
        """save_batch for many clients at once: one script call per group of clients (standalone: all of
        them, up to save_clients_per_call; cluster: those of one hash slot), the calls pipelined."""
        saved = await self.save_many_attached(batches, default_ttl)
        return {client_id: result.messages for client_id, result in saved.items()}

    async def save_many_attached(
        self,
        batches: Mapping[str, Sequence[messages_pb2.PublishMsg]],
        default_ttl: int | None = None,
        sources: Mapping[str, Source] | None = None,
        origins: Mapping[str, Sequence[tuple[int, int] | None]] | None = None,
    ) -> dict[str, SaveResult]:
        """save_many, also returning each client's attachment read atomically with its save: the
        service forwards a client's stored messages to its attached connector. A client with a `sources`
        entry has its batch applied once per source offset (a replay stores nothing again); one with an
        `origins` entry (aligned with its messages) once per tbmq.msg.all origin (the router's replay
        after a crash stores nothing again)."""
        now_ms = int(time.time() * 1000)
        out: dict[str, SaveResult] = {}
        todo: list[tuple[str, Sequence[messages_pb2.PublishMsg], list[int], ClientKeys, bytes]] = []
        for client_id, messages in batches.items():
            out[client_id] = SaveResult([])
            if not messages:
                continue
            args, sent = self._save_args(messages, default_ttl, now_ms,
                                         sources.get(client_id) if sources else None,
                                         origins.get(client_id) if origins else None)
            if not sent:
                continue
            todo.append((client_id, messages, sent, self.keys(client_id), args[-1]))
        if not todo:
            return out
        calls: list[tuple[list[str], list[Any]]] = []
        metas = self._per_call(todo, lambda item: item[3].messages)
        limits = self._limits()
        for part in metas:
            keys: list[str] = []
            args: list[Any] = list(limits)
            for _, _, _, k, blob in part:
                keys += (k.messages, k.pids, k.state, k.attached)
                args.append(blob)
            calls.append((keys, args))
        replies = await self._call_many("save_messages", calls)
        for part, reply in zip(metas, replies):
            if len(reply) != SAVE_REPLY * len(part):
                raise RuntimeError(f"save_messages.lua answered {len(reply)} elements for {len(part)} clients")
            for j, (client_id, messages, sent, _, _) in enumerate(part):
                out[client_id] = self._save_result(client_id, messages, sent,
                                                   reply[SAVE_REPLY * j:SAVE_REPLY * (j + 1)])
        self.stats.save_calls += len(calls)
        return out

    async def reserve_held(self, clients: Mapping[str, Attachment], size: int) -> dict[str, tuple[int, int, int] | None]:
        """reserve_held.lua for many clients: client id -> (last serial, last packet id, the block's last serial)
        when its store is empty and it is live on the given attachment (its state moved past a block of `size`
        serials and packet ids), else None (nothing written)."""
        if not clients:
            return {}
        items = list(clients.items())
        parts = self._per_call(items, lambda item: self.keys(item[0]).state)
        replies = await self._call_many("reserve_held", [
            ([self.keys(cid).state for cid, _ in part], [size, *(att.encode() for _, att in part)]) for part in parts])
        out: dict[str, tuple[int, int, int] | None] = {}
        for part, reply in zip(parts, replies):
            if len(reply) != 3 * len(part):
                raise RuntimeError(f"reserve_held.lua answered {len(reply)} elements for {len(part)} clients")
            for j, (cid, _) in enumerate(part):
                serial, pid, end = (int(x) for x in reply[3 * j:3 * j + 3])
                out[cid] = None if serial < 0 else (serial, pid, end)
        return out

    async def held_marks(self, marks: Mapping[str, Mapping[int, int]]) -> int:
        """held_marks.lua for many clients: client id -> {tbmq.msg.all partition: offset}, each mark raised in the
        client's state when higher, never written to a state that is gone; the state's deadline moved as a save
        of messages of the default TTL would move it (a held client is saved nothing). Returns how many states
        were written."""
        items = [(self.keys(cid).state, b",".join(b"%d:%d" % po for po in parts.items()))
                 for cid, parts in marks.items() if parts]
        if not items:
            return 0
        ttl_ms = self.config.messages_ttl_s * 1000
        calls = [([k for k, _ in part], [ttl_ms, *(arg for _, arg in part)])
                 for part in self._per_call(items, lambda i: i[0])]
        return sum(int(r) for r in await self._call_many("held_marks", calls))

    async def spill_held(
        self, spills: Mapping[str, tuple[Mapping[int, int], Sequence[messages_pb2.DevicePublishMsg]]],
        default_ttl: int | None = None, cursors: Mapping[str, tuple[int, int]] | None = None,
    ) -> int:
        """spill_held.lua for many clients: client id -> (origin marks {tbmq.msg.all partition: offset}, the held
        messages handed out, serials ascending): stored with their serials and packet ids as handed out, the marks
        raised; `cursors` (client id -> (the reserved block's last serial, the last packet id handed out)) restore a
        state that lost them (Redis lost it while the client was held). A message already expired is not stored.
        Returns how many were stored."""
        if not spills:
            return 0
        ttl_s = self.config.messages_ttl_s if default_ttl is None else default_ttl
        now_ms = int(time.time() * 1000)
        items = []
        for cid, (marks, messages) in spills.items():
            parts: list[bytes] = []
            cursor = cursors.get(cid) if cursors else None
            if cursor is not None:
                parts.append(b"!%d:%d;" % cursor)
            if marks:
                parts.append(b"#%s;" % b",".join(b"%d:%d" % (p, o) for p, o in sorted(marks.items())))
            for dmsg in messages:
                _check_pid(dmsg.packet_id)
                ttl = self._ttl_ms(dmsg.msg, ttl_s, now_ms)
                if ttl <= 0:
                    continue
                body = dmsg.msg.SerializeToString()
                parts.append(b"%d,%d,%d:" % (ttl, dmsg.serial, len(body) + 3))
                parts.append(_TYPE_PUBLISH + dmsg.packet_id.to_bytes(2, "big"))
                parts.append(body)
            if parts:
                items.append((self.keys(cid), b"".join(parts)))
        if not items:
            return 0
        calls = [([key for k, _ in part for key in (k.messages, k.pids, k.state)], [blob for _, blob in part])
                 for part in self._per_call(items, lambda item: item[0].messages)]
        return sum(int(r) for r in await self._call_many("spill_held", calls))

    async def fetch_undelivered(
        self, client_id: str, attach: Attachment | None = None, *, check: bool = False, after: int = 0,
        max_messages: int = 0, max_bytes: int = 0,
    ) -> list[messages_pb2.DevicePublishMsg] | None:
        """One page of the client's stored messages in serial order (see fetch_undelivered_response); None
        when `check` finds the client not attached to `attach`."""
        resp = await self.fetch_undelivered_response(client_id, attach, check=check, after=after,
                                                     max_messages=max_messages, max_bytes=max_bytes)
        return None if resp.not_attached else list(resp.messages)

    async def fetch_undelivered_response(
        self, client_id: str, attach: Attachment | None = None, *, check: bool = False, after: int = 0,
        max_messages: int = 0, max_bytes: int = 0,
    ) -> services_pb2.FetchUndeliveredResponse:
        """One page (serials > `after`, at most `max_messages` / `max_bytes`, 0 = no bound; the first
        message always fits) of the client's stored messages in serial order, expired ones dropped;
        `more` = messages beyond the page remain: the parts of `fetch_undelivered_parts` in one answer."""
        wires: list[bytes] = []
        more = False
        async with contextlib.aclosing(self.fetch_undelivered_parts(
                client_id, attach, check=check, after=after, max_messages=max_messages,
                max_bytes=max_bytes)) as parts:
            async for wire, more, not_attached in parts:
                if not_attached:
                    return services_pb2.FetchUndeliveredResponse(not_attached=True)
                wires.append(wire)
        resp = services_pb2.FetchUndeliveredResponse.FromString(b"".join(wires))
        resp.more = more
        return resp

    async def fetch_undelivered_parts(
        self, client_id: str, attach: Attachment | None = None, *, check: bool = False, after: int = 0,
        max_messages: int = 0, max_bytes: int = 0,
    ) -> AsyncIterator[tuple[bytes, bool, bool]]:
        """One page (serials > `after`, at most `max_messages` / `max_bytes`, 0 = no bound; the first
        message always fits) of the client's stored messages in serial order, expired ones dropped, as
        it is read: (wire, more, not_attached) per part, `wire` the encoded `messages` of a
        FetchUndeliveredResponse (FromString parses it), `more` = messages remain beyond this part (true on
        every part but the last, whose `more` is the page's). Messages not handed out yet get a packet id
        (while fewer than `handed_out_limit` are in use: else the page ends there), handed-out ones keep
        theirs.

        With `attach`, the client is attached to that connection atomically with the read (the previous
        connection gets no more forwards); with `check`, the attachment is only compared, never set
        (one part ("", False, True) when the client is not attached to `attach`: a later page or a
        re-sync must not take it back from a newer session). A page that reaches the end makes the client
        LIVE on `attach`: every message saved later is returned by save_*_attached for forwarding; until
        then messages saved meanwhile come in later pages, after the backlog. Without `attach`: a peek (no
        packet ids handed out, nothing attached).

        The page is read in script calls of at most `fetch_chunk_messages`, its parts (the later ones read
        only, "check", after the previous part's last serial, with the page's bytes left binding their
        first message too), each sent before the previous part is encoded and yielded; a newer session
        attaching between two parts ends the page there (`more`). A part's wire bytes are spliced from the
        script's reply (the stored PublishMsg bytes are copied, never parsed): no protobuf object is built
        per message in Python. Closing the iterator early cancels the part being read."""
        k = self.keys(client_id)
        if attach is None:
            mode, value = "peek", ""
        else:
            if "|" in attach.service_id:
                raise ValueError(f"service id must not contain '|', got {attach.service_id!r}")
            mode, value = ("check" if check else "attach"), attach.encode()
        keys = [k.messages, k.pids, k.state, k.attached]
        fixed = [self.config.handed_out_limit, self.config.messages_ttl_s * 1000]
        chunk = self.config.fetch_chunk_messages

        def call(mode: str, after: int, count: int, nbytes: int, strict: bool) -> asyncio.Task:
            return asyncio.ensure_future(self._call(
                "fetch_undelivered", keys, [value, mode, after, count, nbytes, *fixed, 1 if strict else 0]))

        # DevicePublishMsg with only client_id set: exactly its encoded field 1, the same in every message
        cid_field = messages_pb2.DevicePublishMsg(client_id=client_id).SerializeToString()
        left_n, left_b = max_messages, max_bytes  # 0 = no bound
        asked = chunk if left_n == 0 else min(chunk, left_n)
        pending = call(mode, after, asked, left_b, False)
        first = True
        try:
            while pending is not None:
                reply = await pending
                pending = None
                if not isinstance(reply, list):  # not attached (a "check"): a newer session took the client
                    if first:
                        yield b"", False, True
                    else:  # between two parts: what was read so far is still this session's page
                        yield b"", True, False
                    return
                first = False
                more = bool(int(reply[0]))
                got = (len(reply) - 1) // 3
                if more and got == asked:  # the part ended at its count: the page goes on while it has room
                    left_n = left_n - got if left_n else 0
                    if left_b:
                        left_b -= sum(map(len, reply[3::3]))  # a member's size is its value's length
                    if (max_messages == 0 or left_n > 0) and (max_bytes == 0 or left_b > 0):
                        asked = chunk if left_n == 0 else min(chunk, left_n)
                        pending = call("check" if mode == "attach" else mode, int(reply[-2]), asked, left_b,
                                       True)
                        await asyncio.sleep(0)  # the next part's call is sent: Redis runs it meanwhile
                yield _stored_messages_wire(cid_field, reply, 1), more, False
        finally:
            if pending is not None and not pending.done():
                pending.cancel()

    async def peek_last(self, client_id: str, n: int) -> list[messages_pb2.DevicePublishMsg]:
        """The client's last `n` stored messages by serial (fewer when fewer are stored), read only, with
        the packet ids they were handed out with (0 = not handed out): what a save whose reply was lost
        stored, when its retry found the batch applied before (tbmq_device_persistence.service)."""
        if n <= 0:
            return []
        last = await self.redis.hget(self.keys(client_id).state, "serial")
        if last is None:
            return []
        resp = await self.fetch_undelivered_response(client_id, None, after=max(int(last) - n, 0), max_messages=n)
        return list(resp.messages)

    async def acknowledge(self, client_id: str, packet_id: int, serial: int = 0) -> bool:
        """Remove one message (PUBACK / PUBCOMP). True when it was still stored. With `serial`, only while
        the packet id still names the message of that serial (services.proto PacketRequest.serial)."""
        _check_pid(packet_id)
        return bool(await self._call("remove_message", self._ack_keys(client_id), [_ack_item(packet_id, serial)]))

    async def acknowledge_many(self, client_id: str, packet_ids: Iterable[int]) -> int:
        """Remove several messages of one client in one call; returns how many were still stored."""
        pids = list(packet_ids)
        for pid in pids:
            _check_pid(pid)
        if not pids:
            return 0
        ids = ",".join(map(str, pids))
        return int(await self._call("remove_message", self._ack_keys(client_id), [ids]))

    def _ack_keys(self, client_id: str) -> list[str]:
        """remove_message.lua's 3 keys of one client."""
        k = self.keys(client_id)
        return [k.messages, k.pids, k.state]

    async def apply_acks(
        self, acks: Iterable[tuple[str, int, int]], pubrecs: Iterable[tuple[str, int, int]] = ()
    ) -> tuple[int, int]:
        """Many (client id, packet id, serial) PUBRECs and acknowledgements of any clients at once: the
        PUBRECs first (one mark_pubrec.lua call each), then the acknowledgements (one remove_message.lua call
        per group of clients, grouped like save_many's calls, with all their packet ids), each kind in
        one pipeline (per master in cluster mode). A serial (not 0) applies the id only while it still names
        the message of that serial: an acknowledgement retried from an earlier connection leaves a newer
        message the id was handed to alone (services.proto PacketRequest.serial).
        Returns (acknowledged, marked): how many were still stored. Raises ValueError on a bad packet
        id before anything is applied."""
        by_client: dict[str, dict[str, None]] = {}  # client id -> its acknowledgements (insertion-ordered set)
        for client_id, pid, serial in acks:
            _check_pid(pid)
            item = _ack_item(pid, serial)
            items = by_client.get(client_id)
            if items is None:
                by_client[client_id] = {item: None}
            else:
                items[item] = None
        marks: list[tuple[str, str]] = []
        for client_id, pid, serial in pubrecs:
            _check_pid(pid)
            marks.append((client_id, _ack_item(pid, serial)))
        marked = acknowledged = 0
        if marks:
            # in order, one pipeline after the other: when Redis fails midway, the marks applied are the first
            # ones (the connector retries the rest), so a resumed session never finds a later PUBREC marked
            # and an earlier one not (its PUBRELs would overtake that PUBLISH, MQTT-4.6.0-4)
            replies = await self._call_many(
                "mark_pubrec", [(self._pubrec_keys(cid), item.split(":")) for cid, item in marks], ordered=True)
            marked = sum(int(r) for r in replies)
        if by_client:
            items = [(self._ack_keys(cid), ",".join(map(str, pids))) for cid, pids in by_client.items()]
            parts = self._per_call(items, lambda item: item[0][0])
            replies = await self._call_many(
                "remove_message", [([key for keys, _ in part for key in keys], [ids for _, ids in part])
                                   for part in parts])
            self.stats.ack_calls += len(parts)
            acknowledged = sum(int(r) for r in replies)
        return acknowledged, marked

    async def mark_pubrec(self, client_id: str, packet_id: int, serial: int = 0) -> bool:
        """PUBREC received: the message now only needs a PUBREL; its TTL and order are kept. With `serial`,
        only while the packet id still names the message of that serial."""
        _check_pid(packet_id)
        args = [packet_id, serial] if serial else [packet_id]
        return bool(await self._call("mark_pubrec", self._pubrec_keys(client_id), args))

    def _pubrec_keys(self, client_id: str) -> list[str]:
        k = self.keys(client_id)
        return [k.messages, k.pids]

    async def clear(self, client_id: str) -> int:
        """Drop everything stored for the client (and its attachment); returns how many messages were
        dropped."""
        k = self.keys(client_id)
        return int(await self._call("clear_all", [k.messages, k.pids, k.state, k.attached], []))

    async def detach(self, client_id: str, session_id: str) -> bool:
        """Stop forwarding to the connection of `session_id`; no-op (False) when another session
        attached since or the client is not attached."""
        k = self.keys(client_id)
        return bool(await self._call("detach", [k.attached, k.state],
                                     [session_id, self.config.messages_ttl_s * 1000]))

    async def count(self, client_id: str) -> int:
        """How many messages are stored for the client (diagnostics and tests; expired ones not met by a
        fetch yet included): O(1), unlike a fetch."""
        return int(await self.redis.zcard(self.keys(client_id).messages))

    async def attachment(self, client_id: str) -> Attachment | None:
        """The current attachment (diagnostics and tests; the scripts read it atomically themselves)."""
        return Attachment.decode(await self.redis.get(self.keys(client_id).attached))


# Wire format of FetchUndeliveredResponse.messages (field 1) holding DevicePublishMsg: a tag byte is
# (field number << 3) | wire type (0 = varint, 2 = length-delimited).
_RESPONSE_MESSAGE = bytes((1 << 3 | 2,))         # FetchUndeliveredResponse.messages
_PACKET_ID = bytes((2 << 3 | 0,))                # DevicePublishMsg.packet_id
_SERIAL = bytes((3 << 3 | 0,))                   # DevicePublishMsg.serial
_PUBREL = bytes((4 << 3 | 0, messages_pb2.DEVICE_PACKET_TYPE_PUBREL))  # packet_type (PUBLISH = 0: omitted)
_MSG = bytes((5 << 3 | 2,))                      # DevicePublishMsg.msg
_REDELIVERY = bytes((6 << 3 | 0, 1))             # DevicePublishMsg.redelivery = true
_NOT_HANDED_OUT = b"\0\0"                        # the packet id bytes of a stored value never handed out
_TYPE_PUBREL_BYTE = _TYPE_PUBREL[0]
def _stored_messages_wire(cid_field: bytes, reply: list[Any], start: int = 0) -> bytes:
    """fetch_undelivered.lua's {pid, serial, value, ...} (from reply[start]) as the wire bytes of the
    `messages` of a FetchUndeliveredResponse (value = type byte + 2 packet-id bytes + PublishMsg bytes,
    the PublishMsg embedded as DevicePublishMsg.msg). The value's packet id bytes are those from before
    the script handed ids out: non-zero = handed out before, `redelivery` set."""
    parts: list[Any] = []
    append = parts.append
    for i in range(start, len(reply), 3):
        value = reply[i + 2]
        body = memoryview(value)[3:]
        head = b"".join((cid_field, _PACKET_ID, varint(int(reply[i])), _SERIAL, varint(int(reply[i + 1])),
                         _PUBREL if value[0] == _TYPE_PUBREL_BYTE else b"", _MSG, varint(len(body))))
        tail = b"" if value[1:3] == _NOT_HANDED_OUT else _REDELIVERY  # field 6 after 5: protobuf's order
        append(_RESPONSE_MESSAGE)
        append(varint(len(head) + len(body) + len(tail)))
        append(head)
        append(body)
        append(tail)
    return b"".join(parts)


def _check_pid(packet_id: int) -> None:
    if not isinstance(packet_id, int) or not 1 <= packet_id <= MAX_PACKET_ID:
        raise ValueError(f"packet id must be 1..{MAX_PACKET_ID}, got {packet_id!r}")


def _ack_item(packet_id: int, serial: int) -> str:
    """One acknowledgement as remove_message.lua / mark_pubrec.lua take it: "<id>" or "<id>:<serial>"."""
    return f"{packet_id}:{serial}" if serial else str(packet_id)
