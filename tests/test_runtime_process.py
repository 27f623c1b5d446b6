"""ProcessRuntime on real short-lived local processes. Waits are bounded waits on a
process's exit (pidfd), never fixed sleeps. Every test kills what it started."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from nodeagent.runtime import (
    ContainerConfig,
    ContainerRuntimeError,
    ContainerState,
    NotFound,
    RelistResult,
    SandboxConfig,
    SandboxState,
    Unsupported,
    make_runtime,
)
from nodeagent.runtime.base import LABEL_CONTAINER_NAME, LABEL_POD_UID, Resources
from nodeagent.runtime.process import ANNOTATION_PID, WRAPPER, ProcessRuntime
from tests.conftest import aio, mkpod

WAIT = 20.0  # upper bound on any wait for a process to exit


def pod(command: list[str], uid: str = "u1", name: str = "p", **container: Any) -> dict:
    """One container running `command`."""
    return mkpod(name, uid, node=None, policy=None, phase=None, containers=[{
        "name": "c", "image": "localhost/busybox:1", "command": command, **container}])


@asynccontextmanager
async def runtime(state: Path, **kw: Any) -> AsyncIterator[ProcessRuntime]:
    rt = ProcessRuntime(state, **kw)
    try:
        yield rt
    finally:
        for sb in (await rt.relist()).sandboxes:
            await rt.remove_sandbox(sb.id)  # kills whatever still runs
        await rt.close()


async def start(rt: ProcessRuntime, p: dict, attempt: int = 0) -> tuple[str, str]:
    sc = SandboxConfig.from_pod(p)
    sid = await rt.run_sandbox(sc)
    cc = ContainerConfig.from_pod(p, p["spec"]["containers"][0], attempt=attempt,
                                  restart_count=attempt)
    cid = await rt.create_container(sid, cc, sc)
    await rt.start_container(cid)
    return sid, cid


async def one(rt: ProcessRuntime, cid: str, uid: str = "u1") -> Any:
    return next(c for c in (await rt.pod_status(uid)).containers if c.id == cid)


def sleeper(ready: Path, trap: str = "") -> dict:
    """A pod whose program writes its PID to `ready` once set up, then sleeps."""
    return pod(["sh", "-c", f'{trap}echo $$ > "$0.tmp" && mv "$0.tmp" "$0"; exec sleep 600',
                str(ready)])


def workload_pid(ready: Path) -> int:
    """Wait (bounded, inotify) until the program is set up; return its PID."""
    _wait_file(ready)
    return int(ready.read_text())


def pid_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@aio
async def test_runs_command_with_env_workdir_logs_and_exit_code(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    p = pod(["sh", "-c"], args=['echo "$GREETING from $(pwd)"; echo oops >&2; exit 3'],
            env=[{"name": "GREETING", "value": "hello"}], workingDir=str(work))
    async with runtime(tmp_path / "state") as rt:
        sid, cid = await start(rt, p)
        assert await rt.wait_container(cid, WAIT)
        c = await one(rt, cid)
        assert (c.state, c.exit_code, c.reason) == (ContainerState.EXITED, 3, "Error")
        assert c.started_at and c.finished_at and c.finished_at >= c.started_at
        log = tmp_path / "state" / "logs" / "ns_p_u1" / "c" / "0.log"
        assert log.read_text().splitlines() == [f"hello from {work}", "oops"]
        assert c.labels[LABEL_POD_UID] == "u1" and c.labels[LABEL_CONTAINER_NAME] == "c"
        assert c.image == "localhost/busybox:1"


@aio
async def test_runtime_calls_do_not_queue_behind_the_default_thread_pool(
        tmp_path: Path) -> None:
    """While the API server is down, pod status writes (asyncio.to_thread) hold the
    event loop's default threads; the runtime's relists and starts must still run."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    release = threading.Event()
    blocked = asyncio.ensure_future(asyncio.to_thread(release.wait, WAIT))
    try:
        async with runtime(tmp_path) as rt:
            _, cid = await asyncio.wait_for(start(rt, pod(["sleep", "600"])), WAIT)
            listed = await asyncio.wait_for(rt.relist(), WAIT)
            assert [c.id for c in listed.containers] == [cid]
            assert not blocked.done()  # the default pool's one thread was busy throughout
    finally:
        release.set()
        await blocked


