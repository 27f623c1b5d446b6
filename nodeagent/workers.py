"""Pod workers: one serialized worker per pod, latest update wins.

`PodWorkers` owns the per-pod lifecycle: syncing -> terminating -> terminated ->
removed. Each worker runs at most one sync at a time; updates that arrive while it
works collapse into one pending update (the newest), so a burst of N updates causes
at most 2 syncs. Before each sync the worker waits until the PLEG pod cache holds
runtime state read after its previous sync, so it never acts on what it did itself.

`PodSyncer` is what a sync does: make the runtime match the pod spec (sandbox, init
containers in order, containers, restartPolicy, CrashLoopBackOff, imagePullPolicy
against present images), stop a pod within its grace period, clean up a removed one,
and hand the resulting status to the StatusManager.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from nodeagent.api.clock import Clock, clock_timeout
from nodeagent.pleg import CacheEntry, PodCache
from nodeagent.podstatus import StatusManager, Waiting, compute_pod_status
from nodeagent.runtime.base import (
    Container,
    ContainerConfig,
    ContainerRuntimeError,
    ContainerState,
    ImageNotPresent,
    PodRuntimeStatus,
    Runtime,
    Sandbox,
    SandboxConfig,
    SandboxState,
    container_spec_hash,
)

log = logging.getLogger(__name__)

Pod = dict[str, Any]
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


def pull_policy(container: Mapping[str, Any]) -> str:
    """imagePullPolicy with the API's default (Always for :latest or no tag)."""
    p = container.get("imagePullPolicy")
    if p:
        return str(p)
    image = str(container.get("image", ""))
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return "IfNotPresent"
    tag = last.split(":", 1)[1] if ":" in last else "latest"
    return "Always" if tag == "latest" else "IfNotPresent"


# --- CrashLoopBackOff ---------------------------------------------------------------

class CrashBackoff:
    """Restart delays per (pod uid, container name): the first restart is immediate,
    then 10 s, 20 s, ... up to 5 min; a container that ran `reset_after` (10 min) since
    its last restart starts over."""

    def __init__(self, clock: Clock, initial: float = 10.0, maximum: float = 300.0,
                 reset_after: float = 600.0) -> None:
        self.clock = clock
        self.initial = initial
        self.maximum = maximum
        self.reset_after = reset_after
        self._e: dict[tuple[str, str], tuple[float, float]] = {}  # key -> (delay, last)

    def remaining(self, key: tuple[str, str]) -> float:
        """Seconds until the container may be restarted (0: now)."""
        e = self._e.get(key)
        if e is None:
            return 0.0
        delay, last = e
        now = self.clock.monotonic()
        if now - last >= self.reset_after:
            return 0.0
        return max(0.0, last + delay - now)

    def delay(self, key: tuple[str, str]) -> float:
        e = self._e.get(key)
        return e[0] if e else 0.0

    def restarted(self, key: tuple[str, str]) -> None:
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


@dataclass
class _Plan:
    waiting: dict[str, Waiting] = field(default_factory=dict)
    requeue: float = math.inf

    def again(self, seconds: float) -> None:
        self.requeue = min(self.requeue, seconds)


