"""Scripted fake pods (runtime/script.py): the annotations read, the fake runtime acting
them out on its clock, and the agent's own logic (restarts, back-off, phases, Events)
following, as it would on a real runtime."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from nodeagent.api.clock import FakeClock
from nodeagent.pods.podupdate import Op
from nodeagent.runtime import ContainerRuntimeError, ContainerState
from nodeagent.runtime.base import ContainerConfig, SandboxConfig
from nodeagent.runtime.fake import FakeRuntime
from nodeagent.runtime.script import Script, ScriptError, script_for
from tests.conftest import aio, mkpod, started

P = "fake.nodepulse.dev/"


def scripted(name: str, uid: str, annotations: dict[str, str], **kw: Any) -> dict[str, Any]:
    pod = mkpod(name, uid, **kw)
    pod["metadata"]["annotations"] = annotations
    return pod


def test_annotations_pod_wide_and_per_container() -> None:
    ann = {P + "run-for": "1m30s", P + "exit-code": "3", P + "run-for.side": "500ms",
           "other.example/x": "ignored"}
    assert script_for(ann, "main") == Script(run_for=90.0, exit_code=3)
    assert script_for(ann, "side") == Script(run_for=0.5, exit_code=3)
    assert script_for({}, "c") == Script()
    assert script_for({P + "fail-start": "no such file"}, "c").fail_start == "no such file"
    assert script_for({P + "fail-start": ""}, "c").fail_start == "fake: start failed"
    assert script_for({P + "ready-after": "20s"}, "c").ready_after == 20.0
    # the container's own key wins whatever the order
    assert script_for({P + "exit-code.c": "7", P + "exit-code": "1"}, "c").exit_code == 7


@pytest.mark.parametrize(("key", "value", "says"), [
    ("run-for", "soon", "annotation fake.nodepulse.dev/run-for: 'soon' is not a duration"),
    ("run-for.c", "-5", "annotation fake.nodepulse.dev/run-for.c: must not be negative"),
    ("exit-code", "x", "annotation fake.nodepulse.dev/exit-code: 'x' is not an exit code"),
    ("exit-code", "300", "'300' is not within 0..255"),
    ("exit-after", "3s", "annotation fake.nodepulse.dev/exit-after: unknown"),
    ("memory", "lots", "annotation fake.nodepulse.dev/memory: 'lots' is not a quantity"),
    ("disk.c", "-1Gi", "annotation fake.nodepulse.dev/disk.c: must not be negative"),
])
def test_bad_annotations_are_named(key: str, value: str, says: str) -> None:
    with pytest.raises(ScriptError, match=says.replace(".", r"\.")):
        script_for({P + key: value}, "c")


async def _one(rt: FakeRuntime, annotations: dict[str, str]) -> str:
    sb = SandboxConfig(name="p", namespace="ns", uid="u", annotations=annotations)
    sid = await rt.run_sandbox(sb)
    return await rt.create_container(sid, ContainerConfig(name="c", image="i", pod_uid="u"), sb)


@aio
async def test_the_fake_runtime_exits_a_container_at_its_time() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    cid = await _one(rt, {P + "run-for": "30s", P + "exit-code": "3"})
    await rt.start_container(cid)
    started_at = clock.now()
    await clock.advance(29.5)
    assert (await rt.relist()).containers[0].state == ContainerState.RUNNING
    await clock.advance(10)  # seen late, stamped with the scripted time
    c = (await rt.pod_status("u")).containers[0]
    assert (c.state, c.exit_code, c.reason) == (ContainerState.EXITED, 3, "Error")
    assert c.finished_at == started_at + dt.timedelta(seconds=30)


@aio
async def test_scripted_usage_is_what_the_runtime_measures() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock, images=["i"])
    cid = await _one(rt, {P + "memory": "300Mi", P + "disk": "1Gi", P + "processes": "40"})
    assert await rt.container_stats() == []  # created, not running: nothing used
    await rt.start_container(cid)
    quiet = await _one(rt, {})
    await rt.start_container(quiet)
    by_id = {s.container_id: s for s in await rt.container_stats()}
    s = by_id[cid]
    assert (s.memory_working_set_bytes, s.writable_layer_bytes, s.processes) == (
        300 * 2**20, 2**30, 40)
    q = by_id[quiet]
    assert (q.memory_working_set_bytes, q.writable_layer_bytes, q.processes) == (0, 0, 1)
    # the store: an image removed is gone, and pinned ones say so
    rt.pinned.add("i:latest")
    (img,) = await rt.list_images()
    assert img.pinned and img.id == rt.containers[cid].image_id  # the id containers carry
    await rt.remove_image(img.id)
    assert await rt.list_images() == [] and not await rt.image_present("i")


@aio
async def test_a_scripted_start_failure_and_a_bad_annotation() -> None:
    rt = FakeRuntime(FakeClock())
    cid = await _one(rt, {P + "fail-start": "exec: no such file"})
    with pytest.raises(ContainerRuntimeError, match="exec: no such file"):
        await rt.start_container(cid)
    c = rt.containers[cid]
    assert (c.state, c.exit_code, c.reason, c.message) == \
        (ContainerState.EXITED, 128, "StartError", "exec: no such file")
    with pytest.raises(ContainerRuntimeError, match="fake.nodepulse.dev/run-for"):
        await _one(rt, {P + "run-for": "later"})


@aio
async def test_the_agent_crash_loops_completes_and_fails_scripted_pods() -> None:
    clock = FakeClock()
    a = await started(clock)
    a.send(Op.ADD,
           scripted("crash", "u1", {P + "run-for": "5s", P + "exit-code": "1"}),
           scripted("job", "u2", {P + "run-for": "20s"}, policy="Never"),
           scripted("fails", "u3", {P + "run-for": "3s", P + "exit-code": "2"},
                    policy="Never"),
           scripted("nostart", "u4", {P + "fail-start": "no such file"}),
           scripted("bad", "u5", {P + "exit-code": "many"}))
    await a.run_for(12)
    # restartPolicy Always, exiting 1 after 5 s: restarted, then backed off
    crash = a.cstatus("u1")
    assert crash["restartCount"] >= 1
    assert crash["lastState"]["terminated"]["exitCode"] == 1
    await a.run_for(30)
    crash = a.cstatus("u1")
    assert crash["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert crash["restartCount"] == 3  # back-off 10 s, then 20 s: a crash loop
    last = crash["lastState"]["terminated"]
    assert (last["startedAt"], last["finishedAt"]) == ("2026-01-01T00:00:36Z",
                                                       "2026-01-01T00:00:41Z")  # ran 5 s
    # a Job's pod: exit 0 after 20 s, never restarted
    assert a.status("u2")["phase"] == "Succeeded"
    assert a.cstatus("u2")["state"]["terminated"]["exitCode"] == 0
    assert a.status("u3")["phase"] == "Failed"
    assert a.cstatus("u3")["state"]["terminated"]["exitCode"] == 2
    # a failed start is the agent's RunContainerError (then back-off), with its Event
    nostart = a.cstatus("u4")
    assert nostart["state"]["waiting"]["reason"] in ("RunContainerError", "CrashLoopBackOff")
    assert nostart["lastState"]["terminated"]["reason"] == "StartError"
    # a bad annotation: the container is never created; the reason names the annotation
    bad = a.cstatus("u5")["state"]["waiting"]
    assert bad["reason"] == "CreateContainerError"
    assert "fake.nodepulse.dev/exit-code" in bad["message"]
    warned = " ".join(w["message"] for w in a.warnings())
    assert "no such file" in warned and "fake.nodepulse.dev/exit-code" in warned
    await a.loops.stop()


@aio
async def test_ready_after_a_delay_through_the_readiness_probe() -> None:
    """ready-after answers the container's probes as failed until it has run that long:
    readiness follows through the prober, as for a program slow to come up."""
    clock = FakeClock()
    a = await started(clock)
    probe = {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 1}
    pod = scripted("slow", "u1", {P + "ready-after": "20s"}, containers=[
        {"name": "c", "image": "localhost/busybox:1", "readinessProbe": probe}])
    a.send(Op.ADD, pod)
    await a.run_for(15)
    assert a.status("u1")["phase"] == "Running"
    assert a.condition("u1", "Ready")["status"] == "False"
    assert a.cstatus("u1")["ready"] is False
    await a.run_for(10)
    assert a.condition("u1", "Ready")["status"] == "True"
    assert a.cstatus("u1")["ready"] is True
    assert ("c", "httpGet") in a.rt.network_probes
    await a.loops.stop()
