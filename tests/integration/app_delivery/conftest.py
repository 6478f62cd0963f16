"""Fixtures of app-delivery's integration tests: one app-delivery subprocess per module (launcher) and a
fake connector speaking AppDelivery.Deliver to it."""

from __future__ import annotations

import pytest
from app_delivery_harness import FakeConnector, Producer, app_delivery_suite


@pytest.fixture(scope="module")
async def ad_suite(kafka, tmp_path_factory):
    suite = app_delivery_suite(kafka, tmp_path_factory.mktemp("app-delivery"))
    await suite.start()
    yield suite
    await suite.stop()


@pytest.fixture
async def connector(ad_suite):
    if not ad_suite.instance("app-delivery").running:  # a test killed it and failed before restarting
        await ad_suite.start_service("app-delivery")
    c = FakeConnector(ad_suite.grpc_target("app-delivery"))
    yield c
    await c.close()


@pytest.fixture
async def producer(kafka):
    async with Producer(kafka.bootstrap_servers) as p:
        yield p
