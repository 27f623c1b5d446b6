"""Graceful node shutdown, as the kubelet does it: the host's shutdown waits while the
pods are stopped, the lowest priorities first, each group within its budget.

    start ──> logind's InhibitDelayMaxUSec shorter than the budgets' sum? a
              logind.conf.d drop-in raises it, logind reloads, it is read again
          ──> a delay inhibitor lock on shutdown ("kubelet", as the kubelet takes it)
    PrepareForShutdown(true) ──> a Node Event; the node NotReady ("node is shutting
          down") and new pods refused (NodeShutdown); each group of pods, by priority
          from the lowest, stopped with min(its budget, the pod's grace period) and
          waited for up to the budget: Failed, reason Terminated, a DisruptionTarget
          condition ──> the lock released: the host goes on shutting down
    PrepareForShutdown(false), a cancelled shutdown ──> an Event, Ready again, the
          lock taken again

A part of its own at the agent's level, not in the pod half: it acts on both halves
(the pods, the node's Ready and status) and on the host (logind), for the whole life of
the process; the composition root hands it what it uses of each (ShutdownPods, a
callable that writes the node status now, the Events) and nothing here imports them.
The D-Bus side is nodeagent.systembus; tests hand in a fake Logind.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from nodeagent.api.clock import Clock
from nodeagent.events import NORMAL, Events
from nodeagent.metrics import per_registry

log = logging.getLogger(__name__)

# the kubelet's words, where tools and people look for them
WHO = "kubelet"
WHY = "Kubelet needs time to handle node shutdown"
NOT_READY = "node is shutting down"
REASON = "Terminated"
MESSAGE = "Pod was terminated in response to imminent node shutdown."
EVENT_REASON = "Shutdown"
DROP_IN = "99-nodepulse-agent.conf"
DEFAULT_PRIORITY = 0               # a pod without spec.priority
CRITICAL_PRIORITY = 2_000_000_000  # system-cluster-critical and up


class LogindError(Exception):
    """logind or the bus failed, or answered what the agent cannot use."""


class Logind(Protocol):
    """One connection to the host's logind (nodeagent.systembus.LogindBus), watching its
    PrepareForShutdown signal from the start. Every call raises LogindError."""

    async def inhibit_delay_max(self) -> float:
        """logind's InhibitDelayMaxUSec, in seconds."""

    async def inhibit(self, what: str, who: str, why: str, mode: str) -> int:
        """An inhibitor lock: the file descriptor that holds it (closed: released)."""

    async def reload(self) -> None:
        """Ask systemd to have logind read its configuration again."""

    async def prepare_for_shutdown(self) -> bool:
        """The next PrepareForShutdown signal's argument; LogindError once the
        connection is gone."""

    def close(self) -> None: ...


class ShutdownPods(Protocol):
    """What the pod half does for a shutdown (nodeagent.pods.podhalf.Pods)."""

    def active_pods(self) -> list[dict[str, Any]]: ...

    def end_pod(self, pod: dict[str, Any], grace: float, reason: str,
                message: str) -> Awaitable[None]: ...


@dataclass(frozen=True)
class Budget:
    """Pods of this priority and up (below the next budget's) get this many seconds."""
    priority: int
    seconds: int


def budgets(grace: float, critical: float,
            by_priority: Sequence[tuple[int, int]]) -> tuple[Budget, ...]:
    """The budgets, lowest priority first, from the KubeletConfiguration's fields:
    shutdownGracePeriodByPodPriority as it is, else shutdownGracePeriod split into the
    regular pods' part and shutdownGracePeriodCriticalPods. None: no graceful shutdown."""
    if by_priority:
        return tuple(sorted((Budget(p, s) for p, s in by_priority),
                            key=lambda b: b.priority))
    if grace <= 0 or critical > grace:
        return ()
    return (Budget(DEFAULT_PRIORITY, int(grace - critical)),
            Budget(CRITICAL_PRIORITY, int(critical)))


