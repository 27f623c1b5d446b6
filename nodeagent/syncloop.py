"""The sync loop: the one place where pod updates, PLEG events, resyncs and
housekeeping meet and turn into pod worker updates.

    sources' PodUpdates ──┐
    PLEG events ──────────┼─> SyncLoop ─> PodWorkers ─> runtime
    1 s tick: due resyncs ┤                   └─> StatusManager ─> API (pods/status)
    housekeeping ─────────┘  (orphans in the runtime are removed once sources are ready)

`SyncLoop` is also the composition root for this layer: hand it a runtime, a clock,
the merge's update queue and SourcesReady, and an ApiClient (or any PodStatusWriter);
it builds the PLEG, pod cache, status manager, syncer and workers itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from nodeagent.api.clock import Clock
from nodeagent.pleg import EventType, Pleg, PodLifecycleEvent
from nodeagent.podstatus import ApiStatusWriter, PodStatusWriter, StatusManager
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
                 api_client: k8s.ApiClient | None = None,
                 status_writer: PodStatusWriter | None = None, host_ip: str = "",
                 config: SyncLoopConfig | None = None,
                 registry: CollectorRegistry = REGISTRY) -> None:
        """Give `api_client` (status goes to pods/status through it) or, in tests, any
        `status_writer`."""
        if (api_client is None) == (status_writer is None):
            raise ValueError("SyncLoop: give exactly one of api_client or status_writer")
        self.config = cfg = config or SyncLoopConfig()
        self.runtime = runtime
        self.clock = clock
        self.node_name = node_name
        self.updates = updates
        self.sources_ready = sources_ready
        writer: PodStatusWriter
        if status_writer is not None:
            writer = status_writer
        else:
            assert api_client is not None
            writer = ApiStatusWriter(api_client)
        self.pleg = Pleg(runtime, clock, node=node_name, relist_period=cfg.relist_period,
                         relist_timeout=cfg.relist_timeout,
                         inspect_timeout=cfg.inspect_timeout,
                         inspect_concurrency=cfg.inspect_concurrency,
                         health_threshold=cfg.pleg_health_threshold, registry=registry)
        self.status = StatusManager(writer, clock, node=node_name, registry=registry)
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
        self.pleg.start()
        get_update = asyncio.ensure_future(self.updates.get())
        get_event = asyncio.ensure_future(self.pleg.events.get())
        tick = asyncio.ensure_future(self.clock.sleep(1.0))
        try:
            while True:
                done, _ = await asyncio.wait({get_update, get_event, tick},
                                             return_when=asyncio.FIRST_COMPLETED)
                if get_update in done:
                    self.handle_update(get_update.result())
                    get_update = asyncio.ensure_future(self.updates.get())
                if get_event in done:
                    self.handle_event(get_event.result())
                    get_event = asyncio.ensure_future(self.pleg.events.get())
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
        if not self.sources_ready.all_ready():
            return []
        result = self.pleg.last_result
        if result is None:
            return []
        # cleaned up after this relist started: its records are stale, not orphans
        since = self.pleg.last_result_at
        forgotten = self.workers.forgotten
        for uid in [u for u, t in forgotten.items() if t < since]:
            del forgotten[uid]
        known = self.pods.keys() | self.workers.uids() | forgotten.keys()
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
            self._orphans.inc()
            self.workers.update({"metadata": {"uid": uid, "name": name or uid,
                                              "namespace": ns or "default"},
                                 "spec": {"terminationGracePeriodSeconds":
                                          self.config.orphan_grace}},
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
