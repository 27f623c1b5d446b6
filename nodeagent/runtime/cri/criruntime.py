"""CriRuntime: the runtime interface over CRI v1 gRPC (grpc.aio) on a unix socket.

One relist is exactly two calls (ListPodSandbox + ListContainers) whatever the pod
count; details (exit codes, IPs, timestamps) come from pod_status, which PLEG asks
only for pods that changed. Every call has a deadline, and gRPC status codes map to
the interface's errors (NOT_FOUND -> NotFound, DEADLINE_EXCEEDED -> RuntimeTimeout,
UNAVAILABLE -> Unavailable). Container events come from GetContainerEvents where the
runtime has it (containerd 1.7 and 2.x; 1.6 answers UNIMPLEMENTED: relists only).

Identity for adoption lives in labels (pod uid/name/namespace, container name,
attempt) and annotations (restart count, spec hash), which containerd keeps with the
objects: a restarted agent rebuilds everything from one relist.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio

from nodeagent.runtime.base import (
    ANNOTATION_INIT,
    ANNOTATION_RESTART_COUNT,
    ANNOTATION_SPEC_HASH,
    LABEL_POD_NAME,
    LABEL_POD_NAMESPACE,
    LABEL_POD_UID,
    Container,
    ContainerConfig,
    ContainerEvent,
    ContainerEventType,
    ContainerRuntimeError,
    ContainerState,
    ContainerStats,
    ExecResult,
    ImageFsInfo,
    ImageInfo,
    ImageNotPresent,
    NotFound,
    PodRuntimeStatus,
    PullFailed,
    RegistryAuth,
    RelistResult,
    Resources,
    Runtime,
    RuntimeTimeout,
    RuntimeVersion,
    Sandbox,
    SandboxConfig,
    SandboxState,
    StreamRequest,
    Unavailable,
    Unsupported,
    int_or,
)
from nodeagent.runtime.cri.gen import api_pb2 as pb
from nodeagent.runtime.cri.gen import api_pb2_grpc as pb_grpc
from nodeagent.runtime.security import (
    LOCALHOST,
    RUNTIME_DEFAULT,
    UNCONFINED,
    Profile,
    SELinux,
)

LABEL_ATTEMPT = "nodepulse.dev/attempt"
# ListPodSandbox does not say whether a sandbox shares the host network; we keep it.
ANNOTATION_HOST_NETWORK = "nodepulse.dev/host-network"

CRI_CLIENT_VERSION = "0.1.0"
CPU_PERIOD_US = 100_000
MIN_CPU_SHARES = 2
MIN_CPU_QUOTA_US = 1000

# A local socket: reconnect quickly after a runtime restart instead of backing off
# for minutes; lists of many containers exceed gRPC's 4 MiB default.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]

T = TypeVar("T")

_CONTAINER_STATE = {
    pb.CONTAINER_CREATED: ContainerState.CREATED,
    pb.CONTAINER_RUNNING: ContainerState.RUNNING,
    pb.CONTAINER_EXITED: ContainerState.EXITED,
    pb.CONTAINER_UNKNOWN: ContainerState.UNKNOWN,
}
_SANDBOX_STATE = {pb.SANDBOX_READY: SandboxState.READY,
                  pb.SANDBOX_NOTREADY: SandboxState.NOTREADY}
# CONTAINER_CREATED_EVENT is left out: a creation is the agent's own doing, and what
# happens to the container next is an event of its own
_EVENT_TYPE = {pb.CONTAINER_STARTED_EVENT: ContainerEventType.STARTED,
               pb.CONTAINER_STOPPED_EVENT: ContainerEventType.DIED,
               pb.CONTAINER_DELETED_EVENT: ContainerEventType.REMOVED}


def _time(ns: int) -> dt.datetime | None:
    """CRI timestamps are unix nanoseconds; 0 means unset."""
    return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC) if ns else None


def map_error(err: grpc.aio.AioRpcError | grpc.RpcError, what: str) -> ContainerRuntimeError:
    """A gRPC failure as the interface's error; the message names the call and object."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    msg = f"cri {what}: {code.name if code else 'error'}: {details}"
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(msg)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RuntimeTimeout(msg)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(msg)
    return ContainerRuntimeError(msg)


