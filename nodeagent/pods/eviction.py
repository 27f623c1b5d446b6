"""The eviction manager, as the kubelet's: when a node runs short of memory, disk or
process ids, reclaim what the node holds for no pod (dead containers, unused images)
and, when that is not enough, evict pods, one per round, the way the kubelet ranks
them. Its observations also make the node's pressure conditions (MemoryPressure,
DiskPressure, PIDPressure) and refuse new pods while they hold.

Each round (every `monitoring_period`), for every node of the process:

1. The signals: the host is read once for all nodes (`read_signals`, handed in by the
   composition root: memory available as the kubelet computes it, the root dir's
   filesystem as nodefs, the runtime's image filesystem as imagefs, process ids). A
   node whose resource is not the host's own (a virtual node; memory given in
   hostOverrides) counts what its own pods use instead, from the runtime's stats.
2. The thresholds met (thresholds.py): those met now, and those met before whose
   minimum reclaim is not reached yet. A condition is True while one of its thresholds
   was met within `pressure_transition_period`. A threshold acts once it has held for
   its grace period (hard thresholds: at once).
3. The threshold to act on (memory first): a Warning `EvictionThresholdMet`, then
   node-level reclaim for disk signals (the garbage collector's dead containers, then
   unused images); when the signals then show every threshold and minimum reclaim
   satisfied, no pod is evicted.
4. Otherwise the node's pods are ranked (`rank`): for memory, pods using more than they
   request first, then by priority (lowest first), then by usage above the request;
   for disk the same with ephemeral storage (or inodes); for pids by priority, then by
   process count. The first pod the kubelet may evict (never a static pod, nor one of
   priority 2000000000 or more) is stopped through its pod worker: a hard threshold
   gives it 1 s, a soft one `max_pod_grace_period` (at most its own grace; negative:
   its own). It ends Failed, reason `Evicted`, with the kubelet's message, a
   DisruptionTarget condition and a Warning Event `Evicted`; its containers and
   volumes are removed once it has stopped, and the node waits for that (at most
   `cleanup_timeout`) before it evicts again.

Nodes that have never had a pod share one state and one evaluation: a round costs the
pods, not the nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from nodeagent.api.clock import Clock, clock_timeout
from nodeagent.api.kube import describe
from nodeagent.api.quantity import format_bytes, parse_quantity
from nodeagent.events import WARNING, Events
from nodeagent.pods.podupdate import Pod, is_static
from nodeagent.pods.thresholds import (
    CONDITION,
    COUNTED,
    IMAGEFS,
    IMAGEFS_INODES,
    MEMORY,
    NODEFS,
    NODEFS_INODES,
    PIDS,
    RESOURCE,
    Threshold,
)
from nodeagent.runtime.base import ContainerRuntimeError, ContainerStats, Unsupported

log = logging.getLogger(__name__)

REASON = "Evicted"  # an evicted pod's status reason, and its Event's
HARD_GRACE = 1.0  # seconds: the kubelet's grace for a pod evicted for a hard threshold
CRITICAL_PRIORITY = 2_000_000_000  # system-cluster-critical and above
PRESSURE_CONDITIONS = ("MemoryPressure", "DiskPressure", "PIDPressure")


# --- what the host says ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Reading:
    """One signal: its capacity and what is available of it. `available` None: the
    capacity less what the node's own pods use (a node whose resource is not the
    host's own)."""
    capacity: float
    available: float | None = None


@dataclasses.dataclass(frozen=True)
class HostSignals:
    """The host, read once per round for every node of the process."""
    readings: Mapping[str, Reading]  # signal -> reading; a signal not measured is absent
    imagefs_dedicated: bool = False  # images on a filesystem of their own, not nodefs


# --- what the pods use ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ContainerUsage:
    memory: float = 0.0         # working set, bytes
    rootfs: float = 0.0         # writable layer, bytes
    rootfs_inodes: float = 0.0
    logs: float = 0.0           # its log files, bytes
    logs_inodes: float = 0.0


