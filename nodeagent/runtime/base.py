"""The container runtime interface. Nothing above nodeagent/runtime/ knows which
implementation (cri, process, fake) it talks to; it sees only what is defined here.

Identity lives in labels: every sandbox and container carries the pod uid, pod name and
namespace, and containers their container name, so a restarted agent can find and adopt
what an earlier agent started (see `LABEL_*`). Attempts and restart counts travel in the
records too, so a relist alone tells the whole story.

Contracts shared by all implementations:
- Every call is a coroutine; an implementation that blocks (gRPC, subprocess) runs the
  blocking part in a thread so the event loop never stalls.
- `stop_*` and `remove_*` are idempotent: stopping something already stopped, or
  stopping/removing an id that no longer exists, succeeds (the goal state holds).
- Calls that need an existing object (`start_container`, `create_container` into a
  sandbox, `pod_status` never does) raise `NotFound` when the id is unknown.
- A failed call raises a `ContainerRuntimeError` subclass; anything else is a bug.
- `container_events()` streams what happens to containers and sandboxes as it happens
  (the evented PLEG); a runtime without such a stream raises `Unsupported`, and the
  PLEG then learns everything from relists.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import hashlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Coroutine, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nodeagent.api.quantity import parse_quantity
from nodeagent.runtime.security import (
    ContainerSecurity,
    SandboxSecurity,
    container_security,
    sandbox_security,
)

# Labels that identify our objects in the runtime (same keys the kubelet uses, so tools
# like crictl show them sensibly).
LABEL_POD_UID = "io.kubernetes.pod.uid"
LABEL_POD_NAME = "io.kubernetes.pod.name"
LABEL_POD_NAMESPACE = "io.kubernetes.pod.namespace"
LABEL_CONTAINER_NAME = "io.kubernetes.container.name"
LABEL_MANAGED = "nodepulse.dev/managed"
# Annotations carrying bookkeeping a restarted agent needs back.
ANNOTATION_RESTART_COUNT = "io.kubernetes.container.restartCount"
ANNOTATION_SPEC_HASH = "io.kubernetes.container.hash"
ANNOTATION_TERMINATION_GRACE = "io.kubernetes.pod.terminationGracePeriod"
ANNOTATION_INIT = "nodepulse.dev/init-container"
# the resources a container was made with (what an in-place resize starts from)
ANNOTATION_RESOURCES = "nodepulse.dev/resources"

DEFAULT_CONTAINERD_SOCKET = "/run/containerd/containerd.sock"


# --- errors -------------------------------------------------------------------------

class ContainerRuntimeError(RuntimeError):
    """A runtime call failed. Message names the call and the object."""


class NotFound(ContainerRuntimeError):
    """The sandbox, container or image id is not known to the runtime (never existed or
    already removed)."""


class ImageNotPresent(ContainerRuntimeError):
    """The image is not in the runtime's image store (create_container does not pull:
    the image manager, nodeagent/pods/images.py, pulls first)."""


class PullFailed(ContainerRuntimeError):
    """The runtime could not pull the image (unknown name, registry unreachable,
    credentials refused); the message says why, in the runtime's words."""


class RuntimeTimeout(ContainerRuntimeError, TimeoutError):
    """The runtime did not answer within the call's deadline."""


class Unavailable(ContainerRuntimeError):
    """The runtime cannot be reached at all (socket missing, connection refused)."""


class Unsupported(ContainerRuntimeError):
    """This runtime cannot do what was asked (the message says which runtime and why)."""


# --- records ------------------------------------------------------------------------

class ContainerState(enum.StrEnum):
    CREATED = "CREATED"
    RUNNING = "RUNNING"
    EXITED = "EXITED"
    UNKNOWN = "UNKNOWN"


class SandboxState(enum.StrEnum):
    READY = "READY"
    NOTREADY = "NOTREADY"


@dataclass(frozen=True)
class PortMapping:
    container_port: int
    host_port: int = 0
    protocol: str = "TCP"
    host_ip: str = ""


