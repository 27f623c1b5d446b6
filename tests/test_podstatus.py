"""Pod status computation and the manager that patches only on change."""

from __future__ import annotations

import datetime as dt
from typing import Any

from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

from nodeagent.api.clock import FakeClock, settle
from nodeagent.podstatus import StatusManager, Waiting, compute_pod_status
from nodeagent.runtime import (
    Container,
    ContainerState,
    PodRuntimeStatus,
    Sandbox,
    SandboxState,
)
from tests.test_runtime_fake import aio

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def mkpod(policy: str = "Always", init: bool = False, **spec: Any) -> dict:
    p: dict[str, Any] = {
        "metadata": {"name": "web", "namespace": "ns", "uid": "u1"},
        "spec": {"restartPolicy": policy,
                 "containers": [{"name": "a", "image": "img:a"},
                                {"name": "b", "image": "img:b"}], **spec}}
    if init:
        p["spec"]["initContainers"] = [{"name": "i", "image": "img:i"}]
    return p


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
    st = status(mkpod(), rs(ctr("a", ContainerState.RUNNING), ctr("b", ContainerState.RUNNING)))
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
    hn = status(mkpod(hostNetwork=True), rs(ctr("a", ContainerState.RUNNING)))
    assert hn["podIP"] == "192.0.2.1"


