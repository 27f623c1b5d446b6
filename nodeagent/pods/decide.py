"""What one sync of a pod must do, decided before anything is done.

`compute_pod_actions` is a pure function: from the pod's spec, the runtime's state of
the pod and the status last written, with the few answers of the node it needs (what
admission says, which containers the agent cannot create, the crash back-offs still
running, the probes' verdicts), it returns a `PodActions`: a value that says whether
the pod runs at all, and if so which sandbox to stop or make, which containers to kill,
start, resize in place (resize.py), and what the status should say meanwhile. The
syncer (syncer.py)
gathers the inputs, asks, and carries the actions out in order, as the kubelet's
SyncPod carries out what its computePodActions decided.
"""

from __future__ import annotations

import datetime as dt
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nodeagent.pods import podspec
from nodeagent.pods import resize as rz
from nodeagent.pods.admission import NODE_SHUTDOWN, AdmissionSettings, Rejection, admit
from nodeagent.pods.backoff import CrashKey, crash_key
from nodeagent.pods.eviction import REASON as EVICTED
from nodeagent.pods.eviction import pressure_refusal
from nodeagent.pods.podstatus import Waiting, is_sidecar, ran_its_course
from nodeagent.pods.podupdate import Pod, is_static
from nodeagent.pods.probes import Kind
from nodeagent.runtime.base import (
    ANNOTATION_RESOURCES,
    Container,
    ContainerState,
    PodRuntimeStatus,
    Resources,
    Sandbox,
    SandboxState,
    container_spec_hash,
)

Spec = Mapping[str, Any]


def grace_of(pod: Pod, override: float | None = None) -> float:
    """Grace period for stopping a pod: the delete's, else the spec's, else 30 s."""
    if override is not None:
        return max(0.0, float(override))
    meta = pod.get("metadata") or {}
    for v in (meta.get("deletionGracePeriodSeconds"),
              (pod.get("spec") or {}).get("terminationGracePeriodSeconds")):
        if v is not None:
            return max(0.0, float(v))
    return 30.0


def podspec_containers(pod: Pod) -> list[Spec]:
    """The init and regular containers of the pod's spec."""
    spec = pod.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def all_containers(pod: Pod) -> list[Spec]:
    """The init, regular and ephemeral containers of the pod's spec."""
    return [*podspec_containers(pod), *((pod.get("spec") or {}).get("ephemeralContainers")
                                        or [])]


# --- what the node answers ----------------------------------------------------------

@dataclass(frozen=True)
class NodeAbilities:
    """What the node can do for a pod, where that decides whether it may run."""
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    can_mount: bool = True   # the runtime gives containers a filesystem of their own
    runtime: str = ""        # its name, for the messages that say what it cannot do
    probes: bool = True      # the node loop runs probes


@dataclass(frozen=True)
class Verdicts:
    """The answers of the node's stateful parts, read just before deciding."""
    # crash back-offs still running: key -> (seconds left, the current delay)
    backoff: Mapping[CrashKey, tuple[float, float]] = field(default_factory=dict)
    # container id -> the probe whose failure asks for the container to be killed
    probe_kills: Mapping[str, Kind] = field(default_factory=dict)
    # ids of the running sidecars whose startup probe (if any) has passed
    started: frozenset[str] = frozenset()
    # the node's admission (admission.NodeAdmission): why it refused the pod, or that
    # it has not decided yet (pods stopping to make room for a critical one)
    rejection: Rejection | None = None
    admission_waits: bool = False
    # the node's pressure conditions (the eviction manager's): a new pod may be refused
    pressure: frozenset[str] = frozenset()
    shutting_down: bool = False  # the node is shutting down: admit no new pod
    # container id -> the CPU and memory its last in-place resize gave it
    resized: Mapping[str, Resources] = field(default_factory=dict)