@dataclasses.dataclass(frozen=True)
class PodUsage:
    """What one pod uses, by container (the running ones), plus its local volumes."""
    containers: Mapping[str, ContainerUsage] = dataclasses.field(default_factory=dict)
    volumes: float = 0.0        # bytes its local volumes (emptyDir, ...) hold
    volumes_inodes: float = 0.0
    processes: float = 0.0

    @property
    def memory(self) -> float:
        return sum(c.memory for c in self.containers.values())

    def disk(self, parts: frozenset[str], inodes: bool = False) -> float:
        """Bytes (or inodes) on disk: `parts` among "root" (writable layers), "logs",
        "volumes"."""
        total = 0.0
        for c in self.containers.values():
            if "root" in parts:
                total += c.rootfs_inodes if inodes else c.rootfs
            if "logs" in parts:
                total += c.logs_inodes if inodes else c.logs
        if "volumes" in parts:
            total += self.volumes_inodes if inodes else self.volumes
        return total


def disk_parts(signal: str, dedicated: bool) -> frozenset[str]:
    """What of a pod's disk a disk signal counts (the kubelet's): everything on one
    filesystem; with a dedicated imagefs, nodefs holds logs and volumes, imagefs the
    writable layers."""
    if not dedicated:
        return frozenset({"root", "logs", "volumes"})
    if signal in (IMAGEFS, IMAGEFS_INODES):
        return frozenset({"root"})
    return frozenset({"logs", "volumes"})


def pod_usage_of(signal: str, usage: PodUsage, dedicated: bool) -> float:
    """What of `signal`'s resource a pod uses."""
    if signal == MEMORY:
        return usage.memory
    if signal == PIDS:
        return usage.processes
    return usage.disk(disk_parts(signal, dedicated), inodes=signal in COUNTED)


# --- thresholds against observations (the kubelet's helpers) ---------------------------

Observations = Mapping[str, tuple[float, float]]  # signal -> (available, capacity)


@dataclasses.dataclass
class Totals:
    """What a node's pods use, summed, for the signals that count it (a virtual node's
    pods write no files: their disk is their writable layers)."""
    memory: float = 0.0
    rootfs: float = 0.0
    rootfs_inodes: float = 0.0
    processes: float = 0.0

    def add(self, s: ContainerStats) -> None:
        self.memory += s.memory_working_set_bytes or 0
        self.rootfs += s.writable_layer_bytes or 0
        self.rootfs_inodes += s.writable_layer_inodes or 0
        self.processes += s.processes or 0

    def of(self, signal: str) -> float:
        if signal == MEMORY:
            return self.memory
        if signal == PIDS:
            return self.processes
        return self.rootfs_inodes if signal in COUNTED else self.rootfs


def observations(signals: HostSignals, totals: Totals) -> dict[str, tuple[float, float]]:
    """Each signal's (available, capacity) for one node."""
    return {signal: (r.available if r.available is not None
                     else r.capacity - totals.of(signal), r.capacity)
            for signal, r in signals.readings.items()}


@dataclasses.dataclass(frozen=True)
class _Round:
    """What a round read once for all nodes."""
    signals: HostSignals
    measured: Mapping[str, ContainerStats] | None  # the runtime's stats, when read


def thresholds_met(thresholds: Iterable[Threshold], obs: Observations,
                   min_reclaim: bool = False) -> list[Threshold]:
    """The thresholds whose signal is below them; with `min_reclaim`, below them plus
    their minimum reclaim (met until that much more is free again)."""
    out = []
    for t in thresholds:
        if t.signal not in obs:
            continue
        available, capacity = obs[t.signal]
        limit = t.limit(capacity)
        if min_reclaim and t.min_reclaim is not None:
            limit += t.min_reclaim.of(capacity)
        if limit > available:
            out.append(t)
    return out


def by_eviction_priority(thresholds: Iterable[Threshold]) -> list[Threshold]:
    """Memory before anything else (the kubelet's order)."""
    return sorted(thresholds, key=lambda t: t.signal != MEMORY)


# --- ranking ---------------------------------------------------------------------------

def _quantity(value: Any, where: str) -> float:
    try:
        return parse_quantity(value, where)
    except ValueError:
        return 0.0  # the API server validated it; nothing to rank by


