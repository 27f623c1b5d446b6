"""The eviction manager (nodeagent.pods.eviction): thresholds, the ranking tables, the
kubelet's message and admission under pressure as pure functions; then the manager
itself on the fake runtime and FakeClock, its signals scripted by the test: conditions
with the transition period, grace periods, minimum reclaim, node-level reclaim before
any pod is evicted, one pod a round, and the evicted pod's end (Failed, Evicted,
DisruptionTarget, its Event, its containers and volumes removed)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent import host_signals
from nodeagent.api.clock import FakeClock
from nodeagent.api.kube import PODS
from nodeagent.api.quantity import QuantityError
from nodeagent.node.host import FsUsage
from nodeagent.pods.eviction import (
    Candidate,
    ContainerUsage,
    EvictionManager,
    EvictionSettings,
    HostSignals,
    PodFiles,
    PodUsage,
    Reading,
    eviction_message,
    format_amount,
    measure_files,
    pod_request,
    pressure_refusal,
    rank,
    thresholds_met,
)
from nodeagent.pods.gc import GarbageCollector, GcSettings
from nodeagent.pods.podupdate import ANN_CONFIG_SOURCE, Op, Pod
from nodeagent.pods.thresholds import (
    IMAGEFS,
    IMAGEFS_INODES,
    MEMORY,
    NODEFS,
    NODEFS_INODES,
    PIDS,
    Amount,
    Threshold,
    combine,
    parse_minimum_reclaims,
    parse_thresholds,
)
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import READINGS, AgentRig, LoopRig, agent_config, aio, mkpod

MI, GI = 2**20, 2**30


# --- thresholds ------------------------------------------------------------------------

def test_thresholds_in_both_forms_as_the_kubelet_reads_them() -> None:
    t = parse_thresholds("memory.available<100Mi, nodefs.available<10%")
    assert t[MEMORY].of(GI) == 100 * MI and t[NODEFS].of(200) == 20
    assert parse_thresholds({"pid.available": "5%"})[PIDS].percent == 5
    assert parse_thresholds("imagefs.inodesFree<5%,nodefs.available<0%,"
                            "imagefs.available<100%") == {IMAGEFS_INODES: Amount(percent=5)}
    for bad, words in [("memory.available>1Gi", "signal<amount"),
                       ("cpu.available<1", "unknown signal"),
                       ("memory.available<lots", "not a quantity"),
                       ("memory.available<0", "more than zero"),
                       ("nodefs.available<120%", "0-100%")]:
        with pytest.raises(QuantityError, match=words):
            parse_thresholds(bad)


def test_soft_thresholds_need_their_grace_period_and_take_minimum_reclaims() -> None:
    hard = parse_thresholds("memory.available<100Mi")
    soft = parse_thresholds("memory.available<1Gi,nodefs.available<15%")
    reclaim = parse_minimum_reclaims("memory.available=200Mi,nodefs.available=5%")
    with pytest.raises(QuantityError, match="grace period must be specified for the soft "
                                            "eviction threshold nodefs.available"):
        combine(hard, soft, {MEMORY: 60.0}, reclaim)
    ts = combine(hard, soft, {MEMORY: 60.0, NODEFS: 0.0}, reclaim)
    assert [(t.text(), t.grace_period, t.hard) for t in ts] == [
        ("memory.available<100Mi", 0.0, True), ("memory.available<1Gi", 60.0, False),
        ("nodefs.available<15%", 0.0, True)]  # a soft one without grace acts at once
    assert ts[0].min_reclaim == Amount(value=200 * MI)


def test_a_threshold_met_stays_met_until_its_minimum_reclaim_is_free() -> None:
    t = Threshold(MEMORY, Amount(value=100 * MI), min_reclaim=Amount(value=50 * MI))
    obs = {MEMORY: (120 * MI, GI)}
    assert thresholds_met([t], obs) == []
    assert thresholds_met([t], obs, min_reclaim=True) == [t]
    assert thresholds_met([t], {MEMORY: (151 * MI, GI)}, min_reclaim=True) == []
    assert thresholds_met([t], {}) == []  # not observed: not met


# --- ranking ---------------------------------------------------------------------------

def pod(name: str, *, prio: int | None = None, mem_request: str | None = None,
        disk_request: str | None = None, static: bool = False,
        containers: tuple[str, ...] = ("c",), **spec: Any) -> Pod:
    req = {k: v for k, v in (("memory", mem_request), ("ephemeral-storage", disk_request))
           if v is not None}
    p = mkpod(name, containers=[{"name": c, "image": "localhost/busybox:1",
                                 "resources": {"requests": req}} for c in containers], **spec)
    if prio is not None:
        p["spec"]["priority"] = prio
    if static:
        p["metadata"]["annotations"] = {ANN_CONFIG_SOURCE: "file"}
    return p


def mem(**by_container: float) -> PodUsage:
    return PodUsage({c: ContainerUsage(memory=v) for c, v in by_container.items()})


def names(ranked: list[Candidate]) -> list[str]:
    return [str(c.pod["metadata"]["name"]) for c in ranked]


def test_memory_ranking_over_request_then_priority_then_usage_above_request() -> None:
    cands = [
        Candidate(pod("within", mem_request="1Gi"), mem(c=512 * MI)),
        Candidate(pod("over-hi-prio", prio=1000, mem_request="100Mi"), mem(c=900 * MI)),
        Candidate(pod("over-small", mem_request="100Mi"), mem(c=200 * MI)),
        Candidate(pod("over-big"), mem(c=300 * MI)),
        Candidate(pod("unmeasured", prio=5000), None),
    ]
    assert names(rank(MEMORY, cands)) == ["unmeasured", "over-big", "over-small",
                                          "over-hi-prio", "within"]


def test_disk_ranking_counts_what_the_signal_holds() -> None:
    a = Candidate(pod("layers"), PodUsage({"c": ContainerUsage(rootfs=5 * GI)}))
    b = Candidate(pod("logs-and-volumes"), PodUsage({"c": ContainerUsage(logs=GI)},
                                                    volumes=2 * GI))
    c = Candidate(pod("requested", disk_request="10Gi"),
                  PodUsage({"c": ContainerUsage(rootfs=6 * GI)}))
    # one filesystem: everything counts
    assert names(rank(NODEFS, [c, b, a])) == ["layers", "logs-and-volumes", "requested"]
    # images on their own filesystem: nodefs holds logs and volumes, imagefs the layers
    assert names(rank(NODEFS, [a, b], dedicated=True)) == ["logs-and-volumes", "layers"]
    assert names(rank(IMAGEFS, [b, a], dedicated=True)) == ["layers", "logs-and-volumes"]
    inodes = [Candidate(pod("few"), PodUsage(volumes_inodes=10)),
              Candidate(pod("many"), PodUsage(volumes_inodes=10_000))]
    assert names(rank(NODEFS_INODES, inodes)) == ["many", "few"]


def test_pid_ranking_priority_first_then_processes() -> None:
    cands = [Candidate(pod("busy", prio=10), PodUsage(processes=500)),
             Candidate(pod("quiet"), PodUsage(processes=2)),
             Candidate(pod("crowd"), PodUsage(processes=90))]
    assert names(rank(PIDS, cands)) == ["crowd", "quiet", "busy"]


def test_a_pods_request_counts_init_containers_sidecars_and_overhead() -> None:
    p = pod("p", mem_request="100Mi", containers=("a", "b"))
    assert pod_request(p, "memory") == 200 * MI
    p["spec"]["initContainers"] = [
        {"name": "side", "restartPolicy": "Always", "resources": {"requests": {"memory": "50Mi"}}},
        {"name": "big", "resources": {"requests": {"memory": "1Gi"}}}]
    assert pod_request(p, "memory") == GI + 50 * MI  # the init step outweighs the rest
    p["spec"]["initContainers"][1]["resources"]["requests"]["memory"] = "10Mi"
    p["spec"]["overhead"] = {"memory": "5Mi"}
    assert pod_request(p, "memory") == 250 * MI + 5 * MI


# --- the message and admission -----------------------------------------------------------

def test_the_message_is_the_kubelets() -> None:
    hog = pod("hog", containers=("hog", "side"), mem_request="64Mi")
    t = Threshold(MEMORY, Amount(value=100 * MI))
    msg = eviction_message(MEMORY, hog, mem(hog=300 * MI, side=10 * MI), [t],
                           {MEMORY: (50 * MI, GI)})
    assert msg == ("The node was low on resource: memory. Threshold quantity: 100Mi, "
                   "available: 50Mi. Container hog was using 300Mi, request is 64Mi, has "
                   "larger consumption of memory. ")
    disk = Threshold(NODEFS, Amount(percent=10))
    msg = eviction_message(NODEFS, pod("w"), PodUsage({"c": ContainerUsage(rootfs=GI,
                                                                           logs=GI)}),
                           [disk], {NODEFS: (1000 * 1024, 100 * GI)})
    assert msg == ("The node was low on resource: ephemeral-storage. Threshold quantity: "
                   "10Gi, available: 1000Ki. Container c was using 2Gi, request is 0, has "
                   "larger consumption of ephemeral-storage. ")
    assert eviction_message(PIDS, pod("w"), None, [Threshold(PIDS, Amount(value=5000))],
                            {PIDS: (1234, 32768)}) == (
        "The node was low on resource: pids. Threshold quantity: 5k, available: 1234. ")
    assert format_amount(NODEFS, 0) == "0" and format_amount(NODEFS_INODES, 3_000_000) == "3M"


@pytest.mark.parametrize("conditions, the_pod, refused", [
    ((), pod("any"), None),
    (("DiskPressure",), pod("any", mem_request="1Mi"),
     "The node had condition: [DiskPressure]. "),
    (("MemoryPressure",), pod("burstable", mem_request="1Mi"), None),
    (("MemoryPressure",), pod("best-effort"), "The node had condition: [MemoryPressure]. "),
    (("MemoryPressure",), pod("tolerant", tolerations=[
        {"key": "node.kubernetes.io/memory-pressure", "operator": "Exists",
         "effect": "NoSchedule"}]), None),
    (("MemoryPressure", "PIDPressure"), pod("burstable", mem_request="1Mi"),
     "The node had condition: [MemoryPressure PIDPressure]. "),
    (("DiskPressure",), pod("critical", prio=2_000_000_000), None),
    (("DiskPressure",), pod("static", static=True), None),
])
def test_admission_under_pressure(conditions: tuple[str, ...], the_pod: Pod,
                                  refused: str | None) -> None:
    assert pressure_refusal(the_pod, conditions) == refused


def test_files_are_measured_on_their_own_filesystem(tmp_path: Path) -> None:
    logs, vols = tmp_path / "logs", tmp_path / "vols"
    (logs / "c").mkdir(parents=True)
    (logs / "c" / "0.log").write_bytes(b"x" * 10_000)
    (vols / "empty-dir" / "data").mkdir(parents=True)
    (vols / "empty-dir" / "data" / "f").write_bytes(b"y" * 100_000)
    by_container, (vbytes, vinodes) = measure_files(PodFiles(str(logs), str(vols)), ["c", "d"])
    assert by_container["c"][0] >= 10_000 and by_container["c"][1] == 1
    assert by_container["d"] == (0.0, 0.0)
    assert vbytes >= 100_000 and vinodes == 3


# --- the manager -----------------------------------------------------------------------

class Host:
    """Scripted signals: what the host says this round."""

    def __init__(self) -> None:
        self.readings: dict[str, Reading] = {
            MEMORY: Reading(8 * GI, 4 * GI), NODEFS: Reading(100 * GI, 50 * GI),
            NODEFS_INODES: Reading(10**6, 9 * 10**5), PIDS: Reading(32768, 32000)}
        self.dedicated = False
        self.reads = 0

    def set(self, signal: str, available: float | None, capacity: float | None = None) -> None:
        r = self.readings[signal]
        self.readings[signal] = Reading(capacity or r.capacity, available)

    async def read(self) -> HostSignals:
        self.reads += 1
        readings = dict(self.readings)
        if not self.dedicated:
            readings[IMAGEFS], readings[IMAGEFS_INODES] = readings[NODEFS], \
                readings[NODEFS_INODES]
        return HostSignals(readings, self.dedicated)


class Rig:
    """Sync loops on the fake runtime, an eviction manager and a garbage collector on
    them, as the composition root wires them."""

    def __init__(self, thresholds: str = "memory.available<100Mi,nodefs.available<10%",
                 nodes: tuple[str, ...] = ("n1",), images: tuple[str, ...] = (),
                 **settings: Any) -> None:
        """`images`: what the runtime's store holds (none given: every image)."""
        self.clock = FakeClock()
        self.host = Host()
        rt = FakeRuntime(self.clock, images=images or None)
        self.manager = EvictionManager(
            EvictionSettings(thresholds=combine(parse_thresholds(thresholds)), **settings),
            self.clock, self.host.read, rt.container_stats)
        self.loops = LoopRig(rt, self.clock, nodes=nodes, pressure=self.manager.conditions,
                             first_loop=len(nodes) == 1)
        self.rt = rt
        self.gc = GarbageCollector(rt, self.clock, GcSettings(image_min_age=0),
                                   pods=self.loops.loops, events=self.loops.events)
        self.manager.pods = self.loops.loops
        self.manager.reclaimer = self.gc
        self.manager.events = self.loops.events
        self.loops.loops.start()

    async def run(self, *pods: Pod, seconds: float = 3) -> None:
        if pods:
            self.loops.send(Op.ADD, *pods)
        await self.loops.run_for(seconds)

    async def sync(self) -> None:
        """A round, and the Events it wrote."""
        await self.manager.synchronize()
        await self.loops.events.drain()

    async def round(self, seconds: float = 10) -> None:
        """Time passes, then a round."""
        await self.loops.run_for(seconds)
        await self.sync()

    def condition(self, ctype: str, node: str = "n1") -> bool:
        return ctype in self.manager.conditions(node)

    def evicted(self) -> list[str]:
        return [str(c.body["involvedObject"]["name"]) for c in
                self.loops.kube.calls_of("create events")
                if c.body and c.body["reason"] == "Evicted"]

    async def stop(self) -> None:
        await self.loops.loops.stop()


