"""CriRuntime against an in-process CRI server (grpc.aio on a unix socket in a temp
dir): what goes on the wire, how answers and errors map to the interface. The real
containerd is exercised in e2e/test_runtime_cri.py."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from prometheus_client import CollectorRegistry

from nodeagent.api.clock import FakeClock
from nodeagent.pods.pleg import Pleg
from nodeagent.runtime import (
    ContainerConfig,
    ContainerRuntimeError,
    ContainerState,
    ImageNotPresent,
    NotFound,
    PullFailed,
    RegistryAuth,
    RuntimeTimeout,
    SandboxConfig,
    SandboxState,
    Unavailable,
    Unsupported,
    make_runtime,
)
from nodeagent.runtime.base import (
    ANNOTATION_RESTART_COUNT,
    LABEL_CONTAINER_NAME,
    LABEL_POD_NAME,
    LABEL_POD_NAMESPACE,
    LABEL_POD_UID,
    Resources,
)
from nodeagent.runtime.cri import CriRuntime
from nodeagent.runtime.cri.criruntime import ANNOTATION_HOST_NETWORK, LABEL_ATTEMPT
from nodeagent.runtime.cri.gen import api_pb2 as pb
from nodeagent.runtime.cri.gen import api_pb2_grpc as pb_grpc
from tests.conftest import aio, mkpod, until


class FakeCri(pb_grpc.RuntimeServiceServicer, pb_grpc.ImageServiceServicer):
    """Just enough of a CRI runtime, in memory, recording every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.sandboxes: dict[str, pb.PodSandboxStatus] = {}
        self.containers: dict[str, pb.ContainerStatus] = {}
        self.container_sandbox: dict[str, str] = {}
        self.images = {"localhost/busybox:1"}
        self.registry: dict[str, tuple[str, str] | None] = {}  # ref -> (user, password)
        self.hang: set[str] = set()
        self.vanish_on_status: set[str] = set()
        self._ids = itertools.count(1)
        # GetContainerEvents: off answers UNIMPLEMENTED, as containerd 1.6 does
        self.streams_events = True
        self.event_streams: list[asyncio.Queue[pb.ContainerEventResponse | grpc.StatusCode]] = []

    def event(self, rid: str, kind: pb.ContainerEventType) -> None:
        """What containerd sends on a change: the sandbox's status and the container's."""
        sb = self.sandboxes.get(self.container_sandbox.get(rid, rid))
        c = self.containers.get(rid)
        r = pb.ContainerEventResponse(container_id=rid, container_event_type=kind,
                                      created_at=3 * 10**18, pod_sandbox_status=sb,
                                      containers_statuses=[c] if c else [])
        for q in self.event_streams:
            q.put_nowait(r)

    async def GetContainerEvents(self, req: Any, ctx: Any) -> AsyncIterator[Any]:
        await self._record("GetContainerEvents", req, ctx)
        if not self.streams_events:
            await ctx.abort(grpc.StatusCode.UNIMPLEMENTED, "unknown method GetContainerEvents "
                            "for service runtime.v1.RuntimeService")
        q: asyncio.Queue[pb.ContainerEventResponse | grpc.StatusCode] = asyncio.Queue()
        self.event_streams.append(q)
        try:
            while True:
                item = await q.get()
                if isinstance(item, grpc.StatusCode):
                    await ctx.abort(item, "the runtime is going away")
                yield item
        finally:
            self.event_streams.remove(q)

    async def _record(self, name: str, req: Any, ctx: grpc.aio.ServicerContext) -> None:
        self.requests.append((name, req))
        if name in self.hang:
            await asyncio.Event().wait()

    def calls(self, name: str | None = None) -> int:
        return sum(1 for n, _ in self.requests if name is None or n == name)

    def last(self, name: str) -> Any:
        return [r for n, r in self.requests if n == name][-1]

    @staticmethod
    def _match(labels: Any, selector: Any) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    async def Version(self, req: Any, ctx: Any) -> pb.VersionResponse:
        await self._record("Version", req, ctx)
        return pb.VersionResponse(version="0.1.0", runtime_name="fakecri",
                                  runtime_version="9.9", runtime_api_version="v1")

    async def RunPodSandbox(self, req: Any, ctx: Any) -> pb.RunPodSandboxResponse:
        await self._record("RunPodSandbox", req, ctx)
        sid = f"sb{next(self._ids)}"
        c = req.config
        self.sandboxes[sid] = pb.PodSandboxStatus(
            id=sid, metadata=c.metadata, state=pb.SANDBOX_READY, created_at=10**18,
            network=pb.PodSandboxNetworkStatus(ip="10.88.0.7"),
            labels=c.labels, annotations=c.annotations)
        self.event(sid, pb.CONTAINER_STARTED_EVENT)
        return pb.RunPodSandboxResponse(pod_sandbox_id=sid)

    async def StopPodSandbox(self, req: Any, ctx: Any) -> pb.StopPodSandboxResponse:
        await self._record("StopPodSandbox", req, ctx)
        if req.pod_sandbox_id not in self.sandboxes:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {req.pod_sandbox_id}")
        self.sandboxes[req.pod_sandbox_id].state = pb.SANDBOX_NOTREADY
        return pb.StopPodSandboxResponse()

    async def RemovePodSandbox(self, req: Any, ctx: Any) -> pb.RemovePodSandboxResponse:
        await self._record("RemovePodSandbox", req, ctx)
        if self.sandboxes.pop(req.pod_sandbox_id, None) is None:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {req.pod_sandbox_id}")
        return pb.RemovePodSandboxResponse()

    async def PodSandboxStatus(self, req: Any, ctx: Any) -> pb.PodSandboxStatusResponse:
        await self._record("PodSandboxStatus", req, ctx)
        if req.pod_sandbox_id not in self.sandboxes:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {req.pod_sandbox_id}")
        return pb.PodSandboxStatusResponse(status=self.sandboxes[req.pod_sandbox_id])

    async def ListPodSandbox(self, req: Any, ctx: Any) -> pb.ListPodSandboxResponse:
        await self._record("ListPodSandbox", req, ctx)
        return pb.ListPodSandboxResponse(items=[
            pb.PodSandbox(id=s.id, metadata=s.metadata, state=s.state,
                          created_at=s.created_at, labels=s.labels, annotations=s.annotations)
            for s in self.sandboxes.values()
            if self._match(s.labels, req.filter.label_selector)])

    async def CreateContainer(self, req: Any, ctx: Any) -> pb.CreateContainerResponse:
        await self._record("CreateContainer", req, ctx)
        if req.pod_sandbox_id not in self.sandboxes:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {req.pod_sandbox_id}")
        cid = f"c{next(self._ids)}"
        c = req.config
        self.containers[cid] = pb.ContainerStatus(
            id=cid, metadata=c.metadata, state=pb.CONTAINER_CREATED, created_at=2 * 10**18,
            image=c.image, image_ref="sha256:abc", labels=c.labels, annotations=c.annotations,
            resources=pb.ContainerResources(linux=c.linux.resources))
        self.container_sandbox[cid] = req.pod_sandbox_id
        self.event(cid, pb.CONTAINER_CREATED_EVENT)
        return pb.CreateContainerResponse(container_id=cid)

    async def StartContainer(self, req: Any, ctx: Any) -> pb.StartContainerResponse:
        await self._record("StartContainer", req, ctx)
        c = self.containers.get(req.container_id)
        if c is None:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"container {req.container_id}")
        elif c.state != pb.CONTAINER_CREATED:
            await ctx.abort(grpc.StatusCode.UNKNOWN, "container is in EXITED state")
        else:
            c.state, c.started_at = pb.CONTAINER_RUNNING, 2 * 10**18 + 1
            self.event(req.container_id, pb.CONTAINER_STARTED_EVENT)
        return pb.StartContainerResponse()

    def exit(self, cid: str, code: int, reason: str) -> None:
        c = self.containers[cid]
        c.state, c.exit_code, c.reason, c.finished_at = pb.CONTAINER_EXITED, code, reason, \
            2 * 10**18 + 5 * 10**9
        self.event(cid, pb.CONTAINER_STOPPED_EVENT)

    async def StopContainer(self, req: Any, ctx: Any) -> pb.StopContainerResponse:
        await self._record("StopContainer", req, ctx)
        if req.container_id not in self.containers:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"container {req.container_id}")
        self.exit(req.container_id, 143, "Error")
        return pb.StopContainerResponse()

    async def UpdateContainerResources(self, req: Any, ctx: Any
                                       ) -> pb.UpdateContainerResourcesResponse:
        await self._record("UpdateContainerResources", req, ctx)
        if req.container_id not in self.containers:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"container {req.container_id}")
        self.containers[req.container_id].resources.linux.CopyFrom(req.linux)
        return pb.UpdateContainerResourcesResponse()

    async def RemoveContainer(self, req: Any, ctx: Any) -> pb.RemoveContainerResponse:
        await self._record("RemoveContainer", req, ctx)
        if self.containers.pop(req.container_id, None) is None:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"container {req.container_id}")
        self.event(req.container_id, pb.CONTAINER_DELETED_EVENT)
        return pb.RemoveContainerResponse()

    async def ListContainers(self, req: Any, ctx: Any) -> pb.ListContainersResponse:
        await self._record("ListContainers", req, ctx)
        return pb.ListContainersResponse(containers=[
            pb.Container(id=c.id, pod_sandbox_id=self.container_sandbox.get(c.id, ""),
                         metadata=c.metadata, image=c.image, image_ref=c.image_ref,
                         state=c.state, created_at=c.created_at, labels=c.labels,
                         annotations=c.annotations)
            for c in self.containers.values()
            if self._match(c.labels, req.filter.label_selector)])

    async def ContainerStatus(self, req: Any, ctx: Any) -> pb.ContainerStatusResponse:
        await self._record("ContainerStatus", req, ctx)
        if req.container_id in self.vanish_on_status:
            self.containers.pop(req.container_id, None)
        if req.container_id not in self.containers:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"container {req.container_id}")
        return pb.ContainerStatusResponse(status=self.containers[req.container_id])

    async def Status(self, req: Any, ctx: Any) -> pb.StatusResponse:
        await self._record("Status", req, ctx)
        # containerd's verbose answer carries its configuration, the sandbox image in it
        info = {"config": '{"sandboxImage": "localhost/pause:1"}'} if req.verbose else {}
        return pb.StatusResponse(status=pb.RuntimeStatus(conditions=[
            pb.RuntimeCondition(type="RuntimeReady", status=True),
            pb.RuntimeCondition(type="NetworkReady", status=False,
                                reason="NetworkPluginNotReady")]), info=info)

    async def RemoveImage(self, req: Any, ctx: Any) -> pb.RemoveImageResponse:
        await self._record("RemoveImage", req, ctx)
        gone = [n for i, n in enumerate(sorted(self.images)) if f"sha256:{i}" ==
                req.image.image]
        if not gone:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"image {req.image.image}")
        self.images -= set(gone)
        return pb.RemoveImageResponse()

    async def ImageFsInfo(self, req: Any, ctx: Any) -> pb.ImageFsInfoResponse:
        await self._record("ImageFsInfo", req, ctx)
        return pb.ImageFsInfoResponse(image_filesystems=[pb.FilesystemUsage(
            timestamp=1, fs_id=pb.FilesystemIdentifier(mountpoint="/var/lib/containerd/x"),
            used_bytes=pb.UInt64Value(value=4096), inodes_used=pb.UInt64Value(value=7))])

    async def ImageStatus(self, req: Any, ctx: Any) -> pb.ImageStatusResponse:
        await self._record("ImageStatus", req, ctx)
        if req.image.image not in self.images | {"sha256:abc"}:
            return pb.ImageStatusResponse()  # missing: OK with no image, as containerd
        return pb.ImageStatusResponse(image=pb.Image(id="sha256:abc",
                                                     repo_tags=[req.image.image], size=42))

    async def PullImage(self, req: Any, ctx: grpc.aio.ServicerContext) -> pb.PullImageResponse:
        await self._record("PullImage", req, ctx)
        ref = req.image.image
        if ref not in self.registry:
            await ctx.abort(grpc.StatusCode.UNKNOWN, f"failed to resolve reference {ref!r}: "
                            "not found")
        need = self.registry[ref]
        if need is not None and (req.auth.username, req.auth.password) != need:
            await ctx.abort(grpc.StatusCode.UNKNOWN, f"pull {ref!r}: 401 Unauthorized")
        self.images.add(ref)
        return pb.PullImageResponse(image_ref="sha256:abc")

    async def ListImages(self, req: Any, ctx: Any) -> pb.ListImagesResponse:
        await self._record("ListImages", req, ctx)
        return pb.ListImagesResponse(images=[
            pb.Image(id=f"sha256:{i}", repo_tags=[n], size=42)
            for i, n in enumerate(sorted(self.images))])


