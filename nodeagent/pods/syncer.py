"""The syncer: one sync of a pod, in two steps.

First it decides: it gathers the node's answers (admission's verdict, crash back-offs,
probe verdicts) and asks `compute_pod_actions` (decide.py) what must be done. Then it
acts, in the kubelet's order:

    1. a pod that ended, was rejected or ran past its deadline: its final status; one
       admission has not decided yet: nothing (synced again once it has)
    2. the pod's volumes set up (a volume that cannot be: the pod waits, or is refused)
    3. the pod's cgroup made if it is not there (cgroups.py)
    4. duplicate sandboxes stopped; a new sandbox made when none is ready
    5. containers killed (a changed definition, a failed probe, a resize that restarts)
    6. an in-place resize carried out (resize.py): the pod cgroup and the containers
    7. containers started: ephemeral, then the next init container, then the regular ones
    8. the status computed from what the runtime now holds, and handed to the
       StatusManager

A pod is synced as the node allocated it: a resize the node has not allocated yet
(admission.py) is not in the spec the sync sees.

It also stops a pod within its grace period (terminate_pod), writes its final status
and removes its cgroup (sync_terminated), removes what the node holds of a pod the
node ended itself (remove_content: an eviction) or that is gone, then its cgroup
(cleanup_pod). Dead containers of running pods are the garbage collector's (gc.py). It
keeps no per-pod state; the pod workers (workers.py) say when it runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.api.kube import describe
from nodeagent.events import NORMAL, WARNING, Events
from nodeagent.pods import resize as rz
from nodeagent.pods.admission import NodeAdmission
from nodeagent.pods.cgroups import CgroupError
from nodeagent.pods.containers import Containers, Place, Progress
from nodeagent.pods.decide import (
    RETRY,
    NodeAbilities,
    PodActions,
    Verdict,
    Verdicts,
    all_containers,
    compute_pod_actions,
)
from nodeagent.pods.dns import PodDnsError
from nodeagent.pods.env import env_refs
from nodeagent.pods.hooks import DEADLINE_MESSAGE, DEADLINE_REASON
from nodeagent.pods.pleg import CacheEntry
from nodeagent.pods.podstatus import (
    Ending,
    StatusManager,
    Waiting,
    compute_pod_status,
    is_sidecar,
)
from nodeagent.pods.podupdate import Pod
from nodeagent.pods.probes import ProbeManager
from nodeagent.pods.runtimecalls import RuntimeCalls
from nodeagent.pods.sandboxes import NoRuntimeClass, Sandboxes
from nodeagent.pods.settings import NodePodSettings
from nodeagent.pods.volumes import MountFailed, PodVolumes, VolumeManager, VolumeRefused
from nodeagent.runtime.base import (
    Container,
    ContainerRuntimeError,
    ContainerState,
    PodRuntimeStatus,
    Resources,
    SandboxConfig,
    SandboxState,
)

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    terminal: bool = False              # nothing will run again: move to terminating
    requeue_after: float | None = None  # sync again this soon (backoff, image wait)
    # sync again once any of these is done (image pulls under way)
    wake: tuple[asyncio.Future[None], ...] = ()
    # the sandbox and container ids running in the state this sync ended on, when it
    # left nothing to do (every container up): their start events bring nothing new
    running: frozenset[str] = frozenset()
    # what the sync read of the runtime after starting containers, and when it began
    # reading: newer than the relist's, for the PLEG cache
    fresh: tuple[PodRuntimeStatus, float] | None = None


class PodSyncer:
    MOUNT_RETRY = 10.0  # a volume that could not be set up (an object's change is sooner)

    def __init__(self, calls: RuntimeCalls, status: StatusManager, sandboxes: Sandboxes,
                 containers: Containers, volumes: VolumeManager | None,
                 probes: ProbeManager | None, events: Events | None,
                 settings: NodePodSettings, admission: NodeAdmission) -> None:
        """`volumes` None: pods with volumes are refused (its ObjectCache: the ConfigMaps
        and Secrets pods use, watched); `probes` None: a pod with a probe is refused;
        `admission`: the node's (its verdicts, and the node's pressure conditions), told
        when a pod's containers have stopped for good."""
        self.calls = calls
        self.admission = admission
        self.runtime = calls.runtime
        self.clock = calls.clock
        self.status = status
        self.sandboxes = sandboxes
        self.cgroups = sandboxes.cgroups
        self.containers = containers
        self.volumes = volumes
        self.objects = volumes.objects if volumes is not None else None
        self.probes = probes
        self.events = events
        self.settings = settings
        self.node = NodeAbilities(admission=settings.admission,
                                  can_mount=self.runtime.can_mount,
                                  runtime=self.runtime.scheme, probes=probes is not None)

    def in_flight(self) -> int:
        """Runtime calls under way."""
        return self.calls.in_flight()

    async def drain(self, timeout: float) -> int:
        """Let the runtime calls under way end (see RuntimeCalls.drain)."""
        return await self.calls.drain(timeout)

    # --- deciding -------------------------------------------------------------------

    def decide(self, pod: Pod, rs: PodRuntimeStatus) -> PodActions:
        """What the sync of `pod` must do, with the runtime in the state `rs`."""
        return compute_pod_actions(pod, rs, self.status.previous(pod),
                                   now=self.clock.now(), node=self.node,
                                   verdicts=self._verdicts(pod, rs))

    def _verdicts(self, pod: Pod, rs: PodRuntimeStatus) -> Verdicts:
        uid = str(pod["metadata"]["uid"])
        self.admission.settle(pod)
        left = self.containers.backoff.waiting(uid)
        running = [c for c in rs.containers if c.state == ContainerState.RUNNING]
        probes = self.probes
        return Verdicts(
            left,
            {c.id: k for c in running if (k := probes.kill_reason(c.id))} if probes else {},
            frozenset(c.id for c in running if probes is None or probes.started(uid, c)),
            rejection=self.admission.rejection(uid),
            admission_waits=self.admission.waiting(uid),
            pressure=self.admission.pressure(),
            shutting_down=self.admission.shutting_down(),
            resized=self.containers.resized(uid))

    # --- acting ---------------------------------------------------------------------

    async def sync_pod(self, pod: Pod, entry: CacheEntry) -> SyncResult:
        """Make the runtime match the spec. Raises on a runtime failure (retried)."""
        if entry.error is not None:
            raise ContainerRuntimeError(f"runtime state of the pod is unknown: {entry.error}")
        self.admission.settle(pod)
        pod = self.admission.resize(pod)  # as allocated from here on
        return await self.act(pod, entry.status, self.decide(pod, entry.status))

    async def act(self, pod: Pod, rs: PodRuntimeStatus, act: PodActions) -> SyncResult:
        """Carry out what was decided for `pod` with the runtime in the state `rs`, in
        the order the module docstring gives."""
        if act.verdict == Verdict.FINISHED:
            return SyncResult(terminal=True)
        if act.verdict == Verdict.REJECTED:
            assert act.rejection is not None
            r = act.rejection
            log.info("pod %s rejected: %s: %s", describe(pod), r.reason, r.message)
            self._event(pod, WARNING, r.reason, r.message)
            self.status.set_status(pod, {"phase": "Failed", "reason": r.reason,
                                         "message": f"Pod was rejected: {r.message}"})
            return SyncResult(terminal=True)
        if act.verdict == Verdict.WAITING:
            return SyncResult(wake=self.admission.turn())
        if act.verdict == Verdict.DEADLINE:
            log.info("pod %s: activeDeadlineSeconds passed; failing it", describe(pod))
            self._event(pod, NORMAL, DEADLINE_REASON, DEADLINE_MESSAGE)
            self._publish(pod, rs, {}, reason=DEADLINE_REASON, message=DEADLINE_MESSAGE)
            return SyncResult(terminal=True)

        if self.probes is not None:
            self.probes.update(pod)
        volumes = await self._volumes(pod, rs)
        if isinstance(volumes, SyncResult):
            return volumes
        if act.verdict == Verdict.ENDED:
            self._publish(pod, rs, {})
            return SyncResult(terminal=True)
        if act.verdict == Verdict.REFUSED:
            self._publish(pod, rs, self._refuse(pod, act.refuse))
            return SyncResult()

        try:
            self.cgroups.ensure(pod)
        except ValueError as e:  # a quantity the cgroup cannot be given
            self._publish(pod, rs, self._refuse(pod, {str(c["name"]): str(e)
                                                      for c in all_containers(pod)}))
            return SyncResult()
        except CgroupError as e:
            self._event(pod, WARNING, "FailedToCreatePodContainer",
                        f"unable to ensure pod container exists: {e}")
            self._publish(pod, rs, dict(act.waiting))
            raise  # retried with the pod worker's error back-off
        progress = Progress(waiting=dict(act.waiting))
        if act.requeue_after is not None:
            progress.again(act.requeue_after)
        if volumes.refresh_in is not None:  # a token to refresh: sync again by then
            progress.again(volumes.refresh_in + 0.5)
        place, unnamed = await self._place(pod, rs, act, volumes, progress)
        for k in act.kill:
            await self.containers.kill(pod, k.spec, k.container, k.message, place.pod_ip,
                                       grace=k.grace)
        resize_error = None
        if act.resize or act.resize_restarts:
            resize_error = await self._resize(pod, rs, act)
            if resize_error is not None:
                progress.again(RETRY)  # tried again, as the kubelet retries a failed sync
        refuse = dict(act.refuse)
        starts = act.start
        if unnamed is not None:  # nothing new can be created in the sandbox
            refuse.update((str(s.spec["name"]), unnamed) for s in starts)
            starts = ()
        progress.waiting.update(self._refuse(pod, refuse))
        for s in starts:
            await self.containers.start(pod, s, place, progress)

        fresh = None
        if progress.started or act.resize:
            # what this sync started or resized, in the status now rather than after the
            # PLEG's next relist (up to a period later; a resize changes no state it
            # would see at all): one pod_status call
            read_at = self.clock.monotonic()
            rs = await self.calls(self.runtime.pod_status(place.config.uid), "pod_status")
            fresh = (rs, read_at)
        self._resize_status(pod, rs, resize_error)
        self._publish(pod, rs, progress.waiting)
        idle = not (act.init_blocked or act.terminal or progress.waiting)
        return SyncResult(
            terminal=act.terminal,
            requeue_after=None if math.isinf(progress.requeue) else progress.requeue,
            wake=tuple(progress.wake), fresh=fresh,
            running=_all_running(pod, rs, place.sandbox.id) if idle else frozenset())

    async def _resize(self, pod: Pod, rs: PodRuntimeStatus, act: PodActions) -> str | None:
        """Carry out an in-place resize, the kubelet's way: memory, then CPU; for each,
        the pod cgroup's values that grow, then the containers (decreases first), then
        the pod cgroup's values that shrink; then the QoS cgroups. A memory limit that
        would go below what is used is refused first. Returns why it stopped (the rest
        is tried again at a later sync), None when it is done."""
        try:
            await self._check_memory(pod, rs, act)
            for resource in (rz.MEMORY, rz.CPU):
                updates = [r for r in act.resize if resource in r.resources]
                if not updates and not act.resize_restarts:
                    continue
                self.cgroups.resize(pod, resource, grow=True)
                for r in sorted(updates, key=lambda r: rz.grows(r.want, r.have, resource)):
                    await self.containers.resize(pod, r, resource)
                self.cgroups.resize(pod, resource, grow=False)
            self.cgroups.recount(pod)
        except (ContainerRuntimeError, CgroupError, rz.ResizeRefused) as e:
            log.info("pod %s: resize: %s", describe(pod), e)
            return str(e)
        return None

    async def _check_memory(self, pod: Pod, rs: PodRuntimeStatus, act: PodActions) -> None:
        """Refuse (ResizeRefused, the kubelet's message) a memory limit lowered to or
        below what the pod or the container uses now."""
        lowered = {r.container.id: (str(r.spec["name"]), want) for r in act.resize
                   if (want := r.want.memory_limit_bytes)
                   and (not r.have.memory_limit_bytes or want < r.have.memory_limit_bytes)}
        pod_limit = self.cgroups.memory_limit_lowered(pod)
        if not lowered and pod_limit is None:
            return
        meta = pod["metadata"]
        try:
            stats = await self.calls(self.runtime.container_stats(), "container_stats")
        except ContainerRuntimeError as e:
            raise rz.ResizeRefused(
                f'unable to read memory usage for pod "{meta["name"]}_'
                f'{meta.get("namespace", "default")}({meta["uid"]})"') from e
        usage = {s.container_id: s.memory_usage_bytes for s in stats}
        problems = []
        if pod_limit is not None:
            used = [usage.get(c.id) for c in rs.containers
                    if c.state == ContainerState.RUNNING]
            if not used or None in used:
                problems.append("missing pod memory usage")
            elif (total := sum(u for u in used if u is not None)) >= pod_limit:
                problems.append(f"attempting to set pod memory limit ({pod_limit}) below "
                                f"current usage ({total})")
        for cid, (name, want) in lowered.items():
            u = usage.get(cid)
            if u is None:
                problems.append(f'missing container "{name}" memory usage')
            elif u >= want:
                problems.append(f'attempting to set container "{name}" memory limit '
                                f"({want}) below current usage ({u})")
        if problems:
            raise rz.ResizeRefused("cannot decrease memory limits: " + (
                problems[0] if len(problems) == 1 else "[" + ", ".join(problems) + "]"))

    def _resize_status(self, pod: Pod, rs: PodRuntimeStatus, error: str | None) -> None:
        """PodResizeInProgress as the sync left the pod: Error with why, when the resize
        stopped (a ResizeError Event when that is new); set while a running container
        has not been given what is allocated; cleared once every one has (a
        ResizeCompleted Event)."""
        uid = str(pod["metadata"]["uid"])
        generation = int(pod["metadata"].get("generation") or 0)
        resizes = self.admission.resizes
        self.containers.prune_resized(uid, rs)
        if error is not None:
            gen, changed = resizes.set_in_progress(uid, rz.ERROR, error, generation)
            if changed:
                self._event(pod, WARNING, rz.ERRORED,
                            rz.event_message("Pod resize error", pod, gen, error))
        elif self._resizing(pod, rs):
            resizes.set_in_progress(uid, "", "", generation)
        else:
            gen, cleared = resizes.clear_in_progress(uid)
            if cleared:
                self._event(pod, NORMAL, rz.COMPLETED,
                            rz.event_message("Pod resize completed", pod, gen))

    def _resizing(self, pod: Pod, rs: PodRuntimeStatus) -> bool:
        """Whether a running resizable container has not been given what the pod's
        allocation says (the kubelet's IsPodResizeInProgress)."""
        resized = self.containers.resized(str(pod["metadata"]["uid"]))
        for spec in rz.resizable(pod):
            cur = max((c for c in rs.containers if c.name == spec.get("name")),
                      key=lambda c: c.attempt, default=None)
            if cur is not None and cur.state == ContainerState.RUNNING and rz.changed(
                    rz.wanted(spec), rz.applied(cur, resized) or Resources()):
                return True
        return False

    async def _place(self, pod: Pod, rs: PodRuntimeStatus, act: PodActions,
                     volumes: PodVolumes, progress: Progress) -> tuple[Place, str | None]:
        """The sandbox the containers go in, made if the actions say so; and why its
        names cannot be given, when they cannot."""
        for sid in act.stop_sandboxes:  # duplicates (e.g. an earlier crash mid-start)
            await self.calls(self.runtime.stop_sandbox(sid), "stop_sandbox")
        sandbox = act.sandbox
        if act.new_sandbox is not None:
            try:
                sandbox = await self.sandboxes.make(pod, act.new_sandbox, act.stop_first)
            except (ContainerRuntimeError, PodDnsError, NoRuntimeClass) as e:
                # as the kubelet: the containers stay ContainerCreating, an Event says why
                self._event(pod, WARNING, "FailedCreatePodSandBox",
                            f"Failed to create pod sandbox: {e}")
                self._publish(pod, rs, progress.waiting)
                raise  # retried with the pod worker's error back-off
        assert sandbox is not None
        unnamed = None
        try:
            sc = self.sandboxes.config(pod, sandbox.attempt)
        except PodDnsError as e:  # cannot happen for a sandbox we made; a spec edit?
            unnamed = str(e)
            sc = SandboxConfig.from_pod(pod, attempt=sandbox.attempt,
                                        log_root=self.settings.log_root)
            sc.cgroup_parent = self.cgroups.parent(pod)
        host_net = bool((pod.get("spec") or {}).get("hostNetwork"))
        pod_ip = self.settings.pod_ip(host_net, sandbox.ip)
        hip = self.settings.host_ip
        fields = {"spec.nodeName": self.settings.node_name, "status.hostIP": hip,
                  "status.hostIPs": hip, "status.podIP": pod_ip, "status.podIPs": pod_ip}
        return Place(sandbox, sc, volumes, fields), unnamed

    def _refuse(self, pod: Pod, refused: Mapping[str, str]) -> dict[str, Waiting]:
        """Containers that cannot be created: CreateContainerConfigError and a Warning
        each, naming why."""
        for name, message in refused.items():
            self.containers.warn(pod, name, f"Error: {message}")
        return {name: Waiting("CreateContainerConfigError", message)
                for name, message in refused.items()}

    async def _volumes(self, pod: Pod, rs: PodRuntimeStatus) -> PodVolumes | SyncResult:
        """The pod's volumes, set up; or, when they cannot be, the result of this sync:
        a volume this agent does not implement refuses the pod (CreateContainerConfigError
        naming it, a Warning Event per container), one that cannot be set up now waits
        (a FailedMount Event, tried again)."""
        uid = str(pod["metadata"]["uid"])
        # a node whose containers run nothing (virtual nodes) plans the volumes without
        # making them: nothing could read them, and no ConfigMap, Secret or token is read
        made = self.settings.runs_workloads
        if self.objects is not None:
            refs = env_refs(pod) | (self.volumes.refs(pod) if self.volumes and made else set())
            self.objects.track(uid, refs)
        spec = pod.get("spec") or {}
        try:
            if self.volumes is not None:
                return await self.volumes.setup(pod) if made else self.volumes.plan(pod)
            if spec.get("volumes"):
                raise VolumeRefused("spec.volumes: this agent was started without volume "
                                    "support")
            return PodVolumes()
        except VolumeRefused as e:
            self._publish(pod, rs, self._refuse(pod, {str(c["name"]): str(e)
                                                      for c in all_containers(pod)}))
            return SyncResult()
        except MountFailed as e:
            for volume, message in e.failures:
                log.info("pod %s: volume %s: %s", describe(pod), volume, message)
                self._event(pod, WARNING, "FailedMount",
                            f'MountVolume.SetUp failed for volume "{volume}" : {message}')
            self._publish(pod, rs, {})
            return SyncResult(requeue_after=self.MOUNT_RETRY)

    def _publish(self, pod: Pod, rs: PodRuntimeStatus, waiting: Mapping[str, Waiting],
                 terminal: bool = False, reason: str | None = None,
                 message: str | None = None, ending: Ending | None = None) -> None:
        uid = str(pod["metadata"]["uid"])
        resized = self.containers.resized(uid)
        applied = {c.id: r for c in rs.containers if c.state == ContainerState.RUNNING
                   and (r := rz.reported(c, resized)) is not None}
        st = compute_pod_status(pod, rs, host_ip=self.settings.host_ip,
                                scheme=self.runtime.scheme, now=self.clock.now(),
                                waiting=waiting, previous=self.status.previous(pod),
                                terminal=terminal,
                                probed=self.probes.readiness(pod, rs) if self.probes else None,
                                messages=self.containers.messages(pod, rs),
                                reason=reason, message=message, ending=ending,
                                applied=applied, resize=self.admission.resizes.of(uid))
        self.status.set_status(pod, st)

    def _event(self, pod: Pod, type_: str, reason: str, message: str) -> None:
        if self.events is not None:
            self.events.pod(pod, type_, reason, message)

    # --- stopping and forgetting ----------------------------------------------------

    async def terminate_pod(self, pod: Pod, grace: float,
                            ending: Ending | None = None) -> None:
        """Stop every container (preStop hooks, SIGTERM, SIGKILL after `grace`): the
        regular ones together, then the sidecars one by one in reverse order, in the time
        left; then the sandboxes. `ending`: the node stops the pod of its own accord
        (preempted, evicted): the pod's status says so first. Then the node's admission
        no longer counts the pod."""
        uid = pod["metadata"]["uid"]
        if self.probes is not None:
            self.probes.stop_liveness_and_startup(uid)
        rs = await self.calls(self.runtime.pod_status(uid), "pod_status")
        if ending is not None:
            log.info("pod %s: stopping: %s: %s", describe(pod), ending.reason, ending.message)
            self._publish(pod, rs, {}, ending=ending)
        spec = pod.get("spec") or {}
        pod_ip = self.settings.pod_ip(bool(spec.get("hostNetwork")), rs.ip)
        sidecars = [c["name"] for c in spec.get("initContainers") or [] if is_sidecar(c)]
        specs = {c.get("name"): c for c in all_containers(pod)}
        live = [c for c in rs.containers if c.state != ContainerState.EXITED]
        began = self.clock.monotonic()

        def stop(c: Container, left: float) -> Awaitable[None]:
            return self.containers.kill(pod, specs.get(c.name), c,
                                        f"Stopping container {c.name}", pod_ip, grace=left)
        await asyncio.gather(*(stop(c, grace) for c in live if c.name not in sidecars))
        for name in reversed(sidecars):
            for c in live:
                if c.name == name:
                    await stop(c, max(0.0, grace - (self.clock.monotonic() - began)))
        for s in rs.sandboxes:
            if s.state == SandboxState.READY:
                await self.calls(self.runtime.stop_sandbox(s.id), "stop_sandbox")
        self.admission.release(uid)

    def sync_terminated(self, pod: Pod, entry: CacheEntry, ending: Ending | None = None
                        ) -> None:
        """Final status (`ending`: the node ended the pod itself); the pod's cgroup
        removed (nothing of it runs any more; one that cannot be removed yet is tried
        again when the pod is cleaned up); a gracefully deleted API pod is then deleted
        for good."""
        uid = str(pod["metadata"]["uid"])
        try:
            self.cgroups.release(uid)
        except CgroupError as e:
            log.warning("pod %s: %s; tried again when the pod is cleaned up", describe(pod), e)
        if self.objects is not None:  # nothing will read its objects again
            self.objects.release(uid)
        if self.probes is not None:
            self.probes.remove(pod["metadata"]["uid"])
        self._publish(pod, entry.status, {}, terminal=True, ending=ending)
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            self.status.finish_deletion(pod)

    async def cleanup_pod(self, uid: str) -> None:
        """The pod is gone from every source: remove all its runtime objects and its
        volumes, then its cgroup (CgroupError when it cannot be removed yet: retried),
        and forget it."""
        await self.remove_content(uid)
        self.containers.forget(uid)
        self.status.forget(uid)
        self.admission.forget(uid)
        if self.probes is not None:
            self.probes.remove(uid)

    async def remove_content(self, uid: str) -> None:
        """Remove what the node holds of a stopped pod: its containers, sandboxes and
        volumes. Each removal is tried even after one failed: a container the runtime
        will not remove (containerd 1.6 refuses one whose start was cut short while its
        task exists, and then its sandbox too) holds back no other container, and every
        sandbox is still stopped. The failures are raised together, for the worker to
        retry."""
        rs = await self.calls(self.runtime.pod_status(uid), "pod_status")
        failures: list[str] = []

        async def attempt(call: Coroutine[Any, Any, None], what: str) -> None:
            try:
                await self.calls(call, what)
            except Exception as e:  # noqa: BLE001 - reported below, retried by the worker
                failures.append(f"{what}: {e}")
        for c in rs.containers:
            await attempt(self.runtime.remove_container(c.id), f"remove_container {c.id}")
        for s in rs.sandboxes:
            await attempt(self.runtime.stop_sandbox(s.id), f"stop_sandbox {s.id}")
            await attempt(self.runtime.remove_sandbox(s.id), f"remove_sandbox {s.id}")
        if failures:
            raise ContainerRuntimeError("; ".join(failures))
        self.cgroups.release(uid)  # after the sandbox: nothing of the pod is left in it
        if self.objects is not None:
            self.objects.release(uid)
        if self.volumes is not None:
            await self.volumes.teardown(uid)


def _all_running(pod: Pod, rs: PodRuntimeStatus, sandbox_id: str) -> frozenset[str]:
    """The sandbox's and its running containers' ids when every regular container of
    the pod runs in it (its latest attempt); else none."""
    latest: dict[str, Container] = {}
    for c in rs.containers:
        if c.sandbox_id == sandbox_id and (c.name not in latest
                                           or c.attempt > latest[c.name].attempt):
            latest[c.name] = c
    for c in (pod.get("spec") or {}).get("containers") or []:
        cur = latest.get(c["name"])
        if cur is None or cur.state != ContainerState.RUNNING:
            return frozenset()
    return frozenset([sandbox_id, *(c.id for c in latest.values()
                                    if c.state == ContainerState.RUNNING)])

