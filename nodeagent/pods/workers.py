"""Pod workers: one serialized worker per pod, latest update wins.

`PodWorkers` owns the per-pod lifecycle: syncing -> terminating -> terminated ->
removed. Each worker runs at most one sync at a time; updates that arrive while it
works collapse into one pending update (the newest), so a burst of N updates causes
at most 2 syncs. Before each sync the worker waits until the PLEG pod cache holds
runtime state read after its previous sync, so it never acts on what it did itself.
What a sync does is the syncer's (syncer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import heapq
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from nodeagent.api.clock import Clock
from nodeagent.api.kube import describe
from nodeagent.metrics import per_registry
from nodeagent.pods.decide import grace_of
from nodeagent.pods.pleg import CacheEntry, PodCache
from nodeagent.pods.podstatus import Ending
from nodeagent.pods.podupdate import Pod, pod_full_name
from nodeagent.pods.settings import PodTiming
from nodeagent.pods.syncer import PodSyncer

log = logging.getLogger(__name__)


# --- the workers --------------------------------------------------------------------

def _spread(uid: str, n: int) -> float:
    """A number in [0, 1) that looks random across pods and syncs, and is the same on
    every run (no generator per node: a Random is 2.5 KB)."""
    digest = hashlib.blake2b(f"{uid}/{n}".encode(), digest_size=4).digest()
    return int.from_bytes(digest) / 2**32


class DueTimes:
    """When pod workers are next due (a periodic resync or a retry), for every node's
    PodWorkers at once: one heap, so a tick costs the pods due, not the nodes. An entry
    whose worker was made due again since, or is gone, is dropped when its time comes."""

    def __init__(self) -> None:
        # (due, push order, uid, workers): the order keeps ties off the PodWorkers
        self._heap: list[tuple[float, int, str, PodWorkers]] = []
        self._order = itertools.count()

    def push(self, due: float, workers: PodWorkers, uid: str) -> None:
        heapq.heappush(self._heap, (due, next(self._order), uid, workers))

    def next(self) -> float:
        """When the next pod may be due (inf: none is)."""
        return self._heap[0][0] if self._heap else math.inf

    def sync_due(self, now: float) -> None:
        """Queue a sync for every idle pod whose time has come."""
        while self._heap and self._heap[0][0] <= now:
            due, _, uid, workers = heapq.heappop(self._heap)
            workers.sync_if_due(uid, due)


class Latch:
    """A flag set once that can be awaited, as asyncio.Event, but holding no list of
    waiters until one waits: a pod worker has three, thousands of workers a process."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[asyncio.Future[None]] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        for f in self._waiters or ():
            if not f.done():
                f.set_result(None)
        self._waiters = None

    async def wait(self) -> None:
        if self._set:
            return
        f = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(f)
        try:
            await f
        finally:
            if self._waiters is not None and f in self._waiters:
                self._waiters.remove(f)


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
    # the node ends it of its own accord (preempted, evicted, shut down)
    ending: Ending | None = None
    content_removed: bool = False    # its containers and volumes are gone (the ending's)
    task: asyncio.Task[None] | None = None
    last_sync: float = -math.inf  # monotonic start of the last sync
    due: float = math.inf         # when a periodic or retry sync is due
    errors: int = 0
    syncs: int = 0
    running: frozenset[str] = frozenset()  # see SyncResult.running, from the last step
    # set once its containers are stopped for good: a successor with the same
    # namespace/name (an edited static pod gets a new uid) waits for it
    stopped: Latch = field(default_factory=Latch)
    killed: Latch = field(default_factory=Latch)  # a kill arrived
    ended: Latch = field(default_factory=Latch)  # final status handed on



@dataclass
class _WorkerMetrics:
    syncs: Counter
    duration: Histogram
    workers: Gauge
    calls: Gauge