@asynccontextmanager
async def served(tmp_path: Path, **kw: Any) -> AsyncIterator[tuple[FakeCri, CriRuntime]]:
    fake = FakeCri()
    server = grpc.aio.server()
    pb_grpc.add_RuntimeServiceServicer_to_server(fake, server)
    pb_grpc.add_ImageServiceServicer_to_server(fake, server)
    sock = tmp_path / "cri.sock"
    server.add_insecure_port(f"unix://{sock}")
    await server.start()
    rt = make_runtime("cri", f"unix://{sock}", **kw)
    assert isinstance(rt, CriRuntime)
    try:
        yield fake, rt
    finally:
        await rt.close()
        await server.stop(None)


def pod(uid: str = "u1", name: str = "p", host_network: bool = False) -> dict:
    return mkpod(name, uid, node=None, policy=None, phase=None, labels={"app": "a"},
                 hostNetwork=host_network, containers=[{
                     "name": "c", "image": "localhost/busybox:1", "command": ["sleep"],
                     "args": ["60"], "env": [{"name": "A", "value": "1"}],
                     "resources": {"requests": {"cpu": "100m"},
                                   "limits": {"cpu": "250m", "memory": "64Mi"}}}])


async def start(rt: CriRuntime, p: dict, attempt: int = 0,
                log_root: str = "/var/log/pods") -> tuple[str, str]:
    sc = SandboxConfig.from_pod(p, log_root=log_root)
    sid = await rt.run_sandbox(sc)
    cc = ContainerConfig.from_pod(p, p["spec"]["containers"][0], attempt=attempt,
                                  restart_count=attempt)
    cid = await rt.create_container(sid, cc, sc)
    await rt.start_container(cid)
    return sid, cid


