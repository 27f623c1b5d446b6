"""The runtime interface's records and the fake runtime's contract."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.quantity import parse_quantity
from nodeagent.runtime import (
    ContainerConfig,
    ContainerState,
    ImageNotPresent,
    NotFound,
    SandboxConfig,
    SandboxState,
    make_runtime,
)
from nodeagent.runtime.base import LABEL_CONTAINER_NAME, LABEL_POD_UID, Mount, start_call
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import aio, mkpod

SLEEPER = {"name": "c", "image": "localhost/busybox:1", "command": ["sleep"], "args": ["3600"],
           "env": [{"name": "A", "value": "1"}],
           "resources": {"limits": {"cpu": "250m", "memory": "64Mi"}}}


def pod(name: str = "p", uid: str = "u1", **spec: Any) -> dict:
    """A pod not bound to a node yet, one container with the fields the configs map."""
    return mkpod(name, uid, node=None, policy=None, phase=None, labels={"app": "x"},
                 containers=[SLEEPER], **spec)


def test_configs_from_pod() -> None:
    p = pod(hostNetwork=True, terminationGracePeriodSeconds=5)
    sc = SandboxConfig.from_pod(p, attempt=1)
    assert (sc.name, sc.namespace, sc.uid, sc.attempt) == ("p", "ns", "u1", 1)
    assert sc.host_network and sc.hostname == ""
    assert sc.labels[LABEL_POD_UID] == "u1" and sc.labels["app"] == "x"
    assert sc.termination_grace_seconds == 5
    cc = ContainerConfig.from_pod(p, p["spec"]["containers"][0], attempt=2, restart_count=2)
    assert cc.command == ["sleep"] and cc.args == ["3600"]
    assert cc.env == [("A", "1")]  # literal values; the rest is nodeagent.pods.env's (test_env)
    resolved = ContainerConfig.from_pod(p, p["spec"]["containers"][0], env=[("N", "n1")],
                                        mounts=[Mount("/data", "/host/data", True)])
    assert resolved.env == [("N", "n1")]
    assert resolved.mounts == [Mount("/data", "/host/data", True)]
    assert cc.resources.cpu_limit_millis == 250
    assert cc.resources.memory_limit_bytes == 64 * 2**20
    assert cc.labels[LABEL_CONTAINER_NAME] == "c" and cc.attempt == 2
    assert cc.spec_hash


def test_bad_pod_fields_are_named() -> None:
    with pytest.raises(ValueError, match="metadata.uid"):
        SandboxConfig.from_pod({"metadata": {"name": "x"}})
    p = pod()
    p["spec"]["containers"][0]["resources"] = {"limits": {"memory": "lots"}}
    with pytest.raises(ValueError, match=r"container c: resources.limits.memory"):
        ContainerConfig.from_pod(p, p["spec"]["containers"][0])
    with pytest.raises(ValueError, match="image is empty"):
        ContainerConfig.from_pod(p, {"name": "c"})
    assert parse_quantity("1.5Gi") == 1.5 * 2**30
    secret = {"name": "c", "image": "i", "env": [
        {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}
    with pytest.raises(ValueError, match=r"valueFrom are resolved by nodeagent.pods.env"):
        ContainerConfig.from_pod(p, secret)
    with pytest.raises(ValueError, match="envFrom and valueFrom are resolved"):
        ContainerConfig.from_pod(p, {"name": "c", "image": "i", "envFrom": [{}]})


def test_factory_kinds(tmp_path) -> None:
    assert isinstance(make_runtime("fake"), FakeRuntime)
    with pytest.raises(ValueError, match="unknown kind"):
        make_runtime("docker")


@aio
async def test_fake_lifecycle() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock, images=["localhost/busybox:1"])
    p = pod()
    sc = SandboxConfig.from_pod(p)
    sid = await rt.run_sandbox(sc)
    cc = ContainerConfig.from_pod(p, p["spec"]["containers"][0])
    cid = await rt.create_container(sid, cc, sc)
    await rt.start_container(cid)
    listed = await rt.relist()
    assert [c.state for c in listed.containers] == [ContainerState.RUNNING]
    assert listed.sandboxes[0].state == SandboxState.READY

    rt.exit_container(cid, 3)
    st = await rt.pod_status("u1")
    assert st.containers[0].exit_code == 3 and st.containers[0].reason == "Error"
    with pytest.raises(NotFound):
        await rt.start_container(cid)  # exited containers do not restart
    with pytest.raises(NotFound):
        await rt.start_container("nope")
    await rt.stop_container("nope", 1)  # idempotent
    await rt.remove_container("nope")

    bad = ContainerConfig.from_pod(p, {"name": "d", "image": "localhost/missing:1"})
    with pytest.raises(ImageNotPresent):
        await rt.create_container(sid, bad, sc)
    assert await rt.image_present("localhost/busybox:1")
    assert not await rt.image_present("localhost/missing:1")
    assert [i.names for i in await rt.list_images()] == [["localhost/busybox:1"]]

    await rt.stop_sandbox(sid)
    await rt.remove_sandbox(sid)
    await rt.remove_sandbox(sid)
    assert (await rt.relist()).containers == []
    assert (await rt.pod_status("u1")).sandboxes == []


@aio
async def test_fake_stop_honours_timeout_for_sigterm_ignorers() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    p = pod()
    sc = SandboxConfig.from_pod(p)
    sid = await rt.run_sandbox(sc)
    cid = await rt.create_container(sid, ContainerConfig.from_pod(
        p, p["spec"]["containers"][0]), sc)
    await rt.start_container(cid)
    rt.ignore_sigterm.add("c")
    task = asyncio.create_task(rt.stop_container(cid, 10))
    await settle()
    await clock.advance(9)
    assert not task.done() and rt.containers[cid].state == ContainerState.RUNNING
    await clock.advance(1)
    assert task.done()
    assert rt.containers[cid].exit_code == 137


@aio
async def test_an_inline_runtime_call_runs_at_once_and_becomes_a_task_only_when_it_waits(
        ) -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    tasks = len(asyncio.all_tasks())
    version = start_call(rt, rt.version())
    assert version.done() and version.result().runtime_name  # answered in this turn
    assert len(asyncio.all_tasks()) == tasks  # no task was made for it

    missing = start_call(rt, rt.start_container("nope"))
    assert missing.done() and isinstance(missing.exception(), NotFound)

    rt.pull_delay = 5  # a call that waits goes on in a task, where it left off
    pull = start_call(rt, rt.pull_image("localhost/busybox:1"))
    assert not pull.done() and isinstance(pull, asyncio.Task)
    await clock.advance(5)
    assert "localhost/busybox:1" in (await pull).names

    stopped: list[str] = []

    async def cleans_up() -> None:
        try:
            await clock.sleep(60)
        finally:
            stopped.append("ran its finally")
    waiting = start_call(rt, cleans_up())
    waiting.cancel()  # a cancel reaches the call inside, as it would its own task
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert stopped == ["ran its finally"]


@aio
async def test_a_runtime_that_is_not_inline_gets_a_task_for_every_call() -> None:
    rt = FakeRuntime(FakeClock())
    rt.inline = False
    call = start_call(rt, rt.version())
    assert isinstance(call, asyncio.Task) and not call.done()
    assert (await call).runtime_name