@per_registry
def _worker_metrics(registry: CollectorRegistry) -> _WorkerMetrics:
    return _WorkerMetrics(
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


class PodWorkers:
    def __init__(self, syncer: PodSyncer, cache: PodCache, clock: Clock, *,
                 node: str = "", timing: PodTiming | None = None,
                 due_times: DueTimes | None = None,
                 registry: CollectorRegistry = REGISTRY) -> None:
        """`due_times`: where its pods' resync and retry times go (one for every
        PodWorkers of a process: NodeLoops ticks them). A pod's periodic resync comes up
        to `timing.resync_jitter` of `timing.sync_frequency` later (the kubelet's: half,
        at random), so pods started together are not all resynced together."""
        self.syncer = syncer
        self.cache = cache
        self.clock = clock
        self.node = node
        self.timing = timing or PodTiming()
        self.due_times = due_times or DueTimes()
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

    def active(self, uid: str) -> bool:
        """Syncing, with no stop asked for."""
        w = self._w.get(uid)
        return w is not None and w.phase == Phase.SYNCING and not w.kill

    def cleaned_up(self, uid: str) -> bool:
        """Stopped, with what its final status said to remove removed (or forgotten)."""
        w = self._w.get(uid)
        return w is None or (w.phase == Phase.TERMINATED and (
            w.ending is None or not w.ending.remove_content or w.content_removed))

    def saw_running(self, uid: str, container_id: str) -> bool:
        """Whether the pod's last sync ended on this sandbox or container running,
        with nothing left to do: an event saying it started needs no sync (ids are
        never reused, so a restart is a new id)."""
        w = self._w.get(uid)
        return w is not None and container_id in w.running

    def sync_if_due(self, uid: str, due: float) -> None:
        """Queue a sync of the pod if it is still due at `due` (not made due again
        since, nor gone) and idle (a busy worker is made due again when its step
        ends)."""
        w = self._w.get(uid)
        if (w is not None and w.due == due and not w.pending
                and (w.task is None or w.task.done())):
            self.update(w.pod)

    def _make_due(self, w: _Worker, delay: float) -> None:
        w.due = self.clock.monotonic() + delay
        self.due_times.push(w.due, self, w.uid)

    # --- updates --------------------------------------------------------------------

    def update(self, pod: Pod, kind: UpdateKind = UpdateKind.SYNC,
               grace: float | None = None, ending: Ending | None = None) -> None:
        """`grace`: a KILL's or REMOVE's grace period (the shortest one asked wins);
        `ending`: a KILL the node itself decided (preemption, eviction, shutdown): what
        the pod's status says from the start of the stop on (the first one asked for
        wins; none once the pod has stopped)."""
        uid = pod["metadata"]["uid"]
        w = self._w.get(uid)
        if w is None:
            # also for REMOVE of a pod never seen: the runtime may hold its containers
            w = self._w[uid] = _Worker(uid, pod)
        log.debug("pod %s: %s update (phase %s, running=%s)", describe(pod), kind.value,
                  w.phase.value,
                  w.task is not None and not w.task.done())
        w.pod = pod  # latest wins
        if kind in (UpdateKind.KILL, UpdateKind.REMOVE):
            w.kill = True
            w.killed.set()
            if grace is not None:
                w.grace = grace if w.grace is None else min(w.grace, grace)
            if ending is not None and w.ending is None and w.phase != Phase.TERMINATED:
                w.ending = ending
        if kind == UpdateKind.REMOVE:
            w.removed = True
        w.pending = True
        if w.task is None or w.task.done():
            w.task = asyncio.create_task(self._run(w), name=f"pod-worker-{uid}")

    async def end(self, pod: Pod, grace: float, ending: Ending) -> None:
        """Stop the pod as the node's own decision, within `grace` seconds (or its own
        shorter grace period); returns once its final status is handed to the status
        manager (at once for a pod that had already ended)."""
        self.update(pod, UpdateKind.KILL, grace=grace, ending=ending)
        await self._w[pod["metadata"]["uid"]].ended.wait()

    def _waker(self, uid: str) -> Callable[[object], None]:
        def wake(_: object) -> None:
            w = self._w.get(uid)
            if w is not None and w.phase == Phase.SYNCING and not w.kill:
                self.update(w.pod)
        return wake

    async def stop(self) -> None:
        """Stop the workers; runtime calls they had under way may end (see drain), so
        the runtime is never left with a change cut off half-way."""
        tasks = [w.task for w in self._w.values() if w.task and not w.task.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.syncer.drain(self.timing.drain_timeout)

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
                # after the step: the next sync needs a relist that saw what it did, so
                # state newer than the step's end and than the state it acted on (a
                # read made after an earlier step counts as newer than the clock there,
                # which a FakeClock may still show after this one)
                w.last_sync = max(self.clock.monotonic(), entry.modified)
                if self._w.get(w.uid) is not w:
                    return
        except asyncio.CancelledError:
            raise
        except Exception:  # _step handles sync errors; this is a bug: keep the pod due
            log.exception("pod %s: worker failed", describe(w.pod))
            self._make_due(w, self.timing.error_max)

    async def _entry(self, w: _Worker) -> CacheEntry:
        """The pod's runtime state from a relist newer than the last sync. A stop reads
        the runtime itself, so a kill never waits for that relist (also when it
        arrives during the wait): the grace period starts at the delete."""
        if w.kill and w.phase in (Phase.SYNCING, Phase.TERMINATING):
            return self.cache.get(w.uid)
        if w.kill:
            return await self.cache.get_newer_than(w.uid, w.last_sync)
        if self.cache.fresh(w.uid, w.last_sync):  # nothing to wait for: no tasks to make
            return self.cache.get(w.uid)
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
            if other is not w and other.kill and pod_full_name(other.pod) == pod_full_name(w.pod):
                log.info("pod %s (uid %s): waiting for the one of uid %s to stop",
                         describe(w.pod), w.uid, other.uid)
                await other.stopped.wait()

    async def _step(self, w: _Worker, entry: CacheEntry) -> None:
        started = self.clock.monotonic()
        phase = w.phase
        w.running = frozenset()
        log.debug("pod %s: %s step (kill=%s removed=%s)", describe(w.pod), phase.value, w.kill,
                  w.removed)
        try:
            t = self.timing
            requeue = t.sync_frequency * (1 + t.resync_jitter * _spread(w.uid, w.syncs))
            if w.phase == Phase.SYNCING and w.kill:
                w.phase = Phase.TERMINATING
            if w.phase == Phase.SYNCING:
                res = await self.syncer.sync_pod(w.pod, entry)
                if res.fresh is not None:
                    # into the cache too: the kubelet API and the probes read it, and a
                    # client that sees Running may exec or read logs at once
                    rs, read_at = res.fresh
                    await self.cache.store(w.uid, rs, None, read_at, done=False)
                w.running = res.running
                if res.terminal:
                    w.phase = Phase.TERMINATING
                    w.pending = True  # go on terminating at once
                elif res.requeue_after is not None:
                    requeue = min(requeue, res.requeue_after)
                for f in res.wake:  # an image pull: sync again when it ends
                    f.add_done_callback(self._waker(w.uid))
            elif w.phase == Phase.TERMINATING:
                await self.syncer.terminate_pod(w.pod, grace_of(w.pod, w.grace), w.ending)
                w.phase = Phase.TERMINATED
                w.stopped.set()
                w.pending = True  # one more pass with fresh state for the final status
            elif w.phase == Phase.TERMINATED:
                if not w.removed:  # a removed pod has no API object to write to
                    self.syncer.sync_terminated(w.pod, entry, w.ending)
                    if w.ending is not None and w.ending.remove_content \
                            and not w.content_removed:
                        await self.syncer.remove_content(w.uid)
                        w.content_removed = True
                w.ended.set()
                if w.removed:
                    await self.syncer.cleanup_pod(w.uid)
                    self.cache.delete(w.uid)
                    del self._w[w.uid]
                    self.forgotten[w.uid] = self.clock.monotonic()
                    log.debug("pod %s: removed, worker forgotten", describe(w.pod))
            w.errors = 0
            self._make_due(w, requeue)
            self._m.syncs.labels(node=self.node, phase=phase.value, result="ok").inc()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            w.errors += 1
            t = self.timing
            delay = min(t.error_initial * 2 ** (w.errors - 1), t.error_max)
            self._make_due(w, delay)
            self._m.syncs.labels(node=self.node, phase=phase.value, result="error").inc()
            log.warning("pod %s: %s sync failed (%s); retry in %.0fs", describe(w.pod),
                        phase.value,
                        e, delay)
        finally:
            self._m.duration.labels(node=self.node).observe(self.clock.monotonic() - started)