@aio
async def test_relist_is_two_calls_whatever_the_pod_count(tmp_path: Path) -> None:
    async with served(tmp_path) as (fake, rt):
        for n in (1, 50):
            for i in range(len(fake.sandboxes), n):
                await start(rt, pod(uid=f"u{i}", name=f"p{i}"))
            before = fake.calls()
            listed = await rt.relist()
            assert fake.calls() - before == 2
            assert {n for n, _ in fake.requests[before:]} == {"ListPodSandbox",
                                                              "ListContainers"}
            assert len(listed.sandboxes) == len(listed.containers) == n
        # objects that are not ours (no pod uid label) are left out
        fake.sandboxes["foreign"] = pb.PodSandboxStatus(id="foreign", labels={"x": "y"})
        fake.containers["foreign-c"] = pb.ContainerStatus(id="foreign-c")
        listed = await rt.relist()
        assert "foreign" not in {s.id for s in listed.sandboxes}
        assert "foreign-c" not in {c.id for c in listed.containers}


@aio
async def test_sandbox_and_container_requests_carry_identity_and_config(
        tmp_path: Path) -> None:
    async with served(tmp_path) as (fake, rt):
        sid, cid = await start(rt, pod(host_network=True), attempt=2)
        req = fake.last("RunPodSandbox").config
        assert req.hostname == ""  # containerd refuses a hostname on the host network
        assert req.linux.security_context.namespace_options.network == pb.NODE
        assert (req.metadata.name, req.metadata.namespace, req.metadata.uid) == ("p", "ns", "u1")
        assert req.log_directory == "/var/log/pods/ns_p_u1"
        assert req.labels[LABEL_POD_UID] == "u1" and req.labels["app"] == "a"
        assert req.annotations[ANNOTATION_HOST_NETWORK] == "true"
        creq = fake.last("CreateContainer")
        cfg = creq.config
        assert creq.pod_sandbox_id == sid and creq.sandbox_config == req
        assert (cfg.metadata.name, cfg.metadata.attempt) == ("c", 2)
        assert list(cfg.command) == ["sleep"] and list(cfg.args) == ["60"]
        assert [(e.key, e.value) for e in cfg.envs] == [("A", "1")]
        assert cfg.log_path == "c/2.log"
        assert cfg.labels[LABEL_CONTAINER_NAME] == "c" and cfg.labels[LABEL_ATTEMPT] == "2"
        assert cfg.labels[LABEL_POD_NAME] == "p" and cfg.labels[LABEL_POD_NAMESPACE] == "ns"
        assert cfg.annotations[ANNOTATION_RESTART_COUNT] == "2"
        res = cfg.linux.resources
        assert (res.cpu_shares, res.cpu_quota, res.cpu_period) == (102, 25000, 100000)
        assert res.memory_limit_in_bytes == 64 * 2**20
        # a pod network pod gets its hostname; the relist says which is which
        await start(rt, pod(uid="u2", name="web"))
        assert fake.last("RunPodSandbox").config.hostname == "web"
        assert fake.last("RunPodSandbox").config.linux.security_context \
            .namespace_options.network == pb.POD
        by_uid = {s.pod_uid: s for s in (await rt.relist()).sandboxes}
        assert by_uid["u1"].host_network and not by_uid["u2"].host_network


