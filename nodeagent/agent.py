"""The agent's composition root: every part, built from the agent's settings, once.

    Agent(cfg, Externals(RestKube(api), RealClock(), flags=..., env=...)).run(stop)

Shared, whatever the number of nodes: one API client (Kube), one ApiAnswered signal,
one renewal scheduler with request turns of its own, one status ticker with others, one
Node watch, one pod watch and pod source merge, one runtime and one PLEG (NodeLoops),
one health server. A host agent speaks for one node; virtual nodes add more
NodeControllers and SyncLoops to the same. No other module builds parts of the agent:
each component is handed what it uses. What is made per node, when a node is added or
first has a pod, is made here too: build_node_controller (the heartbeat half),
build_node_loop (the pod half, from the PodParts every node shares); the kubelet API by
build_kubelet_api; the pods' cgroups (in the host's cgroup filesystem, as records, or
none, by what the runtime does with them) by build_pod_cgroups. Tests build their rigs
with the same functions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import math
import random
import socket
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry

from nodeagent import __version__
from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import Clock
from nodeagent.api.kube import Kube
from nodeagent.api.serve import HealthServer
from nodeagent.config import VIRTUAL_LABEL, AgentConfig, ConfigError, load
from nodeagent.events import Events
from nodeagent.node.controller import NodeController, NodeControllerConfig, NodeSpec
from nodeagent.node.heartbeatmetrics import node_metrics
from nodeagent.node.host import FsUsage, HostProbe, HostReadError, HostReadings, filesystem
from nodeagent.node.lease import LeaseRenewer
from nodeagent.node.nodewatch import NodeWatch
from nodeagent.node.scheduler import Blocking, DueScheduler, inline
from nodeagent.node.status import StatusSettings
from nodeagent.pods.admission import AdmissionSettings, NodeAdmission
from nodeagent.pods.backoff import CrashBackoff
from nodeagent.pods.cgroups import (
    CgroupBackend,
    CgroupError,
    CgroupSettings,
    MemoryCgroups,
    NodeResources,
    PodCgroups,
)
from nodeagent.pods.containers import Containers
from nodeagent.pods.dns import DnsSettings
from nodeagent.pods.env import EnvResolver
from nodeagent.pods.eviction import (
    EvictionManager,
    EvictionSettings,
    HostSignals,
    Reading,
    pod_files,
)
from nodeagent.pods.gc import GarbageCollector, GcSettings
from nodeagent.pods.handlers import Actions
from nodeagent.pods.hooks import Hooks
from nodeagent.pods.images import ImageManager, PullSettings
from nodeagent.pods.loops import NodeLoops, NodeLoopsConfig, SyncLoop
from nodeagent.pods.objects import ObjectCache, ServiceCache
from nodeagent.pods.pleg import Pleg, PlegConfig, PodCache
from nodeagent.pods.podhalf import Pods, Runnable, running_logs
from nodeagent.pods.podstatus import StatusManager
from nodeagent.pods.podupdate import Source
from nodeagent.pods.probes import ProbeManager
from nodeagent.pods.runtimecalls import RuntimeCalls
from nodeagent.pods.sandboxes import Sandboxes
from nodeagent.pods.settings import NodePodSettings, PodTiming
from nodeagent.pods.sources.api import APISource
from nodeagent.pods.sources.merge import Merge
from nodeagent.pods.sources.problems import Problems
from nodeagent.pods.syncer import PodSyncer
from nodeagent.pods.thresholds import (
    IMAGEFS,
    IMAGEFS_INODES,
    MEMORY,
    NODEFS,
    NODEFS_INODES,
    PIDS,
)
from nodeagent.pods.volumes import HostMounter, TokenManager, VolumeManager
from nodeagent.pods.workers import DueTimes, PodWorkers
from nodeagent.runtime import ContainerRuntimeError, Runtime, make_runtime, socket_path
from nodeagent.runtime.logrotation import LogRotation
from nodeagent.runtime.usage import parse_usage

# What only some settings use is imported where they are read, so that an agent of
# virtual nodes holds none of its code: the host's cgroups, static pods' sources and
# mirrors, graceful shutdown.
if TYPE_CHECKING:
    from nodeagent.server.bundle import ServerBundle
    from nodeagent.server.kubeletserver import HealthCheck
    from nodeagent.server.podhost import PodHost
    from nodeagent.shutdown import Logind, ShutdownManager

log = logging.getLogger(__name__)


TIMER_SLACK = 0.05  # seconds a renewal or status tick may run after its due time
# Events take request turns of their own, few (the kubelet has a client of its own
# for them, paced apart): a burst of pods' start Events, three a pod, neither takes
# the turns their status writes need nor reaches the API server ahead of them
EVENT_CONNECTIONS = 2
# status ticks running at once, per request turn of the status writes: a tick waiting
# for its turn holds the status it computed (DueScheduler's max_running)
TICKS_PER_STATUS_TURN = 16


def status_settings(cfg: AgentConfig) -> StatusSettings:
    # what the hard eviction thresholds hold back of allocatable, as the kubelet's
    held = {resource: (amount.value or 0.0, amount.percent or 0.0)
            for signal, resource in (("memory.available", "memory"),
                                     ("nodefs.available", "ephemeral-storage"))
            if (amount := cfg.eviction_hard.get(signal)) is not None}
    return StatusSettings(max_pods=cfg.max_pods, eviction_held=held,
                          system_reserved=dict(cfg.system_reserved),
                          max_images=cfg.heartbeat.maxImagesInStatus,
                          agent_version=f"v{__version__}-nodepulse")  # semver: tools parse it


def eviction_settings(cfg: AgentConfig) -> EvictionSettings:
    return EvictionSettings(thresholds=cfg.eviction_thresholds,
                            max_pod_grace_period=cfg.eviction_max_pod_grace_period,
                            pressure_transition_period=cfg.eviction_pressure_transition_period)


def gc_settings(cfg: AgentConfig) -> GcSettings:
    return GcSettings(image_high_percent=cfg.image_gc_high_threshold,
                      image_low_percent=cfg.image_gc_low_threshold,
                      image_min_age=cfg.image_minimum_gc_age,
                      container_min_age=cfg.minimum_container_ttl_duration,
                      max_per_container=cfg.maximum_dead_containers_per_container,
                      max_containers=cfg.maximum_dead_containers)


def host_signals(r: HostReadings, cfg: AgentConfig, nodefs: FsUsage,
                 imagefs: FsUsage | None) -> HostSignals:
    """The eviction manager's signals from one host reading. A node whose resource is
    not the host's own counts its pods' use of it instead (Reading.available None):
    virtual nodes, for all of them; a node given its memory in hostOverrides (and not
    what is available of it), for memory. `imagefs`: the runtime's image filesystem
    (None: it keeps none; the signals are then nodefs')."""
    own = not cfg.virtual
    o = cfg.host_overrides
    own_memory = own and ("memoryTotal" not in o or "memoryAvailable" in o)
    readings = {
        MEMORY: Reading(r.memoryTotal, r.memoryAvailable if own_memory else None),
        NODEFS: Reading(r.fsTotal, r.fsAvailable if own else None),
        NODEFS_INODES: Reading(r.inodesTotal, r.inodesFree if own else None),
        PIDS: Reading(r.pidMax, max(0, r.pidMax - r.pidsRunning) if own else None),
    }
    dedicated = own and imagefs is not None and imagefs.device != nodefs.device
    if dedicated:
        assert imagefs is not None
        readings[IMAGEFS] = Reading(imagefs.total, imagefs.available)
        readings[IMAGEFS_INODES] = Reading(imagefs.inodes, imagefs.inodes_free)
    else:
        readings[IMAGEFS], readings[IMAGEFS_INODES] = readings[NODEFS], readings[NODEFS_INODES]
    return HostSignals(readings, imagefs_dedicated=dedicated)


class SharedReadings:
    """One host reading shared by every node for `ttl` seconds: 1000 virtual nodes'
    status ticks read /proc once a second, not 1000 times (on the event loop)."""

    def __init__(self, read: Callable[[], HostReadings], clock: Clock, ttl: float = 1.0) -> None:
        self._read = read
        self.clock = clock
        self.ttl = ttl
        self.reads = 0
        self._lock = threading.Lock()
        self._at = -math.inf
        self._value: HostReadings | HostReadError | None = None

    def read(self) -> HostReadings:
        with self._lock:
            now = self.clock.monotonic()
            if self._value is None or now - self._at >= self.ttl:
                try:
                    self._value = self._read()
                except HostReadError as e:
                    self._value = e  # the same failure for everyone until the next read
                self._at = now
                self.reads += 1
            value = self._value
        if isinstance(value, HostReadError):
            raise value
        return value


async def image_fs(read_signals: Callable[[], Awaitable[HostSignals]]
                   ) -> tuple[float, float] | None:
    """(capacity, available) of the image filesystem, for the image collector; None for
    virtual nodes (their images are not the host's)."""
    r = (await read_signals()).readings[IMAGEFS]
    return None if r.available is None else (r.capacity, r.available)


def node_specs(cfg: AgentConfig) -> list[NodeSpec]:
    """The Nodes this process speaks for: one host node, or the virtual ones (labelled
    nodepulse.dev/virtual=true and tainted with the virtual taints)."""
    if not cfg.virtual:
        return [NodeSpec(cfg.node_name, cfg.agent_id, labels=dict(cfg.node_labels),
                         taints=cfg.register_with_taints, provider_id=cfg.provider_id)]
    labels = {**cfg.node_labels, VIRTUAL_LABEL: "true"}
    taints = list(cfg.register_with_taints)
    taints += [t for t in cfg.virtual_node_taints
               if (t["key"], t["effect"]) not in {(u["key"], u["effect"]) for u in taints}]
    return [NodeSpec(name, cfg.agent_id, labels=labels, taints=taints)
            for name in cfg.virtual_node_names]


def host_probe(cfg: AgentConfig) -> HostProbe:
    return HostProbe(root_dir=cfg.root_dir, proc=cfg.proc_path, node_ips=cfg.node_ips,
                     overrides=cfg.host_overrides)


def host_ip(cfg: AgentConfig, probe: HostProbe) -> str:
    """The node's first InternalIP (pods report it as hostIP)."""
    if cfg.node_ips:
        return cfg.node_ips[0]
    try:
        addresses = probe.read().addresses
    except HostReadError:
        return ""
    return next((a for t, a in addresses if t == "InternalIP"), "")


def build_runtime(cfg: AgentConfig, host_ip: str = "") -> Runtime:
    """The runtime the config names; process runtime state lives under --root-dir."""
    opts: dict[str, Any] = {}
    kind = cfg.runtime
    if kind == "auto" and cfg.virtual:
        kind = "fake"
    if kind == "cri" and cfg.virtual:  # config.load refuses it too; a clear error here
        raise ContainerRuntimeError("the cri runtime cannot serve virtual nodes; use "
                                    "--runtime fake or process")
    if kind == "auto":
        kind = "cri" if Path(socket_path(cfg.container_runtime_endpoint)).exists() else "process"
    if kind == "process":
        opts = {"state_dir": Path(cfg.root_dir) / "process", "host_ip": host_ip}
    elif kind == "fake":
        opts = {"host_ip": host_ip or "192.0.2.10",
                "default_cpu": parse_usage(cfg.fake_cpu, "--fake-cpu"),
                "default_memory": parse_usage(cfg.fake_memory, "--fake-memory")}
    return make_runtime(kind, cfg.container_runtime_endpoint, **opts)


SYSTEMD_RUNNING = Path("/run/systemd/system")  # there when systemd is the host's init


def cgroup_settings(cfg: AgentConfig) -> CgroupSettings:
    return CgroupSettings(root=cfg.cgroup_root, per_qos=cfg.cgroups_per_qos,
                          driver=cfg.cgroup_driver,
                          enforce_pods="pods" in cfg.enforce_node_allocatable,
                          pod_pids_limit=cfg.pod_pids_limit,
                          qos_reserved_memory=cfg.qos_reserved.get("memory", 0))


def build_pod_cgroups(cfg: AgentConfig, runtime: Runtime, read: Callable[[], HostReadings],
                      clock: Clock) -> PodCgroups:
    """The pods' cgroups, kept where the runtime's containers are: in the host's cgroup
    filesystem (a runtime that runs them in their cgroup_parent, on a host agent), as
    records (a runtime that runs nothing, virtual nodes), or nowhere (a runtime that
    places nothing in cgroups, --cgroups-per-qos=false). Raises ConfigError."""
    on_host = runtime.cgroups == "host" and not cfg.virtual and cfg.cgroups_per_qos
    try:
        r = read()
        capacity = NodeResources(round(r.cpu * 1000), r.memoryTotal, r.pidMax)
    except HostReadError as e:
        if on_host:
            raise ConfigError(f"the node's capacity, which its cgroups are given, cannot "
                              f"be read: {e}") from None
        capacity = NodeResources(0, 0, 0)
    backend: CgroupBackend | None = None
    if on_host:
        backend = host_cgroups(cfg)
    elif runtime.cgroups in ("host", "simulated"):
        backend = MemoryCgroups()
    # --system-reserved with --kube-reserved added (config.py)
    return PodCgroups(backend, cgroup_settings(cfg), capacity,
                      capacity.less(cfg.system_reserved), clock)


def host_cgroups(cfg: AgentConfig) -> CgroupBackend:
    """The host's cgroups for the configured driver: the cgroup files (cgroupfs), or
    systemd's slices beside them (systemd). Raises ConfigError."""
    from nodeagent.pods.cgroupfs import CgroupFs
    try:
        files = CgroupFs.detect()
    except CgroupError as e:
        raise ConfigError(f"--cgroups-per-qos: {e}") from None
    if cfg.cgroup_driver != "systemd":
        return files
    if not SYSTEMD_RUNNING.is_dir():
        raise ConfigError(f"--cgroup-driver=systemd: systemd is not running on this host "
                          f"(no {SYSTEMD_RUNNING}); use --cgroup-driver=cgroupfs, with the "
                          "container runtime set to cgroupfs too")
    from nodeagent.pods.systemdcgroups import SystemdCgroups
    from nodeagent.systembus import SystemdUnits  # D-Bus: only with this driver
    try:
        return SystemdCgroups(files, SystemdUnits.connect())
    except CgroupError as e:
        raise ConfigError(f"--cgroup-driver=systemd: {e}") from None


# threads that make, write and remove pods' volumes (a slow disk holds these, never
# the event loop)
FILE_THREADS = 4


@dataclasses.dataclass(frozen=True)
class Pools:
    """The threads blocking work runs on: host readings and the status computation, and
    the pods' files (API requests run on the event loop, see nodeagent.api.rest)."""

    status: concurrent.futures.Executor
    files: concurrent.futures.Executor

    @classmethod
    def of(cls, cfg: AgentConfig) -> Pools:
        return cls(concurrent.futures.ThreadPoolExecutor(cfg.status_concurrency,
                                                         thread_name_prefix="status"),
                   concurrent.futures.ThreadPoolExecutor(FILE_THREADS,
                                                         thread_name_prefix="files"))


@dataclasses.dataclass(frozen=True)
class Externals:
    """What the agent is built from besides its settings (tests hand in fakes)."""

    kube: Kube  # the API server: RestKube over a client from nodeagent.api.client
    clock: Clock
    runtime: Runtime | None = None  # None: the one the config names
    pools: Pools | None = None  # None: thread pools sized by the config
    registry: CollectorRegistry = REGISTRY
    # what the config was loaded from, to load it again when its file changes
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    env: Mapping[str, str] | None = None
    host_ip: str | None = None  # None: read from the host
    # graceful node shutdown's way to logind (None: the system bus, nodeagent.systembus)
    logind: Callable[[], Awaitable[Logind]] | None = None


@dataclasses.dataclass(frozen=True)
class PodParts:
    """What every node's pod loop shares: built once, handed to build_node_loop."""

    runtime: Runtime
    clock: Clock
    kube: Kube                 # pod status writes, RuntimeClasses
    answered: ApiAnswered      # the status writes' backoffs end when the API answers again
    events: Events | None      # Events about pods (None: none written)
    registry: CollectorRegistry
    settings: NodePodSettings  # the node's name is each loop's own
    cache: PodCache            # the PLEG's
    runs: Callable[[str], bool]  # whether the PLEG's last relist found the pod running
    images: ImageManager       # one runtime: one set of pulls
    due_times: DueTimes        # every loop's pods' resyncs, ticked from one timer
    env: EnvResolver
    # a node's Node as admission reads it (labels, taints, allocatable); None: unknown
    node_info: Callable[[str], Mapping[str, Any] | None]
    cgroups: PodCgroups       # every node's pods' cgroups
    # None: pods with volumes are refused; its ObjectCache follows the ConfigMaps and
    # Secrets pods use
    volumes: VolumeManager | None = None
    timing: PodTiming = PodTiming()
    # node -> its pressure conditions now (the eviction manager's; None: never any)
    pressure: Callable[[str], frozenset[str]] | None = None
    # whether the node is shutting down (graceful node shutdown): new pods are refused
    shutting_down: Callable[[], bool] | None = None


def build_node_loop(node: str, shared: PodParts) -> SyncLoop:
    """One node's pod loop: its admission, status writes, probes, syncer (with the parts
    it drives) and pod workers."""
    p, t = shared, shared.timing
    settings = dataclasses.replace(p.settings, node_name=node)
    admission = NodeAdmission(node, settings.admission, functools.partial(p.node_info, node),
                              p.runs, p.events,
                              functools.partial(p.pressure, node) if p.pressure else None,
                              p.shutting_down)
    calls = RuntimeCalls(p.runtime, p.clock, t.call_timeout)
    status = StatusManager(p.kube, p.clock, answered=p.answered, node=node,
                           registry=p.registry)
    handlers = Actions(p.runtime)
    probes = ProbeManager(handlers, p.cache, p.clock, events=p.events,
                          host_ip=p.settings.host_ip, node=node, registry=p.registry)
    hooks = Hooks(handlers, p.clock, p.events)
    backoff = CrashBackoff(p.clock, t.crash_backoff_initial, t.crash_backoff_max,
                           t.crash_backoff_reset)
    containers = Containers(calls, p.images, p.env, p.volumes, hooks, backoff, p.events,
                            settings)
    syncer = PodSyncer(calls, status, Sandboxes(calls, p.kube, p.events, settings, p.cgroups),
                       containers, p.volumes, probes, p.events, settings, admission)
    workers = PodWorkers(syncer, p.cache, p.clock, node=node, timing=t,
                         due_times=p.due_times, registry=p.registry)
    return SyncLoop(node, status, probes, workers, p.registry)


def build_node_controller(spec: NodeSpec, config: NodeControllerConfig,
                          rng: random.Random) -> NodeController:
    """One node's heartbeat: its controller and its Lease renewer."""
    c = config
    lease = LeaseRenewer(spec.name, c.lease_kube, c.clock, c.metrics, c.heartbeat,
                         answered=c.answered, rng=rng, spread_first=c.started_together)
    return NodeController(spec, config, lease, rng)


def build_kubelet_api(cfg: AgentConfig, host: PodHost, kube: Kube, *, clock: Clock,
                      registry: CollectorRegistry, addresses: Sequence[str],
                      health_checks: Mapping[str, HealthCheck]) -> ServerBundle:
    """The kubelet API's server, its serving certificate and the API calls it makes."""
    # aiohttp and TLS: imported only when the API is served
    from nodeagent.server.auth import KubeletAuth
    from nodeagent.server.bundle import ServerBundle
    from nodeagent.server.kubeapi import RealServerApi
    from nodeagent.server.kubeletserver import KubeletServer, ServerSettings
    from nodeagent.server.stats import SimulatedNode, StatsProvider, read_node
    from nodeagent.server.tls import CertError, ServingCert
    assert cfg.port is not None
    names = [*addresses, *cfg.node_names, socket.gethostname().lower()]
    try:
        cert = ServingCert(node=cfg.node_name, names=names,
                           pki_dir=Path(cfg.cert_dir or Path(cfg.root_dir) / "pki"),
                           cert_file=cfg.tls_cert_file, key_file=cfg.tls_private_key_file,
                           client_ca_file=cfg.client_ca_file, clock=clock,
                           tls13_only=cfg.tls_min_version == "VersionTLS13")
        if cfg.tls_cert_file:
            cert.load_files()
        elif not cfg.rotate_server_certificates:
            cert.load_self_signed()
        elif cert.load_current() is None:
            cert.load_self_signed()  # until the first CSR is signed
    except CertError as e:
        raise ConfigError(str(e)) from None
    # connections of our own: the API's TokenReviews must not wait behind pod status writes
    api = RealServerApi(kube.separate(4))
    auth = KubeletAuth(api, clock, anonymous=cfg.anonymous_auth,
                       token_webhook=cfg.authentication_token_webhook,
                       authorize_all=cfg.authorization_mode == "AlwaysAllow",
                       token_ttl=cfg.authentication_token_webhook_cache_ttl,
                       allowed_ttl=cfg.authorization_webhook_cache_authorized_ttl,
                       denied_ttl=cfg.authorization_webhook_cache_unauthorized_ttl)
    simulated = None
    if host.runtime.scheme == "fake":  # its containers' usage is simulated: its nodes' too
        simulated = SimulatedNode(cpu=parse_usage(cfg.fake_node_cpu, "--fake-node-cpu"),
                                  memory=parse_usage(cfg.fake_node_memory, "--fake-node-memory"),
                                  # the memory its Node says it has
                                  memory_capacity=float(cfg.host_overrides.get(
                                      "memoryTotal", read_node()["memory_total"])))
    settings = ServerSettings(address=cfg.address, port=cfg.port,
                              debugging_handlers=cfg.enable_debugging_handlers,
                              connection_idle_timeout=cfg.connection_idle_timeout,
                              streaming_idle_timeout=cfg.streaming_connection_idle_timeout,
                              per_node_ports=cfg.virtual)
    server = KubeletServer(host, auth, cert,
                           StatsProvider(host, host.runtime, clock, simulated=simulated),
                           node_names=cfg.node_names, clock=clock, registry=registry,
                           settings=settings, health_checks=health_checks)
    # the serving certificate's CSRs, on a connection of their own
    return ServerBundle(server, cert, kube.separate(1), cfg.rotate_server_certificates)


class Agent:
    def __init__(self, cfg: AgentConfig, ext: Externals) -> None:
        self.cfg = cfg
        self.kube = kube = ext.kube
        self.clock = clock = ext.clock
        self.registry = ext.registry
        self._flags = dict(ext.flags)
        self._env = ext.env
        self.answered = ApiAnswered(clock)
        self.pools = ext.pools or Pools.of(cfg)
        self.probe = host_probe(cfg)
        self.shared_readings = SharedReadings(self.probe.read, clock)
        self.settings = status_settings(cfg)
        self.nodes: dict[str, NodeController] = {}
        # one generator for every node's jitter (each draws its own numbers from it):
        # a Random is 2.5 KB, which a thousand virtual nodes would each hold
        self.rng = random.Random()
        self.uids: dict[str, str] = {}  # node name -> its Node's UID, once registered
        # Events about the Node and its pods, on connections of their own
        self.events = Events(kube.separate(EVENT_CONNECTIONS), cfg.node_name, clock,
                             node_uid=lambda: self.uids.get(cfg.node_name))
        self.pods = self._pods(cfg, ext, self.events)
        self.node_shutdown = self._node_shutdown(cfg, ext) if cfg.graceful_shutdown else None
        self.metrics = node_metrics(ext.registry)
        # a renewal or tick may run up to TIMER_SLACK late, so one wake-up serves all
        # that are due within it: at most 20 a second for a thousand nodes, not 200.
        # A renewal starts only when one of its request turns is free: it stamps its
        # renewTime as it is sent, not before a wait behind others (the server would
        # hold a time older by the wait); when the server cannot keep up, the Lease
        # that expires first goes next
        self.renewals: DueScheduler[str] = DueScheduler(
            clock, self._renew, "renewals", slack=TIMER_SLACK,
            max_running=cfg.lease_concurrency, urgency=self._lease_deadline)
        self.ticker: DueScheduler[str] = DueScheduler(
            clock, self._tick, "status", slack=TIMER_SLACK,
            max_running=TICKS_PER_STATUS_TURN * cfg.status_concurrency)
        self.node_config = NodeControllerConfig(
            # Lease writes with request turns of their own: never behind status work
            kube=kube.separate(cfg.status_concurrency),
            lease_kube=kube.separate(cfg.lease_concurrency),
            clock=clock, metrics=self.metrics, heartbeat=cfg.heartbeat, status=self.settings,
            # virtual nodes share one reading of the host, so their status work is a few
            # dozen microseconds on the loop (the reading, once a second, a fraction of
            # a millisecond); a host node reads the host every tick, on a thread
            probe=self.shared_readings.read if cfg.virtual else self.probe.read,
            status_call=inline if cfg.virtual else Blocking(self.pools.status),
            renewals=self.renewals,
            ticker=self.ticker, answered=self.answered, uids=self.uids,
            images=self.pods.images, readiness=self.readiness,
            pressure=self.eviction.pressure, legacy=cfg.legacy,
            started_together=cfg.virtual)
        self.watch: NodeWatch | None = None
        self.health: HealthServer | None = None
        self._config_mtime = self._mtime()
        self.kubelet_api: ServerBundle | None = None  # nodeagent.server, when cfg.port is set

    def _pods(self, cfg: AgentConfig, ext: Externals, events: Events) -> Pods:
        """The pod half: sources -> one merge -> NodeLoops (one PLEG, a SyncLoop per
        node, each built by build_node_loop) -> the runtime. Virtual nodes: one API pod
        watch for all names (static pods are refused by the config)."""
        kube, clock, registry = ext.kube, ext.clock, ext.registry
        hip = ext.host_ip if ext.host_ip is not None else host_ip(cfg, self.probe)
        runtime = ext.runtime or build_runtime(cfg, hip)

        def node_uid() -> str | None:
            return self.uids.get(cfg.node_name)
        configured = {s for s, on in ((Source.API, True),
                                      (Source.FILE, bool(cfg.pod_manifest_path)),
                                      (Source.HTTP, bool(cfg.manifest_url))) if on}
        merge = Merge(configured, Problems(events))
        sources: list[Runnable] = [APISource(kube, cfg.node_names, merge, clock,
                                           answered=self.answered)]
        if cfg.pod_manifest_path:
            from nodeagent.pods.sources.file import FileSource
            sources.append(FileSource(cfg.pod_manifest_path, cfg.node_name, merge, clock,
                                    check_frequency=cfg.file_check_frequency,
                                    allow_privileged=cfg.allow_privileged))
        if cfg.manifest_url:
            from nodeagent.pods.sources.http import HTTPSource
            sources.append(HTTPSource(cfg.manifest_url, cfg.node_name, merge, clock,
                                    headers=dict(cfg.manifest_url_headers),
                                    check_frequency=cfg.http_check_frequency,
                                    allow_privileged=cfg.allow_privileged))
        if cfg.pod_manifest_path or cfg.manifest_url:
            from nodeagent.pods.sources.mirror import MirrorManager
            sources.append(MirrorManager(kube, cfg.node_name, merge, clock, node_uid=node_uid,
                                       answered=self.answered))
        cache = PodCache()
        pleg = Pleg(runtime, clock,
                    PlegConfig(evented_relist_period=cfg.evented_pleg_relist_period),
                    registry=registry, cache=cache,
                    node=cfg.agent_id if cfg.virtual else cfg.node_name)
        root = Path(cfg.root_dir).resolve()
        workloads = not cfg.virtual and runtime.runs_workloads
        self.cgroups = build_pod_cgroups(
            cfg, runtime, self.shared_readings.read if cfg.virtual else self.probe.read, clock)
        settings = NodePodSettings(
            host_ip=hip,
            dns=DnsSettings(cluster_dns=cfg.cluster_dns, cluster_domain=cfg.cluster_domain,
                            resolv_conf=cfg.resolv_conf),
            admission=AdmissionSettings(allowed_unsafe_sysctls=cfg.allowed_unsafe_sysctls),
            log_root=cfg.pod_logs_dir or str(root / "logs" / "pods"),
            # virtual nodes' and the fake runtime's containers run nothing that could
            # read a hosts file, a volume or resolve a name
            pods_dir=str(root / "pods") if workloads else "",
            runs_workloads=workloads,
            seccomp_root=str(root / "seccomp"),
            memory_capacity=self.cgroups.capacity.memory_bytes)

        def allocatable(node: str) -> Mapping[str, Any] | None:
            controller = self.nodes.get(node)
            status = controller and (controller.computed or controller.reported)
            return status.get("allocatable") if status else None

        def node_info(node: str) -> Mapping[str, Any] | None:
            controller = self.nodes.get(node)
            return controller.admission_node() if controller else None
        # ConfigMaps, Secrets and Services: watched once for every node of the process
        objects = ObjectCache(kube, clock, answered=self.answered)
        services = ServiceCache(kube, clock, answered=self.answered)
        volumes = VolumeManager(root, clock, objects=objects, tokens=TokenManager(kube, clock),
                                mounter=HostMounter(), allocatable=allocatable,
                                blocking=Blocking(self.pools.files) if workloads else inline)
        images = ImageManager(runtime, clock, kube=kube, events=events, registry=registry,
                              settings=PullSettings(serialize=cfg.serialize_image_pulls,
                                                    max_parallel=cfg.max_parallel_image_pulls,
                                                    present_events=workloads))
        # eviction and garbage collection: the host read once a round for every node
        read_signals = self._signals_reader(runtime)
        self.gc = GarbageCollector(runtime, clock, gc_settings(cfg),
                                   image_fs=functools.partial(image_fs, read_signals),
                                   events=events)
        self.eviction = EvictionManager(
            eviction_settings(cfg), clock, read_signals,
            runtime.container_stats, reclaimer=self.gc, events=events,
            files=functools.partial(pod_files, log_root=settings.log_root,
                                    pods_dir=settings.pods_dir))
        shared = PodParts(runtime=runtime, clock=clock, kube=kube, answered=self.answered,
                          events=events, registry=registry, settings=settings, cache=cache,
                          runs=pleg.runs,
                          images=images, due_times=DueTimes(), volumes=volumes,
                          env=EnvResolver(objects, services, allocatable),
                          node_info=node_info, cgroups=self.cgroups,
                          pressure=self.eviction.conditions,
                          timing=PodTiming(sync_frequency=cfg.sync_frequency),
                          shutting_down=self.shutting_down)
        loops = NodeLoops(NodeLoopsConfig(cfg.node_names),
                          functools.partial(build_node_loop, shared=shared), pleg,
                          merge.updates, merge.ready, clock, shared.due_times, volumes,
                          self.cgroups)
        objects.on_change = loops.objects_changed
        self.eviction.pods = self.gc.pods = loops
        rotation = LogRotation(runtime, functools.partial(running_logs, cache), clock,
                               max_size=cfg.container_log_max_size,
                               max_files=cfg.container_log_max_files)
        # every container's environment has the `kubernetes` Service: watched from the start
        return Pods(runtime, clock, loops, sources,
                    background=(services, rotation, self.eviction, self.gc),
                    shared=(images, objects, services), on_images=self.gc.images_listed)

    def _signals_reader(self, runtime: Runtime) -> Callable[[], Awaitable[HostSignals]]:
        """The eviction manager's reading of the host: the runtime's image filesystem,
        then the host itself and the filesystems, on a thread."""
        async def read() -> HostSignals:
            try:
                info = await runtime.image_fs_info()
                where = info.mountpoint or None
            except ContainerRuntimeError:  # it keeps none, or cannot say now: nodefs
                where = None

            def blocking() -> HostSignals:
                nodefs = filesystem(self.cfg.root_dir)
                imagefs = filesystem(where) if where else None
                return host_signals(self.probe.read(), self.cfg, nodefs, imagefs)
            return await asyncio.get_running_loop().run_in_executor(self.pools.status,
                                                                    blocking)
        return read

    def _node_shutdown(self, cfg: AgentConfig, ext: Externals) -> ShutdownManager:
        """Graceful node shutdown: logind's lock and signal, the pods stopped by
        priority (the host node's; virtual nodes have none, config.load refuses it)."""
        from nodeagent.shutdown import ShutdownManager, budgets
        connect = ext.logind
        if connect is None:
            from nodeagent.systembus import LogindBus  # D-Bus: only with the setting
            connect = LogindBus.connect
        return ShutdownManager(
            budgets(cfg.shutdown_grace_period, cfg.shutdown_grace_period_critical_pods,
                    cfg.shutdown_grace_period_by_pod_priority),
            connect, self.pods, ext.clock, status_now=self._status_now,
            events=self.events, conf_dir=Path(cfg.logind_conf_dir),
            registry=ext.registry)

    def shutting_down(self) -> bool:
        return self.node_shutdown is not None and self.node_shutdown.shutting_down

    def readiness(self) -> str | None:
        """Why the nodes are not Ready: the host shuts down, or the pod half's reason."""
        down = self.node_shutdown.not_ready() if self.node_shutdown is not None else None
        return down or self.pods.readiness()

    def _status_now(self) -> None:
        """Every node's status computed and written now, not at its next tick."""
        for name in self.nodes:
            self.ticker.schedule(name, self.clock.monotonic())

    # -- nodes --
    def add_node(self, spec: NodeSpec,
                 probe: Callable[[], HostReadings] | None = None) -> NodeController:
        # one config for all nodes (thousands of virtual nodes), settings of their own
        config = self.node_config if probe is None else \
            dataclasses.replace(self.node_config, probe=probe)
        node = build_node_controller(spec, config, self.rng)
        node.settings = self.settings
        self.nodes[spec.name] = node
        self.metrics.nodes.set(len(self.nodes))
        return node

    async def _renew(self, name: str) -> float | None:
        node = self.nodes.get(name)
        return await node.renew() if node else None

    def _lease_deadline(self, name: str) -> float:
        node = self.nodes.get(name)
        return node.lease.deadline() if node else -math.inf

    async def _tick(self, name: str) -> float | None:
        node = self.nodes.get(name)
        return await node.tick() if node else None

    # -- health --
    def healthz(self) -> str | None:
        problems = [p for n in self.nodes.values() if (p := n.health())]
        if not problems:
            return None
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        return "; ".join(problems[:3]) + more

    def readyz(self) -> str | None:
        waiting = [n.name for n in self.nodes.values() if not n.registered]
        return f"not registered yet: {', '.join(waiting[:5])}" if waiting else None

    # -- live config: host overrides and eviction thresholds follow the file --
    def _mtime(self) -> float | None:
        path = self.cfg.config_file
        try:
            return path.stat().st_mtime if path else None
        except OSError:
            return None

    async def _follow_config(self) -> None:
        """Look at the config file once per status update period; reload it when it
        changed."""
        while True:
            await self.clock.sleep(self.cfg.heartbeat.statusUpdateFrequencySeconds)
            await self._maybe_reload()

    async def _maybe_reload(self) -> None:
        mtime = self._mtime()
        if mtime == self._config_mtime or self.cfg.config_file is None:
            return
        self._config_mtime = mtime
        try:
            cfg = load(self._flags, self._env)
        except ConfigError as e:
            log.warning("config file changed but was refused; keeping the last good one: %s", e)
            return
        live = ("eviction_hard", "eviction_soft", "eviction_soft_grace_period",
                "eviction_minimum_reclaim", "eviction_max_pod_grace_period",
                "eviction_pressure_transition_period", "image_gc_high_threshold",
                "image_gc_low_threshold", "image_minimum_gc_age",
                "minimum_container_ttl_duration", "maximum_dead_containers_per_container",
                "maximum_dead_containers", "host_overrides", "system_reserved", "max_pods")
        # Every other setting is read once at start.
        changed = [f.name for f in dataclasses.fields(cfg)
                   if f.name not in live and getattr(cfg, f.name) != getattr(self.cfg, f.name)]
        if changed:
            log.warning("config file: %s only take effect on restart", ", ".join(changed))
        self.cfg = dataclasses.replace(self.cfg, **{f: getattr(cfg, f) for f in live})
        self.probe.overrides = dict(self.cfg.host_overrides)
        self.settings = dataclasses.replace(status_settings(self.cfg),
                                            runtime_version=self.settings.runtime_version,
                                            kubelet_port=self.settings.kubelet_port)
        self._hand_settings()
        # the new thresholds act now, not a period later
        self.eviction.settings = eviction_settings(self.cfg)
        self.eviction.kick()
        self.gc.settings = gc_settings(self.cfg)
        self.gc.kick()
        log.info("config file reloaded: eviction thresholds %s",
                 ",".join(t.text() for t in self.cfg.eviction_thresholds) or "none")

    # -- run --
    async def run(self, stop: asyncio.Event) -> None:
        try:  # kubepods and the QoS cgroups, before any pod is synced
            self.cgroups.start()
        except CgroupError as e:
            raise ConfigError(str(e)) from None
        if not self.nodes:
            for spec in node_specs(self.cfg):
                self.add_node(spec)
        self.watch = NodeWatch(self.kube, self.nodes, self.clock, agent_id=self.cfg.agent_id,
                               answered=self.answered)
        if self.cfg.healthz_bind_address:
            host, port = self.cfg.healthz_bind_address
            try:
                self.health = HealthServer(host, port, self.registry)
            except OSError as e:
                raise ConfigError(f"--healthz-bind-address: cannot listen on {host}:{port}: "
                                  f"{e.strerror or e}") from e
            self.health.health_checks["heartbeat"] = self.healthz
            self.health.ready_checks["registered"] = self.readyz
            self.health.health_checks["pleg"] = self.pods.health
            self.health.start()
            log.info("serving /healthz and /metrics on %s:%d", host, self.health.port)
        tasks = [asyncio.create_task(self.renewals.run(), name="renewals"),
                 asyncio.create_task(self.ticker.run(), name="status"),
                 asyncio.create_task(self.watch.run(), name="watch")]
        if self.cfg.config_file is not None:
            tasks.append(asyncio.create_task(self._follow_config(), name="config-file"))
        await self.pods.start()  # the runtime's version is in the first NodeStatus
        self.settings = dataclasses.replace(self.settings,
                                            runtime_version=self.pods.runtime_version)
        api_port = await self._serve_kubelet_api()
        if api_port is not None:  # in the first NodeStatus too
            self.settings = dataclasses.replace(self.settings, kubelet_port=api_port)
        self._hand_settings()
        tasks.append(asyncio.create_task(self.pods.wait(), name="pods"))
        for node in self.nodes.values():
            node.start()
        if self.node_shutdown is not None:
            tasks.append(asyncio.create_task(self.node_shutdown.run(), name="node-shutdown"))
        log.info("agent running: %d node(s), heartbeat mode %s", len(self.nodes),
                 self.cfg.heartbeat_mode)
        waiter = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not waiter and t.exception():
                log.error("agent loop %s ended: %r", t.get_name(), t.exception())
        await self.shutdown(tasks + [waiter])

    def _hand_settings(self) -> None:
        """Every node gets the status settings; a virtual node with a kubelet API port of
        its own says that one in its daemonEndpoints."""
        own = self.kubelet_api.server.node_ports if self.kubelet_api is not None else {}
        for name, node in self.nodes.items():
            node.settings = dataclasses.replace(self.settings, kubelet_port=own[name]) \
                if name in own else self.settings

    async def _serve_kubelet_api(self) -> int | None:
        """Start the kubelet API; its port, or None when it is not served."""
        if self.cfg.port is None:
            return None
        try:
            addresses = [a for _, a in self.probe.read().addresses]
        except HostReadError:
            addresses = list(self.cfg.node_ips)
        checks = {"heartbeat": self.healthz, "pleg": self.pods.health}
        self.kubelet_api = build_kubelet_api(self.cfg, self.pods, self.kube, clock=self.clock,
                                             registry=self.registry, addresses=addresses,
                                             health_checks=checks)
        return await self.kubelet_api.start()

    # seconds a stop may take in all: a step still waiting then (a request or stream
    # that does not end) is left behind, by name, so SIGTERM always ends the process
    # well within a supervisor's grace (CI at 22561cf: one stop hung past 30 s)
    STOP_BUDGET = 15.0

    async def shutdown(self, tasks: Sequence[asyncio.Task[Any]]) -> None:
        """No new work; writes already sent finish before the pools close."""
        log.info("stopping")
        deadline = self.clock.monotonic() + self.STOP_BUDGET
        if self.watch:
            self.watch.stop()
        if self.node_shutdown is not None:  # its lock released: the host need not wait
            await _within(self.clock, deadline, "graceful node shutdown",
                          self.node_shutdown.close())
        if self.kubelet_api:
            await _within(self.clock, deadline, "the kubelet API", self.kubelet_api.stop())
        # pods keep running; a restarted agent adopts them
        await _within(self.clock, deadline, "the pod workers", self.pods.stop())
        await _within(self.clock, deadline, "the lease renewals", self.renewals.stop())
        await _within(self.clock, deadline, "the status ticks", self.ticker.stop())
        for t in tasks:
            t.cancel()
        await _within(self.clock, deadline, "the agent's loops",
                      asyncio.gather(*tasks, return_exceptions=True))
        await _within(self.clock, deadline, "the status pool", asyncio.to_thread(
            self.pools.status.shutdown, wait=True, cancel_futures=True))
        await _within(self.clock, deadline, "the files pool", asyncio.to_thread(
            self.pools.files.shutdown, wait=True, cancel_futures=True))
        if self.health:
            self.health.stop()
        close = getattr(self.cgroups.backend, "close", None)  # systemd's: its bus
        if close is not None:
            close()
        log.info("stopped")


async def _within(clock: Clock, deadline: float, what: str, step: Awaitable[Any]) -> None:
    """Await one step of a stop until the stop's deadline (on `clock`); past it, say which
    step did not finish and go on. Its task is cancelled, not awaited: a step that
    ignores cancellation must not hold the stop either."""
    left = deadline - clock.monotonic()
    task = asyncio.ensure_future(step)
    if left > 0:
        timer = asyncio.ensure_future(clock.sleep(left))
        await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
        timer.cancel()
    else:  # the budget is spent: the step gets its start, no wait
        await asyncio.wait({task}, timeout=0)
    if task.done():
        task.result()  # a step's failure is the stop's, as before
        return
    task.cancel()
    log.warning("stopping: %s did not finish within the %.0f s a stop may take; going on "
                "without it", what, Agent.STOP_BUDGET)
