"""The sync loop: the one place where pod updates, PLEG events, resyncs and
housekeeping meet and turn into pod worker updates.

    sources' PodUpdates ──┐
    PLEG events ──────────┼─> SyncLoop ─> PodWorkers ─> runtime
    1 s tick: due resyncs ┤                   └─> StatusManager ─> API (pods/status)
    housekeeping ─────────┘  (orphans in the runtime are removed once sources are ready)

`SyncLoop` is also the composition root for this layer: hand it a runtime, a clock,
the merge's update queue and SourcesReady, and a Kube; it builds the PLEG, pod cache,
status manager, syncer and workers itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import Clock
from nodeagent.api.kube import Kube
from nodeagent.pleg import EventType, Pleg, PodLifecycleEvent
from nodeagent.podstatus import StatusManager
from nodeagent.runtime.base import LABEL_POD_NAME, LABEL_POD_NAMESPACE, Runtime
from nodeagent.sources.types import Op, PodUpdate, SourcesReady, pod_node_name
from nodeagent.workers import CrashBackoff, PodSyncer, PodWorkers, UpdateKind

log = logging.getLogger(__name__)

Pod = dict[str, Any]


@dataclass
class SyncLoopConfig:
    relist_period: float = 1.0         # PLEG relistPeriod
    relist_timeout: float = 30.0
    inspect_timeout: float = 10.0      # one pod's runtime status call
    inspect_concurrency: int = 8
    pleg_health_threshold: float = 180.0
    sync_frequency: float = 60.0       # periodic resync of each pod
    housekeeping_period: float = 2.0
    orphan_grace: float = 10.0         # stop timeout for containers of unknown pods
    call_timeout: float = 60.0         # any other runtime call
    log_root: str = ""                 # container logs (runtimes that write files)
    crash_backoff_initial: float = 10.0
    crash_backoff_max: float = 300.0
    crash_backoff_reset: float = 600.0


# per registry object (not id(): ids of dead registries are reused)
_HK: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()


def _housekeeping_counter(registry: CollectorRegistry) -> Counter:
    c = _HK.get(registry)
    if c is None:
        c = _HK[registry] = Counter(
            "nodepulse_housekeeping_orphans_total",
            "Pods found in the runtime that belong to no known pod, sent for removal.",
            ["node"], registry=registry)
    return c


class SyncLoop:
    def __init__(self, *, runtime: Runtime, clock: Clock, node_name: str,
                 updates: asyncio.Queue[PodUpdate], sources_ready: SourcesReady,
                 kube: Kube, answered: ApiAnswered | None = None, host_ip: str = "",
                 config: SyncLoopConfig | None = None,
                 registry: CollectorRegistry = REGISTRY,
                 pleg: Pleg | None = None,
                 events: asyncio.Queue[PodLifecycleEvent] | None = None) -> None:
        """Status goes to pods/status through `kube`. `pleg` and `events`: a PLEG
        shared by several nodes (NodeLoops runs it, routes its events to `events` and
        does the housekeeping)."""
        self.config = cfg = config or SyncLoopConfig()
        self.runtime = runtime
        self.clock = clock
        self.node_name = node_name
        self.updates = updates
        self.sources_ready = sources_ready
        self.shared = pleg is not None
        self.pleg = pleg or new_pleg(runtime, clock, node_name, cfg, registry)
        self.events = events if events is not None else self.pleg.events
        self.status = StatusManager(kube, clock, answered=answered, node=node_name,
                                    registry=registry)
        self.syncer = PodSyncer(runtime, self.status, clock, node_name=node_name,
                                host_ip=host_ip, call_timeout=cfg.call_timeout,
                                log_root=cfg.log_root,
                                backoff=CrashBackoff(clock, cfg.crash_backoff_initial,
                                                     cfg.crash_backoff_max,
                                                     cfg.crash_backoff_reset))
        self.workers = PodWorkers(self.syncer, self.pleg.cache, clock, node=node_name,
                                  sync_frequency=cfg.sync_frequency, registry=registry)
        self.pods: dict[str, Pod] = {}   # uid -> latest pod from the sources
        self._orphans = _housekeeping_counter(registry).labels(node=node_name)
        self._task: asyncio.Task[None] | None = None
        self._next_housekeeping = 0.0

    # --- health, for HealthServer.health_checks -------------------------------------

    def health(self) -> str | None:
        return self.pleg.health()

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self.run(), name=f"syncloop-{self.node_name}")
        return self._task

    async def stop(self) -> None:
        """Stop the loops. Pods keep running in the runtime (a new agent adopts them)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        if not self.shared:
            self.pleg.start()
        get_update = asyncio.ensure_future(self.updates.get())
        get_event = asyncio.ensure_future(self.events.get())
        # Loops sharing a PLEG are ticked by their NodeLoops: one timer, not one per node.
        tick = asyncio.ensure_future(self.clock.sleep(1.0) if not self.shared
                                     else asyncio.Event().wait())
        try:
            while True:
                done, _ = await asyncio.wait({get_update, get_event, tick},
                                             return_when=asyncio.FIRST_COMPLETED)
                if get_update in done:
                    self.handle_update(get_update.result())
                    get_update = asyncio.ensure_future(self.updates.get())
                if get_event in done:
                    self.handle_event(get_event.result())
                    get_event = asyncio.ensure_future(self.events.get())
                if tick in done:
                    self.workers.sync_due()
                    if self.clock.monotonic() >= self._next_housekeeping:
                        self._next_housekeeping = (self.clock.monotonic()
                                                   + self.config.housekeeping_period)
                        self.housekeeping()
                    tick = asyncio.ensure_future(self.clock.sleep(1.0))
        finally:
            for f in (get_update, get_event, tick):
                f.cancel()
            await self.workers.stop()
            await self.status.close()
            if not self.shared:
                await self.pleg.stop()

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
                log.warning("pod %s is bound to node %s, not %s; ignored", uid, node,
                            self.node_name)
                continue
            log.debug("pod %s (%s): %s from %s", uid, (pod.get("metadata") or {}).get("name"),
                      u.op, u.source)
            if u.op in (Op.ADD, Op.UPDATE):
                self.pods[uid] = pod
                if (pod.get("metadata") or {}).get("deletionTimestamp"):
                    self._kill(pod)
                else:
                    self.workers.update(pod, UpdateKind.SYNC)
            elif u.op == Op.DELETE:
                self.pods[uid] = pod
                self._kill(pod)
            elif u.op == Op.REMOVE:
                self.pods.pop(uid, None)
                self.workers.update(pod, UpdateKind.REMOVE)
            elif u.op == Op.RECONCILE:
                if uid in self.pods:
                    self.pods[uid] = pod
                self.status.reconcile(pod)

    def _kill(self, pod: Pod) -> None:
        grace = (pod.get("metadata") or {}).get("deletionGracePeriodSeconds")
        self.workers.update(pod, UpdateKind.KILL,
                            grace=None if grace is None else float(grace))

    def handle_event(self, ev: PodLifecycleEvent) -> None:
        if ev.type == EventType.CONTAINER_REMOVED:
            return  # removals are our own doing (pruning, cleanup); nothing to sync
        pod = self.pods.get(ev.pod_uid)
        if pod is not None:
            self.workers.update(pod, UpdateKind.SYNC)
        # events of pods no source knows are left to housekeeping

    # --- housekeeping ---------------------------------------------------------------

    def housekeeping(self) -> list[str]:
        """Send REMOVE for runtime pods that no source knows. Only once every source has
        delivered its first full set: before that, absence proves nothing."""
        return housekeeping(self.pleg, self.sources_ready, [self])

    def known_uids(self) -> set[str]:
        """Pods this loop is responsible for: from the sources, in work, just cleaned up
        (forgotten before the PLEG's last relist started are dropped: stale records)."""
        forgotten = self.workers.forgotten
        for uid in [u for u, t in forgotten.items() if t < self.pleg.last_result_at]:
            del forgotten[uid]
        return set(self.pods.keys() | self.workers.uids() | forgotten.keys())