@aio
async def test_pod_status_details_and_adoption_fields(tmp_path: Path) -> None:
    async with served(tmp_path) as (fake, rt):
        sid, c0 = await start(rt, pod())
        fake.exit(c0, 137, "Error")
        _, other = await start(rt, pod(uid="u9", name="other"))
        sc = SandboxConfig.from_pod(pod())
        c1 = await rt.create_container(sid, ContainerConfig.from_pod(
            pod(), pod()["spec"]["containers"][0], attempt=1, restart_count=1), sc)
        await rt.start_container(c1)
        st = await rt.pod_status("u1")
        assert fake.last("ListContainers").filter.label_selector[LABEL_POD_UID] == "u1"
        assert st.ip == "10.88.0.7" and st.sandboxes[0].state == SandboxState.READY
        by_attempt = {c.attempt: c for c in st.containers}
        assert other not in {c.id for c in st.containers}
        dead, live = by_attempt[0], by_attempt[1]
        assert (dead.state, dead.exit_code, dead.reason) == (ContainerState.EXITED, 137, "Error")
        assert dead.finished_at and dead.started_at and dead.finished_at > dead.started_at
        assert (live.state, live.exit_code, live.restart_count) == (
            ContainerState.RUNNING, None, 1)
        assert live.image_id == "sha256:abc" and live.image == "localhost/busybox:1"
        # a container removed between the list and its status is just absent
        fake.vanish_on_status.add(c0)
        assert [c.id for c in (await rt.pod_status("u1")).containers] == [c1]
        assert (await rt.pod_status("unknown")).containers == []