def container_request(container: Mapping[str, Any], resource: str) -> float:
    requests = (container.get("resources") or {}).get("requests") or {}
    return _quantity(requests[resource], resource) if resource in requests else 0.0


def pod_request(pod: Pod, resource: str) -> float:
    """The pod's effective request of `resource` (as the scheduler counts it): its
    containers and sidecars together, or its largest init container with the sidecars
    started before it, whichever is more; plus the pod's overhead."""
    spec = pod.get("spec") or {}
    sidecars = 0.0
    init_peak = 0.0
    for c in spec.get("initContainers") or []:
        r = container_request(c, resource)
        if c.get("restartPolicy") == "Always":
            sidecars += r
            init_peak = max(init_peak, sidecars)
        else:
            init_peak = max(init_peak, sidecars + r)
    regular = sum(container_request(c, resource) for c in spec.get("containers") or [])
    overhead = spec.get("overhead") or {}
    extra = _quantity(overhead[resource], resource) if resource in overhead else 0.0
    return max(regular + sidecars, init_peak) + extra


def priority(pod: Pod) -> int:
    value = (pod.get("spec") or {}).get("priority")
    return int(value) if isinstance(value, int) else 0


def is_critical(pod: Pod) -> bool:
    """A pod the kubelet never evicts: a static pod, or one of critical priority."""
    return is_static(pod) or priority(pod) >= CRITICAL_PRIORITY


@dataclasses.dataclass(frozen=True)
class Candidate:
    pod: Pod
    usage: PodUsage | None  # None: not measured (the kubelet evicts such pods first)


def rank(signal: str, candidates: Sequence[Candidate],
         dedicated: bool = False) -> list[Candidate]:
    """The pods in the order the kubelet evicts them for `signal` (see the module
    docstring). A pod with no measurement comes before those with one."""
    def key(c: Candidate) -> tuple[Any, ...]:
        prio = priority(c.pod)
        if signal == PIDS:
            if c.usage is None:
                return (prio, 0, 0.0)
            return (prio, 1, -c.usage.processes)
        if c.usage is None:
            return (0, 0, prio, 0.0)
        used = pod_usage_of(signal, c.usage, dedicated)
        if signal == MEMORY:
            request = pod_request(c.pod, "memory")
            over = used - request
            exceeds = used > request
        else:
            # the kubelet: inodes exceed a request of none; the ephemeral-storage
            # request is what the usage is taken relative to either way
            request = pod_request(c.pod, "ephemeral-storage")
            exceeds = used > (0.0 if signal in COUNTED else request)
            over = used - request
        return (1, not exceeds, prio, -over)
    return sorted(candidates, key=key)


# --- the message -----------------------------------------------------------------------

