"""Graceful node shutdown (nodeagent.shutdown) in the whole agent, on the fake runtime,
the in-memory API and FakeClock, with a fake logind: the budgets and the order pods
are stopped in, the node's Ready, the lock, the drop-in, failures of the bus. The same
against a logind on a private D-Bus and containerd: e2e/test_node_shutdown.py."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from nodeagent import config
from nodeagent.api.kube import PODS
from nodeagent.shutdown import (
    CRITICAL_PRIORITY,
    DROP_IN,
    Budget,
    LogindError,
    budgets,
    grace_for,
    group_pods,
)
from nodeagent.systembus import LogindBus, system_bus_address
from tests.conftest import AgentRig, agent_config, aio, mkpod, status_patches

MESSAGE = "Pod was terminated in response to imminent node shutdown."


class FakeLogind:
    """logind as nodeagent.logind presents it, in memory: a lock is a real pipe (its
    write end handed out; closed: released), and a reload reads the drop-in folder as
    logind reads it."""

    def __init__(self, conf_dir: Path, delay: float = 5.0) -> None:
        self.conf_dir = conf_dir
        self.delay = delay
        self.reload_works = True
        self.unreachable: str | None = None  # connect fails with this
        self.locks: list[tuple[tuple[str, str, str, str], int]] = []  # args, read end
        self.signals: list[bool | None] = []  # queued for prepare_for_shutdown
        self.connections = self.closed = self.reloads = 0
        self._waiting: asyncio.Future[None] | None = None

    async def connect(self) -> FakeLogind:
        if self.unreachable:
            raise LogindError(self.unreachable)
        self.connections += 1
        return self

    async def inhibit_delay_max(self) -> float:
        return self.delay

    async def inhibit(self, what: str, who: str, why: str, mode: str) -> int:
        r, w = os.pipe()
        os.set_blocking(r, False)
        self.locks.append(((what, who, why, mode), r))
        return w

    async def reload(self) -> None:
        self.reloads += 1
        if not self.reload_works:
            return
        for path in sorted(self.conf_dir.glob("*.conf")):
            for line in path.read_text().splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "InhibitDelayMaxSec":
                    self.delay = float(value)

    def emit(self, active: bool | None) -> None:
        """PrepareForShutdown(active); None: the connection is gone."""
        self.signals.append(active)
        if self._waiting is not None and not self._waiting.done():
            self._waiting.set_result(None)

    async def prepare_for_shutdown(self) -> bool:
        while not self.signals:
            self._waiting = asyncio.get_running_loop().create_future()
            await self._waiting
        active = self.signals.pop(0)
        if active is None:
            raise LogindError("the system bus connection was closed")
        return active

    def close(self) -> None:
        self.closed += 1

    def held(self) -> list[tuple[str, str, str, str]]:
        """The locks whose file descriptor is still open somewhere."""
        out = []
        for args, r in self.locks:
            try:
                if os.read(r, 1) == b"":
                    continue  # every write end closed: released
            except BlockingIOError:
                pass
            out.append(args)
        return out

    def dispose(self) -> None:
        for _, r in self.locks:
            os.close(r)


def shutdown_rig(tmp_path: Path, settings: str, delay: float = 5.0
                 ) -> tuple[AgentRig, FakeLogind]:
    conf_dir = tmp_path / "logind.conf.d"
    logind = FakeLogind(conf_dir, delay)
    path = tmp_path / "agent.yaml"
    path.write_text(f"{settings}\nlogindConfDir: {conf_dir}\n")
    rig = AgentRig(tmp_path, "--config", str(path), logind=logind.connect)
    return rig, logind


def pod(name: str, priority: int | None = None, grace: int = 30, **spec: Any
        ) -> dict[str, Any]:
    p = mkpod(name, containers=[f"c-{name}"], terminationGracePeriodSeconds=grace, **spec)
    if priority is not None:
        p["spec"]["priority"] = priority
    return p


def finished(rig: AgentRig, uid: str) -> dt.datetime | None:
    """When the pod's container ended in the runtime (None: it runs)."""
    cs = rig.rt.find(uid, f"c-{uid.removeprefix('uid-')}")
    return cs[-1].finished_at if cs and cs[-1].finished_at else None