@aio
async def test_relist_running_then_stop_with_sigterm(tmp_path: Path) -> None:
    async with runtime(tmp_path) as rt:
        sid, cid = await start(rt, pod(["sleep", "600"]))
        listed = await rt.relist()
        c = next(c for c in listed.containers if c.id == cid)
        assert c.state == ContainerState.RUNNING and c.sandbox_id == sid
        pid = int(c.annotations[ANNOTATION_PID])
        assert os.getpgid(pid) == pid != os.getpgid(0)  # its own process group
        sb = listed.sandboxes[0]
        assert sb.state == SandboxState.READY and sb.pod_uid == "u1"
        await rt.stop_container(cid, WAIT)
        c = await one(rt, cid)
        assert (c.state, c.exit_code) == (ContainerState.EXITED, 128 + signal.SIGTERM)
        assert not pid_running(pid)
        await rt.stop_container(cid, WAIT)  # idempotent


@aio
async def test_stop_kills_after_timeout_when_sigterm_is_ignored(tmp_path: Path) -> None:
    async with runtime(tmp_path) as rt:
        _, cid = await start(rt, sleeper(tmp_path / "ready", trap="trap '' TERM; "))
        pid = int((await one(rt, cid)).annotations[ANNOTATION_PID])
        inner = workload_pid(tmp_path / "ready")
        await rt.stop_container(cid, 0.2)
        c = await one(rt, cid)
        assert (c.state, c.exit_code) == (ContainerState.EXITED, 137)
        # the group's SIGKILL reaches each process on its own: the workload may still
        # be dying when the wrapper has been reaped (CI, under load)
        assert not pid_running(pid) and _wait_gone(inner)


@aio
async def test_killed_workload_is_reported_exited_with_its_code(tmp_path: Path) -> None:
    async with runtime(tmp_path / "state") as rt:
        _, cid = await start(rt, sleeper(tmp_path / "ready"))
        os.kill(workload_pid(tmp_path / "ready"), signal.SIGKILL)
        assert await rt.wait_container(cid, WAIT)
        listed = await rt.relist()
        c = next(c for c in listed.containers if c.id == cid)
        assert (c.state, c.exit_code, c.reason) == (ContainerState.EXITED, 137, "Error")
        # a restart is a new container with attempt + 1; the old one cannot start again
        with pytest.raises(ContainerRuntimeError, match="new container"):
            await rt.start_container(cid)
        p = pod(["sleep", "600"])
        sc = SandboxConfig.from_pod(p)
        cc = ContainerConfig.from_pod(p, p["spec"]["containers"][0], attempt=1,
                                      restart_count=1)
        cid1 = await rt.create_container(c.sandbox_id, cc, sc)
        await rt.start_container(cid1)
        new = await one(rt, cid1)
        assert (new.state, new.attempt, new.restart_count) == (ContainerState.RUNNING, 1, 1)


@aio
async def test_wrapper_killed_alone_takes_the_workload_with_it(tmp_path: Path) -> None:
    async with runtime(tmp_path / "state") as rt:
        _, cid = await start(rt, sleeper(tmp_path / "ready"))
        pid = int((await one(rt, cid)).annotations[ANNOTATION_PID])
        inner = workload_pid(tmp_path / "ready")
        os.kill(pid, signal.SIGKILL)
        assert await rt.wait_container(cid, WAIT)
        c = await one(rt, cid)
        assert (c.state, c.exit_code) == (ContainerState.EXITED, 137)
        # like a container whose PID 1 died: nothing of it keeps running
        assert _wait_gone(inner)