def linux_resources(r: Resources, oom_score_adj: int | None = None
                    ) -> pb.LinuxContainerResources:
    """Pod spec resources as cgroup settings (the kubelet's arithmetic: shares from
    the CPU request, CFS quota from the CPU limit, memory limit as is), and the
    processes' OOM score adjustment."""
    out = pb.LinuxContainerResources(oom_score_adj=oom_score_adj or 0)
    millis = r.cpu_request_millis if r.cpu_request_millis is not None else r.cpu_limit_millis
    out.cpu_shares = max(MIN_CPU_SHARES, (millis or 0) * 1024 // 1000)
    if r.cpu_limit_millis:
        out.cpu_period = CPU_PERIOD_US
        out.cpu_quota = max(MIN_CPU_QUOTA_US, r.cpu_limit_millis * CPU_PERIOD_US // 1000)
    if r.memory_limit_bytes:
        out.memory_limit_in_bytes = r.memory_limit_bytes
    return out


def applied_resources(r: pb.LinuxContainerResources) -> Resources | None:
    """The CPU and memory a container's status says the runtime applied, back in the
    spec's units (the kubelet's conversion: the request from the shares, the limit from
    quota and period); None when it says nothing. No memory request: cgroups have none."""
    request = -(-r.cpu_shares * 1000 // 1024) if r.cpu_shares >= MIN_CPU_SHARES else 0
    limit = r.cpu_quota * 1000 // r.cpu_period if r.cpu_period > 0 and r.cpu_quota > 0 else 0
    memory = r.memory_limit_in_bytes
    if not (request or limit or memory > 0):
        return None
    return Resources(cpu_request_millis=request or None, cpu_limit_millis=limit or None,
                     memory_limit_bytes=memory if memory > 0 else None)


def namespaces_pb(c: SandboxConfig, target_id: str = "") -> pb.NamespaceOption:
    """hostNetwork/hostPID/hostIPC share the node's; shareProcessNamespace makes one
    PID namespace for the pod, else each container has its own, or, with `target_id`
    (an ephemeral container's target), that container's."""
    sec = c.security
    pid = pb.NODE if sec.host_pid else pb.POD if sec.share_process_namespace \
        else pb.TARGET if target_id else pb.CONTAINER
    return pb.NamespaceOption(network=pb.NODE if c.host_network else pb.POD, pid=pid,
                              ipc=pb.NODE if sec.host_ipc else pb.POD,
                              target_id=target_id if pid == pb.TARGET else "")


def _profile_pb(p: Profile) -> pb.SecurityProfile:
    kind = {RUNTIME_DEFAULT: pb.SecurityProfile.RuntimeDefault,
            UNCONFINED: pb.SecurityProfile.Unconfined,
            LOCALHOST: pb.SecurityProfile.Localhost}[p.kind]
    return pb.SecurityProfile(profile_type=kind, localhost_ref=p.localhost_ref)


def _selinux_pb(s: SELinux | None) -> pb.SELinuxOption | None:
    if s is None:
        return None
    return pb.SELinuxOption(user=s.user, role=s.role, type=s.type, level=s.level)


def _int64(v: int | None) -> pb.Int64Value | None:
    return None if v is None else pb.Int64Value(value=v)


def sandbox_config_pb(c: SandboxConfig) -> pb.PodSandboxConfig:
    labels = {**c.labels, LABEL_POD_UID: c.uid, LABEL_POD_NAME: c.name,
              LABEL_POD_NAMESPACE: c.namespace, LABEL_ATTEMPT: str(c.attempt)}
    annotations = dict(c.annotations)
    if c.host_network:
        annotations[ANNOTATION_HOST_NETWORK] = "true"
    sec = c.security
    protos = {"TCP": pb.TCP, "UDP": pb.UDP, "SCTP": pb.SCTP}
    ports = []
    for p in c.port_mappings:
        if p.protocol.upper() not in protos:
            raise ContainerRuntimeError(f"pod {c.namespace}/{c.name}: port {p.container_port}: "
                                        f"protocol {p.protocol!r} is not TCP, UDP or SCTP")
        ports.append(pb.PortMapping(protocol=protos[p.protocol.upper()],
                                    container_port=p.container_port, host_port=p.host_port,
                                    host_ip=p.host_ip))
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=c.name, uid=c.uid, namespace=c.namespace,
                                       attempt=c.attempt),
        # containerd refuses a hostname without a private UTS namespace
        hostname="" if c.host_network else c.hostname,
        log_directory=c.log_directory,
        port_mappings=ports,
        labels=labels,
        annotations=annotations,
        dns_config=None if c.dns is None else pb.DNSConfig(
            servers=c.dns.servers, searches=c.dns.searches, options=c.dns.options),
        linux=pb.LinuxPodSandboxConfig(
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=namespaces_pb(c), run_as_user=_int64(sec.run_as_user),
                run_as_group=_int64(sec.run_as_group),
                supplemental_groups=sec.supplemental_groups, privileged=sec.privileged,
                selinux_options=_selinux_pb(sec.selinux),
                # the sandbox's own process runs under the runtime's default profile
                # whatever its containers ask for, as the kubelet's does
                seccomp=pb.SecurityProfile(profile_type=pb.SecurityProfile.RuntimeDefault)),
            sysctls=dict(sec.sysctls), cgroup_parent=c.cgroup_parent,
            overhead=None if c.overhead is None else linux_resources(c.overhead)),
    )


