"""A pod's resources as the kubelet sums them, its QoS class, and its containers' OOM
score adjustments.

- Requests and limits per pod: the regular containers add up; an init container runs
  alone (with the sidecars started before it), so the pod needs the larger of the two;
  sidecars (init containers with restartPolicy Always) run with everything and add up;
  spec.overhead (from the RuntimeClass) is added to the requests, and to the limits
  that are set.
- A container's missing request defaults to its limit, as the API server defaults it
  (static pods are not defaulted by an API server; the kubelet defaults them the same).
- The QoS class: status.qosClass when the API server set it, else computed: BestEffort
  without any CPU or memory request or limit, Guaranteed when every container limits
  both and the requests equal the limits, Burstable otherwise.
- OOM score adjustment: Guaranteed and node-critical pods -997, BestEffort 1000,
  Burstable 1000 - 1000 * request / capacity, kept within [3, 999]; a sidecar no higher
  than the regular container that asks the least.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

from nodeagent.api.quantity import parse_quantity
from nodeagent.pods.podupdate import ANN_CONFIG_MIRROR, ANN_CONFIG_SOURCE, Pod

Amounts = dict[str, int]  # resource name -> amount: cpu in millicores, others in units

GUARANTEED_OOM_SCORE_ADJ = -997
BEST_EFFORT_OOM_SCORE_ADJ = 1000
# priorities from this one up are the system's (system-cluster-critical, -node-critical)
SYSTEM_CRITICAL_PRIORITY = 2_000_000_000
NODE_CRITICAL_CLASS = "system-node-critical"
HUGEPAGES_PREFIX = "hugepages-"


class QOSClass(enum.StrEnum):
    GUARANTEED = "Guaranteed"
    BURSTABLE = "Burstable"
    BEST_EFFORT = "BestEffort"


def amounts(values: Mapping[str, Any] | None, where: str) -> Amounts:
    """A resource list as whole amounts: CPU in millicores, the rest rounded up."""
    out: Amounts = {}
    for name, value in (values or {}).items():
        amount = _amount(name == "cpu", value) if isinstance(value, (str, int)) else None
        if amount is None:  # not a quantity: parsed again for the message naming it
            q = parse_quantity(value, f"{where}.{name}")
            amount = round(q * 1000) if name == "cpu" else math.ceil(q)
        out[str(name)] = amount
    return out


@functools.lru_cache(maxsize=4096)
def _amount(cpu: bool, value: str | int) -> int | None:
    """A quantity's whole amount (None: not a quantity). Kept: pods of a node mostly
    ask for the same few amounts, and a pod's are read several times in its sync."""
    try:
        q = parse_quantity(value)
    except ValueError:
        return None
    return round(q * 1000) if cpu else math.ceil(q)


def container_requests(c: Mapping[str, Any], where: str = "container") -> Amounts:
    """The container's requests, each missing one defaulting to its limit."""
    res = c.get("resources") or {}
    return {**amounts(res.get("limits"), f"{where}.resources.limits"),
            **amounts(res.get("requests"), f"{where}.resources.requests")}


def container_limits(c: Mapping[str, Any], where: str = "container") -> Amounts:
    return amounts((c.get("resources") or {}).get("limits"), f"{where}.resources.limits")