def new_pleg(runtime: Runtime, clock: Clock, node: str, cfg: SyncLoopConfig,
             registry: CollectorRegistry) -> Pleg:
    return Pleg(runtime, clock, node=node, relist_period=cfg.relist_period,
                relist_timeout=cfg.relist_timeout, inspect_timeout=cfg.inspect_timeout,
                inspect_concurrency=cfg.inspect_concurrency,
                health_threshold=cfg.pleg_health_threshold, registry=registry)


def housekeeping(pleg: Pleg, sources_ready: SourcesReady, loops: Sequence[SyncLoop]) -> list[str]:
    """REMOVE for runtime pods that none of `loops` knows (all loops on one runtime:
    a pod of another node is not an orphan). The first loop's workers remove them."""
    if not sources_ready.all_ready():
        return []
    result = pleg.last_result
    if result is None or not loops:
        return []
    known: set[str] = set()
    for loop in loops:
        known |= loop.known_uids()
    first = loops[0]
    names: dict[str, tuple[str, str]] = {}
    for s in result.sandboxes:
        names.setdefault(s.pod_uid, (s.name, s.namespace))
    for c in result.containers:
        names.setdefault(c.pod_uid, (c.labels.get(LABEL_POD_NAME, ""),
                                     c.labels.get(LABEL_POD_NAMESPACE, "")))
    orphans = sorted(names.keys() - known)
    for uid in orphans:
        name, ns = names[uid]
        log.info("housekeeping: pod %s (%s/%s) runs but no source has it; removing",
                 uid, ns, name)
        first._orphans.inc()
        first.workers.update({"metadata": {"uid": uid, "name": name or uid,
                                           "namespace": ns or "default"},
                              "spec": {"terminationGracePeriodSeconds":
                                       first.config.orphan_grace}},
                             UpdateKind.REMOVE)
    return orphans


