"""PLEG: the runtime's container events and a periodic relist turned into pod
lifecycle events.

Evented: while the runtime's event stream (`Runtime.container_events`) is up, each event
has its pod inspected at once and its worker woken (a start the cache already shows, as
the sync that made it read it back, needs no inspection), and the relist runs only every
`evented_relist_period`, as the check that catches what the stream lost. When the stream
breaks, or the runtime has none, the relist takes over at `relist_period`; when it is
back, one relist covers the gap and the long period resumes. A worker waiting for state
newer than its last sync has its pod inspected at once while events flow (the relist
that would otherwise answer it is far off).

The relist, each period: one `runtime.relist()` call, a diff against the previous
records, and for the pods that changed only, a `pod_status` inspection to refresh the
pod cache, then that pod's events. Inspections run as background tasks, bounded and each with a
timeout, so a pod whose inspection hangs delays only its own events: the relist keeps
its period and the other pods' events keep flowing (the kubelet's "PLEG is not
healthy" failure, where one slow pod stalled every pod, cannot happen here).

Workers read pod state from the `PodCache`, never from the runtime; they wait with
`get_newer_than` until the cache reflects the runtime after their last sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import enum
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from nodeagent.api.clock import Clock, clock_timeout
from nodeagent.metrics import per_registry
from nodeagent.runtime.base import (
    ContainerEvent,
    ContainerEventType,
    ContainerRuntimeError,
    ContainerState,
    PodRuntimeStatus,
    RelistResult,
    Runtime,
    SandboxState,
    Unsupported,
)

log = logging.getLogger(__name__)

class EventType(enum.StrEnum):
    CONTAINER_STARTED = "ContainerStarted"
    CONTAINER_DIED = "ContainerDied"
    CONTAINER_REMOVED = "ContainerRemoved"
    CONTAINER_CHANGED = "ContainerChanged"


@dataclass(frozen=True, slots=True)
class PodLifecycleEvent:
    pod_uid: str
    type: EventType
    container_id: str  # a container or sandbox id


# A record's state as the diff sees it; sandboxes map READY->RUNNING, NOTREADY->EXITED.
_NONEXISTENT = "NONEXISTENT"
# ... and the state a runtime event says a record is in now
_EVENT_STATES = {ContainerEventType.STARTED: ContainerState.RUNNING,
                 ContainerEventType.DIED: ContainerState.EXITED,
                 ContainerEventType.REMOVED: _NONEXISTENT}


def _events_for(uid: str, cid: str, old: str, new: str) -> list[PodLifecycleEvent]:
    if old == new:
        return []
    if new == ContainerState.RUNNING:
        return [PodLifecycleEvent(uid, EventType.CONTAINER_STARTED, cid)]
    if new == ContainerState.EXITED:
        return [PodLifecycleEvent(uid, EventType.CONTAINER_DIED, cid)]
    if new == _NONEXISTENT:
        if old == ContainerState.EXITED:
            return [PodLifecycleEvent(uid, EventType.CONTAINER_REMOVED, cid)]
        return [PodLifecycleEvent(uid, EventType.CONTAINER_DIED, cid),
                PodLifecycleEvent(uid, EventType.CONTAINER_REMOVED, cid)]
    return [PodLifecycleEvent(uid, EventType.CONTAINER_CHANGED, cid)]


def records_of(result: RelistResult) -> dict[str, dict[str, str]]:
    """pod uid -> {container or sandbox id -> state} from one relist."""
    out: dict[str, dict[str, str]] = {}
    for s in result.sandboxes:
        out.setdefault(s.pod_uid, {})[s.id] = (
            ContainerState.RUNNING if s.state == SandboxState.READY else ContainerState.EXITED)
    for c in result.containers:
        out.setdefault(c.pod_uid, {})[c.id] = c.state
    return out


def diff(old: dict[str, dict[str, str]],
         new: dict[str, dict[str, str]]) -> dict[str, list[PodLifecycleEvent]]:
    """Events per pod uid for every record whose state differs between two relists."""
    events: dict[str, list[PodLifecycleEvent]] = {}
    for uid in old.keys() | new.keys():
        o = old.get(uid, {})
        n = new.get(uid, {})
        if o == n:
            continue
        evs: list[PodLifecycleEvent] = []
        for cid in sorted(o.keys() | n.keys()):
            evs += _events_for(uid, cid, o.get(cid, _NONEXISTENT), n.get(cid, _NONEXISTENT))
        if evs:
            events[uid] = evs
    return events


# --- the pod cache ------------------------------------------------------------------

@dataclass
class CacheEntry:
    status: PodRuntimeStatus
    error: BaseException | None
    modified: float  # monotonic time the runtime state was read (taken before the call)


class PodCache:
    """Latest known runtime state per pod. `get_newer_than(uid, t)` returns once the
    cache holds state read after `t`: either the pod's own entry is that fresh, or a
    relist that started after `t` found the pod unchanged (no inspection pending).
    Before the first relist nothing is fresh, so a new agent never acts blind."""

    def __init__(self) -> None:
        self._entries: dict[str, CacheEntry] = {}
        self._pending: set[str] = set()  # uids whose inspection is in flight
        self.timestamp = -math.inf       # start time of the last relist fully applied
        # waiting workers per uid: a store wakes only that pod's waiters, a relist only
        # the pods someone waits for (no thundering herd at thousands of pods)
        self._waiters: dict[str, list[tuple[float, asyncio.Future[None]]]] = {}
        # called with (uid, t) when a worker starts waiting for state newer than t
        self.on_stale: Callable[[str, float], None] | None = None

    def get(self, uid: str) -> CacheEntry:
        return self._entries.get(uid) or CacheEntry(PodRuntimeStatus(uid), None, -math.inf)

    def fresh(self, uid: str, t: float) -> bool:
        """Whether the cache holds state of `uid` read after `t` (see the class)."""
        # strictly newer: a relist that started at the same instant as a sync's end may
        # predate what that sync did (FakeClock makes such ties common)
        e = self._entries.get(uid)
        if e is not None and e.modified > t:
            return True
        return self.timestamp > t and uid not in self._pending

    def shows_running(self, uid: str, cid: str) -> bool:
        """Whether the pod's entry has this container running, or this sandbox ready."""
        e = self._entries.get(uid)
        if e is None or e.error is not None:
            return False
        return (any(c.id == cid and c.state == ContainerState.RUNNING
                    for c in e.status.containers)
                or any(s.id == cid and s.state == SandboxState.READY
                       for s in e.status.sandboxes))

    async def get_newer_than(self, uid: str, t: float) -> CacheEntry:
        if not self.fresh(uid, t):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(uid, []).append((t, fut))
            if self.on_stale is not None:
                self.on_stale(uid, t)
            try:
                await fut
            finally:
                if fut.cancelled():  # the worker was cancelled: drop its waiter now
                    self._wake(uid)
        return self.get(uid)

    def _wake(self, uid: str) -> None:
        waiters = self._waiters.get(uid)
        if not waiters:
            return
        keep = []
        for t, fut in waiters:
            if fut.done():
                continue
            if self.fresh(uid, t):
                fut.set_result(None)
            else:
                keep.append((t, fut))
        if keep:
            waiters[:] = keep
        else:
            del self._waiters[uid]

    def mark_pending(self, uid: str) -> None:
        self._pending.add(uid)

    async def store(self, uid: str, status: PodRuntimeStatus, error: BaseException | None,
                    modified: float, *, done: bool = True) -> None:
        if (error is None and not status.sandboxes and not status.containers
                and uid not in self._entries and uid not in self._waiters):
            # what get() answers anyway: a removed pod's late events (after its worker
            # deleted the entry) would otherwise leave an entry per pod for ever
            self._pending.discard(uid)
            return
        self._entries[uid] = CacheEntry(status, error, modified)
        if done:
            self._pending.discard(uid)
        self._wake(uid)

    async def update_time(self, t: float) -> None:
        self.timestamp = max(self.timestamp, t)
        for uid in list(self._waiters):
            self._wake(uid)

    def delete(self, uid: str) -> None:
        self._entries.pop(uid, None)
        self._pending.discard(uid)

    def uids(self) -> set[str]:
        return set(self._entries)