def node_events(rig: AgentRig) -> list[tuple[str, str, str]]:
    return [(c.body["type"], c.body["reason"], c.body["message"])
            for c in rig.kube.calls_of("create events")
            if c.body and c.body["involvedObject"]["kind"] == "Node"]


BY_PRIORITY = """shutdownGracePeriodByPodPriority:
- {priority: 0, shutdownGracePeriodSeconds: 10}
- {priority: 1000, shutdownGracePeriodSeconds: 4}
- {priority: 2000000000, shutdownGracePeriodSeconds: 3}"""


@aio
async def test_pods_stop_lowest_priority_first_each_group_within_its_budget(
        tmp_path: Path) -> None:
    rig, logind = shutdown_rig(tmp_path, BY_PRIORITY)
    rig.rt.ignore_sigterm |= {"c-stubborn", "c-mid"}
    await rig.start()
    for p in (pod("quick"), pod("stubborn", priority=-5), pod("mid", priority=1000, grace=2),
              pod("crit", priority=CRITICAL_PRIORITY + 1000),
              pod("done", policy="Never")):
        rig.kube.put(PODS, p)
    rig.rt.exit_on_start["c-done"] = 0
    for _ in range(4):
        await rig.clock.advance(1)
    assert {c.name for c in rig.rt.running()} == {"c-quick", "c-stubborn", "c-mid", "c-crit"}
    assert rig.status("uid-done")["phase"] == "Succeeded"
    # logind allowed 5 s, the budgets need 17: the drop-in raised it, logind reloaded
    assert (tmp_path / "logind.conf.d" / DROP_IN).read_text().endswith(
        "[Login]\nInhibitDelayMaxSec=17\n")
    assert logind.reloads == 1 and logind.delay == 17
    assert logind.held() == [("shutdown", "kubelet",
                              "Kubelet needs time to handle node shutdown", "delay")]
    assert rig.ready_condition()["status"] == "True"

    t0 = rig.clock.now()
    logind.emit(True)
    await rig.clock.advance(0)
    assert rig.ready_condition()["status"] == "False"  # written at once, not at a tick
    assert rig.ready_condition()["message"] == "node is shutting down"
    assert ("Normal", "Shutdown", "Shutdown manager detected shutdown event") in \
        node_events(rig)
    for _ in range(20):
        await rig.clock.advance(1)
        if not logind.held():
            break
    released = rig.clock.now() - t0
    ended = {name: finished(rig, f"uid-{name}") for name in ("quick", "stubborn", "mid",
                                                             "crit")}
    assert all(ended.values()), ended
    at = {name: (t - t0).total_seconds() for name, t in ended.items() if t}
    # the lowest group at once; its stubborn pod killed at its budget (10 s), not at its
    # own 30 s; the next group only then, its pod killed at its own grace (2 s, under
    # 4); the critical group last; all within the budgets' 17 s
    assert at["quick"] == 0 and at["stubborn"] == 10 and at["mid"] == 10 + 2
    assert at["mid"] <= at["crit"] <= 10 + 4
    assert at["crit"] <= released.total_seconds() <= 17
    for name in ("quick", "stubborn", "mid", "crit"):
        st = rig.status(f"uid-{name}")
        assert (st["phase"], st["reason"], st["message"]) == ("Failed", "Terminated", MESSAGE)
        target = [c for c in st["conditions"] if c["type"] == "DisruptionTarget"]
        assert [(c["status"], c["reason"], c["message"]) for c in target] == [
            ("True", "TerminationByKubelet", MESSAGE)]
    # a pod that had ended is left as it was
    done = [st for u, st in status_patches(rig.kube) if u == "uid-done"]
    assert done[-1]["phase"] == "Succeeded" and done[-1].get("reason") is None

    # a cancelled shutdown: Ready again, a lock again
    logind.emit(False)
    await rig.clock.advance(0)
    assert rig.ready_condition()["status"] == "True"
    assert len(logind.held()) == 1 and len(logind.locks) == 2
    assert ("Normal", "Shutdown", "Shutdown manager detected shutdown cancellation") in \
        node_events(rig)
    await rig.finish()
    assert logind.held() == [] and logind.closed == 1  # the agent's stop releases it
    logind.dispose()