@aio
async def test_a_resize_is_sent_and_what_the_runtime_applied_is_read_back(
        tmp_path: Path) -> None:
    """UpdateContainerResources carries the cgroup settings; the container's status
    gives them back in the spec's units, the kubelet's way (the request from the shares,
    rounded up; the limit from quota and period; no memory request)."""
    p = pod()
    p["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "250m"},
                                               "limits": {"cpu": "500m", "memory": "64Mi"}}
    async with served(tmp_path) as (fake, rt):
        _, cid = await start(rt, p)
        [c] = (await rt.pod_status("u1")).containers
        assert c.resources == Resources(250, 500, None, 64 * 2**20)
        await rt.update_container_resources(cid, Resources(300, 600, 32 * 2**20, 128 * 2**20),
                                            oom_score_adj=900)
        sent = fake.last("UpdateContainerResources")
        assert sent.container_id == cid
        assert (sent.linux.cpu_shares, sent.linux.cpu_quota, sent.linux.cpu_period,
                sent.linux.memory_limit_in_bytes, sent.linux.oom_score_adj) == (
            307, 60000, 100000, 128 * 2**20, 900)
        [c] = (await rt.pod_status("u1")).containers
        assert c.resources == Resources(300, 600, None, 128 * 2**20)
        with pytest.raises(NotFound):
            await rt.update_container_resources("nope", Resources())