# --- metrics ------------------------------------------------------------------------

@dataclass
class PlegMetrics:
    relist_duration: Histogram
    relist_interval: Histogram
    last_seen: Gauge
    events: Counter
    discarded: Counter
    inspect_failures: Counter
    healthy: Gauge
    relist_failures: Counter
    runtime_up: Gauge
    event_stream_up: Gauge


@per_registry
def pleg_metrics(registry: CollectorRegistry) -> PlegMetrics:
    """One set of metric families per registry, labelled by node, so several PLEGs
    (virtual nodes, tests) can share a process."""
    # up to 300 s: the relists' interval while events flow (60 s by default)
    buckets = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
    return PlegMetrics(
        relist_duration=Histogram("nodepulse_pleg_relist_duration_seconds",
                                  "Time one PLEG relist took (list + diff + dispatch).",
                                  ["node"], buckets=buckets, registry=registry),
        relist_interval=Histogram("nodepulse_pleg_relist_interval_seconds",
                                  "Time between the starts of two PLEG relists.",
                                  ["node"], buckets=buckets, registry=registry),
        last_seen=Gauge("nodepulse_pleg_last_seen_seconds",
                        "Unix time the last PLEG relist completed.", ["node"],
                        registry=registry),
        events=Counter("nodepulse_pleg_events_total",
                       "Pod lifecycle events generated by PLEG.", ["node", "type"],
                       registry=registry),
        discarded=Counter("nodepulse_pleg_discarded_events_total",
                          "Events dropped because the event channel was full.",
                          ["node"], registry=registry),
        inspect_failures=Counter("nodepulse_pleg_inspect_failures_total",
                                 "Pod inspections that failed or timed out.",
                                 ["node", "reason"], registry=registry),
        healthy=Gauge("nodepulse_pleg_healthy",
                      "1 when a relist completed within the health threshold.",
                      ["node"], registry=registry),
        relist_failures=Counter("nodepulse_pleg_relist_failures_total",
                                "PLEG relists that failed or timed out (runtime "
                                "unreachable or erroring).", ["node"], registry=registry),
        runtime_up=Gauge("nodepulse_pleg_runtime_up",
                         "0 while the runtime is down as PLEG sees it (its last "
                         "relists failed in a row), else 1.", ["node"],
                         registry=registry),
        event_stream_up=Gauge("nodepulse_pleg_event_stream_up",
                              "1 while the runtime's container event stream is up "
                              "(relists at the long period), else 0.", ["node"],
                              registry=registry),
    )


