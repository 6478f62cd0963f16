"""How the launcher starts a suite and what it cleans up when the suite stops: the start tiers (the back-ends
together, then the front doors together), and which consumer groups each started instance joined as a static
member (Suite.stop takes them out again: tbmq_platform.kafka.remove_static_members)."""

from __future__ import annotations

import dataclasses

from router.settings import RouterSettings
from session_registry.settings import SessionRegistrySettings
from tbmq_device_persistence.settings import DevicePersistenceSettings
from tbmq_launcher.launcher import Suite
from tbmq_launcher.services import ORDER, SERVICES, START_TIERS, start_tiers


def test_the_back_ends_start_together_before_the_front_doors_and_custom_services_alone_after():
    assert start_tiers(list(ORDER)) == [["session-registry", "device-persistence", "app-delivery", "router"],
                                        ["connector", "admin"]]
    assert start_tiers(["connector", "router"]) == [["router"], ["connector"]]
    assert start_tiers(["fake-b", "connector", "fake-a"]) == [["connector"], ["fake-b"], ["fake-a"]]
    assert start_tiers([]) == []
    assert list(ORDER) == [n for tier in START_TIERS for n in tier]


def _started(suite: Suite, *skip: str) -> Suite:
    """Every instance given the environment Suite.start would give it (`skip`: ids never started)."""
    for p in suite.processes():
        if p.service_id not in skip:
            p.env = suite.service_environment(p.name, p.instance)
    return suite


def test_the_static_members_are_the_started_routers_device_persistence_and_registry_instances(tmp_path):
    suite = _started(Suite(connectors=2, instances={"router": 2, "device-persistence": 2}, ports="free",
                           run_dir=tmp_path, id_tag="t1"), "router-2-t1")
    assert suite.static_members() == {"router": ["router-1-t1"],
                                      "device-persistence": ["device-persistence-1-t1", "device-persistence-2-t1"],
                                      "session-registry": ["session-registry-1-t1"]}


def test_a_router_running_device_persistence_is_a_static_member_of_both_groups_named_by_its_settings(tmp_path):
    suite = _started(Suite(services=["router", "connector"], instances={"router": 2}, ports="free",
                           run_dir=tmp_path, persist_in_router=True,
                           service_env={"router": {"ROUTER_GROUP_ID": "r-east",
                                                   "DEVICE_PERSISTENCE_GROUP_ID": "dp-east"}}))
    assert suite.static_members() == {"r-east": ["router-1", "router-2"], "dp-east": ["router-1", "router-2"]}


def _field(cls, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def test_the_launchers_group_variables_and_defaults_are_the_services_own():
    for service, settings in (("router", RouterSettings), ("device-persistence", DevicePersistenceSettings),
                              ("session-registry", SessionRegistrySettings)):
        group = _field(settings, "group_id")
        assert SERVICES[service].static_groups == ((group.metadata["env"], group.default),), service
    assert {name for name, s in SERVICES.items() if s.static_groups} == {"router", "device-persistence",
                                                                          "session-registry"}
