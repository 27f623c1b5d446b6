"""Evented PLEG (fake runtime, FakeClock): the runtime's events wake a pod's worker at
once; the relist runs at the long period as the check that catches a lost event, takes
over at the normal period while the stream is broken, and steps back when it is back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from nodeagent.api.clock import FakeClock, settle
from nodeagent.config import ConfigError
from nodeagent.pods.pleg import EventType, Pleg, PlegConfig, PodLifecycleEvent
from nodeagent.pods.podupdate import Op
from nodeagent.runtime import (
    ContainerConfig,
    ContainerEvent,
    ContainerRuntimeError,
    SandboxConfig,
    Unsupported,
)
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import AgentRig, agent_config, aio, drain, mkpod, start_pod, started

CONFIG = PlegConfig(relist_period=1.0, evented_relist_period=60.0)


async def evented(clock: FakeClock, rt: FakeRuntime,
                  reg: CollectorRegistry | None = None) -> Pleg:
    pleg = Pleg(rt, clock, CONFIG, node="n1", registry=reg or CollectorRegistry())
    pleg.start()
    await settle()
    assert pleg.evented and pleg.period == 60.0
    drain(pleg.events)
    return pleg


@aio
async def test_an_exit_restarts_the_container_at_once_without_a_relist() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("web", "u1"))
    await a.run_for(3)
    first = a.rt.running("u1")[0]
    relists = a.rt.calls["relist"]
    a.rt.exit_container(first.id, 1)
    await settle(100)  # no time passes: no relist, no resync tick
    now = a.rt.running("u1")
    assert len(now) == 1 and now[0].attempt == 1 and now[0].restart_count == 1
    cs = a.cstatus("u1")
    assert cs["restartCount"] == 1 and "running" in cs["state"]
    assert cs["lastState"]["terminated"]["exitCode"] == 1
    assert a.rt.calls["relist"] == relists
    await a.loops.stop()


@aio
async def test_the_start_events_of_what_a_sync_started_cost_no_second_sync() -> None:
    """A sync that ends with every container running has acted on their start: the
    sandbox's and the container's start events wake nobody, and the PLEG does not read
    the pod again for them (the sync stored what it read after the start). A sync that
    had to stop at a sidecar's start goes on when its event comes, with no time passing."""
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("plain", "u1"))
    await settle(100)
    started_events = a.registry.get_sample_value(
        "nodepulse_pleg_events_total", {"node": "n1", "type": "ContainerStarted"})
    assert started_events == 2  # the sandbox and the container
    assert a.loop.workers.syncs("u1") == 1
    assert a.status("u1")["phase"] == "Running"
    # the sync's reads: the new sandbox's ip, and the pod once its container started
    assert a.rt.calls["pod_status"] == 2

    sidecar = {"name": "side", "image": "localhost/busybox:1", "command": ["sleep", "3600"],
               "restartPolicy": "Always"}
    a.send(Op.ADD, mkpod("with-sidecar", "u2", initContainers=[sidecar]))
    await settle(100)
    assert {c.name for c in a.rt.running("u2")} == {"side", "c"}  # no time has passed
    assert a.status("u2")["phase"] == "Running"
    await a.loops.stop()


@aio
async def test_a_scripted_exit_is_an_event_at_its_time() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    pleg = await evented(clock, rt)
    pod = mkpod("job", "u1")
    pod["metadata"]["annotations"] = {"fake.nodepulse.dev/run-for": "5s",
                                      "fake.nodepulse.dev/exit-code": "3"}
    sc = SandboxConfig.from_pod(pod)
    sid = await rt.run_sandbox(sc)
    cid = await rt.create_container(sid, ContainerConfig.from_pod(
        pod, pod["spec"]["containers"][0]), sc)
    await rt.start_container(cid)
    await settle()
    assert {e.type for e in drain(pleg.events)} == {EventType.CONTAINER_STARTED}
    relists = rt.calls["relist"]
    await clock.advance(4.9)
    assert drain(pleg.events) == []
    await clock.advance(0.1)
    assert drain(pleg.events) == [PodLifecycleEvent("u1", EventType.CONTAINER_DIED, cid)]
    (c,) = pleg.cache.get("u1").status.containers
    assert c.state == "EXITED" and c.exit_code == 3
    assert c.finished_at == clock.now()
    assert rt.calls["relist"] == relists
    await pleg.stop()


