"""The syncer's executor (PodSyncer.act), one kind of action at a time: a PodActions
written by hand, carried out against the fake runtime, with what it did read back from
the runtime, the status written and the Events. What decides the actions is
tests/test_decide.py's."""

from __future__ import annotations

from typing import Any

import pytest

from nodeagent.api.clock import FakeClock
from nodeagent.api.kube import PODS
from nodeagent.pods.admission import Rejection
from nodeagent.pods.cgroups import CgroupValues, MemoryCgroups
from nodeagent.pods.decide import (
    RETRY,
    KillContainer,
    PodActions,
    ResizeContainer,
    StartContainer,
    Verdict,
)
from nodeagent.pods.podstatus import Waiting
from nodeagent.pods.podupdate import Pod
from nodeagent.pods.syncer import PodSyncer, SyncResult
from nodeagent.runtime.base import (
    ContainerConfig,
    ContainerRuntimeError,
    ContainerState,
    PodRuntimeStatus,
    Resources,
    SandboxConfig,
    SandboxState,
)
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import LoopRig, aio, mkpod, settle


class Rig:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.rt = FakeRuntime(self.clock)
        self.a = LoopRig(self.rt, self.clock)
        self.syncer: PodSyncer = self.a.loop.syncer

    async def act(self, pod: Pod, act: PodActions) -> SyncResult:
        self.a.kube.put(PODS, pod)
        res = await self.syncer.act(pod, await self.rt.pod_status(pod["metadata"]["uid"]), act)
        await settle()
        await self.a.events.drain()
        return res

    async def sandbox(self, pod: Pod, attempt: int = 0) -> str:
        return await self.rt.run_sandbox(SandboxConfig.from_pod(pod, attempt=attempt))

    async def container(self, pod: Pod, sid: str, name: str = "c", attempt: int = 0,
                        start: bool = True) -> str:
        spec = next(c for c in pod["spec"]["containers"] if c["name"] == name)
        sc = SandboxConfig.from_pod(pod)
        cid = await self.rt.create_container(
            sid, ContainerConfig.from_pod(pod, spec, attempt=attempt), sc)
        if start:
            await self.rt.start_container(cid)
        return cid

    def state(self, cid: str) -> ContainerState:
        return self.rt.containers[cid].state

    def events(self) -> list[dict[str, Any]]:
        return self.a.kube.bodies("create events")

    def reasons(self) -> list[str]:
        return [e["reason"] for e in self.events()]

    def status(self, uid: str = "uid-p") -> dict[str, Any]:
        return self.a.status(uid)


def spec(pod: Pod, name: str = "c") -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


@aio
async def test_rejected_fails_the_pod_and_starts_nothing() -> None:
    r = Rig()
    pod = mkpod("p")
    res = await r.act(pod, PodActions(Verdict.REJECTED,
                                      rejection=Rejection("NodeAffinity", "no match")))
    assert res.terminal
    st = r.status()
    assert (st["phase"], st["reason"], st["message"]) == (
        "Failed", "NodeAffinity", "Pod was rejected: no match")
    assert r.reasons() == ["NodeAffinity"] and r.rt.calls["run_sandbox"] == 0


@aio
async def test_deadline_fails_the_pod_with_its_reason() -> None:
    r = Rig()
    res = await r.act(mkpod("p"), PodActions(Verdict.DEADLINE))
    assert res.terminal and r.status()["reason"] == "DeadlineExceeded"
    assert r.reasons() == ["DeadlineExceeded"]


@pytest.mark.parametrize("verdict,terminal", [(Verdict.FINISHED, True), (Verdict.ENDED, True)])
@aio
async def test_a_pod_that_ended(verdict: Verdict, terminal: bool) -> None:
    r = Rig()
    res = await r.act(mkpod("p", policy="Never"), PodActions(verdict))
    assert res.terminal == terminal and r.rt.calls["run_sandbox"] == 0
    # only the one that ended in this sync writes the final status
    assert bool(r.a.patches()) == (verdict == Verdict.ENDED)


@aio
async def test_refused_reports_each_container_and_makes_no_sandbox() -> None:
    r = Rig()
    res = await r.act(mkpod("p", containers=("a", "b")),
                      PodActions(Verdict.REFUSED, refuse={"a": "why a", "b": "why b"}))
    assert not res.terminal and r.rt.calls["run_sandbox"] == 0
    waiting = [cs["state"]["waiting"] for cs in r.status()["containerStatuses"]]
    assert [(w["reason"], w["message"]) for w in waiting] == [
        ("CreateContainerConfigError", "why a"), ("CreateContainerConfigError", "why b")]
    assert r.reasons() == ["Failed", "Failed"]


