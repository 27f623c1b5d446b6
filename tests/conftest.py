"""What the unit tests share, in one place: running async bodies, waiting on other
threads, the builders of what they feed in (pods, agent settings, host readings), what
they read back from the in-memory API (tests/fakekube.py), and the rigs more than one
test module drives (the sync loops; the whole agent; pods for the PLEG). Test modules
import from here (and from tests/fakekube.py, tests/fakeoperator.py), not from each
other: tests/test_layout.py checks it."""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import dataclasses
import datetime as dt
import functools
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client import CollectorRegistry

from nodeagent import config
from nodeagent.agent import Agent, Externals, PodParts, Pools, build_node_loop
from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import CERTIFICATE_SIGNING_REQUESTS, NODES, PODS
from nodeagent.events import Events
from nodeagent.node.host import HostReadings
from nodeagent.node.status import StatusSettings
from nodeagent.pods.cgroups import CgroupSettings, MemoryCgroups, NodeResources, PodCgroups
from nodeagent.pods.env import EnvResolver
from nodeagent.pods.images import ImageManager, PullSettings
from nodeagent.pods.loops import NodeLoops, NodeLoopsConfig
from nodeagent.pods.objects import ObjectCache, ServiceCache
from nodeagent.pods.pleg import Pleg, PodLifecycleEvent
from nodeagent.pods.podhalf import Closable, Pods, Runnable
from nodeagent.pods.podupdate import Op, Pod, PodUpdate, Source, SourcesReady
from nodeagent.pods.settings import NodePodSettings
from nodeagent.pods.volumes import TokenManager, VolumeManager
from nodeagent.pods.workers import DueTimes
from nodeagent.runtime import ContainerConfig, SandboxConfig
from nodeagent.runtime.base import (
    Container,
    ContainerState,
    PodRuntimeStatus,
    Runtime,
    Sandbox,
    SandboxState,
)
from nodeagent.runtime.fake import FakeRuntime
from nodeagent.server.auth import KubeletAuth
from nodeagent.server.kubeletserver import KubeletServer, ServerSettings
from nodeagent.server.stats import StatsProvider
from nodeagent.server.tls import ServingCert
from nodeagent.shutdown import Logind
from tests.fakekube import FakeKube

# -- running and waiting ----------------------------------------------------------------


def aio(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body in a fresh event loop (no pytest-asyncio here)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))
    return run


