"""Ephemeral containers (`kubectl debug`): added to a running pod through the
pods/ephemeralcontainers subresource, started once in its sandbox, never restarted,
reported in ephemeralContainerStatuses, and refused alone for a field the agent does not
honour (fake runtime, FakeClock)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from nodeagent.api.clock import FakeClock
from nodeagent.api.kube import PODS
from nodeagent.pods import podspec
from nodeagent.pods.podupdate import Op, Pod
from nodeagent.runtime.base import ContainerConfig, PodRuntimeStatus, SandboxConfig
from nodeagent.runtime.cri.criruntime import container_config_pb
from nodeagent.runtime.cri.gen import api_pb2 as pb
from nodeagent.runtime.fake import FakeRuntime
from nodeagent.server.kubeletserver import RequestError, pick_container
from tests.conftest import AgentRig, LoopRig, aio, mkpod, started

IMAGE = "localhost/busybox:1"


def debug(**fields: Any) -> dict[str, Any]:
    """An ephemeral container as the API server stores it (defaults filled in)."""
    return {"name": "debugger", "image": IMAGE, "command": ["sh"], "stdin": True,
            "tty": True, "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent",
            **fields}


def debugged(pod: Pod, *ephemeral: dict[str, Any]) -> Pod:
    """The pod after `kubectl debug` added these ephemeral containers."""
    out = copy.deepcopy(pod)
    out["spec"]["ephemeralContainers"] = list(ephemeral)
    return out


async def running_pod(clock: FakeClock, policy: str = "Always",
                      containers: tuple[str, ...] = ("app",)) -> tuple[LoopRig, Pod]:
    a = await started(clock)
    pod = mkpod("p", "u1", policy=policy, containers=containers)
    a.send(Op.ADD, pod)
    await a.run_for(3)
    assert {c.name for c in a.rt.running("u1")} == set(containers)
    return a, pod


def ephemeral_status(a: LoopRig) -> dict[str, Any]:
    [st] = a.status("u1")["ephemeralContainerStatuses"]
    return st


@aio
async def test_started_once_in_the_running_sandbox_sharing_the_targets_processes() -> None:
    clock = FakeClock()
    a, pod = await running_pod(clock)
    [app] = a.rt.running("u1")
    a.send(Op.UPDATE, debugged(pod, debug(targetContainerName="app")))
    await a.run_for(3)
    [dbg] = a.rt.find("u1", "debugger")
    assert dbg.sandbox_id == app.sandbox_id and a.rt.calls["run_sandbox"] == 1
    assert a.rt.configs[dbg.id].target_id == app.id  # pid namespace TARGET of app
    assert a.rt.configs[dbg.id].tty and a.rt.configs[dbg.id].stdin
    assert [c.id for c in a.rt.running("u1") if c.name == "app"] == [app.id]  # untouched
    st = ephemeral_status(a)
    assert st["state"]["running"]["startedAt"]
    assert st["containerID"] == f"fake://{dbg.id}" and st["imageID"] == dbg.image_id
    assert st["image"] == IMAGE and st["restartCount"] == 0 and st["ready"] is False
    assert "started" not in st  # not probed: the kubelet leaves it unset
    assert a.condition("u1", "Ready")["status"] == "True"  # not counted for readiness
    assert a.status("u1")["phase"] == "Running"
    await a.events.drain()
    started_events = [c.body["involvedObject"]["fieldPath"]
                      for c in a.kube.calls_of("create events")
                      if c.body and c.body["reason"] == "Started"]
    assert "spec.ephemeralContainers{debugger}" in started_events
    await a.run_for(30)  # resyncs start nothing more
    assert len(a.rt.find("u1", "debugger")) == 1
    await a.loops.stop()


@aio
async def test_never_restarted_whatever_the_restart_policy() -> None:
    clock = FakeClock()
    a, pod = await running_pod(clock, policy="Always")
    a.send(Op.UPDATE, debugged(pod, debug()))
    await a.run_for(3)
    [dbg] = a.rt.find("u1", "debugger")
    a.rt.exit_container(dbg.id, 2)
    await a.run_for(120)  # well past any crash back-off
    assert [c.id for c in a.rt.find("u1", "debugger")] == [dbg.id]
    st = ephemeral_status(a)
    assert st["state"]["terminated"]["exitCode"] == 2 and st["restartCount"] == 0
    assert st["lastState"] == {}
    assert a.status("u1")["phase"] == "Running"  # the pod's phase ignores it
    assert a.condition("u1", "ContainersReady")["status"] == "True"
    await a.loops.stop()


@aio
async def test_a_refused_field_refuses_only_the_ephemeral_container() -> None:
    clock = FakeClock()
    a, pod = await running_pod(clock)
    [app] = a.rt.running("u1")
    a.send(Op.UPDATE, debugged(pod, debug(volumeDevices=[{"name": "v",
                                                          "devicePath": "/dev/x"}])))
    await a.run_for(3)
    assert a.rt.find("u1", "debugger") == []
    w = ephemeral_status(a)["state"]["waiting"]
    assert w["reason"] == "CreateContainerConfigError"
    assert w["message"].startswith("spec.ephemeralContainers[0].volumeDevices: ")
    await a.events.drain()
    [ev] = [e for e in a.warnings() if e["reason"] == "Failed"]
    assert ev["involvedObject"]["fieldPath"] == "spec.ephemeralContainers{debugger}"
    assert "spec.ephemeralContainers[0].volumeDevices" in ev["message"]
    # the pod's own containers go on as before: a crash is restarted, not refused
    assert a.condition("u1", "Ready")["status"] == "True"
    a.rt.exit_container(app.id, 1)
    await a.run_for(3)
    [again] = [c for c in a.rt.running("u1") if c.name == "app"]
    assert again.attempt == 1
    assert a.cstatus("u1")["state"]["running"] and a.cstatus("u1")["restartCount"] == 1
    await a.loops.stop()


@aio
async def test_a_target_that_is_not_running_is_refused_visibly() -> None:
    clock = FakeClock()
    a, pod = await running_pod(clock, policy="Never", containers=("app", "side"))
    [app] = [c for c in a.rt.running("u1") if c.name == "app"]
    a.rt.exit_container(app.id, 0)
    await a.run_for(3)
    a.send(Op.UPDATE, debugged(pod, debug(targetContainerName="app")))
    await a.run_for(3)
    assert a.rt.find("u1", "debugger") == []
    w = ephemeral_status(a)["state"]["waiting"]
    assert w["reason"] == "CreateContainerConfigError"
    assert w["message"].startswith("spec.ephemeralContainers[0].targetContainerName: ")
    await a.events.drain()
    assert any("targetContainerName" in e["message"] for e in a.warnings()
               if e["involvedObject"].get("fieldPath") == "spec.ephemeralContainers{debugger}")
    assert [c.name for c in a.rt.running("u1")] == ["side"]
    await a.loops.stop()


@aio
async def test_not_started_in_a_sandbox_it_would_have_to_recreate() -> None:
    """Once it has run, a new sandbox of the pod does not run it again."""
    clock = FakeClock()
    a, pod = await running_pod(clock)
    a.send(Op.UPDATE, debugged(pod, debug()))
    await a.run_for(3)
    [dbg] = a.rt.find("u1", "debugger")
    for s in list(a.rt.sandboxes):
        await a.rt.stop_sandbox(s)  # the sandbox died: everything in it stopped
    await a.run_for(30)
    assert a.rt.calls["run_sandbox"] == 2
    assert [c.name for c in a.rt.running("u1")] == ["app"]
    assert [c.id for c in a.rt.find("u1", "debugger")] == [dbg.id]
    await a.loops.stop()


def test_podspec_checks_each_ephemeral_container_on_its_own() -> None:
    pod = debugged(mkpod("p"), debug(targetContainerName="c"),
                   debug(name="d2", volumeDevices=[{"name": "v"}], futureField=1))
    got = {(u.path, u.container) for u in podspec.unhandled(pod)}
    assert got == {("spec.ephemeralContainers[1].volumeDevices", "d2"),
                   ("spec.ephemeralContainers[1].futureField", "d2")}
    assert set(podspec.EPHEMERAL_FIELDS) == set(podspec.CONTAINER_FIELDS) | {
        "targetContainerName"}


def test_cri_gets_the_targets_pid_namespace() -> None:
    pod = debugged(mkpod("p"), debug(targetContainerName="c"))
    cfg = ContainerConfig.from_pod(pod, pod["spec"]["ephemeralContainers"][0])
    cfg.target_id = "abc123"
    ns = container_config_pb(cfg, SandboxConfig.from_pod(pod)) \
        .linux.security_context.namespace_options
    assert ns.pid == pb.TARGET and ns.target_id == "abc123"
    # a pod sharing one PID namespace (or the node's) already shares the target's
    shared = debugged(mkpod("p", shareProcessNamespace=True), debug(targetContainerName="c"))
    ns = container_config_pb(cfg, SandboxConfig.from_pod(shared)) \
        .linux.security_context.namespace_options
    assert ns.pid == pb.POD and ns.target_id == ""


@aio
async def test_logs_previous_is_never_an_ephemeral_container() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    pod = debugged(mkpod("p", "u1"), debug())
    sid = await rt.run_sandbox(SandboxConfig.from_pod(pod))
    cid = await rt.create_container(sid, ContainerConfig.from_pod(
        pod, pod["spec"]["ephemeralContainers"][0]), SandboxConfig.from_pod(pod))
    await rt.start_container(cid)
    rt.exit_container(cid, 1)
    rs: PodRuntimeStatus = await rt.pod_status("u1")
    assert pick_container(pod, rs, "debugger", previous=False).id == cid
    try:
        pick_container(pod, rs, "debugger", previous=True)
    except RequestError as e:
        assert e.status == 400
    else:
        raise AssertionError("an ephemeral container has no previous instance")


@aio
async def test_the_agents_pod_watch_brings_it(tmp_path: Path) -> None:
    """As `kubectl debug` adds it: the API's pod changes, the watch delivers it, the
    agent runs it and writes its status to the API."""
    rig = AgentRig(tmp_path)
    await rig.start()
    pod = mkpod(uid="u1")
    rig.kube.put(PODS, pod)
    for _ in range(3):
        await rig.clock.advance(1)
    rig.kube.put(PODS, debugged(rig.kube.obj(PODS, "web", "ns"), debug()))
    for _ in range(3):
        await rig.clock.advance(1)
    [dbg] = rig.rt.find("u1", "debugger")
    api = rig.kube.obj(PODS, "web", "ns")["status"]
    [st] = api["ephemeralContainerStatuses"]
    assert st["containerID"] == f"fake://{dbg.id}" and "running" in st["state"]
    assert api["phase"] == "Running"
    await rig.finish()


@aio
async def test_one_the_runtime_lost_stays_ended_and_is_not_run_again() -> None:
    """The API refuses an ephemeral container's status going back from terminated; the
    runtime removing its record (a restart, garbage collection) changes neither that nor
    "never restarted"."""
    clock = FakeClock()
    a, pod = await running_pod(clock)
    a.send(Op.UPDATE, debugged(pod, debug(), debug(name="d2")))
    await a.run_for(3)
    [one] = a.rt.find("u1", "debugger")
    [two] = a.rt.find("u1", "d2")
    a.rt.exit_container(one.id, 3)
    await a.run_for(3)
    await a.rt.remove_container(one.id)
    await a.rt.remove_container(two.id)  # gone while it ran
    await a.run_for(30)
    assert a.rt.find("u1", "debugger") == [] and a.rt.find("u1", "d2") == []
    first, second = a.status("u1")["ephemeralContainerStatuses"]
    assert first["state"]["terminated"]["exitCode"] == 3
    assert first["containerID"] == f"fake://{one.id}"
    assert second["state"]["terminated"]["reason"] == "ContainerStatusUnknown"
    assert second["containerID"] == f"fake://{two.id}"
    await a.loops.stop()