@aio
async def test_a_new_sandbox_after_stopping_what_ran_in_the_old_one() -> None:
    r = Rig()
    pod = mkpod("p")
    old = await r.sandbox(pod, 0)
    left = await r.container(pod, old)
    await r.rt.stop_sandbox(old)  # the sandbox died; in a real runtime its container may not
    r.rt.containers[left].state = ContainerState.RUNNING
    res = await r.act(pod, PodActions(
        Verdict.RUN, new_sandbox=1, stop_first=(r.rt.containers[left],),
        start=(StartContainer(spec(pod), attempt=1, restarts=1),)))
    assert r.state(left) == ContainerState.EXITED
    [new] = [s for s in r.rt.sandboxes.values() if s.state == SandboxState.READY]
    assert new.attempt == 1
    [running] = r.rt.running("uid-p")
    assert running.sandbox_id == new.id and running.attempt == 1
    assert res.running == frozenset({new.id, running.id})  # nothing left to do
    assert res.fresh is not None  # what it started, read back for the PLEG's cache


@aio
async def test_a_sandbox_that_cannot_be_made_is_an_event_and_an_error() -> None:
    r = Rig()
    r.rt.fail["run_sandbox"] = ContainerRuntimeError("no network")
    with pytest.raises(ContainerRuntimeError):
        await r.act(mkpod("p"), PodActions(Verdict.RUN, new_sandbox=0,
                                           start=(StartContainer(spec(mkpod("p"))),)))
    await r.a.events.drain()
    assert r.reasons()[-1] == "FailedCreatePodSandBox"
    assert r.status()["phase"] == "Pending"


@aio
async def test_duplicate_sandboxes_are_stopped() -> None:
    r = Rig()
    pod = mkpod("p")
    s0, s1 = await r.sandbox(pod, 0), await r.sandbox(pod, 1)
    await r.act(pod, PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[s1], stop_sandboxes=(s0,)))
    assert r.rt.sandboxes[s0].state == SandboxState.NOTREADY
    assert r.rt.sandboxes[s1].state == SandboxState.READY


@aio
async def test_a_kill_stops_the_container_with_the_kubelets_event() -> None:
    r = Rig()
    pod = mkpod("p")
    sid = await r.sandbox(pod)
    cid = await r.container(pod, sid)
    await r.act(pod, PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[sid], kill=(
        KillContainer(r.rt.containers[cid], spec(pod), "Container c failed liveness probe"),)))
    assert r.state(cid) == ContainerState.EXITED
    [killing] = [e for e in r.events() if e["reason"] == "Killing"]
    assert killing["message"] == "Container c failed liveness probe"


@aio
async def test_a_created_container_is_replaced_and_a_new_one_created() -> None:
    r = Rig()
    pod = mkpod("p", containers=("a", "b"))
    sid = await r.sandbox(pod)
    created = await r.container(pod, sid, "a", start=False)
    res = await r.act(pod, PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[sid], start=(
        StartContainer(spec(pod, "a"), attempt=1, replaces=r.rt.containers[created]),
        StartContainer(spec(pod, "b")))))
    assert sorted(c.name for c in r.rt.running("uid-p")) == ["a", "b"]
    assert created not in r.rt.containers  # removed before its successor was made
    assert [c.attempt for c in r.rt.find("uid-p", "a")] == [1]
    assert res.running  # every container up: nothing left to do
    assert r.status()["phase"] == "Running"


@aio
async def test_a_created_container_that_cannot_be_removed_gets_no_successor() -> None:
    """While it is there it might yet start: the new attempt waits, the status says
    why, and the next sync tries again."""
    r = Rig()
    pod = mkpod("p")
    sid = await r.sandbox(pod)
    created = await r.container(pod, sid, "c", start=False)
    r.rt.fail["remove_container"] = ContainerRuntimeError("container is starting")
    res = await r.act(pod, PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[sid], start=(
        StartContainer(spec(pod, "c"), attempt=1, replaces=r.rt.containers[created]),)))
    assert [c.id for c in r.rt.find("uid-p", "c")] == [created]
    assert res.requeue_after == RETRY
    [st] = r.status()["containerStatuses"]
    assert st["state"]["waiting"]["reason"] == "CreateContainerError"
    assert "created and never started, could not be removed: container is starting" in \
        st["state"]["waiting"]["message"]


