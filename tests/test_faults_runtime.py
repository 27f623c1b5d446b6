"""Runtime faults (fake runtime, FakeClock): a runtime whose relists fail (containerd
stopped) is reported down within a few relist periods, on the Node's Ready condition and
in /metrics, and clears as soon as relists work again (a single failed relist is not an
outage); an agent that stops lets the runtime calls in flight finish, within a bound."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

from prometheus_client import CollectorRegistry

from nodeagent.agent import TIMER_SLACK
from nodeagent.api.clock import FakeClock, settle
from nodeagent.pods.pleg import Pleg
from nodeagent.pods.podupdate import Op
from nodeagent.runtime import (
    ContainerEvent,
    ContainerState,
    RelistResult,
    Unavailable,
)
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import AgentRig, aio, mkpod, started


class Switch:
    """Makes a FakeRuntime unreachable (Unavailable) while `down` is set: its relists
    and subscriptions fail, and going down breaks its event streams."""

    def __init__(self, rt: FakeRuntime) -> None:
        self.rt = rt
        self._down = False
        real_relist, real_events = rt.relist, rt.container_events

        async def relist() -> RelistResult:
            if self._down:
                raise Unavailable("cri: connection refused (socket gone)")
            return await real_relist()

        async def container_events() -> AsyncIterator[ContainerEvent]:
            if self._down:
                raise Unavailable("cri: connection refused (socket gone)")
            return await real_events()

        rt.relist = relist  # type: ignore[method-assign]
        rt.container_events = container_events  # type: ignore[method-assign]

    @property
    def down(self) -> bool:
        return self._down

    @down.setter
    def down(self, down: bool) -> None:
        self._down = down
        if down:
            self.rt.break_event_streams(Unavailable("cri: connection reset"))


@aio
async def test_failing_relists_report_the_runtime_down_and_back() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    reg = CollectorRegistry()
    pleg = Pleg(rt, clock, node="n1", registry=reg)
    sw = Switch(rt)

    def sample(name: str) -> float | None:
        return reg.get_sample_value(name, {"node": "n1"})

    pleg.start()
    await settle()
    assert pleg.runtime_problem() is None
    assert sample("nodepulse_pleg_runtime_up") == 1.0

    sw.down = True
    await clock.advance(1)
    assert pleg.relist_failures == 1
    assert pleg.runtime_problem() is None  # one failure is a blip, not an outage
    await clock.advance(1)
    problem = pleg.runtime_problem()
    assert problem is not None and "container runtime is down" in problem
    assert "connection refused" in problem
    assert sample("nodepulse_pleg_runtime_up") == 0.0
    assert sample("nodepulse_pleg_relist_failures_total") == 2.0
    assert pleg.health() is None  # liveness: a down runtime is no reason to restart us

    sw.down = False
    await clock.advance(1)
    assert pleg.runtime_problem() is None and pleg.relist_failures == 0
    assert sample("nodepulse_pleg_runtime_up") == 1.0
    assert sample("nodepulse_pleg_relist_failures_total") == 2.0
    await pleg.stop()


@aio
async def test_failing_relists_make_the_node_not_ready_within_one_status_period(
        tmp_path: Path) -> None:
    """Only the relist fails (the version/image reading that runs every 10 s still
    works, as when containerd stops and starts between two of them): the Node still
    goes Ready=False at the next status computation, and back."""
    rig = AgentRig(tmp_path)
    sw = Switch(rig.rt)
    await rig.start()
    assert rig.ready_condition()["status"] == "True"
    sw.down = True
    await rig.clock.advance(2)  # two failed relists: down as PLEG sees it
    assert rig.pods.runtime_problem is None  # the version reading has not run since
    await rig.clock.advance(10)  # one status period
    cond = rig.ready_condition()
    assert cond["status"] == "False", cond
    assert "container runtime is down" in cond["message"]
    sw.down = False
    await rig.clock.advance(10)
    assert rig.ready_condition()["status"] == "True"
    await rig.finish()


@aio
async def test_runtime_reading_is_retried_every_second_while_down(tmp_path: Path) -> None:
    """Once the version reading failed, it is retried at once-a-second, so Ready comes
    back at the first status computation after the runtime does (not an image period
    later)."""
    rig = AgentRig(tmp_path)
    await rig.start()
    real = rig.rt.version

    async def down() -> object:
        raise Unavailable("socket gone")

    rig.rt.version = down  # type: ignore[method-assign,assignment]
    await rig.clock.advance(10)  # the image/version refresh fails
    assert rig.pods.runtime_problem is not None
    rig.rt.version = real  # type: ignore[method-assign]
    await rig.clock.advance(1)
    assert rig.pods.runtime_problem is None
    await rig.clock.advance(9 + TIMER_SLACK)  # the next tick (it may run TIMER_SLACK late)
    assert rig.ready_condition()["status"] == "True"
    await rig.finish()


@aio
async def test_a_runtime_network_not_ready_makes_the_node_not_ready(tmp_path: Path) -> None:
    """The runtime answers but says its network is not ready (containerd with no CNI
    config yet): the Node is Ready=False with the runtime's reason, as the kubelet's,
    until the network is ready; then Ready within a second and one status period. A
    runtime not ready later is seen at its next reading."""
    rig = AgentRig(tmp_path)
    network: dict[str, tuple[bool, str]] = {
        "RuntimeReady": (True, ""),
        "NetworkReady": (False, "reason:NetworkPluginNotReady message:cni plugin not "
                                "initialized")}

    async def conditions() -> dict[str, tuple[bool, str]]:
        return dict(network)

    rig.rt.conditions = conditions  # type: ignore[method-assign]
    await rig.start()
    cond = rig.ready_condition()
    assert cond["status"] == "False", cond
    assert cond["message"] == ("container runtime network not ready: NetworkReady=false "
                               "reason:NetworkPluginNotReady message:cni plugin not "
                               "initialized")
    network["NetworkReady"] = (True, "")
    await rig.clock.advance(1)
    assert rig.pods.runtime_problem is None
    await rig.clock.advance(10 + TIMER_SLACK)
    assert rig.ready_condition()["status"] == "True"
    network["RuntimeReady"] = (False, "reason:ContainerdNotReady")
    await rig.clock.advance(10)  # the next runtime reading
    await rig.clock.advance(10 + TIMER_SLACK)  # and the next status computation
    cond = rig.ready_condition()
    assert cond["status"] == "False" and "RuntimeReady=false reason:ContainerdNotReady" in \
        cond["message"], cond
    await rig.finish()


class GatedRuntime(FakeRuntime):
    """start_container waits for `gate` (a runtime slow to start a container)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.gate = asyncio.Event()
        self.starting = 0

    async def start_container(self, container_id: str) -> None:
        self.starting += 1
        await self.gate.wait()
        await super().start_container(container_id)