def refusals(pod: Pod, node: NodeAbilities) -> tuple[dict[str, str], bool]:
    """The containers that cannot be created because of a field this agent does not
    honour (name -> why), and whether a pod-level field blocks them all."""
    problems = podspec.unhandled(pod)
    # what podspec's table accepts but this node's parts cannot do
    if (pod.get("spec") or {}).get("hostAliases") and not node.can_mount:
        problems.append(podspec.Unhandled(
            "spec.hostAliases", f"the {node.runtime} runtime runs containers in the node's "
            "filesystem and cannot give them an /etc/hosts of their own"))
    if not node.probes:
        problems += [podspec.Unhandled(f"container {c.get('name')}: {kind.field}",
                                       "probes are not run by this agent's pod loop",
                                       str(c.get("name")))
                     for c in podspec_containers(pod) for kind in Kind
                     if c.get(kind.field) is not None]
    refused: dict[str, str] = {}
    pod_level = next((p for p in problems if p.container is None), None)
    for p in problems:
        if p.container is not None:
            refused.setdefault(p.container, p.message)
    if pod_level is not None:
        for c in all_containers(pod):
            refused.setdefault(str(c.get("name")), pod_level.message)
    return refused, pod_level is not None


# --- what the sync does ---------------------------------------------------------------

class Verdict(enum.StrEnum):
    """What becomes of the pod in this sync."""
    FINISHED = "finished"  # it already ended (Succeeded/Failed): nothing to do
    REJECTED = "rejected"  # admission refused it: Failed, nothing started
    WAITING = "waiting"    # admission has not decided yet: nothing done
    DEADLINE = "deadline"  # activeDeadlineSeconds passed: Failed
    ENDED = "ended"        # it ran and nothing will run again (restartPolicy Never):
                           # the final status
    REFUSED = "refused"    # a pod-level field the agent does not honour: no sandbox
    RUN = "run"            # carry out the actions


@dataclass(frozen=True)
class StartContainer:
    """Create and start a container."""
    spec: Spec
    attempt: int = 0
    restarts: int = 0
    init: bool = False
    # a restart after a crash: counted by the back-off when it is attempted
    backoff_key: CrashKey | None = None
    target_id: str = ""              # an ephemeral container joins this one's processes
    # created earlier but never started: removed first, this attempt made in its place
    replaces: Container | None = None


@dataclass(frozen=True)
class KillContainer:
    """Stop a running container as the kubelet kills it (Event, preStop, stop)."""
    container: Container
    spec: Spec
    message: str
    grace: float | None = None  # None: the pod's


@dataclass(frozen=True)
class ResizeContainer:
    """Change a running container's CPU and memory in place to what the pod's
    allocation gives it (CRI UpdateContainerResources)."""
    container: Container
    spec: Spec
    want: Resources  # as allocated
    have: Resources  # as last applied

    @property
    def resources(self) -> tuple[str, ...]:
        """What changes: "memory", "cpu"."""
        return rz.changed(self.want, self.have)


@dataclass(frozen=True)
class PodActions:
    verdict: Verdict
    rejection: Rejection | None = None
    # sync again this soon at the latest: the deadline, a back-off
    requeue_after: float | None = None
    # -- the sandbox
    sandbox: Sandbox | None = None          # the one the containers run in
    new_sandbox: int | None = None          # else: make one, of this attempt
    stop_first: tuple[Container, ...] = ()  # before making it: what still runs of an old one
    stop_sandboxes: tuple[str, ...] = ()    # duplicates of the sandbox in use
    # -- the containers, in the order they are carried out
    kill: tuple[KillContainer, ...] = ()
    start: tuple[StartContainer, ...] = ()  # ephemeral, then init, then regular
    refuse: Mapping[str, str] = field(default_factory=dict)  # reported as refused now
    # -- an in-place resize: between the kills and the starts
    resize: tuple[ResizeContainer, ...] = ()
    resize_restarts: bool = False  # a container restarts for one: the pod cgroup follows
    # -- what the status says meanwhile
    waiting: Mapping[str, Waiting] = field(default_factory=dict)
    init_blocked: bool = False  # an init container is still to run or start
    terminal: bool = False      # every container exited and none will be restarted