@aio
async def test_errors_map_to_the_interface(tmp_path: Path) -> None:
    async with served(tmp_path) as (fake, rt):
        with pytest.raises(NotFound, match="StartContainer nope"):
            await rt.start_container("nope")
        sid, cid = await start(rt, pod())
        fake.exit(cid, 0, "Completed")
        with pytest.raises(ContainerRuntimeError, match="EXITED") as err:
            await rt.start_container(cid)
        assert not isinstance(err.value, NotFound)
        p = pod()
        p["spec"]["containers"][0]["image"] = "localhost/absent:1"
        sc = SandboxConfig.from_pod(p)
        with pytest.raises(ImageNotPresent, match="absent:1"):
            await rt.create_container(sid, ContainerConfig.from_pod(
                p, p["spec"]["containers"][0]), sc)
        assert fake.calls("CreateContainer") == 1  # never sent for a missing image
        with pytest.raises(NotFound):
            await rt.create_container("nope", ContainerConfig.from_pod(
                pod(), pod()["spec"]["containers"][0]), sc)
        # stop and remove are idempotent: NOT_FOUND is success
        await rt.stop_container("nope", 1)
        await rt.remove_container("nope")
        await rt.stop_sandbox("nope")
        await rt.remove_sandbox("nope")
        assert fake.calls("RemovePodSandbox") == 1


@aio
async def test_every_call_has_a_deadline(tmp_path: Path) -> None:
    # deadlines long enough for the calls that must succeed on a loaded machine
    async with served(tmp_path, call_timeout=0.5, request_timeout=1.0) as (fake, rt):
        fake.hang.add("ListContainers")
        with pytest.raises(RuntimeTimeout, match="ListContainers"):
            await rt.relist()
        _, cid = await start(rt, pod())
        fake.hang.add("CreateContainer")
        sc = SandboxConfig.from_pod(pod(uid="u2"))
        sid = await rt.run_sandbox(sc)
        with pytest.raises(RuntimeTimeout, match="CreateContainer"):
            await rt.create_container(sid, ContainerConfig.from_pod(
                pod(uid="u2"), pod()["spec"]["containers"][0]), sc)
        # StopContainer's deadline covers the grace timeout (whole seconds, rounded up)
        await rt.stop_container(cid, 1.2)
        assert fake.last("StopContainer").timeout == 2


@aio
async def test_unreachable_socket_is_unavailable(tmp_path: Path) -> None:
    rt = CriRuntime(str(tmp_path / "nothing.sock"), call_timeout=5)
    try:
        with pytest.raises(Unavailable, match="Version"):
            await rt.version()
    finally:
        await rt.close()


@aio
async def test_version_conditions_and_images(tmp_path: Path) -> None:
    async with served(tmp_path) as (fake, rt):
        v = await rt.version()
        assert (v.runtime_name, v.runtime_version, v.api_version) == ("fakecri", "9.9", "v1")
        assert await rt.conditions() == {"RuntimeReady": (True, ""),
                                         "NetworkReady": (False, "reason:NetworkPluginNotReady")}
        assert await rt.image_present("localhost/busybox:1")
        assert not await rt.image_present("localhost/absent:1")
        fake.images.add("localhost/pause:1")
        imgs = await rt.list_images()
        assert [(i.names, i.size_bytes) for i in imgs] == [
            (["localhost/busybox:1"], 42), (["localhost/pause:1"], 42)]


@aio
async def test_image_removal_the_image_filesystem_and_the_pinned_sandbox_image(
        tmp_path: Path) -> None:
    async with served(tmp_path) as (fake, rt):
        fake.images |= {"localhost/pause:1", "localhost/old:1"}
        imgs = {i.names[0]: i for i in await rt.list_images()}
        # containerd 1.6 pins nothing itself: the sandbox image of its config is pinned
        assert {n: i.pinned for n, i in imgs.items()} == {
            "localhost/busybox:1": False, "localhost/old:1": False, "localhost/pause:1": True}
        await rt.remove_image(imgs["localhost/old:1"].id)
        assert fake.images == {"localhost/busybox:1", "localhost/pause:1"}
        await rt.remove_image("sha256:gone")  # idempotent: NOT_FOUND is fine
        fs = await rt.image_fs_info()
        assert (fs.mountpoint, fs.used_bytes, fs.inodes_used) == ("/var/lib/containerd/x",
                                                                  4096, 7)
        assert [n for n, _ in fake.requests].count("Status") == 1  # read once