@aio
async def test_stopping_lets_a_runtime_call_in_flight_finish() -> None:
    """The agent stops (SIGTERM) while the runtime starts a container: the start is not
    cut off half-way (containerd would abort it as a StartError, and the next agent
    would have to restart the container); stop returns once it is done."""
    clock = FakeClock()
    rt = GatedRuntime(clock)
    a = await started(clock, rt)
    a.send(Op.ADD, mkpod("web", "u1"))
    await a.run_for(2)
    assert rt.starting == 1 and rt.running("u1") == []

    def in_flight() -> float | None:
        return a.registry.get_sample_value("nodepulse_runtime_calls_in_flight",
                                           {"node": "n1"})

    assert in_flight() == 1
    stop = asyncio.create_task(a.loops.stop())
    await settle()
    assert not stop.done()  # waiting for the start in flight
    rt.gate.set()
    await settle()
    assert stop.done() and in_flight() == 0
    assert [c.state for c in rt.find("u1", "c")] == [ContainerState.RUNNING]


@aio
async def test_stopping_gives_up_on_a_hung_runtime_call() -> None:
    clock = FakeClock()
    rt = GatedRuntime(clock)
    a = await started(clock, rt)
    a.loop.workers.timing = dataclasses.replace(a.loop.workers.timing, drain_timeout=15)
    a.send(Op.ADD, mkpod("web", "u1"))
    await a.run_for(2)
    stop = asyncio.create_task(a.loops.stop())
    await settle()
    await clock.advance(14)
    assert not stop.done()
    await clock.advance(1)
    assert stop.done() and stop.exception() is None  # the hung start was cancelled
    assert [c.state for c in rt.find("u1", "c")] == [ContainerState.CREATED]
