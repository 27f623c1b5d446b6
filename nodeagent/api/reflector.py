"""One list-and-watch for everything nodepulse follows: the agent's Nodes, the pods
bound to its nodes, the operator's node Leases. Each user hands it a Handler, which is
what the user does with what comes (the full set; each batch of changes); the rest is
here, once:

- The first read is a paginated LIST (`limit`/`continue`; an expired continue token
  starts it over). Its resourceVersion starts the watch.
- The watch asks for bookmarks; every event and bookmark moves the resourceVersion on.
  When the stream ends (the server's timeout, a dropped connection, an API server
  restart) the watch reopens from there: a resume, not a relist.
- Only 410 Gone (the version is too old for the server) relists: a LIST or, with
  `streaming_relist`, a watch with sendInitialEvents (the streaming list, served from
  the watch cache without a LIST call) while the server allows it.
- Failures back off, doubling from `backoff_initial` to `backoff_max`, or as long as
  a 429's Retry-After asks (served in full). The backoff starts over after a watch that
  worked: something came on it, or it stayed open for a backoff ceiling (a server that
  accepts and at once drops every watch does neither, and keeps its growing backoff).
- The API server answering again (nodeagent.api.answered): the reflector fires the
  signal when a list or watch goes through after failures, and a backoff under way
  ends when the signal is delivered.

The handler is called on the event loop, in the order things happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Coroutine
from typing import Any, Protocol

from prometheus_client import Counter

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.client import ApiError, brief, is_retriable, status_of
from nodeagent.api.clock import Clock
from nodeagent.api.kube import Kube, Obj, Resource, WatchStream

log = logging.getLogger(__name__)

INITIAL_EVENTS_END = "k8s.io/initial-events-end"  # the bookmark that ends a streaming list


class Handler(Protocol):
    def on_list(self, items: list[Obj]) -> None:
        """The whole set (the first list, or a relist after 410): it replaces what came
        before; an object missing from it is gone."""

    def on_events(self, events: list[tuple[str, Obj]]) -> None:
        """(ADDED | MODIFIED | DELETED, object), in order."""


@dataclasses.dataclass(frozen=True)
class ReflectorConfig:
    resource: Resource
    name: str  # what log lines call this watch
    namespace: str | None = None
    label_selector: str = ""
    field_selector: str = ""
    page_size: int = 500
    watch_timeout: float = 300.0  # each watch asks the server to end it after 1-2x this
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    streaming_relist: bool = False


@dataclasses.dataclass(frozen=True)
class WatchMetrics:
    """Counters a user may want under its own names."""
    lists: Counter    # labels: reason (initial, gone), how (list, watchlist)
    relists: Counter  # relists after 410 Gone
    resumes: Counter  # labels: reason (closed, error): watches reopened without a relist
    events: Counter   # labels: type


class Gone(Exception):
    """410: the resourceVersion held is no longer served; relist."""


class WatchEnded(Exception):
    """A streaming relist ended before its initial-events-end bookmark."""


class Reflector:
    def __init__(self, kube: Kube, config: ReflectorConfig, handler: Handler, clock: Clock,
                 *, answered: ApiAnswered | None = None,
                 metrics: WatchMetrics | None = None) -> None:
        self.kube = kube
        self.config = config
        self.handler = handler
        self.clock = clock
        self.answered = answered or ApiAnswered(clock)
        self.metrics = metrics
        self.resource_version: str | None = None
        self.streaming_relist = config.streaming_relist  # off once the server refuses it
        # counters for tests and benchmarks
        self.lists = 0
        self.relists = 0
        self.resumes = 0
        self.watches = 0
        self.events = 0
        self.connected = asyncio.Event()  # a watch stream is open
        self.last_error: BaseException | None = None  # why the last list or watch failed
        self.failed = asyncio.Event()  # set at each failure (readers waiting for a list)
        self._failing = False
        self._stopping = False
        self._stopped = asyncio.Event()  # ends a wait under way when stop() is called
        self._stream: WatchStream | None = None
        # the current watch: when its stream opened, and whether anything came on it
        self._opened_at: float | None = None
        self._delivered = False

    async def run(self) -> None:
        """Until stopped or cancelled."""
        delay = 0.0
        relist_reason = "initial"
        while not self._stopping:
            self._opened_at, self._delivered = None, False
            listed = False
            try:
                if self.resource_version is None:
                    if relist_reason == "gone" and self.streaming_relist:
                        await self._watch(streaming=True)
                    else:
                        await self._list(relist_reason)
                        listed = True
                        await self._watch()
                else:
                    await self._watch()
                delay = 0.0
                if self._stopping:
                    break
                self._resumed("closed")
                if not self._delivered and self._open_for() < 1.0:
                    await self._pause(self.clock.sleep(1.0))  # ended at once: don't spin
            except Gone as e:
                log.info("%s: %s; listing again", self.config.name, e)
                self.resource_version = None
                relist_reason = "gone"
                self.relists += 1
                if self.metrics:
                    self.metrics.relists.inc()
                if listed and not self._delivered:
                    await self._pause(self.clock.sleep(1.0))  # 410 right after a list
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._stopping:
                    break
                if isinstance(e, WatchEnded):
                    self.streaming_relist = False  # this server will not do it; use LIST
                elif status_of(e) in (400, 422) and relist_reason == "gone" \
                        and self.resource_version is None and self.streaming_relist:
                    log.info("%s: streaming relist refused (%s); using LIST",
                             self.config.name, brief(e))
                    self.streaming_relist = False
                    continue
                if self._worked():
                    delay = 0.0  # a watch that worked broke: a new backoff, not the old one
                self.last_error = e
                self.failed.set()
                retry_after = _retry_after(e)
                delay = retry_after or min(self.config.backoff_max,
                                           max(self.config.backoff_initial, delay * 2))
                self._failing = True
                level = logging.INFO if is_retriable(e) else logging.WARNING
                log.log(level, "%s: %s; retrying in %.1fs", self.config.name, brief(e), delay)
                if retry_after is None:
                    await self._pause(self.answered.wait(delay))
                else:  # the server asked for this wait: other requests going through
                    await self._pause(self.clock.sleep(delay))  # do not cut it short
                if self.resource_version is not None:
                    self._resumed("error")

    def stop(self) -> None:
        """End the watch; `run` returns."""
        self._stopping = True
        self._stopped.set()
        self.drop_connection()

    async def _pause(self, wait: Coroutine[Any, Any, Any]) -> None:
        """`wait`, cut short by stop()."""
        waiting = asyncio.ensure_future(wait)
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (waiting, stopped):
                f.cancel()

    def drop_connection(self) -> None:
        """Close the open watch stream as a network failure would (tests, benchmarks)."""
        stream = self._stream
        if stream is not None:
            try:
                stream.close()
            except Exception as e:  # closed either way
                log.debug("%s: closing the stream: %s", self.config.name, e)

    def _open_for(self) -> float:
        return 0.0 if self._opened_at is None else self.clock.monotonic() - self._opened_at

    def _worked(self) -> bool:
        if self._opened_at is None:
            return False
        return self._delivered or self._open_for() >= self.config.backoff_max

    def _resumed(self, reason: str) -> None:
        self.resumes += 1
        if self.metrics:
            self.metrics.resumes.labels(reason).inc()

    def _answered(self) -> None:
        self.last_error = None
        if self._failing:
            self._failing = False
            self.answered.fire()

    # -- list ---------------------------------------------------------------------------

    async def _list(self, reason: str) -> None:
        c = self.config
        items: list[Obj] = []
        cont = ""
        while True:
            try:
                page = await self.kube.list(c.resource, namespace=c.namespace,
                                            label_selector=c.label_selector,
                                            field_selector=c.field_selector,
                                            limit=c.page_size, cont=cont, timeout=60.0)
            except ApiError as e:
                if e.status == 410 and cont:
                    # the continue token expired: start a consistent list again
                    items, cont = [], ""
                    continue
                raise
            items.extend(page.get("items") or [])
            cont = (page.get("metadata") or {}).get("continue") or ""
            if not cont:
                break
        self.lists += 1
        if self.metrics:
            self.metrics.lists.labels(reason, "list").inc()
        self.resource_version = str(page["metadata"]["resourceVersion"])
        self.handler.on_list(items)
        self._answered()

    # -- watch --------------------------------------------------------------------------

    async def _watch(self, streaming: bool = False) -> None:
        c = self.config
        self.watches += 1
        try:
            stream = await self.kube.watch(
                c.resource, namespace=c.namespace,
                resource_version="" if streaming else (self.resource_version or ""),
                label_selector=c.label_selector, field_selector=c.field_selector,
                timeout_seconds=int(c.watch_timeout * random.uniform(1.0, 2.0)),
                send_initial_events=streaming)
        except ApiError as e:
            if e.status == 410:  # refused up front rather than as an ERROR event
                raise Gone(f"resourceVersion {self.resource_version} is gone") from e
            raise
        self._stream = stream
        initial: list[Obj] | None = [] if streaming else None
        try:
            if self._stopping:
                return
            self.connected.set()
            self._opened_at = self.clock.monotonic()
            self._answered()
            async for batch in stream:
                self._delivered = self._delivered or bool(batch)
                initial = self._handle(batch, initial)
            if initial is not None:
                raise WatchEnded("the streaming relist ended before all objects arrived")
        finally:
            self.connected.clear()
            self._stream = None
            try:
                await stream.aclose()
            except Exception as e:  # must not hide the outcome (e.g. a 410)
                log.debug("%s: closing the stream: %s", c.name, e)

    def _handle(self, batch: list[Obj], initial: list[Obj] | None) -> list[Obj] | None:
        """One chunk of events; returns the streaming relist's objects so far (None
        when not in one). The handler gets the chunk's changes in one call."""
        changes: list[tuple[str, Obj]] = []
        for event in batch:
            etype = str(event.get("type", ""))
            obj = event.get("object") or {}
            self.events += 1
            if self.metrics:
                self.metrics.events.labels(etype).inc()
            if etype == "ERROR":
                self._deliver(changes)  # what came before it happened
                if obj.get("code") == 410:
                    raise Gone(obj.get("message") or "410 Gone")
                raise ApiError(obj.get("code") or 500,
                               obj.get("message") or obj.get("reason") or "watch error")
            meta = obj.get("metadata") or {}
            rv = meta.get("resourceVersion")
            if etype == "BOOKMARK":
                if initial is not None:
                    if (meta.get("annotations") or {}).get(INITIAL_EVENTS_END) != "true":
                        continue
                    self.lists += 1
                    if self.metrics:
                        self.metrics.lists.labels("gone", "watchlist").inc()
                    self.handler.on_list(initial)
                    initial = None
                if rv:
                    self.resource_version = str(rv)
                continue
            if initial is not None:
                initial.append(obj)  # part of the streamed list; its RV is not ours yet
                continue
            changes.append((etype, obj))
            if rv:
                self.resource_version = str(rv)
        self._deliver(changes)
        return initial

    def _deliver(self, changes: list[tuple[str, Obj]]) -> None:
        if changes:
            self.handler.on_events(changes)


def _retry_after(e: BaseException) -> float | None:
    if isinstance(e, ApiError) and e.status == 429 and e.headers:
        try:
            return float(e.headers.get("Retry-After", ""))
        except ValueError:
            return None
    return None
