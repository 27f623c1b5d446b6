"""NoSchedule taints by condition: the part of the controller manager's node-lifecycle
controller that keeps a Node's NoSchedule taints in step with its conditions (and
with spec.unschedulable). The API server's TaintNodesByCondition admission puts
`not-ready:NoSchedule` on every new Node; without this nothing would ever take it off.

Every taint here is NoSchedule; taints with other effects, or other keys, are never
touched. The unreachable key is the exception to "follow the condition": it is the
Lease verdict's (monitor.py), which is also what sets Ready=Unknown, so the two
cannot disagree about it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

NOT_READY = "node.kubernetes.io/not-ready"
UNREACHABLE = "node.kubernetes.io/unreachable"
UNSCHEDULABLE = "node.kubernetes.io/unschedulable"

# (condition type, status) -> taint key, effect NoSchedule. Any other status (a pressure
# condition that is False or Unknown, Ready True) calls for no taint.
BY_CONDITION: dict[tuple[str, str], str] = {
    ("Ready", "False"): NOT_READY,
    ("Ready", "Unknown"): UNREACHABLE,
    ("MemoryPressure", "True"): "node.kubernetes.io/memory-pressure",
    ("DiskPressure", "True"): "node.kubernetes.io/disk-pressure",
    ("PIDPressure", "True"): "node.kubernetes.io/pid-pressure",
    ("NetworkUnavailable", "True"): "node.kubernetes.io/network-unavailable",
}
CONDITIONS = frozenset(ctype for ctype, _ in BY_CONDITION)
_ORDER = tuple(sorted(CONDITIONS))
# NoSchedule taints with these keys are ours to add and remove.
MANAGED = frozenset(BY_CONDITION.values()) | {UNSCHEDULABLE}


def wanted(conditions: Mapping[str, Mapping[str, Any]], unschedulable: bool,
           present: Iterable[str] = ()) -> set[str]:
    """The NoSchedule taint keys a node's conditions (by type) call for.

    `present`: the NoSchedule keys the node has now. A node that has never posted a
    Ready condition keeps its not-ready taint (the one admission put there): nothing
    says it is ready yet. (The controller manager takes it off at once in that case,
    making a node schedulable before its kubelet has said a word.)"""
    keys = {key for (ctype, status), key in BY_CONDITION.items()
            if (conditions.get(ctype) or {}).get("status") == status}
    if unschedulable:
        keys.add(UNSCHEDULABLE)
    if "Ready" not in conditions and NOT_READY in present:
        keys.add(NOT_READY)
    return keys


def signature(conditions: Mapping[str, Mapping[str, Any]], unschedulable: bool
              ) -> tuple[Any, ...]:
    """What the taints depend on, to tell whether a Node update changes them."""
    return (unschedulable, *((conditions.get(c) or {}).get("status") for c in _ORDER))
