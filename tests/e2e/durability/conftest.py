"""One suite for the durability tests of this folder: 2 connectors + router + session-registry +
device-persistence (+ app-delivery when it has an entry point), client ids `app-.*` are APPLICATION.

Every test kills one service and starts it again; `healed` (autouse) restarts whatever a failed test left
dead, so one failure does not cascade.
"""

from __future__ import annotations

import importlib.util

import pytest
from durability_helpers import START_TIMEOUT, heal
from tbmq_launcher.kafka import KafkaBroker
from tbmq_launcher.launcher import Suite, new_tag

HAS_APP_DELIVERY = importlib.util.find_spec("app_delivery.__main__") is not None
APP_PATTERN = "app-.*"


@pytest.fixture(scope="package")
async def dsuite(kafka, tmp_path_factory):
    services = ["session-registry", "device-persistence", "router", "connector"]
    if HAS_APP_DELIVERY:
        services.insert(2, "app-delivery")
    s = Suite(services=services, connectors=2, ports="free", log_format="json", id_tag=new_tag(),
              run_dir=tmp_path_factory.mktemp("suite-durability"), start_timeout=START_TIMEOUT,
              stop_timeout=15, kafka=kafka if isinstance(kafka, KafkaBroker) else kafka.bootstrap_servers,
              service_env={"session-registry": {"TBMQ_APPLICATION_CLIENT_ID_PATTERNS": APP_PATTERN}})
    await s.start()
    print(f"\ndurability suite ready in {s.start_seconds:.1f}s, run dir {s.run_dir}")
    try:
        yield s
    finally:
        await s.stop()


@pytest.fixture
async def healed(dsuite):
    await heal(dsuite)
    yield dsuite