def _add(into: Amounts, more: Mapping[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def _max(into: Amounts, more: Mapping[str, int]) -> None:
    for k, v in more.items():
        if k not in into or v > into[k]:
            into[k] = v


def _aggregate(pod: Pod, of: Callable[[Mapping[str, Any], str], Amounts],
               seen: Callable[[Amounts], None] | None) -> Amounts:
    """The pod's containers' amounts summed the kubelet's way; `seen` is shown each
    regular container's amounts, and each init container's with the sidecars before it."""
    spec = pod.get("spec") or {}
    total: Amounts = {}
    for i, c in enumerate(spec.get("containers") or []):
        mine = of(c, f"spec.containers[{i}]")
        if seen is not None:
            seen(mine)
        _add(total, mine)
    sidecars: Amounts = {}
    init_peak: Amounts = {}
    for i, c in enumerate(spec.get("initContainers") or []):
        mine = of(c, f"spec.initContainers[{i}]")
        if c.get("restartPolicy") == "Always":
            _add(total, mine)
            _add(sidecars, mine)
            running = dict(sidecars)
        else:
            running = dict(mine)
            _add(running, sidecars)
        if seen is not None:
            seen(running)
        _max(init_peak, running)
    _max(total, init_peak)
    return total


def pod_requests(pod: Pod) -> Amounts:
    """What the pod asks for in all, its overhead included."""
    total = _aggregate(pod, container_requests, None)
    _add(total, amounts((pod.get("spec") or {}).get("overhead"), "spec.overhead"))
    return total


def pod_limits(pod: Pod, seen: Callable[[Amounts], None] | None = None) -> Amounts:
    """The pod's limits in all; the overhead is added to those that are set."""
    total = _aggregate(pod, container_limits, seen)
    for k, v in amounts((pod.get("spec") or {}).get("overhead"), "spec.overhead").items():
        if total.get(k):
            total[k] += v
    return total


def qos_class(pod: Pod) -> QOSClass:
    """status.qosClass when set, else computed from the containers' CPU and memory."""
    given = str((pod.get("status") or {}).get("qosClass") or "")
    if given in tuple(QOSClass):
        return QOSClass(given)
    spec = pod.get("spec") or {}
    requests: Amounts = {}
    limits: Amounts = {}
    guaranteed = True
    every = [(f"spec.{kind}[{i}]", c) for kind in ("containers", "initContainers")
             for i, c in enumerate(spec.get(kind) or [])]
    for where, c in every:
        req = {k: v for k, v in container_requests(c, where).items()
               if k in ("cpu", "memory") and v > 0}
        lim = {k: v for k, v in container_limits(c, where).items()
               if k in ("cpu", "memory") and v > 0}
        _add(requests, req)
        _add(limits, lim)
        if lim.keys() != {"cpu", "memory"}:
            guaranteed = False
    if not requests and not limits:
        return QOSClass.BEST_EFFORT
    if guaranteed and requests == limits:
        return QOSClass.GUARANTEED
    return QOSClass.BURSTABLE


def is_node_critical(pod: Pod) -> bool:
    """A critical pod (static, mirror, or of a system priority) of the
    system-node-critical class."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    annotations = meta.get("annotations") or {}
    source = annotations.get(ANN_CONFIG_SOURCE)
    critical = (source is not None and source != "api") or ANN_CONFIG_MIRROR in annotations \
        or int(spec.get("priority") or 0) >= SYSTEM_CRITICAL_PRIORITY
    return critical and spec.get("priorityClassName") == NODE_CRITICAL_CLASS


def oom_score_adj(pod: Pod, container: Mapping[str, Any], memory_capacity: int) -> int:
    """The OOM score adjustment the kubelet gives the container's processes."""
    if is_node_critical(pod):
        return GUARANTEED_OOM_SCORE_ADJ
    qos = qos_class(pod)
    if qos == QOSClass.GUARANTEED:
        return GUARANTEED_OOM_SCORE_ADJ
    if qos == QOSClass.BEST_EFFORT:
        return BEST_EFFORT_OOM_SCORE_ADJ
    if memory_capacity <= 0:
        raise ValueError("oom_score_adj: the node's memory capacity is unknown")
    spec = pod.get("spec") or {}
    adj = 1000 - 1000 * container_requests(container).get("memory", 0) // memory_capacity
    sidecar = container.get("restartPolicy") == "Always" and any(
        c.get("name") == container.get("name") for c in spec.get("initContainers") or [])
    regular = spec.get("containers") or []
    if sidecar and regular:
        least = min(container_requests(c).get("memory", 0) for c in regular)
        adj = min(adj, 1000 - 1000 * least // memory_capacity)
    # a Burstable container never ranks with Guaranteed ones, nor with BestEffort ones
    if adj < 1000 + GUARANTEED_OOM_SCORE_ADJ:
        return 1000 + GUARANTEED_OOM_SCORE_ADJ
    if adj == BEST_EFFORT_OOM_SCORE_ADJ:
        return adj - 1
    return adj


def hugepage_size(resource: str) -> int | None:
    """The page size in bytes of a hugepages-<size> resource name (None: another)."""
    if not resource.startswith(HUGEPAGES_PREFIX):
        return None
    return math.ceil(parse_quantity(resource[len(HUGEPAGES_PREFIX):], resource))