class PodSyncer:
    """Drives the runtime for one pod per call. Holds no per-pod state except the
    crash backoff."""

    IMAGE_RETRY = 10.0

    def __init__(self, runtime: Runtime, status: StatusManager, clock: Clock, *,
                 node_name: str = "", host_ip: str = "", call_timeout: float = 60.0,
                 log_root: str = "", backoff: CrashBackoff | None = None) -> None:
        self.runtime = runtime
        self.status = status
        self.clock = clock
        self.node_name = node_name
        self.host_ip = host_ip
        self.call_timeout = call_timeout
        self.log_root = log_root
        self.backoff = backoff or CrashBackoff(clock)
        self._inflight: set[asyncio.Future[Any]] = set()  # runtime calls under way

    async def _rt(self, aw: Awaitable[T], what: str, extra: float = 0.0) -> T:
        """One runtime call, bounded by the call timeout. Cancelling the caller (the
        agent stopping) does not cancel the call itself: a CRI StartContainer whose
        client goes away is aborted by containerd half-way, as a StartError, and the
        next agent has to restart that container. `drain` lets calls in flight end."""
        call = asyncio.ensure_future(aw)
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
                 terminal: bool = False) -> dict[str, Any]:
        st = compute_pod_status(pod, rs, host_ip=self.host_ip, scheme=self.runtime.scheme,
                                now=self.clock.now(), waiting=waiting,
                                previous=self.status.previous(pod), terminal=terminal)
        self.status.set_status(pod, st)
        return st

    async def sync_pod(self, pod: Pod, entry: CacheEntry) -> SyncResult:
        """Make the runtime match the spec. Raises on a runtime failure (retried)."""
        if entry.error is not None:
            raise ContainerRuntimeError(f"runtime state of the pod is unknown: {entry.error}")
        rs = entry.status
        spec = pod.get("spec") or {}
        uid = pod["metadata"]["uid"]
        policy = spec.get("restartPolicy") or "Always"
        plan = _Plan()

        previous = self.status.previous(pod)
        if previous.get("phase") in ("Succeeded", "Failed"):
            return SyncResult(terminal=True)

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
            sandbox = await self._new_sandbox(pod, rs)
            current: list[Container] = []
        else:
            current = [c for c in rs.containers if c.sandbox_id == sandbox.id]
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

        # init containers: one at a time, in order, each to success
        init_blocked = False
        for ic in spec.get("initContainers") or []:
            cur = latest(ic["name"], current)
            if cur is not None and cur.state == ContainerState.EXITED and cur.exit_code == 0:
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
                        log.info("pod %s container %s: spec changed, restarting", uid, c["name"])
                        await self._rt(self.runtime.stop_container(cur.id, grace_of(pod)),
                                       "stop_container", grace_of(pod))
                        await self._restart(pod, c, cur, sandbox, sc, fields, plan,
                                            backoff=False)
                elif cur.state == ContainerState.CREATED:
                    await self._start_created(pod, cur, plan)
                elif cur.state == ContainerState.EXITED:
                    code = cur.exit_code or 0
                    if policy == "Always" or (policy == "OnFailure" and code != 0):
                        await self._restart(pod, c, cur, sandbox, sc, fields, plan)
        await self._prune(rs, sandbox)

        terminal = self._all_done(pod, rs, current, init_blocked)
        self._publish(pod, rs, plan.waiting)
        return SyncResult(terminal=terminal,
                          requeue_after=None if math.isinf(plan.requeue) else plan.requeue)

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

    async def _new_sandbox(self, pod: Pod, rs: PodRuntimeStatus) -> Sandbox:
        # anything left of an earlier sandbox is stopped first: containers never run
        # in two sandboxes of one pod at once
        for c in rs.containers:
            if c.state in (ContainerState.RUNNING, ContainerState.CREATED,
                           ContainerState.UNKNOWN):
                await self._rt(self.runtime.stop_container(c.id, grace_of(pod)),
                               "stop_container", grace_of(pod))
        attempt = max((s.attempt for s in rs.sandboxes), default=-1) + 1
        sc = SandboxConfig.from_pod(pod, attempt=attempt, log_root=self.log_root)
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
        key = (uid, str(spec["name"]))
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
            self.backoff.restarted(key)
        await self._start(pod, spec, sandbox, sc, cur.attempt + 1, cur.restart_count + 1,
                          fields, plan, init=init)

    async def _start(self, pod: Pod, spec: Mapping[str, Any], sandbox: Sandbox,
                     sc: SandboxConfig, attempt: int, restarts: int,
                     fields: Mapping[str, str], plan: _Plan, *, init: bool = False) -> None:
        name = str(spec["name"])
        image = str(spec.get("image", ""))
        policy = pull_policy(spec)
        if not await self._rt(self.runtime.image_present(image), "image_present"):
            self._image_missing(name, image, policy, plan)
            return
        try:
            cfg = ContainerConfig.from_pod(pod, spec, attempt=attempt,
                                           restart_count=restarts, init=init,
                                           field_values=fields)
        except ValueError as e:  # a spec we cannot run (bad quantity, ...): say so
            plan.waiting[name] = Waiting("CreateContainerConfigError", str(e))
            plan.again(self.IMAGE_RETRY)
            return
        try:
            cid = await self._rt(self.runtime.create_container(sandbox.id, cfg, sc),
                                 "create_container")
        except ImageNotPresent:
            self._image_missing(name, image, policy, plan)
            return
        except ContainerRuntimeError as e:
            plan.waiting[name] = Waiting("CreateContainerError", str(e))
            plan.again(self.IMAGE_RETRY)
            return
        try:
            await self._rt(self.runtime.start_container(cid), "start_container")
        except ContainerRuntimeError as e:
            # counts as a crash: the next attempt waits for the back-off
            plan.waiting[name] = Waiting("RunContainerError", str(e))
            self.backoff.restarted((sc.uid, name))
            plan.again(max(1.0, self.backoff.remaining((sc.uid, name))))

    def _image_missing(self, name: str, image: str, policy: str, plan: _Plan) -> None:
        if policy == "Never":
            plan.waiting[name] = Waiting(
                "ErrImageNeverPull",
                f'Container image "{image}" is not present with pull policy of Never')
        else:
            plan.waiting[name] = Waiting(
                "ErrImagePull",
                f'Container image "{image}" is not present and this node does not pull '
                f"images (pull policy {policy}); import it into the container runtime")
        plan.again(self.IMAGE_RETRY)

    async def _start_created(self, pod: Pod, cur: Container, plan: _Plan) -> None:
        try:
            await self._rt(self.runtime.start_container(cur.id), "start_container")
        except ContainerRuntimeError as e:
            plan.waiting[cur.name] = Waiting("RunContainerError", str(e))
            await self._rt(self.runtime.remove_container(cur.id), "remove_container")
            key = (pod["metadata"]["uid"], cur.name)
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
        """Stop every container (SIGTERM, SIGKILL after `grace`) and the sandboxes."""
        uid = pod["metadata"]["uid"]
        rs = await self._rt(self.runtime.pod_status(uid), "pod_status")
        live = [c for c in rs.containers if c.state != ContainerState.EXITED]
        await asyncio.gather(*(self._rt(self.runtime.stop_container(c.id, grace),
                                        "stop_container", grace) for c in live))
        for s in rs.sandboxes:
            if s.state == SandboxState.READY:
                await self._rt(self.runtime.stop_sandbox(s.id), "stop_sandbox")

    def sync_terminated(self, pod: Pod, entry: CacheEntry) -> None:
        """Final status; a gracefully deleted API pod is then deleted for good."""
        self._publish(pod, entry.status, {}, terminal=True)
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            self.status.finish_deletion(pod)

    async def cleanup_pod(self, uid: str) -> None:
        """The pod is gone from every source: remove all its runtime objects."""
        rs = await self._rt(self.runtime.pod_status(uid), "pod_status")
        for c in rs.containers:
            await self._rt(self.runtime.remove_container(c.id), "remove_container")
        for s in rs.sandboxes:
            await self._rt(self.runtime.stop_sandbox(s.id), "stop_sandbox")
            await self._rt(self.runtime.remove_sandbox(s.id), "remove_sandbox")
        self.backoff.forget(uid)
        self.status.forget(uid)