def test_pending_and_waiting_reasons() -> None:
    st = status(mkpod(), rs(ctr("a", ContainerState.RUNNING)),
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
    st = status(mkpod(), r, waiting={"a": Waiting("CrashLoopBackOff", "back-off 10s")})
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
    a2 = status(mkpod(), r2)["containerStatuses"][0]
    assert a2["restartCount"] == 2 and "running" in a2["state"]
    assert a2["lastState"]["terminated"]["exitCode"] == 2


def test_phases_by_restart_policy() -> None:
    ok = rs(ctr("a", ContainerState.EXITED, code=0), ctr("b", ContainerState.EXITED, code=0))
    bad = rs(ctr("a", ContainerState.EXITED, code=0), ctr("b", ContainerState.EXITED, code=3))
    assert status(mkpod("Never"), ok)["phase"] == "Succeeded"
    assert status(mkpod("Never"), bad)["phase"] == "Failed"
    assert status(mkpod("OnFailure"), ok)["phase"] == "Succeeded"
    assert status(mkpod("OnFailure"), bad)["phase"] == "Running"
    assert status(mkpod("Always"), ok)["phase"] == "Running"
    # deleted and stopped: terminal whatever the policy
    assert status(mkpod("Always"), bad, terminal=True)["phase"] == "Failed"
    # a terminal phase never goes back
    assert status(mkpod("Never"), rs(ctr("a", ContainerState.RUNNING)),
                  previous={"phase": "Succeeded"})["phase"] == "Succeeded"
    done = status(mkpod("Never"), ok)
    assert next(c for c in done["conditions"] if c["type"] == "Ready")["reason"] == \
        "PodCompleted"


def test_init_containers() -> None:
    st = status(mkpod(init=True), rs(ctr("i", ContainerState.RUNNING)))
    assert st["phase"] == "Pending" and cond(st, "Initialized") == "False"
    assert st["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
    st = status(mkpod(init=True), rs(ctr("i", ContainerState.EXITED, code=0),
                                     ctr("a", ContainerState.RUNNING),
                                     ctr("b", ContainerState.RUNNING)))
    assert st["phase"] == "Running" and cond(st, "Initialized") == "True"
    assert st["initContainerStatuses"][0]["ready"] is True
    st = status(mkpod("Never", init=True), rs(ctr("i", ContainerState.EXITED, code=1)))
    assert st["phase"] == "Failed"


def test_transition_times_kept_while_unchanged() -> None:
    r = rs(ctr("a", ContainerState.RUNNING), ctr("b", ContainerState.RUNNING))
    first = status(mkpod(), r)
    later = compute_pod_status(mkpod(), r, host_ip="192.0.2.1", scheme="containerd",
                               now=T0 + dt.timedelta(minutes=5), previous=first)
    assert later == first
    r.containers[1].state = ContainerState.EXITED
    r.containers[1].exit_code = 1
    changed = compute_pod_status(mkpod(), r, host_ip="192.0.2.1", scheme="containerd",
                                 now=T0 + dt.timedelta(minutes=5), previous=first)
    ready = next(c for c in changed["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["lastTransitionTime"] == "2026-01-01T00:05:00Z"
    sched = next(c for c in changed["conditions"] if c["type"] == "PodScheduled")
    assert sched["lastTransitionTime"] == "2026-01-01T00:00:00Z"


class FakeWriter:
    def __init__(self) -> None:
        self.patches: list[tuple[str, dict]] = []
        self.deletes: list[str] = []
        self.fail: list[BaseException] = []

    async def patch_status(self, pod: dict, st: dict) -> None:
        if self.fail:
            raise self.fail.pop(0)
        self.patches.append((pod["metadata"]["uid"], st))

    async def delete_pod(self, pod: dict) -> None:
        if self.fail:
            raise self.fail.pop(0)
        self.deletes.append(pod["metadata"]["uid"])


@aio
async def test_manager_patches_only_on_change_and_retries() -> None:
    clock = FakeClock()
    w = FakeWriter()
    m = StatusManager(w, clock, registry=CollectorRegistry())
    pod = mkpod()
    r = rs(ctr("a", ContainerState.RUNNING), ctr("b", ContainerState.RUNNING))
    st = status(pod, r)
    m.set_status(pod, st)
    await settle()
    assert len(w.patches) == 1
    m.set_status(pod, status(pod, r, previous=m.previous(pod)))
    await settle()
    assert len(w.patches) == 1  # same status: no write

    # an API status already equal to ours (agent restart): no write either
    m2 = StatusManager(FakeWriter(), clock, registry=CollectorRegistry())
    m2.set_status({**pod, "status": {**st, "qosClass": "BestEffort"}}, st)
    await settle()
    assert not m2.dirty("u1")

    # a failing API: retried with backoff until it works; latest status wins
    w.fail = [ApiException(status=503), ApiException(status=503)]
    r.containers[0].state = ContainerState.EXITED
    r.containers[0].exit_code = 1
    m.set_status(pod, status(pod, r, previous=m.previous(pod)))
    await settle()
    assert len(w.patches) == 1 and m.dirty("u1")
    await clock.advance(1)   # 2nd try fails, next in 2 s
    assert len(w.patches) == 1
    await clock.advance(2)
    assert len(w.patches) == 2 and not m.dirty("u1")
    assert w.patches[-1][1]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 1

    # someone else overwrote the status: RECONCILE makes us write ours again
    m.reconcile({**pod, "status": {"phase": "Unknown"}})
    await settle()
    assert len(w.patches) == 3


@aio
async def test_retry_now_ends_a_long_backoff() -> None:
    """After an outage, statuses go as soon as the pod watch reconnects, not at the
    end of a backoff that grew to a minute meanwhile."""
    clock = FakeClock()
    w = FakeWriter()
    m = StatusManager(w, clock, registry=CollectorRegistry())
    pod = mkpod()
    w.fail = [ApiException(status=503)] * 7
    m.set_status(pod, status(pod, rs()))
    await settle()
    await clock.advance(1 + 2 + 4 + 8 + 16 + 32)  # 6 more failed tries; next in 60 s
    assert len(w.fail) == 0 and m.dirty("u1") and w.patches == []
    await clock.advance(30)
    assert w.patches == []
    m.retry_now()
    await settle()
    assert len(w.patches) == 1 and not m.dirty("u1")
    # a failure after it backs off from the start again
    w.fail = [ApiException(status=503)]
    m.set_status(pod, status(pod, rs(ctr("a", ContainerState.RUNNING))))
    await settle()
    assert len(w.patches) == 1
    await clock.advance(1)
    assert len(w.patches) == 2 and not m.dirty("u1")


@aio
async def test_manager_finishes_deletion_and_handles_gone_pods() -> None:
    clock = FakeClock()
    w = FakeWriter()
    m = StatusManager(w, clock, registry=CollectorRegistry())
    pod = mkpod()
    m.set_status(pod, status(pod, rs()))
    m.finish_deletion(pod)
    await settle()
    assert len(w.patches) == 1 and w.deletes == ["u1"]
    # 404 on patch: the pod is gone; give up quietly
    w2 = FakeWriter()
    w2.fail = [ApiException(status=404)]
    m2 = StatusManager(w2, clock, registry=CollectorRegistry())
    m2.set_status(pod, status(pod, rs()))
    await settle()
    assert not m2.dirty("u1") and w2.patches == []
    # static pods are not deleted through the API
    static = mkpod()
    static["metadata"]["annotations"] = {"kubernetes.io/config.source": "file"}
    static["metadata"]["uid"] = "static1"
    m.finish_deletion(static)
    await settle()
    assert w.deletes == ["u1"]


@aio
async def test_static_pod_status_waits_for_its_mirror_pod() -> None:
    clock = FakeClock()
    w = FakeWriter()
    m = StatusManager(w, clock, registry=CollectorRegistry())
    static = mkpod()
    static["metadata"]["annotations"] = {"kubernetes.io/config.source": "file"}
    w.fail = [ApiException(status=404), ApiException(status=404)]
    m.set_status(static, status(static, rs()))
    await settle()
    assert w.patches == [] and m.dirty("u1")
    await clock.advance(3)  # retried at 1 s (404 again) and 3 s: the mirror exists now
    assert len(w.patches) == 1 and not m.dirty("u1")
