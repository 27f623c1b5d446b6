"""The sync loop end to end on the fake runtime and FakeClock: pods start, crash,
restart with back-off, finish, get deleted; orphans are removed; a new agent adopts."""

from __future__ import annotations

from pathlib import Path

from nodeagent.api.clock import FakeClock, settle
from nodeagent.pods.gc import GarbageCollector, GcSettings
from nodeagent.pods.podupdate import Op, PodUpdate, Source
from nodeagent.pods.settings import NodePodSettings
from nodeagent.runtime import (
    ContainerRuntimeError,
    ContainerState,
    RuntimeTimeout,
    SandboxConfig,
    SandboxState,
)
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import LoopRig, aio, mkpod, pod_deletes, started


@aio
async def test_pod_starts_and_reports_running() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("web", "u1", containers=("c0", "c1")))
    await a.run_for(3)
    assert len(a.rt.running("u1")) == 2
    st = a.status("u1")
    assert st["phase"] == "Running"
    assert {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "True"
    assert st["containerStatuses"][0]["containerID"].startswith("fake://")
    assert st["podIP"].startswith("10.88.") and st["hostIP"] == "192.0.2.10"
    patches = len(a.patches())
    await a.run_for(120)  # two periodic resyncs, nothing changed: no more writes
    assert len(a.patches()) == patches
    assert a.rt.calls["run_sandbox"] == 1 and a.rt.calls["create_container"] == 2
    await a.loops.stop()


@aio
async def test_crash_restarts_with_doubling_backoff() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("web", "u1"))
    await a.run_for(3)
    first = a.rt.running("u1")[0]
    a.rt.exit_container(first.id, 1)
    await a.run_for(2)  # died seen within 2 relists, restarted at once
    now = a.rt.running("u1")
    assert len(now) == 1 and now[0].attempt == 1 and now[0].restart_count == 1
    await a.run_for(1)
    cs = a.cstatus("u1")
    assert cs["restartCount"] == 1 and "running" in cs["state"]
    assert cs["lastState"]["terminated"]["exitCode"] == 1

    restart_times = []
    for _ in range(3):
        a.rt.exit_container(a.rt.running("u1")[0].id, 2)
        t0 = clock.monotonic()
        await a.run_for(2)
        assert a.rt.running("u1") == []
        assert a.cstatus("u1")["state"]["waiting"]["reason"] == "CrashLoopBackOff"
        while not a.rt.running("u1"):
            await a.run_for(1)
        restart_times.append(clock.monotonic() - t0)
    # back-off 10 s, 20 s, 40 s (each counted from the previous restart, seen ~1 s late)
    assert [round(t / 10) * 10 for t in restart_times] == [10, 20, 40]
    assert a.rt.running("u1")[0].restart_count == 4
    # old attempts stay until the garbage collector's round; then the running one and
    # the newest exited one (its lastState, `logs --previous`) remain
    assert len(a.rt.find("u1", "c")) == 5
    relists = a.rt.calls["relist"]
    assert await GarbageCollector(a.rt, clock, GcSettings(), pods=a.loops
                                  ).collect_containers() == 3
    assert [c.attempt for c in a.rt.find("u1", "c")] == [3, 4]
    assert a.rt.calls["relist"] == relists  # the PLEG's last relist did
    await a.loops.stop()


@aio
async def test_new_image_restarts_a_crash_looping_container_without_its_backoff() -> None:
    clock = FakeClock()
    a = await started(clock)
    pod = mkpod("web", "u1")
    a.send(Op.ADD, pod)
    await a.run_for(3)
    for _ in range(3):  # restarted at once, then after 10 s and 20 s: 40 s comes next
        a.rt.exit_container(a.rt.running("u1")[0].id, 2)
        await a.run_for(2)
        while not a.rt.running("u1"):
            await a.run_for(1)
    a.rt.exit_container(a.rt.running("u1")[0].id, 2)
    await a.run_for(2)
    assert a.cstatus("u1")["state"]["waiting"]["message"].startswith("back-off 40s")
    # the kubelet keys the back-off by the container's definition too: a new image starts
    # its container at the next sync, not 40 s later
    spec = pod["spec"]
    a.send(Op.UPDATE, {**pod, "spec": {**spec, "containers": [
        {**spec["containers"][0], "image": "localhost/busybox:2"}]}})
    await a.run_for(2)
    now = a.rt.running("u1")
    assert len(now) == 1 and now[0].image == "localhost/busybox:2"
    assert a.cstatus("u1")["restartCount"] == 4
    await a.loops.stop()