@aio
async def test_pull_image_sends_the_credentials_and_maps_refusals(tmp_path: Path) -> None:
    async with served(tmp_path) as (fake, rt):
        fake.registry = {"reg.example/app:1": ("u", "p"), "reg.example/open:1": None}
        info = await rt.pull_image("reg.example/open:1")
        assert (info.id, info.size_bytes) == ("sha256:abc", 42)
        assert not fake.last("PullImage").HasField("auth")
        with pytest.raises(PullFailed, match="401 Unauthorized"):
            await rt.pull_image("reg.example/app:1", RegistryAuth(username="u", password="x"))
        with pytest.raises(PullFailed, match="not found"):
            await rt.pull_image("reg.example/nothing:1")
        await rt.pull_image("reg.example/app:1", RegistryAuth(username="u", password="p",
                                                              server_address="reg.example"))
        sent = fake.last("PullImage")
        assert (sent.image.image, sent.auth.username, sent.auth.password,
                sent.auth.server_address) == ("reg.example/app:1", "u", "p", "reg.example")
        assert await rt.image_present("reg.example/app:1")
        assert "s3cret" not in repr(RegistryAuth(username="u", password="s3cret"))  # never logged


def test_constructor_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="socket"):
        CriRuntime("")
    with pytest.raises(ValueError, match="request_timeout"):
        CriRuntime("/x.sock", request_timeout=0)


def test_mounts_reach_the_container_config() -> None:
    from nodeagent.runtime.base import ContainerConfig, Mount, SandboxConfig
    from nodeagent.runtime.cri.criruntime import container_config_pb
    pod = mkpod("p")
    config = ContainerConfig.from_pod(pod, pod["spec"]["containers"][0])
    config.mounts = [Mount("/data", "/var/lib/x/data", read_only=True)]
    msg = container_config_pb(config, SandboxConfig.from_pod(pod))
    assert [(m.container_path, m.host_path, m.readonly) for m in msg.mounts] == \
        [("/data", "/var/lib/x/data", True)]