def hog(name: str, memory: str, **kw: Any) -> Pod:
    p = pod(name, **kw)
    p["metadata"]["annotations"] = {**p["metadata"].get("annotations", {}),
                                    "fake.nodepulse.dev/memory": memory}
    return p


@aio
async def test_hard_memory_threshold_evicts_the_hog_and_nothing_else() -> None:
    r = Rig()
    await r.run(hog("quiet", "10Mi"), hog("big", "300Mi"), hog("vip", "600Mi", prio=1000),
                hog("static", "1Gi", static=True))
    await r.sync()
    assert not r.condition("MemoryPressure") and r.evicted() == []

    r.host.set(MEMORY, 50 * MI)  # the host runs short
    await r.round(1)
    assert r.condition("MemoryPressure")
    assert r.evicted() == ["big"]  # over its request of none, lowest priority, biggest
    event = next(c.body for c in r.loops.kube.calls_of("create events")
                 if c.body and c.body["reason"] == "Evicted")
    assert event["type"] == "Warning" and event["message"].startswith(
        "The node was low on resource: memory. Threshold quantity: 100Mi, available: 50Mi. "
        "Container c was using 300Mi, request is 0")
    assert r.loops.events_of("EvictionThresholdMet") == ["Attempting to reclaim memory"]
    await r.round(5)  # stopped within its 1 s grace, removed; still short: the next one
    st = r.loops.status("uid-big")
    assert (st["phase"], st["reason"]) == ("Failed", "Evicted")
    assert st["message"] == event["message"]
    disruption = next(c for c in st["conditions"] if c["type"] == "DisruptionTarget")
    assert (disruption["status"], disruption["reason"]) == ("True", "TerminationByKubelet")
    assert r.rt.find("uid-big", "c") == []  # its containers removed once it stopped
    assert r.evicted() == ["big", "quiet"]  # one a round
    await r.round(5)
    assert r.evicted() == ["big", "quiet", "vip"]  # priority protects only so long
    await r.round(5)
    assert r.evicted() == ["big", "quiet", "vip"]  # a static pod is never evicted
    assert r.rt.running("uid-static")
    await r.stop()


