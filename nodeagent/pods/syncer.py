"""The syncer: what one sync of a pod does, turning its spec into runtime calls.

`PodSyncer` makes the runtime match the pod spec (sandbox, init containers in order,
containers, restartPolicy, CrashLoopBackOff, ephemeral containers once each; images
through the ImageManager, images.py), stops a pod within its grace period, cleans up a
removed one, and hands the resulting status to the StatusManager. It holds no per-pod
state but the crash backoff; the pod workers (workers.py) decide when it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
import os
import shutil
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nodeagent.api.client import brief
from nodeagent.api.clock import Clock, clock_timeout
from nodeagent.api.kube import RUNTIME_CLASSES, describe
from nodeagent.events import NORMAL, WARNING, Events
from nodeagent.pods import podspec
from nodeagent.pods.admission import AdmissionSettings, Rejection, admit
from nodeagent.pods.dns import (
    DnsSettings,
    PodDnsError,
    hostname_and_domain,
    hosts_file,
    kernel_hostname,
    pod_dns,
)
from nodeagent.pods.env import EnvResolver, env_refs, expand_command
from nodeagent.pods.handlers import Actions, Target
from nodeagent.pods.hooks import (
    DEADLINE_MESSAGE,
    DEADLINE_REASON,
    Hooks,
    cap_messages,
    termination_message,
    termination_mount,
)
from nodeagent.pods.images import ImageManager
from nodeagent.pods.objects import ObjectCache
from nodeagent.pods.pleg import CacheEntry, PodCache
from nodeagent.pods.podstatus import StatusManager, Waiting, compute_pod_status, is_sidecar
from nodeagent.pods.podupdate import Pod
from nodeagent.pods.probes import Kind, ProbeManager
from nodeagent.pods.volumes import MountFailed, PodVolumes, VolumeManager, VolumeRefused
from nodeagent.runtime.base import (
    Container,
    ContainerConfig,
    ContainerRuntimeError,
    ContainerState,
    ImageNotPresent,
    Mount,
    PodRuntimeStatus,
    Runtime,
    Sandbox,
    SandboxConfig,
    SandboxState,
    container_spec_hash,
    start_call,
)

log = logging.getLogger(__name__)

DEFAULT_MESSAGE_PATH = "/dev/termination-log"

T = TypeVar("T")


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


def remove_pod_files(pods_dir: str, uid: str) -> None:
    """What the agent wrote for a pod (termination-message files, its /etc/hosts)."""
    shutil.rmtree(os.path.join(pods_dir, uid, "containers"), ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(pods_dir, uid, "etc-hosts"))
    with contextlib.suppress(OSError):
        os.rmdir(os.path.join(pods_dir, uid))  # only when nothing else is left in it


# --- CrashLoopBackOff ---------------------------------------------------------------

CrashKey = tuple[str, str, str]  # pod uid, container name, container_spec_hash


def crash_key(uid: str, spec: Mapping[str, Any]) -> CrashKey:
    """A container's back-off key. Its definition is part of it, as in the kubelet's:
    a crash-looping container given a new image starts without the old delay."""
    return (uid, str(spec["name"]), container_spec_hash(spec))


class CrashBackoff:
    """Restart delays per container (crash_key): the first restart is immediate,
    then 10 s, 20 s, ... up to 5 min; a container that ran `reset_after` (10 min) since
    its last restart starts over."""

    def __init__(self, clock: Clock, initial: float = 10.0, maximum: float = 300.0,
                 reset_after: float = 600.0) -> None:
        self.clock = clock
        self.initial = initial
        self.maximum = maximum
        self.reset_after = reset_after
        self._e: dict[CrashKey, tuple[float, float]] = {}  # key -> (delay, last)

    def remaining(self, key: CrashKey) -> float:
        """Seconds until the container may be restarted (0: now)."""
        e = self._e.get(key)
        if e is None:
            return 0.0
        delay, last = e
        now = self.clock.monotonic()
        if now - last >= self.reset_after:
            return 0.0
        return max(0.0, last + delay - now)

    def delay(self, key: CrashKey) -> float:
        e = self._e.get(key)
        return e[0] if e else 0.0

    def restarted(self, key: CrashKey) -> None:
        now = self.clock.monotonic()
        e = self._e.get(key)
        if e is None or now - e[1] >= self.reset_after:
            self._e[key] = (self.initial, now)
        else:
            self._e[key] = (min(e[0] * 2, self.maximum), now)

    def forget(self, uid: str) -> None:
        for k in [k for k in self._e if k[0] == uid]:
            del self._e[k]


def _forget_call(inflight: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def done(call: asyncio.Future[Any]) -> None:
        inflight.discard(call)
        if not call.cancelled():
            call.exception()  # retrieved: a caller that was cancelled never will
    return done


# --- what one sync does -------------------------------------------------------------

@dataclass
class SyncResult:
    terminal: bool = False              # nothing will run again: move to terminating
    requeue_after: float | None = None  # sync again this soon (backoff, image wait)
    # sync again once any of these is done (image pulls under way)
    wake: tuple[asyncio.Future[None], ...] = ()
    # the sandbox and container ids running in the state this sync ended on, when it
    # left nothing to do (every container up): their start events bring nothing new
    running: frozenset[str] = frozenset()


@dataclass(frozen=True)
class NodePodSettings:
    """What the node adds to every pod it runs: admission, names and resolver, and
    where the files it writes for pods go."""
    dns: DnsSettings = field(default_factory=DnsSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    pods_dir: str = ""      # <root-dir>/pods: each pod's managed /etc/hosts ("": none)
    seccomp_root: str = ""  # <root-dir>/seccomp: where Localhost seccomp profiles are
    # False (virtual nodes and the fake runtime, whose containers run nothing): no
    # resolver configuration, volumes planned but not made (nothing could read them; no
    # ConfigMap, Secret or token read), no container lifecycle Events (`Pulled` for an
    # image already there, `Created`, `Started`: they would only load the API server)
    runs_workloads: bool = True


ETC_HOSTS = "/etc/hosts"


@dataclass
class _Plan:
    waiting: dict[str, Waiting] = field(default_factory=dict)
    requeue: float = math.inf
    # container name -> why it cannot be created (a field the agent does not honour)
    refused: dict[str, str] = field(default_factory=dict)
    volumes: PodVolumes = field(default_factory=PodVolumes)
    wake: list[asyncio.Future[None]] = field(default_factory=list)
    started: bool = False  # this sync started a container

    def again(self, seconds: float) -> None:
        self.requeue = min(self.requeue, seconds)


class PodSyncer:
    """Drives the runtime for one pod per call. Holds no per-pod state except the
    crash backoff."""

    IMAGE_RETRY = 10.0
    MOUNT_RETRY = 10.0  # a volume that could not be set up (an object's change is sooner)

    def __init__(self, runtime: Runtime, status: StatusManager, clock: Clock, *,
                 node_name: str = "", host_ip: str = "", call_timeout: float = 60.0,
                 log_root: str = "", backoff: CrashBackoff | None = None,
                 events: Events | None = None, images: ImageManager | None = None,
                 volumes: VolumeManager | None = None, env: EnvResolver | None = None,
                 objects: ObjectCache | None = None,
                 probes: ProbeManager | None = None, actions: Actions | None = None,
                 settings: NodePodSettings | None = None,
                 cache: PodCache | None = None) -> None:
        """`probes`: the node loop's probe manager (None: probes are not run, and a pod
        that has one is refused); `settings`: what the node adds to every pod, and
        where per-pod files live on the host (its pods_dir; "" for none)."""
        self.runtime = runtime
        self.settings = settings or NodePodSettings()
        self.status = status
        self.clock = clock
        self.node_name = node_name
        self.host_ip = host_ip
        self.call_timeout = call_timeout
        self.log_root = log_root
        self.backoff = backoff or CrashBackoff(clock)
        self.events = events
        self.volumes = volumes  # None: pods with volumes are refused
        self.env = env or EnvResolver()  # default: literal values and pod fields only
        self.objects = objects  # the ConfigMaps and Secrets pods use, watched
        self.images = images or ImageManager(runtime, clock, events=events,
                                             call_timeout=call_timeout)
        self.probes = probes
        self.cache = cache  # the PLEG's: what this sync reads fresh is written there too
        self.hooks = Hooks(actions or Actions(runtime), clock, events)
        self._inflight: set[asyncio.Future[Any]] = set()  # runtime calls under way
        # termination messages read, per pod uid and container id (read once: the file
        # of an exited container no longer changes)
        self._messages: dict[str, dict[str, str]] = {}

    async def _rt(self, aw: Coroutine[Any, Any, T], what: str, extra: float = 0.0) -> T:
        """One runtime call, bounded by the call timeout. Cancelling the caller (the
        agent stopping) does not cancel the call itself: a CRI StartContainer whose
        client goes away is aborted by containerd half-way, as a StartError, and the
        next agent has to restart that container. `drain` lets calls in flight end."""
        call = start_call(self.runtime, aw)
        if call.done():  # an inline runtime answered in this turn
            return call.result()
        self._inflight.add(call)
        call.add_done_callback(_forget_call(self._inflight))
        secs = self.call_timeout + extra
        try:
            return await clock_timeout(self.clock, asyncio.shield(call), secs,
                                       f"runtime {what}: no answer within {secs:.0f}s")
        except TimeoutError:
            call.cancel()  # timed out: the call itself is abandoned
            raise

    def in_flight(self) -> int:
        return sum(1 for c in self._inflight if not c.done())

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` s for the runtime calls in flight, then cancel the rest.
        Returns how many had to be cancelled."""
        pending = {c for c in self._inflight if not c.done()}
        if not pending:
            return 0
        log.info("waiting up to %.0fs for %d runtime call(s) in flight", timeout,
                 len(pending))
        with contextlib.suppress(TimeoutError):
            await clock_timeout(self.clock, asyncio.wait(pending), timeout,
                                "runtime calls in flight")
        left = [c for c in pending if not c.done()]
        for c in left:
            c.cancel()
        if left:
            log.warning("%d runtime call(s) still running after %.0fs; cancelled",
                        len(left), timeout)
            await asyncio.gather(*left, return_exceptions=True)
        return len(left)

    def _publish(self, pod: Pod, rs: PodRuntimeStatus, waiting: Mapping[str, Waiting],
                 terminal: bool = False, reason: str | None = None,
                 message: str | None = None) -> dict[str, Any]:
        st = compute_pod_status(pod, rs, host_ip=self.host_ip, scheme=self.runtime.scheme,
                                now=self.clock.now(), waiting=waiting,
                                previous=self.status.previous(pod), terminal=terminal,
                                probed=self.probes.readiness(pod, rs) if self.probes else None,
                                messages=self._termination_messages(pod, rs),
                                reason=reason, message=message)
        self.status.set_status(pod, st)
        return st

    def _termination_messages(self, pod: Pod, rs: PodRuntimeStatus) -> dict[str, str]:
        containers = all_containers(pod)
        by_name = {c.get("name"): c for c in containers}
        cache = self._messages.setdefault(str(pod["metadata"]["uid"]), {})
        for c in rs.containers:
            if c.state != ContainerState.EXITED or c.id in cache or c.name not in by_name:
                continue
            cache[c.id] = termination_message(self.settings.pods_dir, pod, by_name[c.name], c,
                                              self.runtime.log_format)
        for cid in cache.keys() - {c.id for c in rs.containers}:
            del cache[cid]  # pruned
        return cap_messages({k: v for k, v in cache.items() if v}, len(containers))

    def _deadline_left(self, pod: Pod, previous: Mapping[str, Any]) -> float | None:
        """Seconds until activeDeadlineSeconds runs out (from the pod's startTime)."""
        secs = (pod.get("spec") or {}).get("activeDeadlineSeconds")
        if secs is None:
            return None
        start = previous.get("startTime") or (pod.get("status") or {}).get("startTime")
        begun = dt.datetime.fromisoformat(str(start).replace("Z", "+00:00")) if start \
            else self.clock.now()
        return float(secs) - (self.clock.now() - begun).total_seconds()

    async def sync_pod(self, pod: Pod, entry: CacheEntry) -> SyncResult:
        """Make the runtime match the spec. Raises on a runtime failure (retried)."""
        if entry.error is not None:
            raise ContainerRuntimeError(f"runtime state of the pod is unknown: {entry.error}")
        rs = entry.status
        spec = pod.get("spec") or {}
        policy = spec.get("restartPolicy") or "Always"
        plan = _Plan()

        previous = self.status.previous(pod)
        if previous.get("phase") in ("Succeeded", "Failed"):
            return SyncResult(terminal=True)
        rejection = admit(pod, self.settings.admission)
        if rejection is not None:
            self._reject(pod, rejection)
            return SyncResult(terminal=True)
        left = self._deadline_left(pod, previous)
        if left is not None and left <= 0:
            log.info("pod %s: activeDeadlineSeconds passed; failing it", describe(pod))
            if self.events is not None:
                self.events.pod(pod, "Normal", DEADLINE_REASON, DEADLINE_MESSAGE)
            self._publish(pod, rs, plan.waiting, reason=DEADLINE_REASON,
                          message=DEADLINE_MESSAGE)
            return SyncResult(terminal=True)
        if left is not None:
            plan.again(left)
        if self.probes is not None:
            self.probes.update(pod)
        pod_refused = self._refusals(pod, plan)
        volumes = await self._volumes(pod, rs)
        if isinstance(volumes, SyncResult):
            return volumes
        plan.volumes = volumes
        if volumes.refresh_in is not None:  # a token to refresh: sync again by then
            plan.again(volumes.refresh_in + 0.5)

        ready = sorted((s for s in rs.sandboxes if s.state == SandboxState.READY),
                       key=lambda s: s.attempt, reverse=True)
        for extra in ready[1:]:  # duplicates (e.g. an earlier crash mid-start)
            await self._rt(self.runtime.stop_sandbox(extra.id), "stop_sandbox")
        sandbox = ready[0] if ready else None
        if sandbox is None:
            if rs.containers and policy == "Never" and any(
                    c.state == ContainerState.EXITED for c in rs.containers):
                # the sandbox died after containers ran; Never means no second run
                self._publish(pod, rs, plan.waiting)
                return SyncResult(terminal=True)
            if pod_refused:  # a pod-level field we cannot honour: no sandbox either
                self._refuse_all(pod, plan)
                self._publish(pod, rs, plan.waiting)
                return SyncResult()
            try:
                sandbox = await self._new_sandbox(pod, rs)
            except (ContainerRuntimeError, PodDnsError, _NoRuntimeClass) as e:
                # as the kubelet: the containers stay ContainerCreating, an Event says why
                self._warn(pod, "", f"Failed to create pod sandbox: {e}",
                           reason="FailedCreatePodSandBox")
                self._publish(pod, rs, plan.waiting)
                raise  # retried with the pod worker's error back-off
            current: list[Container] = []
        else:
            current = [c for c in rs.containers if c.sandbox_id == sandbox.id]
        try:
            sc = self._sandbox_config(pod, sandbox.attempt)
        except PodDnsError as e:  # cannot happen for a sandbox we made; a spec edit?
            plan.refused = {c["name"]: str(e) for c in all_containers(pod)}
            sc = SandboxConfig.from_pod(pod, attempt=sandbox.attempt, log_root=self.log_root)
        pod_ip = self.host_ip if spec.get("hostNetwork") else sandbox.ip
        fields = {"spec.nodeName": self.node_name, "status.hostIP": self.host_ip,
                  "status.hostIPs": self.host_ip, "status.podIP": pod_ip,
                  "status.podIPs": pod_ip}

        def latest(name: str, among: list[Container]) -> Container | None:
            cs = [c for c in among if c.name == name]
            return max(cs, key=lambda c: c.attempt) if cs else None

        def next_attempt(name: str) -> tuple[int, int]:
            prev = latest(name, rs.containers)
            return (0, 0) if prev is None else (prev.attempt + 1, prev.restart_count + 1)

        if ready:  # not in a sandbox made by this sync (the kubelet's rule too)
            await self._ephemeral(pod, rs, current, sandbox, sc, fields, plan)

        # init containers: one at a time, in order, each to success; a sidecar (a
        # restartable init container) to started, and kept running from then on
        initialized = any(c.name in {x["name"] for x in spec.get("containers") or []}
                          for c in current)
        init_blocked = False
        for ic in spec.get("initContainers") or []:
            cur = latest(ic["name"], current)
            if is_sidecar(ic):
                if await self._sidecar(pod, ic, cur, sandbox, sc, fields, plan,
                                       next_attempt) or initialized:
                    continue
                init_blocked = True
                break
            if initialized or (cur is not None and cur.state == ContainerState.EXITED
                               and cur.exit_code == 0):
                continue
            init_blocked = True
            if cur is None:
                attempt, restarts = next_attempt(ic["name"])
                await self._start(pod, ic, sandbox, sc, attempt, restarts, fields, plan,
                                  init=True)
            elif cur.state == ContainerState.EXITED:
                if policy == "Never":
                    self._publish(pod, rs, plan.waiting)
                    return SyncResult(terminal=True)
                await self._restart(pod, ic, cur, sandbox, sc, fields, plan, init=True)
            elif cur.state == ContainerState.CREATED:
                await self._start_created(pod, cur, plan)
            break
        if not init_blocked:
            for c in spec.get("containers") or []:
                cur = latest(c["name"], current)
                if cur is None:
                    attempt, restarts = next_attempt(c["name"])
                    await self._start(pod, c, sandbox, sc, attempt, restarts, fields, plan)
                elif cur.state == ContainerState.RUNNING:
                    if cur.spec_hash and cur.spec_hash != container_spec_hash(c):
                        log.info("pod %s container %s: spec changed, restarting",
                                 describe(pod), c["name"])
                        await self._kill(pod, c, cur, f"Container {c['name']} definition "
                                                      "changed, will be restarted", pod_ip)
                        await self._restart(pod, c, cur, sandbox, sc, fields, plan,
                                            backoff=False)
                    elif (kind := self._probe_failed(cur)) is not None:
                        restart = policy != "Never"
                        await self._kill(pod, c, cur, f"Container {c['name']} failed "
                                         f"{kind.value.lower()} probe"
                                         + (", will be restarted" if restart else ""),
                                         pod_ip, grace=self._probe_grace(pod, c, kind))
                elif cur.state == ContainerState.CREATED:
                    await self._start_created(pod, cur, plan)
                elif cur.state == ContainerState.EXITED:
                    code = cur.exit_code or 0
                    if policy == "Always" or (policy == "OnFailure" and code != 0):
                        await self._restart(pod, c, cur, sandbox, sc, fields, plan)
        await self._prune(rs, sandbox)

        terminal = self._all_done(pod, rs, current, init_blocked)
        if plan.started:
            # what this sync started, in the status now rather than after the PLEG's
            # next relist (up to a period later): one pod_status call. Into the cache
            # too: the kubelet API and the probes read it, and a client that sees
            # Running may exec or read logs at once
            read_at = self.clock.monotonic()
            rs = await self._rt(self.runtime.pod_status(sc.uid), "pod_status")
            if self.cache is not None:
                await self.cache.store(sc.uid, rs, None, read_at, done=False)
        self._publish(pod, rs, plan.waiting)
        return SyncResult(terminal=terminal,
                          requeue_after=None if math.isinf(plan.requeue) else plan.requeue,
                          wake=tuple(plan.wake),
                          running=frozenset() if init_blocked or terminal or plan.waiting
                          else _all_running(spec, rs, sandbox.id))

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
            waiting = {}
            for c in all_containers(pod):
                waiting[str(c["name"])] = Waiting("CreateContainerConfigError", str(e))
                self._warn(pod, str(c["name"]), f"Error: {e}")
            self._publish(pod, rs, waiting)
            return SyncResult()
        except MountFailed as e:
            for volume, message in e.failures:
                log.info("pod %s: volume %s: %s", describe(pod), volume, message)
                if self.events is not None:
                    self.events.pod(pod, WARNING, "FailedMount",
                                    f'MountVolume.SetUp failed for volume "{volume}" : '
                                    f"{message}")
            self._publish(pod, rs, {})
            return SyncResult(requeue_after=self.MOUNT_RETRY)

    async def _ephemeral(self, pod: Pod, rs: PodRuntimeStatus, current: list[Container],
                         sandbox: Sandbox, sc: SandboxConfig, fields: Mapping[str, str],
                         plan: _Plan) -> None:
        """The ephemeral containers (kubectl debug), added to the running pod: each
        created and started once, whatever the pod's restartPolicy, and never again
        once the runtime has any record of it (in any sandbox of the pod) or its status
        said it ran. One with a
        targetContainerName joins that container's process namespace."""
        spec = pod.get("spec") or {}
        # what ran already, also as reported (the runtime may have removed it since)
        ran = {c.name for c in rs.containers} | {
            s["name"] for s in self.status.previous(pod).get("ephemeralContainerStatuses")
            or [] if s.get("containerID")}
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
                          f"{target!r} is not running, so its process namespace cannot " \
                          "be joined"
                    plan.waiting[name] = Waiting("CreateContainerConfigError", why)
                    self._warn(pod, name, f"Error: {why}")
                    plan.again(self.IMAGE_RETRY)
                    continue
                target_id = max(running, key=lambda c: c.attempt).id
            await self._start(pod, ec, sandbox, sc, 0, 0, fields, plan, target_id=target_id)

    async def _sidecar(self, pod: Pod, ic: Mapping[str, Any], cur: Container | None,
                       sandbox: Sandbox, sc: SandboxConfig, fields: Mapping[str, str],
                       plan: _Plan, next_attempt: Callable[[str], tuple[int, int]]) -> bool:
        """Keep a sidecar running (whatever the pod's restartPolicy); True once it has
        started (its startup probe, if any, passed)."""
        name = str(ic["name"])
        sc_ip = fields.get("status.podIP", "")
        if cur is None:
            attempt, restarts = next_attempt(name)
            await self._start(pod, ic, sandbox, sc, attempt, restarts, fields, plan,
                              init=True)
            return False
        if cur.state == ContainerState.CREATED:
            await self._start_created(pod, cur, plan)
            return False
        if cur.state != ContainerState.RUNNING:
            await self._restart(pod, ic, cur, sandbox, sc, fields, plan, init=True)
            return False
        if cur.spec_hash and cur.spec_hash != container_spec_hash(ic):
            await self._kill(pod, ic, cur, f"Init container {name} definition changed",
                             sc_ip)
            return False
        kind = self._probe_failed(cur)
        if kind is not None:
            await self._kill(pod, ic, cur, f"Init container {name} failed "
                                           f"{kind.value.lower()} probe", sc_ip,
                             grace=self._probe_grace(pod, ic, kind))
            return False
        return self.probes is None or self.probes.started(str(pod["metadata"]["uid"]), cur)

    def _probe_failed(self, cur: Container) -> Kind | None:
        return self.probes.kill_reason(cur.id) if self.probes is not None else None

    @staticmethod
    def _probe_grace(pod: Pod, container: Mapping[str, Any], kind: Kind) -> float | None:
        """A probe's own terminationGracePeriodSeconds, when it sets one."""
        meta = pod.get("metadata") or {}
        if meta.get("deletionGracePeriodSeconds") is not None:
            return None
        v = (container.get(kind.field) or {}).get("terminationGracePeriodSeconds")
        return None if v is None else float(v)

    async def _kill(self, pod: Pod, spec: Mapping[str, Any] | None, cur: Container,
                    message: str, pod_ip: str, *, grace: float | None = None) -> None:
        """Stop one container as the kubelet kills it: a `Killing` Event, its preStop
        hook within the grace period, then SIGTERM and SIGKILL after what is left."""
        grace = grace_of(pod) if grace is None else grace
        if spec is not None:
            self.hooks.killing(pod, cur.name, message)
            grace = await self.hooks.pre_stop(pod, spec, Target(spec, cur.id, pod_ip), grace)
        await self._rt(self.runtime.stop_container(cur.id, grace), "stop_container", grace)

    def _all_done(self, pod: Pod, rs: PodRuntimeStatus, current: list[Container],
                  init_blocked: bool) -> bool:
        """Every container exited and none will be restarted."""
        spec = pod.get("spec") or {}
        policy = spec.get("restartPolicy") or "Always"
        if policy == "Always" or init_blocked:
            return False
        for c in spec.get("containers") or []:
            cs = [x for x in current if x.name == c["name"]]
            if not cs:
                return False
            cur = max(cs, key=lambda x: x.attempt)
            if cur.state != ContainerState.EXITED:
                return False
            if policy == "OnFailure" and (cur.exit_code or 0) != 0:
                return False
        return True

    # --- admission, refusals, the sandbox's names and resolver ----------------------

    def _reject(self, pod: Pod, r: Rejection) -> None:
        """The node does not admit the pod: phase Failed, the kubelet's reason, nothing
        started."""
        log.info("pod %s rejected: %s: %s", describe(pod), r.reason, r.message)
        if self.events is not None:
            self.events.pod(pod, WARNING, r.reason, r.message)
        self.status.set_status(pod, {"phase": "Failed", "reason": r.reason,
                                     "message": f"Pod was rejected: {r.message}"})

    def _refusals(self, pod: Pod, plan: _Plan) -> bool:
        """Fill plan.refused with the containers that cannot be created because of a
        field this agent does not honour; True when a pod-level field blocks them all."""
        problems = podspec.unhandled(pod)
        # what podspec's tables accept but this syncer's parts cannot do
        if (pod.get("spec") or {}).get("hostAliases") and not self.runtime.can_mount:
            problems.append(podspec.Unhandled(
                "spec.hostAliases", f"the {self.runtime.scheme} runtime runs containers in "
                "the node's filesystem and cannot give them an /etc/hosts of their own"))
        if self.probes is None:
            problems += [podspec.Unhandled(f"container {c.get('name')}: {kind.field}",
                                           "probes are not run by this agent's pod loop",
                                           str(c.get("name")))
                         for c in podspec_containers(pod) for kind in Kind
                         if c.get(kind.field) is not None]
        pod_level = next((p for p in problems if p.container is None), None)
        for p in problems:
            if p.container is not None:
                plan.refused.setdefault(p.container, p.message)
        if pod_level is not None:
            for c in all_containers(pod):
                plan.refused.setdefault(str(c.get("name")), pod_level.message)
        return pod_level is not None

    def _refuse_all(self, pod: Pod, plan: _Plan) -> None:
        for c in all_containers(pod):
            name = str(c.get("name"))
            if name in plan.refused:
                self._refuse(pod, name, plan)

    def _refuse(self, pod: Pod, name: str, plan: _Plan) -> None:
        message = plan.refused[name]
        plan.waiting[name] = Waiting("CreateContainerConfigError", message)
        self._warn(pod, name, f"Error: {message}")

    def _sandbox_config(self, pod: Pod, attempt: int) -> SandboxConfig:
        """The sandbox's config with the names the node gives it (hostname cut to 63
        characters, or the FQDN with setHostnameAsFQDN)."""
        sc = SandboxConfig.from_pod(pod, attempt=attempt, log_root=self.log_root)
        if not sc.host_network:
            host, domain = hostname_and_domain(pod, self.settings.dns.cluster_domain)
            sc.hostname = kernel_hostname(pod, host, domain)
        return sc

    async def _runtime_handler(self, pod: Pod) -> str:
        """The handler of the pod's RuntimeClass ("" without one)."""
        name = (pod.get("spec") or {}).get("runtimeClassName")
        if not name:
            return ""
        try:
            rc = await self.status.kube.get(RUNTIME_CLASSES, str(name), timeout=10.0)
        except Exception as e:
            raise _NoRuntimeClass(f"RuntimeClass {name!r} (spec.runtimeClassName): "
                                  f"{brief(e)}") from e
        return str(rc.get("handler") or "")

    async def _new_sandbox(self, pod: Pod, rs: PodRuntimeStatus) -> Sandbox:
        # anything left of an earlier sandbox is stopped first: containers never run
        # in two sandboxes of one pod at once
        for c in rs.containers:
            if c.state in (ContainerState.RUNNING, ContainerState.CREATED,
                           ContainerState.UNKNOWN):
                await self._rt(self.runtime.stop_container(c.id, grace_of(pod)),
                               "stop_container", grace_of(pod))
        attempt = max((s.attempt for s in rs.sandboxes), default=-1) + 1
        sc = self._sandbox_config(pod, attempt)
        if self.settings.runs_workloads:
            names = pod_dns(pod, self.settings.dns)
            for reason, message in names.warnings:
                self._warn(pod, "", message, reason=reason)
            sc.dns = names.config
        sc.runtime_handler = await self._runtime_handler(pod)
        sid = await self._rt(self.runtime.run_sandbox(sc), "run_sandbox")
        # the new sandbox's ip comes from the runtime; read it back once
        fresh = await self._rt(self.runtime.pod_status(sc.uid), "pod_status")
        for s in fresh.sandboxes:
            if s.id == sid:
                return s
        return Sandbox(id=sid, pod_uid=sc.uid, name=sc.name, namespace=sc.namespace,
                       attempt=attempt, state=SandboxState.READY,
                       host_network=sc.host_network)

    async def _restart(self, pod: Pod, spec: Mapping[str, Any], cur: Container,
                       sandbox: Sandbox, sc: SandboxConfig, fields: Mapping[str, str],
                       plan: _Plan, *, init: bool = False, backoff: bool = True) -> None:
        uid = pod["metadata"]["uid"]
        key = crash_key(uid, spec)
        if backoff:
            wait = self.backoff.remaining(key)
            if wait > 0:
                meta = pod["metadata"]
                plan.waiting[spec["name"]] = Waiting(
                    "CrashLoopBackOff",
                    f"back-off {self.backoff.delay(key):.0f}s restarting failed "
                    f"container={spec['name']} pod={meta['name']}_"
                    f"{meta.get('namespace', 'default')}({uid})")
                plan.again(wait)
                return
        await self._start(pod, spec, sandbox, sc, cur.attempt + 1, cur.restart_count + 1,
                          fields, plan, init=init, backoff_key=key if backoff else None)

    async def _start(self, pod: Pod, spec: Mapping[str, Any], sandbox: Sandbox,
                     sc: SandboxConfig, attempt: int, restarts: int,
                     fields: Mapping[str, str], plan: _Plan, *, init: bool = False,
                     backoff_key: CrashKey | None = None, target_id: str = "") -> None:
        """Create and start a container once its image is there. `backoff_key`: a restart
        after a crash, counted by the back-off when it is attempted (not while the image
        is being pulled for it); `target_id`: the container whose process namespace an
        ephemeral container joins."""
        name = str(spec["name"])
        if name in plan.refused:
            self._refuse(pod, name, plan)
            return
        image = await self.images.ensure(pod, spec)
        if not image.ready:
            if image.waiting is not None:
                plan.waiting[name] = image.waiting
            if image.failed and image.waiting is not None:
                self._warn(pod, name, f"Error: {image.waiting.reason}")
            if image.retry_after is not None:
                plan.again(image.retry_after)
            if image.pulling is not None:
                plan.wake.append(image.pulling)
            return
        if backoff_key is not None:
            self.backoff.restarted(backoff_key)
        try:
            env = await self.env.resolve(pod, spec, fields)
            mounts = self.volumes.mounts(pod, spec, plan.volumes, env) if self.volumes else []
            cfg = ContainerConfig.from_pod(pod, spec, attempt=attempt,
                                           restart_count=restarts, init=init, env=env,
                                           mounts=mounts,
                                           seccomp_root=self.settings.seccomp_root)
            cfg.target_id = target_id
            cfg.command, cfg.args = expand_command(spec, env)
            await self._check_non_root(pod, cfg)
            self._mount_etc_hosts(pod, spec, sandbox, sc, cfg)
            mount = self._message_mount(pod, spec, attempt)
            if mount is not None:
                cfg.mounts.append(mount)
        except (ValueError, OSError) as e:  # a spec we cannot run (bad quantity, ...)
            plan.waiting[name] = Waiting("CreateContainerConfigError", str(e))
            self._warn(pod, name, f"Error: {e}")
            plan.again(self.IMAGE_RETRY)
            return
        try:
            cid = await self._rt(self.runtime.create_container(sandbox.id, cfg, sc),
                                 "create_container")
        except ImageNotPresent as e:  # removed since the image manager saw it
            plan.waiting[name] = Waiting("ErrImagePull", str(e))
            self._warn(pod, name, "Error: ErrImagePull")
            plan.again(self.IMAGE_RETRY)
            return
        except ContainerRuntimeError as e:
            plan.waiting[name] = Waiting("CreateContainerError", str(e))
            self._warn(pod, name, f"Error: {e}")
            plan.again(self.IMAGE_RETRY)
            return
        self._note(pod, name, "Created", "Container created")
        try:
            await self._rt(self.runtime.start_container(cid), "start_container")
            plan.started = True
        except ContainerRuntimeError as e:
            # counts as a crash: the next attempt waits for the back-off
            plan.waiting[name] = Waiting("RunContainerError", str(e))
            self._warn(pod, name, f"Error: {e}")
            key = crash_key(sc.uid, spec)
            self.backoff.restarted(key)
            plan.again(max(1.0, self.backoff.remaining(key)))
            return
        self._note(pod, name, "Started", "Container started")
        pod_ip = fields.get("status.podIP", "")
        failed = await self.hooks.post_start(pod, spec, Target(spec, cid, pod_ip))
        if failed is not None:
            # the kubelet's reason for a container whose postStart hook failed
            started = Container(id=cid, sandbox_id=sandbox.id, pod_uid=sc.uid, name=name,
                                image=str(spec.get("image", "")),
                                state=ContainerState.RUNNING, attempt=attempt)
            await self._kill(pod, spec, started, "FailedPostStartHook", pod_ip)
            plan.waiting[name] = Waiting("PostStartHookError", failed)
            key = crash_key(sc.uid, spec)
            self.backoff.restarted(key)
            plan.again(max(1.0, self.backoff.remaining(key)))

    def _message_mount(self, pod: Pod, spec: Mapping[str, Any], attempt: int) -> Mount | None:
        """The termination-message file, where the runtime can mount it. A runtime that
        cannot (the process runtime) gets none for the API's default path, which every
        pod has, and refuses any other path."""
        path = spec.get("terminationMessagePath")
        if not path or not self.settings.pods_dir:
            return None
        if not self.runtime.can_mount:
            if path != DEFAULT_MESSAGE_PATH:
                raise ValueError(f"container {spec['name']}: terminationMessagePath "
                                 f"{path}: the {self.runtime.scheme} runtime cannot mount "
                                 "a file into a container")
            return None
        try:
            return termination_mount(self.settings.pods_dir, pod, spec, attempt)
        except OSError as e:
            raise ValueError(f"container {spec['name']}: terminationMessagePath: cannot "
                             f"create its file: {e}") from e

    def _note(self, pod: Pod, container: str, reason: str, message: str) -> None:
        """A Normal Event about a container's lifecycle, as the kubelet's."""
        if self.events is not None and self.settings.runs_workloads:
            self.events.pod(pod, NORMAL, reason, message, container=container)

    async def _check_non_root(self, pod: Pod, cfg: ContainerConfig) -> None:
        """runAsNonRoot: refused when the container would run as root, or as a user
        name whose uid cannot be known (the kubelet's rule and wording)."""
        sec = cfg.security
        if not sec.run_as_non_root:
            return
        meta = pod["metadata"]
        who = f'(pod: "{meta["name"]}_{meta.get("namespace") or "default"}' \
              f'({meta["uid"]})", container: {cfg.name})'
        if sec.run_as_user is not None:
            if sec.run_as_user == 0:
                raise ValueError(f"container's runAsUser breaks non-root policy {who}")
            return
        uid, user = await self._rt(self.runtime.image_user(cfg.image), "image_user")
        if uid is None and user:
            raise ValueError(f"container has runAsNonRoot and image has non-numeric user "
                             f"({user}), cannot verify user is non-root {who}")
        if not uid:  # 0, or no user in the image at all: root
            raise ValueError(f"container has runAsNonRoot and image will run as root {who}")

    def _mount_etc_hosts(self, pod: Pod, spec: Mapping[str, Any], sandbox: Sandbox,
                         sc: SandboxConfig, cfg: ContainerConfig) -> None:
        """The managed /etc/hosts (pod IP, hostname, FQDN, hostAliases; a host-network
        pod's is the node's own with the aliases), written under the pod's folder and
        mounted, unless the container mounts something at /etc/hosts itself."""
        if not self.settings.pods_dir or not self.runtime.can_mount:
            return
        if any(m.get("mountPath") == ETC_HOSTS for m in spec.get("volumeMounts") or []):
            return
        host_net = bool((pod.get("spec") or {}).get("hostNetwork"))
        ip = self.host_ip if host_net else sandbox.ip
        if not ip and not host_net:
            return  # no pod IP to name (the kubelet mounts none either)
        host, domain = hostname_and_domain(pod, self.settings.dns.cluster_domain)
        content = hosts_file(pod, [ip] if ip else [], host, domain,
                             self.settings.dns.node_hosts)
        path = os.path.join(self.settings.pods_dir, sc.uid, "etc-hosts")
        try:
            with open(path) as f:
                same = f.read() == content
        except OSError:
            same = False
        if not same:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                f.write(content)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        cfg.mounts.append(Mount(ETC_HOSTS, path))

    def _warn(self, pod: Pod, container: str, message: str, reason: str = "Failed") -> None:
        """A Warning Event on the pod about one container, as the kubelet's."""
        if self.events is not None:
            self.events.pod(pod, WARNING, reason, message, container=container)

    async def _start_created(self, pod: Pod, cur: Container, plan: _Plan) -> None:
        try:
            await self._rt(self.runtime.start_container(cur.id), "start_container")
            plan.started = True
        except ContainerRuntimeError as e:
            plan.waiting[cur.name] = Waiting("RunContainerError", str(e))
            self._warn(pod, cur.name, f"Error: {e}")
            await self._rt(self.runtime.remove_container(cur.id), "remove_container")
            key = (pod["metadata"]["uid"], cur.name, cur.spec_hash)
            self.backoff.restarted(key)
            plan.again(max(1.0, self.backoff.remaining(key)))

    async def _prune(self, rs: PodRuntimeStatus, sandbox: Sandbox) -> None:
        """Keep the newest exited attempt of each container (its lastState), remove
        older ones and containers of old, stopped sandboxes."""
        by_name: dict[str, list[Container]] = {}
        for c in rs.containers:
            by_name.setdefault(c.name, []).append(c)
        for cs in by_name.values():
            cs.sort(key=lambda c: c.attempt, reverse=True)
            exited = [c for c in cs if c.state == ContainerState.EXITED]
            keep = {cs[0].id} | ({exited[0].id} if exited else set())
            for c in exited:
                if c.id not in keep:
                    await self._rt(self.runtime.remove_container(c.id), "remove_container")
        for s in rs.sandboxes:
            if s.id != sandbox.id and s.state == SandboxState.NOTREADY and not any(
                    c.sandbox_id == s.id for c in rs.containers):
                await self._rt(self.runtime.remove_sandbox(s.id), "remove_sandbox")

    async def terminate_pod(self, pod: Pod, grace: float) -> None:
        """Stop every container (preStop hooks, SIGTERM, SIGKILL after `grace`): the
        regular ones together, then the sidecars one by one in reverse order, in the time
        left; then the sandboxes."""
        uid = pod["metadata"]["uid"]
        if self.probes is not None:
            self.probes.stop_liveness_and_startup(uid)
        rs = await self._rt(self.runtime.pod_status(uid), "pod_status")
        spec = pod.get("spec") or {}
        pod_ip = self._pod_ip(pod, rs.ip)
        sidecars = [c["name"] for c in spec.get("initContainers") or [] if is_sidecar(c)]
        specs = {c.get("name"): c for c in all_containers(pod)}
        live = [c for c in rs.containers if c.state != ContainerState.EXITED]
        began = self.clock.monotonic()

        def stop(c: Container, left: float) -> Awaitable[None]:
            return self._kill(pod, specs.get(c.name), c, f"Stopping container {c.name}",
                              pod_ip, grace=left)
        await asyncio.gather(*(stop(c, grace) for c in live if c.name not in sidecars))
        for name in reversed(sidecars):
            for c in live:
                if c.name == name:
                    await stop(c, max(0.0, grace - (self.clock.monotonic() - began)))
        for s in rs.sandboxes:
            if s.state == SandboxState.READY:
                await self._rt(self.runtime.stop_sandbox(s.id), "stop_sandbox")

    def _pod_ip(self, pod: Pod, sandbox_ip: str) -> str:
        return self.host_ip if (pod.get("spec") or {}).get("hostNetwork") else sandbox_ip

    def sync_terminated(self, pod: Pod, entry: CacheEntry) -> None:
        """Final status; a gracefully deleted API pod is then deleted for good."""
        if self.objects is not None:  # nothing will read its objects again
            self.objects.release(str(pod["metadata"]["uid"]))
        if self.probes is not None:
            self.probes.remove(pod["metadata"]["uid"])
        self._publish(pod, entry.status, {}, terminal=True)
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            self.status.finish_deletion(pod)

    async def cleanup_pod(self, uid: str) -> None:
        """The pod is gone from every source: remove all its runtime objects. Each
        removal is tried even after one failed: a container the runtime will not remove
        (containerd 1.6 refuses one whose start was cut short while its task exists, and
        then its sandbox too) holds back no other container, and every sandbox is still
        stopped. The failures are raised together, for the worker to retry."""
        rs = await self._rt(self.runtime.pod_status(uid), "pod_status")
        failures: list[str] = []

        async def attempt(call: Coroutine[Any, Any, None], what: str) -> None:
            try:
                await self._rt(call, what)
            except Exception as e:  # noqa: BLE001 - reported below, retried by the worker
                failures.append(f"{what}: {e}")
        for c in rs.containers:
            await attempt(self.runtime.remove_container(c.id), f"remove_container {c.id}")
        for s in rs.sandboxes:
            await attempt(self.runtime.stop_sandbox(s.id), f"stop_sandbox {s.id}")
            await attempt(self.runtime.remove_sandbox(s.id), f"remove_sandbox {s.id}")
        if failures:
            raise ContainerRuntimeError("; ".join(failures))
        if self.objects is not None:
            self.objects.release(uid)
        if self.volumes is not None:
            await self.volumes.teardown(uid)
        self.backoff.forget(uid)
        self.images.forget(uid)
        self.status.forget(uid)
        if self.probes is not None:
            self.probes.remove(uid)
        self._messages.pop(uid, None)
        if self.settings.pods_dir:  # the pod's files: termination messages, /etc/hosts
            remove_pod_files(self.settings.pods_dir, uid)


class _NoRuntimeClass(Exception):
    """The pod's RuntimeClass cannot be read."""


def _all_running(spec: Mapping[str, Any], rs: PodRuntimeStatus, sandbox_id: str
                 ) -> frozenset[str]:
    """The sandbox's and its running containers' ids when every regular container of
    `spec` runs in it (its latest attempt); else none."""
    latest: dict[str, Container] = {}
    for c in rs.containers:
        if c.sandbox_id == sandbox_id and (c.name not in latest
                                           or c.attempt > latest[c.name].attempt):
            latest[c.name] = c
    for c in spec.get("containers") or []:
        cur = latest.get(c["name"])
        if cur is None or cur.state != ContainerState.RUNNING:
            return frozenset()
    return frozenset([sandbox_id, *(c.id for c in latest.values()
                                    if c.state == ContainerState.RUNNING)])


def podspec_containers(pod: Pod) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def all_containers(pod: Pod) -> list[Mapping[str, Any]]:
    """The init, regular and ephemeral containers of the pod's spec."""
    return [*podspec_containers(pod), *((pod.get("spec") or {}).get("ephemeralContainers")
                                        or [])]