def test_security_namespaces_sysctls_and_dns_reach_cri() -> None:
    from nodeagent.runtime.base import ContainerConfig, DnsConfig, SandboxConfig
    from nodeagent.runtime.cri.criruntime import container_config_pb, sandbox_config_pb
    pod = mkpod("p", hostPID=True, shareProcessNamespace=True, containers=[{
        "name": "c", "image": "i", "securityContext": {
            "runAsUser": 65534, "privileged": True, "allowPrivilegeEscalation": False,
            "capabilities": {"add": ["NET_ADMIN"], "drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
            "seLinuxOptions": {"level": "s0:c1"}}}],
        securityContext={"runAsGroup": 3000, "fsGroup": 2000, "supplementalGroups": [7],
                         "sysctls": [{"name": "kernel.shm_rmid_forced", "value": "1"}]},
        overhead={"cpu": "250m", "memory": "64Mi"})
    sc = SandboxConfig.from_pod(pod)
    sc.dns = DnsConfig(("10.0.0.10",), ("ns.svc.cluster.local",), ("ndots:5",))
    sb = sandbox_config_pb(sc)
    lsc = sb.linux.security_context
    assert lsc.namespace_options.pid == pb.NODE and lsc.namespace_options.ipc == pb.POD
    assert lsc.run_as_group.value == 3000 and not lsc.HasField("run_as_user")
    assert list(lsc.supplemental_groups) == [2000, 7] and lsc.privileged
    assert lsc.seccomp.profile_type == pb.SecurityProfile.RuntimeDefault
    assert dict(sb.linux.sysctls) == {"kernel.shm_rmid_forced": "1"}
    assert sb.linux.overhead.cpu_quota == 25_000
    assert sb.linux.overhead.memory_limit_in_bytes == 64 * 2**20
    assert list(sb.dns_config.servers) == ["10.0.0.10"]
    assert list(sb.dns_config.options) == ["ndots:5"]
    c = container_config_pb(ContainerConfig.from_pod(pod, pod["spec"]["containers"][0]), sc)
    csc = c.linux.security_context
    assert csc.run_as_user.value == 65534 and csc.run_as_group.value == 3000
    assert csc.privileged and csc.no_new_privs
    assert list(csc.capabilities.add_capabilities) == ["NET_ADMIN"]
    assert list(csc.capabilities.drop_capabilities) == ["ALL"]
    assert csc.seccomp.profile_type == pb.SecurityProfile.RuntimeDefault
    assert csc.selinux_options.level == "s0:c1"
    assert csc.namespace_options.pid == pb.NODE
    plain = mkpod("q")
    qsc = SandboxConfig.from_pod(plain)
    q = container_config_pb(ContainerConfig.from_pod(plain, plain["spec"]["containers"][0]),
                            qsc)
    qs = q.linux.security_context
    assert not qs.HasField("run_as_user") and not qs.no_new_privs and not qs.privileged
    assert qs.seccomp.profile_type == pb.SecurityProfile.Unconfined  # the kubelet's default
    assert qs.namespace_options.pid == pb.CONTAINER
    assert not sandbox_config_pb(qsc).HasField("dns_config")  # the node's resolv.conf


def test_cgroup_parent_and_oom_score_adj_reach_cri() -> None:
    from nodeagent.runtime.base import ContainerConfig, SandboxConfig
    from nodeagent.runtime.cri.criruntime import container_config_pb, sandbox_config_pb
    pod = mkpod("p")
    sc = SandboxConfig.from_pod(pod)
    sc.cgroup_parent = "/kubepods/besteffort/poduid-p"
    assert sandbox_config_pb(sc).linux.cgroup_parent == "/kubepods/besteffort/poduid-p"
    cc = ContainerConfig.from_pod(pod, pod["spec"]["containers"][0])
    cc.oom_score_adj = 1000
    msg = container_config_pb(cc, sc)
    assert msg.linux.resources.oom_score_adj == 1000
    assert msg.linux.resources.cpu_shares == 2


@aio
async def test_container_events_from_get_container_events(tmp_path: Path) -> None:
    async with served(tmp_path) as (fake, rt):
        events = await rt.container_events()
        await until(lambda: fake.event_streams != [], "the server has the stream")

        async def next_event() -> tuple[str, str, str]:
            ev = await asyncio.wait_for(anext(events), 5)
            return ev.type.value, ev.pod_uid, ev.container_id

        sid, cid = await start(rt, pod("u1"))
        # created is left out: the agent's own doing, followed by its start
        assert await next_event() == ("started", "u1", sid)
        assert await next_event() == ("started", "u1", cid)
        fake.exit(cid, 1, "Error")
        assert await next_event() == ("died", "u1", cid)
        # an object that is not ours (no pod uid label) is left out, as from a relist
        fake.containers["other"] = pb.ContainerStatus(id="other", state=pb.CONTAINER_EXITED)
        fake.event("other", pb.CONTAINER_STOPPED_EVENT)
        await rt.remove_container(cid)
        assert await next_event() == ("removed", "u1", cid)
        # the runtime goes away: the stream fails with the interface's error
        fake.event_streams[0].put_nowait(grpc.StatusCode.UNAVAILABLE)
        with pytest.raises(Unavailable, match="GetContainerEvents"):
            await next_event()
        await until(lambda: fake.event_streams == [], "the server saw the stream end")


@aio
async def test_subscribing_to_a_runtime_that_is_down_fails(tmp_path: Path) -> None:
    """containerd answers a stream only with its first event, so the subscription asks
    for the runtime's version first: a runtime that is down fails the subscription
    itself, and the PLEG never takes the stream for up meanwhile."""
    down = make_runtime("cri", f"unix://{tmp_path / 'absent.sock'}", call_timeout=5)
    try:
        with pytest.raises(Unavailable, match="Version"):
            await down.container_events()
    finally:
        await down.close()
    async with served(tmp_path) as (fake, rt):
        await rt.container_events()
        assert fake.requests[0][0] == "Version"
        await until(lambda: fake.event_streams != [], "the server has the stream")


@aio
async def test_a_runtime_without_container_events_says_so(tmp_path: Path) -> None:
    """containerd 1.6 answers UNIMPLEMENTED, at the stream's first read; the PLEG then
    only relists."""
    async with served(tmp_path) as (fake, rt):
        fake.streams_events = False
        events = await rt.container_events()
        with pytest.raises(Unsupported, match="UNIMPLEMENTED|unknown method"):
            await asyncio.wait_for(anext(events), 5)
        pleg = Pleg(rt, FakeClock(), registry=CollectorRegistry())
        pleg.start()
        await until(lambda: pleg._watcher is not None and pleg._watcher.done(),
                    "the PLEG gave up on events")  # a failed stream would be retried
        assert fake.calls("GetContainerEvents") == 2 and not pleg.evented
        await until(lambda: pleg.relists >= 1, "the PLEG relists")
        await pleg.stop()
