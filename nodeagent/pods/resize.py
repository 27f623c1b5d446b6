"""In-place pod resize (KEP-1287), as the kubelet of the pinned version does it.

A resize changes the CPU and memory of a running pod's resizable containers (the
regular ones and the sidecars) through the API's pods/resize subresource; the spec's
resources then say what is desired. Three states of a pod's resources:

- desired: the spec as the API has it;
- allocated: what the node admitted. admission.py's NodeAdmission holds it and
  allocates a resize when it fits beside the node's other pods; until then the pod
  runs as allocated. A resize that can never fit the node is PodResizePending with
  reason Infeasible; one that may fit once room frees up is PodResizePending with
  reason Deferred, and is tried again when pods leave the node or resize;
- applied: what each running container was given, at its creation (the annotation
  runtime.base.ANNOTATION_RESOURCES) and then by each in-place update
  (containers.py records those).

A sync compares allocated with applied (decide.py): a resource whose resizePolicy says
RestartContainer restarts the container; the others are updated in place (syncer.py:
memory, then CPU; for each, the pod cgroup's values that grow first, the containers'
decreases before their increases, then the pod cgroup's values that shrink). While
applied differs from allocated for a running container, the pod has
PodResizeInProgress; its reason is Error, with the runtime's message, when an update
failed.

Here: the pure parts (which containers resize, what changed, the allocated pod), the
store of the two conditions (the kubelet's status manager keeps them) and the
messages of the kubelet's resize Events.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nodeagent.pods.podstatus import is_sidecar
from nodeagent.pods.podupdate import Pod
from nodeagent.pods.resources import Amounts, amounts
from nodeagent.runtime.base import ANNOTATION_RESOURCES, Container, Resources, resources_of

Spec = Mapping[str, Any]

PENDING = "PodResizePending"
IN_PROGRESS = "PodResizeInProgress"
INFEASIBLE, DEFERRED, ERROR = "Infeasible", "Deferred", "Error"
RESTART_CONTAINER = "RestartContainer"
CPU, MEMORY = "cpu", "memory"
# the kubelet's Events of a resize: Normal, Normal, Warning, Warning, Warning
STARTED, COMPLETED, ERRORED = "ResizeStarted", "ResizeCompleted", "ResizeError"
PENDING_EVENTS = {DEFERRED: "ResizeDeferred", INFEASIBLE: "ResizeInfeasible"}
STATIC_POD = "In-place resize of static-pods is not supported"


def resizable(pod: Pod) -> list[Spec]:
    """The containers whose resources a resize may change: the regular ones and the
    sidecars (init containers with restartPolicy Always)."""
    spec = pod.get("spec") or {}
    return [*(c for c in spec.get("initContainers") or [] if is_sidecar(c)),
            *(spec.get("containers") or [])]


def requirements(container: Spec) -> tuple[Amounts, Amounts]:
    """A container's requests and limits as amounts, to compare them by value
    ("1" and "1000m" are the same CPU)."""
    res = container.get("resources") or {}
    return amounts(res.get("requests")), amounts(res.get("limits"))


def with_allocation(pod: Pod, allocated: Pod) -> Pod:
    """`pod` with each resizable container's resources as `allocated` has them (the
    kubelet's UpdatePodFromAllocation); `pod` itself when they are the same."""
    given = {str(c.get("name")): c for c in resizable(allocated)}
    changed = {}
    for c in resizable(pod):
        had = given.get(str(c.get("name")))
        if had is not None and requirements(had) != requirements(c):
            changed[str(c.get("name"))] = had.get("resources") or {}
    if not changed:
        return pod
    spec = dict(pod.get("spec") or {})
    for kind in ("initContainers", "containers"):
        if spec.get(kind):
            spec[kind] = [{**c, "resources": changed[c.get("name")]}
                          if c.get("name") in changed else c for c in spec[kind]]
    return {**pod, "spec": spec}


