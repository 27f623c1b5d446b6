"""In-place pod resize through the pod loop, on the fake runtime and FakeClock: a resize
sent as the API delivers it (an UPDATE of the pod's resources), what the node
allocates, what the runtime is given, the pod cgroup, the status (container
resources, allocatedResources, the resize conditions) and the kubelet's Events."""

from __future__ import annotations

import copy
from typing import Any

from nodeagent.api.clock import FakeClock
from nodeagent.api.kube import PODS
from nodeagent.pods.admission import AdmissionSettings
from nodeagent.pods.podupdate import Op, Pod
from nodeagent.pods.settings import NodePodSettings
from nodeagent.runtime.base import Resources, Runtime
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import LoopRig, aio, mkpod, settle

MI = 1024 * 1024


def box(name: str, cpu: str | None = "100m", memory: str | None = "64Mi",
        policy: dict[str, str] | None = None, limits: bool = True) -> dict[str, Any]:
    """A container asking for `cpu` and `memory` (limits equal: Guaranteed, unless
    `limits` is False), with a resizePolicy per resource."""
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    res: dict[str, Any] = {"requests": requests}
    if limits:
        res["limits"] = dict(requests)
    c: dict[str, Any] = {"name": name, "image": "localhost/busybox:1",
                         "command": ["sleep", "3600"], "resources": res}
    if policy:
        c["resizePolicy"] = [{"resourceName": k, "restartPolicy": v}
                             for k, v in policy.items()]
    return c


def resized(pod: Pod, name: str, cpu: str | None = None, memory: str | None = None,
            limits: bool = True) -> Pod:
    """The pod after a resize of one container (generation + 1, as the API server
    counts it)."""
    out = copy.deepcopy(pod)
    out["metadata"]["generation"] = int(pod["metadata"].get("generation") or 1) + 1
    for c in out["spec"]["containers"]:
        if c["name"] == name:
            for kind in ("requests", "limits") if limits else ("requests",):
                if cpu is not None:
                    c["resources"][kind]["cpu"] = cpu
                if memory is not None:
                    c["resources"][kind]["memory"] = memory
    return out


async def rig(clock: FakeClock, rt: FakeRuntime | None = None) -> LoopRig:
    a = LoopRig(rt or FakeRuntime(clock), clock, pod_settings=NodePodSettings(
        admission=AdmissionSettings(kernel=(6, 1), apparmor=False)))
    a.loops.start()
    await settle()
    return a


def conditions(a: LoopRig, name: str) -> dict[str, dict[str, Any]]:
    """Pod `name`'s resize conditions as the API holds them."""
    pod = a.kube.obj(PODS, name, "ns")
    return {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []
            if c["type"].startswith("PodResize")}


@aio
async def test_a_resize_is_applied_in_place_and_reported() -> None:
    clock = FakeClock()
    a = await rig(clock)
    pod = mkpod("p", "u1", containers=[box("c")])
    pod["metadata"]["generation"] = 1
    a.send(Op.ADD, pod)
    await a.run_for(3)
    [c] = a.rt.running("u1")
    cs = a.cstatus("u1")
    assert cs["resources"] == {"limits": {"cpu": "100m", "memory": "64Mi"},
                               "requests": {"cpu": "100m", "memory": "64Mi"}}
    assert cs["allocatedResources"] == {"cpu": "100m", "memory": "64Mi"}
    a.send(Op.UPDATE, resized(pod, "c", cpu="200m", memory="128Mi"))
    await a.run_for(2)
    [same] = a.rt.running("u1")
    assert same.id == c.id and same.restart_count == 0  # not restarted
    assert a.rt.containers[c.id].resources == Resources(200, 200, 128 * MI, 128 * MI)
    cs = a.cstatus("u1")
    assert cs["resources"] == {"limits": {"cpu": "200m", "memory": "128Mi"},
                               "requests": {"cpu": "200m", "memory": "128Mi"}}
    assert cs["allocatedResources"] == {"cpu": "200m", "memory": "128Mi"}
    await a.events.drain()
    assert [m.split(":")[0] for m in a.events_of("ResizeStarted")] == ["Pod resize started"]
    assert a.events_of("ResizeCompleted") == [
        'Pod resize completed: {"containers":[{"name":"c","resources":{"limits":'
        '{"cpu":"200m","memory":"128Mi"},"requests":{"cpu":"200m","memory":"128Mi"}}}],'
        '"generation":2}']
    assert not [c for c in a.status("u1")["conditions"] if c["type"].startswith("PodResize")]
    await a.loops.stop()


def guaranteed(name: str, uid: str, cpu: str, memory: str = "64Mi", **meta: Any) -> Pod:
    pod = mkpod(name, uid, containers=[box("c", cpu, memory)])
    pod["metadata"].update({"generation": 1, **meta})
    return pod


