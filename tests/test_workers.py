"""Pod workers (workers.py) and the syncer (syncer.py) in isolation: back-off
arithmetic, pull policy defaults, latest-wins, kill during a sync, init container order."""

from __future__ import annotations

import asyncio
import math

from prometheus_client import CollectorRegistry

from nodeagent.api.clock import FakeClock, settle
from nodeagent.pods.backoff import CrashBackoff
from nodeagent.pods.decide import grace_of
from nodeagent.pods.images import pull_policy
from nodeagent.pods.pleg import CacheEntry, PodCache
from nodeagent.pods.podupdate import Op
from nodeagent.pods.syncer import SyncResult
from nodeagent.pods.workers import Phase, PodWorkers, UpdateKind
from nodeagent.runtime import PodRuntimeStatus
from nodeagent.runtime.base import Sandbox, SandboxState
from tests.conftest import aio, mkpod, started


def test_crash_backoff_doubles_caps_and_resets() -> None:
    clock = FakeClock()
    b = CrashBackoff(clock)
    key = ("u", "c", "spec-hash")
    assert b.remaining(key) == 0  # first restart: at once
    delays = []
    for _ in range(8):
        b.restarted(key)
        delays.append(b.remaining(key))
        clock._t += b.remaining(key)  # wait it out, then crash again at once
    assert delays == [10, 20, 40, 80, 160, 300, 300, 300]
    clock._t += 600  # ran 10 minutes since the last restart
    assert b.remaining(key) == 0
    b.restarted(key)
    assert b.remaining(key) == 10
    b.forget("u")
    assert b.remaining(key) == 0


def test_crash_backoff_says_which_of_a_pods_containers_still_wait() -> None:
    clock = FakeClock()
    b = CrashBackoff(clock)
    b.restarted(("u", "a", "h1"))
    b.restarted(("u", "b", "h2"))
    b.restarted(("other", "a", "h1"))
    clock._t += 5
    assert b.waiting("u") == {("u", "a", "h1"): (5.0, 10.0), ("u", "b", "h2"): (5.0, 10.0)}
    clock._t += 5  # their back-off is over: nothing waits
    assert b.waiting("u") == {} and b.waiting("nobody") == {}


def test_pull_policy_defaults_and_grace() -> None:
    assert pull_policy({"image": "busybox"}) == "Always"
    assert pull_policy({"image": "localhost:5000/busybox:latest"}) == "Always"
    assert pull_policy({"image": "localhost:5000/busybox:1"}) == "IfNotPresent"
    assert pull_policy({"image": "x@sha256:abc"}) == "IfNotPresent"
    assert pull_policy({"image": "x:1", "imagePullPolicy": "Never"}) == "Never"
    p = mkpod("a", "u", terminationGracePeriodSeconds=7)
    assert grace_of(p) == 7
    p["metadata"]["deletionGracePeriodSeconds"] = 3
    assert grace_of(p) == 3 and grace_of(p, 1) == 1
    assert grace_of({"metadata": {}}) == 30


class SlowSyncer:
    """Counts syncs; each sync blocks until the test releases it."""

    def __init__(self) -> None:
        self.synced: list[dict] = []
        self.gate = asyncio.Event()
        self.terminated: list[float] = []

    async def sync_pod(self, pod: dict, entry: CacheEntry) -> SyncResult:
        self.synced.append(pod)
        await self.gate.wait()
        return SyncResult()

    async def terminate_pod(self, pod: dict, grace: float) -> None:
        self.terminated.append(grace)

    def sync_terminated(self, pod: dict, entry: CacheEntry) -> None:
        pass

    async def drain(self, timeout: float) -> int:
        return 0

    async def cleanup_pod(self, uid: str) -> None:
        pass


async def workers_with(syncer: SlowSyncer) -> tuple[PodWorkers, PodCache, FakeClock]:
    clock = FakeClock()
    cache = PodCache()
    await cache.update_time(0.0)
    w = PodWorkers(syncer, cache, clock, registry=CollectorRegistry())  # type: ignore[arg-type]
    return w, cache, clock


@aio
async def test_latest_update_wins_burst_of_100() -> None:
    syncer = SlowSyncer()
    w, cache, clock = await workers_with(syncer)
    base = mkpod("web", "u1")
    clock._t = 1.0
    await cache.update_time(1.0)
    for i in range(100):
        w.update({**base, "metadata": {**base["metadata"], "labels": {"v": str(i)}}})
        await asyncio.sleep(0)
    await settle()
    assert len(syncer.synced) == 1  # the first sync is running; 99 updates wait as one
    syncer.gate.set()
    await settle()
    clock._t = 2.0
    await cache.update_time(2.0)  # a relist after the first sync
    await settle()
    assert len(syncer.synced) == 2
    assert syncer.synced[-1]["metadata"]["labels"] == {"v": "99"}