# --- what a running container was given ------------------------------------------------

def _cpu(r: Resources) -> tuple[int, int]:
    return r.cpu_request_millis or 0, r.cpu_limit_millis or 0


def _memory(r: Resources) -> tuple[int, int]:
    return r.memory_request_bytes or 0, r.memory_limit_bytes or 0


def applied(container: Container, updated: Mapping[str, Resources]) -> Resources | None:
    """What the running `container` was given: its last in-place update (`updated`, by
    container id), else what it was made with; None when neither is known (made by an
    agent that did not record it)."""
    if container.id in updated:
        return updated[container.id]
    return Resources.decode(container.annotations.get(ANNOTATION_RESOURCES, ""))


def reported(container: Container, updated: Mapping[str, Resources]) -> Resources | None:
    """What the running `container` was given as its status reports it: what the
    runtime says it applied, completed by what the agent applied (the memory request,
    which no cgroup holds; everything, for a runtime that says nothing)."""
    mine = applied(container, updated)
    theirs = container.resources
    if theirs is None or mine is None:
        return theirs or mine
    return Resources(*(t if t is not None else m for t, m in zip(
        (theirs.cpu_request_millis, theirs.cpu_limit_millis, theirs.memory_request_bytes,
         theirs.memory_limit_bytes),
        (mine.cpu_request_millis, mine.cpu_limit_millis, mine.memory_request_bytes,
         mine.memory_limit_bytes), strict=True)))


class ResizeRefused(Exception):
    """A resize the node will not carry out now (a memory limit below what is used);
    the message is the kubelet's."""


def changed(want: Resources, have: Resources) -> tuple[str, ...]:
    """The resources ("memory", "cpu") whose request or limit differ, a missing value
    counting as 0 (the kubelet's comparison)."""
    return tuple(name for name, part in ((MEMORY, _memory), (CPU, _cpu))
                 if part(want) != part(have))


def restarts_for(container: Spec, resources: Sequence[str]) -> bool:
    """Whether the container's resizePolicy says RestartContainer for one of
    `resources` (a resource it names no policy for: NotRequired)."""
    policy = {p.get("resourceName"): p.get("restartPolicy")
              for p in container.get("resizePolicy") or []}
    return any(policy.get(r) == RESTART_CONTAINER for r in resources)


def with_resource(have: Resources, want: Resources, resource: str) -> Resources:
    """`have` with `resource`'s request and limit taken from `want`: one update changes
    one resource (the kubelet's), the other stays as last applied."""
    if resource == MEMORY:
        return replace(have, memory_request_bytes=want.memory_request_bytes,
                       memory_limit_bytes=want.memory_limit_bytes)
    return replace(have, cpu_request_millis=want.cpu_request_millis,
                   cpu_limit_millis=want.cpu_limit_millis)


def grows(want: Resources, have: Resources, resource: str) -> bool:
    """Whether the update of `resource` increases it (by its limit when that changes,
    else by its request): increases are applied after decreases."""
    w, h = (_memory if resource == MEMORY else _cpu)(want), \
        (_memory if resource == MEMORY else _cpu)(have)
    return w[1] > h[1] if w[1] != h[1] else w[0] > h[0]


def wanted(container: Spec) -> Resources:
    """The container's CPU and memory as the spec (as allocated) gives them."""
    return resources_of(container, f"container {container.get('name')}")


# --- the conditions ---------------------------------------------------------------------

@dataclass(frozen=True)
class ResizeCondition:
    """A PodResizePending or PodResizeInProgress condition (status True), as the
    kubelet's status manager keeps it; rendered with its times by podstatus.py."""
    type: str
    reason: str = ""
    message: str = ""
    generation: int = 0


