"""In-place pod resize through the pod loop, on the fake runtime and FakeClock: a resize
sent as the API delivers it (an UPDATE of the pod's resources), what the node
allocates, what the runtime is given, the pod cgroup, the status (container
resources, allocatedResources, the resize conditions) and the kubelet's Events."""

from __future__ import annotations

import copy
from typing import Any

from nodeagent.api.clock import FakeClock
from nodeagent.pods.admission import AdmissionSettings
from nodeagent.pods.podupdate import Op, Pod
from nodeagent.pods.settings import NodePodSettings
from nodeagent.runtime.base import Resources
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


def conditions(a: LoopRig, uid: str) -> dict[str, dict[str, Any]]:
    """The pod's resize conditions as the API holds them."""
    pod = a.kube.get_obj("pods", a.kube_name(uid))
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