def _latest(name: str, among: Sequence[Container]) -> Container | None:
    cs = [c for c in among if c.name == name]
    return max(cs, key=lambda c: c.attempt) if cs else None


@dataclass
class _Decision:
    """What compute_pod_actions gathers as it goes."""
    pod: Pod
    rs: PodRuntimeStatus
    previous: Mapping[str, Any]
    verdicts: Verdicts
    refused: Mapping[str, str]
    requeue: float = math.inf
    kill: list[KillContainer] = field(default_factory=list)
    start: list[StartContainer] = field(default_factory=list)
    refuse: dict[str, str] = field(default_factory=dict)
    waiting: dict[str, Waiting] = field(default_factory=dict)
    resize: list[ResizeContainer] = field(default_factory=list)
    resize_restarts: bool = False

    def again(self, seconds: float) -> None:
        self.requeue = min(self.requeue, seconds)

    def new(self, spec: Spec, **kw: Any) -> None:
        """Start a container that has no attempt in the current sandbox."""
        prev = _latest(str(spec["name"]), self.rs.containers)
        attempt, restarts = (0, 0) if prev is None else (prev.attempt + 1,
                                                          prev.restart_count + 1)
        self.run(StartContainer(spec, attempt, restarts, **kw))

    def run(self, start: StartContainer) -> None:
        name = str(start.spec["name"])
        if name in self.refused:
            self.refuse[name] = self.refused[name]
        else:
            self.start.append(start)

    def _crash_key(self, spec: Spec) -> CrashKey:
        return crash_key(str(self.pod["metadata"]["uid"]), spec)

    def _backing_off(self, spec: Spec, key: CrashKey) -> bool:
        """The container's crash back-off still runs: it waits (CrashLoopBackOff)."""
        meta = self.pod["metadata"]
        left = self.verdicts.backoff.get(key)
        if left is None:
            return False
        wait, delay = left
        self.waiting[str(spec["name"])] = Waiting(
            "CrashLoopBackOff",
            f"back-off {delay:.0f}s restarting failed container={spec['name']} "
            f"pod={meta['name']}_{meta.get('namespace', 'default')}({meta['uid']})")
        self.again(wait)
        return True

    def restart(self, spec: Spec, cur: Container, *, init: bool = False) -> None:
        """Start the next attempt of an exited container once its back-off allows."""
        key = self._crash_key(spec)
        if self._backing_off(spec, key):
            return
        self.run(StartContainer(spec, cur.attempt + 1, cur.restart_count + 1, init=init,
                                backoff_key=key))

    def replace_created(self, spec: Spec, cur: Container, *, init: bool = False) -> None:
        """A container created and never started: a start cut short (the agent or the
        runtime stopped mid-start) can leave one that the runtime will not start again
        (containerd then marks it exited, StartError). As the kubelet, which never
        starts a container it did not just create, a new attempt is made in its place;
        its restart count stays, as it never ran."""
        if self._backing_off(spec, self._crash_key(spec)):
            return
        self.run(StartContainer(spec, cur.attempt + 1, cur.restart_count, init=init,
                                replaces=cur))

    def kill_unknown(self, spec: Spec, cur: Container, *, init: bool = False,
                     again: bool = True) -> None:
        """A container the runtime reports in an unknown state may still run: it is
        stopped, then (`again`) a new attempt started, so that two never run at once.
        The kubelet's rule: a regular container starts again whatever the restart
        policy; an init container of a Never pod does not (its exit code, once
        stopped, decides the pod's fate)."""
        what = "Init container" if init else "Container"
        self.kill.append(KillContainer(cur, spec, f"{what} {spec['name']} is in an unknown "
                                                  "state and may still run: stopped"))
        if again:
            self.run(StartContainer(spec, cur.attempt + 1, cur.restart_count + 1, init=init))

    def resize_or_restart(self, spec: Spec, cur: Container, *, init: bool = False) -> bool:
        """The running `cur` as its allocated resources say (the kubelet's
        computePodResizeAction): resized in place, or restarted when its resizePolicy
        says RestartContainer for a resource that changed; False when it restarts."""
        if is_static(self.pod):  # never resized in place
            return True
        want = rz.wanted(spec)
        # one made by an agent that did not record what it gave: from nothing, as the
        # kubelet does without its record
        have = rz.applied(cur, self.verdicts.resized) or Resources()
        changed = rz.changed(want, have)
        if not changed:
            return True
        if rz.restarts_for(spec, changed):
            self.kill.append(KillContainer(cur, spec, f"Container {spec['name']} resize "
                                                      "requires restart"))
            self.run(StartContainer(spec, cur.attempt + 1, cur.restart_count + 1, init=init))
            self.resize_restarts = True
            return False
        self.resize.append(ResizeContainer(cur, spec, want, have))
        return True