@aio
async def test_restart_policies() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("never", "n", policy="Never"), mkpod("onf", "o", policy="OnFailure"),
           mkpod("onf2", "o2", policy="OnFailure"))
    await a.run_for(3)
    a.rt.exit_container(a.rt.running("n")[0].id, 0)
    a.rt.exit_container(a.rt.running("o")[0].id, 0)
    a.rt.exit_container(a.rt.running("o2")[0].id, 1)
    await a.run_for(4)
    assert a.status("n")["phase"] == "Succeeded"
    assert a.status("o")["phase"] == "Succeeded"
    assert a.rt.running("n") == [] and a.rt.running("o") == []
    # finished pods' sandboxes are stopped
    assert all(s.state == SandboxState.NOTREADY for s in a.rt.sandboxes.values()
               if s.pod_uid in ("n", "o"))
    assert len(a.rt.running("o2")) == 1 and a.status("o2")["phase"] == "Running"
    assert a.cstatus("o2")["restartCount"] == 1
    n_creates = a.rt.calls["create_container"]
    await a.run_for(130)
    assert a.rt.calls["create_container"] == n_creates  # Succeeded pods never restart
    await a.loops.stop()


@aio
async def test_graceful_delete_within_grace_then_remove() -> None:
    clock = FakeClock()
    a = await started(clock)
    pod = mkpod("web", "u1", terminationGracePeriodSeconds=30)
    a.send(Op.ADD, pod)
    await a.run_for(3)
    a.rt.ignore_sigterm.add("c")
    deleted = {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "2026-01-01T00:00:03Z",
                                   "deletionGracePeriodSeconds": 5}}
    a.send(Op.DELETE, deleted)
    await a.run_for(4)
    assert len(a.rt.running("u1")) == 1  # still inside its grace period
    await a.run_for(3)
    assert a.rt.running("u1") == []
    c = a.rt.find("u1", "c")[-1]
    assert c.exit_code == 137
    await a.run_for(2)
    st = a.status("u1")
    assert st["phase"] == "Failed"  # killed: terminal
    assert pod_deletes(a.kube) == ["u1"]  # the graceful delete is finished in the API
    a.send(Op.REMOVE, deleted)
    await a.run_for(2)
    assert [s for s in a.rt.sandboxes.values() if s.pod_uid == "u1"] == []
    assert a.rt.find("u1", "c") == []
    assert "u1" not in a.loop.workers
    await a.loops.stop()