@dataclass(frozen=True)
class Resources:
    """Requests and limits from the pod spec; None where the spec sets none."""
    cpu_request_millis: int | None = None
    cpu_limit_millis: int | None = None
    memory_request_bytes: int | None = None
    memory_limit_bytes: int | None = None

    def encode(self) -> str:
        """As a container annotation holds it: the four amounts, "" for one not set."""
        return ",".join("" if v is None else str(v) for v in (
            self.cpu_request_millis, self.cpu_limit_millis, self.memory_request_bytes,
            self.memory_limit_bytes))

    @classmethod
    def decode(cls, text: str) -> Resources | None:
        """What `encode` wrote; None when `text` is not that (the annotation is missing,
        or was written by someone else)."""
        parts = text.split(",")
        if len(parts) != 4:
            return None
        try:
            values = [int(p) if p else None for p in parts]
        except ValueError:
            return None
        return cls(*values)


@dataclass(frozen=True)
class DnsConfig:
    """The resolver configuration a sandbox's /etc/resolv.conf is written from."""
    servers: tuple[str, ...] = ()
    searches: tuple[str, ...] = ()
    options: tuple[str, ...] = ()


HOSTNAME_MAX = 63  # a kernel hostname holds 64 bytes with the terminating NUL


def truncate_hostname(hostname: str) -> str:
    """A hostname cut to 63 characters, without a trailing '-' or '.' (the kubelet's
    rule: a pod name may be longer than a hostname can be)."""
    if len(hostname) <= HOSTNAME_MAX:
        return hostname
    return hostname[:HOSTNAME_MAX].rstrip("-.")


@dataclass
class SandboxConfig:
    """What a pod needs from the runtime before any container runs."""
    name: str
    namespace: str
    uid: str
    attempt: int = 0
    host_network: bool = False
    hostname: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    port_mappings: list[PortMapping] = field(default_factory=list)
    log_directory: str = ""
    termination_grace_seconds: int = 30
    security: SandboxSecurity = field(default_factory=SandboxSecurity)
    # None: the node's own /etc/resolv.conf as it is (the runtime's default)
    dns: DnsConfig | None = None
    runtime_handler: str = ""  # the pod's RuntimeClass's handler ("": the default)
    overhead: Resources | None = None  # spec.overhead (set from the RuntimeClass)
    # the pod's cgroup (nodeagent.pods.cgroups), which the sandbox and its containers go
    # under, in the node's cgroup driver's form ("": the runtime's default)
    cgroup_parent: str = ""

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any], attempt: int = 0,
                 log_root: str = "") -> SandboxConfig:
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        name, namespace, uid = _pod_identity(pod)
        host_network = bool(spec.get("hostNetwork", False))
        ports = [
            PortMapping(container_port=int(p["containerPort"]),
                        host_port=int(p.get("hostPort") or 0),
                        protocol=str(p.get("protocol") or "TCP"),
                        host_ip=str(p.get("hostIP") or ""))
            for c in spec.get("containers") or []
            for p in c.get("ports") or []
            if p.get("hostPort")
        ]
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        labels.update({LABEL_POD_UID: uid, LABEL_POD_NAME: name,
                       LABEL_POD_NAMESPACE: namespace, LABEL_MANAGED: "true"})
        grace = spec.get("terminationGracePeriodSeconds")
        annotations = {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()}
        return cls(
            name=name, namespace=namespace, uid=uid, attempt=attempt,
            host_network=host_network,
            # containerd refuses a hostname without a private UTS namespace
            hostname="" if host_network else truncate_hostname(
                str(spec.get("hostname") or name)),
            labels=labels, annotations=annotations, port_mappings=ports,
            log_directory=f"{log_root}/{namespace}_{name}_{uid}" if log_root else "",
            termination_grace_seconds=30 if grace is None else int(grace),
            security=sandbox_security(pod),
            overhead=_overhead(spec.get("overhead"), f"pod {namespace}/{name}"),
        )


@dataclass(frozen=True)
class Mount:
    """A file or directory of the host bind-mounted into a container: what a pod's
    volumes, its /etc/hosts and its termination-message file become. The syncer resolves
    them to host paths before it calls the runtime."""
    container_path: str
    host_path: str
    read_only: bool = False
    propagation: str = "None"  # the API's mountPropagation: None, HostToContainer,
    # Bidirectional