@aio
async def test_kill_during_sync_terminates_after_it_with_the_delete_grace() -> None:
    syncer = SlowSyncer()
    w, cache, clock = await workers_with(syncer)
    clock._t = 1.0
    await cache.update_time(1.0)
    pod = mkpod("web", "u1", terminationGracePeriodSeconds=30)
    w.update(pod)
    await settle()
    w.update(pod, UpdateKind.KILL, grace=5)
    await settle()
    assert w.phase("u1") == Phase.SYNCING and syncer.terminated == []
    syncer.gate.set()
    for t in (2.0, 3.0, 4.0):
        clock._t = t
        await cache.update_time(t)
        await settle()
    assert syncer.terminated == [5]
    assert w.phase("u1") == Phase.TERMINATED
    w.update(pod, UpdateKind.REMOVE)
    clock._t = 5.0
    await cache.update_time(5.0)
    await settle()
    assert "u1" not in w


@aio
async def test_kill_starts_without_waiting_for_a_relist() -> None:
    """The grace period starts at the delete, not at the next relist: a container that
    ignores SIGTERM is killed `grace` seconds after the delete arrived."""
    syncer = SlowSyncer()
    syncer.gate.set()
    w, cache, clock = await workers_with(syncer)
    clock._t = 1.0
    await cache.update_time(1.0)
    pod = mkpod("web", "u1")
    w.update(pod)
    await settle()
    assert len(syncer.synced) == 1
    clock._t = 1.5  # no relist since the sync
    w.update(pod)   # a status-only change: this sync waits for the next relist...
    await settle()
    assert len(syncer.synced) == 1
    w.update(pod, UpdateKind.KILL, grace=3)  # ...a kill does not
    await settle()
    assert syncer.terminated == [3] and len(syncer.synced) == 1
    assert w.phase("u1") == Phase.TERMINATED
    # the final status still waits for a relist that saw the stop
    w.update(pod, UpdateKind.REMOVE)
    await settle()
    assert "u1" in w
    clock._t = 2.0
    await cache.update_time(2.0)
    await settle()
    assert "u1" not in w


def running_sandbox(uid: str) -> PodRuntimeStatus:
    return PodRuntimeStatus(uid, sandboxes=[Sandbox("s1", uid, "web", "ns", 0,
                                                    SandboxState.READY)])


@aio
async def test_a_sync_never_takes_what_the_last_one_acted_on_as_newer() -> None:
    """The PLEG stamps a read it makes for a waiting worker just after that worker's
    last sync. On a clock that has not moved since (a FakeClock; a burst of inline
    calls), the clock at the end of the next step is below that stamp: the step after
    must still wait for a read made after it, not act on what the step before read
    (a Job's sidecar, seen running once more after its kill, made the pod Failed)."""
    syncer = SlowSyncer()
    syncer.gate.set()
    w, cache, clock = await workers_with(syncer)
    clock._t = 1.0
    read = math.nextafter(1.0, math.inf)
    await cache.store("u1", running_sandbox("u1"), None, read)
    pod = mkpod("web", "u1")
    w.update(pod)
    await settle()
    assert len(syncer.synced) == 1
    w.update(pod)  # the clock still reads 1.0, below the read the last sync acted on
    await settle()
    assert len(syncer.synced) == 1
    await cache.store("u1", running_sandbox("u1"), None, math.nextafter(read, math.inf))
    await settle()
    assert len(syncer.synced) == 2


@aio
async def test_init_containers_run_in_order_before_containers() -> None:
    clock = FakeClock()
    a = await started(clock)
    pod = mkpod("web", "u1")
    pod["spec"]["initContainers"] = [{"name": "i1", "image": "localhost/busybox:1"},
                                     {"name": "i2", "image": "localhost/busybox:1"}]
    a.send(Op.ADD, pod)
    await a.run_for(3)
    names = [c.name for c in a.rt.running("u1")]
    assert names == ["i1"]
    st = a.status("u1")
    assert st["phase"] == "Pending"
    assert st["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
    a.rt.exit_container(a.rt.running("u1")[0].id, 0)
    await a.run_for(3)
    assert [c.name for c in a.rt.running("u1")] == ["i2"]
    a.rt.exit_container(a.rt.running("u1")[0].id, 0)
    await a.run_for(3)
    assert [c.name for c in a.rt.running("u1")] == ["c"]
    await a.run_for(2)
    st = a.status("u1")
    assert st["phase"] == "Running"
    assert {c["type"]: c["status"] for c in st["conditions"]}["Initialized"] == "True"
    assert [s["state"]["terminated"]["exitCode"] for s in st["initContainerStatuses"]] == [0, 0]
    await a.loops.stop()


@aio
async def test_failed_init_container_with_never_fails_the_pod() -> None:
    clock = FakeClock()
    a = await started(clock)
    pod = mkpod("job", "u1", policy="Never")
    pod["spec"]["initContainers"] = [{"name": "i1", "image": "localhost/busybox:1"}]
    a.send(Op.ADD, pod)
    await a.run_for(3)
    a.rt.exit_container(a.rt.running("u1")[0].id, 3)
    await a.run_for(4)
    assert a.status("u1")["phase"] == "Failed"
    assert a.rt.find("u1", "c") == []  # the main container never ran
    await a.loops.stop()


def test_cache_entry_for_unknown_pod_is_empty() -> None:
    cache = PodCache()
    e = cache.get("nope")
    assert e.status == PodRuntimeStatus("nope") and e.error is None
