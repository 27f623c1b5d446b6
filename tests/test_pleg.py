"""PLEG: relist diff, events, cache freshness, a hung pod, health and metrics."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from nodeagent.api.clock import FakeClock, settle
from nodeagent.pods.pleg import (
    EventType,
    Pleg,
    PlegConfig,
    PodCache,
    PodLifecycleEvent,
    clock_timeout,
    diff,
)
from nodeagent.runtime import PodRuntimeStatus, RelistResult
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import aio, drain, start_pod


def test_diff_generates_kubelet_style_events() -> None:
    old = {"a": {"c1": "RUNNING", "c2": "RUNNING", "c3": "EXITED", "c4": "CREATED"}}
    new = {"a": {"c1": "RUNNING", "c2": "EXITED", "c4": "RUNNING", "c5": "CREATED"},
           "b": {"x": "RUNNING"}}
    ev = diff(old, new)
    kinds = {(e.container_id, e.type) for e in ev["a"]}
    assert kinds == {("c2", EventType.CONTAINER_DIED), ("c3", EventType.CONTAINER_REMOVED),
                     ("c4", EventType.CONTAINER_STARTED), ("c5", EventType.CONTAINER_CHANGED)}
    assert [e.type for e in ev["b"]] == [EventType.CONTAINER_STARTED]
    # a running container that vanished died and was removed
    gone = diff({"a": {"c1": "RUNNING"}}, {})
    assert [e.type for e in gone["a"]] == [EventType.CONTAINER_DIED,
                                           EventType.CONTAINER_REMOVED]
    assert diff(new, new) == {}


@aio
async def test_relist_emits_events_and_refreshes_only_changed_pods() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    pleg = Pleg(rt, clock, registry=CollectorRegistry())
    a = await start_pod(rt, "a", 2)
    await start_pod(rt, "b", 1)
    await pleg.relist()
    await settle()
    evs = drain(pleg.events)
    assert {e.pod_uid for e in evs} == {"a", "b"}
    assert all(e.type == EventType.CONTAINER_STARTED for e in evs)
    assert len(evs) == 5  # 2 sandboxes + 3 containers
    assert rt.calls["pod_status"] == 2
    assert len(pleg.cache.get("a").status.containers) == 2

    # nothing changed: one list call, no inspection, no events
    await pleg.relist()
    await settle()
    assert rt.calls["relist"] == 2 and rt.calls["pod_status"] == 2
    assert drain(pleg.events) == []

    rt.exit_container(a[0], 1)
    await pleg.relist()
    await settle()
    assert drain(pleg.events) == [PodLifecycleEvent("a", EventType.CONTAINER_DIED, a[0])]
    assert rt.calls["pod_status"] == 3  # only pod a inspected
    died = [c for c in pleg.cache.get("a").status.containers if c.id == a[0]][0]
    assert died.exit_code == 1

    await rt.remove_container(a[0])
    await pleg.relist()
    await settle()
    assert drain(pleg.events) == [PodLifecycleEvent("a", EventType.CONTAINER_REMOVED, a[0])]


@aio
async def test_without_events_only_relists_set_what_the_next_diff_starts_from() -> None:
    """An inspection's answer may describe a pod otherwise than the list does (or be
    older than the last list): with relists only, it never becomes what the next diff
    compares against, so nothing is reported twice."""
    clock = FakeClock()
    rt = FakeRuntime(clock)
    rt.has_events = False
    pleg = Pleg(rt, clock, registry=CollectorRegistry())
    await start_pod(rt, "a", 1)

    async def nothing_yet(uid: str) -> PodRuntimeStatus:  # an answer older than the list
        return PodRuntimeStatus(uid)
    rt.pod_status = nothing_yet  # type: ignore[method-assign,assignment]
    await pleg.relist()
    await settle()
    assert len(drain(pleg.events)) == 2  # the sandbox and the container started
    for _ in range(3):
        await pleg.relist()
        await settle()
    assert drain(pleg.events) == []


@aio
async def test_one_hung_pod_does_not_stall_others_or_the_period() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    rt.has_events = False  # relists only: their period is what is tested
    pleg = Pleg(rt, clock, PlegConfig(inspect_timeout=10), registry=CollectorRegistry())
    for uid in ("hung", "b", "c"):
        await start_pod(rt, uid)
    rt.hang_pod_status.add("hung")
    pleg.start()
    await settle()
    evs = drain(pleg.events)
    # b and c reported at once; hung's inspection is still waiting
    assert {e.pod_uid for e in evs} == {"b", "c"}
    b_died = rt.running("b")[0].id
    rt.exit_container(b_died, 2)
    for second in range(1, 6):
        await clock.advance(1)
        assert pleg.relists == second + 1  # the relist kept its period
    evs = drain(pleg.events)
    assert PodLifecycleEvent("b", EventType.CONTAINER_DIED, b_died) in evs
    assert pleg.health() is None
    # a worker waiting on the hung pod is released by the inspection timeout, with an error
    waiter = asyncio.create_task(pleg.cache.get_newer_than("hung", 0.0))
    await settle()
    assert not waiter.done()
    await clock.advance(5)
    assert waiter.done() and isinstance(waiter.result().error, TimeoutError)
    # its events are still delivered, and it is inspected again next relist
    evs = drain(pleg.events)
    assert {e.pod_uid for e in evs} == {"hung"}
    # retried at the next relist (still hanging), then the runtime recovers
    rt.hang_pod_status.clear()
    await clock.advance(10)
    assert pleg.cache.get("hung").error is None
    assert len(pleg.cache.get("hung").status.containers) == 1
    await pleg.stop()


@aio
async def test_health_turns_bad_when_relist_hangs_and_metrics_show_it() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    rt.has_events = False  # relists only: the 1 s period and its 180 s threshold
    reg = CollectorRegistry()
    pleg = Pleg(rt, clock, PlegConfig(relist_timeout=30), node="n1", registry=reg)
    pleg.start()
    await settle()
    await clock.advance(3)
    assert pleg.health() is None
    assert reg.get_sample_value("nodepulse_pleg_healthy", {"node": "n1"}) == 1.0
    assert reg.get_sample_value("nodepulse_pleg_relist_interval_seconds_count",
                                {"node": "n1"}) == 3
    assert reg.get_sample_value("nodepulse_pleg_last_seen_seconds", {"node": "n1"}) == \
        clock.now().timestamp()

    never: asyncio.Future[RelistResult] = asyncio.get_running_loop().create_future()

    async def hang() -> RelistResult:
        return await never

    rt.relist = hang  # type: ignore[method-assign]
    await clock.advance(179)
    assert pleg.health() is None
    await clock.advance(5)
    msg = pleg.health()
    assert msg is not None and "PLEG is not healthy" in msg
    assert reg.get_sample_value("nodepulse_pleg_healthy", {"node": "n1"}) == 0.0
    await pleg.stop()


@aio
async def test_full_channel_discards_and_counts() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    reg = CollectorRegistry()
    pleg = Pleg(rt, clock, PlegConfig(channel_capacity=3), node="n", registry=reg)
    for uid in ("a", "b", "c"):
        await start_pod(rt, uid)
    await pleg.relist()
    await settle()
    assert pleg.events.qsize() == 3
    assert reg.get_sample_value("nodepulse_pleg_discarded_events_total", {"node": "n"}) == 3
    assert reg.get_sample_value("nodepulse_pleg_events_total",
                                {"node": "n", "type": "ContainerStarted"}) == 6


@aio
async def test_cache_get_newer_than() -> None:
    cache = PodCache()
    w = asyncio.create_task(cache.get_newer_than("x", 5.0))
    await settle()
    assert not w.done()
    await cache.update_time(4.0)
    await settle()
    assert not w.done()
    cache.mark_pending("x")
    await cache.update_time(6.0)
    await settle()
    assert not w.done()  # a relist saw x change; its inspection is not done yet
    await cache.store("x", PodRuntimeStatus("x"), None, 6.0)
    await settle()
    assert w.done() and w.result().modified == 6.0


@aio
async def test_clock_timeout() -> None:
    clock = FakeClock()
    never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    t = asyncio.create_task(clock_timeout(clock, never, 2, "slow thing"))
    await settle()
    await clock.advance(2)
    assert t.done() and isinstance(t.exception(), TimeoutError)
    assert never.cancelled()

    async def quick() -> int:
        return 7
    assert await clock_timeout(clock, quick(), 2, "x") == 7
    assert clock.sleepers == 0


@aio
async def test_cache_waiters_are_woken_per_pod_and_cancellation_is_clean() -> None:
    cache = PodCache()
    await cache.update_time(1.0)
    a = asyncio.create_task(cache.get_newer_than("a", 1.0))
    b1 = asyncio.create_task(cache.get_newer_than("b", 1.0))
    b2 = asyncio.create_task(cache.get_newer_than("b", 1.0))
    await settle()
    b1.cancel()
    await settle()
    assert len(cache._waiters["b"]) == 1  # the cancelled waiter is gone at once
    await cache.store("a", PodRuntimeStatus("a"), None, 2.0)
    await settle()
    assert a.done() and not b2.done()  # only pod a's waiter woke
    await cache.update_time(2.0)  # a relist that found b unchanged
    await settle()
    assert b2.done() and b1.cancelled()
    assert cache._waiters == {}