@aio
async def test_one_pod_a_round_and_the_next_only_once_the_last_is_cleaned_up() -> None:
    r = Rig()
    await r.run(hog("a", "300Mi"), hog("b", "200Mi"))
    r.rt.ignore_sigterm.add("c")  # stopping takes the whole grace
    r.host.set(MEMORY, 50 * MI)
    await r.sync()
    assert r.evicted() == ["a"]
    await r.sync()  # a is still stopping: nobody else goes
    assert r.evicted() == ["a"]
    await r.round(5)
    assert r.evicted() == ["a", "b"]
    await r.loops.run_for(3)  # b stops too
    await r.stop()


@aio
async def test_soft_threshold_raises_the_condition_at_once_and_evicts_after_its_grace() -> None:
    r = Rig(thresholds="memory.available<100Mi", max_pod_grace_period=20)
    r.manager.settings = dataclasses.replace(r.manager.settings, thresholds=combine(
        {}, parse_thresholds("memory.available<1Gi"), {MEMORY: 30.0}))
    p = hog("slow", "300Mi", terminationGracePeriodSeconds=60)
    await r.run(p)
    r.rt.ignore_sigterm.add("c")
    r.host.set(MEMORY, 900 * MI)
    await r.sync()
    assert r.condition("MemoryPressure") and r.evicted() == []
    await r.round(20)
    assert r.evicted() == []
    await r.round(10)  # held for 30 s: now
    assert r.evicted() == ["slow"]
    await r.round(15)  # the grace is the most a soft eviction allows (20 s), not 60 s
    assert r.rt.running("uid-slow")
    await r.round(10)
    assert r.loops.status("uid-slow")["reason"] == "Evicted"
    await r.stop()