# --- the PLEG -----------------------------------------------------------------------

@dataclass(frozen=True)
class PlegConfig:
    relist_period: float = 1.0         # the kubelet's relistPeriod
    # while the event stream is up: the relist is then only the check for lost events
    # (the kubelet's evented PLEG relists every 300 s; see docs/pods.md, "Evented PLEG")
    evented_relist_period: float = 60.0
    relist_timeout: float = 30.0       # one runtime list
    inspect_timeout: float = 10.0      # one pod's status call
    inspect_concurrency: int = 8
    health_threshold: float = 180.0    # no relist for this long (or for two periods,
    # when the period in force is longer): PLEG is not healthy
    channel_capacity: int = 1000       # events waiting for the sync loops
    runtime_failure_threshold: int = 2  # failed relists in a row before the runtime is
    # reported down (one failure may be a blip)
    event_retry: float = 1.0           # a broken event stream is subscribed again after
    event_retry_max: float = 30.0      # this, doubling up to the max


class Pleg:
    def __init__(self, runtime: Runtime, clock: Clock, config: PlegConfig = PlegConfig(), *,
                 node: str = "", cache: PodCache | None = None,
                 registry: CollectorRegistry = REGISTRY) -> None:
        """`node` labels the metrics (the agent's id when one PLEG serves many nodes)."""
        c = config
        self.runtime = runtime
        self.clock = clock
        self.node = node
        self.relist_period = c.relist_period
        self.evented_relist_period = c.evented_relist_period
        self.event_retry, self.event_retry_max = c.event_retry, c.event_retry_max
        self.evented = False  # the event stream is up: relists at the long period
        self._relist_now = asyncio.Event()  # set: relist at once (see relist_soon)
        self.relist_timeout = c.relist_timeout
        self.inspect_timeout = c.inspect_timeout
        self.health_threshold = c.health_threshold
        self.cache = cache or PodCache()
        self.cache.on_stale = self._refresh
        self.events: asyncio.Queue[PodLifecycleEvent] = asyncio.Queue(c.channel_capacity)
        self.last_result: RelistResult | None = None  # for housekeeping and adoption
        self.last_result_at = -math.inf  # monotonic start of the relist that made it
        self.relists = 0
        self.runtime_failure_threshold = max(1, c.runtime_failure_threshold)
        self.relist_failures = 0  # in a row; 0 after a relist that worked
        self.relist_error = ""    # the last failure, for runtime_problem()
        self._failing_since = dt.datetime.min  # wall time of the first failure in a row
        self._records: dict[str, dict[str, str]] = {}
        self._sem = asyncio.Semaphore(c.inspect_concurrency)
        self._inspecting: dict[str, asyncio.Task[None]] = {}
        self._again: dict[str, tuple[float, list[PodLifecycleEvent]]] = {}
        self._reinspect: set[str] = set()  # failed inspections: retry next relist
        self._started = clock.monotonic()
        self._last_relist_done: float | None = None
        self._last_relist_start: float | None = None
        m = pleg_metrics(registry)
        self._m_duration = m.relist_duration.labels(node=node)
        self._m_interval = m.relist_interval.labels(node=node)
        self._m_last_seen = m.last_seen.labels(node=node)
        self._m_events = m.events
        self._m_discarded = m.discarded.labels(node=node)
        self._m_inspect_fail = m.inspect_failures
        m.healthy.labels(node=node).set_function(lambda: 0.0 if self.health() else 1.0)
        self._m_relist_failures = m.relist_failures.labels(node=node)
        m.runtime_up.labels(node=node).set_function(
            lambda: 0.0 if self.runtime_problem() else 1.0)
        m.event_stream_up.labels(node=node).set_function(lambda: float(self.evented))
        self._task: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None  # ends when the runtime has no events

    # --- health ---------------------------------------------------------------------

    @property
    def period(self) -> float:
        """The relist period in force."""
        return self.evented_relist_period if self.evented else self.relist_period

    def health(self) -> str | None:
        """None when healthy; usable as a HealthServer check."""
        since = self._last_relist_done if self._last_relist_done is not None else self._started
        idle = self.clock.monotonic() - since
        threshold = max(self.health_threshold, 2 * self.period)
        if idle > threshold:
            what = "last relist completed" if self._last_relist_done is not None else \
                "no relist completed since start"
            return (f"PLEG is not healthy: {what} {idle:.0f}s ago "
                    f"(threshold {threshold:.0f}s)")
        return None

    def runtime_problem(self) -> str | None:
        """Why the runtime looks down from here (None: it answers). Unlike health(),
        which fails only when relists stop completing for minutes (a liveness matter:
        restarting the agent is the cure), this follows the runtime at the relist
        period, for the node's readiness: a stopped containerd shows within seconds
        and clears on the first relist that works again."""
        if self.relist_failures < self.runtime_failure_threshold:
            return None
        # no counts or durations in the text: it is the Node's condition message
        return (f"container runtime is down: PLEG relists failing since "
                f"{self._failing_since:%Y-%m-%dT%H:%M:%SZ}; last error: "
                f"{self.relist_error[:200]}")

    # --- running --------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"pleg-{self.node}")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._inspecting.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._task = None

    async def run(self) -> None:
        self._watcher = asyncio.create_task(self._watch_events(),
                                            name=f"pleg-events-{self.node}")
        try:
            await self._relist_loop()
        finally:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    async def _relist_loop(self) -> None:
        next_at = self.clock.monotonic()
        while True:
            self._relist_now.clear()
            try:
                await self.relist()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # retried next period; runtime_problem/health tell
                # once, not every period while the runtime is down
                (log.warning if self.relist_failures == 1 else log.debug)(
                    "PLEG relist failed: %s", e)
            next_at += self.period
            now = self.clock.monotonic()
            if next_at < now:  # fell behind (slow runtime): do not burst to catch up
                next_at = now
            # the stream coming or going ends the wait (a relist after a subscription
            # covers what happened before it; one after a break, what the stream lost),
            # and so does relist_soon()
            with contextlib.suppress(TimeoutError):
                await clock_timeout(self.clock, self._relist_now.wait(), next_at - now,
                                    "relist period")
            if self._relist_now.is_set():
                next_at = self.clock.monotonic()

    def _set_evented(self, up: bool) -> None:
        if self.evented != up:
            self.evented = up
            self._relist_now.set()

    def relist_soon(self) -> None:
        """Relist now rather than at the period's end: something only a relist shows
        (housekeeping reads the last one) has happened."""
        self._relist_now.set()

    async def _watch_events(self) -> None:
        """Keep the runtime's event stream open and turn its events into inspections."""
        retry = self.event_retry
        warned = False
        while True:
            try:
                events = await clock_timeout(
                    self.clock, self.runtime.container_events(), self.relist_timeout,
                    f"subscribing to the runtime's events took longer than "
                    f"{self.relist_timeout}s")
            except Unsupported as e:
                log.info("PLEG: %s; relisting every %gs", e, self.relist_period)
                return
            except Exception as e:
                error = str(e) or type(e).__name__
            else:
                subscribed = self.clock.monotonic()
                self._set_evented(True)
                if warned:
                    log.info("PLEG: the runtime's event stream is back; relisting every %gs",
                             self.evented_relist_period)
                    warned = False
                try:
                    async for ev in events:
                        self._on_event(ev)
                    raise ContainerRuntimeError("the stream ended")
                except Unsupported as e:  # some runtimes say so only at the first read
                    self._set_evented(False)
                    log.info("PLEG: %s; relisting every %gs", e, self.relist_period)
                    return
                except Exception as e:
                    error = str(e) or type(e).__name__
                self._set_evented(False)
                if self.clock.monotonic() - subscribed >= self.event_retry_max:
                    retry = self.event_retry  # it had worked for a while: not a flapping one
            (log.debug if warned else log.warning)(
                "PLEG: the runtime's event stream failed (%s); relisting every %gs, "
                "subscribing again in %gs", error, self.relist_period, retry)
            warned = True
            await self.clock.sleep(retry)
            retry = min(retry * 2, self.event_retry_max)

    def _on_event(self, ev: ContainerEvent) -> None:
        """The event's change, as the relist's diff would name it (a running container
        removed also died), applied to the records; its pod inspected."""
        uid, cid, new = ev.pod_uid, ev.container_id, _EVENT_STATES[ev.type]
        pod = self._records.setdefault(uid, {})
        evs = _events_for(uid, cid, pod.get(cid, _NONEXISTENT), new)
        if new == _NONEXISTENT:
            pod.pop(cid, None)
        else:
            pod[cid] = new
        if not pod:
            del self._records[uid]
        if not evs:  # a relist or an earlier event has it already
            return
        if new == ContainerState.RUNNING and self.cache.shows_running(uid, cid):
            # a read made after the start is in the cache already (the sync that started
            # it stored what it read): nothing for an inspection to add
            self._emit(evs)
            return
        self._inspect(uid, self.clock.monotonic(), evs)

    def _refresh(self, uid: str, t: float) -> None:
        """A worker waits for the pod's state newer than `t` (the end of its last
        sync). While events flow the next relist is far off: read the pod now. The
        read starts after that sync ended, so it is newer than `t` even when the clock
        reads the same."""
        if self.evented:
            self._inspect(uid, max(self.clock.monotonic(), math.nextafter(t, math.inf)), [])

    async def relist(self) -> None:
        """One relist: list, diff, inspect changed pods in the background, emit."""
        start = self.clock.monotonic()
        if self._last_relist_start is not None:
            self._m_interval.observe(start - self._last_relist_start)
        self._last_relist_start = start
        try:
            result = await clock_timeout(
                self.clock, self.runtime.relist(), self.relist_timeout,
                f"runtime relist took longer than {self.relist_timeout}s")
        except Exception as e:
            if self.relist_failures == 0:
                self._failing_since = self.clock.now().astimezone(dt.UTC)
            self.relist_failures += 1
            self.relist_error = str(e) or type(e).__name__
            self._m_relist_failures.inc()
            raise
        if self.relist_failures >= self.runtime_failure_threshold:
            log.info("PLEG: the runtime answers again after %d failed relists",
                     self.relist_failures)
        self.relist_failures = 0
        self.relists += 1
        records = records_of(result)
        changed = diff(self._records, records)
        self._records = records
        self.last_result = result
        self.last_result_at = start
        for uid in self._reinspect - changed.keys():
            changed[uid] = []
        self._reinspect.clear()
        for uid, evs in changed.items():
            self._inspect(uid, start, evs)
        await self.cache.update_time(start)
        self._last_relist_done = self.clock.monotonic()
        self._m_duration.observe(self._last_relist_done - start)
        self._m_last_seen.set(self.clock.now().timestamp())

    def _inspect(self, uid: str, t: float, evs: list[PodLifecycleEvent]) -> None:
        self.cache.mark_pending(uid)
        if uid in self._inspecting:
            # one inspection per pod at a time; a later change queues one more pass
            prev_t, prev_evs = self._again.get(uid, (t, []))
            self._again[uid] = (max(prev_t, t), prev_evs + evs)
            return
        self._inspecting[uid] = asyncio.create_task(self._inspect_pod(uid, t, evs),
                                                    name=f"pleg-inspect-{uid}")

    async def _inspect_pod(self, uid: str, t: float, evs: list[PodLifecycleEvent]) -> None:
        try:
            while True:
                await self._inspect_once(uid, t, evs)
                if uid not in self._again:
                    return
                t, evs = self._again.pop(uid)
        finally:
            self._inspecting.pop(uid, None)

    async def _inspect_once(self, uid: str, t: float, evs: list[PodLifecycleEvent]) -> None:
        status: PodRuntimeStatus | None = None
        error: BaseException | None = None
        async with self._sem:
            read_at = self.clock.monotonic()
            try:
                status = await clock_timeout(
                    self.clock, self.runtime.pod_status(uid), self.inspect_timeout,
                    f"pod {uid}: runtime status took longer than {self.inspect_timeout}s")
            except TimeoutError as e:
                error = e
                self._m_inspect_fail.labels(node=self.node, reason="timeout").inc()
            except Exception as e:  # recorded in the cache; the worker sees it and retries
                error = e
                self._m_inspect_fail.labels(node=self.node, reason="error").inc()
        if error is not None:
            log.warning("PLEG: inspecting pod %s failed: %s", uid, error)
            self._reinspect.add(uid)
            # keep the old status but record the error, so waiting workers move on
            await self.cache.store(uid, self.cache.get(uid).status, error, t)
        else:
            assert status is not None
            if self._records_follow(read_at):
                # what the next relist's diff starts from: it then finds only changes no
                # event or inspection has seen
                pod = records_of(RelistResult(status.sandboxes, status.containers)).get(uid)
                if pod:
                    self._records[uid] = pod
                else:
                    self._records.pop(uid, None)
            await self.cache.store(uid, status, None, t, done=uid not in self._again)
        self._emit(evs)

    def _records_follow(self, read_at: float) -> bool:
        """Whether an inspection read at `read_at` may set the relist's records. Only
        while events flow: the next relist is then far off, and its diff must not report
        again what events already did. Never from a read older than the last relist's
        start, nor while a relist is under way: a relist's list replaces the records when
        it ends, so an older read stored after it, or a newer one stored before it ends,
        would make the next diff report a start or an exit a second time."""
        if not self.evented:
            return False
        start, done = self._last_relist_start, self._last_relist_done
        return start is None or (read_at >= start and done is not None and done >= start)

    def _emit(self, evs: Iterable[PodLifecycleEvent]) -> None:
        for ev in evs:
            self._m_events.labels(node=self.node, type=ev.type.value).inc()
            try:
                self.events.put_nowait(ev)
            except asyncio.QueueFull:
                self._m_discarded.inc()