async def route_updates(updates: asyncio.Queue[PodUpdate],
                        targets: Mapping[str, asyncio.Queue[PodUpdate]]) -> None:
    """Virtual-node mode: one merge serves many nodes, one SyncLoop per node. Splits
    each PodUpdate by `spec.nodeName` onto that node's queue, keeping the order."""
    while True:
        u = await updates.get()
        by_node: dict[str, list[Pod]] = {}
        for pod in u.pods:
            node = pod_node_name(pod)
            if node in targets:
                by_node.setdefault(node, []).append(pod)
            else:
                log.warning("pod %s: node %r is not served here; ignored",
                            (pod.get("metadata") or {}).get("uid"), node)
        for node, pods in by_node.items():
            targets[node].put_nowait(PodUpdate(u.op, tuple(pods), u.source))


class NodeLoops:
    """Virtual-node mode: one PLEG over the shared runtime, one SyncLoop per node.

    The merge's updates are split per node by spec.nodeName; the PLEG's events go to
    the loop of the node that owns the pod (learnt from those updates); housekeeping
    runs once for all loops, so a pod of one node is never an orphan of another.
    Same interface as SyncLoop for Pods: start(), stop(), health().
    """

    def __init__(self, *, runtime: Runtime, clock: Clock, node_names: Sequence[str],
                 updates: asyncio.Queue[PodUpdate], sources_ready: SourcesReady,
                 kube: Kube, answered: ApiAnswered | None = None, host_ip: str = "",
                 config: SyncLoopConfig | None = None, label: str = "",
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.config = cfg = config or SyncLoopConfig()
        self.clock = clock
        self.updates = updates
        self.sources_ready = sources_ready
        self.pleg = new_pleg(runtime, clock, label, cfg, registry)
        self.loops: dict[str, SyncLoop] = {}
        self.owner: dict[str, str] = {}  # pod uid -> node, from the routed updates
        for name in node_names:
            self.loops[name] = SyncLoop(
                runtime=runtime, clock=clock, node_name=name, updates=asyncio.Queue(),
                sources_ready=sources_ready, kube=kube, answered=answered,
                host_ip=host_ip, config=cfg,
                registry=registry, pleg=self.pleg, events=asyncio.Queue())
        self._task: asyncio.Task[None] | None = None

    def health(self) -> str | None:
        return self.pleg.health()

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self.run(), name="syncloops")
        return self._task

    async def stop(self) -> None:
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
                 asyncio.create_task(self._tick(), name="resync-tick"),
                 *(loop.start() for loop in self.loops.values())]
        own = tasks[:4]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # a loop that ends is a failure: raise it
        finally:
            for t in own:
                t.cancel()
            await asyncio.gather(*own, return_exceptions=True)
            await asyncio.gather(*(loop.stop() for loop in self.loops.values()),
                                 return_exceptions=True)
            await self.pleg.stop()

    async def _route_updates(self) -> None:
        while True:
            self.route(await self.updates.get())

    def route(self, u: PodUpdate) -> None:
        by_node: dict[str, list[Pod]] = {}
        for pod in u.pods:
            node = pod_node_name(pod)
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            if node not in self.loops:
                log.warning("pod %s: node %r is not served here; ignored", uid, node)
                continue
            by_node.setdefault(node, []).append(pod)
            if uid:
                if u.op == Op.REMOVE:
                    self.owner.pop(uid, None)
                else:
                    self.owner[uid] = node
        for node, pods in by_node.items():
            self.loops[node].updates.put_nowait(PodUpdate(u.op, tuple(pods), u.source))

    async def _route_events(self) -> None:
        while True:
            ev = await self.pleg.events.get()
            node = self.owner.get(ev.pod_uid)
            if node is not None:
                self.loops[node].events.put_nowait(ev)
            # a pod no node knows: housekeeping removes it

    async def _housekeeping(self) -> None:
        while True:
            await self.clock.sleep(self.config.housekeeping_period)
            housekeeping(self.pleg, self.sources_ready, list(self.loops.values()))

    async def _tick(self) -> None:
        """Every loop's 1 s resync tick, from one timer."""
        while True:
            await self.clock.sleep(1.0)
            for loop in self.loops.values():
                loop.workers.sync_due()