def format_amount(signal: str, amount: float) -> str:
    """A quantity as the kubelet prints it: bytes in binary units, counts in decimal."""
    n = int(amount)
    if signal not in COUNTED:
        return format_bytes(n) if n else "0"
    for suffix, unit in (("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9),
                         ("M", 10**6), ("k", 10**3)):
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def eviction_message(signal: str, pod: Pod, usage: PodUsage | None,
                     thresholds: Sequence[Threshold], obs: Observations,
                     dedicated: bool = False) -> str:
    """"The node was low on resource: memory. Threshold quantity: 100Mi, available:
    50Mi. Container hog was using 300Mi, request is 0, has larger consumption of
    memory. " (the kubelet's words)."""
    resource = RESOURCE[signal]
    message = f"The node was low on resource: {resource}. "
    for t in thresholds:
        if RESOURCE[t.signal] == resource and t.signal in obs:
            available, capacity = obs[t.signal]
            message += (f"Threshold quantity: {format_amount(t.signal, t.limit(capacity))}, "
                        f"available: {format_amount(t.signal, available)}. ")
            break
    if usage is None or resource not in ("memory", "ephemeral-storage"):
        return message
    spec = pod.get("spec") or {}
    for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        used = usage.containers.get(str(c.get("name")))
        if used is None:
            continue
        amount = used.memory if resource == "memory" else used.rootfs + used.logs
        request = container_request(c, resource)
        if amount > request:
            message += (f"Container {c.get('name')} was using "
                        f"{format_amount(MEMORY, amount)}, request is "
                        f"{format_amount(MEMORY, request)}, has larger consumption of "
                        f"{resource}. ")
    return message


# --- admission under pressure ------------------------------------------------------------

def best_effort(pod: Pod) -> bool:
    """No container requests or limits cpu or memory (QoS class BestEffort)."""
    spec = pod.get("spec") or {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        res = c.get("resources") or {}
        for kind in ("requests", "limits"):
            if any(r in (res.get(kind) or {}) for r in ("cpu", "memory")):
                return False
    return True


def _tolerates_memory_pressure(pod: Pod) -> bool:
    key = "node.kubernetes.io/memory-pressure"
    for t in (pod.get("spec") or {}).get("tolerations") or []:
        if t.get("effect") not in (None, "", "NoSchedule"):
            continue
        if t.get("operator") == "Exists" and t.get("key") in (None, "", key):
            return True
        if t.get("key") == key and t.get("operator") in (None, "Equal") \
                and not t.get("value"):
            return True
    return False


def pressure_refusal(pod: Pod, conditions: Iterable[str]) -> str | None:
    """Why a new pod may not start on a node under `conditions` (the kubelet's
    eviction admission), or None: critical pods always may; under memory pressure
    alone, any pod but a BestEffort one that does not tolerate the memory-pressure
    taint; under any other pressure, none."""
    present = [c for c in PRESSURE_CONDITIONS if c in set(conditions)]
    if not present or is_critical(pod):
        return None
    if present == ["MemoryPressure"] and (not best_effort(pod)
                                          or _tolerates_memory_pressure(pod)):
        return None
    return f"The node had condition: [{' '.join(present)}]. "


# --- measuring -------------------------------------------------------------------------

def walk(path: str) -> tuple[float, float]:
    """(bytes, inodes) under `path` on its own filesystem (a mount below it, such as a
    Memory emptyDir's tmpfs, is not counted): what `du` would say."""
    try:
        dev = os.lstat(path).st_dev
    except OSError:
        return 0.0, 0.0
    size = inodes = 0.0
    stack = [path]
    while stack:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_dev != dev:
                continue
            size += st.st_blocks * 512
            inodes += 1
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
    return size, inodes


@dataclasses.dataclass(frozen=True)
class PodFiles:
    """Where a pod's files are on nodefs: its log folder and its volumes' folder ("":
    none)."""
    logs: str = ""
    volumes: str = ""


def measure_files(files: PodFiles, containers: Iterable[str]
                  ) -> tuple[dict[str, tuple[float, float]], tuple[float, float]]:
    """Blocking: each container's log files (bytes, inodes) and the volumes'."""
    logs = {name: walk(os.path.join(files.logs, name)) if files.logs else (0.0, 0.0)
            for name in containers}
    return logs, walk(files.volumes) if files.volumes else (0.0, 0.0)


# --- the manager -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EvictionSettings:
    thresholds: tuple[Threshold, ...] = ()
    max_pod_grace_period: int = 0  # negative: the pod's own
    pressure_transition_period: float = 300.0
    monitoring_period: float = 10.0  # the kubelet's
    cleanup_timeout: float = 30.0    # how long a node waits for an evicted pod to go


class Reclaimer(Protocol):
    """Node-level reclaim (the garbage collector, gc.py)."""

    async def remove_dead_containers(self) -> None: ...

    async def remove_unused_images(self) -> None: ...


class PodsView(Protocol):
    """What the manager reads of the pod half and does through it (the sync loops,
    nodeagent.pods.loops.NodeLoops)."""

    node_names: frozenset[str]  # every node of the process

    def nodes_with_pods(self) -> Iterable[str]: ...

    def pods_of(self, node: str) -> list[Pod]:
        """Every pod the node knows (what runs of them uses the node's resources)."""

    def active_pods(self, node: str) -> list[Pod]:
        """The pods that may be evicted: known, syncing, not being stopped."""

    def running_containers(self, pod: Pod) -> list[tuple[str, str]]:
        """(id, name) of the pod's running containers."""

    def evict(self, node: str, pod: Pod, grace: float, message: str) -> None:
        """Stop the pod within `grace` seconds; it ends Failed, Evicted, `message`."""

    def cleaned_up(self, node: str, uid: str) -> bool:
        """The pod is stopped and what it held (containers, volumes) removed."""


@dataclasses.dataclass
class _NodeState:
    first_observed: dict[Threshold, float] = dataclasses.field(default_factory=dict)
    last_observed: dict[str, float] = dataclasses.field(default_factory=dict)  # condition
    messages: dict[str, str] = dataclasses.field(default_factory=dict)  # condition -> why
    met: list[Threshold] = dataclasses.field(default_factory=list)
    conditions: frozenset[str] = frozenset()
    waiting: tuple[str, float] | None = None  # (evicted pod's uid, give up at)

    def copy(self) -> _NodeState:
        return _NodeState(dict(self.first_observed), dict(self.last_observed),
                          dict(self.messages), list(self.met), self.conditions)


class EvictionManager:
    def __init__(self, settings: EvictionSettings, clock: Clock,
                 read_signals: Callable[[], Awaitable[HostSignals]],
                 stats: Callable[[], Awaitable[list[ContainerStats]]],
                 pods: PodsView | None = None, reclaimer: Reclaimer | None = None,
                 events: Events | None = None,
                 files: Callable[[Pod], PodFiles] = lambda pod: PodFiles()) -> None:
        """`read_signals`: the host, read once (off the event loop); `stats`: the
        runtime's container stats; `pods`: the sync loops (set once they are built);
        `files`: where a pod's logs and volumes are."""
        self.settings = settings
        self.clock = clock
        self.read_signals = read_signals
        self.stats = stats
        self.pods = pods
        self.reclaimer = reclaimer
        self.events = events
        self.files = files
        self.states: dict[str, _NodeState] = {}  # nodes that had pods
        self.idle = _NodeState()  # every node that never had a pod
        self.rounds = 0
        self.evictions = 0
        self._kick = asyncio.Event()
        self._stats_unsupported = False

    # -- what the rest of the node reads (any thread) --
    def conditions(self, node: str) -> frozenset[str]:
        return self._state(node).conditions

    def pressure(self, node: str) -> dict[str, str]:
        """The node's pressure conditions that are True, each with why."""
        st = self._state(node)
        return {c: st.messages.get(c, "") for c in st.conditions}

    def _state(self, node: str) -> _NodeState:
        return self.states.get(node, self.idle)

    # -- running --
    def kick(self) -> None:
        """Run a round now (the thresholds changed)."""
        self._kick.set()

    async def run(self) -> None:
        while True:
            try:
                await self.synchronize()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: log it, keep the loop
                log.exception("eviction manager: round failed")
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                await clock_timeout(self.clock, self._kick.wait(),
                                    self.settings.monitoring_period, "the next round")

    async def synchronize(self) -> None:
        """One round for every node (the module docstring's steps)."""
        self.rounds += 1
        if not self.settings.thresholds:
            for st in [self.idle, *self.states.values()]:
                st.conditions = frozenset()
            return
        try:
            signals = await self.read_signals()
        except Exception as e:  # noqa: BLE001 - no observation this round
            log.warning("eviction manager: cannot read the host: %s", e)
            return
        nodes = list(self.pods.nodes_with_pods()) if self.pods is not None else []
        for node in nodes:
            if node not in self.states:
                self.states[node] = self.idle.copy()
        # the runtime's stats, once for all nodes, when a signal counts the pods' use
        counted = any(r.available is None for r in signals.readings.values())
        measured = await self._container_stats() if counted and nodes else None
        round_ = _Round(signals, measured)
        if self.pods is None or len(nodes) < len(self.pods.node_names):
            await self._node(None, self.idle, round_, Totals())
        for i, node in enumerate(nodes):
            totals = self._totals(node, measured) if counted else Totals()
            await self._node(node, self.states[node], round_, totals)
            if i % 100 == 99:
                await asyncio.sleep(0)  # thousands of nodes: the event loop runs between

    def _totals(self, node: str, measured: Mapping[str, ContainerStats] | None) -> Totals:
        """What the node's pods use, summed from the runtime's stats."""
        assert self.pods is not None
        t = Totals()
        for pod in self.pods.pods_of(node):
            for cid, _ in self.pods.running_containers(pod):
                st = (measured or {}).get(cid)
                if st is not None:
                    t.add(st)
        return t

    async def _container_stats(self) -> dict[str, ContainerStats] | None:
        """The runtime's stats by container id; None when it cannot measure."""
        if self._stats_unsupported:
            return None
        try:
            return {s.container_id: s for s in await self.stats()}
        except Unsupported as e:
            log.info("eviction manager: %s: pods are ranked without their usage", e)
            self._stats_unsupported = True
        except ContainerRuntimeError as e:
            log.warning("eviction manager: container stats: %s", e)
        return None

    def _stats_usage(self, pod: Pod, measured: Mapping[str, ContainerStats]) -> PodUsage:
        assert self.pods is not None
        containers: dict[str, ContainerUsage] = {}
        processes = 0.0
        for cid, name in self.pods.running_containers(pod):
            s = measured.get(cid)
            if s is None:
                continue
            containers[name] = ContainerUsage(
                memory=float(s.memory_working_set_bytes or 0),
                rootfs=float(s.writable_layer_bytes or 0),
                rootfs_inodes=float(s.writable_layer_inodes or 0))
            processes += s.processes or 0
        return PodUsage(containers, processes=processes)

    async def _node(self, node: str | None, st: _NodeState, round_: _Round,
                    totals: Totals) -> None:
        """One node's round (`node` None: the nodes without pods, which share `st`)."""
        s = self.settings
        now = self.clock.monotonic()
        obs = observations(round_.signals, totals)
        met = thresholds_met(s.thresholds, obs)
        if st.met:  # met before, and not yet reclaimed beyond their minimum
            met += [t for t in thresholds_met(st.met, obs, min_reclaim=True) if t not in met]
        st.first_observed = {t: st.first_observed.get(t, now) for t in met}
        for t in met:
            cond = CONDITION[t.signal]
            st.last_observed[cond] = now
            st.messages[cond] = "below eviction threshold: " + ",".join(
                u.text() for u in met if CONDITION[u.signal] == cond)
        # observed now, or within the transition period (the kubelet's rule; a period
        # of zero: while observed)
        st.conditions = frozenset(c for c, at in st.last_observed.items()
                                  if at == now or now - at < s.pressure_transition_period)
        st.met = [t for t, at in st.first_observed.items() if now - at >= t.grace_period]
        if not st.met:
            return
        if node is not None and st.waiting is not None:
            uid, until = st.waiting
            if not (self.pods is None or self.pods.cleaned_up(node, uid)) and now < until:
                return  # the last pod evicted is still being cleaned up
            st.waiting = None
        await self._act(node, st, obs, round_, totals)

    async def _act(self, node: str | None, st: _NodeState, obs: Observations,
                   round_: _Round, totals: Totals) -> None:
        signals = round_.signals
        threshold = by_eviction_priority(st.met)[0]
        resource = RESOURCE[threshold.signal]
        who = node or "(nodes without pods)"
        log.info("eviction manager: node %s: attempting to reclaim %s (%s)", who, resource,
                 threshold.text())
        if self.events is not None:
            self.events.warning("EvictionThresholdMet", f"Attempting to reclaim {resource}")
        if await self._reclaim_node(threshold.signal, signals):
            obs2 = await self._observe_again(totals)
            if obs2 is not None and not thresholds_met(self.settings.thresholds, obs2,
                                                         min_reclaim=True):
                log.info("eviction manager: node %s: reclaimed %s without evicting pods",
                         who, resource)
                return
        if node is None:
            return  # no pod to evict
        assert self.pods is not None
        active = self.pods.active_pods(node)
        if not active:
            log.warning("eviction manager: node %s: thresholds met, but no pods are active "
                        "to evict", node)
            return
        candidates = await self._candidates(threshold.signal, active, round_)
        for c in rank(threshold.signal, candidates, signals.imagefs_dedicated):
            if is_critical(c.pod):
                log.warning("eviction manager: cannot evict a critical pod %s",
                            describe(c.pod))
                continue
            grace = self._grace(threshold, c.pod)
            message = eviction_message(threshold.signal, c.pod, c.usage, st.met, obs,
                                       signals.imagefs_dedicated)
            log.info("eviction manager: node %s: evicting pod %s (grace %gs): %s", node,
                     describe(c.pod), grace, message)
            if self.events is not None:
                self.events.pod(c.pod, WARNING, REASON, message)
            self.pods.evict(node, c.pod, grace, message)
            self.evictions += 1
            st.waiting = (str(c.pod["metadata"]["uid"]),
                          self.clock.monotonic() + self.settings.cleanup_timeout)
            return
        log.warning("eviction manager: node %s: unable to evict any pod", node)

    def _grace(self, threshold: Threshold, pod: Pod) -> float:
        if threshold.hard:
            return HARD_GRACE
        most = self.settings.max_pod_grace_period
        own = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
        if most < 0:
            return float(own) if own is not None else 30.0
        return float(min(most, own)) if own is not None else float(most)

    async def _reclaim_node(self, signal: str, signals: HostSignals) -> bool:
        """Dead containers, then unused images, for a disk signal whose filesystem holds
        them; whether anything was tried."""
        if self.reclaimer is None or signal in (MEMORY, PIDS):
            return False
        if signals.imagefs_dedicated and signal in (NODEFS, NODEFS_INODES):
            return False  # nodefs holds neither
        for step in (self.reclaimer.remove_dead_containers,
                     self.reclaimer.remove_unused_images):
            try:
                await step()
            except Exception as e:  # noqa: BLE001 - the next step, then pods, still go
                log.warning("eviction manager: node-level reclaim: %s", e)
        return True

    async def _observe_again(self, totals: Totals) -> Observations | None:
        """The signals read again after node-level reclaim (the pods' use as it was)."""
        try:
            fresh = await self.read_signals()
        except Exception as e:  # noqa: BLE001
            log.warning("eviction manager: cannot read the host after reclaim: %s", e)
            return None
        return observations(fresh, totals)

    async def _candidates(self, signal: str, pods: Sequence[Pod],
                          round_: _Round) -> list[Candidate]:
        """The pods with what they use of the signal's resource: the runtime's stats,
        and for disk their files on nodefs (walked off the event loop)."""
        assert self.pods is not None
        pv = self.pods
        measured = round_.measured
        if measured is None:  # not read this round: no signal counted the pods
            measured = await self._container_stats()
        base = {str(p["metadata"]["uid"]): self._stats_usage(p, measured or {})
                for p in pods}
        if signal in (MEMORY, PIDS):
            return [Candidate(p, base[str(p["metadata"]["uid"])] if measured is not None
                              else None) for p in pods]
        files = [(p, self.files(p), [n for _, n in pv.running_containers(p)]) for p in pods]

        def measure() -> list[tuple[dict[str, tuple[float, float]], tuple[float, float]]]:
            return [measure_files(f, names) for _, f, names in files]
        walked = await asyncio.to_thread(measure)
        out = []
        for (p, _, names), (logs, (vol, vol_inodes)) in zip(files, walked, strict=True):
            u = base[str(p["metadata"]["uid"])]
            containers = {}
            for name in set(names) | set(u.containers):
                c = u.containers.get(name, ContainerUsage())
                lb, li = logs.get(name, (0.0, 0.0))
                containers[name] = dataclasses.replace(c, logs=lb, logs_inodes=li)
            out.append(Candidate(p, PodUsage(containers, vol, vol_inodes, u.processes)))
        return out


def pod_files(pod: Pod, log_root: str, pods_dir: str) -> PodFiles:
    """A pod's log folder (`<log root>/<namespace>_<name>_<uid>`) and its volumes'
    (`<pods dir>/<uid>/volumes`)."""
    meta = pod.get("metadata") or {}
    uid = str(meta.get("uid", ""))
    logs = (str(Path(log_root) / f"{meta.get('namespace') or 'default'}_{meta.get('name')}"
                                  f"_{uid}") if log_root else "")
    return PodFiles(logs=logs, volumes=str(Path(pods_dir) / uid / "volumes")
                    if pods_dir else "")