def _probe_grace(pod: Pod, container: Spec, kind: Kind) -> float | None:
    """A probe's own terminationGracePeriodSeconds, when it sets one (a delete's grace
    period comes first)."""
    if (pod.get("metadata") or {}).get("deletionGracePeriodSeconds") is not None:
        return None
    v = (container.get(kind.field) or {}).get("terminationGracePeriodSeconds")
    return None if v is None else float(v)


def _deadline_left(pod: Pod, previous: Mapping[str, Any], now: dt.datetime) -> float | None:
    """Seconds until activeDeadlineSeconds runs out (from the pod's startTime)."""
    secs = (pod.get("spec") or {}).get("activeDeadlineSeconds")
    if secs is None:
        return None
    start = previous.get("startTime") or (pod.get("status") or {}).get("startTime")
    begun = dt.datetime.fromisoformat(str(start).replace("Z", "+00:00")) if start else now
    return float(secs) - (now - begun).total_seconds()


def compute_pod_actions(pod: Pod, rs: PodRuntimeStatus, previous: Mapping[str, Any], *,
                        now: dt.datetime, node: NodeAbilities,
                        verdicts: Verdicts = Verdicts()) -> PodActions:
    """What this sync must do for `pod`, given the runtime's state of it `rs` and the
    status last written `previous` (see the module docstring)."""
    if previous.get("phase") in ("Succeeded", "Failed"):
        return PodActions(Verdict.FINISHED)
    rejection = admit(pod, node.admission) or verdicts.rejection
    if rejection is None and verdicts.pressure and _new(rs, previous):
        why = pressure_refusal(pod, verdicts.pressure)
        rejection = Rejection(EVICTED, why) if why else None
    if verdicts.shutting_down and _new(rs, previous) \
            and previous.get("phase") in (None, "", "Pending"):
        rejection = NODE_SHUTDOWN  # one that runs is stopped by the shutdown, in its turn
    if rejection is not None:
        return PodActions(Verdict.REJECTED, rejection=rejection)
    if verdicts.admission_waits:
        return PodActions(Verdict.WAITING)
    left = _deadline_left(pod, previous, now)
    if left is not None and left <= 0:
        return PodActions(Verdict.DEADLINE)
    refused, pod_refused = refusals(pod, node)
    d = _Decision(pod, rs, previous, verdicts, refused)
    if left is not None:
        d.again(left)
    spec = pod.get("spec") or {}
    policy = spec.get("restartPolicy") or "Always"

    ready = sorted((s for s in rs.sandboxes if s.state == SandboxState.READY),
                   key=lambda s: s.attempt, reverse=True)
    sandbox = ready[0] if ready else None
    new_sandbox: int | None = None
    stop_first: tuple[Container, ...] = ()
    regular = [str(c["name"]) for c in spec.get("containers") or []]
    if sandbox is None:
        if rs.containers and policy == "Never" and any(
                c.state == ContainerState.EXITED for c in rs.containers):
            # the sandbox died after containers ran; Never means no second run
            return PodActions(Verdict.ENDED)
        if regular and all(ran_its_course(previous, n, policy) for n in regular):
            # the runtime lost a pod whose containers ran (the status says so)
            return PodActions(Verdict.ENDED)
        if pod_refused:  # a pod-level field we cannot honour: no sandbox either
            return PodActions(Verdict.REFUSED, refuse={
                str(c.get("name")): refused[str(c.get("name"))] for c in all_containers(pod)})
        new_sandbox = max((s.attempt for s in rs.sandboxes), default=-1) + 1
        # containers never run in two sandboxes of one pod at once
        stop_first = tuple(c for c in rs.containers if c.state in (
            ContainerState.RUNNING, ContainerState.CREATED, ContainerState.UNKNOWN))
        current: list[Container] = []
    else:
        current = [c for c in rs.containers if c.sandbox_id == sandbox.id]
        # not in a sandbox made by this sync (the kubelet's rule too)
        _ephemeral(d, current)

    # init containers: one at a time, in order, each to success; a sidecar (a
    # restartable init container) to started, and kept running from then on
    names = {str(c["name"]) for c in spec.get("containers") or []}
    initialized = any(c.name in names for c in current)
    init_blocked = False
    for ic in spec.get("initContainers") or []:
        cur = _latest(str(ic["name"]), current)
        if is_sidecar(ic):
            if _sidecar(d, ic, cur) or initialized:
                continue
            init_blocked = True
            break
        if initialized or (cur is not None and cur.state == ContainerState.EXITED
                           and cur.exit_code == 0):
            continue
        init_blocked = True
        if cur is None:
            d.new(ic, init=True)
        elif cur.state == ContainerState.EXITED:
            if policy == "Never":
                return PodActions(Verdict.ENDED)
            d.restart(ic, cur, init=True)
        elif cur.state == ContainerState.CREATED:
            d.replace_created(ic, cur, init=True)
        elif cur.state == ContainerState.UNKNOWN:
            d.kill_unknown(ic, cur, init=True, again=policy != "Never")
        break
    if not init_blocked:
        for c in spec.get("containers") or []:
            cur = _latest(str(c["name"]), current)
            if cur is None:
                if not ran_its_course(previous, str(c["name"]), policy):
                    d.new(c)
            elif cur.state == ContainerState.RUNNING:
                if _definition_changed(cur, c):
                    d.kill.append(KillContainer(
                        cur, c, f"Container {c['name']} definition changed, will be "
                                "restarted"))
                    d.run(StartContainer(c, cur.attempt + 1, cur.restart_count + 1))
                elif (kind := verdicts.probe_kills.get(cur.id)) is not None:
                    will = ", will be restarted" if policy != "Never" else ""
                    d.kill.append(KillContainer(
                        cur, c, f"Container {c['name']} failed {kind.value.lower()} "
                                f"probe{will}", _probe_grace(pod, c, kind)))
                else:
                    d.resize_or_restart(c, cur)
            elif cur.state == ContainerState.CREATED:
                d.replace_created(c, cur)
            elif cur.state == ContainerState.UNKNOWN:
                d.kill_unknown(c, cur)
            elif cur.state == ContainerState.EXITED:
                code = cur.exit_code or 0
                if policy == "Always" or (policy == "OnFailure" and code != 0):
                    d.restart(c, cur)

    return PodActions(
        Verdict.RUN, requeue_after=None if math.isinf(d.requeue) else d.requeue,
        sandbox=sandbox, new_sandbox=new_sandbox, stop_first=stop_first,
        stop_sandboxes=tuple(s.id for s in ready[1:]),
        kill=tuple(d.kill), start=tuple(d.start), refuse=d.refuse, waiting=d.waiting,
        resize=tuple(d.resize), resize_restarts=d.resize_restarts,
        init_blocked=init_blocked, terminal=_all_done(spec, current, init_blocked, previous))