@aio
async def test_grace_period_with_critical_pods_stops_critical_pods_last(
        tmp_path: Path) -> None:
    rig, logind = shutdown_rig(tmp_path, "shutdownGracePeriod: 20s\n"
                                         "shutdownGracePeriodCriticalPods: 5s", delay=30)
    rig.rt.ignore_sigterm |= {"c-regular", "c-node-critical"}
    await rig.start()
    for p in (pod("regular", grace=60), pod("high", priority=1_000_000_000),
              pod("node-critical", priority=CRITICAL_PRIORITY + 1000, grace=60)):
        rig.kube.put(PODS, p)
    for _ in range(4):
        await rig.clock.advance(1)
    assert logind.reloads == 0  # logind allows 30 s already
    t0 = rig.clock.now()
    logind.emit(True)
    await rig.clock.advance(0)
    for _ in range(25):
        await rig.clock.advance(1)
    at = {name: (t - t0).total_seconds() for name in ("regular", "high", "node-critical")
          if (t := finished(rig, f"uid-{name}"))}
    # regular pods (up to system-cluster-critical) share the first 15 s; the critical
    # ones the last 5
    assert at["high"] == 0 and at["regular"] == 15 and at["node-critical"] >= 20 - 1
    assert logind.held() == []
    await rig.finish()
    logind.dispose()


@aio
async def test_pods_that_come_while_the_node_shuts_down_are_refused(tmp_path: Path) -> None:
    rig, logind = shutdown_rig(tmp_path, "shutdownGracePeriod: 10s", delay=30)
    await rig.start()
    logind.emit(True)
    await rig.clock.advance(1)
    rig.kube.put(PODS, pod("late"))
    for _ in range(3):
        await rig.clock.advance(1)
    st = rig.status("uid-late")
    assert (st["phase"], st["reason"], st["message"]) == (
        "Failed", "NodeShutdown", "Pod was rejected: Pod was rejected as the node is "
                                  "shutting down.")
    assert rig.rt.find("uid-late", "c-late") == [] and not rig.rt.sandboxes
    await rig.finish()
    logind.dispose()


@aio
async def test_without_the_setting_nothing_is_asked_of_logind(tmp_path: Path) -> None:
    logind = FakeLogind(tmp_path)
    rig = AgentRig(tmp_path, logind=logind.connect)
    assert rig.agent.node_shutdown is None
    await rig.start()
    await rig.clock.advance(2)
    assert logind.connections == 0 and rig.ready_condition()["status"] == "True"
    await rig.finish()


@aio
async def test_no_bus_is_an_error_named_and_tried_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="nodeagent.shutdown")
    rig, logind = shutdown_rig(tmp_path, "shutdownGracePeriod: 10s", delay=30)
    logind.unreachable = ("cannot connect to the system bus at "
                          "unix:path=/var/run/dbus/system_bus_socket: No such file")
    await rig.start()
    await rig.clock.advance(1)
    assert "graceful node shutdown: cannot connect to the system bus" in caplog.text
    assert any(e[:2] == ("Warning", "NodeShutdownUnavailable") and "system bus" in e[2]
               for e in node_events(rig))
    assert rig.ready_condition()["status"] == "True"  # the node runs on without it
    await rig.clock.advance(3)  # tried again after 1 s, then 2 s: logged once
    assert caplog.text.count("cannot connect to the system bus") == 1
    logind.unreachable = None
    await rig.clock.advance(4)
    assert logind.connections == 1 and len(logind.held()) == 1
    await rig.finish()
    logind.dispose()


