"""Runtime faults seen by PLEG and the node's readiness (fake runtime, FakeClock):
a runtime whose relists fail (containerd stopped) is reported down within a few relist
periods, on the Node's Ready condition and in /metrics, and clears as soon as relists
work again; a single failed relist is not an outage."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from nodeagent.api.clock import FakeClock, settle
from nodeagent.pleg import Pleg
from nodeagent.runtime import RelistResult, Unavailable
from nodeagent.runtime.fake import FakeRuntime
from tests.test_agent_pods import Rig
from tests.test_runtime_fake import aio


class Switch:
    """Makes a FakeRuntime's relist fail (Unavailable) while `down` is set."""

    def __init__(self, rt: FakeRuntime) -> None:
        self.down = False
        self.real = rt.relist

        async def relist() -> RelistResult:
            if self.down:
                raise Unavailable("cri: connection refused (socket gone)")
            return await self.real()

        rt.relist = relist  # type: ignore[method-assign]


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
    rig = Rig(tmp_path)
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
    rig = Rig(tmp_path)
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
    await rig.clock.advance(9)
    assert rig.ready_condition()["status"] == "True"
    await rig.finish()