@aio
async def test_the_condition_holds_for_the_transition_period() -> None:
    r = Rig(pressure_transition_period=30)
    r.host.set(NODEFS, 5 * GI)
    await r.sync()
    assert r.condition("DiskPressure")
    assert r.manager.pressure("n1") == {
        "DiskPressure": "below eviction threshold: nodefs.available<10%"}
    r.host.set(NODEFS, 50 * GI)
    await r.round(20)
    assert r.condition("DiskPressure")
    await r.round(15)
    assert not r.condition("DiskPressure")
    await r.stop()


@aio
async def test_minimum_reclaim_keeps_evicting_past_the_threshold() -> None:
    r = Rig()
    r.manager.settings = dataclasses.replace(r.manager.settings, thresholds=combine(
        parse_thresholds("memory.available<100Mi"), reclaim=parse_minimum_reclaims(
            "memory.available=500Mi")))
    await r.run(hog("a", "300Mi"), hog("b", "200Mi"))
    r.host.set(MEMORY, 50 * MI)
    await r.sync()
    assert r.evicted() == ["a"]
    r.host.set(MEMORY, 300 * MI)  # above the threshold, not above it plus 500Mi
    await r.round(5)
    assert r.evicted() == ["a", "b"] and r.condition("MemoryPressure")
    r.host.set(MEMORY, 700 * MI)
    await r.round(5)
    assert r.evicted() == ["a", "b"]
    await r.stop()