@aio
async def test_a_container_refused_now_waits_and_the_others_start() -> None:
    r = Rig()
    pod = mkpod("p", containers=("good", "bad"))
    sid = await r.sandbox(pod)
    await r.act(pod, PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[sid],
                                start=(StartContainer(spec(pod, "good")),),
                                refuse={"bad": "spec.containers[1].x: not supported"}))
    assert [c.name for c in r.rt.running("uid-p")] == ["good"]
    [bad] = [cs for cs in r.status()["containerStatuses"] if cs["name"] == "bad"]
    assert bad["state"]["waiting"] == {"reason": "CreateContainerConfigError",
                                       "message": "spec.containers[1].x: not supported"}


@aio
async def test_what_was_decided_to_wait_is_reported_and_synced_again() -> None:
    r = Rig()
    pod = mkpod("p")
    sid = await r.sandbox(pod)
    cid = await r.container(pod, sid)
    r.rt.exit_container(cid, 1)
    res = await r.act(pod, PodActions(
        Verdict.RUN, sandbox=r.rt.sandboxes[sid], requeue_after=20.0,
        waiting={"c": Waiting("CrashLoopBackOff", "back-off 20s restarting failed")}))
    assert res.requeue_after == 20.0 and res.running == frozenset()
    assert r.status()["containerStatuses"][0]["state"]["waiting"]["reason"] == \
        "CrashLoopBackOff"


@aio
async def test_terminal_is_passed_on() -> None:
    r = Rig()
    pod = mkpod("p", policy="OnFailure")
    sid = await r.sandbox(pod)
    cid = await r.container(pod, sid)
    r.rt.exit_container(cid, 0)
    res = await r.act(pod, PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[sid], terminal=True))
    assert res.terminal and res.running == frozenset()


@aio
async def test_the_runtime_state_it_reads_is_the_one_it_is_given() -> None:
    """act() takes the runtime's state as an argument (the worker's cache entry): with
    nothing to start it reads nothing of the runtime itself."""
    r = Rig()
    pod = mkpod("p")
    sid = await r.sandbox(pod)
    await r.container(pod, sid)
    rs: PodRuntimeStatus = await r.rt.pod_status("uid-p")
    before = r.rt.calls["pod_status"]
    await r.syncer.act(pod, rs, PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[sid]))
    assert r.rt.calls["pod_status"] == before


# --- in-place resize ----------------------------------------------------------------

MI = 1024 * 1024


def sized(cpu: str = "100m", memory: str = "64Mi", **meta: Any) -> Pod:
    """Pod p with one Guaranteed container c of these resources."""
    res = {"cpu": cpu, "memory": memory}
    pod = mkpod("p", containers=[{"name": "c", "image": "localhost/busybox:1",
                                  "command": ["sleep", "3600"],
                                  "resources": {"requests": res, "limits": dict(res)}}])
    pod["metadata"].update(meta)
    return pod


async def running(r: Rig, pod: Pod) -> tuple[str, str]:
    """Its sandbox and container made and its first sync done (the pod cgroup made)."""
    sid = await r.sandbox(pod)
    cid = await r.container(pod, sid)
    await r.act(pod, PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[sid]))
    return sid, cid


def resize(r: Rig, pod: Pod, cid: str, want: Resources, have: Resources) -> ResizeContainer:
    return ResizeContainer(r.rt.containers[cid], spec(pod), want, have)


SMALL = Resources(100, 100, 64 * MI, 64 * MI)


def backend(r: Rig) -> MemoryCgroups:
    """Where the rig's pod cgroups are kept."""
    assert isinstance(r.a.cgroups.backend, MemoryCgroups)
    return r.a.cgroups.backend


@aio
async def test_a_resize_changes_the_container_and_its_pod_cgroup_in_place() -> None:
    r = Rig()
    sid, cid = await running(r, sized())
    path = r.a.cgroups.tracked()["uid-p"]
    big = sized("200m", "128Mi", generation=2)
    want = Resources(200, 200, 128 * MI, 128 * MI)
    res = await r.act(big, PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[sid],
                                      resize=(resize(r, big, cid, want, SMALL),)))
    assert r.state(cid) == ContainerState.RUNNING and r.rt.containers[cid].resources == want
    assert r.rt.calls["update_container_resources"] == 2  # memory, then cpu
    v = backend(r).cgroups[path]
    assert (v.memory_limit, v.cpu_shares, v.cpu_quota) == (128 * MI, 204, 20000)
    cs = r.status()["containerStatuses"][0]
    assert cs["resources"] == {"limits": {"cpu": "200m", "memory": "128Mi"},
                               "requests": {"cpu": "200m", "memory": "128Mi"}}
    assert cs["allocatedResources"] == {"cpu": "200m", "memory": "128Mi"}
    assert res.fresh is not None and res.requeue_after is None
    # what it was given is what the next decision starts from
    assert r.a.loop.syncer.containers.resized("uid-p") == {cid: want}