@aio
async def test_a_worker_waiting_for_newer_state_is_answered_without_a_relist() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    await start_pod(rt, "a")
    pleg = await evented(clock, rt)
    relists, inspections = rt.calls["relist"], rt.calls["pod_status"]
    t = clock.monotonic()  # a sync of pod a ends now: it needs state read after it
    waiter = asyncio.create_task(pleg.cache.get_newer_than("a", t))
    await settle()
    assert waiter.done() and waiter.result().modified > t
    assert rt.calls["pod_status"] == inspections + 1 and rt.calls["relist"] == relists
    await pleg.stop()


@aio
async def test_a_lost_event_is_caught_by_the_long_period_relist() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    (cid,) = await start_pod(rt, "a")
    pleg = await evented(clock, rt)
    assert pleg.cache.get("a").status.containers[0].state == "RUNNING"
    rt.lost_events = 1
    rt.exit_container(cid, 2)  # the stream never delivers this exit
    await clock.advance(59)
    assert drain(pleg.events) == []
    assert pleg.cache.get("a").status.containers[0].state == "RUNNING"  # not known yet
    await clock.advance(1)  # the relist, a minute after the last
    assert drain(pleg.events) == [PodLifecycleEvent("a", EventType.CONTAINER_DIED, cid)]
    assert pleg.cache.get("a").status.containers[0].state == "EXITED"
    await pleg.stop()


@aio
async def test_a_broken_stream_hands_over_to_the_relist_until_it_is_back() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    reg = CollectorRegistry()
    (cid,) = await start_pod(rt, "a")
    pleg = await evented(clock, rt, reg)
    assert reg.get_sample_value("nodepulse_pleg_event_stream_up", {"node": "n1"}) == 1.0
    await clock.advance(30)
    relists = rt.calls["relist"]

    rt.fail["container_events"] = ContainerRuntimeError("connection refused")
    rt.break_event_streams()
    await settle()
    assert not pleg.evented and pleg.period == 1.0
    assert reg.get_sample_value("nodepulse_pleg_event_stream_up", {"node": "n1"}) == 0.0
    assert rt.calls["relist"] == relists + 1  # at once: the stream may have lost events
    rt.exit_container(cid, 2)  # no stream: the next relist sees it
    await clock.advance(1)
    assert rt.calls["relist"] == relists + 2
    assert drain(pleg.events) == [PodLifecycleEvent("a", EventType.CONTAINER_DIED, cid)]
    # subscribing again failed after 1 s; the retry 2 s later works
    await clock.advance(1)
    assert not pleg.evented and rt.calls["relist"] == relists + 3
    await clock.advance(2)  # t=34
    assert pleg.evented and pleg.period == 60.0
    # a relist when it came back at t=33 covers the gap; then a minute's pause
    assert pleg.last_result_at == 33.0 and rt.calls["relist"] == relists + 4
    await clock.advance(58)
    assert rt.calls["relist"] == relists + 4
    await clock.advance(1)
    assert rt.calls["relist"] == relists + 5
    assert pleg.health() is None
    await pleg.stop()


@aio
async def test_a_runtime_without_events_is_relisted_at_the_normal_period() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    rt.has_events = False
    pleg = Pleg(rt, clock, CONFIG, registry=CollectorRegistry())
    pleg.start()
    await settle()
    assert not pleg.evented and rt.calls["relist"] == 1
    await clock.advance(5)
    assert rt.calls["relist"] == 6
    assert rt.calls["container_events"] == 1  # asked once, never again
    await pleg.stop()



