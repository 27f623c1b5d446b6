"""Container probes: liveness, readiness and startup, as the kubelet runs them.

One `ProbeManager` per node loop. Each probe of each container (regular containers and
restartable "sidecar" init containers) has a worker: a task that wakes every
`periodSeconds` on the loop's clock and runs the probe against the container the PLEG
cache holds for that name (its id, state, start time; the pod IP from the sandbox), so a
probe costs no runtime call beyond its own (an exec probe's ExecSync; an HTTP, TCP or
gRPC probe dials the pod from the agent and costs none).

A result counts once it has repeated `successThreshold` or `failureThreshold` times;
results are kept per container id (a restarted container starts over), and a change is
pushed to the pod's worker (`on_change`), which recomputes the status (written only
when it changed) or, on a liveness or startup failure, kills the container.

Until the startup probe (if any) has succeeded, liveness and readiness do not run; the
startup probe stops once it has a result. Readiness starts as failure, liveness as
success, startup as unknown. A probe that cannot run at all (unknown named port, no pod
IP) counts as nothing, as the kubelet's "probe errored".
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import enum
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter

from nodeagent.api.clock import Clock
from nodeagent.api.kube import describe
from nodeagent.events import WARNING as EVENT_WARNING
from nodeagent.events import Events
from nodeagent.metrics import per_registry
from nodeagent.pods.handlers import FAILURE, SUCCESS, WARNING, ActionError, Actions, Target
from nodeagent.pods.pleg import PodCache
from nodeagent.pods.podstatus import Probed, is_sidecar
from nodeagent.pods.podupdate import Pod
from nodeagent.runtime.base import Container, ContainerState, PodRuntimeStatus

log = logging.getLogger(__name__)

# a container older than the agent by this much was adopted, not started by it
RESTART_GRACE = 10.0


class Kind(enum.StrEnum):
    LIVENESS = "Liveness"
    READINESS = "Readiness"
    STARTUP = "Startup"

    @property
    def field(self) -> str:
        return f"{self.value.lower()}Probe"


class Result(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    UNKNOWN = "unknown"


INITIAL = {Kind.READINESS: Result.FAILURE, Kind.LIVENESS: Result.SUCCESS,
           Kind.STARTUP: Result.UNKNOWN}


@per_registry
def _probe_counter(registry: CollectorRegistry) -> Counter:
    return Counter("nodepulse_probe_results_total",
                   "Probes run, by kind (Liveness, Readiness, Startup) and result (success, "
                   "failure, unknown: the probe could not be run)",
                   ["node", "probe_type", "result"], registry=registry)


def probed_containers(pod: Pod) -> list[Mapping[str, Any]]:
    """The containers probes run on: regular ones and sidecar init containers."""
    spec = pod.get("spec") or {}
    return [*(spec.get("containers") or []),
            *(c for c in spec.get("initContainers") or [] if is_sidecar(c))]


def latest(rs: PodRuntimeStatus, name: str) -> Container | None:
    cs = [c for c in rs.containers if c.name == name]
    return max(cs, key=lambda c: c.attempt) if cs else None


def _seconds(probe: Mapping[str, Any], key: str, default: int, least: int = 0) -> int:
    v = probe.get(key)
    return max(least, int(v)) if v is not None else default


@dataclass
class _Worker:
    uid: str
    name: str
    kind: Kind
    probe: Mapping[str, Any]
    container: Mapping[str, Any]
    task: asyncio.Task[None] | None = None
    container_id: str = ""
    last: Result | None = None
    run: int = 0
    on_hold: bool = False
    trigger: asyncio.Event = field(default_factory=asyncio.Event)
    probes: int = 0  # probes run, for tests and the benchmark


class ProbeManager:
    def __init__(self, actions: Actions, cache: PodCache, clock: Clock, *,
                 events: Events | None = None, host_ip: str = "",
                 on_change: Callable[[str], None] = lambda uid: None,
                 rng: random.Random | None = None, node: str = "",
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.actions = actions
        self.cache = cache
        self.clock = clock
        self.events = events
        self.host_ip = host_ip
        self.on_change = on_change
        self.rng = rng or random.Random()
        self.started_at = clock.monotonic()
        self._started_wall = clock.now()
        self._pods: dict[str, Pod] = {}
        self._workers: dict[tuple[str, str, Kind], _Worker] = {}
        self._results: dict[tuple[str, Kind], Result] = {}  # (container id, kind)
        self.probes_run = 0
        self._counted = _probe_counter(registry)
        self._node = node

    # --- the pod's lifecycle ----------------------------------------------------------

    def update(self, pod: Pod) -> None:
        """The pod is (still) syncing: a worker for each probe it declares."""
        uid = str(pod["metadata"]["uid"])
        self._pods[uid] = pod
        for c in probed_containers(pod):
            for kind in Kind:
                probe = c.get(kind.field)
                key = (uid, str(c["name"]), kind)
                if probe is None or key in self._workers:
                    continue
                w = self._workers[key] = _Worker(uid, str(c["name"]), kind, probe, c)
                w.task = asyncio.get_running_loop().create_task(
                    self._run(w), name=f"probe-{kind.value.lower()}-{uid}-{c['name']}")

    def stop_liveness_and_startup(self, uid: str) -> None:
        """The pod is terminating: containers are no longer killed for failing probes;
        readiness goes on (a terminating pod's endpoints follow it)."""
        for key in [k for k in self._workers if k[0] == uid and k[2] != Kind.READINESS]:
            self._stop(key)

    def remove(self, uid: str) -> None:
        """The pod is done or gone: no more probes, results forgotten."""
        self._pods.pop(uid, None)
        for key in [k for k in self._workers if k[0] == uid]:
            self._stop(key)

    def _stop(self, key: tuple[str, str, Kind]) -> None:
        w = self._workers.pop(key, None)
        if w is None:
            return
        if w.task is not None:
            w.task.cancel()
        if w.container_id:
            self._results.pop((w.container_id, w.kind), None)

    async def close(self) -> None:
        tasks = [w.task for w in self._workers.values() if w.task is not None]
        self._workers.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.actions.close()

    # --- what the syncer and the status ask ---------------------------------------------

    def has_worker(self, uid: str, name: str, kind: Kind) -> bool:
        return (uid, name, kind) in self._workers

    def result(self, container_id: str, kind: Kind) -> Result | None:
        return self._results.get((container_id, kind))

    def kill_reason(self, container_id: str) -> Kind | None:
        """The probe whose failure means the container must be killed, if any."""
        for kind in (Kind.LIVENESS, Kind.STARTUP):
            if self._results.get((container_id, kind)) == Result.FAILURE:
                return kind
        return None

    def _current(self, uid: str, c: Container, kind: Kind) -> Result | None:
        """The container's result for a probe kind: what its worker decided, else (the
        worker has not looked at this container yet) its starting value. None: the
        container has no such probe."""
        w = self._workers.get((uid, c.name, kind))
        if w is None:
            return None
        r = self._results.get((c.id, kind))
        if r is None:
            pod = self._pods.get(uid)
            r = self._initial(w, pod, c) if pod is not None else INITIAL[kind]
        return r

    def started(self, uid: str, c: Container) -> bool:
        """Running, and its startup probe (if any) has succeeded."""
        if c.state != ContainerState.RUNNING:
            return False
        r = self._current(uid, c, Kind.STARTUP)
        return r is None or r == Result.SUCCESS

    def readiness(self, pod: Pod, rs: PodRuntimeStatus) -> dict[str, Probed]:
        """Started and ready per container id, for the containers with probes; asks a
        started container's readiness probe to run now while it is not ready."""
        uid = str(pod["metadata"]["uid"])
        out: dict[str, Probed] = {}
        for spec in probed_containers(pod):
            name = str(spec["name"])
            if not any(self.has_worker(uid, name, k) for k in Kind):
                continue
            c = latest(rs, name)
            if c is None:
                continue
            started = self.started(uid, c)
            ready = False
            if started:
                r = self._current(uid, c, Kind.READINESS)
                ready = r is None or r == Result.SUCCESS
                w = self._workers.get((uid, name, Kind.READINESS))
                if w is not None and not ready:
                    w.trigger.set()  # probe it now rather than a period from now
            out[c.id] = Probed(started, ready)
        return out

    # --- the workers ----------------------------------------------------------------

    async def _run(self, w: _Worker) -> None:
        period = _seconds(w.probe, "periodSeconds", 10, 1)
        try:
            if self.clock.monotonic() - self.started_at < period:
                # the agent just started: spread the first probes over one period
                await self._wait(w, self.rng.random() * period)
            due = self.clock.monotonic()
            while await self._step(w):
                # a tick every period, as a ticker: a slow probe does not stretch it (the
                # ticks it overran are dropped); a probe asked for now starts it over
                now = self.clock.monotonic()
                due += period
                if due <= now:
                    due += ((now - due) // period + 1) * period
                if await self._wait(w, due - now):
                    due = self.clock.monotonic()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("probe worker %s/%s %s failed", w.uid, w.name, w.kind.value)
        # a worker that is done stays (without a task) until the pod is removed, so the
        # next sync does not start it again

    async def _wait(self, w: _Worker, seconds: float) -> bool:
        """Sleep `seconds`, or less when the status asks for a probe now (True then)."""
        if w.trigger.is_set():
            w.trigger.clear()
            return True
        sleep = asyncio.ensure_future(self.clock.sleep(seconds))
        woken = asyncio.ensure_future(w.trigger.wait())
        try:
            await asyncio.wait({sleep, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            woken.cancel()
        triggered = w.trigger.is_set()
        w.trigger.clear()
        return triggered

    def _set(self, w: _Worker, result: Result) -> None:
        key = (w.container_id, w.kind)
        if self._results.get(key) == result:
            return
        self._results[key] = result
        self.on_change(w.uid)

    def _initial(self, w: _Worker, pod: Pod, c: Container) -> Result:
        """A container the agent adopted (it ran before the agent started) keeps what
        the API last heard about it, so an agent restart does not flap readiness."""
        adopted = c.started_at is not None and c.started_at < self._started_wall - \
            dt.timedelta(seconds=RESTART_GRACE)
        if not adopted or w.kind == Kind.LIVENESS:
            return INITIAL[w.kind]
        status = pod.get("status") or {}
        for cs in [*(status.get("containerStatuses") or []),
                   *(status.get("initContainerStatuses") or [])]:
            if cs.get("name") == w.name and str(cs.get("containerID", "")).endswith(c.id):
                ok = cs.get("ready") if w.kind == Kind.READINESS else cs.get("started")
                return Result.SUCCESS if ok else INITIAL[w.kind]
        return INITIAL[w.kind]

    async def _step(self, w: _Worker) -> bool:
        """One tick (the kubelet's doProbe). False: this worker is done."""
        pod = self._pods.get(w.uid)
        if pod is None:
            return False
        entry = self.cache.get(w.uid)
        c = latest(entry.status, w.name)
        if c is None or c.state == ContainerState.CREATED:
            return True  # not started yet
        if c.id != w.container_id:
            if w.container_id:
                self._results.pop((w.container_id, w.kind), None)
            w.container_id = c.id
            w.on_hold, w.last, w.run = False, None, 0
            self._set(w, self._initial(w, pod, c))
        if w.on_hold:
            return True
        if c.state != ContainerState.RUNNING:
            self._set(w, Result.FAILURE)
            policy = (pod.get("spec") or {}).get("restartPolicy") or "Always"
            return not (c.state == ContainerState.EXITED and policy == "Never"
                        and not is_sidecar(w.container))
        if (pod.get("metadata") or {}).get("deletionTimestamp") and \
                w.kind != Kind.READINESS:
            self._set(w, Result.SUCCESS)
            return False
        delay = _seconds(w.probe, "initialDelaySeconds", 0)
        if c.started_at is not None and \
                (self.clock.now() - c.started_at).total_seconds() < delay:
            return True
        if self.started(w.uid, c) != (w.kind != Kind.STARTUP):
            return True  # startup runs until it passes, the others after
        result = await self._probe(w, pod, c, entry.status)
        if result is None or self._workers.get((w.uid, w.name, w.kind)) is not w:
            return True
        if result == w.last:
            w.run += 1
        else:
            w.last, w.run = result, 1
        need = _seconds(w.probe, "failureThreshold", 3, 1) if result == Result.FAILURE \
            else _seconds(w.probe, "successThreshold", 1, 1)
        if w.run < need:
            return True
        self._set(w, result)
        if (w.kind == Kind.LIVENESS and result == Result.FAILURE) or w.kind == Kind.STARTUP:
            w.on_hold, w.run = True, 0  # until the container is restarted
        return True

    async def _probe(self, w: _Worker, pod: Pod, c: Container,
                     rs: PodRuntimeStatus) -> Result | None:
        spec = pod.get("spec") or {}
        ip = self.host_ip if spec.get("hostNetwork") else rs.ip
        timeout = _seconds(w.probe, "timeoutSeconds", 1, 1)
        w.probes += 1
        self.probes_run += 1
        try:
            outcome = await self.actions.run(w.probe, Target(w.container, c.id, ip), timeout)
        except ActionError as e:
            log.debug("pod %s container %s: %s probe errored: %s", describe(pod), w.name,
                      w.kind.value, e)
            self._event(pod, w.name, "Unhealthy", f"{w.kind.value} probe errored and "
                                                  f"resulted in Unknown state: {e}")
            self._count(w, Result.UNKNOWN)
            return None
        if outcome.result == FAILURE:
            self._event(pod, w.name, "Unhealthy",
                        f"{w.kind.value} probe failed: {outcome.output}")
            self._count(w, Result.FAILURE)
            return Result.FAILURE
        if outcome.result == WARNING:
            self._event(pod, w.name, "ProbeWarning",
                        f"{w.kind.value} probe warning: {outcome.output}")
        assert outcome.result in (SUCCESS, WARNING)
        self._count(w, Result.SUCCESS)
        return Result.SUCCESS

    def _count(self, w: _Worker, result: Result) -> None:
        self._counted.labels(self._node, w.kind.value, result.value).inc()

    def _event(self, pod: Pod, container: str, reason: str, message: str) -> None:
        if self.events is not None:
            self.events.pod(pod, EVENT_WARNING, reason, message, container=container)

    def worker_count(self) -> int:
        return len(self._workers)