@aio
async def test_disk_pressure_reclaims_dead_containers_and_unused_images_first() -> None:
    r = Rig(images=("localhost/busybox:1", "localhost/old:1", "localhost/pause:1"))
    r.rt.pinned.add("localhost/pause:1")  # the sandbox image
    await r.run(pod("web"), pod("done", policy="Never"))
    r.rt.exit_container(r.rt.running("uid-done")[0].id, 0)
    await r.run(seconds=3)
    assert r.loops.status("uid-done")["phase"] == "Succeeded"
    removed: list[str] = []

    async def remove_image(image_id: str) -> None:  # the disk frees as images go
        removed.append(image_id)
        await FakeRuntime.remove_image(r.rt, image_id)
        r.host.set(NODEFS, 60 * GI)
    r.rt.remove_image = remove_image  # type: ignore[method-assign]
    r.host.set(NODEFS, 5 * GI)
    await r.sync()
    assert r.rt.find("uid-done", "c") == []  # a terminated pod's containers: removed
    assert r.rt.find("uid-web", "c")  # a running one's: never
    # every unused image; not the one a container uses, nor the pinned one
    assert r.rt.images == {"localhost/busybox:1", "localhost/pause:1"} and len(removed) == 1
    assert r.evicted() == []  # that was enough
    assert r.loops.events_of("EvictionThresholdMet") == ["Attempting to reclaim "
                                                          "ephemeral-storage"]
    assert r.loops.status("uid-done")["phase"] == "Succeeded"  # as it ended
    await r.stop()