@aio
async def test_a_stream_refused_at_its_first_read_means_relists_only() -> None:
    """CRI's UNIMPLEMENTED (containerd 1.6) arrives with the stream's first answer."""
    clock = FakeClock()
    rt = FakeRuntime(clock)

    async def refused() -> AsyncIterator[ContainerEvent]:
        raise Unsupported("cri GetContainerEvents: UNIMPLEMENTED")
        yield  # an async generator

    async def container_events() -> AsyncIterator[ContainerEvent]:
        rt.calls["container_events"] += 1
        return refused()

    rt.container_events = container_events  # type: ignore[method-assign]
    pleg = Pleg(rt, clock, CONFIG, registry=CollectorRegistry())
    pleg.start()
    await settle()
    await clock.advance(5)
    assert not pleg.evented and pleg.period == 1.0
    assert rt.calls["relist"] == 7 and rt.calls["container_events"] == 1  # 0 (twice: the
    # stream looked up for a moment), 1, ..., 5
    await pleg.stop()


def test_the_long_period_is_a_setting(tmp_path: Path) -> None:
    rig = AgentRig(tmp_path, "--evented-pleg-relist-period", "5m")
    assert rig.pods.loops.pleg.evented_relist_period == 300.0
    assert AgentRig(tmp_path).pods.loops.pleg.evented_relist_period == 60.0
    (tmp_path / "agent.yaml").write_text("eventedPlegRelistPeriod: 2m\n")
    cfg = agent_config(tmp_path, "--node-name", "n1", "--config", str(tmp_path / "agent.yaml"))
    assert cfg.evented_pleg_relist_period == 120.0
    with pytest.raises(ConfigError, match="--evented-pleg-relist-period"):
        agent_config(tmp_path, "--node-name", "n1", "--evented-pleg-relist-period", "0s")


@aio
async def test_a_removed_pods_late_events_leave_no_cache_entry() -> None:
    clock = FakeClock()
    a = await started(clock)
    pods = [mkpod(f"web-{i}", f"u{i}") for i in range(3)]
    a.send(Op.ADD, *pods)
    await a.run_for(3)
    assert a.loops.pleg.cache.uids() == {"u0", "u1", "u2"}
    a.send(Op.REMOVE, *pods[:2])
    await a.run_for(3)
    assert not a.rt.find("u0", "c") and not a.rt.find("u1", "c")
    assert a.loops.pleg.cache.uids() == {"u2"}
    await a.loops.stop()


@aio
async def test_idle_pods_cost_a_relist_a_minute_and_a_read_per_resync() -> None:
    """What the evented PLEG saves: with relists only, 50 idle pods cost 120 relists in
    two minutes (each copying every record); with events, two, plus one read of each pod
    at its 60 s resync."""
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, *(mkpod(f"p{i}", f"u{i}") for i in range(50)))
    await a.run_for(5)
    assert len(a.rt.running()) == 50
    before = dict(a.rt.calls)
    syncs = [a.loop.workers.syncs(f"u{i}") for i in range(50)]
    await a.run_for(120)
    spent = {k: v - before.get(k, 0) for k, v in a.rt.calls.items() if v != before.get(k, 0)}
    assert spent["relist"] == 2
    # each resync reads the pod unless a relist since its last sync already has
    assert spent.get("pod_status", 0) <= 2 * 50
    assert set(spent) <= {"relist", "pod_status"}
    assert all(a.loop.workers.syncs(f"u{i}") - syncs[i] >= 1 for i in range(50))
    await a.loops.stop()


@aio
async def test_a_running_container_removed_also_died() -> None:
    """As the relist's diff names it: the worker syncs on the death (a removal alone is
    the agent's own doing and syncs nothing)."""
    clock = FakeClock()
    rt = FakeRuntime(clock)
    (cid,) = await start_pod(rt, "a")
    pleg = await evented(clock, rt)
    await rt.remove_container(cid)
    await settle()
    assert drain(pleg.events) == [PodLifecycleEvent("a", EventType.CONTAINER_DIED, cid),
                                  PodLifecycleEvent("a", EventType.CONTAINER_REMOVED, cid)]
    await pleg.stop()