def _wait_gone(pid: int) -> bool:
    """Bounded wait for a process we do not parent (pidfd, no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        return bool(p.poll(int(WAIT * 1000)))
    finally:
        os.close(fd)


@aio
async def test_restarted_agent_adopts_running_processes_without_duplicates(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    rt1 = ProcessRuntime(state)
    sid, cid = await start(rt1, sleeper(tmp_path / "ready"))
    pid = int((await one(rt1, cid)).annotations[ANNOTATION_PID])
    inner = workload_pid(tmp_path / "ready")
    # a second agent on the same state dir is refused while the first holds it
    with pytest.raises(ContainerRuntimeError, match="in use by another agent"):
        ProcessRuntime(state)
    await rt1.close()

    async with runtime(state) as rt2:
        listed = await rt2.relist()
        assert [(c.id, c.state) for c in listed.containers] == [(cid, ContainerState.RUNNING)]
        assert [s.id for s in listed.sandboxes] == [sid]
        c = listed.containers[0]
        assert int(c.annotations[ANNOTATION_PID]) == pid
        # the adopted process is not rt2's child: its code still comes through
        os.kill(inner, signal.SIGTERM)
        assert await rt2.wait_container(cid, WAIT)
        c = await one(rt2, cid)
        assert (c.state, c.exit_code) == (ContainerState.EXITED, 143)


@aio
async def test_adoption_checks_process_identity(tmp_path: Path) -> None:
    rt = ProcessRuntime(tmp_path)
    sid, cid = await start(rt, pod(["sleep", "600"]))
    await rt.stop_container(cid, WAIT)
    await rt.close()
    # forge a RUNNING record whose PID now belongs to another process (this one)
    path = tmp_path / "containers" / f"{cid}.json"
    rec = json.loads(path.read_text())
    rec.update(state="RUNNING", pid=os.getpid(), exit_code=None, finished_at=None)
    path.write_text(json.dumps(rec))
    (tmp_path / "containers" / f"{cid}.exit").unlink(missing_ok=True)
    async with runtime(tmp_path) as rt2:
        c = await one(rt2, cid)
        assert c.state == ContainerState.EXITED  # not adopted: the start time differs
        assert "not recorded" in c.message
    assert pid_running(os.getpid())  # and nothing of ours was signalled


@aio
async def test_adopts_a_process_started_just_before_a_crash(tmp_path: Path) -> None:
    """The agent died after starting the wrapper but before saving RUNNING."""
    p = pod(["sleep", "600"])
    sc = SandboxConfig.from_pod(p)
    rt = ProcessRuntime(tmp_path)
    sid = await rt.run_sandbox(sc)
    cid = await rt.create_container(sid, ContainerConfig.from_pod(
        p, p["spec"]["containers"][0]), sc)
    await rt.close()
    base = tmp_path / "containers" / cid
    wrapper = subprocess.Popen(["/bin/sh", "-c", WRAPPER, str(base), "sleep", "600"],
                               start_new_session=True)
    try:
        _wait_file(base.with_suffix(".pid"))
        async with runtime(tmp_path) as rt2:
            c = await one(rt2, cid)
            assert c.state == ContainerState.RUNNING
            assert int(c.annotations[ANNOTATION_PID]) == wrapper.pid
            await rt2.stop_container(cid, WAIT)
            assert (await one(rt2, cid)).exit_code == 143
    finally:
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)
        wrapper.wait(WAIT)


def _wait_file(path: Path) -> None:
    """Bounded wait for the wrapper's first line, using inotify rather than sleeping."""
    from inotify_simple import INotify, flags
    ino = INotify()
    try:
        ino.add_watch(str(path.parent), flags.CLOSE_WRITE | flags.MOVED_TO)
        for _ in range(50):
            if path.exists() and path.read_text().strip():
                return
            ino.read(timeout=int(WAIT * 1000 / 50))
    finally:
        ino.close()
    raise AssertionError(f"{path} never written")


@aio
async def test_corrupt_record_is_set_aside_and_others_load(tmp_path: Path) -> None:
    rt1 = ProcessRuntime(tmp_path)
    sid, cid = await start(rt1, pod(["sleep", "600"]))
    await rt1.close()
    (tmp_path / "containers" / "broken.json").write_text("{not json")
    async with runtime(tmp_path) as rt2:
        assert [c.id for c in (await rt2.relist()).containers] == [cid]
        assert (tmp_path / "containers" / "broken.json.corrupt").exists()


