"""Pod status: computed from the pod spec and the runtime's view of the pod, written to
the API's pods/status subresource only when it changed.

`compute_pod_status` is a pure function (spec + runtime records + what the worker
decided -> the API's PodStatus JSON). `StatusManager` remembers what the API last
accepted per pod and PATCHes only differences, one sender per pod, latest wins,
retrying with backoff on API errors; a backoff under way ends when the API server
answers again (the ApiAnswered signal: the pod watch reconnected, a Lease renewal went
through, or a static pod's mirror pod was created).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.client import brief, invalid_fields, is_retriable, status_of
from nodeagent.api.clock import Clock, api_time
from nodeagent.api.kube import PODS, Kube, describe
from nodeagent.api.quantity import QuantityError, format_bytes, format_cpu, parse_quantity
from nodeagent.metrics import per_registry
from nodeagent.pods.podupdate import Pod, is_static
from nodeagent.runtime.base import (
    Container,
    ContainerState,
    PodRuntimeStatus,
    Resources,
    SandboxState,
)

if TYPE_CHECKING:  # resize.py imports this module
    from nodeagent.pods.resize import ResizeCondition

log = logging.getLogger(__name__)

Status = dict[str, Any]

# The status fields this agent owns; others (qosClass, nominatedNodeName, conditions of
# other writers) are left alone by the strategic merge patch.
OWNED = ("phase", "conditions", "containerStatuses", "initContainerStatuses",
         "ephemeralContainerStatuses", "hostIP", "hostIPs", "podIP", "podIPs", "startTime",
         "reason", "message", "observedGeneration")
# the conditions this agent writes (the kubelet's); any other type in a pod's status
# (readiness gates, DisruptionTarget) belongs to someone else and is never written,
# but for the DisruptionTarget of a pod the node itself stopped (Ending), written once
CONDITION_TYPES = ("PodReadyToStartContainers", "PodScheduled", "Initialized",
                   "ContainersReady", "Ready", "PodResizePending", "PodResizeInProgress")
# ours that come and go: one no longer in the status is deleted from the API's
TRANSIENT_CONDITIONS = ("PodResizePending", "PodResizeInProgress")
# at or below these the runtime's CPU values are not told from the spec's (the least
# CPU quota, 10m; the least CPU shares, 2): the spec's are reported
MIN_CPU_LIMIT_MILLIS = 10
MIN_CPU_REQUEST_MILLIS = 2
TERMINAL = ("Succeeded", "Failed")
# a strategic merge patch's directive: the list it heads replaces the one stored
REPLACE = {"$patch": "replace"}
# the state of a container that ran and that the runtime no longer knows
GONE = {"exitCode": 137, "reason": "ContainerStatusUnknown",
        "message": "The container could not be located; it used to be running"}


@dataclass(frozen=True)
class Waiting:
    """Why a container is not running, as decided by the pod worker."""
    reason: str
    message: str = ""


DISRUPTED_BY_NODE = "TerminationByKubelet"  # the DisruptionTarget reason of an Ending


@dataclass(frozen=True)
class Ending:
    """How a pod the node itself stops ends (preempted for a critical pod, evicted,
    stopped for a shutdown): phase Failed with this reason and message and, with
    `disruption`, a DisruptionTarget condition (reason TerminationByKubelet) with that
    message; written when the stop begins and kept as its final status.
    `remove_content`: once stopped, its containers and volumes are removed (an
    eviction's)."""
    reason: str
    message: str
    disruption: str = ""
    remove_content: bool = False


@dataclass(frozen=True)
class Probed:
    """A container's started and ready as its probes say (containers without probes
    are both as soon as they run)."""
    started: bool
    ready: bool


def is_sidecar(container: Mapping[str, Any]) -> bool:
    """A restartable init container (restartPolicy Always in initContainers)."""
    return container.get("restartPolicy") == "Always"


def rfc3339(t: dt.datetime | None) -> str | None:
    if t is None:
        return None
    return api_time(t)


def _terminated(c: Container, scheme: str, messages: Mapping[str, str]) -> dict[str, Any]:
    code = c.exit_code if c.exit_code is not None else 0
    out: dict[str, Any] = {"exitCode": code,
                           "reason": c.reason or ("Completed" if code == 0 else "Error"),
                           "startedAt": rfc3339(c.started_at or c.created_at),
                           "finishedAt": rfc3339(c.finished_at),
                           "containerID": f"{scheme}://{c.id}"}
    # the runtime's message, then what the container left (the kubelet joins them)
    message = ": ".join(m for m in (c.message, messages.get(c.id, "")) if m)
    if message:
        out["message"] = message
    return out


def _amount(value: Any, cpu: bool) -> int | None:
    try:
        q = parse_quantity(value)
    except QuantityError:
        return None
    return round(q * 1000) if cpu else round(q)


def _resources(spec: Mapping[str, Any], cur: Container,
               applied: Resources | None) -> dict[str, Any]:
    """A container's status `resources`, as the kubelet reports them: its allocated
    requests and limits, and for one running what the runtime applied in their place
    (`applied`; the CPU's only where it can be told from the allocated value)."""
    res = spec.get("resources") or {}
    out = {k: dict(res[k]) for k in ("limits", "requests") if res.get(k)}
    if cur.state != ContainerState.RUNNING or applied is None:
        return out

    def put(kind: str, name: str, value: int | None, least: int = -1) -> None:
        had = out.get(kind)
        if had is None or value is None:
            return
        before = _amount(had.get(name, 0), name == "cpu")
        if value != before and (value > least or (before or 0) > least):
            had[name] = format_cpu(value / 1000) if name == "cpu" else format_bytes(value)
    put("limits", "cpu", applied.cpu_limit_millis, MIN_CPU_LIMIT_MILLIS)
    put("limits", "memory", applied.memory_limit_bytes)
    put("requests", "cpu", applied.cpu_request_millis, MIN_CPU_REQUEST_MILLIS)
    put("requests", "memory", applied.memory_request_bytes)
    return out


def ran_its_course(previous: Mapping[str, Any], name: str, policy: str) -> bool:
    """The status says the container ran, and by the restart policy it does not run
    again: with Never, it started at all (running or terminated, now or before); with
    OnFailure, it exited 0. For a container the runtime has no record of (a runtime
    that lost the pod, a reboot): a run-once container that ran must not run twice (the
    kubelet's rule too: "ran" is not "never ran"); its status says how it ended, or
    that it could not be found. One only created (an id, waiting) never ran."""
    if policy == "Always":
        return False
    for s in previous.get("containerStatuses") or []:
        if s.get("name") == name and s.get("containerID"):
            state = s.get("state") or {}
            ended = state.get("terminated")
            ran = "running" in state or ended is not None or \
                "terminated" in (s.get("lastState") or {})
            return ran and (policy == "Never"
                            or (ended is not None and ended.get("exitCode") == 0))
    return False


def _container_statuses(specs: list[Mapping[str, Any]], rs: PodRuntimeStatus, *,
                        scheme: str, waiting: Mapping[str, Waiting],
                        previous: Mapping[str, Any], default_reason: str,
                        probed: Mapping[str, Probed], messages: Mapping[str, str],
                        applied: Mapping[str, Resources]) -> list[dict[str, Any]]:
    out = []
    for spec in specs:
        name = spec["name"]
        attempts = sorted((c for c in rs.containers if c.name == name),
                          key=lambda c: (c.attempt, c.created_at or dt.datetime.min.replace(
                              tzinfo=dt.UTC)), reverse=True)
        cur = attempts[0] if attempts else None
        older = next((c for c in attempts[1:] if c.state == ContainerState.EXITED), None)
        st: dict[str, Any] = {"name": name, "image": spec.get("image", ""), "imageID": "",
                              "ready": False, "started": False, "restartCount": 0,
                              "lastState": {}}
        w = waiting.get(name)
        if cur is None:
            st["state"] = {"waiting": {"reason": w.reason if w else default_reason,
                                       **({"message": w.message} if w and w.message else {})}}
        else:
            st["containerID"] = f"{scheme}://{cur.id}"
            st["imageID"] = cur.image_id
            st["restartCount"] = cur.restart_count
            st["resources"] = _resources(spec, cur, applied.get(cur.id))
            requests = (spec.get("resources") or {}).get("requests")
            if requests:
                st["allocatedResources"] = dict(requests)
            if cur.state == ContainerState.RUNNING:
                st["state"] = {"running": {"startedAt": rfc3339(cur.started_at)}}
                p = probed.get(cur.id, Probed(True, True))
                st["started"], st["ready"] = p.started, p.started and p.ready
            elif cur.state == ContainerState.EXITED and w is not None:
                # exited and waiting to be restarted (e.g. CrashLoopBackOff)
                st["state"] = {"waiting": {"reason": w.reason,
                                           **({"message": w.message} if w.message else {})}}
                st["lastState"] = {"terminated": _terminated(cur, scheme, messages)}
            elif cur.state == ContainerState.EXITED:
                st["state"] = {"terminated": _terminated(cur, scheme, messages)}
            else:  # CREATED or UNKNOWN
                st["state"] = {"waiting": {"reason": w.reason if w else "ContainerCreating",
                                           **({"message": w.message} if w and w.message
                                              else {})}}
            if not st["lastState"] and older is not None:
                st["lastState"] = {"terminated": _terminated(older, scheme, messages)}
        if not st["lastState"]:
            # the runtime may have removed the old attempt; keep what we reported before
            prev = previous.get(name) or {}
            if prev.get("restartCount") == st["restartCount"] and prev.get("lastState"):
                st["lastState"] = prev["lastState"]
        out.append(st)
    return out


def _phase(pod: Pod, init_done: bool, statuses: list[dict[str, Any]], terminal: bool,
           init_failed: bool, sidecars: list[dict[str, Any]]) -> str:
    policy = (pod.get("spec") or {}).get("restartPolicy") or "Always"
    if init_failed:
        return "Failed"
    if not init_done:
        return "Pending"
    running = waiting = stopped = succeeded = failed = 0
    for st in sidecars:  # a running sidecar keeps the pod Running; a stopped one is
        # not the pod's outcome
        if "running" in st["state"]:
            running += 1
        elif "waiting" in st["state"] and not st.get("lastState", {}).get("terminated"):
            waiting += 1
    for st in statuses:
        state = st["state"]
        if "running" in state:
            running += 1
        elif "terminated" in state:
            stopped += 1
            if state["terminated"]["exitCode"] == 0:
                succeeded += 1
            else:
                failed += 1
        elif st.get("lastState", {}).get("terminated"):
            stopped += 1  # waiting to restart: it did run
            if st["lastState"]["terminated"]["exitCode"] == 0:
                succeeded += 1
            else:
                failed += 1
        else:
            waiting += 1
    if waiting and not terminal:
        return "Pending"
    if running and not terminal:
        return "Running"
    if terminal:
        if running or waiting:
            return "Failed"
        return "Failed" if failed else "Succeeded"
    if stopped:
        if policy == "Always" or (policy == "OnFailure" and failed):
            return "Running"
        return "Failed" if failed else "Succeeded"
    return "Pending"


def _condition(ctype: str, ok: bool, previous: Mapping[str, Mapping[str, Any]], now: str,
               reason: str = "", message: str = "") -> dict[str, Any]:
    status = "True" if ok else "False"
    prev = previous.get(ctype) or {}
    since = prev.get("lastTransitionTime") if prev.get("status") == status else None
    # reason and message are always present, None when they do not apply: the
    # strategic merge patch merges conditions by type, so an omitted key would keep
    # the old reason ("ContainersNotReady") on a condition that turned True
    c: dict[str, Any] = {"type": ctype, "status": status, "lastProbeTime": None,
                         "lastTransitionTime": since or now,
                         "reason": reason if (not ok or reason == "PodCompleted") and reason
                         else None,
                         "message": message if not ok and message else None}
    return c


def _resize_condition(r: ResizeCondition, previous: Mapping[str, Mapping[str, Any]],
                      now: str) -> dict[str, Any]:
    """A resize condition with its times: the transition when its reason changed, the
    probe when anything of it did."""
    prev = previous.get(r.type) or {}
    same = prev.get("status") == "True" and (prev.get("reason") or "") == r.reason
    unchanged = same and (prev.get("message") or "") == r.message and \
        int(prev.get("observedGeneration") or 0) == r.generation
    return {"type": r.type, "status": "True",
            "lastProbeTime": prev.get("lastProbeTime") if unchanged else now,
            "lastTransitionTime": prev.get("lastTransitionTime") if same else now,
            "observedGeneration": r.generation or None, "reason": r.reason or None,
            "message": r.message or None}


def compute_pod_status(pod: Pod, rs: PodRuntimeStatus, *, host_ip: str, scheme: str,
                       now: dt.datetime, waiting: Mapping[str, Waiting] | None = None,
                       previous: Status | None = None, terminal: bool = False,
                       probed: Mapping[str, Probed] | None = None,
                       messages: Mapping[str, str] | None = None,
                       reason: str | None = None, message: str | None = None,
                       ending: Ending | None = None,
                       applied: Mapping[str, Resources] | None = None,
                       resize: Sequence[ResizeCondition] = ()) -> Status:
    """The pod's status in API JSON form. `previous` is the last status we (or the API)
    had, for startTime, transition times and terminal phases. `terminal`: the worker
    has stopped the pod for good (deleted, or finished), so no container will restart.
    `probed`: started/ready by container id for containers with probes; `messages`:
    termination messages by container id; `reason`/`message`: the pod's own (e.g.
    DeadlineExceeded), kept once the phase is terminal; `ending`: the node itself stops
    (or stopped) the pod: Failed with the Ending's reason, unless it had ended already;
    `applied`: the CPU and memory each running container was given, by container id
    (its status `resources`; `pod` holds the allocated ones); `resize`: the pod's
    resize conditions (left out once it ended)."""
    spec = pod.get("spec") or {}
    previous = previous or {}
    waiting = waiting or {}
    if previous.get("phase") in TERMINAL and not rs.containers:
        # ended, and the runtime holds nothing of it (it never ran: rejected by
        # admission; or what ran was removed since: evicted, collected): it stays as it
        # was
        return {k: previous[k] for k in OWNED if k in previous}
    stamp = rfc3339(now)
    assert stamp is not None
    prev_cs = {s["name"]: s for s in previous.get("containerStatuses") or []}
    prev_ics = {s["name"]: s for s in previous.get("initContainerStatuses") or []}
    prev_ecs = {s["name"]: s for s in previous.get("ephemeralContainerStatuses") or []}
    prev_cond = {c["type"]: c for c in previous.get("conditions") or []}

    probed = probed or {}
    messages = messages or {}
    applied = applied or {}
    inits = spec.get("initContainers") or []
    init_statuses = _container_statuses(inits, rs, scheme=scheme, waiting=waiting,
                                        previous=prev_ics, default_reason="PodInitializing",
                                        probed=probed, messages=messages, applied=applied)
    sidecar_names = {c["name"] for c in inits if is_sidecar(c)}
    for s in init_statuses:
        if s["name"] not in sidecar_names:  # a finished init container is "ready"
            s["ready"] = "terminated" in s["state"] and \
                s["state"]["terminated"]["exitCode"] == 0
    statuses = _container_statuses(spec.get("containers") or [], rs, scheme=scheme,
                                   waiting=waiting, previous=prev_cs,
                                   default_reason="PodInitializing", probed=probed,
                                   messages=messages, applied=applied)
    in_runtime = {c.name for c in rs.containers}
    policy = spec.get("restartPolicy") or "Always"
    for s in statuses:
        before = prev_cs.get(s["name"]) or {}
        if s["name"] not in in_runtime and ran_its_course(previous, s["name"], policy):
            # it ran, the runtime lost it, and it will not run again: it ended as the
            # status said, or (it was running) in a way nobody saw
            s.update(containerID=before["containerID"], imageID=before.get("imageID", ""),
                     restartCount=before.get("restartCount", 0),
                     state=before["state"] if "terminated" in (before.get("state") or {})
                     else {"terminated": GONE})
    ephemerals = spec.get("ephemeralContainers") or []
    # an ephemeral container is never restarted: once it ran, nothing keeps it waiting
    ran = {c.name for c in rs.containers}
    ephemeral_statuses = _container_statuses(
        ephemerals, rs, scheme=scheme, previous=prev_ecs,
        waiting={k: w for k, w in waiting.items() if k not in ran},
        default_reason="PodInitializing", probed={}, messages=messages, applied=applied)
    for s in ephemeral_statuses:  # neither probed nor counted as ready (the kubelet's)
        s["ready"] = False
        del s["started"]
        before = prev_ecs.get(s["name"]) or {}
        if s["name"] not in ran and before.get("containerID"):
            # it ran, and the runtime no longer has it: it ended (the API refuses an
            # ephemeral container's status going back from terminated)
            s.update(containerID=before["containerID"], imageID=before.get("imageID", ""),
                     state=before["state"] if "terminated" in (before.get("state") or {})
                     else {"terminated": GONE})
    # initialized: each init container done (a sidecar: started), or any regular
    # container already ran (init containers may have been removed since)
    not_init = [s["name"] for s in init_statuses
                if not (s["started"] if s["name"] in sidecar_names else s["ready"])]
    init_done = not not_init or any(
        "waiting" not in s["state"] or s.get("lastState", {}).get("terminated")
        for s in statuses)
    if not init_done and (prev_cond.get("Initialized") or {}).get("status") == "True":
        init_done = True
    if init_done:
        for s in [*statuses, *ephemeral_statuses]:
            w = s["state"].get("waiting")
            if w and w.get("reason") == "PodInitializing":
                w["reason"] = "ContainerCreating"
    policy = spec.get("restartPolicy") or "Always"
    init_failed = policy == "Never" and any(
        "terminated" in s["state"] and s["state"]["terminated"]["exitCode"] != 0
        for s in init_statuses if s["name"] not in sidecar_names)

    sidecars = [s for s in init_statuses if s["name"] in sidecar_names]
    phase = _phase(pod, init_done, statuses, terminal, init_failed, sidecars)
    if ending is not None and previous.get("phase") in TERMINAL \
            and previous.get("reason") != ending.reason:
        ending = None  # it had ended by itself before the node stopped it
    if previous.get("phase") in TERMINAL:
        phase = previous["phase"]  # terminal phases never change back
    elif ending is not None:
        # Failed even when its containers exited 0 on being stopped: it did not end by
        # itself (the kubelet marks it when it starts stopping it)
        phase = "Failed"
    elif reason is not None:
        phase = "Failed"  # the pod was failed as a whole (e.g. its deadline passed)
    if ending is not None:
        reason, message = ending.reason, ending.message
    elif reason is None and phase in TERMINAL and previous.get("phase") in TERMINAL:
        reason, message = previous.get("reason"), previous.get("message")

    generation = (pod.get("metadata") or {}).get("generation")
    deleting = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
    # ContainersReady: every container (and sidecar) ready
    unready = [s["name"] for s in [*sidecars, *statuses] if not s["ready"]]
    containers_ready = not unready and phase == "Running" and not terminal
    if phase in TERMINAL:
        cr_reason, cr_msg = ("PodCompleted" if phase == "Succeeded" else "PodFailed"), ""
    elif unready:
        cr_reason = "ContainersNotReady"
        cr_msg = f"containers with unready status: [{' '.join(unready)}]"
    else:
        cr_reason = "ContainersNotReady"
        cr_msg = "the pod is terminating" if (terminal or deleting) else ""
    # readiness gates: conditions others write, as the API server has them
    api_cond = {c.get("type"): c for c in (pod.get("status") or {}).get("conditions") or []}
    gate_msgs = []
    for g in spec.get("readinessGates") or []:
        gtype = g.get("conditionType")
        gc = api_cond.get(gtype)
        if gc is None:
            gate_msgs.append(f'corresponding condition of pod readiness gate "{gtype}" '
                             "does not exist.")
        elif gc.get("status") != "True":
            gate_msgs.append(f'the status of pod readiness gate "{gtype}" is not "True", '
                             f"but {gc.get('status')}")
    ready = containers_ready and not gate_msgs and not deleting
    if not containers_ready:
        ready_reason, ready_msg = cr_reason, cr_msg
    elif gate_msgs:
        ready_reason, ready_msg = "ReadinessGatesNotReady", ", ".join(gate_msgs)
    else:
        ready_reason, ready_msg = "ContainersNotReady", "the pod is terminating"
    sandbox_ready = any(sb.state == SandboxState.READY and (sb.host_network or sb.ip or
                                                            spec.get("hostNetwork"))
                        for sb in rs.sandboxes) and not terminal
    conditions = [
        _condition("PodReadyToStartContainers", sandbox_ready, prev_cond, stamp),
        _condition("PodScheduled", True, prev_cond, stamp),
        _condition("Initialized", init_done, prev_cond, stamp, "ContainersNotInitialized",
                   f"containers with incomplete status: [{' '.join(not_init)}]"),
        _condition("ContainersReady", containers_ready, prev_cond, stamp, cr_reason, cr_msg),
        _condition("Ready", ready, prev_cond, stamp, ready_reason, ready_msg),
    ]
    if ending is not None and ending.disruption:
        # not one of ours to compare (CONDITION_TYPES), but written with them
        conditions.append({"type": "DisruptionTarget", "status": "True",
                           "lastProbeTime": None,
                           "lastTransitionTime": (prev_cond.get("DisruptionTarget") or {}).get(
                               "lastTransitionTime") or stamp,
                           "reason": DISRUPTED_BY_NODE, "message": ending.disruption})
    if generation is not None:
        for c in conditions:
            c["observedGeneration"] = generation
    if phase not in TERMINAL:
        conditions += [_resize_condition(r, prev_cond, stamp) for r in resize]
    pod_ip = host_ip if spec.get("hostNetwork") else rs.ip
    status: Status = {
        "phase": phase,
        "conditions": conditions,
        "containerStatuses": statuses,
        "hostIP": host_ip or None,
        "hostIPs": [{"ip": host_ip}] if host_ip else None,
        "podIP": pod_ip or None,
        "podIPs": [{"ip": pod_ip}] if pod_ip else None,
        "startTime": previous.get("startTime") or stamp,
        "reason": reason,
        "message": message,
    }
    if generation is not None:
        status["observedGeneration"] = generation
    if inits:
        status["initContainerStatuses"] = init_statuses
    if ephemerals:
        status["ephemeralContainerStatuses"] = ephemeral_statuses
    if previous.get("phase") in TERMINAL:
        for k in ("reason", "message"):  # why it ended stays with it
            if previous.get(k):
                status[k] = previous[k]
    return status


def _drop_nones(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _drop_nones(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_drop_nones(x) for x in v]
    return v


def owned(status: Mapping[str, Any] | None) -> Status:
    """The part of a status this agent writes, normalized for comparison: a null in
    our patch means "remove", so None and a missing key compare equal; conditions of
    types others own are not ours to compare, and their order is not."""
    status = status or {}
    out = {k: _drop_nones(status[k]) for k in OWNED if status.get(k) is not None}
    if "conditions" in out:
        # by type: the API server's merge of our list into its own keeps its order
        out["conditions"] = sorted((c for c in out["conditions"]
                                    if c.get("type") in CONDITION_TYPES),
                                   key=lambda c: str(c.get("type")))
    return out


# --- writing to the API -------------------------------------------------------------

def transient(status: Mapping[str, Any] | None) -> frozenset[str]:
    """The transient conditions (TRANSIENT_CONDITIONS) a status has."""
    return frozenset(c.get("type") for c in (status or {}).get("conditions") or []
                     if c.get("type") in TRANSIENT_CONDITIONS)


def owned_digest(status: Mapping[str, Any] | None) -> bytes:
    """A digest of a status's owned part: what the writes compare, so that a pod holds
    one copy of its status, not three (thousands of pods on virtual nodes)."""
    text = json.dumps(owned(status), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass
class _Entry:
    pod: Pod
    status: Status            # latest computed
    want: bytes               # the digest of its owned part (what a write would make
    #                           the API hold)
    sent: bytes | None        # that of what the API holds as far as we know
    # the transient conditions (resize) the API holds, as far as we know: one that goes
    # away is deleted from its list by name
    held: frozenset[str] = frozenset()
    task: asyncio.Task[None] | None = None
    delete: bool = False      # finish the graceful deletion once status is written
    deleted: bool = False


@per_registry
def _writes_counter(registry: CollectorRegistry) -> Counter:
    return Counter("nodepulse_pod_status_writes_total",
                   "Pod status API writes by result (ok, error, gone) and kind.",
                   ["node", "kind", "result"], registry=registry)


class StatusManager:
    """Writes pods' status to the pods/status subresource, and finishes graceful
    deletions (DELETE with grace 0 and a uid precondition): what a node's credentials
    may do to the pods bound to it."""

    REQUEST_TIMEOUT = 30.0
    MIRROR_RETRY_MAX = 2.0  # between writes to a static pod's mirror that is not there

    def __init__(self, kube: Kube, clock: Clock, *, answered: ApiAnswered | None = None,
                 node: str = "", retry_initial: float = 1.0, retry_max: float = 60.0,
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.kube = kube
        self.clock = clock
        self.answered = answered or ApiAnswered(clock)
        self.node = node
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self._pods: dict[str, _Entry] = {}
        self._writes = _writes_counter(registry)

    def status(self, uid: str) -> Status | None:
        """The latest status computed for a pod (the `previous` for the next one)."""
        e = self._pods.get(uid)
        return e.status if e else None

    def previous(self, pod: Pod) -> Status:
        """What to compute the next status against: ours, else the API's."""
        uid = pod["metadata"]["uid"]
        e = self._pods.get(uid)
        return e.status if e else dict(pod.get("status") or {})

    def set_status(self, pod: Pod, status: Status) -> None:
        uid = pod["metadata"]["uid"]
        e = self._pods.get(uid)
        want = owned_digest(status)
        if e is None:
            api = pod.get("status")
            e = self._pods[uid] = _Entry(pod, status, want, owned_digest(api), transient(api))
        e.pod, e.status, e.want = pod, status, want
        self._kick(uid, e)

    def reconcile(self, pod: Pod) -> None:
        """The API's status changed under us (RECONCILE): resend if it differs."""
        e = self._pods.get(pod["metadata"]["uid"])
        if e is None:
            return
        e.sent, e.held = owned_digest(pod.get("status")), transient(pod.get("status"))
        e.pod = pod
        self._kick(pod["metadata"]["uid"], e)

    def finish_deletion(self, pod: Pod) -> None:
        """The pod was deleted gracefully and its containers are stopped: write the final
        status, then delete the API object (API pods only)."""
        uid = pod["metadata"]["uid"]
        e = self._pods.get(uid)
        if e is None:
            held = owned(pod.get("status"))
            e = self._pods[uid] = _Entry(pod, held, owned_digest(held), None)
        if is_static(pod) or e.deleted:
            return
        e.delete = True
        self._kick(uid, e)

    async def written(self, uid: str) -> None:
        """Until the pod's status as last set is written (or the pod found gone)."""
        while (e := self._pods.get(uid)) is not None and e.task is not None \
                and not e.task.done():
            await asyncio.wait({e.task})

    def forget(self, uid: str) -> None:
        e = self._pods.pop(uid, None)
        if e and e.task:
            e.task.cancel()

    def dirty(self, uid: str) -> bool:
        e = self._pods.get(uid)
        return e is not None and (e.sent != e.want or (e.delete and not e.deleted))

    def _kick(self, uid: str, e: _Entry) -> None:
        if self.dirty(uid) and (e.task is None or e.task.done()):
            e.task = asyncio.create_task(self._send(uid, e), name=f"pod-status-{uid}")

    async def flush(self) -> None:
        """Wait for every pending write (tests, shutdown)."""
        while tasks := [e.task for e in self._pods.values() if e.task and not e.task.done()]:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        for e in self._pods.values():
            if e.task:
                e.task.cancel()
        for e in self._pods.values():
            if e.task:
                with contextlib.suppress(asyncio.CancelledError):
                    await e.task

    async def _send(self, uid: str, e: _Entry) -> None:
        delay = self.retry_initial
        cap = self.retry_max
        while self._pods.get(uid) is e and self.dirty(uid):
            want = e.want
            kind = "delete" if want == e.sent and e.delete else "patch"
            try:
                if kind == "patch":
                    status = e.status
                    await self._patch(e.pod, status, e.held)
                    e.sent, e.held = want, transient(status)
                else:
                    await self._delete(e.pod)
                    e.deleted = True
                self._writes.labels(node=self.node, kind=kind, result="ok").inc()
                delay = self.retry_initial
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                code = status_of(exc)
                if code in (404, 409, 422) and kind == "patch" and is_static(e.pod):
                    # a static pod's status goes to its mirror pod, which the mirror
                    # manager may not have created yet, or is replacing (an outdated
                    # one being deleted answers 422): the static pod is still here, so
                    # keep trying (CI: a pod that replaced another of its name never
                    # showed Running, its first write having met the old mirror)
                    self._writes.labels(node=self.node, kind=kind, result="error").inc()
                    log.info("pod %s: no mirror pod (yet) for its status (%s); retry in "
                             "%.0fs", describe(e.pod), code, delay)
                    cap = self.MIRROR_RETRY_MAX  # the mirror comes within seconds
                elif code in (404, 409) or (code == 422 and
                                            "metadata.uid" in invalid_fields(exc)):
                    # the pod is gone or was replaced by a new one with the same name
                    # (the patch's uid no longer matches: the API calls that invalid)
                    log.info("pod %s: status %s gave %s; the pod is gone", describe(e.pod),
                             kind, code)
                    self._writes.labels(node=self.node, kind=kind, result="gone").inc()
                    e.sent = want
                    e.deleted = True
                    return
                elif code == 422:
                    # a status the API server refuses: say what it said, and try again
                    # (the next status may pass; a pod is never left as if gone)
                    self._writes.labels(node=self.node, kind=kind, result="invalid").inc()
                    log.warning("pod %s: the API server refused its status (%s); retry in "
                                "%.0fs", describe(e.pod), brief(exc), delay)
                else:
                    self._writes.labels(node=self.node, kind=kind, result="error").inc()
                    log.warning("pod %s: status %s failed (%s), retry in %.0fs%s", describe(e.pod),
                                kind, brief(exc), delay,
                                "" if is_retriable(exc) else " (not retriable?)")
            back = await self.answered.wait(delay)  # the API server answers again
            delay = self.retry_initial if back else min(delay * 2, cap)

    async def _patch(self, pod: Pod, status: Status, held: frozenset[str]) -> None:
        """A strategic merge patch of `status`; a transient condition the API holds
        (`held`) and `status` no longer has is deleted from the API's list by name."""
        meta = pod["metadata"]
        gone = [{"type": t, "$patch": "delete"} for t in sorted(held - transient(status))]
        if gone:
            status = {**status, "conditions": [*(status.get("conditions") or []), *gone]}
        # podIPs and hostIPs are replaced, not merged by address: a pod given a new
        # sandbox (its runtime lost the old one) has a new address, and old and new
        # together would be two of one family, which the API server refuses
        body: dict[str, Any] = {"status": {
            k: [REPLACE, *v] if k in ("podIPs", "hostIPs") and v else v
            for k, v in status.items()}}
        if not is_static(pod):
            # the uid makes the patch fail on a new pod that reuses the name; a static
            # pod's status goes to its mirror pod, which has a uid of its own
            body["metadata"] = {"uid": meta["uid"]}
        await self.kube.patch(PODS, meta["name"], body, namespace=meta.get("namespace", "default"),
                              subresource="status", timeout=self.REQUEST_TIMEOUT, parse=False)

    async def _delete(self, pod: Pod) -> None:
        meta = pod["metadata"]
        await self.kube.delete(PODS, meta["name"], namespace=meta.get("namespace", "default"),
                               options={"gracePeriodSeconds": 0,
                                        "preconditions": {"uid": meta["uid"]}},
                               timeout=self.REQUEST_TIMEOUT, parse=False)
