"""device-persistence settings and attachment encoding (no Kafka, no Redis)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tbmq_platform.settings import SettingsError

from tbmq_device_persistence.settings import BYTES_LIMIT_VAR, LIMIT_VAR, TTL_VAR, DevicePersistenceSettings, load_settings
from tbmq_device_persistence.store import Attachment

pytestmark = pytest.mark.unit


def test_defaults():
    s = load_settings({})
    assert isinstance(s, DevicePersistenceSettings)
    assert (s.service_name, s.instance_id, s.health_port, s.grpc_port) == (
        "device-persistence", "device-persistence-1", 8087, 9061)
    assert s.redis_url == "redis://localhost:6380/0" and s.redis_cluster_nodes == ()
    assert (s.messages_limit, s.messages_ttl_s) == (1_000_000, 604800)
    cfg = s.store_config()
    assert not cfg.cluster and cfg.messages_limit == 1_000_000 and cfg.messages_ttl_s == 604800
    assert s.group_id == "device-persistence"


def test_environment():
    s = load_settings({"DEVICE_PERSISTENCE_GRPC_PORT": "6000", "GRPC_PORT": "7000",
                       "REDIS_CLUSTER_NODES": "127.0.0.1:7001, 127.0.0.1:7002",
                       LIMIT_VAR: "1000000", BYTES_LIMIT_VAR: "1048576", TTL_VAR: "60",
                       "DEVICE_PERSISTENCE_HANDED_OUT_LIMIT": "65534", "TBMQ_SERVICE_ID": "dp-7"})
    assert s.grpc_port == 6000 and s.instance_id == "dp-7"
    cfg = s.store_config()
    assert cfg.cluster and cfg.cluster_nodes == ("127.0.0.1:7001", "127.0.0.1:7002")
    assert cfg.messages_limit == 1_000_000 and cfg.messages_ttl_s == 60
    assert cfg.bytes_limit == 1048576 and cfg.handed_out_limit == 65534
    assert load_settings({"GRPC_PORT": "7000"}).grpc_port == 7000  # the launcher's variable


@pytest.mark.parametrize("raw", ["1000001", "0", "x"])
def test_limit_refused_naming_the_variable(raw):
    with pytest.raises(SettingsError) as e:
        load_settings({LIMIT_VAR: raw})
    assert LIMIT_VAR in str(e.value)


def test_every_bad_variable_named():
    with pytest.raises(SettingsError) as e:
        load_settings({TTL_VAR: "0", "REDIS_CLUSTER_NODES": "nohost", "DEVICE_PERSISTENCE_GRPC_PORT": "99999",
                       LIMIT_VAR: "1000001", BYTES_LIMIT_VAR: "10", "DEVICE_PERSISTENCE_HANDED_OUT_LIMIT": "65535"})
    text = str(e.value)
    assert TTL_VAR in text and "REDIS_CLUSTER_NODES" in text and "DEVICE_PERSISTENCE_GRPC_PORT" in text
    assert LIMIT_VAR in text and BYTES_LIMIT_VAR in text and "DEVICE_PERSISTENCE_HANDED_OUT_LIMIT" in text
    with pytest.raises(SettingsError, match="braces"):
        load_settings({"DEVICE_PERSISTENCE_REDIS_KEY_PREFIX": "{x}"})


def test_start_up_refuses_limit_above_a_million():
    env = {LIMIT_VAR: "1000001", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "device_persistence"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert LIMIT_VAR in proc.stderr and "1000000" in proc.stderr


def test_attachment_encoding():
    a = Attachment("connector-1", "6f1c-uuid")
    assert a.encode() == "connector-1|6f1c-uuid"
    assert Attachment.decode(a.encode().encode()) == a
    assert Attachment.decode(b"svc|sess|with|bars") == Attachment("svc", "sess|with|bars")
    assert Attachment.decode(b"") is None and Attachment.decode(None) is None
    assert Attachment.decode(b"no-bar") is None


def test_save_attempts_bounds():
    assert load_settings({}).save_attempts == 5
    assert load_settings({"DEVICE_PERSISTENCE_SAVE_ATTEMPTS": "1"}).save_attempts == 1
    with pytest.raises(SettingsError, match="DEVICE_PERSISTENCE_SAVE_ATTEMPTS"):
        load_settings({"DEVICE_PERSISTENCE_SAVE_ATTEMPTS": "0"})


def test_refused_for_data_tells_a_clients_data_from_redis_itself():
    """What redis-py raises for Redis's answers (its parser strips a leading "ERR "): refusals of the data are
    dead-lettered after the attempts, everything about Redis itself is retried."""
    from redis.exceptions import (BusyLoadingError, ConnectionError, NoPermissionError, NoScriptError,
                                  OutOfMemoryError, ReadOnlyError, ResponseError, TimeoutError)

    from tbmq_device_persistence.store import refused_for_data

    data = [ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value script: 3f2a, "
                          "on @user_script:120."),
            ResponseError("user_script:88: attempt to perform arithmetic on a nil value script: 3f2a, on "
                          "@user_script:88."),
            ResponseError("save_messages: bad origin header of batch 2")]
    redis_itself = [ConnectionError("Connection refused"), TimeoutError("Timeout reading from socket"),
                    BusyLoadingError("Redis is loading the dataset in memory"),
                    OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
                    ReadOnlyError("You can't write against a read only replica."),
                    NoScriptError("No matching script. Please use EVAL."),
                    NoPermissionError("this user has no permissions to run the 'evalsha' command"),
                    ResponseError("BUSY Redis is busy running a script."),
                    ResponseError("CLUSTERDOWN The cluster is down"), OSError("reset")]
    assert [refused_for_data(e) for e in data] == [True] * len(data)
    assert [refused_for_data(e) for e in redis_itself] == [False] * len(redis_itself)


@pytest.mark.parametrize(("env", "spans"), [
    ({}, False),
    ({"DEVICE_PERSISTENCE_TRACE_SPANS": "true"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
])
def test_save_span_only_when_exported_or_asked_for(env, spans):
    from tbmq_platform.tracing import spans_on
    assert spans_on(load_settings(env)) is spans


@pytest.mark.parametrize("raw", ["3", "45"])
def test_a_group_session_kafka_or_the_consumer_would_refuse_stops_start_up_naming_it(raw):
    """Below Kafka's group.min.session.timeout.ms (6 s) the group join fails; above 30 s the join (which waits
    up to the session) would outlast the consumer's 40 s request timeout."""
    with pytest.raises(SettingsError, match="DEVICE_PERSISTENCE_SESSION_TIMEOUT_S"):
        load_settings({"DEVICE_PERSISTENCE_SESSION_TIMEOUT_S": raw})
    assert load_settings({}).session_timeout_s == 10.0
    assert load_settings({"DEVICE_PERSISTENCE_SESSION_TIMEOUT_S": "6"}).session_timeout_s == 6.0