@dataclass
class ContainerConfig:
    """One container of a pod spec, resolved to what the runtime needs."""
    name: str
    image: str
    pod_uid: str
    pod_name: str = ""
    pod_namespace: str = ""
    command: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    env: list[tuple[str, str]] = field(default_factory=list)
    working_dir: str = ""
    attempt: int = 0
    restart_count: int = 0
    init: bool = False
    resources: Resources = field(default_factory=Resources)
    spec_hash: str = ""
    log_path: str = ""  # relative to the sandbox's log_directory
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    # the spec's stdin, stdinOnce and tty: what `kubectl attach -i/-t` talks to
    stdin: bool = False
    stdin_once: bool = False
    tty: bool = False
    mounts: list[Mount] = field(default_factory=list)
    security: ContainerSecurity = field(default_factory=ContainerSecurity)
    # an ephemeral container's targetContainerName, resolved: the id of the container
    # whose process namespace it joins ("": none)
    target_id: str = ""
    # the OOM score adjustment of its processes, by the pod's QoS class
    # (nodeagent.pods.qos; None: the runtime's default)
    oom_score_adj: int | None = None

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any], container: Mapping[str, Any], *,
                 attempt: int = 0, restart_count: int = 0, init: bool = False,
                 env: list[tuple[str, str]] | None = None,
                 mounts: list[Mount] | None = None,
                 seccomp_root: str = "") -> ContainerConfig:
        """`env` is the environment nodeagent.pods.env resolved (None: the literal `value`s
        of the spec, which then must hold nothing else); command and args are the
        spec's, unexpanded. `seccomp_root`: the folder Localhost seccomp profiles are
        named relative to."""
        name, namespace, uid = _pod_identity(pod)
        cname = container.get("name")
        if not cname:
            raise ValueError(f"pod {namespace}/{name}: a container has no name")
        image = container.get("image")
        if not image:
            raise ValueError(f"pod {namespace}/{name}: container {cname}: image is empty")
        if env is None:
            if container.get("envFrom") or any("valueFrom" in e
                                               for e in container.get("env") or []):
                raise ValueError(f"pod {namespace}/{name} container {cname}: envFrom and "
                                 "valueFrom are resolved by nodeagent.pods.env, not here")
            env = [(str(e["name"]), str(e.get("value") or ""))
                   for e in container.get("env") or []]
        labels = {LABEL_POD_UID: uid, LABEL_POD_NAME: name, LABEL_POD_NAMESPACE: namespace,
                  LABEL_CONTAINER_NAME: str(cname), LABEL_MANAGED: "true"}
        h = container_spec_hash(container)
        resources = resources_of(container, where=f"pod {namespace}/{name} container {cname}")
        annotations = {ANNOTATION_RESTART_COUNT: str(restart_count), ANNOTATION_SPEC_HASH: h,
                       ANNOTATION_RESOURCES: resources.encode()}
        if init:
            annotations[ANNOTATION_INIT] = "true"
        return cls(
            name=str(cname), image=str(image), pod_uid=uid, pod_name=name,
            pod_namespace=namespace,
            command=[str(x) for x in container.get("command") or []],
            args=[str(x) for x in container.get("args") or []],
            env=env, working_dir=str(container.get("workingDir") or ""),
            attempt=attempt, restart_count=restart_count, init=init,
            resources=resources, spec_hash=h, log_path=f"{cname}/{attempt}.log",
            labels=labels, annotations=annotations,
            stdin=bool(container.get("stdin")), stdin_once=bool(container.get("stdinOnce")),
            tty=bool(container.get("tty")), mounts=list(mounts or []),
            security=container_security(
                pod, container, f"{container_path(pod, str(cname))}.securityContext",
                seccomp_root),
        )


@dataclass
class Sandbox:
    id: str
    pod_uid: str
    name: str
    namespace: str
    attempt: int
    state: SandboxState
    created_at: dt.datetime | None = None
    ip: str = ""
    host_network: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass
class Container:
    id: str
    sandbox_id: str
    pod_uid: str
    name: str
    image: str
    state: ContainerState
    attempt: int = 0
    restart_count: int = 0
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    created_at: dt.datetime | None = None
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    image_id: str = ""
    spec_hash: str = ""
    init: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    log_path: str = ""  # absolute path of its log file; "" when it writes none (pod_status)
    # the CPU and memory the runtime says it applied (pod_status; None: it says nothing):
    # the request and limit as its cgroup settings give them back, no memory request
    resources: Resources | None = None


@dataclass
class RelistResult:
    """Everything the runtime holds that we manage, from one call."""
    sandboxes: list[Sandbox]
    containers: list[Container]


@dataclass
class PodRuntimeStatus:
    """One pod as the runtime sees it: all its sandboxes (newest first) and all its
    containers (every attempt still present)."""
    uid: str
    sandboxes: list[Sandbox] = field(default_factory=list)
    containers: list[Container] = field(default_factory=list)

    @property
    def ip(self) -> str:
        for s in self.sandboxes:
            if s.state == SandboxState.READY and s.ip:
                return s.ip
        return ""


class ContainerEventType(enum.StrEnum):
    STARTED = "started"  # a container runs, a sandbox is ready
    DIED = "died"        # a container exited (by itself, stopped, or failing to start);
    # a sandbox stopped
    REMOVED = "removed"  # a container or sandbox is gone from the runtime


@dataclass(frozen=True, slots=True)
class ContainerEvent:
    """One change of a container or sandbox, as the runtime saw it happen."""
    type: ContainerEventType
    pod_uid: str
    container_id: str  # a container's or a sandbox's id
    at: dt.datetime


@dataclass(frozen=True)
class ImageInfo:
    id: str
    names: list[str]
    size_bytes: int
    pinned: bool = False  # never garbage collected (CRI Image.pinned: the sandbox image)


@dataclass(frozen=True)
class ImageFsInfo:
    """The filesystem the runtime keeps its images on (CRI ImageFsInfo): where it is
    mounted, and what the images take of it (None: not measured)."""
    mountpoint: str
    used_bytes: int | None = None
    inodes_used: int | None = None


@dataclass(frozen=True)
class RegistryAuth:
    """Credentials for one image pull (CRI AuthConfig): basic auth (username and
    password, or `auth`, base64 of "user:password"), or a token."""
    username: str = ""
    password: str = ""
    auth: str = ""
    server_address: str = ""
    identity_token: str = ""
    registry_token: str = ""

    def __repr__(self) -> str:  # never a secret in a log line
        return f"RegistryAuth(username={self.username!r}, server={self.server_address!r})"


@dataclass(frozen=True)
class ContainerStats:
    """One running container's usage, as the runtime measured it at `timestamp`."""
    container_id: str
    timestamp: dt.datetime
    cpu_usage_core_seconds: float | None = None  # cumulative
    memory_working_set_bytes: int | None = None
    memory_usage_bytes: int | None = None
    memory_rss_bytes: int | None = None
    writable_layer_bytes: int | None = None
    writable_layer_inodes: int | None = None
    processes: int | None = None  # processes (threads not counted) the container runs


@dataclass(frozen=True)
class StreamRequest:
    """What an exec or attach asks for (the kubelet API's query parameters)."""
    stdin: bool = False
    stdout: bool = True
    stderr: bool = True
    tty: bool = False


@dataclass(frozen=True)
class ExecResult:
    """What a command run to completion in a container (CRI ExecSync) gave back."""
    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""


@dataclass(frozen=True)
class RuntimeVersion:
    runtime_name: str
    runtime_version: str
    api_version: str


# --- the interface ------------------------------------------------------------------