def _new(rs: PodRuntimeStatus, previous: Mapping[str, Any]) -> bool:
    """Nothing of the pod has run yet: admission may still refuse it."""
    return not rs.sandboxes and not rs.containers and not any(
        s.get("containerID") for s in [*(previous.get("containerStatuses") or []),
                                       *(previous.get("initContainerStatuses") or [])])


def _ephemeral(d: _Decision, current: Sequence[Container]) -> None:
    """The ephemeral containers (kubectl debug), added to the running pod: each started
    once, whatever the pod's restartPolicy, and never again once the runtime has any
    record of it (in any sandbox of the pod) or its status said it ran. One with a
    targetContainerName joins that container's process namespace."""
    spec = d.pod.get("spec") or {}
    # what ran already, also as reported (the runtime may have removed it since)
    ran = {c.name for c in d.rs.containers} | {
        s["name"] for s in d.previous.get("ephemeralContainerStatuses") or []
        if s.get("containerID")}
    for i, ec in enumerate(spec.get("ephemeralContainers") or []):
        name = str(ec["name"])
        if name in ran:
            continue
        target_id = ""
        if (target := ec.get("targetContainerName")):
            running = [c for c in current if c.name == target
                       and c.state == ContainerState.RUNNING]
            if not running:
                why = f"spec.ephemeralContainers[{i}].targetContainerName: container " \
                      f"{target!r} is not running, so its process namespace cannot be joined"
                d.refuse[name] = why
                d.again(RETRY)
                continue
            target_id = max(running, key=lambda c: c.attempt).id
        d.run(StartContainer(ec, target_id=target_id))


