"""NoSchedule taints by condition: the mapping table, add and remove through the
monitor's one loop (admission's not-ready taint included), no fight with the Lease
verdict's unreachable taints, and a write only when the taint set changes. FakeClock,
the fake API server of tests/fakeoperator.py; no test sleeps."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from nodeoperator import taints
from nodeoperator.modes import EXCLUSIVE, Lifecycle
from nodeoperator.monitor import WRITES, Monitor
from nodeoperator.state import Store

from nodeagent.api.client import ApiError
from nodeagent.api.clock import FakeClock
from tests.fakeoperator import NOT_READY, Env, FakeApi, post, register, run, spec, step

UNREACHABLE = "node.kubernetes.io/unreachable"
DISK = "node.kubernetes.io/disk-pressure"
MEMORY = "node.kubernetes.io/memory-pressure"
PID = "node.kubernetes.io/pid-pressure"
NETWORK = "node.kubernetes.io/network-unavailable"
UNSCHEDULABLE = "node.kubernetes.io/unschedulable"


# the controller manager's node-lifecycle controller off: the operator does it all
ALONE = Lifecycle(EXCLUSIVE)


def conds(**statuses: str) -> dict[str, dict[str, Any]]:
    return {ctype: {"type": ctype, "status": s} for ctype, s in statuses.items()}


@pytest.mark.parametrize(("conditions", "unschedulable", "present", "expected"), [
    (conds(Ready="True"), False, (), set()),
    (conds(Ready="False"), False, (), {NOT_READY}),
    (conds(Ready="Unknown"), False, (), {UNREACHABLE}),
    (conds(Ready="True", MemoryPressure="True"), False, (), {MEMORY}),
    (conds(Ready="True", DiskPressure="True"), False, (), {DISK}),
    (conds(Ready="True", PIDPressure="True"), False, (), {PID}),
    (conds(Ready="True", NetworkUnavailable="True"), False, (), {NETWORK}),
    # pressure False or Unknown calls for nothing
    (conds(Ready="True", MemoryPressure="False", DiskPressure="Unknown",
           PIDPressure="False", NetworkUnavailable="False"), False, (), set()),
    (conds(Ready="False", DiskPressure="True", PIDPressure="True"), False, (),
     {NOT_READY, DISK, PID}),
    (conds(Ready="True"), True, (), {UNSCHEDULABLE}),
    # admission's not-ready: kept while no Ready was ever posted, gone once it is True
    ({}, False, (NOT_READY,), {NOT_READY}),
    ({}, False, (), set()),
    (conds(DiskPressure="True"), False, (NOT_READY,), {NOT_READY, DISK}),
    (conds(Ready="True"), False, (NOT_READY,), set()),
    (conds(Ready="Unknown"), False, (NOT_READY,), {UNREACHABLE}),
    # a condition type that is not in the table taints nothing
    (conds(Ready="True", KernelDeadlock="True"), False, (), set()),
])
def test_mapping_table(conditions: dict[str, dict[str, Any]], unschedulable: bool,
                       present: tuple[str, ...], expected: set[str]) -> None:
    assert taints.wanted(conditions, unschedulable, present) == expected


def test_every_condition_taint_is_noschedule_and_managed() -> None:
    condition_keys = {NOT_READY, UNREACHABLE, MEMORY, DISK, PID, NETWORK}
    assert set(taints.BY_CONDITION.values()) == condition_keys
    assert set(taints.MANAGED) == condition_keys | {UNSCHEDULABLE}


# ---- through the monitor
def edit(api: FakeApi, name: str, **spec_fields: Any) -> None:
    node = api.nodes[name]
    node["spec"].update(spec_fields)
    api._bump(node)
    api.store.node_event("MODIFIED", copy.deepcopy(node))


def keys(api: FakeApi, name: str, effect: str = "NoSchedule") -> set[str]:
    return {t["key"] for t in api.nodes[name]["spec"].get("taints", [])
            if t["effect"] == effect}


def taint_writes(api: FakeApi) -> int:
    return sum(1 for kind, _, patch in api.writes if kind == "node" and "spec" in patch)


def node_writes_ok() -> float:
    return WRITES.labels("node", "ok")._value.get()


def test_admission_not_ready_removed_once_ready_and_others_kept() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        other = {"key": "dedicated", "value": "edge", "effect": "NoSchedule"}
        register(api, "n1", extra=[other])
        api.renew("n1")
        store.changed.clear()
        await mon.tick()
        # No Ready posted yet: the node stays not-ready (only the annotation is written).
        assert keys(api, "n1") == {"dedicated", NOT_READY}
        assert taint_writes(api) == 0
        post(api, "n1", Ready="True", MemoryPressure="False", DiskPressure="False",
             PIDPressure="False")
        assert store.changed.is_set()  # a condition change wakes the loop
        before = node_writes_ok()
        await mon.tick()
        assert api.nodes["n1"]["spec"]["taints"] == [other]
        assert node_writes_ok() == before + 1  # counted in the existing metric
        # The write carried the resourceVersion it was computed from.
        [(_, _, patch)] = [w for w in api.writes if w[0] == "node" and "spec" in w[2]]
        assert patch["metadata"]["resourceVersion"]
    run(t)


def test_condition_taints_added_and_removed() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        register(api, "n1")
        post(api, "n1", Ready="True", DiskPressure="False")
        api.renew("n1")
        await mon.tick()
        assert keys(api, "n1") == set()
        post(api, "n1", DiskPressure="True")
        await step(clock, mon, 1)
        assert keys(api, "n1") == {DISK}
        post(api, "n1", MemoryPressure="True", PIDPressure="True")
        await step(clock, mon, 1)
        assert keys(api, "n1") == {DISK, MEMORY, PID}
        post(api, "n1", Ready="False", DiskPressure="False")
        await step(clock, mon, 1)
        assert keys(api, "n1") == {NOT_READY, MEMORY, PID}
        edit(api, "n1", unschedulable=True)  # kubectl cordon
        await step(clock, mon, 1)
        assert keys(api, "n1") == {NOT_READY, MEMORY, PID, UNSCHEDULABLE}
        post(api, "n1", NetworkUnavailable="True")
        await step(clock, mon, 1)
        assert NETWORK in keys(api, "n1")
        post(api, "n1", Ready="True", MemoryPressure="False", PIDPressure="False",
             NetworkUnavailable="False")
        edit(api, "n1", unschedulable=False)
        await step(clock, mon, 1)
        assert api.nodes["n1"]["spec"]["taints"] == []
        # Effects other than NoSchedule under the same keys are not ours.
        api.nodes["n1"]["spec"]["taints"] = [{"key": DISK, "effect": "NoExecute"}]
        api.deliver()
        await step(clock, mon, 1)
        assert api.nodes["n1"]["spec"]["taints"] == [{"key": DISK, "effect": "NoExecute"}]
    run(t)


def test_stale_node_gets_unreachable_not_not_ready_and_no_fight() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("p", spec(grace=15))
        register(api, "n1")
        post(api, "n1", Ready="False", MemoryPressure="True", NetworkUnavailable="True")
        api.renew("n1")
        await mon.tick()
        assert keys(api, "n1") == {NOT_READY, MEMORY, NETWORK}
        await step(clock, mon, 16)  # the Lease goes stale
        # Ready and the pressure conditions go Unknown in the same period: unreachable
        # replaces not-ready, the pressure taint goes; the network plugin's stays.
        assert keys(api, "n1") == {UNREACHABLE, NETWORK}
        assert keys(api, "n1", "NoExecute") == {UNREACHABLE}
        ready = next(c for c in api.nodes["n1"]["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "Unknown"
        writes = len(api.writes)
        for _ in range(5):  # settled: neither side undoes the other
            await step(clock, mon, 2)
        assert len(api.writes) == writes
        # Renewed: the Lease verdict lifts unreachable; Ready is still Unknown (the
        # agent has not posted yet), which calls for no not-ready either.
        api.renew("n1")
        await mon.tick()
        assert keys(api, "n1") == {NETWORK} and keys(api, "n1", "NoExecute") == set()
        await step(clock, mon, 2)
        assert keys(api, "n1") == {NETWORK}
        post(api, "n1", Ready="False")  # the agent reports in, still not ready
        await mon.tick()
        assert keys(api, "n1") == {NOT_READY, NETWORK}
        post(api, "n1", Ready="True", NetworkUnavailable="False")
        await mon.tick()
        assert api.nodes["n1"]["spec"]["taints"] == []
    run(t)


def test_stale_node_that_never_posted_loses_admission_not_ready_for_unreachable() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        register(api, "n1")
        await step(clock, mon, 51)  # default grace 50 s, never a Lease
        assert keys(api, "n1") == {UNREACHABLE}
        assert keys(api, "n1", "NoExecute") == {UNREACHABLE}
    run(t)


def test_write_only_when_the_taint_set_changes() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        # Taints already as the conditions want them, in an order of someone else's
        # making: nothing to write.
        register(api, "n1")
        post(api, "n1", Ready="True", DiskPressure="True")
        api.nodes["n1"]["spec"]["taints"] = [{"key": DISK, "effect": "NoSchedule"},
                                             {"key": "x", "effect": "NoSchedule"}]
        api.deliver()
        api.renew("n1")
        await mon.tick()
        assert taint_writes(api) == 0
        # Condition changes that leave the set as it is: no write either.
        post(api, "n1", Ready="True", DiskPressure="True", MemoryPressure="Unknown")
        await step(clock, mon, 2)
        post(api, "n1", PIDPressure="False")
        await step(clock, mon, 2)
        assert taint_writes(api) == 0
        # One that changes it: exactly one write, then quiet again.
        post(api, "n1", DiskPressure="False")
        await step(clock, mon, 2)
        await step(clock, mon, 2)
        await step(clock, mon, 2)
        assert taint_writes(api) == 1
        assert api.nodes["n1"]["spec"]["taints"] == [{"key": "x", "effect": "NoSchedule"}]
    run(t)


def test_no_second_write_before_the_watch_shows_the_first() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        register(api, "n1")
        post(api, "n1", Ready="True")
        api.renew("n1")
        api.auto_deliver = False
        await mon.tick()
        assert taint_writes(api) == 1
        await step(clock, mon, 2)  # the index still shows not-ready: our write is pending
        assert taint_writes(api) == 1
        api.deliver()
        await step(clock, mon, 2)
        assert taint_writes(api) == 1 and keys(api, "n1") == set()
    run(t)


def test_someone_elses_taint_added_meanwhile_is_not_lost() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        register(api, "n1")
        api.renew("n1")
        await mon.tick()
        post(api, "n1", Ready="True")
        # Another client adds a taint the index has not seen when we compute.
        api.nodes["n1"]["spec"]["taints"].append({"key": "maint", "effect": "NoSchedule"})
        api._bump(api.nodes["n1"])
        conflicts = WRITES.labels("node", "conflict")._value.get()
        await mon.tick()
        assert WRITES.labels("node", "conflict")._value.get() == conflicts + 1
        assert NOT_READY in keys(api, "n1")  # refused: nothing overwritten
        api.deliver()
        await mon.tick()
        assert api.nodes["n1"]["spec"]["taints"] == [{"key": "maint", "effect": "NoSchedule"}]
    run(t)


def test_standby_writes_no_condition_taints() -> None:
    async def t(env: Env) -> None:
        clock, store, api, _ = env
        mon = Monitor(store, clock, api, lifecycle=ALONE, period=2, is_leader=lambda: False)
        register(api, "n1")
        post(api, "n1", Ready="True")
        await mon.tick()
        assert api.writes == [] and keys(api, "n1") == {NOT_READY}
    run(t)


def test_store_wakes_only_for_changes_that_matter_to_taints() -> None:
    store = Store(FakeClock())
    body: dict[str, Any] = {"metadata": {"name": "n1", "resourceVersion": "1"}, "spec": {},
                            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    store.node_event("ADDED", body)
    store.changed.clear()
    body["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-01-01T00:00:10Z"
    store.node_event("MODIFIED", body)
    assert not store.changed.is_set()  # a heartbeat alone: next period is soon enough
    body["status"]["conditions"].append({"type": "NetworkUnavailable", "status": "True"})
    store.node_event("MODIFIED", body)
    assert store.changed.is_set()
    assert store.nodes["n1"].conditions["NetworkUnavailable"]["status"] == "True"
    store.changed.clear()
    body["spec"]["unschedulable"] = True
    store.node_event("MODIFIED", body)
    assert store.changed.is_set() and store.nodes["n1"].unschedulable


def test_api_error_leaves_taints_for_the_next_period() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        register(api, "n1")
        post(api, "n1", Ready="True")
        api.renew("n1")
        real = api.patch_node
        calls = 0

        async def failing(name: str, patch: dict[str, Any]) -> str:
            nonlocal calls
            calls += 1
            raise ApiError(status=500, reason="etcd timeout")
        api.patch_node = failing  # type: ignore[method-assign]
        await mon.tick()
        assert calls == 1 and keys(api, "n1") == {NOT_READY}
        api.patch_node = real  # type: ignore[method-assign]
        await step(clock, mon, 2)
        assert keys(api, "n1") == set()
    run(t)