_PROPAGATION = {"None": pb.PROPAGATION_PRIVATE,
                "HostToContainer": pb.PROPAGATION_HOST_TO_CONTAINER,
                "Bidirectional": pb.PROPAGATION_BIDIRECTIONAL}


def container_config_pb(c: ContainerConfig, sandbox: SandboxConfig) -> pb.ContainerConfig:
    labels = {**c.labels, LABEL_POD_UID: c.pod_uid, LABEL_ATTEMPT: str(c.attempt)}
    annotations = {**c.annotations, ANNOTATION_RESTART_COUNT: str(c.restart_count)}
    if c.spec_hash:
        annotations[ANNOTATION_SPEC_HASH] = c.spec_hash
    if c.init:
        annotations[ANNOTATION_INIT] = "true"
    sec = c.security
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=c.name, attempt=c.attempt),
        image=pb.ImageSpec(image=c.image),
        command=c.command, args=c.args, working_dir=c.working_dir,
        envs=[pb.KeyValue(key=k, value=v) for k, v in c.env],
        mounts=[pb.Mount(container_path=m.container_path, host_path=m.host_path,
                         readonly=m.read_only, propagation=_PROPAGATION[m.propagation])
                for m in c.mounts],
        labels=labels, annotations=annotations,
        log_path=c.log_path if sandbox.log_directory else "",
        stdin=c.stdin, stdin_once=c.stdin_once, tty=c.tty,
        linux=pb.LinuxContainerConfig(
            resources=linux_resources(c.resources, c.oom_score_adj),
            security_context=pb.LinuxContainerSecurityContext(
                namespace_options=namespaces_pb(sandbox, c.target_id),
                run_as_user=_int64(sec.run_as_user), run_as_group=_int64(sec.run_as_group),
                supplemental_groups=sec.supplemental_groups, privileged=sec.privileged,
                readonly_rootfs=sec.readonly_rootfs, no_new_privs=sec.no_new_privs,
                capabilities=pb.Capability(add_capabilities=sec.capabilities_add,
                                           drop_capabilities=sec.capabilities_drop),
                seccomp=_profile_pb(sec.seccomp),
                apparmor=None if sec.apparmor is None else _profile_pb(sec.apparmor),
                selinux_options=_selinux_pb(sec.selinux))),
    )