@aio
async def test_errors_name_the_container_and_field(tmp_path: Path) -> None:
    async with runtime(tmp_path) as rt:
        p = pod(["sleep", "600"])
        sc = SandboxConfig.from_pod(p)
        sid = await rt.run_sandbox(sc)
        with pytest.raises(ContainerRuntimeError, match="container c: command and args"):
            await rt.create_container(sid, ContainerConfig.from_pod(
                p, {"name": "c", "image": "x"}), sc)
        with pytest.raises(NotFound):
            await rt.create_container("nope", ContainerConfig.from_pod(
                p, p["spec"]["containers"][0]), sc)
        with pytest.raises(NotFound):
            await rt.start_container("nope")
        await rt.stop_container("nope", 1)
        await rt.remove_container("nope")
        await rt.stop_sandbox("nope")
        await rt.remove_sandbox("nope")

        bad_dir = ContainerConfig.from_pod(p, {**p["spec"]["containers"][0],
                                               "workingDir": str(tmp_path / "missing")})
        cid = await rt.create_container(sid, bad_dir, sc)
        with pytest.raises(ContainerRuntimeError, match="workingDir .*missing does not exist"):
            await rt.start_container(cid)
        c = await one(rt, cid)
        assert (c.state, c.exit_code, c.reason) == (ContainerState.EXITED, 128, "StartError")

        no_exe = ContainerConfig.from_pod(p, {**p["spec"]["containers"][0],
                                              "command": ["no-such-program-xyz"]})
        cid = await rt.create_container(sid, no_exe, sc)
        with pytest.raises(ContainerRuntimeError, match="no-such-program-xyz.*not found"):
            await rt.start_container(cid)

        await rt.stop_sandbox(sid)
        with pytest.raises(NotFound, match="not ready"):
            await rt.create_container(sid, ContainerConfig.from_pod(
                p, p["spec"]["containers"][0]), sc)


@aio
async def test_remove_sandbox_kills_and_forgets_everything(tmp_path: Path) -> None:
    async with runtime(tmp_path) as rt:
        sid, cid = await start(rt, pod(["sleep", "600"]))
        pid = int((await one(rt, cid)).annotations[ANNOTATION_PID])
        await rt.stop_sandbox(sid)
        st = await rt.pod_status("u1")
        assert st.sandboxes[0].state == SandboxState.NOTREADY
        assert st.containers[0].state == ContainerState.EXITED
        assert not pid_running(pid)
        await rt.remove_sandbox(sid)
        assert await rt.relist() == RelistResult([], [])
        assert list((tmp_path / "containers").iterdir()) == []
        assert list((tmp_path / "sandboxes").iterdir()) == []
        assert not (tmp_path / "logs" / "ns_p_u1").exists()


@aio
async def test_make_runtime_and_images_are_labels(tmp_path: Path) -> None:
    rt = make_runtime("process", state_dir=tmp_path)
    assert isinstance(rt, ProcessRuntime) and rt.scheme == "process"
    try:
        assert await rt.image_present("anything/at:all")
        assert (await rt.version()).runtime_name == "process"
        _, cid = await start(rt, pod([sys.executable, "-c", "print('hi')"]))
        assert await rt.wait_container(cid, WAIT)
        assert (await one(rt, cid)).exit_code == 0
        assert [i.names for i in await rt.list_images()] == [["localhost/busybox:1"]]
    finally:
        for sb in (await rt.relist()).sandboxes:
            await rt.remove_sandbox(sb.id)
        await rt.close()


@aio
async def test_usage_is_its_process_groups_and_images_are_not_removable(
        tmp_path: Path) -> None:
    """What the eviction manager ranks by: the resident memory and the processes of the
    container's process group; and what the image collector is told: no images to
    remove, no image filesystem."""
    ready = tmp_path / "ready"
    p = pod(["sh", "-c", f'sleep 600 & sleep 600 & echo up > "{ready}.tmp" && '
                         f'mv "{ready}.tmp" "{ready}"; wait'])
    async with runtime(tmp_path / "state") as rt:
        _, cid = await start(rt, p)
        _wait_file(ready)
        (s,) = await rt.container_stats()
        assert s.container_id == cid
        assert s.processes == 4  # the wrapper, the shell and its two sleeps
        assert s.memory_working_set_bytes and s.memory_working_set_bytes > 100_000
        with pytest.raises(Unsupported, match="process runtime cannot remove images"):
            await rt.remove_image("sha256:x")
        with pytest.raises(Unsupported, match="process runtime keeps no image filesystem"):
            await rt.image_fs_info()