class Runtime(ABC):
    """A container runtime. `scheme` prefixes container ids in the API
    (`containerd://...`, `process://...`, `fake://...`)."""

    scheme: str = "unknown"
    # calls answered in the caller's turn unless they wait on purpose (an in-process
    # simulation): start_call runs them to their first wait before making a task
    inline: bool = False

    @abstractmethod
    async def version(self) -> RuntimeVersion:
        """Name and version of the runtime; also a cheap liveness probe."""

    async def conditions(self) -> dict[str, tuple[bool, str]]:
        """The runtime's own conditions (CRI's RuntimeReady and NetworkReady): type ->
        (status, why when false). A runtime that has none answers {}: ready."""
        return {}

    @abstractmethod
    async def relist(self) -> RelistResult:
        """All sandboxes and containers labelled as ours (LABEL_POD_UID present), in a
        constant number of runtime calls whatever the pod count. This is the PLEG relist."""

    @abstractmethod
    async def pod_status(self, pod_uid: str) -> PodRuntimeStatus:
        """Detailed state of one pod's sandboxes and containers (exit codes, reasons,
        timestamps). An unknown uid gives an empty status, not NotFound."""

    @abstractmethod
    async def run_sandbox(self, config: SandboxConfig) -> str:
        """Create and start a pod sandbox; returns its id. Not idempotent: each call
        makes a new sandbox (callers check the relist first)."""

    @abstractmethod
    async def stop_sandbox(self, sandbox_id: str) -> None:
        """Stop the sandbox and every container in it. Idempotent; unknown id is fine."""

    @abstractmethod
    async def remove_sandbox(self, sandbox_id: str) -> None:
        """Remove the sandbox and its containers (stopping them first if needed).
        Idempotent; unknown id is fine."""

    @abstractmethod
    async def create_container(self, sandbox_id: str, config: ContainerConfig,
                               sandbox_config: SandboxConfig) -> str:
        """Create (not start) a container in a sandbox; returns its id. NotFound when
        the sandbox is unknown, ImageNotPresent when the image is missing."""

    @abstractmethod
    async def start_container(self, container_id: str) -> None:
        """Start a created container. NotFound when unknown. A container that has
        exited cannot be started again: a restart is a new container with attempt+1."""

    @abstractmethod
    async def stop_container(self, container_id: str, timeout: float) -> None:
        """Ask the container to stop (SIGTERM), kill it after `timeout` seconds.
        Idempotent; unknown id or already exited is fine."""

    @abstractmethod
    async def remove_container(self, container_id: str) -> None:
        """Remove a container (killing it if still running). Idempotent."""

    @abstractmethod
    async def image_present(self, ref: str) -> bool:
        """Whether the image is in the local store. Never pulls."""

    @abstractmethod
    async def pull_image(self, ref: str, auth: RegistryAuth | None = None) -> ImageInfo:
        """Pull the image into the local store with `auth` (None: anonymously); returns
        what the store then holds (its id and size). PullFailed when the registry
        refuses or cannot be reached. Not bounded by the short call deadline: a big
        image takes minutes."""

    @abstractmethod
    async def list_images(self) -> list[ImageInfo]:
        """Images in the local store, for NodeStatus.images and image garbage
        collection."""

    async def update_container_resources(self, container_id: str, resources: Resources,
                                         oom_score_adj: int | None = None) -> None:
        """Change a running container's CPU and memory in place (CRI
        UpdateContainerResources): what an in-place pod resize applies. NotFound when the
        container is unknown; Unsupported when this runtime cannot change them."""
        raise Unsupported(f"the {self.scheme} runtime cannot change a container's "
                          "resources in place")

    async def remove_image(self, image_id: str) -> None:
        """Remove an image from the local store (CRI RemoveImage). Idempotent: an image
        already gone is fine."""
        raise Unsupported(f"the {self.scheme} runtime cannot remove images")

    async def image_fs_info(self) -> ImageFsInfo:
        """The filesystem the images are on (CRI ImageFsInfo); Unsupported when the
        runtime keeps no images on a filesystem of the node."""
        raise Unsupported(f"the {self.scheme} runtime keeps no image filesystem")

    async def image_user(self, ref: str) -> tuple[int | None, str]:
        """The user a present image runs as by default: (uid, "") for a numeric user,
        (None, name) for a user name, (None, "") when the image names none (root).
        What runAsNonRoot is checked against."""
        raise Unsupported(f"the {self.scheme} runtime cannot tell an image's user")

    async def container_events(self) -> AsyncIterator[ContainerEvent]:
        """Subscribe to the runtime's container events. Returns once subscribed: the
        iterator then yields, in order, every event of our containers and sandboxes
        from then on, until it raises (the stream broke; events until the next
        subscription are lost, so a caller relists after subscribing again). Raises
        `Unsupported` when the runtime has no event stream (a runtime that tells only
        when the stream is first read, as CRI's UNIMPLEMENTED does, raises it from the
        iterator), a ContainerRuntimeError when subscribing failed."""
        raise Unsupported(f"the {self.scheme} runtime streams no container events")

    async def close(self) -> None:  # noqa: B027 (optional hook, nothing to do by default)
        """Release connections; the runtime's objects keep running."""

    # --- what the kubelet API serves (optional: the defaults refuse, naming the runtime)

    # Whether a container gets a root filesystem of its own into which
    # ContainerConfig.mounts can be made (the files the agent writes for it: its managed
    # /etc/hosts, its termination-message file, its volumes).
    can_mount: bool = True

    # Where a pod's containers go, cgroup-wise: "host": in the cgroup their sandbox
    # config names (cgroup_parent), limited by their resources (the agent makes the pod
    # cgroups in the host's cgroup filesystem); "simulated": the cgroup parent and the
    # limits are recorded, nothing runs (the agent keeps the pod cgroups as records);
    # "none": in no cgroup of their own (no pod cgroups; the runtime refuses limits it
    # could not enforce).
    cgroups: str = "none"

    # Whether anything runs in its containers (the fake runtime runs nothing): a node
    # whose runtime runs nothing gets no files for its containers (volumes are planned,
    # not made; no /etc/hosts, no DNS config), see NodePodSettings.runs_workloads.
    runs_workloads: bool = True

    # How container log files are written: "cri" (`<time> <stream> <P|F> <text>` lines,
    # as containerd writes them) or "raw" (the program's bytes as they came, no times).
    log_format: str = "cri"

    async def exec_url(self, container_id: str, cmd: list[str], req: StreamRequest) -> str:
        """URL of the runtime's streaming server where this exec waits (CRI Exec); the
        caller proxies the client's upgraded connection to it."""
        raise Unsupported(f"the {self.scheme} runtime cannot exec into containers")

    async def exec_sync(self, container_id: str, cmd: list[str],
                        timeout: float) -> ExecResult:
        """Run `cmd` in the running container to completion and return its exit code
        and output (CRI ExecSync): what exec probes and exec lifecycle hooks do. Raises
        RuntimeTimeout when it runs longer than `timeout` seconds (0: no limit)."""
        raise Unsupported(f"the {self.scheme} runtime cannot run commands in containers")

    def simulated_network(self, container_id: str, action: str) -> ExecResult | None:
        """For a runtime whose containers run nothing (the fake one): the answer a
        network probe or hook (`action`: httpGet, tcpSocket, grpc) gets from the
        container, exit code 0 for success, the output in stdout. None (every real
        runtime): the agent dials the pod."""
        return None

    async def attach_url(self, container_id: str, req: StreamRequest) -> str:
        """URL where an attach to the container's main process waits (CRI Attach)."""
        raise Unsupported(f"the {self.scheme} runtime cannot attach to containers")

    async def port_forward_url(self, sandbox_id: str, ports: list[int]) -> str:
        """URL where a port forward into the pod's network waits (CRI PortForward)."""
        raise Unsupported(f"the {self.scheme} runtime cannot forward ports into pods")

    async def container_stats(self) -> list[ContainerStats]:
        """Usage of every running container of ours (CRI ListContainerStats)."""
        raise Unsupported(f"the {self.scheme} runtime measures no container usage")

    async def rotate_container_log(self, container_id: str, path: str, rotated: str) -> None:
        """Move the running container's log file `path` to `rotated` and have the
        container write to a fresh `path` (CRI: rename, then ReopenContainerLog)."""
        raise Unsupported(f"the {self.scheme} runtime cannot rotate container logs")


