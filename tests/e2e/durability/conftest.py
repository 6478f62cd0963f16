"""One suite per test module of this folder (`dsuite`): 2 connectors + router + session-registry +
device-persistence (+ app-delivery when it has an entry point), client ids `app-.*` are APPLICATION.

Every test kills one service and starts it again; `healed` (autouse) restarts whatever a failed test left
dead, so one failure does not cascade.

Tests with a suite of their own (test_durability_forward.py: two device-persistence instances) run first,
before `dsuite` exists: two suites on one Kafka would split the routers', registries' and
device-persistence instances' consumer groups between them (a message routed by the other suite's router
never reaches this suite's subscriber).

`dsuite` is module-scoped, one per test module, stopped when the module ends. Not package-scoped: this folder
has no __init__.py, so pytest would keep a "package" fixture to the end of the session (pytest-dev/pytest
#13216), and its services (app-delivery deleting APPLICATION topics, device-persistence in the shared
consumer group) would then work inside every later suite's test (tests/e2e/spark, tests/e2e/connector when
run after this folder).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from durability_helpers import heal, running_suite

HAS_APP_DELIVERY = importlib.util.find_spec("app_delivery.__main__") is not None
APP_PATTERN = "app-.*"


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    slots = [n for n, item in enumerate(items) if item.path.parent == here]
    ours = [items[n] for n in slots]
    ordered = ([i for i in ours if "dsuite" not in i.fixturenames]
               + [i for i in ours if "dsuite" in i.fixturenames])
    for n, item in zip(slots, ordered):
        items[n] = item


@pytest.fixture(scope="module")
async def dsuite(kafka, tmp_path_factory):
    services = ["session-registry", "device-persistence", "router", "connector"]
    if HAS_APP_DELIVERY:
        services.insert(2, "app-delivery")
    async with running_suite(kafka, tmp_path_factory, "suite-durability", services,
                             service_env={"session-registry": {"TBMQ_APPLICATION_CLIENT_ID_PATTERNS": APP_PATTERN}}
                             ) as s:
        yield s


@pytest.fixture
async def healed(dsuite):
    await heal(dsuite)
    yield dsuite