@aio
async def test_long_stops_do_not_stall_the_relist(tmp_path: Path) -> None:
    """More pending stops (each waiting out a long grace period) than worker threads:
    the relist still completes, since stops wait on the event loop."""
    async with runtime(tmp_path / "state") as rt:
        ids = []
        for i in range(12):
            ready = tmp_path / f"ready{i}"
            _, cid = await start(rt, {**sleeper(ready, trap="trap '' TERM; "),
                                      "metadata": {"name": f"p{i}", "namespace": "ns",
                                                   "uid": f"u{i}"}})
            workload_pid(ready)
            ids.append(cid)
        stops = [asyncio.create_task(rt.stop_container(cid, 3600)) for cid in ids]
        listed = await asyncio.wait_for(rt.relist(), WAIT)
        assert len(listed.containers) == 12
        assert all(c.state == ContainerState.RUNNING for c in listed.containers)
        assert not any(t.done() for t in stops)
        for t in stops:
            t.cancel()
        await asyncio.gather(*stops, return_exceptions=True)


@aio
async def test_leftover_background_processes_die_with_the_container(tmp_path: Path) -> None:
    async with runtime(tmp_path / "state") as rt:
        bg = tmp_path / "bg"
        _, cid = await start(rt, pod(["sh", "-c", 'sleep 600 & echo $! > "$0"; exit 0',
                                      str(bg)]))
        assert await rt.wait_container(cid, WAIT)
        c = await one(rt, cid)
        assert (c.state, c.exit_code, c.reason) == (ContainerState.EXITED, 0, "Completed")
        assert _wait_gone(int(bg.read_text()))  # like a container whose PID 1 ended


@aio
async def test_records_from_before_a_reboot_are_not_adopted(tmp_path: Path) -> None:
    rt = ProcessRuntime(tmp_path)
    _, cid = await start(rt, pod(["sleep", "600"]))
    pid = int((await one(rt, cid)).annotations[ANNOTATION_PID])
    await rt.close()
    path = tmp_path / "containers" / f"{cid}.json"
    rec = json.loads(path.read_text())
    rec["boot_id"] = "another-boot"
    path.write_text(json.dumps(rec))
    try:
        async with runtime(tmp_path) as rt2:
            c = await one(rt2, cid)
            assert (c.state, c.exit_code) == (ContainerState.EXITED, 137)
            assert pid_running(pid)  # a PID from another boot is never signalled
    finally:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@aio
async def test_refuses_mounts_it_cannot_make(tmp_path: Path) -> None:
    from nodeagent.runtime.base import Mount, Unsupported
    p = pod(["true"])
    async with runtime(tmp_path) as rt:
        sc = SandboxConfig.from_pod(p)
        sid = await rt.run_sandbox(sc)
        cc = ContainerConfig.from_pod(p, p["spec"]["containers"][0])
        cc.mounts = [Mount("/data", str(tmp_path))]
        with pytest.raises(Unsupported, match="volumeMounts.*/data"):
            await rt.create_container(sid, cc, sc)


@aio
async def test_refuses_limits_it_cannot_enforce(tmp_path: Path) -> None:
    from nodeagent.runtime.base import Unsupported
    p = pod(["true"])
    p["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "100m"},
                                               "limits": {"memory": "64Mi"}}
    async with runtime(tmp_path) as rt:
        assert rt.cgroups == "none"
        sc = SandboxConfig.from_pod(p)
        sid = await rt.run_sandbox(sc)
        cc = ContainerConfig.from_pod(p, p["spec"]["containers"][0])
        with pytest.raises(Unsupported, match="resources.limits.memory: the process runtime "
                                              "runs a process in the agent's own cgroup"):
            await rt.create_container(sid, cc, sc)
        p["spec"]["containers"][0]["resources"].pop("limits")  # a request alone: runs
        await rt.create_container(sid, ContainerConfig.from_pod(p, p["spec"]["containers"][0]),
                                  sc)