@aio
async def test_nodefs_pressure_with_a_dedicated_imagefs_reclaims_nothing_but_evicts() -> None:
    r = Rig(images=("localhost/busybox:1", "localhost/old:1"))
    r.host.dedicated = True
    r.host.readings[IMAGEFS] = Reading(100 * GI, 50 * GI)
    r.host.readings[IMAGEFS_INODES] = Reading(10**6, 9 * 10**5)
    await r.run(pod("writer"))
    r.host.set(NODEFS, 5 * GI)
    await r.sync()
    assert "localhost/old:1" in (r.rt.images or set())  # images are not on nodefs
    assert r.evicted() == ["writer"]
    await r.stop()


@aio
async def test_virtual_nodes_count_their_own_pods_and_share_one_reading() -> None:
    nodes = tuple(f"vn-{i}" for i in range(50))
    r = Rig(nodes=nodes)
    r.host.readings[MEMORY] = Reading(GI, None)  # each node: 1Gi less its pods' use
    a, b = hog("a", "950Mi", node="vn-3"), hog("b", "500Mi", node="vn-7")
    await r.run(a, b)
    await r.sync()
    assert r.host.reads == 1  # one reading for every node
    assert r.evicted() == ["a"]
    assert [n for n in nodes if r.condition("MemoryPressure", n)] == ["vn-3"]
    assert set(r.manager.states) == {"vn-3", "vn-7"}  # the nodes without pods share one
    await r.stop()


@aio
async def test_a_new_pod_is_refused_under_pressure_a_running_one_is_not() -> None:
    r = Rig()
    await r.run(pod("running", mem_request="1Mi"))
    r.host.set(NODEFS, 5 * GI)
    r.manager.reclaimer = None
    r.manager.pods = None  # conditions only: nothing evicted here
    await r.sync()
    await r.run(pod("new", mem_request="1Mi"), seconds=3)
    st = r.loops.status("uid-new")
    assert (st["phase"], st["reason"]) == ("Failed", "Evicted")
    assert st["message"] == "Pod was rejected: The node had condition: [DiskPressure]. "
    assert r.loops.status("uid-running")["phase"] == "Running"
    assert r.rt.running("uid-running")
    await r.stop()