# --- helpers shared by implementations and the layers above -------------------------

def _pod_identity(pod: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = pod.get("metadata") or {}
    name = meta.get("name")
    uid = meta.get("uid")
    namespace = meta.get("namespace") or "default"
    if not name:
        raise ValueError("pod: metadata.name is empty")
    if not uid:
        raise ValueError(f"pod {namespace}/{name}: metadata.uid is empty")
    return str(name), str(namespace), str(uid)


def _overhead(overhead: Mapping[str, Any] | None, where: str) -> Resources | None:
    """spec.overhead (what the sandbox itself costs) as limits, as CRI carries it."""
    if not overhead:
        return None
    cpu = overhead.get("cpu")
    mem = overhead.get("memory")
    return Resources(
        cpu_limit_millis=None if cpu is None else round(
            parse_quantity(cpu, f"{where}: spec.overhead.cpu") * 1000),
        memory_limit_bytes=None if mem is None else math.ceil(
            parse_quantity(mem, f"{where}: spec.overhead.memory")))


def container_path(pod: Mapping[str, Any], name: str) -> str:
    """Where a container is in the pod spec, as API field paths say it:
    `spec.containers[0]`, `spec.initContainers[1]`."""
    spec = pod.get("spec") or {}
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(kind) or []):
            if c.get("name") == name:
                return f"spec.{kind}[{i}]"
    return f"container {name}"


