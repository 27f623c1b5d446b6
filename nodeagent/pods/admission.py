"""Node admission: whether this node may run a pod at all, as the kubelet decides it
before starting anything. A refused pod goes to phase Failed with the kubelet's reason
and the message "Pod was rejected: ..." and a Warning Event of that reason; none of its
containers is started.

Two parts:

- `admit(pod, settings)`: what depends on the pod alone, checked at every sync: its OS
  (spec.os.name and its kubernetes.io/os label), its sysctls against the safe set and
  `--allowed-unsafe-sysctls`, a Strict supplementalGroupsPolicy (the runtime cannot do
  it), AppArmor profiles on a host without AppArmor, and pod-level resources (this
  agent's pod cgroups follow its containers' resources only).
- `NodeAdmission`: what depends on the node and the pods already on it, decided once
  per pod, in the order the pods were created (pods the runtime already runs first:
  an agent that restarts takes them back before anything new). These are the kubelet's
  general predicates (`general_predicates`): the pod's effective requests
  (resources.py) fit the node's allocatable beside the pods admitted before it and not
  ended; its host ports are free; its nodeName, nodeSelector and required node
  affinity match the Node; it tolerates the Node's NoExecute taints (a static pod is
  not asked). A critical pod (static, or of critical priority) that does not fit only
  for want of resources preempts pods of lower priority instead (`pods_to_preempt`):
  they are stopped with phase Failed, reason Preempting, and the critical pod starts
  once they have stopped. An admitted pod stays admitted: admission never stops a pod
  that runs.

What an admitted pod holds is its allocation: its requests as admitted. An in-place
resize (resize.py) changes it only once the new requests fit the node beside the other
pods (`resize`, the kubelet's handlePodResourcesResize): one that never can is
Infeasible, one that may later is Deferred and tried again when a pod leaves the node
or another resize is allocated, in the kubelet's order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent.api.kube import describe
from nodeagent.events import NORMAL, WARNING, Events
from nodeagent.pods import resize as rz
from nodeagent.pods.podstatus import Ending, is_sidecar
from nodeagent.pods.podupdate import Pod, is_static
from nodeagent.pods.resources import (
    CPU,
    EPHEMERAL,
    MEMORY,
    PODS,
    amounts,
    counted,
    is_critical,
    is_extended,
    is_scalar,
    pod_requests,
    preemptable,
    priority,
    qos_class,
    request_of,
)
from nodeagent.runtime.security import UNCONFINED, normalize_sysctl

log = logging.getLogger(__name__)

NODE_OS = "linux"
OS_LABEL = "kubernetes.io/os"

# Sysctls that are namespaced and touch nothing outside the pod (the kubelet's safe set),
# with the kernel version each needs to be namespaced.
SAFE_SYSCTLS: tuple[tuple[str, tuple[int, int]], ...] = (
    ("kernel.shm_rmid_forced", (0, 0)),
    ("net.ipv4.ip_local_port_range", (0, 0)),
    ("net.ipv4.tcp_syncookies", (0, 0)),
    ("net.ipv4.ping_group_range", (0, 0)),
    ("net.ipv4.ip_unprivileged_port_start", (0, 0)),
    ("net.ipv4.ip_local_reserved_ports", (3, 16)),
    ("net.ipv4.tcp_keepalive_time", (4, 5)),
    ("net.ipv4.tcp_fin_timeout", (4, 6)),
    ("net.ipv4.tcp_keepalive_intvl", (4, 5)),
    ("net.ipv4.tcp_keepalive_probes", (4, 5)),
    ("net.ipv4.tcp_rmem", (4, 15)),
    ("net.ipv4.tcp_wmem", (4, 15)),
)

# Which namespace a sysctl lives in; one outside these is not namespaced at all.
_IPC_NAMES = ("kernel.sem", "kernel.shmall", "kernel.shmmax", "kernel.shmmni",
              "kernel.shm_rmid_forced")
_IPC_PREFIXES = ("kernel.shm", "kernel.msg", "fs.mqueue.")


def sysctl_namespace(name: str) -> str:
    """"Net", "IPC", or "" when the sysctl is not namespaced (node-wide)."""
    if name.startswith("net."):
        return "Net"
    if name in _IPC_NAMES or name.startswith(_IPC_PREFIXES):
        return "IPC"
    return ""


def kernel_version() -> tuple[int, int]:
    parts = platform.release().split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0


def apparmor_enabled() -> bool:
    try:
        return Path("/sys/module/apparmor/parameters/enabled").read_text().strip() == "Y"
    except OSError:
        return False


def check_unsafe_sysctls(patterns: Sequence[str], where: str) -> tuple[str, ...]:
    """Validate `--allowed-unsafe-sysctls` patterns (a name, or a prefix ending in '*'):
    each must be namespaced, else allowing it would let a pod change the node."""
    out = []
    for p in patterns:
        name = normalize_sysctl(p.strip())
        if not name:
            continue
        if "*" in name[:-1]:
            raise ValueError(f"{where}: {p!r}: '*' may only end a pattern")
        if not sysctl_namespace(name.rstrip("*")):
            raise ValueError(f"{where}: {p!r}: the sysctls {name.rstrip('*')!r} are not "
                             "known to be namespaced")
        out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class AdmissionSettings:
    allowed_unsafe_sysctls: tuple[str, ...] = ()  # names or prefixes ending in '*'
    kernel: tuple[int, int] = field(default_factory=kernel_version)
    apparmor: bool = field(default_factory=apparmor_enabled)

    def allowed_sysctls(self) -> tuple[str, ...]:
        safe = tuple(n for n, needs in SAFE_SYSCTLS if self.kernel >= needs)
        return safe + self.allowed_unsafe_sysctls


@dataclass(frozen=True)
class Rejection:
    reason: str
    message: str


# a pod that has not started yet while the node shuts down (nodeagent.shutdown)
NODE_SHUTDOWN = Rejection("NodeShutdown", "Pod was rejected as the node is shutting down.")


def _sysctl_refusal(name: str, allowed: Sequence[str], host_net: bool,
                    host_ipc: bool) -> str:
    name = normalize_sysctl(name)
    for pattern in allowed:
        if pattern == name or (pattern.endswith("*") and name.startswith(pattern[:-1])):
            ns = sysctl_namespace(name)
            if (ns == "Net" and host_net) or (ns == "IPC" and host_ipc):
                return f'"{name}" not allowed with host {ns} enabled'
            return ""
    return f'"{name}" not allowlisted'


def _apparmor_wanted(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    scs = [spec.get("securityContext") or {}] + [
        c.get("securityContext") or {}
        for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]]
    if any((sc.get("appArmorProfile") or {}).get("type") not in (None, UNCONFINED)
           for sc in scs):
        return True
    prefix = "container.apparmor.security.beta.kubernetes.io/"
    return any(k.startswith(prefix) and v != "unconfined"
               for k, v in ((pod.get("metadata") or {}).get("annotations") or {}).items())


def admit(pod: Mapping[str, Any], settings: AdmissionSettings) -> Rejection | None:
    """None when this node may run the pod, else why not (the kubelet's reasons)."""
    spec = pod.get("spec") or {}
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if OS_LABEL in labels and labels[OS_LABEL] != NODE_OS:
        return Rejection("PodOSSelectorNodeLabelDoesNotMatch",
                         "Failed to admit pod as the `kubernetes.io/os` label doesn't match "
                         "node label")
    os_name = (spec.get("os") or {}).get("name")
    if os_name is not None and os_name != NODE_OS:
        return Rejection("PodOSNotSupported",
                         "Failed to admit pod as the OS field doesn't match node OS")
    psc = spec.get("securityContext") or {}
    if psc.get("supplementalGroupsPolicy") not in (None, "Merge"):
        return Rejection("SupplementalGroupsPolicyNotSupported",
                         f"SupplementalGroupsPolicy={psc['supplementalGroupsPolicy']} is not "
                         "supported in this node")
    if spec.get("resources"):
        return Rejection("PodLevelResourcesNotSupported",
                         "Pod-level resources (spec.resources) are not supported by this "
                         "node agent: its pod cgroups follow the containers' resources "
                         "only")
    if psc.get("sysctls"):
        allowed = settings.allowed_sysctls()
        for s in psc["sysctls"]:
            why = _sysctl_refusal(str(s.get("name") or ""), allowed,
                                  bool(spec.get("hostNetwork")), bool(spec.get("hostIPC")))
            if why:
                return Rejection("SysctlForbidden", f"forbidden sysctl: {why}")
    if not settings.apparmor and _apparmor_wanted(pod):
        return Rejection("AppArmor", "Cannot enforce AppArmor: AppArmor is not enabled on "
                                     "the host")
    return None


# --- the general predicates: the pod beside the node and its other pods -------------

Node = Mapping[str, Any]
"""A Node as the API has it; admission reads metadata.name and .labels, spec.taints and
status.allocatable."""

HostPort = tuple[str, str, int]  # host IP ("0.0.0.0": all), protocol, port
ANY_IP = "0.0.0.0"


@dataclass(frozen=True)
class Insufficient:
    """The node has too little left of a resource for the pod."""
    resource: str
    requested: int
    used: int
    capacity: int

    def short(self) -> int:
        """How much more would have to be free."""
        return self.requested - (self.capacity - self.used)

    def rejection(self) -> Rejection:
        return Rejection(f"OutOf{self.resource}",
                         f"Node didn't have enough resource: {self.resource}, requested: "
                         f"{self.requested}, used: {self.used}, capacity: {self.capacity}")


@dataclass(frozen=True)
class Unmatched:
    """A predicate other than resources that the pod fails, and why."""
    predicate: str
    why: str

    def rejection(self) -> Rejection:
        return Rejection(self.predicate, f"Predicate {self.predicate} failed: {self.why}")


Failure = Insufficient | Unmatched

NODE_AFFINITY = Unmatched("NodeAffinity", "node(s) didn't match Pod's node affinity/selector")
NODE_NAME = Unmatched("NodeName", "node(s) didn't match the requested node name")
NODE_PORTS = Unmatched("NodePorts", "node(s) didn't have free ports for the requested pod "
                                    "ports")
TAINTS = Unmatched("TaintToleration", "node(s) had taints that the pod didn't tolerate")


@dataclass(frozen=True)
class Held:
    """What an admitted pod holds of its node until its containers have stopped."""
    pod: Pod
    requests: Mapping[str, int]
    ports: tuple[HostPort, ...]


def hold(pod: Pod) -> Held:
    return Held(pod, pod_requests(pod), tuple(host_ports(pod)))


def host_ports(pod: Pod) -> list[HostPort]:
    """The host ports the pod's long-running containers (regular ones and sidecars)
    claim."""
    spec = pod.get("spec") or {}
    out = []
    for c in [*(c for c in spec.get("initContainers") or [] if is_sidecar(c)),
              *(spec.get("containers") or [])]:
        for p in c.get("ports") or []:
            port = _integer(p.get("hostPort")) or 0
            if port > 0:
                out.append((str(p.get("hostIP") or ANY_IP), str(p.get("protocol") or "TCP"),
                            port))
    return out


def _port_taken(want: HostPort, used: Iterable[HostPort]) -> bool:
    """A port on all addresses clashes with that port on any; one address's only with
    the same address's or all addresses'."""
    ip, proto, port = want
    return any((p, n) == (proto, port) and (u == ip or ANY_IP in (ip, u))
               for u, p, n in used)


def _requirement(expr: Mapping[str, Any], value: str | None) -> bool | None:
    """Whether a node selector requirement holds for a label's value (None: the label
    is absent); None when the requirement is malformed (it matches nothing)."""
    op = expr.get("operator")
    values = [str(v) for v in expr.get("values") or []]
    if op in ("In", "NotIn"):
        if not values:
            return None
        return (value in values) == (op == "In")
    if op in ("Exists", "DoesNotExist"):
        if values:
            return None
        return (value is not None) == (op == "Exists")
    if op in ("Gt", "Lt"):
        bound = _integer(values[0]) if len(values) == 1 else None
        if bound is None:
            return None
        have = _integer(value)
        return have is not None and (have > bound if op == "Gt" else have < bound)
    return None


def _integer(value: object) -> int | None:
    try:
        return int(str(value)) if value is not None else None
    except ValueError:
        return None


def _field_requirement(expr: Mapping[str, Any], fields: Mapping[str, str]) -> bool | None:
    """A matchFields requirement (In or NotIn, one value) against the Node's fields."""
    values = expr.get("values") or []
    if expr.get("operator") not in ("In", "NotIn") or len(values) != 1:
        return None
    return (fields.get(str(expr.get("key")), "") == str(values[0])) == \
        (expr.get("operator") == "In")


def _term_matches(term: Mapping[str, Any], labels: Mapping[str, str],
                  fields: Mapping[str, str]) -> bool:
    labels_ok = [_requirement(e, labels.get(str(e.get("key"))))
                 for e in term.get("matchExpressions") or []]
    fields_ok = [_field_requirement(e, fields) for e in term.get("matchFields") or []]
    return all(ok is True for ok in [*labels_ok, *fields_ok])


def node_affinity_matches(pod: Pod, node: Node) -> bool:
    """The pod's nodeSelector (every label, exactly) and its required node affinity (any
    of its non-empty terms) match the Node."""
    spec = pod.get("spec") or {}
    meta = node.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    if any(labels.get(str(k)) != str(v) for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if required is None:
        return True
    fields = {"metadata.name": str(meta.get("name") or "")}
    terms = [t for t in required.get("nodeSelectorTerms") or []
             if t.get("matchExpressions") or t.get("matchFields")]
    return any(_term_matches(t, labels, fields) for t in terms)


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """An empty effect or key in the toleration matches any; operator Exists any value,
    Equal (the default) the same value."""
    for k in ("effect", "key"):
        if toleration.get(k) and toleration[k] != taint.get(k):
            return False
    op = toleration.get("operator") or "Equal"
    if op == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    return op == "Exists"


def untolerated_no_execute(pod: Pod, node: Node) -> bool:
    """A NoExecute taint of the Node that none of the pod's tolerations tolerates (the
    NoSchedule ones are the scheduler's, as for the kubelet)."""
    tolerations = (pod.get("spec") or {}).get("tolerations") or []
    return any(not any(tolerates(t, taint) for t in tolerations)
               for taint in (node.get("spec") or {}).get("taints") or []
               if taint.get("effect") == "NoExecute")


def _fits(pod: Pod, allocatable: Mapping[str, int],
          others: Sequence[Held]) -> list[Insufficient]:
    """The resources the node lacks for the pod beside `others`. Extended resources the
    node does not advertise at all are not counted (they may be another component's,
    such as a cluster-wide resource)."""
    requests = pod_requests(pod, lambda n: not is_extended(n) or n in allocatable)
    used: dict[str, int] = {}
    for h in others:
        for k, v in h.requests.items():
            if counted(k):
                used[k] = used.get(k, 0) + v
    out = []
    if len(others) + 1 > allocatable.get(PODS, 0):
        out.append(Insufficient(PODS, 1, len(others), allocatable.get(PODS, 0)))
    for name in [CPU, MEMORY, EPHEMERAL, *sorted(k for k in requests if is_scalar(k))]:
        want = requests.get(name, 0)
        if want > 0 and want > allocatable.get(name, 0) - used.get(name, 0):
            out.append(Insufficient(name, want, used.get(name, 0), allocatable.get(name, 0)))
    return out


def general_predicates(pod: Pod, node: Node, others: Sequence[Held]) -> list[Failure]:
    """Every predicate the pod fails on `node` beside the pods admitted there
    (`others`), in the kubelet's order: resources (pods, cpu, memory,
    ephemeral-storage, then the others by name), node affinity and selector, node
    name, host ports, NoExecute taints. The first decides the rejection."""
    spec = pod.get("spec") or {}
    out: list[Failure] = []
    out += _fits(pod, amounts((node.get("status") or {}).get("allocatable")), others)
    if not node_affinity_matches(pod, node):
        out.append(NODE_AFFINITY)
    name = spec.get("nodeName")
    if name and name != (node.get("metadata") or {}).get("name"):
        out.append(NODE_NAME)
    used = [p for h in others for p in h.ports]
    if any(_port_taken(p, used) for p in host_ports(pod)):
        out.append(NODE_PORTS)
    if not is_static(pod) and untolerated_no_execute(pod, node):
        out.append(TAINTS)
    return out


# --- preemption: room for a critical pod --------------------------------------------

PREEMPTED = Ending("Preempting", "Preempted in order to admit critical pod",
                   disruption="Pod was preempted by Kubelet to accommodate a critical pod.")

Needs = list[tuple[str, int]]  # resource -> how much more must be freed


class PreemptionError(Exception):
    """No set of pods frees what is needed."""


def _needs_text(needs: Needs) -> str:
    return "[" + "".join(f"(res: {n}, q: {q}), " for n, q in needs) + "]"


def _left(needs: Needs, pods: Sequence[Pod]) -> Needs:
    """What is still needed once `pods` are gone."""
    out = []
    for name, q in needs:
        for p in pods:
            q -= request_of(p, name)
            if q <= 0:
                break
        if q > 0:
            out.append((name, q))
    return out


def _distance(needs: Needs, pod: Pod) -> float:
    """How far stopping `pod` leaves us from what is needed, each need weighed as a
    fraction of itself, so no resource outweighs another by its unit."""
    d = 0.0
    for name, q in needs:
        left = q - request_of(pod, name)
        if left > 0:
            d += (left / q) ** 2
    return d


def _smaller(a: Pod, b: Pod) -> bool:
    """`a` requests less than `b`: memory first, then cpu (ties: yes)."""
    for name in (MEMORY, CPU):
        x, y = request_of(a, name), request_of(b, name)
        if x != y:
            return x < y
    return True


def _closest(pods: Sequence[Pod], needs: Needs) -> list[Pod]:
    """Pods chosen one at a time, each the closest to what is still needed (the
    smaller on a tie), until nothing is."""
    pool = list(pods)
    chosen: list[Pod] = []
    while needs:
        if not pool:
            raise PreemptionError("no set of running pods found to reclaim resources: "
                                  + _needs_text(needs))
        best, best_d = 0, float(len(needs) + 1)
        for i, p in enumerate(pool):
            d = _distance(needs, p)
            if d < best_d or (d == best_d and _smaller(p, pool[best])):
                best, best_d = i, d
        needs = _left(needs, [pool[best]])
        chosen.append(pool[best])
        pool[best] = pool[-1]
        pool.pop()
    return chosen


def pods_to_preempt(pod: Pod, candidates: Sequence[Pod], needs: Needs) -> list[Pod]:
    """The pods to stop so that the critical `pod` fits, the kubelet's way: of those it
    may preempt, as few Guaranteed pods as would do were every BestEffort and
    Burstable one stopped, then as few Burstable ones as would do beside those, then
    the BestEffort ones still needed. PreemptionError when even all would not do."""
    by_class: dict[str, list[Pod]] = {"BestEffort": [], "Burstable": [], "Guaranteed": []}
    for c in candidates:
        if preemptable(pod, c) and qos_class(c) in by_class:
            by_class[qos_class(c)].append(c)
    best_effort, burstable, guaranteed = by_class.values()
    if left := _left(needs, [*best_effort, *burstable, *guaranteed]):
        raise PreemptionError("no set of running pods found to reclaim resources: "
                              + _needs_text(left))
    g = _closest(guaranteed, _left(needs, [*best_effort, *burstable]))
    b = _closest(burstable, _left(needs, [*best_effort, *g]))
    e = _closest(best_effort, _left(needs, [*b, *g]))
    return [*e, *b, *g]


# --- one node's admission -----------------------------------------------------------

INVALID_NODE_INFO = Rejection("InvalidNodeInfo", "Kubelet cannot get node info.")


class NodeAdmission:
    """One node's admission of the pods bound to it (see the module docstring): which
    are admitted and what they hold, which were rejected and why, which wait.

    The pod loop tells it when a pod is first seen (`add`), will not start
    (`withdraw`), has stopped for good (`release`) or is gone (`forget`); the syncer
    asks for a pod's verdict (`settle`, then `rejection` and `waiting`). Pods are
    decided when a verdict is first asked for, so a restarted agent knows by then
    which pods the runtime runs."""

    def __init__(self, node: str, settings: AdmissionSettings,
                 node_info: Callable[[], Node | None], running: Callable[[str], bool],
                 events: Events | None = None,
                 pressure: Callable[[], frozenset[str]] | None = None,
                 shutting_down: Callable[[], bool] | None = None,
                 resizes: rz.ResizeConditions | None = None) -> None:
        """`node_info`: the Node as admission reads it (None: unknown); `running(uid)`:
        whether the runtime runs something of the pod; `pressure`: the node's pressure
        conditions now (the eviction manager's), under which a new pod may be refused;
        `shutting_down`: whether the node is shutting down (no new pod then);
        `resizes`: the pods' resize conditions, PodResizePending set here."""
        self.node = node
        self.settings = settings
        self.node_info = node_info
        self.running = running
        self.events = events
        self._pressure = pressure
        self._shutting_down = shutting_down
        self.resizes = resizes if resizes is not None else rz.ResizeConditions()
        # stop a preempted pod with this status (the pod loop's: a KILL to its worker)
        self.on_preempt: Callable[[Pod, Ending], None] | None = None
        # sync a pod whose resize was allocated while another pod was being synced
        self.on_resize: Callable[[Pod], None] | None = None
        self.admitted: dict[str, Held] = {}
        # resizes not allocated yet (Deferred, or not decided): uid -> (since, the pod)
        self._resizing: dict[str, tuple[int, Pod]] = {}
        # seen, undecided: uid -> (arrival, pod, to stop)
        self._pending: dict[str, tuple[int, Pod, bool]] = {}
        self._rejected: dict[str, Rejection] = {}
        self._ended: set[str] = set()  # stopped for good, or never to start
        self._stopping: set[str] = set()  # preempted and not stopped yet: the rest waits
        self._preemptor = ""
        self._turn: asyncio.Future[None] | None = None
        self._arrivals = itertools.count()

    def pressure(self) -> frozenset[str]:
        """The node's pressure conditions now (none without an eviction manager)."""
        return self._pressure() if self._pressure is not None else frozenset()

    def shutting_down(self) -> bool:
        return self._shutting_down is not None and self._shutting_down()

    # -- what the pod loop reports --

    def add(self, pod: Pod) -> None:
        """A pod first seen: to be decided."""
        uid = str(pod["metadata"]["uid"])
        if uid not in self._pending and uid not in self.admitted and \
                uid not in self._rejected and uid not in self._ended:
            self._pending[uid] = (next(self._arrivals), pod, False)

    def withdraw(self, uid: str) -> None:
        """The pod is to stop (deleted, gone) before it was decided: it will not start;
        if the runtime runs it already (an agent that restarted finds it), it holds what
        it holds until it has stopped. One already admitted holds it until then too."""
        if uid in self._pending:
            arrival, pod, _ = self._pending[uid]
            self._pending[uid] = (arrival, pod, True)

    def release(self, uid: str) -> None:
        """The pod's containers have stopped for good: what it held is free (a deferred
        resize may fit now)."""
        held = self.admitted.pop(uid, None)
        self._pending.pop(uid, None)
        self._resizing.pop(uid, None)
        self._ended.add(uid)
        if held is not None and self._resizing:
            self._retry_resizes()
        if uid in self._stopping:
            self._stopping.discard(uid)
            if not self._stopping:
                log.info("node %s: the pods preempted for %s have stopped", self.node,
                         self._preemptor)
                self._preemptor = ""
                if self._turn is not None and not self._turn.done():
                    self._turn.set_result(None)
                self._turn = None

    def forget(self, uid: str) -> None:
        """The pod is gone from every source and the runtime."""
        self.release(uid)
        self._ended.discard(uid)
        self._rejected.pop(uid, None)
        self.resizes.forget(uid)

    # -- what the syncer asks --

    def settle(self, pod: Pod) -> None:
        """Decide `pod` (added if new) and every pod before it that can be decided."""
        self.add(pod)
        if self._stopping or not self._pending:
            return
        order = sorted(self._pending.items(), key=lambda kv: (
            not self.running(kv[0]),
            str((kv[1][1].get("metadata") or {}).get("creationTimestamp") or ""), kv[1][0]))
        for uid, (_, p, stops) in order:
            del self._pending[uid]
            if stops and not self.running(uid):
                self._ended.add(uid)  # it will never start
                continue
            self._decide(uid, p)
            if self._stopping:  # the rest waits until the preempted pods have stopped
                return

    def rejection(self, uid: str) -> Rejection | None:
        return self._rejected.get(uid)

    def waiting(self, uid: str) -> bool:
        """Not decided yet, or admitted in place of pods still stopping."""
        return uid in self._pending or (uid == self._preemptor and bool(self._stopping))

    def turn(self) -> tuple[asyncio.Future[None], ...]:
        """Done once the preempted pods have stopped (nothing when none are stopping)."""
        if not self._stopping:
            return ()
        if self._turn is None:
            self._turn = asyncio.get_running_loop().create_future()
        return (self._turn,)

    # -- resizes --

    def allocated(self, pod: Pod) -> Pod:
        """`pod` with its resizable containers' resources as allocated: a resize not
        allocated (yet) is not in it. An admitted pod runs as this says."""
        held = self.admitted.get(str(pod["metadata"]["uid"]))
        return pod if held is None or held.pod is pod else rz.with_allocation(pod, held.pod)

    def resize(self, pod: Pod) -> Pod:
        """Allocate `pod`'s resize if it asks for one and it fits (then PodResizePending
        is cleared, PodResizeInProgress set and a ResizeStarted Event written); else
        PodResizePending says why. Every other pending resize is tried again with it, in
        the kubelet's order. Returns the pod as allocated now."""
        uid = str(pod["metadata"]["uid"])
        if uid not in self.admitted:
            return pod
        now = self.allocated(pod)
        if now is pod:  # nothing to allocate (or a pending resize was reverted)
            self._resizing.pop(uid, None)
            self.resizes.clear_pending(uid)
            return pod
        since = self._resizing.get(uid, (next(self._arrivals), pod))[0]
        self._resizing[uid] = (since, pod)
        self._retry_resizes(uid)
        return self.allocated(pod)

    def _retry_resizes(self, syncing: str = "") -> None:
        """Try every pending resize: the ones that ask for no more first, then by
        priority, Guaranteed before the others, the longest pending first. A pod whose
        resize is allocated, or whose conditions changed, is synced (`on_resize`), but for
        `syncing`, whose sync asked."""
        def order(uid: str) -> tuple[bool, int, bool, bool, int]:
            since, pod = self._resizing[uid]
            held = self.admitted[uid]
            more = pod_requests(pod)
            grows = any(more.get(r, 0) > held.requests.get(r, 0) for r in (CPU, MEMORY))
            return (grows, -(priority(pod) or 0), qos_class(pod) != "Guaranteed",
                    self.resizes.get(uid, rz.PENDING) is None, since)
        for uid in [u for u in self._resizing if u not in self.admitted]:
            del self._resizing[uid]
        for uid in sorted(self._resizing, key=order):
            pod = self._resizing[uid][1]
            before = self.resizes.of(uid)
            if self._try_resize(uid, pod) != rz.DEFERRED:
                del self._resizing[uid]
            if uid != syncing and self.resizes.of(uid) != before \
                    and self.on_resize is not None:
                self.on_resize(pod)  # allocated, or its status says something new

    def _try_resize(self, uid: str, pod: Pod) -> str:
        """The kubelet's handlePodResourcesResize and canResizePod for one pod (desired
        `pod`): "" when allocated or nothing to do, else the PodResizePending reason."""
        held = self.admitted[uid]
        if rz.with_allocation(pod, held.pod) is pod:
            self.resizes.clear_pending(uid)
            return ""
        generation = int((pod.get("metadata") or {}).get("generation") or 0)
        if is_static(pod):
            return self._pend(pod, rz.INFEASIBLE, rz.STATIC_POD, generation)
        node = self.node_info()
        if node is None:
            return self._pend(pod, rz.DEFERRED, INVALID_NODE_INFO.message, generation)
        allocatable = amounts((node.get("status") or {}).get("allocatable"))
        want = pod_requests(pod)
        for name in (MEMORY, CPU):  # more than the whole node has: never
            if want.get(name, 0) > allocatable.get(name, 0):
                return self._pend(pod, rz.INFEASIBLE, f"Node didn't have enough capacity: "
                                  f"{name}, requested: {want.get(name, 0)}, capacity: "
                                  f"{allocatable.get(name, 0)}", generation)
        others = [h for u, h in self.admitted.items() if u != uid]
        failures = general_predicates(pod, node, others)
        if failures:
            return self._pend(pod, rz.DEFERRED, failures[0].rejection().message, generation)
        self.admitted[uid] = hold(pod)
        self.resizes.clear_pending(uid)
        self.resizes.clear_in_progress(uid)
        self.resizes.set_in_progress(uid, "", "", generation)
        log.info("pod %s: resize allocated (generation %d)", describe(pod), generation)
        if self.events is not None:
            self.events.pod(pod, NORMAL, rz.STARTED,
                            rz.event_message("Pod resize started", pod, generation))
        return ""

    def _pend(self, pod: Pod, reason: str, message: str, generation: int) -> str:
        uid = str(pod["metadata"]["uid"])
        if self.resizes.set_pending(uid, reason, message, generation):
            log.info("pod %s: resize %s: %s", describe(pod), reason, message)
            if self.events is not None:
                self.events.pod(pod, WARNING, rz.PENDING_EVENTS[reason], rz.event_message(
                    f"Pod resize {reason}", pod, generation, message))
        return reason

    # -- deciding --

    def _decide(self, uid: str, pod: Pod) -> None:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            self._ended.add(uid)  # it ran its course: nothing to admit
            return
        if self.running(uid):
            # it runs already (an agent that restarted finds it): it keeps what it has
            node = self.node_info()
            failures = general_predicates(pod, node, list(self.admitted.values())) \
                if node is not None else []
            if failures:
                r = failures[0].rejection()
                log.warning("pod %s runs on node %s, which would not admit it now (%s: "
                            "%s); it keeps running", describe(pod), self.node, r.reason,
                            r.message)
            self.admitted[uid] = hold(pod)
            return
        refused = admit(pod, self.settings)
        if refused is not None:
            self._rejected[uid] = refused
            return
        node = self.node_info()
        if node is None:
            self._rejected[uid] = INVALID_NODE_INFO
            return
        failures = general_predicates(pod, node, list(self.admitted.values()))
        if failures and is_critical(pod):
            other: list[Failure] = [f for f in failures if isinstance(f, Unmatched)]
            if not other:
                self._preempt(uid, pod, [(f.resource, f.short()) for f in failures
                                         if isinstance(f, Insufficient)])
                return
            failures = other
        if failures:
            self._rejected[uid] = failures[0].rejection()
        else:
            self.admitted[uid] = hold(pod)

    def _preempt(self, uid: str, pod: Pod, needs: Needs) -> None:
        """Admit the critical `pod` in place of pods of lower priority, stopped first."""
        candidates = [h.pod for u, h in self.admitted.items() if u not in self._stopping]
        try:
            victims = pods_to_preempt(pod, candidates, needs)
        except PreemptionError as e:
            self._rejected[uid] = Rejection(
                "UnexpectedAdmissionError", "Unexpected error while attempting to recover "
                f"from admission failure: preemption: error finding a set of pods to "
                f"preempt: {e}")
            return
        self.admitted[uid] = hold(pod)
        if not victims:
            return
        self._preemptor = uid
        for v in victims:
            self._stopping.add(str(v["metadata"]["uid"]))
            log.info("node %s: preempting pod %s to admit the critical pod %s (short of "
                     "%s)", self.node, describe(v), describe(pod), _needs_text(needs))
            if self.events is not None:
                self.events.pod(v, WARNING, PREEMPTED.reason, PREEMPTED.message)
            if self.on_preempt is not None:
                self.on_preempt(v, PREEMPTED)