@aio
async def test_a_resize_that_does_not_fit_waits_for_room_and_one_that_never_can_is_infeasible(
        ) -> None:
    clock = FakeClock()
    a = await rig(clock)  # a node of 4 CPUs
    big, small = guaranteed("big", "u1", "2"), guaranteed("small", "u2", "1")
    a.send(Op.ADD, big, small)
    await a.run_for(3)
    [c] = a.rt.running("u2")
    a.send(Op.UPDATE, resized(small, "c", cpu="2500m"))
    await a.run_for(2)
    pending = conditions(a, "small")["PodResizePending"]
    assert (pending["reason"], pending["message"], pending["observedGeneration"]) == (
        "Deferred", "Node didn't have enough resource: cpu, requested: 2500, used: 2000, "
        "capacity: 4000", 2)
    assert a.rt.containers[c.id].resources == Resources(1000, 1000, 64 * MI, 64 * MI)
    # allocated, as the node admitted it, until then
    assert a.cstatus("u2")["allocatedResources"] == {"cpu": "1", "memory": "64Mi"}
    await a.events.drain()
    [msg] = a.events_of("ResizeDeferred")
    assert msg.startswith('Pod resize Deferred: {"containers":[{"name":"c","resources":'
                          '{"limits":{"cpu":"2500m"')
    assert msg.endswith('"generation":2,"error":"Node didn\'t have enough resource: cpu, '
                        'requested: 2500, used: 2000, capacity: 4000"}')
    # the big pod goes: the deferred resize is allocated and carried out
    a.send(Op.REMOVE, big)
    await a.run_for(5)
    assert a.rt.containers[c.id].resources == Resources(2500, 2500, 64 * MI, 64 * MI)
    assert conditions(a, "small") == {}  # deleted from the API's status
    assert a.cstatus("u2")["resources"]["limits"]["cpu"] == "2500m"
    # more than the node has at all: Infeasible, and nothing changes
    pod = resized(resized(small, "c", cpu="2500m"), "c", cpu="5")
    a.send(Op.UPDATE, pod)
    await a.run_for(2)
    pending = conditions(a, "small")["PodResizePending"]
    assert (pending["reason"], pending["message"]) == (
        "Infeasible", "Node didn't have enough capacity: cpu, requested: 5000, capacity: 4000")
    assert a.rt.containers[c.id].resources == Resources(2500, 2500, 64 * MI, 64 * MI)
    await a.events.drain()
    assert len(a.events_of("ResizeInfeasible")) == 1
    # reverted: nothing is pending any more
    a.send(Op.UPDATE, resized(pod, "c", cpu="2500m"))
    await a.run_for(2)
    assert conditions(a, "small") == {}
    assert [c.id for c in a.rt.running("u2")] == [c.id]  # never restarted
    await a.loops.stop()


@aio
async def test_a_resize_whose_policy_says_restart_restarts_the_container() -> None:
    clock = FakeClock()
    a = await rig(clock)
    pod = mkpod("p", "u1", containers=[box("c", policy={"memory": "RestartContainer"})])
    pod["metadata"]["generation"] = 1
    a.send(Op.ADD, pod)
    await a.run_for(3)
    [old] = a.rt.running("u1")
    a.send(Op.UPDATE, resized(pod, "c", cpu="150m"))  # cpu: NotRequired, in place
    await a.run_for(2)
    assert [c.id for c in a.rt.running("u1")] == [old.id]
    a.send(Op.UPDATE, resized(resized(pod, "c", cpu="150m"), "c", memory="96Mi"))
    await a.run_for(3)
    [new] = a.rt.running("u1")
    assert new.id != old.id and new.restart_count == 1
    assert a.rt.configs[new.id].resources == Resources(150, 150, 96 * MI, 96 * MI)
    assert a.cstatus("u1")["restartCount"] == 1
    await a.events.drain()
    assert "Container c resize requires restart" in a.events_of("Killing")
    assert conditions(a, "p") == {}
    await a.loops.stop()


class Unresizable(FakeRuntime):
    """A runtime that cannot change a container's resources in place (the interface's
    own answer)."""

    async def update_container_resources(self, container_id: str, resources: Resources,
                                         oom_score_adj: int | None = None) -> None:
        await Runtime.update_container_resources(self, container_id, resources,
                                                 oom_score_adj)


@aio
async def test_a_runtime_that_cannot_resize_says_so_in_the_condition() -> None:
    """A runtime without in-place updates (the process runtime's refusal is its own
    message): the resize is allocated, PodResizeInProgress says why it is not applied."""
    clock = FakeClock()
    a = await rig(clock, Unresizable(clock))
    pod = mkpod("p", "u1", containers=[box("c", memory=None, limits=False)])
    pod["metadata"]["generation"] = 1
    a.send(Op.ADD, pod)
    await a.run_for(3)
    a.send(Op.UPDATE, resized(pod, "c", cpu="200m", limits=False))
    await a.run_for(2)
    cond = conditions(a, "p")["PodResizeInProgress"]
    assert (cond["reason"], cond["message"]) == (
        "Error", "the fake runtime cannot change a container's resources in place")
    assert a.cstatus("u1")["allocatedResources"] == {"cpu": "200m"}
    assert a.cstatus("u1")["resources"] == {"requests": {"cpu": "100m"}}  # as applied
    await a.loops.stop()