# --- the workers --------------------------------------------------------------------

class UpdateKind(enum.StrEnum):
    SYNC = "sync"      # (re)sync the pod to its spec
    KILL = "kill"      # stop it: deleted gracefully, or ended
    REMOVE = "remove"  # gone from its source: stop, clean up, forget


class Phase(enum.StrEnum):
    SYNCING = "syncing"
    TERMINATING = "terminating"
    TERMINATED = "terminated"


@dataclass
class _Worker:
    uid: str
    pod: Pod
    phase: Phase = Phase.SYNCING
    pending: bool = False
    kill: bool = False
    removed: bool = False
    grace: float | None = None
    task: asyncio.Task[None] | None = None
    last_sync: float = -math.inf  # monotonic start of the last sync
    due: float = math.inf         # when a periodic or retry sync is due
    errors: int = 0
    syncs: int = 0
    # set once its containers are stopped for good: a successor with the same
    # namespace/name (an edited static pod gets a new uid) waits for it
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    killed: asyncio.Event = field(default_factory=asyncio.Event)  # a kill arrived

    @property
    def full_name(self) -> str:
        meta = self.pod.get("metadata") or {}
        return f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"


@dataclass
class _WorkerMetrics:
    syncs: Counter
    duration: Histogram
    workers: Gauge
    calls: Gauge


