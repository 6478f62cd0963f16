"""ROUTER_PERSIST_VIA=local without a broker: the copies of this process's own device-persistence target are
handed to its `persist` in one batch per loop iteration, in order, and their futures resolve only once it
returned (saved); the other targets keep their Persist streams; the settings name the own target."""

from __future__ import annotations

import asyncio

import pytest

from tbmq_platform.peers import pick_target
from tbmq_platform.settings import SettingsError, load

from router.persist import LocalPersist, PersistLink, PersistStream
from router.settings import RouterSettings

pytestmark = pytest.mark.unit


class FakeDevicePersistence:
    """`persist` as tbmq_device_persistence's service has it: each call saved in call order (its batch lock);
    the test releases each save."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []
        self.release: list[asyncio.Future] = []
        self.fail_with: BaseException | None = None

    async def persist(self, records) -> int:
        self.calls.append(list(records))
        fut = asyncio.get_running_loop().create_future()
        self.release.append(fut)
        await fut
        if self.fail_with is not None:
            raise self.fail_with
        return len(records)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_one_loop_iterations_copies_are_one_persist_call_resolved_after_the_save():
    dp = FakeDevicePersistence()
    local = LocalPersist("localhost:50061", dp.persist)
    first = [local.add(b"a"), local.add(b"b")]
    assert first[0] is first[1]  # one future per batch
    await settle()
    second = local.add(b"c")
    await settle()
    assert dp.calls == [[b"a", b"b"], [b"c"]]
    assert not first[0].done() and local.unanswered == 2  # handed over, not saved yet
    dp.release[0].set_result(None)
    await settle()
    assert first[0].done() and not second.done()
    dp.release[1].set_result(None)
    await settle()
    assert second.done() and local.unanswered == 0
    assert local.stats["batches"] == 2 and local.stats["records"] == 3 and local.stats["answered"] == 2


async def test_a_batch_device_persistence_could_not_save_while_stopping_stays_unanswered():
    dp = FakeDevicePersistence()
    local = LocalPersist("localhost:50061", dp.persist)
    fut = local.add(b"a")
    await settle()
    dp.fail_with = RuntimeError("stopping while Redis is unavailable: the batch is not answered")
    dp.release[0].set_result(None)
    await settle()
    assert not fut.done()  # never failed, never resolved: its offsets are not committed
    assert local.stats["answered"] == 0 and local.unanswered == 0


async def test_close_cancels_the_saves_in_progress():
    dp = FakeDevicePersistence()
    local = LocalPersist("localhost:50061", dp.persist)
    fut = local.add(b"a")
    await settle()
    await local.close()
    assert local.unanswered == 0 and not fut.done()


async def test_only_the_own_target_is_local_and_a_client_keeps_its_target():
    dp = FakeDevicePersistence()
    targets = ("a:50061", "b:50061", "c:50061")
    link = PersistLink(targets, local=("b:50061", dp.persist))
    try:
        kinds = {s.target: type(s) for s in link.streams}
        assert kinds == {"a:50061": PersistStream, "b:50061": LocalPersist, "c:50061": PersistStream}
        # the same pick as a router without a local instance, and as the connectors make
        ours = next(f"client-{i}" for i in range(100) if pick_target(targets, f"client-{i}".encode()) == "b:50061")
        link.send(ours.encode(), b"copy")
        await settle()
        assert dp.calls == [[b"copy"]]
    finally:
        for f in dp.release:
            f.set_result(None)
        await link.close()


def test_a_local_target_outside_the_list_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        PersistLink(("a:50061",), local=("b:50061", FakeDevicePersistence().persist))


def test_the_own_target_is_the_lists_only_entry_or_named():
    assert load(RouterSettings, {"ROUTER_PERSIST_VIA": "local",
                                 "DEVICE_PERSISTENCE_GRPC_TARGETS": "h:1"}).own_target == "h:1"
    s = load(RouterSettings, {"ROUTER_PERSIST_VIA": "local", "DEVICE_PERSISTENCE_GRPC_TARGETS": "h:1,h:2",
                              "ROUTER_LOCAL_TARGET": "h:2"})
    assert s.own_target == "h:2"


@pytest.mark.parametrize("local_target", ["", "h:3"])
def test_local_needs_its_own_target_among_the_targets(local_target):
    with pytest.raises(SettingsError, match="ROUTER_LOCAL_TARGET"):
        load(RouterSettings, {"ROUTER_PERSIST_VIA": "local", "DEVICE_PERSISTENCE_GRPC_TARGETS": "h:1,h:2",
                              "ROUTER_LOCAL_TARGET": local_target})
    # the same list over Persist streams needs no own target
    load(RouterSettings, {"ROUTER_PERSIST_VIA": "grpc", "DEVICE_PERSISTENCE_GRPC_TARGETS": "h:1,h:2",
                          "ROUTER_LOCAL_TARGET": local_target})