def _sandbox(s: Any) -> Sandbox:
    """pb.PodSandbox or pb.PodSandboxStatus -> Sandbox."""
    labels, annotations = dict(s.labels), dict(s.annotations)
    ip = ""
    if isinstance(s, pb.PodSandboxStatus) and s.HasField("network"):
        ip = s.network.ip
    return Sandbox(
        id=s.id, pod_uid=labels.get(LABEL_POD_UID) or s.metadata.uid, name=s.metadata.name,
        namespace=s.metadata.namespace, attempt=s.metadata.attempt,
        state=_SANDBOX_STATE.get(s.state, SandboxState.NOTREADY),
        created_at=_time(s.created_at), ip=ip,
        host_network=annotations.get(ANNOTATION_HOST_NETWORK) == "true",
        labels=labels, annotations=annotations)


def _event(r: pb.ContainerEventResponse) -> ContainerEvent | None:
    """A CRI event as ours; None for a kind we do not act on, or for an object that is
    not ours (no pod uid label, as the relist filters). The pod's uid is on its
    sandbox's status, or on the container's when the sandbox is gone already."""
    kind = _EVENT_TYPE.get(r.container_event_type)
    uid = r.pod_sandbox_status.labels.get(LABEL_POD_UID) or next(
        (c.labels[LABEL_POD_UID] for c in r.containers_statuses if LABEL_POD_UID in c.labels),
        "")
    if kind is None or not uid:
        return None
    return ContainerEvent(kind, uid, r.container_id,
                          _time(r.created_at) or dt.datetime.now(dt.UTC))


def _container(c: pb.Container, st: pb.ContainerStatus | None = None) -> Container:
    labels, annotations = dict(c.labels), dict(c.annotations)
    out = Container(
        id=c.id, sandbox_id=c.pod_sandbox_id, pod_uid=labels.get(LABEL_POD_UID, ""),
        name=c.metadata.name, image=c.image.image,
        state=_CONTAINER_STATE.get(c.state, ContainerState.UNKNOWN),
        attempt=c.metadata.attempt,
        restart_count=int_or(annotations.get(ANNOTATION_RESTART_COUNT)),
        created_at=_time(c.created_at), image_id=c.image_ref,
        spec_hash=annotations.get(ANNOTATION_SPEC_HASH, ""),
        init=annotations.get(ANNOTATION_INIT) == "true",
        labels=labels, annotations=annotations)
    if st is not None:
        out.state = _CONTAINER_STATE.get(st.state, ContainerState.UNKNOWN)
        out.started_at = _time(st.started_at)
        out.finished_at = _time(st.finished_at)
        out.reason, out.message = st.reason, st.message
        out.image_id = st.image_ref or out.image_id
        out.log_path = st.log_path
        if out.state == ContainerState.EXITED:
            out.exit_code = st.exit_code
        if st.HasField("resources") and st.resources.HasField("linux"):
            out.resources = applied_resources(st.resources.linux)
    return out


