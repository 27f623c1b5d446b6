"""Pod status computation and the manager that patches only on change."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import PODS
from nodeagent.pods.podstatus import Ending, StatusManager, Waiting, compute_pod_status, owned
from nodeagent.pods.resize import ResizeCondition
from nodeagent.runtime import (
    Container,
    ContainerState,
    PodRuntimeStatus,
    Sandbox,
    SandboxState,
)
from nodeagent.runtime.base import Resources
from tests.conftest import aio, mkpod, pod_deletes, status_patches
from tests.fakekube import FakeKube, api_error

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def web(policy: str = "Always", init: bool = False, **spec: Any) -> dict:
    """Pod "web" (uid u1) with containers a and b, and with `init` an init container i."""
    if init:
        spec["initContainers"] = [{"name": "i", "image": "img:i"}]
    return mkpod("web", "u1", policy=policy, node=None, phase=None, containers=[
        {"name": "a", "image": "img:a"}, {"name": "b", "image": "img:b"}], **spec)


def ctr(name: str, state: ContainerState, attempt: int = 0, code: int | None = None,
        cid: str = "") -> Container:
    return Container(id=cid or f"{name}{attempt}", sandbox_id="s1", pod_uid="u1", name=name,
                     image=f"img:{name}", state=state, attempt=attempt,
                     restart_count=attempt, exit_code=code, created_at=T0, started_at=T0,
                     finished_at=T0 if state == ContainerState.EXITED else None,
                     image_id="sha256:1")


def rs(*containers: Container, ready: bool = True) -> PodRuntimeStatus:
    sb = Sandbox(id="s1", pod_uid="u1", name="web", namespace="ns", attempt=0,
                 state=SandboxState.READY if ready else SandboxState.NOTREADY, ip="10.88.0.5")
    return PodRuntimeStatus("u1", [sb], list(containers))


def status(pod: dict, r: PodRuntimeStatus, **kw: Any) -> dict:
    return compute_pod_status(pod, r, host_ip="192.0.2.1", scheme="containerd", now=T0, **kw)


def cond(st: dict, ctype: str) -> str:
    return next(c["status"] for c in st["conditions"] if c["type"] == ctype)


def test_running_pod() -> None:
    st = status(web(), rs(ctr("a", ContainerState.RUNNING), ctr("b", ContainerState.RUNNING)))
    assert st["phase"] == "Running"
    assert [cond(st, t) for t in ("PodScheduled", "Initialized", "ContainersReady",
                                  "Ready")] == ["True"] * 4
    # reason/message are explicit nulls: a strategic merge patch must clear the old
    # "ContainersNotReady" of a condition that turned True
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert "reason" in ready and ready["reason"] is None and ready["message"] is None
    a = st["containerStatuses"][0]
    assert a["containerID"] == "containerd://a0" and a["ready"] and a["started"]
    assert a["state"] == {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    assert st["podIP"] == "10.88.0.5" and st["hostIP"] == "192.0.2.1"
    assert st["startTime"] == "2026-01-01T00:00:00Z"
    hn = status(web(hostNetwork=True), rs(ctr("a", ContainerState.RUNNING)))
    assert hn["podIP"] == "192.0.2.1"


def test_pending_and_waiting_reasons() -> None:
    st = status(web(), rs(ctr("a", ContainerState.RUNNING)),
                waiting={"b": Waiting("ErrImageNeverPull", "image img:b is not present")})
    assert st["phase"] == "Pending"
    b = st["containerStatuses"][1]
    assert b["state"] == {"waiting": {"reason": "ErrImageNeverPull",
                                      "message": "image img:b is not present"}}
    assert cond(st, "Ready") == "False" and cond(st, "ContainersReady") == "False"
    ready = next(c for c in st["conditions"] if c["type"] == "ContainersReady")
    assert ready["reason"] == "ContainersNotReady" and "[b]" in ready["message"]


def test_crashloop_restart_counts_and_last_state() -> None:
    r = rs(ctr("a", ContainerState.EXITED, attempt=0, code=1, cid="old"),
           ctr("a", ContainerState.EXITED, attempt=1, code=2, cid="new"),
           ctr("b", ContainerState.RUNNING))
    st = status(web(), r, waiting={"a": Waiting("CrashLoopBackOff", "back-off 10s")})
    a = st["containerStatuses"][0]
    assert a["restartCount"] == 1
    assert a["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert a["lastState"]["terminated"]["exitCode"] == 2
    assert a["lastState"]["terminated"]["containerID"] == "containerd://new"
    assert st["phase"] == "Running"  # Always: the container is between restarts
    # restarted: running, lastState is the previous attempt
    r2 = rs(ctr("a", ContainerState.EXITED, attempt=1, code=2, cid="new"),
            ctr("a", ContainerState.RUNNING, attempt=2, cid="newer"),
            ctr("b", ContainerState.RUNNING))
    a2 = status(web(), r2)["containerStatuses"][0]
    assert a2["restartCount"] == 2 and "running" in a2["state"]
    assert a2["lastState"]["terminated"]["exitCode"] == 2


def test_phases_by_restart_policy() -> None:
    ok = rs(ctr("a", ContainerState.EXITED, code=0), ctr("b", ContainerState.EXITED, code=0))
    bad = rs(ctr("a", ContainerState.EXITED, code=0), ctr("b", ContainerState.EXITED, code=3))
    assert status(web("Never"), ok)["phase"] == "Succeeded"
    assert status(web("Never"), bad)["phase"] == "Failed"
    assert status(web("OnFailure"), ok)["phase"] == "Succeeded"
    assert status(web("OnFailure"), bad)["phase"] == "Running"
    assert status(web("Always"), ok)["phase"] == "Running"
    # deleted and stopped: terminal whatever the policy
    assert status(web("Always"), bad, terminal=True)["phase"] == "Failed"
    # a terminal phase never goes back
    assert status(web("Never"), rs(ctr("a", ContainerState.RUNNING)),
                  previous={"phase": "Succeeded"})["phase"] == "Succeeded"
    done = status(web("Never"), ok)
    assert next(c for c in done["conditions"] if c["type"] == "Ready")["reason"] == \
        "PodCompleted"


def test_init_containers() -> None:
    st = status(web(init=True), rs(ctr("i", ContainerState.RUNNING)))
    assert st["phase"] == "Pending" and cond(st, "Initialized") == "False"
    assert st["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
    st = status(web(init=True), rs(ctr("i", ContainerState.EXITED, code=0),
                                     ctr("a", ContainerState.RUNNING),
                                     ctr("b", ContainerState.RUNNING)))
    assert st["phase"] == "Running" and cond(st, "Initialized") == "True"
    assert st["initContainerStatuses"][0]["ready"] is True
    st = status(web("Never", init=True), rs(ctr("i", ContainerState.EXITED, code=1)))
    assert st["phase"] == "Failed"


def test_a_pod_the_node_stopped_is_failed_with_its_reason_and_a_disruption_target(
        ) -> None:
    why = "Pod was terminated in response to imminent node shutdown."
    ending = Ending("Terminated", why, disruption=why)
    exited = rs(ctr("a", ContainerState.EXITED, code=0), ctr("b", ContainerState.EXITED,
                                                             code=0), ready=False)
    for policy in ("Always", "Never"):  # exited 0 on SIGTERM: it did not end by itself
        st = status(web(policy), exited, terminal=True, ending=ending)
        assert (st["phase"], st["reason"], st["message"]) == ("Failed", ending.reason,
                                                              ending.message)
        [target] = [c for c in st["conditions"] if c["type"] == "DisruptionTarget"]
        assert (target["status"], target["reason"], target["message"]) == (
            "True", "TerminationByKubelet", ending.message)
        # written with the final status, never compared (it is not the agent's own)
        assert "DisruptionTarget" not in [c["type"] for c in owned(st)["conditions"]]
    # a pod that had ended stays as it ended
    done = status(web("Never"), exited, terminal=True)
    st = status(web("Never"), exited, terminal=True, ending=ending, previous=done)
    assert st["phase"] == "Succeeded" and st["reason"] is None
    assert "DisruptionTarget" not in [c["type"] for c in st["conditions"]]


def test_transition_times_kept_while_unchanged() -> None:
    r = rs(ctr("a", ContainerState.RUNNING), ctr("b", ContainerState.RUNNING))
    first = status(web(), r)
    later = compute_pod_status(web(), r, host_ip="192.0.2.1", scheme="containerd",
                               now=T0 + dt.timedelta(minutes=5), previous=first)
    assert later == first
    r.containers[1].state = ContainerState.EXITED
    r.containers[1].exit_code = 1
    changed = compute_pod_status(web(), r, host_ip="192.0.2.1", scheme="containerd",
                                 now=T0 + dt.timedelta(minutes=5), previous=first)
    ready = next(c for c in changed["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["lastTransitionTime"] == "2026-01-01T00:05:00Z"
    sched = next(c for c in changed["conditions"] if c["type"] == "PodScheduled")
    assert sched["lastTransitionTime"] == "2026-01-01T00:00:00Z"


def sized(requests: dict[str, str], limits: dict[str, str] | None = None) -> dict:
    pod = web()
    pod["spec"]["containers"][0]["resources"] = {"requests": requests,
                                                 **({"limits": limits} if limits else {})}
    return pod


RESOURCES_CASES = [
    # (requests, limits, what the runtime applied) -> the status' requests and limits
    ({"cpu": "25m", "memory": "20Mi"}, {"cpu": "35m", "memory": "30Mi"},
     Resources(25, 35, 20 * 2**20, 30 * 2**20),
     {"cpu": "25m", "memory": "20Mi"}, {"cpu": "35m", "memory": "30Mi"}),
    # applied is not allocated yet (mid-resize): the runtime's values are reported
    ({"cpu": "1", "memory": "1Gi"}, {"cpu": "2", "memory": "2Gi"},
     Resources(500, 1500, 2**29, 2**30),
     {"cpu": "500m", "memory": "512Mi"}, {"cpu": "1500m", "memory": "1Gi"}),
    # below 2 shares and a 10m quota the cgroups cannot tell: as allocated
    ({"cpu": "1m"}, {"cpu": "5m"}, Resources(2, 10, None, None),
     {"cpu": "1m"}, {"cpu": "5m"}),
    # no limit set: none reported
    ({"cpu": "100m"}, None, Resources(100, None, None, None), {"cpu": "100m"}, None),
]


@pytest.mark.parametrize("requests,limits,applied,want_requests,want_limits",
                         RESOURCES_CASES, ids=["same", "mid-resize", "equivalents", "requests"])
def test_container_resources_are_what_the_runtime_applied(
        requests: dict[str, str], limits: dict[str, str] | None, applied: Resources,
        want_requests: dict[str, str], want_limits: dict[str, str] | None) -> None:
    running = ctr("a", ContainerState.RUNNING)
    st = status(sized(requests, limits), rs(running), applied={running.id: applied})
    a = st["containerStatuses"][0]
    assert a["resources"] == {"requests": want_requests,
                              **({"limits": want_limits} if want_limits else {})}
    assert a["allocatedResources"] == requests
    b = st["containerStatuses"][1]  # no runtime container: neither is reported
    assert "resources" not in b and "allocatedResources" not in b


def test_an_exited_container_reports_what_is_allocated_and_resize_conditions_end_with_the_pod(
        ) -> None:
    pod = sized({"cpu": "200m"})
    gone = ctr("a", ContainerState.EXITED, code=0)
    pending = ResizeCondition("PodResizePending", "Deferred", "no room", 3)
    st = status(pod, rs(gone, ctr("b", ContainerState.RUNNING)),
                applied={gone.id: Resources(100)}, resize=[pending])
    assert st["containerStatuses"][0]["resources"] == {"requests": {"cpu": "200m"}}
    [c] = [c for c in st["conditions"] if c["type"] == "PodResizePending"]
    assert (c["status"], c["reason"], c["message"], c["observedGeneration"]) == (
        "True", "Deferred", "no room", 3)
    later = compute_pod_status(pod, rs(gone, ctr("b", ContainerState.RUNNING)),
                               host_ip="192.0.2.1", scheme="containerd",
                               now=T0 + dt.timedelta(seconds=30), previous=st,
                               resize=[pending])
    [again] = [c for c in later["conditions"] if c["type"] == "PodResizePending"]
    assert again["lastTransitionTime"] == again["lastProbeTime"] == c["lastTransitionTime"]
    done = status(pod, rs(gone, ctr("b", ContainerState.EXITED, code=0)), terminal=True,
                  resize=[pending])
    assert done["phase"] == "Succeeded" and not [
        c for c in done["conditions"] if c["type"].startswith("PodResize")]


def api(*pods: dict) -> FakeKube:
    """The in-memory API holding these pods."""
    kube = FakeKube()
    for p in pods:
        kube.put(PODS, p)
    return kube


@aio
async def test_manager_patches_only_on_change_and_retries() -> None:
    clock = FakeClock()
    pod = web()
    kube = api(pod)
    m = StatusManager(kube, clock, registry=CollectorRegistry())
    r = rs(ctr("a", ContainerState.RUNNING), ctr("b", ContainerState.RUNNING))
    st = status(pod, r)
    m.set_status(pod, st)
    await settle()
    assert len(status_patches(kube)) == 1
    assert kube.obj(PODS, "web", "ns")["status"]["phase"] == "Running"
    m.set_status(pod, status(pod, r, previous=m.previous(pod)))
    await settle()
    assert len(status_patches(kube)) == 1  # same status: no write

    # an API status already equal to ours (agent restart): no write either
    m2 = StatusManager(api(pod), clock, registry=CollectorRegistry())
    m2.set_status({**pod, "status": {**st, "qosClass": "BestEffort"}}, st)
    await settle()
    assert not m2.dirty("u1")

    # a failing API: retried with backoff until it works; latest status wins
    kube.fail("patch pods/status", api_error(503), api_error(503))
    r.containers[0].state = ContainerState.EXITED
    r.containers[0].exit_code = 1
    m.set_status(pod, status(pod, r, previous=m.previous(pod)))
    await settle()
    assert len(status_patches(kube)) == 1 and m.dirty("u1")
    await clock.advance(1)   # 2nd try fails, next in 2 s
    assert len(status_patches(kube)) == 1
    await clock.advance(2)
    patches = status_patches(kube)
    assert len(patches) == 2 and not m.dirty("u1")
    assert patches[-1][1]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 1

    # someone else overwrote the status: RECONCILE makes us write ours again
    m.reconcile({**pod, "status": {"phase": "Unknown"}})
    await settle()
    assert len(status_patches(kube)) == 3


@aio
async def test_the_api_answering_again_ends_a_long_backoff() -> None:
    """After an outage, statuses go as soon as the API server answers again (the pod
    watch reconnects), not at the end of a backoff that grew to a minute meanwhile."""
    clock = FakeClock()
    pod = web()
    kube = api(pod)
    answered = ApiAnswered(clock)
    m = StatusManager(kube, clock, answered=answered, registry=CollectorRegistry())
    kube.fail("patch pods/status", *[api_error(503)] * 7)
    m.set_status(pod, status(pod, rs()))
    await settle()
    await clock.advance(1 + 2 + 4 + 8 + 16 + 32)  # 6 more failed tries; next in 60 s
    assert kube.count("patch pods/status") == 7 and m.dirty("u1")
    assert status_patches(kube) == []
    await clock.advance(30)
    assert status_patches(kube) == []
    answered.fire()
    await settle()
    assert len(status_patches(kube)) == 1 and not m.dirty("u1")
    # a failure after it backs off from the start again
    kube.fail("patch pods/status", api_error(503))
    m.set_status(pod, status(pod, rs(ctr("a", ContainerState.RUNNING))))
    await settle()
    assert len(status_patches(kube)) == 1
    await clock.advance(1)
    assert len(status_patches(kube)) == 2 and not m.dirty("u1")


@aio
async def test_manager_finishes_deletion_and_handles_gone_pods() -> None:
    clock = FakeClock()
    pod = web()
    kube = api(pod)
    m = StatusManager(kube, clock, registry=CollectorRegistry())
    m.set_status(pod, status(pod, rs()))
    m.finish_deletion(pod)
    await settle()
    assert len(status_patches(kube)) == 1 and pod_deletes(kube) == ["u1"]
    assert not kube.has(PODS, "web", "ns")
    delete = kube.calls_of("delete pods")[0].body
    assert delete == {"gracePeriodSeconds": 0, "preconditions": {"uid": "u1"}}
    # 404 on patch: the pod is gone; give up quietly
    kube2 = api()
    m2 = StatusManager(kube2, clock, registry=CollectorRegistry())
    m2.set_status(pod, status(pod, rs()))
    await settle()
    assert not m2.dirty("u1") and status_patches(kube2) == []
    assert kube2.count("patch pods/status") == 1
    # a new pod under the same name: the patch's uid precondition refuses it (409)
    kube3 = api({**web(), "metadata": {"name": "web", "namespace": "ns", "uid": "u2"}})
    m3 = StatusManager(kube3, clock, registry=CollectorRegistry())
    m3.set_status(pod, status(pod, rs()))
    await settle()
    assert not m3.dirty("u1") and status_patches(kube3) == []
    assert "status" not in kube3.obj(PODS, "web", "ns")
    # static pods are not deleted through the API
    static = web()
    static["metadata"]["annotations"] = {"kubernetes.io/config.source": "file"}
    static["metadata"]["uid"] = "static1"
    m.finish_deletion(static)
    await settle()
    assert pod_deletes(kube) == ["u1"]


@aio
async def test_static_pod_status_waits_for_its_mirror_pod() -> None:
    clock = FakeClock()
    kube = api()
    m = StatusManager(kube, clock, registry=CollectorRegistry())
    static = web()
    static["metadata"]["annotations"] = {"kubernetes.io/config.source": "file"}
    m.set_status(static, status(static, rs()))
    await settle()
    assert status_patches(kube) == [] and m.dirty("u1")  # 404: no mirror pod yet
    await clock.advance(1)  # retried at 1 s (404 again)
    assert kube.count("patch pods/status") == 2
    kube.put(PODS, {"metadata": {"name": "web", "namespace": "ns", "uid": "mirror-uid"}})
    await clock.advance(2)  # and at 3 s: the mirror exists now
    assert len(status_patches(kube)) == 1 and not m.dirty("u1")
    assert status_patches(kube)[0][0] == "ns/web"  # no uid precondition: the mirror's own


@aio
async def test_static_pod_status_outlasts_its_mirror_being_replaced() -> None:
    """The mirror manager replaces an outdated mirror pod (delete, create): a status
    write that meets the old one (422) or none (404) is tried again every 2 s at most,
    never dropped as if the static pod were gone."""
    clock = FakeClock()
    kube = api({"metadata": {"name": "web", "namespace": "ns", "uid": "old-mirror"}})
    m = StatusManager(kube, clock, registry=CollectorRegistry())
    static = web()
    static["metadata"]["annotations"] = {"kubernetes.io/config.source": "file"}
    kube.fail("patch pods/status", *[api_error(422)] * 2, *[api_error(404)] * 4)
    m.set_status(static, status(static, rs()))
    await settle()
    await clock.advance(1 + 2 + 2 + 2 + 2)  # five more tries, 2 s apart once grown
    assert kube.count("patch pods/status") == 6 and m.dirty("u1")
    await clock.advance(2)  # the new mirror is there
    assert len(status_patches(kube)) == 1 and not m.dirty("u1")


@aio
async def test_writes_a_strategic_patch_with_a_uid_precondition() -> None:
    pod = web()
    static = web()
    static["metadata"].update(name="kube-x", uid="hash1",
                              annotations={"kubernetes.io/config.source": "file"})
    kube = api(pod, {"metadata": {"name": "kube-x", "namespace": "ns", "uid": "mirror"}})
    m = StatusManager(kube, FakeClock(), registry=CollectorRegistry())
    m.set_status(pod, {"phase": "Running"})
    m.set_status(static, {"phase": "Running"})
    await settle()
    first, second = kube.calls_of("patch pods/status")
    assert first.query["contentType"] == "application/strategic-merge-patch+json"
    assert first.body == {"status": {"phase": "Running"}, "metadata": {"uid": "u1"}}
    assert second.body == {"status": {"phase": "Running"}}  # the mirror has its own uid
    assert first.timeout == second.timeout == 30.0


@aio
async def test_a_new_sandboxs_address_replaces_the_one_in_the_api() -> None:
    """An agent started again on a runtime that lost the pod's sandbox (the fake
    runtime after the agent's SIGKILL, a reboot) gives the pod a new sandbox with a new
    address. Its status patch replaces podIPs: a strategic merge would add the new
    address to the old one, which the API server refuses (one per family), and the pod
    would keep the old status for good (bench.soak: Job pods Running long after their
    containers ended)."""
    clock = FakeClock()
    pod = web()
    pod["status"] = {"phase": "Running", "podIP": "10.88.0.5", "podIPs": [{"ip": "10.88.0.5"}],
                     "hostIP": "192.0.2.9", "hostIPs": [{"ip": "192.0.2.9"}]}
    kube = api(pod)
    m = StatusManager(kube, clock, registry=CollectorRegistry())
    new = rs(ctr("a", ContainerState.RUNNING), ctr("b", ContainerState.RUNNING))
    new.sandboxes[0].ip = "10.88.0.9"
    m.set_status(pod, status(pod, new))
    await settle()
    st = kube.obj(PODS, "web", "ns")["status"]
    assert (st["podIP"], st["podIPs"]) == ("10.88.0.9", [{"ip": "10.88.0.9"}])
    assert (st["hostIP"], st["hostIPs"]) == ("192.0.2.1", [{"ip": "192.0.2.1"}])
    assert not m.dirty("u1")


@aio
async def test_a_status_the_api_refuses_is_tried_again_not_taken_for_a_gone_pod() -> None:
    """422 means the pod was replaced only when the API names metadata.uid (the patch's
    uid precondition); any other refusal is a status the agent must fix or try again,
    with a warning that says what the API server said."""
    clock = FakeClock()
    pod = web()
    kube = api(pod)
    kube.fail("patch pods/status", api_error(
        422, message='Pod "web" is invalid: status.containerStatuses[0].state: Forbidden',
        fields=("status.containerStatuses[0].state",)))
    m = StatusManager(kube, clock, registry=CollectorRegistry())
    m.set_status(pod, status(pod, rs(ctr("a", ContainerState.RUNNING))))
    await settle()
    assert status_patches(kube) == [] and m.dirty("u1")
    await clock.advance(1)
    assert len(status_patches(kube)) == 1 and not m.dirty("u1")