class StuckRuntime(FakeRuntime):
    """Refuses to remove the `stuck` containers and their sandboxes, as containerd 1.6
    does with a container whose start was cut short while its task exists."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.stuck: set[str] = set()
        self.refused = 0

    async def remove_container(self, container_id: str) -> None:
        if container_id in self.stuck:
            self.refused += 1
            raise ContainerRuntimeError(f"cannot delete running task {container_id}")
        await super().remove_container(container_id)

    async def remove_sandbox(self, sandbox_id: str) -> None:
        for cid in self.stuck:
            if self.containers[cid].sandbox_id == sandbox_id:
                raise ContainerRuntimeError(f"failed to remove container {cid}")
        await super().remove_sandbox(sandbox_id)


@aio
async def test_a_container_the_runtime_will_not_remove_holds_back_nothing_else() -> None:
    clock = FakeClock()
    rt = StuckRuntime(clock)
    a = await started(clock, rt)
    pod = mkpod("web", "u1", containers=("a", "b"))
    a.send(Op.ADD, pod)
    await a.run_for(3)
    rt.stuck.add(rt.find("u1", "a")[0].id)  # the first one cleanup comes to
    a.send(Op.REMOVE, pod)
    await a.run_for(2)
    assert [c.name for c in rt.containers.values() if c.pod_uid == "u1"] == ["a"]
    [sb] = [s for s in rt.sandboxes.values() if s.pod_uid == "u1"]
    assert sb.state == SandboxState.NOTREADY and "u1" in a.loop.workers  # retried
    refused = rt.refused
    await a.run_for(10)
    assert rt.refused > refused
    rt.stuck.clear()  # e.g. the runtime restarted and cleared the task
    await a.run_for(40)
    assert not [c for c in rt.containers.values() if c.pod_uid == "u1"]
    assert not [s for s in rt.sandboxes.values() if s.pod_uid == "u1"]
    assert "u1" not in a.loop.workers
    await a.loops.stop()


@aio
async def test_housekeeping_waits_for_sources_then_removes_orphans() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    a1 = await started(clock, rt)
    a1.send(Op.ADD, mkpod("keep", "k"), mkpod("gone", "g"))
    await a1.run_for(3)
    await a1.loops.stop()
    a2 = LoopRig(rt, clock, ready=False)
    a2.loops.start()
    await settle()
    a2.send(Op.ADD, mkpod("keep", "k"))
    await a2.run_for(10)
    assert len(rt.running("g")) == 1  # sources not ready: absence proves nothing
    a2.ready.mark(Source.API)
    await a2.run_for(4)
    assert rt.find("g", "c") == [] and not [s for s in rt.sandboxes.values()
                                             if s.pod_uid == "g"]
    assert len(rt.running("k")) == 1
    assert a2.patches() and all(u != "g" for u, _ in a2.patches())
    await a2.loops.stop()


@aio
async def test_new_agent_adopts_running_pods_without_duplicates() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    a1 = await started(clock, rt)
    pods = [mkpod(f"p{i}", f"u{i}", containers=("c0", "c1")) for i in range(3)]
    a1.send(Op.ADD, *pods)
    await a1.run_for(3)
    assert len(rt.running()) == 6
    await a1.loops.stop()  # like SIGKILL: nothing in the runtime is touched
    creates, sandboxes = rt.calls["create_container"], rt.calls["run_sandbox"]
    crashed = rt.running("u1")[0]
    rt.exit_container(crashed.id, 1)  # dies while no agent runs

    a2 = LoopRig(rt, clock)
    # the API already shows what agent 1 reported
    a2.send(Op.ADD, *[{**p, "status": a1.status(p["metadata"]["uid"])} for p in pods])
    a2.loops.start()
    await a2.run_for(5)
    assert rt.calls["run_sandbox"] == sandboxes
    assert rt.calls["create_container"] == creates + 1  # only the crashed one, restarted
    assert len(rt.running()) == 6 and len(rt.sandboxes) == 3
    restarted = [c for c in rt.running("u1") if c.name == crashed.name][0]
    assert restarted.attempt == crashed.attempt + 1 and restarted.restart_count == 1
    # pods whose status did not change are not written again
    assert {u for u, _ in a2.patches()} == {"u1"}
    await a2.loops.stop()


@aio
async def test_burst_of_updates_causes_at_most_two_syncs() -> None:
    clock = FakeClock()
    a = await started(clock)
    pod = mkpod("web", "u1")
    a.send(Op.ADD, pod)
    await a.run_for(3)
    before = a.loop.workers.syncs("u1")
    for i in range(100):
        p = {**pod, "metadata": {**pod["metadata"], "labels": {"n": str(i)}}}
        a.loop.handle_update(PodUpdate(Op.UPDATE, (p,), Source.API))
    await a.run_for(3)
    assert 1 <= a.loop.workers.syncs("u1") - before <= 2
    await a.loops.stop()


@aio
async def test_periodic_resync_only_when_due() -> None:
    """A pod is resynced 60-90 s after its last sync (the kubelet's jitter of half the
    period), not before."""
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("a", "ua"))
    await a.run_for(45)
    a.send(Op.ADD, mkpod("b", "ub"))
    await a.run_for(3)
    sa, sb = a.loop.workers.syncs("ua"), a.loop.workers.syncs("ub")
    await a.run_for(12)   # t=60: a's last sync was at ~t=1
    assert a.loop.workers.syncs("ua") == sa
    await a.run_for(33)   # t=93: a is due (by t=92), b is not (not before ~t=106)
    assert a.loop.workers.syncs("ua") == sa + 1
    assert a.loop.workers.syncs("ub") == sb
    await a.run_for(45)   # t=138: b is due (by ~t=137)
    assert a.loop.workers.syncs("ub") == sb + 1
    await a.loops.stop()


@aio
async def test_pods_started_together_are_resynced_apart() -> None:
    """Each resync comes at a point of its 60-90 s window that differs from pod to pod:
    60 pods started in the same second are not resynced in the same tick."""
    clock = FakeClock()
    a = await started(clock)
    uids = [f"u{i}" for i in range(60)]
    a.send(Op.ADD, *(mkpod(f"p{i}", uid) for i, uid in enumerate(uids)))
    await a.run_for(2)
    synced = {uid: a.loop.workers.syncs(uid) for uid in uids}
    resynced_at: dict[str, int] = {}
    for t in range(2, 95):
        for uid in uids:
            if uid not in resynced_at and a.loop.workers.syncs(uid) > synced[uid]:
                resynced_at[uid] = t
        await a.run_for(1)
    assert sorted(resynced_at) == sorted(uids)
    assert min(resynced_at.values()) >= 60 and max(resynced_at.values()) <= 92
    per_second = [list(resynced_at.values()).count(t) for t in range(60, 93)]
    assert max(per_second) <= 8  # spread: 60 over 30 s (at once: 60 in one)
    await a.loops.stop()


@aio
async def test_runtime_errors_are_retried_with_backoff() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.rt.fail["run_sandbox"] = RuntimeTimeout("run_sandbox: deadline exceeded")
    a.send(Op.ADD, mkpod("web", "u1"))
    await a.run_for(1)
    assert a.rt.running("u1") == [] and a.rt.calls["run_sandbox"] == 1
    await a.run_for(3)
    assert len(a.rt.running("u1")) == 1 and a.rt.calls["run_sandbox"] == 2
    await a.loops.stop()


@aio
async def test_spec_change_replaces_the_container() -> None:
    clock = FakeClock()
    a = await started(clock)
    pod = mkpod("web", "u1")
    a.send(Op.ADD, pod)
    await a.run_for(3)
    old = a.rt.running("u1")[0]
    new = {**pod, "spec": {**pod["spec"], "containers": [
        {**pod["spec"]["containers"][0], "image": "localhost/busybox:2"}]}}
    a.send(Op.UPDATE, new)
    await a.run_for(3)
    cur = a.rt.running("u1")
    assert len(cur) == 1 and cur[0].id != old.id and cur[0].image == "localhost/busybox:2"
    assert a.rt.containers[old.id].state == ContainerState.EXITED
    await a.loops.stop()


@aio
async def test_one_hung_pod_does_not_hold_back_the_others() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD, mkpod("a", "ua"))
    await a.run_for(3)
    a.rt.hang_pod_status.add("ua")
    a.rt.exit_container(a.rt.running("ua")[0].id, 1)
    a.send(Op.ADD, mkpod("b", "ub"), mkpod("c", "uc"))
    await a.run_for(3)
    assert a.status("ub")["phase"] == "Running" and a.status("uc")["phase"] == "Running"
    assert a.loops.health() is None
    await a.loops.stop()


@aio
async def test_housekeeping_ignores_pods_cleaned_up_after_the_last_relist() -> None:
    clock = FakeClock()
    a = await started(clock)
    pod = mkpod("web", "u1")
    a.send(Op.ADD, pod)
    await a.run_for(3)
    stale = a.loops.pleg.last_result
    a.send(Op.REMOVE, pod)
    await settle()
    for step in (0.1, 0.2, 0.3):  # cache "fresh" for each worker step, but no relist
        await a.loops.pleg.cache.update_time(clock.monotonic() + step)
        await settle()
    assert "u1" not in a.loop.workers and a.rt.find("u1", "c") == []
    assert a.loops.pleg.last_result is stale  # no relist since: it still shows u1
    assert await a.loops.housekeeping() == []
    await a.run_for(a.loops.pleg.period + 1)
    assert await a.loops.housekeeping() == []
    assert a.loop.workers.forgotten == {}  # pruned once a newer relist came
    await a.loops.stop()


@aio
async def test_unrunnable_spec_is_reported_not_crashed_on() -> None:
    clock = FakeClock()
    a = await started(clock)
    pod = mkpod("web", "u1", containers=("c0", "c1"))
    pod["spec"]["containers"][1]["resources"] = {"limits": {"memory": "lots"}}
    a.send(Op.ADD, pod)
    await a.run_for(3)
    # the pod's cgroup, which both containers go in, cannot be given its limits: the
    # pod waits, each container naming the field
    for i in (0, 1):
        bad = a.cstatus("u1", i)["state"]["waiting"]
        assert bad["reason"] == "CreateContainerConfigError"
        assert "spec.containers[1].resources.limits.memory: 'lots'" in bad["message"]
    assert a.rt.running("u1") == []
    await a.events.drain()
    events = [e for e in a.warnings() if e["reason"] == "Failed"]
    assert {e["involvedObject"]["fieldPath"] for e in events} == {
        "spec.containers{c0}", "spec.containers{c1}"}
    assert all("resources.limits.memory" in e["message"] for e in events)
    assert events[0]["metadata"]["namespace"] == pod["metadata"]["namespace"]
    await a.loops.stop()


@aio
async def test_updates_are_split_by_node_in_order() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    loops = LoopRig(rt, clock, ready=False, nodes=("n1", "n2"), first_loop=False).loops
    p1, p2, p3 = mkpod("a", "ua"), mkpod("b", "ub"), mkpod("c", "uc")
    p2["spec"]["nodeName"] = "n2"
    p3["spec"]["nodeName"] = "elsewhere"
    loops.route(PodUpdate(Op.ADD, (p1, p2, p3), Source.API))
    loops.route(PodUpdate(Op.REMOVE, (p1,), Source.API))
    n1, n2 = loops.loops["n1"], loops.loops["n2"]
    # each node's loop took its own pods, in order: a was added, then removed
    assert n1.pods == {} and "ua" in n1.workers and "ub" not in n1.workers
    assert n2.pods == {"ub": p2} and "ub" in n2.workers and "ua" not in n2.workers
    assert loops.owner == {"ub": "n2"}  # where the PLEG's events for a pod go
    assert set(loops.loops) == {"n1", "n2"}  # nothing made for a node not served here
    for loop in loops.loops.values():
        await loop.close()


@aio
async def test_replacement_with_same_name_waits_for_the_old_pod_to_stop() -> None:
    clock = FakeClock()
    a = await started(clock)
    old = mkpod("static-web", "old", terminationGracePeriodSeconds=5)
    a.send(Op.ADD, old)
    await a.run_for(3)
    a.rt.ignore_sigterm.add("c")  # the old one takes its whole grace period to stop
    new = mkpod("static-web", "new")
    a.send(Op.REMOVE, old)
    a.send(Op.ADD, new)
    await a.run_for(3)
    assert len(a.rt.running("old")) == 1
    assert not [s for s in a.rt.sandboxes.values() if s.pod_uid == "new"]
    await a.run_for(4)
    assert a.rt.running("old") == []
    assert len(a.rt.running("new")) == 1
    await a.loops.stop()


@aio
async def test_a_started_pod_is_reported_running_without_waiting_for_a_relist() -> None:
    """The status a sync publishes shows what it started (one pod_status call), not the
    runtime state from before it: Running is written without waiting up to a PLEG
    period for the relist that will see the container (pod startup latency)."""
    clock = FakeClock()
    a = await started(clock)
    relists = a.rt.calls["relist"]
    a.send(Op.ADD, mkpod("web", "u1"))
    await settle(100)  # the worker's sync and the status write: no time passes
    assert a.rt.calls["relist"] == relists
    st = a.status("u1")
    assert st["phase"] == "Running" and "running" in st["containerStatuses"][0]["state"]
    # and the cache the kubelet API reads knows the container (an exec right away works)
    [cached] = a.loops.pleg.cache.get("u1").status.containers
    assert cached.state == ContainerState.RUNNING
    writes = len(a.patches())
    await a.run_for(3)  # the relist's ContainerStarted syncs again: nothing new to write
    assert len(a.patches()) == writes
    await a.loops.stop()


@aio
async def test_an_orphan_is_removed_before_any_node_has_a_loop() -> None:
    """Loops are made when a node first has a pod; a pod an earlier agent left in the
    runtime, which no source has, is still removed (by a loop made for it)."""
    clock = FakeClock()
    rt = FakeRuntime(clock)
    await rt.run_sandbox(SandboxConfig.from_pod(mkpod("left", "old")))
    rig = LoopRig(rt, clock, ready=False, nodes=("n1", "n2"), first_loop=False)
    loops = rig.loops
    loops.start()
    rig.ready.mark(Source.API)  # the API's first full list: no pod for n1 or n2
    for _ in range(4):
        await clock.advance(1)
    assert loops.loops.keys() == {"n1"}
    assert "old" not in {s.pod_uid for s in (await rt.relist()).sandboxes}
    await loops.stop()


@aio
async def test_a_node_that_runs_workloads_tells_each_start_a_virtual_one_does_not() -> None:
    """The kubelet's Normal Events of a container start (`Pulled` for an image already
    there, `Created`, `Started`) come from a node whose containers run; a node on the
    fake runtime (virtual nodes) writes none of them, and still says what goes wrong."""
    said: dict[bool, list[str]] = {}
    for runs in (True, False):
        clock = FakeClock()
        rt = FakeRuntime(clock, images=["localhost/busybox:1"])
        a = LoopRig(rt, clock, pod_settings=NodePodSettings(runs_workloads=runs))
        a.loops.start()
        await settle()
        a.send(Op.ADD, mkpod("web", "u1"),
               mkpod("never", "u2", containers=[{"name": "c", "image": "localhost/none:1",
                                                 "imagePullPolicy": "Never"}]))
        await a.run_for(2)
        await a.events.drain()
        assert a.status("u1")["phase"] == "Running"
        said[runs] = sorted({c.body["reason"] for c in a.kube.calls_of("create events")
                             if c.body})
        await a.loops.stop()
    # (the resolver's MissingClusterDNS: a node that runs workloads has no --cluster-dns)
    assert said[True] == ["Created", "ErrImageNeverPull", "Failed", "MissingClusterDNS",
                          "Pulled", "Started"]
    assert said[False] == ["ErrImageNeverPull", "Failed"]


@aio
async def test_the_services_are_read_as_the_loops_start_not_at_the_first_pod(
        tmp_path: Path) -> None:
    clock = FakeClock()
    a = LoopRig(FakeRuntime(clock), clock, volumes=tmp_path)
    await a.pods.start()
    await settle()
    # every container's environment has the `kubernetes` Service's variables: read
    # before the first pod comes, which then does not wait for the list
    assert a.kube.count("list services") == 1
    a.send(Op.ADD, mkpod("web", "u1"))
    await a.run_for(2)
    assert len(a.rt.running("u1")) == 1 and a.kube.count("list services") == 1
    await a.pods.stop()
