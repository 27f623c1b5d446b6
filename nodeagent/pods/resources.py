"""What a pod asks of its node, counted as the kubelet counts it: its effective resource
requests, its QoS class and its priority.

Amounts are whole numbers, as the scheduler's arithmetic has them: millicores for
`cpu`, rounded-up units for everything else (bytes, pods, devices).

The effective requests of a pod (what admission fits against the node's allocatable):
- a container's request for a resource is its `requests` entry, else its `limits`
  entry (the API server's defaulting, which static pods do not go through);
- the regular containers and the sidecars (init containers with restartPolicy Always)
  run together: their requests add up;
- an init container runs beside the sidecars declared before it: the pod needs, per
  resource, at least the largest of those sums;
- pod-level requests (`spec.resources`), where set, replace the containers' sum for
  cpu, memory and hugepages;
- `spec.overhead` (the RuntimeClass's cost of the sandbox) is added on top.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from nodeagent.api.quantity import QuantityError, parse_quantity
from nodeagent.pods.podstatus import is_sidecar
from nodeagent.pods.podupdate import Pod, is_mirror, is_static

Amounts = dict[str, int]

CPU, MEMORY, EPHEMERAL, PODS = "cpu", "memory", "ephemeral-storage", "pods"
HUGEPAGES = "hugepages-"
# a priority this high marks a pod critical (the system-*-critical classes)
CRITICAL_PRIORITY = 2_000_000_000
# the built-in priority classes, for a pod whose priority the API server has not
# resolved (a static pod)
SYSTEM_PRIORITIES = {"system-node-critical": 2_000_001_000,
                     "system-cluster-critical": 2_000_000_000}


def amount(name: str, value: object) -> int | None:
    """A quantity as a whole number: millicores for cpu, else rounded up; None when it
    is not a quantity (the API server refuses those; a static pod's bad cpu or memory
    is refused by name when its container's config is built)."""
    try:
        q = parse_quantity(value, name)
    except QuantityError:
        return None
    return round(q * 1000) if name == CPU else math.ceil(q)


def amounts(resources: Mapping[str, Any] | None) -> Amounts:
    """A resource list (`{"cpu": "500m", ...}`) as amounts; what does not parse is left
    out."""
    out: Amounts = {}
    for name, value in (resources or {}).items():
        n = amount(str(name), value)
        if n is not None:
            out[str(name)] = n
    return out


def is_native(name: str) -> bool:
    """In the kubernetes.io namespace: an unprefixed name, or one under kubernetes.io/."""
    return "/" not in name or "kubernetes.io/" in name


def is_extended(name: str) -> bool:
    """An extended resource (example.com/foo): advertised by someone other than the
    kubelet (a device plugin, an admin patching the Node's status)."""
    return not is_native(name) and not name.startswith("requests.")


def is_scalar(name: str) -> bool:
    """Counted by name beside cpu, memory, ephemeral-storage and pods: extended
    resources, hugepages, other kubernetes.io/ names, attachable volumes."""
    return (is_extended(name) or name.startswith(HUGEPAGES) or "kubernetes.io/" in name
            or name.startswith("attachable-volumes-"))


def counted(name: str) -> bool:
    """Whether admission fits this resource against the node (other names in a
    request, such as `storage`, are not the node's to count)."""
    return name in (CPU, MEMORY, EPHEMERAL) or is_scalar(name)


def _add(into: Amounts, more: Mapping[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def _max(into: Amounts, other: Mapping[str, int]) -> None:
    for k, v in other.items():
        if v > into.get(k, 0):
            into[k] = v


def container_requests(c: Mapping[str, Any]) -> Amounts:
    """A container's requests, its limits standing in where a request is not set."""
    res = c.get("resources") or {}
    return {**amounts(res.get("limits")), **amounts(res.get("requests"))}


def _level_resource(name: str) -> bool:
    return name in (CPU, MEMORY) or name.startswith(HUGEPAGES)


def _pod_level(spec: Mapping[str, Any], containers: Mapping[str, int]) -> Amounts:
    """spec.resources' requests, of the resources it may set; where one is not given,
    its limit stands in when the containers request none of it (the API server's
    defaulting)."""
    res = spec.get("resources") or {}
    out = {k: v for k, v in amounts(res.get("requests")).items() if _level_resource(k)}
    for k, v in amounts(res.get("limits")).items():
        if _level_resource(k) and k not in out and (k.startswith(HUGEPAGES)
                                                    or k not in containers):
            out[k] = v
    return out


def pod_requests(pod: Pod, keep: Callable[[str], bool] = lambda _name: True, *,
                 overhead: bool = True) -> Amounts:
    """The pod's effective requests (see the module docstring). `keep`: which
    resources of the containers' requests count (admission leaves out the extended
    resources its node does not have); `overhead`: add spec.overhead."""
    spec = pod.get("spec") or {}

    def of(c: Mapping[str, Any]) -> Amounts:
        return {k: v for k, v in container_requests(c).items() if keep(k)}
    total: Amounts = {}
    for c in spec.get("containers") or []:
        _add(total, of(c))
    sidecars: Amounts = {}
    peak: Amounts = {}  # the most any init container needs, with the sidecars before it
    for c in spec.get("initContainers") or []:
        mine = of(c)
        if is_sidecar(c):
            _add(total, mine)
            _add(sidecars, mine)
            _max(peak, sidecars)
        else:
            with_sidecars = dict(sidecars)
            _add(with_sidecars, mine)
            _max(peak, with_sidecars)
    _max(total, peak)
    total.update(_pod_level(spec, total))
    if overhead:
        _add(total, amounts(spec.get("overhead")))
    return total


def request_of(pod: Pod, name: str) -> int:
    """What the pod holds of one resource, as preemption weighs it: one for `pods`; else
    its requests, with spec.overhead added only where it requests some."""
    if name == PODS:
        return 1
    n = pod_requests(pod, overhead=False).get(name, 0)
    if n:
        n += amounts((pod.get("spec") or {}).get("overhead")).get(name, 0)
    return n


def qos_class(pod: Pod) -> str:
    """BestEffort, Burstable or Guaranteed: the API server's (status.qosClass), else
    computed as it computes it (a static pod's)."""
    given = (pod.get("status") or {}).get("qosClass")
    if given:
        return str(given)
    spec = pod.get("spec") or {}
    requests: Amounts = {}
    limits: Amounts = {}
    guaranteed = True
    level = spec.get("resources")
    if level:  # pod-level resources decide the class when set
        requests = {k: v for k, v in pod_requests(pod, overhead=False).items()
                    if k in (CPU, MEMORY) and v > 0}
        lim = level.get("limits")
        if lim:
            limits = {k: v for k, v in amounts(lim).items() if k in (CPU, MEMORY) and v > 0}
            guaranteed = {CPU, MEMORY} <= set(amounts(lim))
    else:
        for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
            res = c.get("resources") or {}
            req = {k: v for k, v in container_requests(c).items()
                   if k in (CPU, MEMORY) and v > 0}
            lim = {k: v for k, v in amounts(res.get("limits")).items()
                   if k in (CPU, MEMORY) and v > 0}
            _add(requests, req)
            _add(limits, lim)
            if set(lim) != {CPU, MEMORY}:
                guaranteed = False
    if not requests and not limits:
        return "BestEffort"
    if guaranteed and all(limits.get(k) == v for k, v in requests.items()) \
            and len(requests) == len(limits):
        return "Guaranteed"
    return "Burstable"


def priority(pod: Pod) -> int | None:
    """spec.priority; for a pod the API server has not resolved it for (a static pod),
    the value of a built-in priority class it names."""
    spec = pod.get("spec") or {}
    if spec.get("priority") is not None:
        return int(spec["priority"])
    return SYSTEM_PRIORITIES.get(str(spec.get("priorityClassName") or ""))


def is_critical(pod: Pod) -> bool:
    """A static (or mirror) pod, or one of critical priority: admission may preempt
    other pods to make room for it."""
    p = priority(pod)
    return is_static(pod) or is_mirror(pod) or (p is not None and p >= CRITICAL_PRIORITY)


def preemptable(preemptor: Pod, victim: Pod) -> bool:
    """Whether `preemptor` may take `victim`'s place: a critical pod may preempt a pod
    that is not; otherwise only a higher priority preempts a lower one."""
    if is_critical(preemptor) and not is_critical(victim):
        return True
    a, b = priority(preemptor), priority(victim)
    return a is not None and b is not None and a > b
