"""The suite's port plan (docs/architecture.md, the default ports).

Every default is below the kernel's ephemeral range: outgoing connections take their local ports there, and a
listener cannot bind a port a connection on the host holds, open or in TIME_WAIT, so a default in that range
fails a start now and then (app-delivery's old 50062 did, right after a benchmark had closed 10,000 client
connections). And a plan with two listeners on one port is refused before anything starts."""

from __future__ import annotations

import dataclasses

import pytest
from tbmq_launcher.launcher import (
    DEFAULT_CONTROLLER_PORT,
    DEFAULT_KAFKA_PORT,
    DEFAULT_REDIS_CLUSTER_PORTS,
    DEFAULT_REDIS_PORT,
    PORT_ATTRS,
    Suite,
    SuiteError,
)
from tbmq_launcher.services import SERVICES

# Linux's default range starts here; the IANA range (BSDs, Windows, macOS) at 49152
EPHEMERAL_LOW = 32768
REDIS_CLUSTER_BUS_OFFSET = 10000
MOST_INSTANCES = 8  # of every service at once on the default plan


def _plan(instances: int) -> dict[str, int]:
    suite = Suite(connectors=instances, instances={name: instances for name in SERVICES}, ports="default",
                  run_dir="/tmp/unused")
    assert len(suite.procs) == instances * len(SERVICES)
    return {f"{p.service_id} {attr}": getattr(p, attr) for p in suite.procs.values() for attr in PORT_ATTRS
            if getattr(p, attr) is not None}


def test_every_listener_of_every_instance_is_below_the_ephemeral_range_and_on_its_own_port():
    ports = _plan(MOST_INSTANCES)
    assert {key.split()[1] for key in ports} == set(PORT_ATTRS)  # every kind of listener is in the check
    assert len(set(ports.values())) == len(ports)
    assert {k: v for k, v in ports.items() if v >= EPHEMERAL_LOW} == {}


def test_a_plan_with_two_listeners_on_one_port_is_refused_naming_each_clash():
    with pytest.raises(SuiteError) as refused:
        _plan(MOST_INSTANCES + 1)
    message = str(refused.value)
    assert "8883: connector-1 tls_port and connector-9 ws_port" in message
    assert "8888: connector-6 tls_port and admin-9 health_port" in message
    assert message.count(" and ") == 6
    # an explicit base port moves the connector's listeners out of the way
    Suite(connectors=MOST_INSTANCES + 1, ports="default", run_dir="/tmp/unused", tls_port=18883)


def test_kafka_and_redis_defaults_are_below_the_ephemeral_range():
    infra = [DEFAULT_KAFKA_PORT, DEFAULT_CONTROLLER_PORT, DEFAULT_REDIS_PORT, *DEFAULT_REDIS_CLUSTER_PORTS,
             *(p + REDIS_CLUSTER_BUS_OFFSET for p in DEFAULT_REDIS_CLUSTER_PORTS)]
    assert [p for p in infra if p >= EPHEMERAL_LOW] == []


def _settings_classes():
    from admin.settings import AdminSettings
    from app_delivery.settings import AppDeliverySettings
    from connector.settings import ConnectorSettings
    from tbmq_device_persistence.settings import DevicePersistenceSettings
    from router.settings import RouterSettings
    from session_registry.settings import SessionRegistrySettings

    return [AdminSettings, AppDeliverySettings, ConnectorSettings, DevicePersistenceSettings, RouterSettings,
            SessionRegistrySettings]


@pytest.mark.parametrize("cls", _settings_classes(), ids=lambda c: c.__name__)
def test_a_service_started_without_the_launcher_listens_and_dials_below_the_ephemeral_range(cls):
    """The services' own defaults (compose, systemd): their listening ports, and the peers they dial, which
    are other services' listening ports."""
    settings = cls()
    found = {}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if field.name.endswith("_port") and isinstance(value, int):
            found[field.name] = value
        for target in value if isinstance(value, tuple) else (value,):
            if field.name.endswith(("_target", "_targets")) and isinstance(target, str) and ":" in target:
                found[f"{field.name} {target}"] = int(target.rsplit(":", 1)[1])
    assert found, f"{cls.__name__} has no port setting"
    assert {k: v for k, v in found.items() if v >= EPHEMERAL_LOW} == {}


def test_persist_in_router_gives_each_router_the_port_and_target_of_a_device_persistence_instance():
    suite = Suite(instances={"router": 2}, ports="default", run_dir="/tmp/unused", persist_in_router=True)
    assert not suite.instances_of("device-persistence")
    r1, r2 = (suite.service_environment("router", i) for i in (1, 2))
    dp_port = SERVICES["device-persistence"].grpc_port
    assert (r1["DEVICE_PERSISTENCE_GRPC_PORT"], r2["DEVICE_PERSISTENCE_GRPC_PORT"]) == (str(dp_port),
                                                                                          str(dp_port + 100))
    assert r1["ROUTER_PERSIST_VIA"] == r2["ROUTER_PERSIST_VIA"] == "local"
    targets = f"localhost:{dp_port},localhost:{dp_port + 100}"
    # every service that reaches device-persistence gets the routers, in one order
    for name in ("router", "connector", "session-registry"):
        assert suite.service_environment(name)["DEVICE_PERSISTENCE_GRPC_TARGETS"] == targets
    assert (r1["ROUTER_LOCAL_TARGET"], r2["ROUTER_LOCAL_TARGET"]) == tuple(targets.split(","))


def test_persist_in_router_refuses_a_device_persistence_process_too():
    with pytest.raises(ValueError, match="persist_in_router"):
        Suite(services=["device-persistence", "router"], run_dir="/tmp/unused", persist_in_router=True)