# --- the composition root's wiring ---------------------------------------------------------

def test_host_signals_from_one_reading(tmp_path: Path) -> None:
    nodefs = FsUsage(total=10 * GI, available=GI, inodes=100, inodes_free=5, device=1)
    sig = host_signals(READINGS, agent_config(tmp_path), nodefs, None)
    assert sig.readings[MEMORY] == Reading(8 * GI, 4 * GI)
    assert sig.readings[NODEFS] == Reading(100 * GI, 50 * GI)  # the reading's (overrides)
    assert sig.readings[PIDS] == Reading(4_194_304, 4_194_304 - 300)
    assert sig.readings[IMAGEFS] == sig.readings[NODEFS] and not sig.imagefs_dedicated
    elsewhere = FsUsage(total=GI, available=GI // 4, inodes=50, inodes_free=10, device=2)
    sig = host_signals(READINGS, agent_config(tmp_path), nodefs, elsewhere)
    assert sig.imagefs_dedicated and sig.readings[IMAGEFS] == Reading(GI, GI // 4)
    assert sig.readings[IMAGEFS_INODES] == Reading(50, 10)
    same = dataclasses.replace(elsewhere, device=1)
    assert not host_signals(READINGS, agent_config(tmp_path), nodefs, same).imagefs_dedicated
    # memory given in hostOverrides is not the host's: the node's pods count
    told = agent_config(tmp_path, "--host-overrides", "{memoryTotal: 1Gi}")
    assert host_signals(READINGS, told, nodefs, None).readings[MEMORY].available is None
    told = agent_config(tmp_path, "--host-overrides", "{memoryTotal: 1Gi, memoryAvailable: 1Mi}")
    assert host_signals(READINGS, told, nodefs, None).readings[MEMORY].available is not None
    virtual = agent_config(tmp_path, "--virtual-nodes", "3", "--runtime", "fake")
    sig = host_signals(READINGS, virtual, nodefs, elsewhere)
    assert all(r.available is None for r in sig.readings.values())
    assert not sig.imagefs_dedicated


@aio
async def test_the_agent_reports_the_managers_conditions_and_admits_by_them(
        tmp_path: Path) -> None:
    # the fake /proc has 3.8Gi available (no memory cgroup): below the threshold
    rig = AgentRig(tmp_path, "--eviction-hard", "memory.available<5Gi")
    await rig.start()
    await rig.clock.advance(10)
    cond = {c["type"]: c for c in rig.node()["status"]["conditions"]}
    assert cond["MemoryPressure"]["status"] == "True"
    assert cond["MemoryPressure"]["message"] == \
        "below eviction threshold: memory.available<5Gi"
    assert cond["DiskPressure"]["status"] == "False"
    rig.kube.put(PODS, mkpod("best-effort", "u1"))
    rig.kube.put(PODS, mkpod("burstable", "u2", containers=[{
        "name": "c", "image": "localhost/busybox:1",
        "resources": {"requests": {"memory": "1Mi"}}}]))
    await rig.clock.advance(3)
    assert (rig.status("u1")["phase"], rig.status("u1")["reason"]) == ("Failed", "Evicted")
    assert rig.status("u2")["phase"] == "Running"
    await rig.finish()


@aio
async def test_new_gc_thresholds_in_the_config_file_collect_at_once(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("imageMinimumGCAge: 0s\n")
    rig = AgentRig(tmp_path, "--config", str(path))  # its images: busybox and pause, unused
    await rig.start()
    await rig.clock.advance(30)
    assert rig.rt.images == {"localhost/busybox:1", "localhost/pause:1"}  # 50% used
    path.write_text("imageMinimumGCAge: 0s\nimageGCHighThresholdPercent: 40\n"
                    "imageGCLowThresholdPercent: 30\n")
    os.utime(path, (1, 1))
    await rig.clock.advance(10)
    assert rig.rt.images == set()
    await rig.finish()
