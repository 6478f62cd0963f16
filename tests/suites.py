"""`module_suite`: a launcher Suite on free ports with the session's Kafka, for a test module's fixture.

    @pytest.fixture(scope="module")
    async def pq(kafka, tmp_path_factory):
        async with module_suite(kafka, tmp_path_factory, "suite-persist", services=[...], connectors=2) as s:
            yield s
"""

from __future__ import annotations

import contextlib

from tbmq_launcher.launcher import Suite, new_tag


@contextlib.asynccontextmanager
async def module_suite(kafka, tmp_path_factory, name: str = "suite", **options):
    """Started, stopped on exit; `kafka` is the session fixture (a KafkaBroker or an external bootstrap)."""
    options.setdefault("log_format", "json")
    s = Suite(ports="free", id_tag=new_tag(), run_dir=tmp_path_factory.mktemp(name),
              kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers, **options)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()