# a container that cannot be created now (its image, its config): tried again this soon
RETRY = 10.0


def _sidecar(d: _Decision, ic: Spec, cur: Container | None) -> bool:
    """Keep a sidecar running (whatever the pod's restartPolicy); True once it has
    started (its startup probe, if any, passed)."""
    name = str(ic["name"])
    if cur is None:
        d.new(ic, init=True)
        return False
    if cur.state == ContainerState.CREATED:
        d.replace_created(ic, cur, init=True)
        return False
    if cur.state == ContainerState.UNKNOWN:
        d.kill_unknown(ic, cur, init=True)
        return False
    if cur.state != ContainerState.RUNNING:
        d.restart(ic, cur, init=True)
        return False
    if _definition_changed(cur, ic):
        d.kill.append(KillContainer(cur, ic, f"Init container {name} definition changed"))
        return False
    kind = d.verdicts.probe_kills.get(cur.id)
    if kind is not None:
        d.kill.append(KillContainer(cur, ic, f"Init container {name} failed "
                                             f"{kind.value.lower()} probe",
                                    _probe_grace(d.pod, ic, kind)))
        return False
    if not d.resize_or_restart(ic, cur, init=True):
        return False
    return cur.id in d.verdicts.started


def _definition_changed(cur: Container, spec: Spec) -> bool:
    """Whether the running container was made from another definition than `spec`'s
    (resources aside: a resize changes those in place). One made by an agent before
    in-place resize (it recorded no resources) hashed them too: that hash is kept, so
    an upgrade restarts nothing."""
    if not cur.spec_hash or cur.spec_hash == container_spec_hash(spec):
        return False
    return ANNOTATION_RESOURCES in cur.annotations or \
        cur.spec_hash != container_spec_hash(spec, whole=True)


def _all_done(spec: Spec, current: Sequence[Container], init_blocked: bool,
              previous: Mapping[str, Any]) -> bool:
    """Every container exited (or, lost by the runtime, ran its course) and none will
    be restarted."""
    policy = spec.get("restartPolicy") or "Always"
    if policy == "Always" or init_blocked:
        return False
    for c in spec.get("containers") or []:
        cur = _latest(str(c["name"]), current)
        if cur is None and ran_its_course(previous, str(c["name"]), policy):
            continue
        if cur is None or cur.state != ContainerState.EXITED:
            return False
        if policy == "OnFailure" and (cur.exit_code or 0) != 0:
            return False
    return True