@aio
async def test_a_delay_logind_will_not_raise_is_an_error_and_no_lock(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="nodeagent.shutdown")
    rig, logind = shutdown_rig(tmp_path, "shutdownGracePeriod: 40s", delay=5)
    logind.reload_works = False
    await rig.start()
    for _ in range(4):
        await rig.clock.advance(1)
    assert ("logind's InhibitDelayMaxSec is still 5s after " in caplog.text
            and "asked for 40s" in caplog.text)
    assert logind.locks == [] and logind.closed == 1
    await rig.finish()


@aio
async def test_a_lost_bus_is_connected_again_and_the_lock_taken_again(
        tmp_path: Path) -> None:
    rig, logind = shutdown_rig(tmp_path, "shutdownGracePeriod: 10s", delay=30)
    await rig.start()
    await rig.clock.advance(1)
    assert len(logind.held()) == 1
    logind.emit(None)  # logind or the bus restarted
    await rig.clock.advance(0)
    assert logind.held() == [] and logind.closed == 1
    await rig.clock.advance(1)
    assert logind.connections == 2 and len(logind.held()) == 1 and len(logind.locks) == 2
    await rig.finish()
    logind.dispose()


@aio
async def test_the_system_bus_is_found_as_the_kubelet_finds_it(tmp_path: Path) -> None:
    assert system_bus_address({}) == "unix:path=/var/run/dbus/system_bus_socket"
    assert system_bus_address({"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/x"}) == \
        "unix:path=/x"
    with pytest.raises(LogindError, match=f"cannot connect to the system bus at "
                                          f"unix:path={tmp_path}/none: "):
        await LogindBus.connect(f"unix:path={tmp_path}/none")


# -- the budgets, as the kubelet reads its settings --

def test_budgets_from_the_settings() -> None:
    assert budgets(30, 10, ()) == (Budget(0, 20), Budget(CRITICAL_PRIORITY, 10))
    assert budgets(30, 0, ()) == (Budget(0, 30), Budget(CRITICAL_PRIORITY, 0))
    assert budgets(0, 0, ()) == ()
    assert budgets(0, 0, ((100, 5), (-10, 7))) == (Budget(-10, 7), Budget(100, 5))


def test_each_pod_goes_to_the_highest_budget_it_reaches() -> None:
    bs = (Budget(0, 10), Budget(1000, 4), Budget(CRITICAL_PRIORITY, 3))
    pods = {n: {"metadata": {"name": n}, "spec": {} if p is None else {"priority": p}}
            for n, p in (("none", None), ("neg", -1), ("zero", 0), ("999", 999),
                         ("1000", 1000), ("crit", CRITICAL_PRIORITY),
                         ("node", CRITICAL_PRIORITY + 1000))}
    groups = group_pods(bs, list(pods.values()))
    assert [[p["metadata"]["name"] for p in g] for g in groups] == [
        ["none", "neg", "zero", "999"], ["1000"], ["crit", "node"]]
    assert grace_for({"spec": {"terminationGracePeriodSeconds": 2}}, bs[0]) == 2
    assert grace_for({"spec": {"terminationGracePeriodSeconds": 30}}, bs[0]) == 10
    assert grace_for({"spec": {}}, bs[1]) == 4


def test_virtual_nodes_refuse_the_setting_by_name(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("shutdownGracePeriod: 30s\n")
    with pytest.raises(config.ConfigError, match="shutdownGracePeriod: not supported with "
                                                 "--virtual-nodes"):
        agent_config(tmp_path, "--virtual-nodes", "3", "--config", str(path))
    assert agent_config(tmp_path, "--config", str(path)).graceful_shutdown