@aio
async def test_security_settings_a_process_cannot_honour_are_refused(tmp_path: Path) -> None:
    async with runtime(tmp_path / "state") as rt:
        own = {"runAsUser": os.getuid(), "runAsGroup": os.getgid()}
        sid, cid = await start(rt, pod(["true"], securityContext=own))  # its own ids: fine
        for sc, field in (({"runAsUser": os.getuid() + 1}, "runAsUser"),
                          ({"privileged": True}, "privileged"),
                          ({"readOnlyRootFilesystem": True}, "readOnlyRootFilesystem"),
                          ({"allowPrivilegeEscalation": False}, "allowPrivilegeEscalation"),
                          ({"capabilities": {"drop": ["ALL"]}}, "capabilities"),
                          ({"seccompProfile": {"type": "RuntimeDefault"}}, "seccompProfile")):
            p = pod(["true"], uid="u2", securityContext=sc)
            sb = SandboxConfig.from_pod(p)
            with pytest.raises(ContainerRuntimeError, match=f"securityContext.{field}"):
                await rt.create_container(sid, ContainerConfig.from_pod(
                    p, p["spec"]["containers"][0]), sb)
        assert await rt.image_user("any") == (os.getuid(), "")
        sysctl = mkpod("s", "u3", securityContext={"sysctls": [{"name": "net.ipv4.ping_group_range",
                                                                 "value": "0 1"}]})
        with pytest.raises(ContainerRuntimeError, match="spec.securityContext.sysctls"):
            await rt.run_sandbox(SandboxConfig.from_pod(sysctl))
        handler = SandboxConfig.from_pod(mkpod("h", "u4"))
        handler.runtime_handler = "kata"
        with pytest.raises(ContainerRuntimeError, match="runtimeClassName"):
            await rt.run_sandbox(handler)


@aio
async def test_events_report_starts_exits_as_they_happen_and_removals(tmp_path: Path) -> None:
    async with runtime(tmp_path) as rt:
        events = await rt.container_events()

        async def next_event() -> tuple[str, str]:
            ev = await asyncio.wait_for(anext(events), WAIT)
            assert ev.pod_uid == "u1"
            return ev.type.value, ev.container_id

        sid, cid = await start(rt, pod(["sh", "-c", "exit 3"]))
        assert await next_event() == ("started", sid)
        assert await next_event() == ("started", cid)
        # the exit is reported by itself (no call reads the container meanwhile)
        assert await next_event() == ("died", cid)
        assert rt._containers[cid].exit_code == 3
        await rt.remove_sandbox(sid)
        assert [await next_event() for _ in range(3)] == [
            ("died", sid), ("removed", cid), ("removed", sid)]
        await events.aclose()  # type: ignore[attr-defined]
        assert rt._exit_fds == {} and rt._streams == []


@aio
async def test_an_ephemeral_container_joins_only_a_running_target(tmp_path: Path) -> None:
    """Every process is in the node's PID namespace, its target's too: a target that
    runs is joined, one that does not is refused, naming the field."""
    from nodeagent.runtime.base import ContainerRuntimeError
    p = pod(["sleep", "600"])
    async with runtime(tmp_path) as rt:
        sid, target = await start(rt, p)
        sc = SandboxConfig.from_pod(p)
        dbg = ContainerConfig.from_pod(p, {"name": "debugger", "image": "i",
                                           "command": ["true"]})
        dbg.target_id = target
        await rt.start_container(await rt.create_container(sid, dbg, sc))
        await rt.stop_container(target, 0)
        dbg.name, dbg.log_path = "debugger2", "debugger2/0.log"
        with pytest.raises(ContainerRuntimeError, match="targetContainerName"):
            await rt.create_container(sid, dbg, sc)


@aio
async def test_a_running_process_cannot_be_resized_and_says_why(tmp_path: Path) -> None:
    """A process runs in the agent's own cgroup: an in-place resize is refused (the pod's
    PodResizeInProgress condition carries this message) and the process runs on."""
    async with runtime(tmp_path / "state") as rt:
        _, cid = await start(rt, pod(["sleep", "600"], resources={"requests": {"cpu": "100m"}}))
        with pytest.raises(Unsupported, match="the process runtime runs a process in the "
                                              "agent's own cgroup and cannot change its CPU "
                                              "or memory in place"):
            await rt.update_container_resources(cid, Resources(cpu_request_millis=200))
        assert (await one(rt, cid)).state == ContainerState.RUNNING
        assert (await one(rt, cid)).resources is None  # it applies none
