"""The session registry's settings that start-up refuses (tbmq_platform.settings: one message naming every bad
variable, before anything starts)."""

from __future__ import annotations

import pytest
from session_registry.settings import SessionRegistrySettings
from tbmq_platform.settings import SettingsError, load


@pytest.mark.parametrize("raw", ["3", "45", "x"])
def test_a_group_session_kafka_or_the_consumer_would_refuse_stops_start_up_naming_it(raw):
    """Below Kafka's group.min.session.timeout.ms (6 s) the group join fails; above 30 s the join (which waits
    up to the session) would outlast the consumer's 40 s request timeout."""
    with pytest.raises(SettingsError, match="TBMQ_SESSION_REGISTRY_SESSION_TIMEOUT_S"):
        load(SessionRegistrySettings, {"TBMQ_SESSION_REGISTRY_SESSION_TIMEOUT_S": raw})


def test_the_group_session_defaults_to_kafkas_minimum_and_joins_as_a_static_member():
    s = load(SessionRegistrySettings, {"TBMQ_SERVICE_ID": "session-registry-7"})
    assert s.session_timeout_s == 6.0 and s.group_id == "session-registry"
    assert s.group_instance_id == "session-registry-7"
    assert load(SessionRegistrySettings, {"TBMQ_SESSION_REGISTRY_SESSION_TIMEOUT_S": "30"}).session_timeout_s == 30.0
    assert load(SessionRegistrySettings, {"TBMQ_KAFKA_STATIC_MEMBERSHIP": "false"}).group_instance_id is None