class CriRuntime(Runtime):
    """CRI v1 client. `socket`: path of the runtime's unix socket (or unix:// URL).

    call_timeout: deadline of reads (version, lists, status, image status).
    request_timeout: deadline of changes (sandbox run/stop/remove, container create,
      start, remove; a stop gets its grace period on top). Like the kubelet's
      --runtime-request-timeout (2 min): under a burst, containerd on a small machine
      takes seconds per create.
    pull_timeout: deadline of one image pull (30 min: big images over slow links; the
      kubelet sets none, but a pull that never ends would hold every pull behind it).
    The channel is opened lazily inside the running event loop."""

    scheme = "containerd"
    cgroups = "host"  # the runtime runs each container in the sandbox's cgroup_parent

    def __init__(self, socket: str, *, call_timeout: float = 10.0,
                 request_timeout: float = 120.0, pull_timeout: float = 1800.0,
                 runtime_handler: str = "") -> None:
        if not socket:
            raise ValueError("cri: socket path is empty")
        if min(call_timeout, request_timeout, pull_timeout) <= 0:
            raise ValueError(f"cri: call_timeout ({call_timeout}), request_timeout "
                             f"({request_timeout}) and pull_timeout ({pull_timeout}) must "
                             "be positive seconds")
        self.target = socket if socket.startswith("unix:") else f"unix://{socket}"
        self.call_timeout = call_timeout
        self.request_timeout = request_timeout
        self.pull_timeout = pull_timeout
        self.runtime_handler = runtime_handler
        self.calls = 0  # gRPC calls made, for tests and benchmarks
        self._sandbox_image: str | None = None  # the runtime's, once read (list_images)
        self._channel: grpc.aio.Channel | None = None
        self._rt: pb_grpc.RuntimeServiceStub | None = None
        self._img: pb_grpc.ImageServiceStub | None = None

    def _stubs(self) -> tuple[pb_grpc.RuntimeServiceStub, pb_grpc.ImageServiceStub]:
        if self._rt is None or self._img is None:
            self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
            self._rt = pb_grpc.RuntimeServiceStub(self._channel)
            self._img = pb_grpc.ImageServiceStub(self._channel)
        return self._rt, self._img

    async def _call(self, what: str, fn: Callable[..., Awaitable[T]], req: Any,
                    timeout: float | None = None) -> T:
        self.calls += 1
        try:
            return await fn(req, timeout=timeout or self.call_timeout)
        except grpc.aio.AioRpcError as e:
            raise map_error(e, what) from e

    async def container_events(self) -> AsyncIterator[ContainerEvent]:
        """GetContainerEvents (no deadline: it streams). The call is sent when this
        returns, but containerd answers nothing before its first event: a runtime
        without the call is known only at the first read, which raises Unsupported, and
        an event in the moment before containerd has subscribed the call is lost (the
        PLEG's next relist, at the long period, catches it). A Version call first: a
        runtime that is down fails the subscription itself (Unavailable), rather than
        looking subscribed until the stream's first read fails."""
        rt, _ = self._stubs()
        await self._call("Version", rt.Version, pb.VersionRequest(version=CRI_CLIENT_VERSION))
        self.calls += 1
        return self._events(rt.GetContainerEvents(pb.GetEventsRequest()))

    @staticmethod
    async def _events(call: Any) -> AsyncIterator[ContainerEvent]:
        try:
            async for r in call:
                ev = _event(r)
                if ev is not None:
                    yield ev
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise Unsupported(f"cri GetContainerEvents: the runtime streams no container "
                                  f"events ({e.details()})") from e
            raise map_error(e, "GetContainerEvents") from e
        finally:
            call.cancel()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._rt = self._img = None

    # --- Runtime ---------------------------------------------------------------------

    async def version(self) -> RuntimeVersion:
        rt, _ = self._stubs()
        v = await self._call("Version", rt.Version, pb.VersionRequest(version=CRI_CLIENT_VERSION))
        return RuntimeVersion(v.runtime_name, v.runtime_version, v.runtime_api_version)

    async def conditions(self) -> dict[str, tuple[bool, str]]:
        """Runtime conditions (RuntimeReady, NetworkReady): type -> (status, reason)."""
        rt, _ = self._stubs()
        st = await self._call("Status", rt.Status, pb.StatusRequest())
        return {c.type: (c.status, " ".join(f"{k}:{v}" for k, v in (
            ("reason", c.reason), ("message", c.message)) if v))
            for c in st.status.conditions}

    async def relist(self) -> RelistResult:
        rt, _ = self._stubs()
        sbs, cts = await asyncio.gather(
            self._call("ListPodSandbox", rt.ListPodSandbox, pb.ListPodSandboxRequest()),
            self._call("ListContainers", rt.ListContainers, pb.ListContainersRequest()))
        return RelistResult(
            sandboxes=[_sandbox(s) for s in sbs.items if LABEL_POD_UID in s.labels],
            containers=[_container(c) for c in cts.containers if LABEL_POD_UID in c.labels])

    async def pod_status(self, pod_uid: str) -> PodRuntimeStatus:
        rt, _ = self._stubs()
        sel = {LABEL_POD_UID: pod_uid}
        sbs, cts = await asyncio.gather(
            self._call("ListPodSandbox", rt.ListPodSandbox, pb.ListPodSandboxRequest(
                filter=pb.PodSandboxFilter(label_selector=sel))),
            self._call("ListContainers", rt.ListContainers, pb.ListContainersRequest(
                filter=pb.ContainerFilter(label_selector=sel))))

        async def sandbox(s: pb.PodSandbox) -> Sandbox:
            try:
                r = await self._call(f"PodSandboxStatus {s.id}", rt.PodSandboxStatus,
                                     pb.PodSandboxStatusRequest(pod_sandbox_id=s.id))
                return _sandbox(r.status)
            except NotFound:  # removed between the list and now
                return _sandbox(s)

        async def container(c: pb.Container) -> Container | None:
            try:
                r = await self._call(f"ContainerStatus {c.id}", rt.ContainerStatus,
                                     pb.ContainerStatusRequest(container_id=c.id))
            except NotFound:
                return None
            return _container(c, r.status)

        sandboxes = await asyncio.gather(*(sandbox(s) for s in sbs.items))
        containers = await asyncio.gather(*(container(c) for c in cts.containers))
        return PodRuntimeStatus(
            uid=pod_uid,
            sandboxes=sorted(sandboxes, key=lambda s: (s.attempt, s.created_at or _EPOCH),
                             reverse=True),
            containers=[c for c in containers if c is not None])

    async def run_sandbox(self, config: SandboxConfig) -> str:
        rt, _ = self._stubs()
        r = await self._call(
            f"RunPodSandbox {config.namespace}/{config.name}", rt.RunPodSandbox,
            pb.RunPodSandboxRequest(config=sandbox_config_pb(config),
                                    runtime_handler=config.runtime_handler
                                    or self.runtime_handler),
            self.request_timeout)
        return r.pod_sandbox_id

    async def stop_sandbox(self, sandbox_id: str) -> None:
        rt, _ = self._stubs()
        with contextlib.suppress(NotFound):  # idempotent: gone already
            await self._call(f"StopPodSandbox {sandbox_id}", rt.StopPodSandbox,
                             pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id),
                             self.request_timeout)

    async def remove_sandbox(self, sandbox_id: str) -> None:
        rt, _ = self._stubs()
        with contextlib.suppress(NotFound):
            await self._call(f"RemovePodSandbox {sandbox_id}", rt.RemovePodSandbox,
                             pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
                             self.request_timeout)

    async def create_container(self, sandbox_id: str, config: ContainerConfig,
                               sandbox_config: SandboxConfig) -> str:
        # the image manager pulled it; gone since (removed by hand): say so clearly
        if not await self.image_present(config.image):
            raise ImageNotPresent(f"cri CreateContainer {config.name}: image {config.image} "
                                  "is not present in the runtime")
        rt, _ = self._stubs()
        r = await self._call(
            f"CreateContainer {config.name} in sandbox {sandbox_id}", rt.CreateContainer,
            pb.CreateContainerRequest(pod_sandbox_id=sandbox_id,
                                      config=container_config_pb(config, sandbox_config),
                                      sandbox_config=sandbox_config_pb(sandbox_config)),
            self.request_timeout)
        return r.container_id

    async def start_container(self, container_id: str) -> None:
        rt, _ = self._stubs()
        await self._call(f"StartContainer {container_id}", rt.StartContainer,
                         pb.StartContainerRequest(container_id=container_id),
                         self.request_timeout)

    async def stop_container(self, container_id: str, timeout: float) -> None:
        rt, _ = self._stubs()
        secs = max(0, int(timeout + 0.999))  # CRI takes whole seconds; never cut it short
        with contextlib.suppress(NotFound):
            await self._call(f"StopContainer {container_id}", rt.StopContainer,
                             pb.StopContainerRequest(container_id=container_id, timeout=secs),
                             secs + self.request_timeout)

    async def update_container_resources(self, container_id: str, resources: Resources,
                                         oom_score_adj: int | None = None) -> None:
        rt, _ = self._stubs()
        await self._call(f"UpdateContainerResources {container_id}",
                         rt.UpdateContainerResources,
                         pb.UpdateContainerResourcesRequest(
                             container_id=container_id,
                             linux=linux_resources(resources, oom_score_adj)),
                         self.request_timeout)

    async def remove_container(self, container_id: str) -> None:
        rt, _ = self._stubs()
        with contextlib.suppress(NotFound):
            await self._call(f"RemoveContainer {container_id}", rt.RemoveContainer,
                             pb.RemoveContainerRequest(container_id=container_id),
                             self.request_timeout)

    async def image_present(self, ref: str) -> bool:
        _, img = self._stubs()
        r = await self._call(f"ImageStatus {ref}", img.ImageStatus,
                             pb.ImageStatusRequest(image=pb.ImageSpec(image=ref)))
        # a missing image is OK with no image field, not NOT_FOUND
        return r.HasField("image") and bool(r.image.id)

    async def image_user(self, ref: str) -> tuple[int | None, str]:
        _, img = self._stubs()
        r = await self._call(f"ImageStatus {ref}", img.ImageStatus,
                             pb.ImageStatusRequest(image=pb.ImageSpec(image=ref)))
        if not (r.HasField("image") and r.image.id):
            raise ImageNotPresent(f"cri ImageStatus {ref}: image is not present")
        # containerd gives a numeric user (even "1000:1000") as uid, a name as username
        uid = r.image.uid.value if r.image.HasField("uid") else None
        return uid, r.image.username

    async def pull_image(self, ref: str, auth: RegistryAuth | None = None) -> ImageInfo:
        _, img = self._stubs()
        req = pb.PullImageRequest(image=pb.ImageSpec(image=ref))
        if auth is not None:
            req.auth.CopyFrom(pb.AuthConfig(
                username=auth.username, password=auth.password, auth=auth.auth,
                server_address=auth.server_address, identity_token=auth.identity_token,
                registry_token=auth.registry_token))
        try:
            r = await self._call(f"PullImage {ref}", img.PullImage, req, self.pull_timeout)
        except (Unavailable, RuntimeTimeout):
            raise
        except ContainerRuntimeError as e:
            raise PullFailed(str(e)) from e
        st = await self._call(f"ImageStatus {r.image_ref}", img.ImageStatus,
                              pb.ImageStatusRequest(image=pb.ImageSpec(image=r.image_ref)))
        return ImageInfo(id=r.image_ref, names=list(st.image.repo_tags) or [ref],
                         size_bytes=st.image.size)

    async def list_images(self) -> list[ImageInfo]:
        """The store's images; the sandbox image is pinned also where the runtime does
        not say so itself (containerd before 1.7 sets no Image.pinned)."""
        _, img = self._stubs()
        r = await self._call("ListImages", img.ListImages, pb.ListImagesRequest())
        sandbox = await self._sandbox_image_ref()
        return [ImageInfo(id=i.id, names=list(i.repo_tags) or list(i.repo_digests),
                          size_bytes=i.size,
                          pinned=i.pinned or bool(sandbox and sandbox in i.repo_tags))
                for i in r.images]

    async def _sandbox_image_ref(self) -> str:
        """The sandbox ("pause") image the runtime's configuration names (its verbose
        Status: containerd's `sandboxImage`); "" when it does not say."""
        if self._sandbox_image is None:
            rt, _ = self._stubs()
            st = await self._call("Status", rt.Status, pb.StatusRequest(verbose=True))
            try:
                config = json.loads(st.info.get("config") or "{}")
            except ValueError:
                config = {}
            self._sandbox_image = str(config.get("sandboxImage") or "") \
                if isinstance(config, dict) else ""
        return self._sandbox_image

    async def remove_image(self, image_id: str) -> None:
        _, img = self._stubs()
        with contextlib.suppress(NotFound):  # idempotent: gone already
            await self._call(f"RemoveImage {image_id}", img.RemoveImage,
                             pb.RemoveImageRequest(image=pb.ImageSpec(image=image_id)),
                             self.request_timeout)

    async def image_fs_info(self) -> ImageFsInfo:
        _, img = self._stubs()
        r = await self._call("ImageFsInfo", img.ImageFsInfo, pb.ImageFsInfoRequest())
        if not r.image_filesystems:
            raise ContainerRuntimeError("cri ImageFsInfo: the runtime named no image "
                                        "filesystem")
        fs = r.image_filesystems[0]
        return ImageFsInfo(
            mountpoint=fs.fs_id.mountpoint,
            used_bytes=fs.used_bytes.value if fs.HasField("used_bytes") else None,
            inodes_used=fs.inodes_used.value if fs.HasField("inodes_used") else None)


    # --- the kubelet API ---------------------------------------------------------------

    async def exec_url(self, container_id: str, cmd: list[str], req: StreamRequest) -> str:
        rt, _ = self._stubs()
        r = await self._call(f"Exec {container_id}", rt.Exec, pb.ExecRequest(
            container_id=container_id, cmd=cmd, tty=req.tty, stdin=req.stdin,
            stdout=req.stdout, stderr=req.stderr))
        return r.url

    async def exec_sync(self, container_id: str, cmd: list[str],
                        timeout: float) -> ExecResult:
        rt, _ = self._stubs()
        secs = int(timeout)  # CRI takes whole seconds, as the kubelet sends them
        req = pb.ExecSyncRequest(container_id=container_id, cmd=cmd, timeout=secs)
        what = f"ExecSync {container_id}"
        self.calls += 1
        try:
            # the runtime ends the command at `timeout`; the call's own deadline leaves
            # it time to clean up (0: the command may run as long as it likes)
            r = await rt.ExecSync(req, timeout=secs + self.request_timeout if secs else None)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RuntimeTimeout(f'command "{" ".join(cmd)}" timed out') from e
            raise map_error(e, what) from e
        return ExecResult(r.exit_code, r.stdout, r.stderr)

    async def attach_url(self, container_id: str, req: StreamRequest) -> str:
        rt, _ = self._stubs()
        r = await self._call(f"Attach {container_id}", rt.Attach, pb.AttachRequest(
            container_id=container_id, tty=req.tty, stdin=req.stdin, stdout=req.stdout,
            stderr=req.stderr))
        return r.url

    async def port_forward_url(self, sandbox_id: str, ports: list[int]) -> str:
        rt, _ = self._stubs()
        r = await self._call(f"PortForward {sandbox_id}", rt.PortForward,
                             pb.PortForwardRequest(pod_sandbox_id=sandbox_id, port=ports))
        return r.url

    async def container_stats(self) -> list[ContainerStats]:
        rt, _ = self._stubs()
        r = await self._call("ListContainerStats", rt.ListContainerStats,
                             pb.ListContainerStatsRequest())
        out = []
        for st in r.stats:
            if LABEL_POD_UID not in st.attributes.labels:
                continue  # not ours
            cpu, mem = st.cpu, st.memory

            def value(msg: Any, name: str) -> int | None:
                return getattr(msg, name).value if msg.HasField(name) else None

            core_ns = value(cpu, "usage_core_nano_seconds")
            out.append(ContainerStats(
                container_id=st.attributes.id,
                timestamp=_time(cpu.timestamp or mem.timestamp) or dt.datetime.now(dt.UTC),
                cpu_usage_core_seconds=None if core_ns is None else core_ns / 1e9,
                memory_working_set_bytes=value(mem, "working_set_bytes"),
                memory_usage_bytes=value(mem, "usage_bytes"),
                memory_rss_bytes=value(mem, "rss_bytes"),
                writable_layer_bytes=value(st.writable_layer, "used_bytes"),
                writable_layer_inodes=value(st.writable_layer, "inodes_used")))
        return out

    async def rotate_container_log(self, container_id: str, path: str, rotated: str) -> None:
        rt, _ = self._stubs()
        await asyncio.to_thread(os.rename, path, rotated)
        try:
            await self._call(f"ReopenContainerLog {container_id}", rt.ReopenContainerLog,
                             pb.ReopenContainerLogRequest(container_id=container_id))
        except ContainerRuntimeError:
            # put it back, so the next round tries again and nothing is lost
            with contextlib.suppress(OSError):
                await asyncio.to_thread(os.rename, rotated, path)
            raise


_EPOCH = dt.datetime.fromtimestamp(0, dt.UTC)
