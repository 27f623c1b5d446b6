"""The sync loops: where pod updates, PLEG events, resyncs and housekeeping meet and
turn into pod worker updates.

    merge's PodUpdates ─> NodeLoops ─┬─> SyncLoop (node a) ─> PodWorkers ─> runtime
    PLEG events ────────>  (routing) ├─> SyncLoop (node b)        └─> StatusManager ─> API
    resync tick ──────────┤          └─> ...
    housekeeping ─────────┘  (orphans in the runtime, and the folders and cgroups of
                              pods nothing has, are removed once sources are ready)

`NodeLoops` runs one PLEG over the runtime for every node of the process (a host agent
is the case N=1): it routes each update to the SyncLoop of the pod's `spec.nodeName`
and each PLEG event to the loop of the node that owns the pod, ticks every loop's
resyncs from one timer, and does the housekeeping once for all (a pod of one node is
never an orphan of another). A `SyncLoop` is one node's: its pods, workers, syncer and
status manager, which the composition root builds (nodeagent.agent.build_node_loop)
when its node first has a pod: a process of thousands of virtual nodes, most of them idle, holds no
metric series for a node that never ran anything. It has no queue or task of its own:
the routing hands it each update and event (a hop through a queue and a task per node
cost every pod two more turns of the event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter

from nodeagent.api.clock import Clock
from nodeagent.api.kube import describe
from nodeagent.metrics import per_registry
from nodeagent.pods.cgroups import PodCgroups
from nodeagent.pods.eviction import REASON
from nodeagent.pods.gc import ACTIVE, TERMINATED
from nodeagent.pods.pleg import EventType, Pleg, PodLifecycleEvent
from nodeagent.pods.podstatus import Ending, StatusManager
from nodeagent.pods.podupdate import Op, Pod, PodUpdate, SourcesReady, pod_node_name
from nodeagent.pods.probes import ProbeManager
from nodeagent.pods.volumes import VolumeManager
from nodeagent.pods.workers import DueTimes, Phase, PodWorkers, UpdateKind
from nodeagent.runtime.base import (
    LABEL_POD_NAME,
    LABEL_POD_NAMESPACE,
    ContainerState,
    RelistResult,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeLoopsConfig:
    node_names: tuple[str, ...]
    housekeeping_period: float = 2.0
    orphan_grace: float = 10.0         # stop timeout for containers of unknown pods


@per_registry
def _housekeeping_counter(registry: CollectorRegistry) -> Counter:
    return Counter("nodepulse_housekeeping_orphans_total",
                   "Pods found in the runtime that belong to no known pod, sent for removal.",
                   ["node"], registry=registry)


class SyncLoop:
    """One node's loop: turns that node's updates and PLEG events (its NodeLoops routes
    them here) into pod worker updates."""

    def __init__(self, node_name: str, status: StatusManager, probes: ProbeManager,
                 workers: PodWorkers, registry: CollectorRegistry = REGISTRY) -> None:
        """`status`, `probes`, `workers`: the node's own, built by the composition root
        (nodeagent.agent.build_node_loop). A probe result that changes syncs the pod."""
        self.node_name = node_name
        self.status = status
        self.probes = probes
        self.workers = workers
        self.syncer = workers.syncer
        self.admission = workers.syncer.admission
        probes.on_change = self._probed
        self.admission.on_preempt = self._preempt
        self.admission.on_resize = self._resized
        self.pods: dict[str, Pod] = {}   # uid -> latest pod from the sources
        self._orphans = _housekeeping_counter(registry).labels(node=node_name)

    async def close(self) -> None:
        """Stop the workers, probes and status writes (pods keep running)."""
        await self.workers.stop()
        await self.probes.close()
        await self.status.close()

    # --- inputs ---------------------------------------------------------------------

    def handle_update(self, u: PodUpdate) -> None:
        for pod in u.pods:
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            if not uid:
                log.error("pod update %s from %s: a pod has no metadata.uid; ignored",
                          u.op, u.source)
                continue
            node = pod_node_name(pod)
            if node and node != self.node_name:
                log.warning("pod %s is bound to node %s, not %s; ignored", describe(pod), node,
                            self.node_name)
                continue
            log.debug("pod %s: %s from %s", describe(pod), u.op, u.source)
            if u.op in (Op.ADD, Op.UPDATE):
                self.pods[uid] = pod
                if u.op == Op.ADD:  # admitted or not when a first sync asks
                    self.admission.add(pod)
                    self.admission.resizes.backfill(pod)
                if (pod.get("metadata") or {}).get("deletionTimestamp"):
                    self._kill(pod)
                else:
                    self.workers.update(pod, UpdateKind.SYNC)
            elif u.op == Op.DELETE:
                self.pods[uid] = pod
                self._kill(pod)
            elif u.op == Op.REMOVE:
                self.pods.pop(uid, None)
                self.admission.withdraw(uid)
                self.workers.update(pod, UpdateKind.REMOVE)
            elif u.op == Op.RECONCILE:
                if uid in self.pods:
                    self.pods[uid] = pod
                self.status.reconcile(pod)
                if (pod.get("spec") or {}).get("readinessGates"):
                    # someone else's condition may have changed a gate: Ready follows
                    self._probed(uid)

    def active(self) -> list[Pod]:
        """The pods that have not ended: those a worker still runs or is stopping."""
        return [pod for uid, pod in self.pods.items()
                if self.workers.phase(uid) in (Phase.SYNCING, Phase.TERMINATING)]

    async def end(self, pod: Pod, grace: float, ending: Ending) -> None:
        """Stop the pod as the node's own decision (PodWorkers.end); returns once its
        final status is written."""
        await self.workers.end(pod, grace, ending)
        await self.status.written(pod["metadata"]["uid"])

    def _probed(self, uid: str) -> None:
        """A probe result (or a readiness gate) changed: the pod's worker syncs (its
        status, or a kill)."""
        pod = self.pods.get(uid)
        if pod is not None and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            self.workers.update(pod, UpdateKind.SYNC)

    def _kill(self, pod: Pod) -> None:
        grace = (pod.get("metadata") or {}).get("deletionGracePeriodSeconds")
        self.admission.withdraw(str(pod["metadata"]["uid"]))
        self.workers.update(pod, UpdateKind.KILL,
                            grace=None if grace is None else float(grace))

    def _resized(self, pod: Pod) -> None:
        """Admission allocated the pod's resize (room freed up), or its resize status
        changed: its worker syncs."""
        self._probed(str(pod["metadata"]["uid"]))

    def _preempt(self, pod: Pod, ending: Ending) -> None:
        """Admission stops the pod to make room for a critical one."""
        latest = self.pods.get(str(pod["metadata"]["uid"]), pod)
        self.workers.update(latest, UpdateKind.KILL, ending=ending)

    def handle_event(self, ev: PodLifecycleEvent) -> None:
        if ev.type == EventType.CONTAINER_REMOVED:
            return  # removals are our own doing (pruning, cleanup); nothing to sync
        if (ev.type == EventType.CONTAINER_STARTED
                and self.workers.saw_running(ev.pod_uid, ev.container_id)):
            return  # its last sync acted on it running (usually: that sync started it)
        pod = self.pods.get(ev.pod_uid)
        if pod is not None:
            self.workers.update(pod, UpdateKind.SYNC)
        # events of pods no source knows are left to housekeeping

    def known_uids(self, relisted_at: float) -> set[str]:
        """Pods this loop is responsible for: from the sources, in work, just cleaned up
        (forgotten before the PLEG's last relist started at `relisted_at` are dropped:
        stale records)."""
        forgotten = self.workers.forgotten
        for uid in [u for u, t in forgotten.items() if t < relisted_at]:
            del forgotten[uid]
        return set(self.pods.keys() | self.workers.uids() | forgotten.keys())



def remove_orphans(result: RelistResult, orphans: set[str], orphan_grace: float,
                   remover: Callable[[], SyncLoop]) -> list[str]:
    """REMOVE for the pods of `orphans` that the relist `result` found (all loops on one
    runtime: a pod of another node is not an orphan); the workers of the loop `remover`
    gives remove them."""
    if not orphans:
        return []
    names: dict[str, tuple[str, str]] = {}
    for s in result.sandboxes:
        if s.pod_uid in orphans:
            names.setdefault(s.pod_uid, (s.name, s.namespace))
    for c in result.containers:
        if c.pod_uid in orphans:
            names.setdefault(c.pod_uid, (c.labels.get(LABEL_POD_NAME, ""),
                                         c.labels.get(LABEL_POD_NAMESPACE, "")))
    first = remover()
    ordered = sorted(orphans)
    for uid in ordered:
        name, ns = names[uid]
        log.info("housekeeping: pod %s/%s (uid %s) runs but no source has it; removing",
                 ns, name, uid)
        first._orphans.inc()
        first.workers.update({"metadata": {"uid": uid, "name": name or uid,
                                           "namespace": ns or "default"},
                              "spec": {"terminationGracePeriodSeconds": orphan_grace}},
                             UpdateKind.REMOVE)
    return ordered


class NodeLoops:
    """One PLEG over the runtime, one SyncLoop per node (see the module docstring).

    The merge's updates are split per node by spec.nodeName; the PLEG's events go to
    the loop of the node that owns the pod (learnt from those updates).
    """

    TICK_MIN, TICK_MAX = 0.1, 1.0  # the resync tick's wait (_tick)

    def __init__(self, config: NodeLoopsConfig, make_loop: Callable[[str], SyncLoop],
                 pleg: Pleg, updates: asyncio.Queue[PodUpdate], sources_ready: SourcesReady,
                 clock: Clock, due_times: DueTimes,
                 volumes: VolumeManager | None = None,
                 cgroups: PodCgroups | None = None) -> None:
        """`make_loop(node)`: a node's SyncLoop (the composition root's); `due_times`:
        every loop's pods' resyncs, ticked here from one timer; `volumes` and
        `cgroups`: the pods' host folders and cgroups, cleaned of pods nobody has."""
        self.config = config
        self.make_loop = make_loop
        self.clock = clock
        self.pleg = pleg
        self.updates = updates
        self.sources_ready = sources_ready
        self.due_times = due_times
        self.volumes = volumes
        self.cgroups = cgroups
        self.node_names = frozenset(config.node_names)
        self.loops: dict[str, SyncLoop] = {}  # made by loop(): when a node first has a pod
        self.owner: dict[str, str] = {}  # pod uid -> node, from the routed updates
        self._task: asyncio.Task[None] | None = None

    def loop(self, node: str) -> SyncLoop:
        """The node's SyncLoop, made on first use."""
        loop = self.loops.get(node)
        if loop is None:
            loop = self.loops[node] = self.make_loop(node)
        return loop

    def objects_changed(self, uids: set[str]) -> None:
        """A ConfigMap or Secret these pods use changed: sync them (their volumes)."""
        for uid in uids:
            loop = self.loops.get(self.owner.get(uid, ""))
            pod = loop.pods.get(uid) if loop else None
            if loop is not None and pod is not None:
                loop.workers.update(pod, UpdateKind.SYNC)

    def health(self) -> str | None:
        """None when healthy; a HealthServer check (PLEG's)."""
        return self.pleg.health()

    # --- what the eviction manager and the garbage collector read and do -------------

    def nodes_with_pods(self) -> list[str]:
        return list(self.loops)

    def pods_of(self, node: str) -> list[Pod]:
        loop = self.loops.get(node)
        return list(loop.pods.values()) if loop else []

    def active_pods(self, node: str) -> list[Pod]:
        loop = self.loops.get(node)
        if loop is None:
            return []
        return [p for uid, p in loop.pods.items() if loop.workers.active(uid)
                and not (p.get("metadata") or {}).get("deletionTimestamp")
                and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]

    def running_containers(self, pod: Pod) -> list[tuple[str, str]]:
        rs = self.pleg.cache.get(str(pod["metadata"]["uid"])).status
        return [(c.id, c.name) for c in rs.containers if c.state == ContainerState.RUNNING]

    def evict(self, node: str, pod: Pod, grace: float, message: str) -> None:
        """Stop the pod within `grace`; it ends Failed, Evicted, and what it held is
        removed once it has stopped."""
        self.loop(node).workers.update(pod, UpdateKind.KILL, grace=grace, ending=Ending(
            REASON, message, disruption=message, remove_content=True))

    def cleaned_up(self, node: str, uid: str) -> bool:
        loop = self.loops.get(node)
        return loop is None or loop.workers.cleaned_up(uid)

    def last_relist(self) -> RelistResult | None:
        return self.pleg.last_result

    def pod_states(self) -> dict[str, str]:
        """uid -> ACTIVE or TERMINATED for every pod a loop knows."""
        out = {}
        for loop in self.loops.values():
            for uid in loop.pods.keys() | loop.workers.uids():
                out[uid] = TERMINATED if loop.workers.phase(uid) == Phase.TERMINATED \
                    else ACTIVE
        return out

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self.run(), name="syncloops")
        return self._task

    async def stop(self) -> None:
        """Stop the loops. Pods keep running in the runtime (a new agent adopts them)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        self.pleg.start()
        tasks = [asyncio.create_task(self._route_updates(), name="route-updates"),
                 asyncio.create_task(self._route_events(), name="route-events"),
                 asyncio.create_task(self._housekeeping(), name="housekeeping"),
                 asyncio.create_task(self._tick(), name="resync-tick")]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # they run until stopped: one that ends failed
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # together: each may wait for its runtime calls under way (PodWorkers.stop)
            await asyncio.gather(*(loop.close() for loop in self.loops.values()),
                                 return_exceptions=True)
            await self.pleg.stop()

    async def housekeeping(self) -> list[str]:
        """Removes the runtime's pods that no loop knows, and the folders and cgroups of
        pods that neither a loop nor the runtime has; returns the removed pods' uids
        (of the runtime's). Only once
        every source has delivered its first full set: before that, absence proves
        nothing."""
        result = self.pleg.last_result
        if result is None or not self.sources_ready.all_ready():
            return []
        at = self.pleg.last_result_at
        known: set[str] = set().union(*(loop.known_uids(at) for loop in self.loops.values()))
        in_runtime = ({s.pod_uid for s in result.sandboxes}
                      | {c.pod_uid for c in result.containers})
        orphans = remove_orphans(result, in_runtime - known, self.config.orphan_grace,
                                 lambda: self.loop(self.config.node_names[0]))
        if self.volumes is not None:  # on the volumes' threads: the disk may be slow
            await self.volumes.blocking(self.volumes.cleanup_orphans, known | in_runtime)
        if self.cgroups is not None:
            self.cgroups.housekeeping(known | in_runtime)
        return orphans

    async def _route_updates(self) -> None:
        while True:
            self.route(await self.updates.get())

    def route(self, u: PodUpdate) -> None:
        by_node: dict[str, list[Pod]] = {}
        for pod in u.pods:
            node = pod_node_name(pod)
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            if node not in self.node_names:
                log.warning("pod %s: node %r is not served here; ignored", describe(pod), node)
                continue
            by_node.setdefault(node, []).append(pod)
            if uid:
                if u.op == Op.REMOVE:
                    self.owner.pop(uid, None)
                else:
                    self.owner[uid] = node
        for node, pods in by_node.items():
            self.loop(node).handle_update(PodUpdate(u.op, tuple(pods), u.source))

    async def _route_events(self) -> None:
        while True:
            ev = await self.pleg.events.get()
            node = self.owner.get(ev.pod_uid)
            if node is not None:
                self.loops[node].handle_event(ev)
            elif ev.type == EventType.CONTAINER_STARTED:
                # a pod no node knows: housekeeping removes it, from a relist that
                # shows it (while events flow the next one is far off)
                self.pleg.relist_soon()

    async def _housekeeping(self) -> None:
        while True:
            await self.clock.sleep(self.config.housekeeping_period)
            await self.housekeeping()

    async def _tick(self) -> None:
        """Every loop's resync tick, from one timer. It wakes when the next pod is due,
        a tenth of a second at the soonest and a second at the latest: ticking each
        second, it took a second's due pods at once (bench.scale --churn, 3000 pods on
        100 nodes: 10-18 ms in which the event loop stood still and new pods waited)."""
        while True:
            wait = self.due_times.next() - self.clock.monotonic()
            await self.clock.sleep(min(self.TICK_MAX, max(self.TICK_MIN, wait)))
            self.due_times.sync_due(self.clock.monotonic())
