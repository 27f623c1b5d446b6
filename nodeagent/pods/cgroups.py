"""Pod and QoS cgroups as the kubelet makes them.

The hierarchy under --cgroup-root (with --cgroups-per-qos, the default):

    kubepods                 node allocatable: memory, CPU shares and pids of the node
                             less --system-reserved and --kube-reserved
    ├── pod<uid>             a Guaranteed pod
    ├── burstable            CPU shares: the sum of the Burstable pods' CPU requests
    │   └── pod<uid>
    └── besteffort           CPU shares: 2
        └── pod<uid>

A pod's cgroup (made before its sandbox, whose cgroup_parent it is) gets CPU shares from
its requests (2 at the least), a CFS quota from its CPU limit and a memory limit when
every container sets one (always for Guaranteed pods; never for BestEffort ones), its
hugepage requests as hugetlb limits (0 for the page sizes it did not ask for), and
--pod-max-pids. The QoS cgroups follow the pods as they come and go, and once a minute;
with --qos-reserved=memory=N% they also hold back N% of the memory requests of the
classes above them. The values, names and driver forms (cgroupfs paths, systemd slices)
are computed here; a backend (the real cgroup filesystem, cgroupfs.py, or MemoryCgroups
below, for runtimes whose containers run nothing) holds them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from nodeagent.api.clock import Clock
from nodeagent.api.kube import describe
from nodeagent.pods.podupdate import Pod
from nodeagent.pods.qos import QOSClass, hugepage_size, pod_limits, pod_requests, qos_class

log = logging.getLogger(__name__)

MIN_SHARES = 2
MAX_SHARES = 262144
SHARES_PER_CPU = 1024
CPU_PERIOD_US = 100_000
MIN_QUOTA_US = 1000
HUGETLB_UNBOUNDED = 1 << 62  # the QoS cgroups never limit hugepages
QOS_UPDATE_PERIOD = 60.0     # seconds between the QoS cgroups' periodic updates
POD_PREFIX = "pod"
NODE_CGROUP = "kubepods"
DRIVERS = ("cgroupfs", "systemd")


class CgroupError(Exception):
    """A cgroup could not be made, changed or removed; the message names it."""


def milli_cpu_to_shares(millis: int) -> int:
    if millis <= 0:
        return MIN_SHARES  # an unset request: the kernel's least, not its default 1024
    return max(MIN_SHARES, min(MAX_SHARES, millis * SHARES_PER_CPU // 1000))


def milli_cpu_to_quota(millis: int, period: int = CPU_PERIOD_US) -> int:
    """Microseconds per period for a CPU limit (0: no limit), at least a millisecond."""
    if millis <= 0:
        return 0
    return max(MIN_QUOTA_US, millis * period // 1000)


# --- names ------------------------------------------------------------------------------

CgroupName = tuple[str, ...]  # driver-neutral: ("kubepods", "burstable", "pod<uid>")


def parse_root(root: str) -> CgroupName:
    """--cgroup-root (a cgroupfs path, "/" by default) as a name."""
    return tuple(p for p in root.strip().split("/") if p)


def to_path(name: CgroupName, driver: str) -> str:
    """The name as the driver writes it: a cgroupfs path (/kubepods/burstable/pod<uid>),
    or systemd slices, each nested in its parent's
    (/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice, a "-"
    in a part written "_")."""
    if driver != "systemd":
        return "/" + "/".join(name)
    parts = [p.replace("-", "_") for p in name]
    return "/" + "/".join("-".join(parts[:i + 1]) + ".slice" for i in range(len(parts)))


def pod_uid_of(child: str, driver: str) -> str | None:
    """The pod uid of a child cgroup of a QoS cgroup, or None for another child."""
    last = child
    if driver == "systemd":
        if not child.endswith(".slice"):
            return None
        last = child[:-len(".slice")].rsplit("-", 1)[-1].replace("_", "-")
    if last.startswith(POD_PREFIX) and len(last) > len(POD_PREFIX):
        return last[len(POD_PREFIX):]
    return None


# --- values -------------------------------------------------------------------------

@dataclass(frozen=True)
class CgroupValues:
    """What is set on a cgroup; None: left as it is (the parent's, or unlimited)."""
    cpu_shares: int | None = None
    cpu_quota: int | None = None     # microseconds per period; -1: no limit
    cpu_period: int | None = None
    memory_limit: int | None = None  # bytes
    pids_limit: int | None = None    # -1: no limit
    hugetlb: Mapping[int, int] = field(default_factory=dict)  # page size -> bytes


@dataclass(frozen=True)
class NodeResources:
    """What the node has for pods: CPU in millicores, memory in bytes, process ids."""
    cpu_millis: int
    memory_bytes: int
    pids: int

    def less(self, reserved: Mapping[str, float]) -> NodeResources:
        """Less the reserved amounts (cpu in cores, memory in bytes, pid), never below 0."""
        return NodeResources(
            cpu_millis=max(0, self.cpu_millis - round(reserved.get("cpu", 0.0) * 1000)),
            memory_bytes=max(0, self.memory_bytes - int(reserved.get("memory", 0.0))),
            pids=max(0, self.pids - int(reserved.get("pid", 0.0))))


def pod_values(pod: Pod, pids_limit: int = -1, qos: QOSClass | None = None) -> CgroupValues:
    """The pod cgroup's values (the kubelet's ResourceConfigForPod); `qos`: the pod's
    class, when known already."""
    declared = {"cpu": True, "memory": True}

    def seen(limits: Mapping[str, int]) -> None:
        for k in declared:
            if not limits.get(k):
                declared[k] = False
    requests = pod_requests(pod)
    limits = pod_limits(pod, seen)
    hugetlb = {size: v for k, v in requests.items() if (size := hugepage_size(k))}
    shares = milli_cpu_to_shares(requests.get("cpu", 0))
    quota = milli_cpu_to_quota(limits.get("cpu", 0))
    memory = limits.get("memory", 0)
    pids = pids_limit if pids_limit > 0 else None
    qos = qos or qos_class(pod)
    if qos == QOSClass.GUARANTEED:
        return CgroupValues(cpu_shares=shares, cpu_quota=quota, cpu_period=CPU_PERIOD_US,
                            memory_limit=memory, pids_limit=pids, hugetlb=hugetlb)
    if qos == QOSClass.BURSTABLE:
        cpu_limited = declared["cpu"]
        return CgroupValues(cpu_shares=shares,
                            cpu_quota=quota if cpu_limited else None,
                            cpu_period=CPU_PERIOD_US if cpu_limited else None,
                            memory_limit=memory if declared["memory"] else None,
                            pids_limit=pids, hugetlb=hugetlb)
    return CgroupValues(cpu_shares=MIN_SHARES, pids_limit=pids, hugetlb=hugetlb)


def node_values(resources: NodeResources) -> CgroupValues:
    """kubepods' values: what the node gives pods."""
    return CgroupValues(cpu_shares=milli_cpu_to_shares(resources.cpu_millis),
                        memory_limit=resources.memory_bytes, pids_limit=resources.pids)


# --- where the cgroups are kept -----------------------------------------------------

class CgroupBackend(Protocol):
    """Cgroups by driver path (to_path), in one cgroup version's files or in memory."""

    def exists(self, path: str) -> bool: ...

    def present(self, path: str) -> bool:
        """Whether anything of the cgroup is left: in cgroup v1, its folder in any
        hierarchy (a removal stopped halfway leaves it in some)."""

    def create(self, path: str, values: CgroupValues) -> None:
        """Make the cgroup (and its parents) and set `values`."""

    def update(self, path: str, values: CgroupValues) -> None: ...

    def remove(self, path: str) -> None:
        """Kill what still runs in it, then remove it and what is under it."""

    def children(self, path: str) -> list[str]:
        """The names of the cgroups directly under `path`."""

    def page_sizes(self) -> tuple[int, ...]:
        """The hugepage sizes (bytes) whose use a cgroup limits; () without hugetlb."""

    def memory_usage(self, path: str) -> int | None: ...


class MemoryCgroups:
    """Cgroups as records, for runtimes whose containers run nothing (the fake runtime,
    virtual nodes): the same hierarchy and values, and nothing written to the host."""

    def __init__(self) -> None:
        self.cgroups: dict[str, CgroupValues] = {"/": CgroupValues()}
        self._children: dict[str, set[str]] = {"/": set()}  # path -> its children's names

    def exists(self, path: str) -> bool:
        return path in self.cgroups

    present = exists  # in memory, nothing is ever left halfway

    def create(self, path: str, values: CgroupValues) -> None:
        parent = "/"
        for part in [p for p in path.split("/") if p]:
            here = parent.rstrip("/") + "/" + part
            if here not in self.cgroups:
                self.cgroups[here] = CgroupValues()
                self._children[here] = set()
                self._children[parent].add(part)
            parent = here
        self.cgroups[path] = values

    def update(self, path: str, values: CgroupValues) -> None:
        if path not in self.cgroups:
            raise CgroupError(f"cgroup {path}: does not exist")
        old = self.cgroups[path]
        self.cgroups[path] = dataclasses.replace(old, **{
            f.name: getattr(values, f.name) for f in dataclasses.fields(values)
            if getattr(values, f.name) not in (None, {})})

    def remove(self, path: str) -> None:
        if path not in self.cgroups or path == "/":
            return
        for child in list(self._children[path]):
            self.remove(f"{path}/{child}")
        del self.cgroups[path]
        del self._children[path]
        parent, _, name = path.rpartition("/")
        self._children[parent or "/"].discard(name)

    def children(self, path: str) -> list[str]:
        return sorted(self._children.get(path, ()))

    def page_sizes(self) -> tuple[int, ...]:
        return ()

    def memory_usage(self, path: str) -> int | None:
        return None


# --- the manager --------------------------------------------------------------------

@dataclass(frozen=True)
class CgroupSettings:
    """The kubelet's cgroup flags."""
    root: str = "/"                  # --cgroup-root
    per_qos: bool = True             # --cgroups-per-qos
    driver: str = "cgroupfs"         # --cgroup-driver
    enforce_pods: bool = True        # --enforce-node-allocatable has "pods"
    pod_pids_limit: int = -1         # --pod-max-pids (-1: none of its own)
    qos_reserved_memory: int = 0     # --qos-reserved memory=N%: N


@dataclass(frozen=True)
class _Tracked:
    path: str
    qos: QOSClass
    cpu_request: int     # millicores
    memory_request: int  # bytes
    values: CgroupValues = CgroupValues()  # what its cgroup was given


# the pod cgroup values of each resource an in-place resize changes
RESIZED = {"memory": ("memory_limit",), "cpu": ("cpu_shares", "cpu_quota", "cpu_period")}


def _larger(name: str, new: int, old: int | None) -> bool:
    """Whether `new` gives more than `old` (a quota of 0 or less: no limit)."""
    if old is None:
        return True
    if name == "cpu_quota":
        return old > 0 and (new <= 0 or new > old)
    return new > old


class PodCgroups:
    """Every pod's cgroup under its QoS cgroup; the QoS cgroups' and kubepods' values.

    `backend` None: no pod cgroups (--cgroups-per-qos=false, or a runtime that places
    nothing in cgroups): every cgroup parent is "" (the runtime's default).
    `capacity`: the node's; `allocatable`: what pods get of it (capacity less
    --system-reserved and --kube-reserved), enforced on kubepods with
    --enforce-node-allocatable=pods."""

    def __init__(self, backend: CgroupBackend | None, settings: CgroupSettings,
                 capacity: NodeResources, allocatable: NodeResources, clock: Clock) -> None:
        self.backend = backend if settings.per_qos else None
        self.settings = settings
        self.capacity = capacity
        self.allocatable = allocatable
        self.clock = clock
        self.driver = settings.driver
        self.root = parse_root(settings.root)
        self.node = (*self.root, NODE_CGROUP)
        self.qos_names: dict[QOSClass, CgroupName] = {
            QOSClass.GUARANTEED: self.node,
            QOSClass.BURSTABLE: (*self.node, "burstable"),
            QOSClass.BEST_EFFORT: (*self.node, "besteffort")}
        self._pods: dict[str, _Tracked] = {}
        # the counted pods' requests by class, kept as they come and go: a new pod's QoS
        # update costs the same with ten thousand pods (virtual nodes) as with ten
        self._cpu: dict[QOSClass, int] = dict.fromkeys(QOSClass, 0)
        self._memory: dict[QOSClass, int] = dict.fromkeys(QOSClass, 0)
        self._qos_updated = -QOS_UPDATE_PERIOD
        self._qos_written: dict[QOSClass, CgroupValues] = {}  # what each class was given

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    def path(self, name: CgroupName) -> str:
        return to_path(name, self.driver)

    def _backend(self) -> CgroupBackend:
        assert self.backend is not None
        return self.backend

    def start(self) -> None:
        """Check the root, make kubepods with the node's allocatable values, and the
        QoS cgroups. Raises CgroupError."""
        if self.backend is None:
            return
        b = self.backend
        root = self.path(self.root)
        if not b.exists(root):
            raise CgroupError(f"--cgroup-root {self.settings.root}: cgroup {root} does not "
                              "exist")
        given = self.allocatable if self.settings.enforce_pods else self.capacity
        node = self.path(self.node)
        try:
            values = dataclasses.replace(node_values(given), hugetlb=self._unbounded())
            (b.update if b.exists(node) else b.create)(node, values)
            for qos in (QOSClass.BURSTABLE, QOSClass.BEST_EFFORT):
                path = self.path(self.qos_names[qos])
                if not b.exists(path):
                    b.create(path, CgroupValues())
        except OSError as e:
            raise CgroupError(f"cannot make the QoS cgroups under {node}: {e}") from e
        self.update_qos(everything=True)

    # --- pods -------------------------------------------------------------------------

    def _path_of(self, uid: str, qos: QOSClass) -> str:
        return self.path((*self.qos_names[qos], POD_PREFIX + uid))

    def parent(self, pod: Pod) -> str:
        """The pod's cgroup as the runtime is given it (a sandbox's cgroup_parent)."""
        if not self.enabled:
            return ""
        uid = str(pod["metadata"]["uid"])
        tracked = self._pods.get(uid)  # a pod's QoS class never changes
        return tracked.path if tracked is not None else self._path_of(uid, qos_class(pod))

    def ensure(self, pod: Pod) -> None:
        """The pod's cgroup exists, made with the pod's values when it did not (the QoS
        cgroups first counting the pod). Raises CgroupError, ValueError (a bad
        quantity)."""
        if self.backend is None:
            return
        uid = str(pod["metadata"]["uid"])
        t = self._pods.get(uid)
        if t is None:
            qos, requests = qos_class(pod), pod_requests(pod)
            t = _Tracked(self._path_of(uid, qos), qos, requests.get("cpu", 0),
                         requests.get("memory", 0),
                         pod_values(pod, self.settings.pod_pids_limit, qos))
            self._count(uid, t)
            self.update_qos()
        if self.backend.exists(t.path):
            return
        values = pod_values(pod, self.settings.pod_pids_limit, t.qos)
        values = dataclasses.replace(values, hugetlb={
            s: values.hugetlb.get(s, 0) for s in self.backend.page_sizes()})
        try:
            self.backend.create(t.path, values)
        except OSError as e:
            raise CgroupError(f"cannot make the cgroup {t.path} of pod {describe(pod)}: "
                              f"{e}") from e
        log.debug("pod %s: cgroup %s made (%s)", describe(pod), t.path, _brief(values))

    def resize(self, pod: Pod, resource: str, grow: bool) -> None:
        """Set the pod cgroup's values of `resource` ("memory": its limit; "cpu": its
        shares and quota) to what the pod's resources, as allocated, give: with `grow`
        those that increase (set before its containers are resized), else those that
        decrease (after them). A value the resources leave unset stays as it is (a limit
        is never removed). Raises CgroupError."""
        uid = str(pod["metadata"]["uid"])
        t = self._pods.get(uid)
        if self.backend is None or t is None:
            return
        new = pod_values(pod, self.settings.pod_pids_limit, t.qos)
        change = {}
        for name in RESIZED[resource]:
            value, old = getattr(new, name), getattr(t.values, name)
            if value is not None and value != old and (
                    name == "cpu_period" or _larger(name, value, old) == grow):
                change[name] = value
        if resource == "cpu" and "cpu_quota" not in change:
            change.pop("cpu_period", None)  # the period goes with its quota
        if not change:
            return
        values = CgroupValues(**change)
        try:
            self.backend.update(t.path, values)
        except OSError as e:
            raise CgroupError(f"cannot resize the cgroup {t.path} of pod {describe(pod)}: "
                              f"{e}") from e
        self._pods[uid] = dataclasses.replace(t, values=dataclasses.replace(t.values,
                                                                            **change))
        log.debug("pod %s: cgroup %s resized (%s)", describe(pod), t.path, _brief(values))

    def memory_limit_lowered(self, pod: Pod) -> int | None:
        """The pod cgroup's memory limit as the pod's resources now give it, when that
        is lower than the one it has (or it has none); else None."""
        t = self._pods.get(str(pod["metadata"]["uid"]))
        if self.backend is None or t is None:
            return None
        new = pod_values(pod, self.settings.pod_pids_limit, t.qos).memory_limit
        old = t.values.memory_limit
        return new if new and (not old or new < old) else None

    def recount(self, pod: Pod) -> None:
        """The QoS cgroups count the pod's requests as they are now (after a resize).
        Raises CgroupError."""
        uid = str(pod["metadata"]["uid"])
        t = self._pods.get(uid)
        if self.backend is None or t is None:
            return
        requests = pod_requests(pod)
        if (requests.get("cpu", 0), requests.get("memory", 0)) == (t.cpu_request,
                                                                   t.memory_request):
            return
        self._uncount(uid)
        self._count(uid, dataclasses.replace(t, cpu_request=requests.get("cpu", 0),
                                             memory_request=requests.get("memory", 0)))
        self.update_qos()

    def release(self, uid: str) -> None:
        """The pod runs no more: its cgroup is removed and the QoS cgroups no longer
        count it. Raises CgroupError."""
        if self.backend is None:
            return
        tracked = self._uncount(uid)
        paths = [tracked.path] if tracked else self._untracked(uid)
        if tracked is not None:
            self.update_qos()
        for path in paths:
            self._remove(path)

    def _count(self, uid: str, t: _Tracked) -> None:
        self._pods[uid] = t
        self._cpu[t.qos] += t.cpu_request
        self._memory[t.qos] += t.memory_request

    def _uncount(self, uid: str) -> _Tracked | None:
        t = self._pods.pop(uid, None)
        if t is not None:
            self._cpu[t.qos] -= t.cpu_request
            self._memory[t.qos] -= t.memory_request
        return t

    def _remove(self, path: str) -> None:
        try:
            self._backend().remove(path)
        except OSError as e:
            raise CgroupError(f"cannot remove the cgroup {path}: {e}") from e

    def _untracked(self, uid: str) -> list[str]:
        """The pod's cgroups that exist though it is not counted (made before the agent
        started, or released already): where its name puts them under each QoS cgroup,
        looked up, not found by listing every pod's."""
        b = self._backend()
        return [p for p in dict.fromkeys(self._path_of(uid, q) for q in QOSClass)
                if b.present(p)]

    def _found(self) -> dict[str, list[str]]:
        """The pod cgroups under the QoS cgroups: uid -> their paths."""
        b = self._backend()
        found: dict[str, list[str]] = {}
        for name in self.qos_names.values():
            parent = self.path(name)
            for child in b.children(parent):
                uid = pod_uid_of(child, self.driver)
                if uid:
                    found.setdefault(uid, []).append(f"{parent.rstrip('/')}/{child}")
        return found

    def housekeeping(self, keep: Iterable[str]) -> list[str]:
        """Remove the cgroups of the pods not in `keep` (nothing knows them, nothing of
        theirs is in the runtime); the QoS values again once a minute. Returns the uids
        whose cgroups were removed."""
        if self.backend is None:
            return []
        found = self._found()
        removed = []
        for uid in sorted(found.keys() - set(keep)):
            paths = found[uid]
            log.info("housekeeping: removing the cgroup of pod %s, which nothing runs", uid)
            self._uncount(uid)
            try:
                for path in paths:
                    self._remove(path)
            except CgroupError as e:
                log.warning("housekeeping: %s; tried again later", e)
                continue
            removed.append(uid)
        if removed or self.clock.monotonic() - self._qos_updated >= QOS_UPDATE_PERIOD:
            try:
                self.update_qos(everything=True)
            except CgroupError as e:
                log.warning("%s; tried again later", e)
        return removed

    # --- QoS ---------------------------------------------------------------------------

    def qos_values(self) -> dict[QOSClass, CgroupValues]:
        """What the QoS cgroups get for the pods running now."""
        memory = self._memory
        unbounded = self._unbounded()
        burstable = CgroupValues(cpu_shares=milli_cpu_to_shares(self._cpu[QOSClass.BURSTABLE]),
                                 hugetlb=unbounded)
        best_effort = CgroupValues(cpu_shares=MIN_SHARES, hugetlb=unbounded)
        percent = self.settings.qos_reserved_memory
        if percent and self.allocatable.memory_bytes:
            limit = self.allocatable.memory_bytes \
                - memory[QOSClass.GUARANTEED] * percent // 100
            burstable = dataclasses.replace(burstable, memory_limit=limit)
            best_effort = dataclasses.replace(
                best_effort, memory_limit=limit - memory[QOSClass.BURSTABLE] * percent // 100)
        return {QOSClass.GUARANTEED: CgroupValues(hugetlb=unbounded),
                QOSClass.BURSTABLE: burstable, QOSClass.BEST_EFFORT: best_effort}

    def update_qos(self, everything: bool = False) -> None:
        """Set the QoS cgroups' values that changed since they were last set (with
        `everything`: all of them, as once a minute). A memory limit below what a
        class uses already cannot be set: then it is set to that use, which stops it
        growing. Raises CgroupError."""
        if self.backend is None:
            return
        b = self.backend
        if everything:
            self._qos_updated = self.clock.monotonic()
        failed = []
        for qos, values in self.qos_values().items():
            if not everything and self._qos_written.get(qos) == values:
                continue
            self._qos_written.pop(qos, None)  # unknown until it is set again
            path = self.path(self.qos_names[qos])
            try:
                b.update(path, values)
                self._qos_written[qos] = values
                continue
            except OSError as e:
                problem = f"{path}: {e}"
            usage = b.memory_usage(path) if values.memory_limit is not None else None
            if usage is not None and values.memory_limit is not None \
                    and usage > values.memory_limit:
                try:
                    b.update(path, dataclasses.replace(values, memory_limit=usage))
                    continue
                except OSError as e:
                    problem = f"{path}: {e}"
            failed.append(problem)
        if failed:
            raise CgroupError("cannot update the QoS cgroups: " + "; ".join(failed))

    def _unbounded(self) -> dict[int, int]:
        return {s: HUGETLB_UNBOUNDED for s in self._backend().page_sizes()}

    def tracked(self) -> dict[str, str]:
        """Pod uid -> cgroup path, of the pods counted now."""
        return {uid: t.path for uid, t in self._pods.items()}


def _brief(v: CgroupValues) -> str:
    parts = [f"{f.name}={getattr(v, f.name)}" for f in dataclasses.fields(v)
             if getattr(v, f.name) not in (None, {})]
    return ", ".join(parts) or "no limits"
