"""Events on Nodes, so `kubectl describe node` tells what the operator did and why.

Like the controller manager's, they are core/v1 Events in the `default` namespace
(a Node has none) with the Node as involvedObject (kind, name and uid), which is
where `kubectl describe node` looks; the agent writes its own the same way. The
monitor posts one only when it changes something (a taint added or removed, Ready
set to Unknown, the partition guard tripped or lifted), never per period. A policy the
controller manager overrides (coexist mode) gets one the same way, about the
NodeStatusPolicy (`kubectl describe nsp`).

The same node, reason and message within `window` seconds is not a new Event: the
one already written gets its count raised and lastTimestamp moved (a PATCH), as a
flapping node's would with client-go's correlator. A token bucket per node caps
what one node can cost the API server. Events are posted in the background, a few at a
time (`emit`), so a mass outage's Events never delay the taint writes or the next
monitor period; they also wait (`after`) while the monitor has nodes to mark, as a mass
marking's Events would otherwise take as much of the API server as the marking itself
(three Events per node against two writes); their timestamps are when they were
emitted. Past `max_pending` waiting, more are dropped and counted.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime as dt
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from prometheus_client import Counter

from nodeagent.api.client import status_of
from nodeagent.api.clock import Clock

log = logging.getLogger("nodeoperator.nodeevents")

COMPONENT = "nodepulse-operator"
NAMESPACE = "default"  # where Events about cluster-scoped objects go

EVENTS = Counter("nodepulse_operator_events_total", "Events posted on Nodes",
                 ["reason", "result"])


class EventSink(Protocol):
    async def create_event(self, namespace: str, body: dict[str, Any]) -> str: ...

    async def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> str: ...


@dataclasses.dataclass(frozen=True)
class NodeEvent:
    node: str  # the involved object's name: a Node, or a NodeStatusPolicy (`kind`)
    uid: str
    type: str  # Normal | Warning
    reason: str  # CamelCase
    message: str  # a sentence
    kind: str = "Node"
    api_version: str = "v1"


@dataclasses.dataclass
class _Written:
    name: str
    count: int
    at: float  # monotonic, last posted


class NodeEvents:
    def __init__(self, sink: EventSink, clock: Clock, *, instance: str = "",
                 window: float = 600.0, burst: int = 10, refill_every: float = 30.0,
                 remember: int = 4096, concurrency: int = 4, max_pending: int = 2000) -> None:
        self.sink, self.clock, self.instance = sink, clock, instance
        self._slots = asyncio.Semaphore(concurrency)
        self.max_pending = max_pending
        self._tasks: set[asyncio.Task[None]] = set()
        self.window, self.burst, self.refill_every = window, burst, refill_every
        self.remember = remember
        self._written: collections.OrderedDict[tuple[str, str, str, str], _Written] = \
            collections.OrderedDict()
        self._tokens: dict[str, tuple[float, float]] = {}  # node -> (tokens, at)
        self.dropped = 0
        # awaited before each post: what must go to the API server first
        self.after: Callable[[], Awaitable[Any]] | None = None

    def _take(self, node: str) -> bool:
        now = self.clock.monotonic()
        tokens, at = self._tokens.get(node, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) / self.refill_every)
        ok = tokens >= 1.0
        self._tokens[node] = (tokens - 1.0 if ok else tokens, now)
        if len(self._tokens) > self.remember:  # forget the longest-idle node's bucket
            oldest = min(self._tokens, key=lambda n: self._tokens[n][1])
            del self._tokens[oldest]
        return ok

    def emit(self, ev: NodeEvent) -> None:
        """Post in the background (from the event loop)."""
        if len(self._tasks) >= self.max_pending:
            self.dropped += 1
            EVENTS.labels(ev.reason, "dropped").inc()
            return
        task = asyncio.get_running_loop().create_task(self._post_later(ev, self.clock.now()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post_later(self, ev: NodeEvent, at: dt.datetime) -> None:
        if self.after is not None:
            await self.after()
        async with self._slots:
            await self.post(ev, at)

    async def drain(self) -> None:
        """Wait for the Events emitted so far (tests; shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def post(self, ev: NodeEvent, at: dt.datetime | None = None) -> None:
        """Write the Event (`at`: when it happened, default now), or raise the count of
        the same one written recently. Never raises: an Event is a courtesy, the write
        it reports has been made."""
        if not self._take(f"{ev.kind}/{ev.node}"):
            self.dropped += 1
            EVENTS.labels(ev.reason, "dropped").inc()
            return
        key = (f"{ev.kind}/{ev.node}", ev.uid, ev.reason, ev.message)
        now = self.clock.monotonic()
        ts = (at or self.clock.now()).strftime("%Y-%m-%dT%H:%M:%SZ")
        seen = self._written.get(key)
        try:
            if seen is not None and now - seen.at < self.window:
                try:
                    await self.sink.patch_event(NAMESPACE, seen.name, {
                        "count": seen.count + 1, "lastTimestamp": ts})
                    seen.count += 1
                    seen.at = now
                    self._written.move_to_end(key)
                    EVENTS.labels(ev.reason, "aggregated").inc()
                    return
                except Exception as e:
                    if status_of(e) != 404:  # expired (Event TTL): write a new one
                        raise
            name = f"{ev.node}.{secrets.token_hex(8)}"
            await self.sink.create_event(NAMESPACE, self._body(ev, name, ts))
            self._written[key] = _Written(name, 1, now)
            self._written.move_to_end(key)
            while len(self._written) > self.remember:
                self._written.popitem(last=False)
            EVENTS.labels(ev.reason, "created").inc()
        except Exception as e:
            EVENTS.labels(ev.reason, "error").inc()
            log.info("could not post Event %s on node %s: %s", ev.reason, ev.node, e)

    def _body(self, ev: NodeEvent, name: str, ts: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "involvedObject": {"apiVersion": ev.api_version, "kind": ev.kind,
                               "name": ev.node, "uid": ev.uid},
            "type": ev.type, "reason": ev.reason, "message": ev.message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT, "reportingInstance": self.instance,
            "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
        }