# per registry object (not id(): ids of dead registries are reused)
_WM: weakref.WeakKeyDictionary[CollectorRegistry, _WorkerMetrics] = weakref.WeakKeyDictionary()


def _worker_metrics(registry: CollectorRegistry) -> _WorkerMetrics:
    m = _WM.get(registry)
    if m is None:
        m = _WM[registry] = _WorkerMetrics(
            syncs=Counter("nodepulse_pod_worker_syncs_total",
                          "Pod worker syncs by lifecycle phase and result.",
                          ["node", "phase", "result"], registry=registry),
            duration=Histogram("nodepulse_pod_worker_sync_duration_seconds",
                               "Time one pod sync took.", ["node"], registry=registry),
            workers=Gauge("nodepulse_pod_workers", "Pod workers by lifecycle phase.",
                          ["node", "phase"], registry=registry),
            calls=Gauge("nodepulse_runtime_calls_in_flight",
                        "Runtime calls the pod workers have under way (what a stop waits "
                        "for).", ["node"], registry=registry))
    return m


class PodWorkers:
    def __init__(self, syncer: PodSyncer, cache: PodCache, clock: Clock, *,
                 node: str = "", sync_frequency: float = 60.0, error_initial: float = 1.0,
                 error_max: float = 60.0, drain_timeout: float = 15.0,
                 registry: CollectorRegistry = REGISTRY) -> None:
        """`drain_timeout`: on stop, how long runtime calls in flight may still run."""
        self.syncer = syncer
        self.cache = cache
        self.clock = clock
        self.node = node
        self.sync_frequency = sync_frequency
        self.error_initial = error_initial
        self.error_max = error_max
        self.drain_timeout = drain_timeout
        self._w: dict[str, _Worker] = {}
        # uid -> when its worker finished cleaning up; a relist older than that still
        # shows the pod, which housekeeping must not take for an orphan
        self.forgotten: dict[str, float] = {}
        self._m = _worker_metrics(registry)
        for ph in Phase:
            self._m.workers.labels(node=node, phase=ph.value).set_function(
                self._counter(ph))
        self._m.calls.labels(node=node).set_function(lambda: float(syncer.in_flight()))

    def _counter(self, ph: Phase) -> Callable[[], float]:
        return lambda: float(sum(1 for w in self._w.values() if w.phase == ph))

    # --- queries --------------------------------------------------------------------

    def __contains__(self, uid: str) -> bool:
        return uid in self._w

    def uids(self) -> set[str]:
        return set(self._w)

    def phase(self, uid: str) -> Phase | None:
        w = self._w.get(uid)
        return w.phase if w else None

    def syncs(self, uid: str) -> int:
        w = self._w.get(uid)
        return w.syncs if w else 0

    def due(self) -> list[str]:
        """Pods whose periodic resync or retry time has come and that are idle."""
        now = self.clock.monotonic()
        return [w.uid for w in self._w.values()
                if w.due <= now and not w.pending and (w.task is None or w.task.done())]

    # --- updates --------------------------------------------------------------------

    def update(self, pod: Pod, kind: UpdateKind = UpdateKind.SYNC,
               grace: float | None = None) -> None:
        uid = pod["metadata"]["uid"]
        w = self._w.get(uid)
        if w is None:
            # also for REMOVE of a pod never seen: the runtime may hold its containers
            w = self._w[uid] = _Worker(uid, pod)
        log.debug("pod %s: %s update (phase %s, running=%s)", uid, kind.value, w.phase.value,
                  w.task is not None and not w.task.done())
        w.pod = pod  # latest wins
        if kind in (UpdateKind.KILL, UpdateKind.REMOVE):
            w.kill = True
            w.killed.set()
            if grace is not None:
                w.grace = grace if w.grace is None else min(w.grace, grace)
        if kind == UpdateKind.REMOVE:
            w.removed = True
        w.pending = True
        if w.task is None or w.task.done():
            w.task = asyncio.create_task(self._run(w), name=f"pod-worker-{uid}")

    def sync_due(self) -> list[str]:
        """Queue a sync for every pod that is due; returns their uids."""
        uids = self.due()
        for uid in uids:
            self.update(self._w[uid].pod)
        return uids

    async def stop(self) -> None:
        """Stop the workers; runtime calls they had under way may end (see drain), so
        the runtime is never left with a change cut off half-way."""
        tasks = [w.task for w in self._w.values() if w.task and not w.task.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.syncer.drain(self.drain_timeout)

    # --- the worker loop ------------------------------------------------------------

    async def _run(self, w: _Worker) -> None:
        try:
            while w.pending:
                if w.syncs == 0 and not w.kill:
                    await self._wait_for_predecessor(w)
                w.pending = False
                entry = await self._entry(w)
                w.syncs += 1
                await self._step(w, entry)
                # after the step: the next sync needs a relist that saw what it did
                w.last_sync = self.clock.monotonic()
                if self._w.get(w.uid) is not w:
                    return
        except asyncio.CancelledError:
            raise
        except Exception:  # _step handles sync errors; this is a bug: keep the pod due
            log.exception("pod %s: worker failed", w.uid)
            w.due = self.clock.monotonic() + self.error_max

    async def _entry(self, w: _Worker) -> CacheEntry:
        """The pod's runtime state from a relist newer than the last sync. A stop reads
        the runtime itself, so a kill never waits for that relist (also when it
        arrives during the wait): the grace period starts at the delete."""
        if w.kill and w.phase in (Phase.SYNCING, Phase.TERMINATING):
            return self.cache.get(w.uid)
        if w.kill:
            return await self.cache.get_newer_than(w.uid, w.last_sync)
        newer = asyncio.ensure_future(self.cache.get_newer_than(w.uid, w.last_sync))
        killed = asyncio.ensure_future(w.killed.wait())
        try:
            await asyncio.wait({newer, killed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            killed.cancel()
            if not newer.done():
                newer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await newer
        return newer.result() if not newer.cancelled() else self.cache.get(w.uid)

    async def _wait_for_predecessor(self, w: _Worker) -> None:
        """A pod replacing another of the same name (REMOVE old, ADD new) starts only
        once the old one's containers are stopped: both would claim the same host
        ports and names."""
        for other in list(self._w.values()):
            if other is not w and other.kill and other.full_name == w.full_name:
                log.info("pod %s (%s): waiting for pod %s of the same name to stop",
                         w.uid, w.full_name, other.uid)
                await other.stopped.wait()

    async def _step(self, w: _Worker, entry: CacheEntry) -> None:
        started = self.clock.monotonic()
        phase = w.phase
        log.debug("pod %s: %s step (kill=%s removed=%s)", w.uid, phase.value, w.kill,
                  w.removed)
        try:
            requeue = self.sync_frequency
            if w.phase == Phase.SYNCING and w.kill:
                w.phase = Phase.TERMINATING
            if w.phase == Phase.SYNCING:
                res = await self.syncer.sync_pod(w.pod, entry)
                if res.terminal:
                    w.phase = Phase.TERMINATING
                    w.pending = True  # go on terminating at once
                elif res.requeue_after is not None:
                    requeue = min(requeue, res.requeue_after)
            elif w.phase == Phase.TERMINATING:
                await self.syncer.terminate_pod(w.pod, grace_of(w.pod, w.grace))
                w.phase = Phase.TERMINATED
                w.stopped.set()
                w.pending = True  # one more pass with fresh state for the final status
            elif w.phase == Phase.TERMINATED:
                if not w.removed:  # a removed pod has no API object to write to
                    self.syncer.sync_terminated(w.pod, entry)
                if w.removed:
                    await self.syncer.cleanup_pod(w.uid)
                    self.cache.delete(w.uid)
                    del self._w[w.uid]
                    self.forgotten[w.uid] = self.clock.monotonic()
                    log.debug("pod %s: removed, worker forgotten", w.uid)
            w.errors = 0
            w.due = self.clock.monotonic() + requeue
            self._m.syncs.labels(node=self.node, phase=phase.value, result="ok").inc()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            w.errors += 1
            delay = min(self.error_initial * 2 ** (w.errors - 1), self.error_max)
            w.due = self.clock.monotonic() + delay
            self._m.syncs.labels(node=self.node, phase=phase.value, result="error").inc()
            log.warning("pod %s: %s sync failed (%s); retry in %.0fs", w.uid, phase.value,
                        e, delay)
        finally:
            self._m.duration.labels(node=self.node).observe(self.clock.monotonic() - started)
