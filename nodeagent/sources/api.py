"""The API source: pods bound to this node (or to a set of nodes), list then watch.

- Initial sync: a paginated LIST (`limit`/`continue`) of pods with
  `fieldSelector=spec.nodeName=<node>`; this is what the Node authorizer lets a node's
  own credentials read. Its resourceVersion starts the watch.
- Watch with `allowWatchBookmarks=true`; every event and bookmark advances the
  resourceVersion. When the stream ends (server timeout, dropped connection, API
  server restart) the watch is reopened from that resourceVersion: a resume, no relist.
- Only 410 Gone (the resourceVersion is too old for the API server) causes a relist.
  The relist is a watch with `sendInitialEvents=true` (the streaming list, served
  from the watch cache without a LIST call) when the server allows it, else a paginated
  LIST; either way the result goes to `Merge.set`, which emits only the differences
  against what this source delivered before.

Several nodes (virtual-node mode): with more than one name, one watch covers all bound
pods (`fieldSelector=spec.nodeName!=`) and pods of other nodes are dropped here by
`spec.nodeName` (which never changes once set). That needs credentials allowed to list
all pods (a service account), not a node's own. Pods carry their `spec.nodeName`, so
consumers route them.

Pods are dicts (the JSON body is parsed once, no model objects). Blocking calls run in
threads; the watch stream is read by a thread that hands batches of events to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import Callable, Iterable
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from nodeagent.api.client import is_retriable, status_of
from nodeagent.api.clock import Clock, Wakeup
from nodeagent.api.rest import json_lines, request, request_json
from nodeagent.sources import metrics
from nodeagent.sources.merge import Merge
from nodeagent.sources.types import Pod, Source

log = logging.getLogger("nodeagent.sources")

INITIAL_EVENTS_END = "k8s.io/initial-events-end"


class Gone(Exception):
    """410: the resourceVersion we hold is no longer served; relist."""


class WatchEnded(Exception):
    """A streaming relist ended before its initial-events-end bookmark."""


class APISource:
    def __init__(self, api: client.ApiClient, node_names: Iterable[str], merge: Merge,
                 clock: Clock, *, page_size: int = 500, watch_timeout: float = 300.0,
                 backoff_initial: float = 0.5, backoff_max: float = 30.0,
                 streaming_relist: bool = True) -> None:
        self.api = api
        self.nodes = frozenset(node_names)
        if not self.nodes:
            raise ValueError("the API source needs at least one node name")
        if len(self.nodes) == 1:
            self.field_selector = f"spec.nodeName={next(iter(self.nodes))}"
        else:
            self.field_selector = "spec.nodeName!="
        self.merge = merge
        self.clock = clock
        self.page_size = page_size
        self.watch_timeout = watch_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.streaming_relist = streaming_relist
        self.resource_version: str | None = None
        # counters for tests and the benchmark (the same as the Prometheus metrics)
        self.lists = 0
        self.relists = 0
        self.resumes = 0
        self.events = 0
        self.watches = 0
        self.connected = asyncio.Event()  # a watch stream is open
        # called when the API server answers again after a failed list or watch (the
        # mirror manager and the pod status writes then retry at once)
        self.on_reconnect: list[Callable[[], None]] = []
        self._failing = False
        self._backoff = Wakeup()  # api_answered ends a backoff under way
        # the current watch: when its stream opened, and whether anything came on it
        self._opened_at: float | None = None
        self._delivered = False
        self._resp: urllib3.BaseHTTPResponse | None = None
        self._resp_lock = threading.Lock()
        self._stop = threading.Event()  # per watch: the reader must stop

    async def run(self) -> None:
        delay = 0.0
        relist_reason = "initial"
        while True:
            self._opened_at, self._delivered = None, False
            try:
                if self.resource_version is None:
                    if relist_reason == "gone" and self.streaming_relist:
                        await self._watch(streaming_relist=True)
                    else:
                        await self._list(relist_reason)
                        await self._watch()
                else:
                    await self._watch()
                delay = 0.0
                self._resumed("closed")
            except Gone as e:
                log.info("api source: %s; relisting", e)
                self.resource_version = None
                relist_reason = "gone"
                self.relists += 1
                metrics.API_RELISTS.inc()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if isinstance(e, WatchEnded):
                    self.streaming_relist = False  # this server will not do it; use LIST
                elif status_of(e) in (400, 422) and relist_reason == "gone" \
                        and self.resource_version is None and self.streaming_relist:
                    log.info("api source: streaming relist refused (%s); using LIST", e)
                    self.streaming_relist = False
                    continue
                if self._worked():
                    delay = 0.0  # a watch that worked broke: a new backoff, not the old one
                retry_after = _retry_after(e)
                delay = retry_after or min(self.backoff_max,
                                           max(self.backoff_initial, delay * 2))
                self._failing = True
                level = logging.INFO if is_retriable(e) else logging.WARNING
                log.log(level, "api source: %s; retrying in %.1fs", _describe(e), delay)
                if retry_after is None:
                    await self._backoff.wait(self.clock, delay)
                else:  # the server asked for this wait: other requests going through
                    await self.clock.sleep(delay)  # do not cut it short
                if self.resource_version is not None:
                    self._resumed("error")

    def api_answered(self) -> None:
        """Another request to the API server went through after failing (the node's
        Lease): a backoff under way ends now instead of up to backoff_max later."""
        self._backoff.wake()

    def _worked(self) -> bool:
        """The watch that just failed had opened and then worked: something came on it,
        or it stayed open for a full backoff ceiling. A server that accepts and at once
        drops every watch does neither, and keeps its growing backoff."""
        if self._opened_at is None:
            return False
        return self._delivered or self.clock.monotonic() - self._opened_at >= self.backoff_max

    def _resumed(self, reason: str) -> None:
        self.resumes += 1
        metrics.API_RESUMES.labels(reason).inc()

    def _mine(self, pod: Pod) -> bool:
        return pod.get("spec", {}).get("nodeName") in self.nodes

    # -- list ---------------------------------------------------------------------------

    async def _list(self, reason: str) -> None:
        pods: list[Pod] = []
        cont: str | None = None
        while True:
            try:
                page = await asyncio.to_thread(
                    request_json, self.api, "GET", "/api/v1/pods",
                    query={"fieldSelector": self.field_selector, "limit": self.page_size,
                           "continue": cont}, timeout=60.0)
            except ApiException as e:
                if e.status == 410 and cont is not None:
                    # the continue token expired: start a consistent list again
                    pods, cont = [], None
                    continue
                raise
            for pod in page.get("items") or []:
                if self._mine(pod):
                    pod.setdefault("apiVersion", "v1")
                    pod.setdefault("kind", "Pod")
                    pods.append(pod)
            cont = (page.get("metadata") or {}).get("continue") or None
            if cont is None:
                break
        self.lists += 1
        metrics.API_LISTS.labels(reason, "list").inc()
        self.merge.set(Source.API, pods)
        self.resource_version = page["metadata"]["resourceVersion"]
        self._answered()

    def _answered(self) -> None:
        if self._failing:
            self._failing = False
            for hook in self.on_reconnect:
                hook()

    # -- watch --------------------------------------------------------------------------

    async def _watch(self, streaming_relist: bool = False) -> None:
        query: dict[str, Any] = {
            "fieldSelector": self.field_selector, "watch": True, "allowWatchBookmarks": True,
            "timeoutSeconds": int(self.watch_timeout * random.uniform(1.0, 2.0)),
        }
        if streaming_relist:
            query.update(sendInitialEvents=True, resourceVersionMatch="NotOlderThan")
        else:
            query["resourceVersion"] = self.resource_version
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[dict] | BaseException | None] = asyncio.Queue()
        with self._resp_lock:
            self._stop = threading.Event()
        reader = threading.Thread(target=self._read_stream,
                                  args=(query, queue, loop, self._stop),
                                  name="api-source-watch", daemon=True)
        self.watches += 1
        reader.start()
        initial: list[Pod] | None = [] if streaming_relist else None
        try:
            while True:
                item = await queue.get()
                if item is None:
                    if initial is not None:
                        raise WatchEnded("the streaming relist ended before all pods arrived")
                    return
                if isinstance(item, BaseException):
                    raise item
                self.connected.set()
                if self._opened_at is None:
                    self._opened_at = self.clock.monotonic()
                    self._answered()
                self._delivered = self._delivered or bool(item)
                for event in item:
                    initial = self._handle(event, initial)
        finally:
            self.connected.clear()
            self._close_stream()
            # The reader ends as soon as its socket is shut; a request still waiting for
            # response headers ends at its own timeout (it is a daemon thread).
            await asyncio.to_thread(reader.join, 10.0)

    def _handle(self, event: dict, initial: list[Pod] | None) -> list[Pod] | None:
        etype = event.get("type", "")
        obj = event.get("object") or {}
        self.events += 1
        metrics.API_EVENTS.labels(etype).inc()
        if etype == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message") or "410 Gone")
            raise ApiException(status=obj.get("code") or 500,
                               reason=obj.get("message") or "watch error")
        meta = obj.get("metadata") or {}
        rv = meta.get("resourceVersion")
        if etype == "BOOKMARK":
            if initial is not None:
                if (meta.get("annotations") or {}).get(INITIAL_EVENTS_END) != "true":
                    return initial
                self.lists += 1
                metrics.API_LISTS.labels("gone", "watchlist").inc()
                self.merge.set(Source.API, initial)
                initial = None
            self.resource_version = rv
            return initial
        if self._mine(obj):
            if initial is not None:
                initial.append(obj)  # part of the streamed list; RV is not ours yet
                return initial
            if etype in ("ADDED", "MODIFIED"):
                self.merge.upsert(Source.API, obj)
            elif etype == "DELETED":
                self.merge.remove(Source.API, obj)
        if initial is None and rv:
            self.resource_version = rv
        return initial

    def _read_stream(self, query: dict[str, Any],
                     queue: asyncio.Queue[list[dict] | BaseException | None],
                     loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """Thread: open the watch, split the stream into JSON lines, pass them on."""
        def put(item: list[dict] | BaseException | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        resp: urllib3.BaseHTTPResponse | None = None
        try:
            resp = request(self.api, "GET", "/api/v1/pods", query=query,
                           timeout=(10.0, self.watch_timeout * 2 + 30))
            with self._resp_lock:
                if stop.is_set():
                    raise ConnectionResetError("the watch was closed while it was opened")
                self._resp = resp
            put([])  # the stream is open
            for events in json_lines(resp.stream(65536)):
                put(events)
            put(None)
        except ApiException as e:
            put(Gone(e.reason or "410 Gone") if e.status == 410 else e)
        except Exception as e:  # handed to the loop, which decides
            put(e)
        finally:
            with self._resp_lock:
                if self._resp is resp:
                    self._resp = None
            if resp is not None:
                resp.close()

    def drop_connection(self) -> None:
        """Close the open watch stream as a network failure would (tests, benchmarks)."""
        self._close_stream()

    def _close_stream(self) -> None:
        with self._resp_lock:
            self._stop.set()
            resp, self._resp = self._resp, None
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()  # unblocks a read in progress in the reader thread
            resp.close()


def _retry_after(e: BaseException) -> float | None:
    if isinstance(e, ApiException) and e.status == 429 and e.headers:
        try:
            return float(e.headers.get("Retry-After", ""))
        except ValueError:
            return None
    return None


def _describe(e: BaseException) -> str:
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"