async def until(pred: Callable[[], bool], what: str = "the condition",
                timeout: float = 5.0) -> None:
    """Yield to the event loop (no sleeping) until `pred()` holds, for at most `timeout`
    seconds of real time: for things other threads or the kernel deliver."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"never: {what}")
        await asyncio.sleep(0)


def free_port() -> int:
    """A TCP port nothing listens on (for now) on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class InlineExecutor(concurrent.futures.Executor):
    """Runs each call at once in the caller's thread: blocking work under a FakeClock
    finishes within the test's own steps."""

    def submit(self, fn: Callable[..., Any], /, *args: Any,
               **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # delivered to the awaiting coroutine
            fut.set_exception(e)
        return fut


# -- builders ---------------------------------------------------------------------------

def mkpod(name: str = "web", uid: str | None = None, *, ns: str = "ns",
          node: str | None = "n1", policy: str | None = "Always",
          containers: Sequence[str | Mapping[str, Any]] = ("c",),
          image: str = "localhost/busybox:1", labels: Mapping[str, str] | None = None,
          phase: str | None = "Pending", **spec: Any) -> Pod:
    """A pod as the API server holds it: uid "uid-<name>" unless given, bound to `node`
    (None: no nodeName), restartPolicy `policy` (None: unset). Each of `containers` is a
    name (a container running `image`: sleep 3600) or a whole container spec; `spec`
    adds spec fields; `phase` None leaves the status out."""
    body: dict[str, Any] = {
        "containers": [{"name": c, "image": image, "command": ["sleep", "3600"]}
                       if isinstance(c, str) else dict(c) for c in containers], **spec}
    if node is not None:
        body["nodeName"] = node
    if policy is not None:
        body["restartPolicy"] = policy
    meta: dict[str, Any] = {"name": name, "namespace": ns, "uid": uid or f"uid-{name}"}
    if labels:
        meta["labels"] = dict(labels)
    pod: Pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": body}
    if phase is not None:
        pod["status"] = {"phase": phase}
    return pod


class Sink:
    """Takes the Warning Events the sources report (an EventSink)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def warning(self, reason: str, message: str) -> None:
        self.events.append((reason, message))


def fake_proc(tmp_path: Path, mem_avail_kb: int = 4_000_000, tasks: int = 345) -> Path:
    """A /proc with what the host readings read."""
    proc = tmp_path / "proc"
    (proc / "sys/kernel/random").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:        8000000 kB\nMemFree:         1000 kB\n"
        f"MemAvailable:    {mem_avail_kb} kB\n")
    (proc / "sys/kernel/pid_max").write_text("32768\n")
    (proc / "loadavg").write_text(f"0.10 0.20 0.30 2/{tasks} 12345\n")
    (proc / "sys/kernel/random/boot_id").write_text("boot-1\n")
    return proc


GI = 2**30
READINGS = HostReadings(
    cpu=4, memoryTotal=8 * GI, memoryAvailable=4 * GI, fsTotal=100 * GI, fsAvailable=50 * GI,
    inodesTotal=1_000_000, inodesFree=900_000, pidMax=4_194_304, pidsRunning=300,
    kernelVersion="6.1.0", osImage="Debian GNU/Linux 12", operatingSystem="linux",
    architecture="amd64", hostname="h1",
    addresses=(("InternalIP", "10.0.0.5"), ("Hostname", "h1")), machineID="m", bootID="b")
SETTINGS = StatusSettings(max_pods=110, agent_version="v0.1.0",
                          system_reserved={"cpu": 0.5, "memory": GI},
                          # the default hard eviction thresholds of memory and nodefs
                          eviction_held={"memory": (100 * 2**20, 0.0),
                                         "ephemeral-storage": (0.0, 10.0)})


def agent_flags(tmp_path: Path, *argv: str) -> dict[str, Any]:
    """The agent's flags as its command line parses them: no health server, state under
    tmp_path, a fake /proc; `argv` adds or overrides."""
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    proc = tmp_path / "proc"
    return vars(parser.parse_args(["--healthz-bind-address", "", "--root-dir", str(tmp_path),
                                   "--proc-path",
                                   str(proc if proc.exists() else fake_proc(tmp_path)),
                                   *argv]))


def agent_config(tmp_path: Path, *argv: str,
                 env: Mapping[str, str] | None = None) -> config.AgentConfig:
    return config.load(agent_flags(tmp_path, *argv), env or {})


# -- reading back from the in-memory API ------------------------------------------------

def status_patches(kube: FakeKube) -> list[tuple[str, dict[str, Any]]]:
    """(pod, status) of each pod status PATCH that went through, in order. The pod is
    named by the uid its patch carries (a precondition), or by namespace/name (a static
    pod's status goes to its mirror pod, whose uid is its own)."""
    out = []
    for c in kube.calls_of("patch pods/status", ok=True):
        body = c.body or {}
        who = (body.get("metadata") or {}).get("uid") or f"{c.namespace}/{c.name}"
        # the status as the API reads it: lists without their "$patch" directives
        out.append((str(who), {k: [i for i in v if not (isinstance(i, dict) and "$patch" in i)]
                               if isinstance(v, list) else v
                               for k, v in body["status"].items()}))
    return out


def pod_deletes(kube: FakeKube) -> list[str]:
    """The uids of the pods whose deletion was finished in the API (DELETE, grace 0)."""
    return [str(((c.body or {}).get("preconditions") or {}).get("uid"))
            for c in kube.calls_of("delete pods", ok=True)]


# -- rigs -------------------------------------------------------------------------------

class FakeMounter:
    """The mount table for tmpfs volumes, in memory; `refuse` makes mounting fail as
    it does for an agent without CAP_SYS_ADMIN."""

    def __init__(self) -> None:
        self.mounted: dict[str, int | None] = {}  # path -> size
        self.refuse = False

    def mount_tmpfs(self, path: str, size: int | None) -> None:
        if self.refuse:
            raise PermissionError(1, f"mount tmpfs on {path}: Operation not permitted")
        self.mounted[os.path.realpath(path)] = size

    def unmount(self, path: str) -> None:
        del self.mounted[path]

    def mounts_under(self, path: str) -> list[str]:
        root = os.path.realpath(path)
        return sorted((p for p in self.mounted if p == root or p.startswith(root + "/")),
                      key=lambda p: p.count("/"), reverse=True)


def token_answers(kube: FakeKube, clock: FakeClock) -> list[dict[str, Any]]:
    """The in-memory API answers TokenRequests: token "tok-<n>" for the asked
    expirationSeconds from the clock's now. Returns the requests' bodies as they come."""
    asked: list[dict[str, Any]] = []

    def answer(call: Any) -> dict[str, Any]:
        asked.append(call.body)
        secs = int(call.body["spec"].get("expirationSeconds") or 3600)
        expires = clock.now() + dt.timedelta(seconds=secs)
        return {**call.body, "status": {"token": f"tok-{len(asked)}",
                                        "expirationTimestamp": expires.strftime(
                                            "%Y-%m-%dT%H:%M:%SZ")}}
    kube.answer("create serviceaccounts/token", answer)
    return asked


class LoopRig:
    """The sync loops of the given nodes on a fake runtime and FakeClock, built as the
    composition root builds them (nodeagent.agent.build_node_loop) and fed as the merge
    feeds them; the in-memory API holds the pods sent (status is written there)."""

    def __init__(self, rt: FakeRuntime, clock: FakeClock, ready: bool = True,
                 nodes: Sequence[str] = ("n1",),
                 pod_settings: NodePodSettings | None = None,
                 volumes: Path | None = None, first_loop: bool = True,
                 cgroups: PodCgroups | None = None,
                 pressure: Callable[[str], frozenset[str]] | None = None) -> None:
        """`volumes`: the agent's root dir, to run with volumes, ConfigMaps, Secrets,
        Services and tokens from the in-memory API (a FakeMounter for tmpfs);
        `first_loop`: make the first node's loop now (else: when it first has a pod);
        `cgroups`: the pods' cgroups (default: in memory, a node of 4 CPUs, 8Gi, started);
        `pressure`: the nodes' pressure conditions (an eviction manager's)."""
        self.rt = rt
        self.clock = clock
        self.updates: asyncio.Queue[PodUpdate] = asyncio.Queue()
        self.ready = SourcesReady({Source.API})
        if ready:
            self.ready.mark(Source.API)
        self.kube = FakeKube(now=clock.monotonic)
        self.registry = CollectorRegistry()
        self.events = Events(self.kube, nodes[0], clock, node_uid=lambda: "node-uid")
        settings = pod_settings or NodePodSettings()
        settings = dataclasses.replace(settings, host_ip="192.0.2.10",
                                       memory_capacity=settings.memory_capacity or 8 * GI)
        if cgroups is None:
            node = NodeResources(cpu_millis=4000, memory_bytes=8 * GI, pids=4_194_304)
            cgroups = PodCgroups(MemoryCgroups(), CgroupSettings(), node, node, clock)
            cgroups.start()
        self.cgroups = cgroups
        self.mounter = FakeMounter()
        self.allocatable = {"cpu": "4", "memory": "8Gi", "ephemeral-storage": "100Gi",
                            "pods": "110"}
        # what admission reads of each node's Node (node_view)
        self.node_labels: dict[str, str] = {"kubernetes.io/os": "linux"}
        self.node_taints: list[dict[str, str]] = []
        self.objects: ObjectCache | None = None
        self.volumes: VolumeManager | None = None
        env = EnvResolver()
        if volumes is not None:
            self.objects = ObjectCache(self.kube, clock)
            self.tokens = TokenManager(self.kube, clock)
            self.volumes = VolumeManager(volumes, clock, objects=self.objects,
                                         tokens=self.tokens, mounter=self.mounter,
                                         allocatable=lambda node: self.allocatable)
            env = EnvResolver(self.objects, ServiceCache(self.kube, clock),
                              lambda node: self.allocatable)
        label = nodes[0] if len(nodes) == 1 else "vn"
        pleg = Pleg(rt, clock, node=label, registry=self.registry)
        self.images = ImageManager(
            rt, clock, kube=self.kube, events=self.events, registry=self.registry,
            settings=PullSettings(present_events=settings.runs_workloads))
        self.parts = PodParts(runtime=rt, clock=clock, kube=self.kube,
                              answered=ApiAnswered(clock), events=self.events,
                              registry=self.registry, settings=settings, cache=pleg.cache,
                              runs=pleg.runs,
                              images=self.images, due_times=DueTimes(), env=env,
                              volumes=self.volumes, node_info=self.node_view,
                              cgroups=cgroups, pressure=pressure)
        self.loops = NodeLoops(NodeLoopsConfig(tuple(nodes)),
                               functools.partial(build_node_loop, shared=self.parts), pleg,
                               self.updates, self.ready, clock, self.parts.due_times,
                               self.volumes, cgroups)
        if self.objects is not None:
            self.objects.on_change = self.loops.objects_changed
        if first_loop:
            self.loop = self.loops.loop(nodes[0])  # the first node's own
        shared: list[Closable] = [self.images]
        if self.objects is not None:
            shared.append(self.objects)
        background: list[Runnable] = []
        if env.services is not None:
            shared.append(env.services)
            background.append(env.services)
        # with the runtime's readings, no sources
        self.pods = Pods(rt, clock, self.loops, background=background, shared=shared)

    def node_view(self, name: str) -> dict[str, Any]:
        """A node's Node as admission reads it: the rig's allocatable, labels (with the
        node's hostname) and taints."""
        return {"metadata": {"name": name,
                             "labels": {**self.node_labels, "kubernetes.io/hostname": name}},
                "spec": {"taints": list(self.node_taints)},
                "status": {"allocatable": dict(self.allocatable)}}

    def warnings(self) -> list[dict[str, Any]]:
        """The Warning Events written so far."""
        return [c.body for c in self.kube.calls_of("create events")
                if c.body and c.body["type"] == "Warning"]

    def events_of(self, reason: str) -> list[str]:
        """The messages of the Events with this reason written so far."""
        return [c.body["message"] for c in self.kube.calls_of("create events")
                if c.body and c.body["reason"] == reason]

    def condition(self, uid: str, ctype: str) -> dict[str, Any]:
        return next(c for c in self.status(uid)["conditions"] if c["type"] == ctype)

    def send(self, op: Op, *pods: Pod) -> None:
        """What the API source would deliver; the API server holds the same pods."""
        for pod in pods:
            meta = pod["metadata"]
            if op != Op.REMOVE:
                self.kube.put(PODS, pod)
            elif self.kube.has(PODS, meta["name"], meta["namespace"]):
                self.kube.remove(PODS, meta["name"], meta["namespace"])
        self.updates.put_nowait(PodUpdate(op, tuple(pods), Source.API))

    def patches(self) -> list[tuple[str, dict[str, Any]]]:
        return status_patches(self.kube)

    def status(self, uid: str) -> dict[str, Any]:
        return [st for u, st in self.patches() if u == uid][-1]

    def cstatus(self, uid: str, i: int = 0) -> dict[str, Any]:
        return self.status(uid)["containerStatuses"][i]

    async def run_for(self, seconds: float) -> None:
        for _ in range(int(seconds)):
            await self.clock.advance(1)


async def started(clock: FakeClock, rt: FakeRuntime | None = None,
                  pods_dir: str = "", log_root: str = "") -> LoopRig:
    a = LoopRig(rt or FakeRuntime(clock), clock,
                pod_settings=NodePodSettings(pods_dir=pods_dir, log_root=log_root))
    a.loops.start()
    await settle()
    return a


# the PLEG tests' pods on the fake runtime, and the events the PLEG hands out
def pod_of(uid: str, containers: int = 1) -> dict:
    return mkpod(f"p-{uid}", uid, image="img", containers=[f"c{i}" for i in range(containers)])


async def start_pod(rt: FakeRuntime, uid: str, containers: int = 1) -> list[str]:
    p = pod_of(uid, containers)
    sc = SandboxConfig.from_pod(p)
    sid = await rt.run_sandbox(sc)
    ids = []
    for c in p["spec"]["containers"]:
        cid = await rt.create_container(sid, ContainerConfig.from_pod(p, c), sc)
        await rt.start_container(cid)
        ids.append(cid)
    return ids


def drain(q: asyncio.Queue[PodLifecycleEvent]) -> list[PodLifecycleEvent]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


HERMETIC_FS = "{fsTotal: 100Gi, fsAvailable: 50Gi, inodesTotal: 1000000, inodesFree: 900000}"


class AgentRig:
    """The agent as its composition root builds it, on the in-memory API, the fake
    runtime and FakeClock (blocking work inline): pods reach it through the API source,
    as they would from the API server."""

    def __init__(self, tmp_path: Path, *argv: str, health: str = "",
                 images: Sequence[str] = ("localhost/busybox:1", "localhost/pause:1"),
                 image_size: int = 5_000_000,
                 logind: Callable[[], Awaitable[Logind]] | None = None) -> None:
        """`logind`: graceful node shutdown's way to logind (a fake)."""
        # the filesystem as measured nowhere: a full disk under the test run must not
        # put the node under pressure (its eviction manager would refuse pods)
        self.flags = agent_flags(tmp_path, "--node-name", "n1", "--healthz-bind-address",
                                 health, "--host-overrides", HERMETIC_FS, *argv)
        # no kubelet API here (tests/test_server_*.py test it): nothing listens on 10250
        self.cfg = dataclasses.replace(config.load(self.flags, {}), port=None)
        self.clock = FakeClock()
        self.kube = FakeKube(now=self.clock.monotonic)
        self.rt = FakeRuntime(self.clock, images=images, image_size=image_size)
        inline = InlineExecutor()
        self.agent = Agent(self.cfg, Externals(self.kube, self.clock, runtime=self.rt,
                                           pools=Pools(inline, inline), host_ip="192.0.2.10",
                                           registry=CollectorRegistry(), flags=self.flags,
                                           env={}, logind=logind))
        self.pods = self.agent.pods
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.agent.run(self.stop))
        await settle()

    async def finish(self) -> None:
        self.stop.set()
        assert self.task is not None
        await self.task

    def node(self, name: str = "n1") -> dict[str, Any]:
        return self.kube.obj(NODES, name)

    def ready_condition(self) -> dict[str, Any]:
        return next(c for c in self.node()["status"]["conditions"] if c["type"] == "Ready")

    def status(self, uid: str) -> dict[str, Any]:
        return [st for u, st in status_patches(self.kube) if u == uid][-1]


class TestSigner:
    """A cluster CA that approves and signs CertificateSigningRequests in the in-memory
    API, as an approver and the controller manager's csrsigning would (or denies them)."""

    __test__ = False  # not a test class, whatever pytest thinks of its name

    def __init__(self, kube: FakeKube, clock: FakeClock) -> None:
        self.kube, self.clock = kube, clock
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-ca")])
        now = clock.now()
        self.cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                     .public_key(self.key.public_key())
                     .serial_number(x509.random_serial_number())
                     .not_valid_before(now - dt.timedelta(days=1))
                     .not_valid_after(now + dt.timedelta(days=3650))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None),
                                    critical=True)
                     .sign(self.key, hashes.SHA256()))

    def pending(self) -> list[str]:
        """Names of the CSRs neither signed nor refused yet."""
        return [n for n, o in self.kube.items(CERTIFICATE_SIGNING_REQUESTS).items()
                if not (o.get("status") or {}).get("certificate")
                and not (o.get("status") or {}).get("conditions")]

    def sign(self, name: str, lifetime: dt.timedelta = dt.timedelta(days=365)) -> bytes:
        """Approve and sign the CSR `name`: its certificate, valid from now."""
        obj = self.kube.obj(CERTIFICATE_SIGNING_REQUESTS, name)
        req = x509.load_pem_x509_csr(base64.b64decode(obj["spec"]["request"]))
        now = self.clock.now()
        cert = (x509.CertificateBuilder().subject_name(req.subject)
                .issuer_name(self.cert.subject).public_key(req.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(now + lifetime)
                .sign(self.key, hashes.SHA256()))
        pem = cert.public_bytes(serialization.Encoding.PEM)
        obj["status"] = {"conditions": [{"type": "Approved", "status": "True",
                                         "reason": "TestSigner"}],
                         "certificate": base64.b64encode(pem).decode()}
        self.kube.put(CERTIFICATE_SIGNING_REQUESTS, obj)
        return pem

    def deny(self, name: str, reason: str = "NotAllowed", message: str = "no") -> None:
        obj = self.kube.obj(CERTIFICATE_SIGNING_REQUESTS, name)
        obj["status"] = {"conditions": [{"type": "Denied", "status": "True",
                                         "reason": reason, "message": message}]}
        self.kube.put(CERTIFICATE_SIGNING_REQUESTS, obj)


# -- the kubelet API server, with a fake runtime and in-memory reviews --

class KubeletApiFake:
    """TokenReview: "good-<user>" is <user>; SubjectAccessReview: `allowed` (user,
    subresource) pairs."""

    def __init__(self, allowed: set[tuple[str, str]]) -> None:
        self.allowed = allowed

    async def review_token(self, token: str) -> dict[str, Any]:
        if token.startswith("good-") and len(token) > 5:
            return {"authenticated": True, "user": {"username": token[5:]}}
        return {"authenticated": False}

    async def review_access(self, spec: dict[str, Any]) -> dict[str, Any]:
        sub = spec["resourceAttributes"]["subresource"]
        return {"allowed": (spec["user"], sub) in self.allowed}

    async def create_csr(self, body: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("not used")

    async def get_csr(self, name: str) -> dict[str, Any]:
        raise AssertionError("not used")


class OnePodHost:
    """One pod, web in ns (uid u1, container main), whose container runs (sandbox s1,
    container c1) when `running`."""

    def __init__(self, runtime: Runtime, running: bool = False) -> None:
        self.runtime = runtime
        self.running = running
        self.pod = {"metadata": {"name": "web", "namespace": "ns", "uid": "u1"},
                    "spec": {"nodeName": "n1", "containers": [{"name": "main",
                                                               "image": "img"}]}}

    def find_pod(self, namespace: str, name: str) -> tuple[str, dict[str, Any]] | None:
        return ("n1", self.pod) if (namespace, name) == ("ns", "web") else None

    def all_pods(self) -> list[dict[str, Any]]:
        return [self.pod]

    def node_pods(self, node: str) -> list[dict[str, Any]]:
        return [self.pod] if node == "n1" else []

    def runtime_pod(self, uid: str) -> PodRuntimeStatus:
        if not self.running:
            return PodRuntimeStatus(uid)
        return PodRuntimeStatus(uid, [Sandbox("s1", uid, "web", "ns", 0, SandboxState.READY)],
                                [Container("c1", "s1", uid, "main", "img",
                                           ContainerState.RUNNING)])


class NoTls:
    """A mocked request's transport: no peer certificate."""

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


# what read_node gives on a small machine
NODE_READING = {"cpu_seconds": 12.5, "memory_total": 4 * 2**30, "memory_usage": 2**30,
                "memory_working_set": 2**29, "memory_available": 3 * 2**30,
                "boot_time": 1.7e9}


def kubelet_server(tmp: Path, now: dt.datetime, runtime: Runtime | None = None, *,
                   clock: FakeClock | None = None, **settings: Any) -> KubeletServer:
    """A KubeletServer for node n1 serving OnePodHost on 127.0.0.1 and a free port; alice
    may use nodes/proxy, stan nodes/stats. `settings`: ServerSettings' fields."""
    clock = clock or FakeClock(now)
    api = KubeletApiFake({("alice", "proxy"), ("stan", "stats")})
    cert = ServingCert(node="n1", names=["127.0.0.1"], pki_dir=tmp / "pki", clock=clock)
    cert.load_self_signed()
    host = OnePodHost(runtime or FakeRuntime(clock), running=runtime is not None)
    usage = StatsProvider(host, host.runtime, clock, lambda: dict(NODE_READING))
    return KubeletServer(host, KubeletAuth(api, clock), cert, usage, node_names=["n1"],
                         clock=clock, registry=CollectorRegistry(),
                         settings=ServerSettings(address="127.0.0.1", port=0, **settings))