class ResizeConditions:
    """Each pod's resize conditions: PodResizePending (the node's allocation sets it)
    and PodResizeInProgress (the sync sets and clears it)."""

    def __init__(self) -> None:
        self._pods: dict[str, dict[str, ResizeCondition]] = {}

    def of(self, uid: str) -> tuple[ResizeCondition, ...]:
        held = self._pods.get(uid) or {}
        return tuple(held[t] for t in (PENDING, IN_PROGRESS) if t in held)

    def get(self, uid: str, ctype: str) -> ResizeCondition | None:
        return (self._pods.get(uid) or {}).get(ctype)

    def set_pending(self, uid: str, reason: str, message: str, generation: int) -> bool:
        """Set PodResizePending; whether its reason or generation changed (then the
        kubelet writes an Event)."""
        old = self.get(uid, PENDING)
        self._pods.setdefault(uid, {})[PENDING] = ResizeCondition(PENDING, reason, message,
                                                                  generation)
        return old is None or (old.reason, old.generation) != (reason, generation)

    def set_in_progress(self, uid: str, reason: str, message: str,
                        generation: int) -> tuple[int, bool]:
        """Set PodResizeInProgress, keeping the generation of one set already (and its
        reason and message when none is given); its generation, and whether it
        changed."""
        old = self.get(uid, IN_PROGRESS)
        if old is not None:
            if not reason and not message:
                reason, message = old.reason, old.message
            generation = old.generation
        new = ResizeCondition(IN_PROGRESS, reason, message, generation)
        self._pods.setdefault(uid, {})[IN_PROGRESS] = new
        return generation, new != old

    def clear_pending(self, uid: str) -> None:
        self._drop(uid, PENDING)

    def clear_in_progress(self, uid: str) -> tuple[int, bool]:
        """Clear PodResizeInProgress: the generation it had, and whether there was one."""
        old = self._drop(uid, IN_PROGRESS)
        return (old.generation, True) if old is not None else (0, False)

    def _drop(self, uid: str, ctype: str) -> ResizeCondition | None:
        held = self._pods.get(uid)
        old = held.pop(ctype, None) if held else None
        if held is not None and not held:
            del self._pods[uid]
        return old

    def backfill(self, pod: Pod) -> None:
        """The conditions the API's status of `pod` holds, for an agent that starts with
        the pod already there (nothing is known of it yet)."""
        uid = str(pod["metadata"]["uid"])
        if uid in self._pods:
            return
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") in (PENDING, IN_PROGRESS) and c.get("status") == "True":
                self._pods.setdefault(uid, {})[c["type"]] = ResizeCondition(
                    c["type"], str(c.get("reason") or ""), str(c.get("message") or ""),
                    int(c.get("observedGeneration") or 0))

    def forget(self, uid: str) -> None:
        self._pods.pop(uid, None)


# --- the Events' messages ---------------------------------------------------------------

def _summary(pod: Pod, generation: int, error: str) -> str:
    """The pod's containers' resources, as the kubelet's resize Events give them (Go's
    JSON: keys in its order, maps sorted, empty ones left out, <, > and & escaped)."""
    def of(c: Spec) -> dict[str, Any]:
        res = c.get("resources") or {}
        kept = {k: dict(sorted(res[k].items())) for k in ("limits", "requests")
                if res.get(k)}
        return {"name": c.get("name"), "resources": kept}
    spec = pod.get("spec") or {}
    out: dict[str, Any] = {}
    if spec.get("initContainers"):
        out["initContainers"] = [of(c) for c in spec["initContainers"]]
    if spec.get("containers"):
        out["containers"] = [of(c) for c in spec["containers"]]
    out["generation"] = generation
    if error:
        out["error"] = error
    text = json.dumps(out, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def event_message(prefix: str, pod: Pod, generation: int, error: str = "") -> str:
    """"Pod resize started: {...}" and its kin: `prefix`, then the resources of `pod`
    (the allocated pod, or the desired one for a pending resize)."""
    return f"{prefix}: {_summary(pod, generation, error)}"