# what may change in a running container without replacing it: an in-place resize
RESIZABLE_FIELDS = ("resources", "resizePolicy")


def container_spec_hash(container: Mapping[str, Any], *, whole: bool = False) -> str:
    """Stable hash of a container spec, its resources and resize policy left out (a
    resize changes them in place); a change means the container must be replaced.
    `whole`: of every field, as agents before in-place resize hashed it."""
    kept = container if whole else {k: v for k, v in container.items()
                                    if k not in RESIZABLE_FIELDS}
    blob = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def resources_of(container: Mapping[str, Any], where: str = "container") -> Resources:
    res = container.get("resources") or {}
    req = res.get("requests") or {}
    lim = res.get("limits") or {}

    def cpu(d: Mapping[str, Any], kind: str) -> int | None:
        return None if "cpu" not in d else round(
            parse_quantity(d["cpu"], f"{where}: resources.{kind}.cpu") * 1000)

    def mem(d: Mapping[str, Any], kind: str) -> int | None:  # whole bytes, rounded up
        return None if "memory" not in d else math.ceil(
            parse_quantity(d["memory"], f"{where}: resources.{kind}.memory"))

    return Resources(cpu_request_millis=cpu(req, "requests"), cpu_limit_millis=cpu(lim, "limits"),
                     memory_request_bytes=mem(req, "requests"),
                     memory_limit_bytes=mem(lim, "limits"))


def int_or(value: object, default: int = 0) -> int:
    """Parse an int from a label/annotation; labels are user-visible and may be junk."""
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


T = TypeVar("T")


def start_call(runtime: Runtime, call: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """A call of `runtime` under way. An inline runtime's call runs at once, up to its
    first wait: a call that never waits is a done Future (no task, no trip round the
    event loop: a simulated pod's start is a handful of calls), one that waits goes on
    in a task from there. Other runtimes' calls are tasks from the start. (Python 3.12's
    eager tasks do this for any coroutine; the first step here runs as the caller's
    task, which an inline runtime's code never asks for.)"""
    if not runtime.inline:
        return asyncio.ensure_future(call)
    done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    try:
        waiting_on = call.send(None)
    except StopIteration as answer:
        done.set_result(answer.value)
        return done
    except Exception as e:  # noqa: BLE001 - the call's own failure, handed on
        done.set_exception(e)
        return done
    return asyncio.ensure_future(_Resumed(call, waiting_on))


class _Resumed(Coroutine[Any, Any, T]):
    """A started call, for a task to run on: the task's first step gets the wait the
    call is in; every later step, and a cancel (also one that comes before the task's
    first step), goes to the call itself."""

    def __init__(self, call: Coroutine[Any, Any, T], waiting_on: Any) -> None:
        self._call = call
        self._waiting_on: list[Any] = [waiting_on]  # until the task's first step

    def send(self, value: Any) -> Any:
        if self._waiting_on:
            return self._waiting_on.pop()
        return self._call.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._waiting_on.clear()
        if val is None and tb is None:
            return self._call.throw(typ)
        return self._call.throw(typ, val, tb)

    def close(self) -> None:
        self._call.close()

    def __await__(self) -> Generator[Any, Any, T]:
        raise TypeError("a started runtime call is run by its task, not awaited")