def group_pods(budgets: Sequence[Budget], pods: Sequence[Mapping[str, Any]]
               ) -> list[list[Mapping[str, Any]]]:
    """The pods of each budget: the highest budget whose priority a pod reaches, the
    lowest for a pod below them all."""
    groups: list[list[Mapping[str, Any]]] = [[] for _ in budgets]
    floors = [b.priority for b in budgets]
    for pod in pods:
        priority = (pod.get("spec") or {}).get("priority")
        priority = DEFAULT_PRIORITY if priority is None else int(priority)
        groups[max(0, bisect.bisect_right(floors, priority) - 1)].append(pod)
    return groups


def grace_for(pod: Mapping[str, Any], budget: Budget) -> float:
    """The budget, or the pod's own terminationGracePeriodSeconds when shorter."""
    own = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    return float(budget.seconds if own is None else min(int(own), budget.seconds))


def describe(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name')}"


@dataclass
class _Metrics:
    started: Gauge
    ended: Gauge


@per_registry
def _metrics(registry: CollectorRegistry) -> _Metrics:
    return _Metrics(
        started=Gauge("nodepulse_graceful_shutdown_start_time_seconds",
                      "When the last graceful node shutdown began (Unix time).",
                      registry=registry),
        ended=Gauge("nodepulse_graceful_shutdown_end_time_seconds",
                    "When the last graceful node shutdown had stopped its pods (Unix "
                    "time).", registry=registry))


class ShutdownManager:
    RECONNECT = 1.0    # seconds before the bus is tried again; doubling while it fails
    RECONNECT_MAX = 60.0
    RELOAD_CHECKS = (0.1, 0.2, 0.4, 0.8, 1.6)  # waits before each look after a reload

    def __init__(self, budgets: Sequence[Budget], connect: Callable[[], Awaitable[Logind]],
                 pods: ShutdownPods, clock: Clock, *, status_now: Callable[[], None],
                 events: Events | None, conf_dir: Path,
                 registry: CollectorRegistry = REGISTRY) -> None:
        """`connect`: a new connection to logind; `status_now`: have the node status
        computed and written now (its Ready follows `not_ready`); `conf_dir`: where
        logind reads drop-ins (/etc/systemd/logind.conf.d)."""
        self.budgets = tuple(budgets)
        self.connect = connect
        self.pods = pods
        self.clock = clock
        self.status_now = status_now
        self.events = events
        self.conf_dir = conf_dir
        self.shutting_down = False
        self.lock: int | None = None  # the inhibitor lock's file descriptor, while held
        self.closed = False  # the agent stops: no lock is taken any more
        self._failure: str | None = None  # the last failure logged (once each)
        self._metrics = _metrics(registry)
        self._stops: set[asyncio.Task[None]] = set()  # pod stops past their budget

    @property
    def requested(self) -> int:
        """Seconds the host's shutdown is asked to wait: every budget's."""
        return sum(b.seconds for b in self.budgets)

    def not_ready(self) -> str | None:
        """Why the node is not Ready, while it shuts down (its readiness, any thread)."""
        return NOT_READY if self.shutting_down else None

    # -- running --
    async def run(self) -> None:
        """Watch for shutdowns until cancelled; the bus is connected again when it goes
        away (logind or the bus restarted), and a failed start is tried again later."""
        wait = self.RECONNECT
        while True:
            bus: Logind | None = None
            try:
                bus = await self.connect()
                await self._start(bus)
                wait = self.RECONNECT
                self._failure = None
                await self._watch(bus)
            except LogindError as e:
                self._failed(str(e), wait)
            except Exception as e:  # a bug here must not end the agent: logged, again
                log.exception("graceful node shutdown failed")
                self._failed(f"{type(e).__name__}: {e}", wait)
            finally:
                self._release()
                if bus is not None:
                    bus.close()
            await self.clock.sleep(wait)
            wait = min(wait * 2, self.RECONNECT_MAX)

    def _failed(self, why: str, wait: float) -> None:
        """Logged and told on the Node once per distinct failure (it is tried again)."""
        if why != self._failure:
            log.error("graceful node shutdown: %s; trying again in %.0fs, then less often",
                      why, wait)
            if self.events is not None:
                self.events.warning("NodeShutdownUnavailable",
                                    f"Graceful node shutdown is not set up: {why}")
        self._failure = why

    async def close(self) -> None:
        """Release the lock (the agent stops: the host must not wait for it)."""
        self.closed = True
        self._release()
        for t in self._stops:
            t.cancel()
        await asyncio.gather(*self._stops, return_exceptions=True)

    async def _start(self, bus: Logind) -> None:
        """logind's delay big enough, then the lock."""
        have = await bus.inhibit_delay_max()
        if self.requested > have:
            have = await self._raise_delay(bus, have)
        await self._take_lock(bus)
        log.info("graceful node shutdown: holding a delay inhibitor lock; budgets %s "
                 "(logind allows %.0fs)", ", ".join(f"priority {b.priority}+: {b.seconds}s"
                                                    for b in self.budgets), have)

    async def _raise_delay(self, bus: Logind, have: float) -> float:
        """Write the drop-in that gives logind's InhibitDelayMaxSec the budgets' sum,
        have logind reload, and look until it took effect, as the kubelet does."""
        path = self.conf_dir / DROP_IN
        log.info("graceful node shutdown: logind's InhibitDelayMaxSec is %.0fs, %ds "
                 "needed: writing %s", have, self.requested, path)
        try:
            self.conf_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(f"# written by nodepulse-agent for graceful node shutdown\n"
                            f"[Login]\nInhibitDelayMaxSec={self.requested}\n")
        except OSError as e:
            raise LogindError(f"cannot write {path}: {e.strerror or e}") from None
        await bus.reload()
        for wait in self.RELOAD_CHECKS:
            await self.clock.sleep(wait)
            have = await bus.inhibit_delay_max()
            if have >= self.requested:
                return have
        raise LogindError(f"logind's InhibitDelayMaxSec is still {have:.0f}s after "
                          f"{path} asked for {self.requested}s (the shutdown budgets' sum)")

    async def _take_lock(self, bus: Logind) -> None:
        lock = await bus.inhibit("shutdown", WHO, WHY, "delay")
        self._release()
        self.lock = lock
        if self.closed:
            self._release()

    def _release(self) -> None:
        if self.lock is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock)
            self.lock = None

    async def _watch(self, bus: Logind) -> None:
        while True:
            active = await bus.prepare_for_shutdown()
            log.info("graceful node shutdown: PrepareForShutdown(%s)", active)
            if self.events is not None:
                self.events.node(NORMAL, EVENT_REASON, "Shutdown manager detected "
                                 + ("shutdown event" if active else "shutdown cancellation"))
            self.shutting_down = active
            self.status_now()
            if active:
                await self._shut_down()
            else:
                await self._take_lock(bus)

    async def _shut_down(self) -> None:
        """Stop the pods group by group, then release the lock."""
        self._metrics.started.set(self.clock.now().timestamp())
        self._metrics.ended.set(0)
        try:
            groups = group_pods(self.budgets, self.pods.active_pods())
            for budget, pods in zip(self.budgets, groups, strict=True):
                if pods:
                    await self._stop_group(budget, pods)
        finally:
            self._metrics.ended.set(self.clock.now().timestamp())
            self._release()
            log.info("graceful node shutdown: pods stopped; the lock is released")

    async def _stop_group(self, budget: Budget, pods: Sequence[Mapping[str, Any]]) -> None:
        log.info("graceful node shutdown: stopping %d pod(s) of priority %d and up "
                 "within %ds: %s", len(pods), budget.priority, budget.seconds,
                 ", ".join(describe(p) for p in pods))
        stops = {asyncio.ensure_future(self.pods.end_pod(dict(p), grace_for(p, budget),
                                                         REASON, MESSAGE))
                 for p in pods}
        timer = asyncio.ensure_future(self.clock.sleep(budget.seconds))
        pending = set(stops)
        try:
            while pending and not timer.done():
                done, pending = await asyncio.wait(pending | {timer},
                                                   return_when=asyncio.FIRST_COMPLETED)
                pending.discard(timer)
                for t in done - {timer}:
                    if not t.cancelled() and t.exception() is not None:
                        log.warning("graceful node shutdown: stopping a pod failed: %r",
                                    t.exception())
        finally:
            timer.cancel()
        if pending:
            log.warning("graceful node shutdown: %d pod(s) of priority %d and up had not "
                        "ended (stopped, final status written) within %ds; going on",
                        len(pending), budget.priority, budget.seconds)
            self._stops |= pending  # they go on; the agent's stop cancels them
            for t in pending:
                t.add_done_callback(self._stops.discard)
