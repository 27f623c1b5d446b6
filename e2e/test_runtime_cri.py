"""CriRuntime against a real containerd, started privately by nodepulse_dev.containerd
with locally built images: every test runs against both builds, Debian's containerd 1.6
and the pinned 2.x built from source (both on Debian's runc). Each build's containerd is
stopped by the last test of its group, which checks that it and every shim are gone."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from nodeagent.runtime import (
    ContainerConfig,
    ContainerEventType,
    ContainerState,
    ImageNotPresent,
    NotFound,
    SandboxConfig,
    SandboxState,
    Unavailable,
    Unsupported,
    make_runtime,
)
from nodeagent.runtime.base import (
    LABEL_CONTAINER_NAME,
    LABEL_POD_NAME,
    LABEL_POD_NAMESPACE,
    LABEL_POD_UID,
)
from nodeagent.runtime.cri import CriRuntime
from nodeagent.runtime.cri.criruntime import LABEL_ATTEMPT
from nodeagent.runtime.cri.gen import api_pb2 as pb
from nodeagent.runtime.cri.gen import api_pb2_grpc as pb_grpc
from nodepulse_dev import build as gobuild
from nodepulse_dev.containerd import BUILDS, Containerd, start_containerd
from nodepulse_dev.images import BUSYBOX_IMAGE, PAUSE_IMAGE


@pytest.fixture(scope="module", params=BUILDS)
def ctd(request: pytest.FixtureRequest) -> Iterator[Containerd]:
    c = start_containerd(build=request.param, cni=True)
    failed = request.session.testsfailed
    try:
        yield c
    finally:
        if request.session.testsfailed > failed:
            c.keep_files = True  # containerd.log and the pod logs, for a human
            print(f"\ncontainerd files kept in {c.base}")
        c.stop()


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def run(body: Callable[[CriRuntime], Awaitable[None]], ctd: Containerd) -> None:
    async def main() -> None:
        rt = make_runtime("cri", ctd.endpoint)
        assert isinstance(rt, CriRuntime)
        try:
            await body(rt)
        finally:
            await rt.close()
    asyncio.run(main())


async def eventually(check: Callable[[], Awaitable[bool]], what: str,
                     timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def pod(name: str, uid: str, command: list[str], host_network: bool = True,
        grace: int = 5) -> dict:
    return {"metadata": {"name": name, "namespace": "e2e", "uid": uid},
            "spec": {"hostNetwork": host_network, "terminationGracePeriodSeconds": grace,
                     "containers": [{"name": "main", "image": BUSYBOX_IMAGE,
                                     "command": command,
                                     "env": [{"name": "GREETING", "value": "hello"}],
                                     "resources": {"limits": {"cpu": "200m",
                                                              "memory": "32Mi"}}}]}}


def container_pid(ctd: Containerd, container_id: str) -> int:
    with ctd.channel() as ch:
        st = pb_grpc.RuntimeServiceStub(ch).ContainerStatus(
            pb.ContainerStatusRequest(container_id=container_id, verbose=True), timeout=10)
    return int(json.loads(st.info["info"])["pid"])


async def start_pod(rt: CriRuntime, ctd: Containerd, p: dict, attempt: int = 0
                    ) -> tuple[SandboxConfig, str, str]:
    sc = SandboxConfig.from_pod(p, log_root=str(ctd.base / "pod-logs"))
    sid = await rt.run_sandbox(sc)
    cc = ContainerConfig.from_pod(p, p["spec"]["containers"][0], attempt=attempt,
                                  restart_count=attempt)
    cid = await rt.create_container(sid, cc, sc)
    await rt.start_container(cid)
    return sc, sid, cid


def test_version_conditions_and_images(ctd: Containerd) -> None:
    async def body(rt: CriRuntime) -> None:
        v = await rt.version()
        assert v.runtime_name == "containerd" and v.api_version == "v1"
        # the build asked for is the one that answers
        if ctd.build == "built":
            assert v.runtime_version == gobuild.TOOLS["containerd"].version
        else:
            assert v.runtime_version.startswith("1.6."), v.runtime_version
        conds = await rt.conditions()
        assert conds["RuntimeReady"][0] is True
        assert conds["NetworkReady"][0] is True  # the bridge conflist was written
        assert await rt.image_present(BUSYBOX_IMAGE)
        assert await rt.image_present(PAUSE_IMAGE)
        assert not await rt.image_present("localhost/nodepulse/absent:1")
        names = {n for i in await rt.list_images() for n in i.names}
        assert {BUSYBOX_IMAGE, PAUSE_IMAGE} <= names
    run(body, ctd)


def test_host_network_pod_lifecycle_kill_and_restart(ctd: Containerd) -> None:
    p = pod("hn", "uid-hn", ["sh", "-c", "echo $GREETING from $(hostname); exec sleep 3600"])

    async def body(rt: CriRuntime) -> None:
        sc, sid, cid = await start_pod(rt, ctd, p)
        # the pod's shim is the build's own (2.x never runs Debian's 1.6 shim)
        shims = {os.readlink(f"/proc/{pid}/exe") for pid in ctd.shim_pids()}
        assert shims == {os.path.realpath(ctd.shim)}, shims
        calls = rt.calls
        listed = await rt.relist()
        assert rt.calls - calls == 2  # the relist is two calls
        c = next(c for c in listed.containers if c.id == cid)
        assert c.state == ContainerState.RUNNING and c.sandbox_id == sid
        assert (c.pod_uid, c.name, c.attempt, c.restart_count) == ("uid-hn", "main", 0, 0)
        assert c.labels[LABEL_CONTAINER_NAME] == "main" and c.labels[LABEL_ATTEMPT] == "0"
        assert c.labels[LABEL_POD_UID] == "uid-hn"
        sb = next(s for s in listed.sandboxes if s.id == sid)
        assert sb.state == SandboxState.READY and sb.host_network
        assert (sb.labels[LABEL_POD_NAME], sb.labels[LABEL_POD_NAMESPACE]) == ("hn", "e2e")

        # the container's log is in CRI format under the sandbox's log directory
        log = Path(sc.log_directory) / "main" / "0.log"
        await eventually(lambda: _async(log.exists() and "stdout F hello from" in
                                        log.read_text()), "the container log line")

        # kill the container's process: the relist reports EXITED, status has the code
        pid = container_pid(ctd, cid)
        os.kill(pid, signal.SIGKILL)

        async def exited() -> bool:
            r = await rt.relist()
            return any(c.id == cid and c.state == ContainerState.EXITED for c in r.containers)
        await eventually(exited, "EXITED in the relist after SIGKILL")
        st = await rt.pod_status("uid-hn")
        dead = next(c for c in st.containers if c.id == cid)
        assert dead.exit_code == 137 and dead.reason == "Error" and dead.finished_at

        # an exited container cannot be started again: a restart is attempt + 1
        cc1 = ContainerConfig.from_pod(p, p["spec"]["containers"][0], attempt=1,
                                       restart_count=1)
        cid1 = await rt.create_container(sid, cc1, sc)
        await rt.start_container(cid1)
        st = await rt.pod_status("uid-hn")
        by_attempt = {c.attempt: c for c in st.containers}
        assert by_attempt[0].state == ContainerState.EXITED
        assert by_attempt[1].state == ContainerState.RUNNING
        assert by_attempt[1].restart_count == 1
        assert st.sandboxes[0].id == sid

        # a restarted agent (a new client) adopts the same objects from one relist
        again = CriRuntime(str(ctd.socket))
        try:
            adopted = await again.relist()
        finally:
            await again.close()
        mine = sorted((c.attempt, c.id) for c in adopted.containers if c.pod_uid == "uid-hn")
        assert mine == [(0, cid), (1, cid1)]

        await rt.stop_sandbox(sid)
        st = await rt.pod_status("uid-hn")
        assert st.sandboxes[0].state == SandboxState.NOTREADY
        assert all(c.state == ContainerState.EXITED for c in st.containers)
        await rt.remove_sandbox(sid)
        assert (await rt.pod_status("uid-hn")).containers == []
        # idempotent on what is gone
        await rt.stop_sandbox(sid)
        await rt.remove_sandbox(sid)
        await rt.stop_container(cid1, 1)
        await rt.remove_container(cid1)
    run(body, ctd)


def test_stop_honours_sigterm_and_kills_after_timeout(ctd: Containerd) -> None:
    polite = pod("polite", "uid-polite",
                 ["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"])
    stubborn = pod("stubborn", "uid-stubborn", ["sh", "-c", "trap '' TERM; sleep 3600 & wait"])

    async def body(rt: CriRuntime) -> None:
        _, sid1, c1 = await start_pod(rt, ctd, polite)
        _, sid2, c2 = await start_pod(rt, ctd, stubborn)
        # one exits on SIGTERM at once, the one ignoring it is killed after the timeout
        await asyncio.gather(rt.stop_container(c1, 30), rt.stop_container(c2, 1))
        codes = {c.id: c.exit_code for u in ("uid-polite", "uid-stubborn")
                 for c in (await rt.pod_status(u)).containers}
        assert codes == {c1: 0, c2: 137}
        for sid in (sid1, sid2):
            await rt.stop_sandbox(sid)
            await rt.remove_sandbox(sid)
    run(body, ctd)


def test_bridge_network_pod_gets_ip_and_serves(ctd: Containerd) -> None:
    p = pod("web", "uid-web",
            ["sh", "-c", "while true; do echo pong | nc -l -p 8080; done"], host_network=False)

    async def body(rt: CriRuntime) -> None:
        sc, sid, cid = await start_pod(rt, ctd, p)
        assert sc.hostname == "web"
        st = await rt.pod_status("uid-web")
        assert ipaddress.ip_address(st.ip) in ipaddress.ip_network(ctd.subnet)
        assert not st.sandboxes[0].host_network

        def fetch() -> str:
            with socket.create_connection((st.ip, 8080), timeout=2) as s:
                return s.recv(64).decode()

        async def answers() -> bool:
            try:
                return (await asyncio.to_thread(fetch)).strip() == "pong"
            except OSError:
                return False
        await eventually(answers, f"pong from {st.ip}:8080")
        await rt.stop_sandbox(sid)
        await rt.remove_sandbox(sid)
    run(body, ctd)


def test_errors_map_to_the_interface(ctd: Containerd) -> None:
    p = pod("err", "uid-err", ["sleep", "3600"])

    async def body(rt: CriRuntime) -> None:
        sc = SandboxConfig.from_pod(p)
        sid = await rt.run_sandbox(sc)
        missing = ContainerConfig.from_pod(
            p, {**p["spec"]["containers"][0], "image": "localhost/nodepulse/absent:1"})
        with pytest.raises(ImageNotPresent, match="absent:1"):
            await rt.create_container(sid, missing, sc)
        cc = ContainerConfig.from_pod(p, p["spec"]["containers"][0])
        with pytest.raises(NotFound):
            await rt.create_container("0" * 64, cc, sc)
        with pytest.raises(NotFound):
            await rt.start_container("0" * 64)
        assert (await rt.pod_status("no-such-uid")).containers == []
        await rt.stop_sandbox(sid)
        await rt.remove_sandbox(sid)

        gone = CriRuntime(str(ctd.base / "no-such.sock"), call_timeout=5)
        try:
            with pytest.raises(Unavailable):
                await gone.version()
        finally:
            await gone.close()
    run(body, ctd)


def test_client_recovers_when_containerd_restarts(ctd: Containerd) -> None:
    """containerd stops (its shims and containers keep running) and comes back: the
    same client reports Unavailable meanwhile, then sees the same running container."""
    p = pod("survivor", "uid-survivor", ["sleep", "3600"])

    async def body(rt: CriRuntime) -> None:
        _, sid, cid = await start_pod(rt, ctd, p)
        await asyncio.to_thread(ctd.kill_daemon)
        with pytest.raises(Unavailable):
            await rt.relist()
        await asyncio.to_thread(ctd.start_daemon)

        async def back() -> bool:
            try:
                r = await rt.relist()
            except Unavailable:
                return False
            return any(c.id == cid and c.state == ContainerState.RUNNING
                       for c in r.containers)
        await eventually(back, "the running container after containerd's restart")
        await rt.stop_sandbox(sid)
        await rt.remove_sandbox(sid)
    run(body, ctd)


def test_container_events(ctd: Containerd) -> None:
    """containerd 2.x streams a container's start, death and removal, each naming the
    pod; Debian's 1.6 has no GetContainerEvents, which the first read reports as
    Unsupported (the PLEG then relists only)."""
    p = pod("ev", "uid-ev", ["sleep", "3600"])

    async def body(rt: CriRuntime) -> None:
        events = await rt.container_events()
        seen: list[tuple[ContainerEventType, str, str]] = []

        async def read() -> None:
            async for ev in events:
                seen.append((ev.type, ev.pod_uid, ev.container_id))

        reader = asyncio.create_task(read())
        try:
            if ctd.build == "debian":
                with pytest.raises(Unsupported, match="GetContainerEvents"):
                    await asyncio.wait_for(reader, 20)
                return
            # containerd subscribes the call only once it has it: let that happen
            # before the first change (a real PLEG's relist covers that moment)
            await asyncio.sleep(1)
            _, sid, cid = await start_pod(rt, ctd, p)
            os.kill(container_pid(ctd, cid), signal.SIGKILL)
            await eventually(lambda: _async((ContainerEventType.DIED, "uid-ev", cid) in seen),
                             "the container's death as an event")
            await rt.stop_sandbox(sid)
            await rt.remove_sandbox(sid)
            await eventually(lambda: _async((ContainerEventType.REMOVED, "uid-ev", cid)
                                            in seen), "the container's removal as an event")
            mine = [t for t, _, c in seen if c == cid]
            assert mine == [ContainerEventType.STARTED, ContainerEventType.DIED,
                            ContainerEventType.REMOVED], seen
            # the sandbox's own changes carry the pod's uid too
            assert (ContainerEventType.STARTED, "uid-ev", sid) in seen, seen
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Unsupported):
                await reader
    run(body, ctd)


def test_zz_teardown_leaves_nothing_running(ctd: Containerd) -> None:
    """Runs last of its build's tests: stop the containerd (as the fixture does) and
    check containerd and every shim it started are gone."""
    c = ctd
    pid = c.pid
    assert pid is not None
    # leave a running pod behind on purpose: stop() must still clean it up
    async def leave_one(rt: CriRuntime) -> None:
        await start_pod(rt, c, pod("left", "uid-left", ["sleep", "3600"]))
    run(leave_one, c)
    assert c.shim_pids()
    c.stop()
    assert not _pid_alive(pid)
    assert c.shim_pids() == []
    assert not c.base.exists()


async def _async(value: bool) -> bool:
    return value