@aio
async def test_what_grows_is_set_before_the_containers_and_what_shrinks_after() -> None:
    """The kubelet's order: memory, then CPU; the pod cgroup's larger values before the
    containers are resized, its smaller ones after."""
    r = Rig()
    sid, cid = await running(r, sized())
    path = r.a.cgroups.tracked()["uid-p"]
    done: list[tuple[str, int | None, int | None]] = []
    update, cg_update = r.rt.update_container_resources, backend(r).update

    async def container(cid: str, res: Resources, adj: int | None = None) -> None:
        done.append(("container", res.memory_limit_bytes, res.cpu_limit_millis))
        await update(cid, res, adj)

    def cgroup(p: str, values: CgroupValues) -> None:
        if p == path:
            done.append(("pod", values.memory_limit, values.cpu_quota))
        cg_update(p, values)
    setattr(r.rt, "update_container_resources", container)  # noqa: B010
    setattr(r.a.cgroups.backend, "update", cgroup)  # noqa: B010
    pod = sized("200m", "32Mi", generation=2)
    await r.act(pod, PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[sid], resize=(
        resize(r, pod, cid, Resources(200, 200, 32 * MI, 32 * MI), SMALL),)))
    assert done == [("container", 32 * MI, 100), ("pod", 32 * MI, None),
                    ("pod", None, 20000), ("container", 32 * MI, 200)]


@aio
async def test_an_update_the_runtime_refuses_is_the_in_progress_conditions_error() -> None:
    r = Rig()
    sid, cid = await running(r, sized())
    pod = sized("200m", generation=2)
    r.rt.fail["update_container_resources"] = ContainerRuntimeError("cgroup says no")
    act = PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[sid], resize=(
        resize(r, pod, cid, Resources(200, 200, 64 * MI, 64 * MI), SMALL),))
    res = await r.act(pod, act)
    assert res.requeue_after == 10.0  # tried again
    [cond] = [c for c in r.status()["conditions"] if c["type"] == "PodResizeInProgress"]
    assert (cond["status"], cond["reason"], cond["message"], cond["observedGeneration"]) \
        == ("True", "Error", "cgroup says no", 2)
    assert r.events()[-1]["reason"] == "ResizeError"
    assert r.events()[-1]["message"].startswith('Pod resize error: {"containers":[{"name":"c"')
    assert r.events()[-1]["message"].endswith('"generation":2,"error":"cgroup says no"}')
    assert r.rt.containers[cid].resources == SMALL  # nothing changed
    # the same error again is no new Event; once it goes through, the resize is done
    await r.act(pod, act)
    r.rt.fail.clear()
    await r.act(pod, act)
    assert r.reasons().count("ResizeError") == 1 and r.reasons()[-1] == "ResizeCompleted"
    assert not [c for c in r.status()["conditions"]
                if c["type"].startswith("PodResize") and "$patch" not in c]


@aio
async def test_a_memory_limit_below_what_is_used_is_refused_before_anything_changes() -> None:
    r = Rig()
    pod = sized(annotations={"fake.nodepulse.dev/memory": "50Mi"})
    sid, cid = await running(r, pod)
    small = sized("100m", "32Mi", generation=2)
    await r.act(small, PodActions(Verdict.RUN, sandbox=r.rt.sandboxes[sid], resize=(
        resize(r, small, cid, Resources(100, 100, 32 * MI, 32 * MI), SMALL),)))
    [cond] = [c for c in r.status()["conditions"] if c["type"] == "PodResizeInProgress"]
    assert cond["reason"] == "Error" and cond["message"] == (
        "cannot decrease memory limits: [attempting to set pod memory limit (33554432) "
        "below current usage (52428800), attempting to set container \"c\" memory limit "
        "(33554432) below current usage (52428800)]")
    assert r.rt.calls["update_container_resources"] == 0
    assert backend(r).cgroups[r.a.cgroups.tracked()["uid-p"]].memory_limit == 64 * MI
