from dataclasses import FrozenInstanceError, dataclass

import pytest

from tbmq_platform.settings import (CommonSettings, SettingsError, env, integer, load, load_all_or_exit, load_or_exit,
                                   port)


@dataclass(frozen=True)
class Demo(CommonSettings):
    service_name: str = "demo"
    mqtt_port: int = env("MQTT_PORT", 1883, parse=port)
    limit: int = env("DEMO_LIMIT", 10000, parse=integer(1, 65535))
    flag: bool = env("DEMO_FLAG", False)


def test_defaults_run_on_one_machine():
    s = load(Demo, {})
    assert s.mqtt_port == 1883 and s.kafka_bootstrap_servers == ("localhost:9092",)
    assert s.instance_id == "demo-1" and s.bootstrap == "localhost:9092"


def test_values_are_parsed_once_into_a_frozen_object():
    s = load(Demo, {"MQTT_PORT": "1999", "DEMO_FLAG": "true", "KAFKA_BOOTSTRAP_SERVERS": "a:1,b:2"})
    assert (s.mqtt_port, s.flag, s.bootstrap) == (1999, True, "a:1,b:2")
    with pytest.raises(FrozenInstanceError):
        s.mqtt_port = 1  # type: ignore[misc]


def test_every_bad_variable_is_named_in_one_error():
    with pytest.raises(SettingsError) as err:
        load(Demo, {"MQTT_PORT": "http", "DEMO_LIMIT": "70000", "LOG_FORMAT": "xml",
                    "KAFKA_BOOTSTRAP_SERVERS": "nohostport"})
    text = str(err.value)
    for name in ("MQTT_PORT", "DEMO_LIMIT", "LOG_FORMAT", "KAFKA_BOOTSTRAP_SERVERS"):
        assert name in text
    assert len(err.value.problems) == 4


def test_load_or_exit_exits_2_with_one_message(capsys):
    with pytest.raises(SystemExit) as exc:
        load_or_exit(Demo, {"MQTT_PORT": "-1", "DEMO_LIMIT": "x"})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MQTT_PORT" in err and "DEMO_LIMIT" in err


@dataclass(frozen=True)
class WithFallback(CommonSettings):
    grpc_port: int = env("DEMO_GRPC_PORT", 50061, parse=port, fallback="GRPC_PORT")


def test_a_fallback_variable_is_read_only_when_the_own_one_is_unset():
    assert load(WithFallback, {}).grpc_port == 50061
    assert load(WithFallback, {"GRPC_PORT": "6000"}).grpc_port == 6000
    assert load(WithFallback, {"GRPC_PORT": "6000", "DEMO_GRPC_PORT": "7000"}).grpc_port == 7000
    with pytest.raises(SettingsError) as err:
        load(WithFallback, {"GRPC_PORT": "x"})
    assert "GRPC_PORT='x'" in str(err.value)


def test_topic_layout_comes_from_the_common_settings():
    s = load(CommonSettings, {"TBMQ_TOPIC_PROFILE": "single-node", "TBMQ_TOPIC_REPLICATION_FACTOR": "3",
                              "TBMQ_TOPIC_MIN_INSYNC_REPLICAS": "2"})
    layout = s.topic_layout
    assert (layout.profile, layout.replication_factor, layout.min_insync_replicas) == ("single-node", 3, 2)


def test_min_insync_replicas_above_the_replication_factor_stops_start_up():
    with pytest.raises(SettingsError) as e:
        load(CommonSettings, {"TBMQ_TOPIC_REPLICATION_FACTOR": "1", "TBMQ_TOPIC_MIN_INSYNC_REPLICAS": "2"})
    assert "TBMQ_TOPIC_MIN_INSYNC_REPLICAS=2" in str(e.value) and "TBMQ_TOPIC_REPLICATION_FACTOR=1" in str(e.value)


def test_a_service_settings_check_keeps_the_common_one():
    from connector.settings import ConnectorSettings

    with pytest.raises(SettingsError) as e:
        load(ConnectorSettings, {"TBMQ_TOPIC_REPLICATION_FACTOR": "2", "TBMQ_TOPIC_MIN_INSYNC_REPLICAS": "3"})
    assert "TBMQ_TOPIC_MIN_INSYNC_REPLICAS=3" in str(e.value)


def test_retention_warn_fraction_must_be_a_fraction():
    with pytest.raises(SettingsError) as e:
        load(CommonSettings, {"TBMQ_RETENTION_WARN_FRACTION": "1.5", "TBMQ_RETENTION_WATCH_INTERVAL_S": "-1"})
    assert "TBMQ_RETENTION_WARN_FRACTION" in str(e.value) and "TBMQ_RETENTION_WATCH_INTERVAL_S" in str(e.value)


def test_static_membership_uses_the_instance_id_unless_switched_off():
    assert load(CommonSettings, {"TBMQ_SERVICE_ID": "router-2"}).group_instance_id == "router-2"
    assert load(CommonSettings, {"TBMQ_SERVICE_ID": "router-2",
                                 "TBMQ_KAFKA_STATIC_MEMBERSHIP": "false"}).group_instance_id is None
    with pytest.raises(SettingsError, match="TBMQ_KAFKA_STATIC_MEMBERSHIP"):
        load(CommonSettings, {"TBMQ_KAFKA_STATIC_MEMBERSHIP": "maybe"})


def test_the_device_persistence_targets_are_one_setting_in_the_connector_and_the_router():
    from connector.settings import ConnectorSettings
    from router.settings import RouterSettings

    environ = {"DEVICE_PERSISTENCE_GRPC_TARGETS": "dp-1:50061, dp-2:50061"}
    for cls in (ConnectorSettings, RouterSettings):
        assert load(cls, environ).device_persistence_grpc_targets == ("dp-1:50061", "dp-2:50061")
        assert load(cls, {"DEVICE_PERSISTENCE_GRPC_TARGET": "dp-9:1"}).device_persistence_grpc_targets == \
            ("dp-9:1",)
        with pytest.raises(SettingsError) as err:  # an empty list would leave pick_target nothing to pick
            load(cls, {"DEVICE_PERSISTENCE_GRPC_TARGETS": " , "})
        assert err.value.problems == ["DEVICE_PERSISTENCE_GRPC_TARGETS=' , ': must name at least one host:port"]


@dataclass(frozen=True)
class Other(CommonSettings):
    other_limit: int = env("OTHER_LIMIT", 5, parse=integer(1))


def test_load_all_or_exit_names_every_bad_variable_of_every_class_once(capsys):
    with pytest.raises(SystemExit) as exc:
        load_all_or_exit((Demo, Other), {"DEMO_LIMIT": "x", "OTHER_LIMIT": "0", "LOG_FORMAT": "xml"})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DEMO_LIMIT" in err and "OTHER_LIMIT" in err
    assert err.count("LOG_FORMAT") == 1  # read by both classes, named once


def test_load_all_or_exit_returns_each_class_loaded_from_the_same_environment():
    demo, other = load_all_or_exit((Demo, Other), {"OTHER_LIMIT": "9", "TBMQ_SERVICE_ID": "x-1"})
    assert type(demo) is Demo and type(other) is Other
    assert other.other_limit == 9 and demo.instance_id == other.instance_id == "x-1"
