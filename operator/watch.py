"""One list-and-watch of the node Leases in kube-node-lease, outside kopf.

Leases are the hot stream (every node renews every few seconds: hundreds of events a
second at thousands of nodes). kopf spends over a millisecond of CPU on each event
(per-object workers, diffs, handler selection); this watch only parses the JSON line
and hands it to the Store. It reads in a worker thread (the kubernetes client blocks),
hands events over to the event loop a chunk at a time, resumes from the last
resourceVersion it saw (bookmarks keep that fresh), and relists only on 410 Gone.
Nodes and policies, which change rarely, stay with kopf.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from nodeoperator.state import LEASE_NAMESPACE, Store
from prometheus_client import Counter

from nodeagent.api.clock import Clock

log = logging.getLogger("nodeoperator.watch")

EVENTS = Counter("nodepulse_operator_lease_events_total", "Lease watch events handled")
RELISTS = Counter("nodepulse_operator_lease_relists_total", "Lease lists (start, 410 Gone)")

Batch = list[tuple[str, dict[str, Any]]]


class Gone(Exception):
    """The resourceVersion we resume from is too old: list again."""


class LeaseWatch:
    def __init__(self, api: Any, store: Store, clock: Clock, *,
                 namespace: str = LEASE_NAMESPACE, page: int = 500,
                 timeout: int = 300, backoff: float = 1.0) -> None:
        """`api` is a kubernetes CoordinationV1Api (or a fake with the same two calls)."""
        self.api, self.store, self.clock = api, store, clock
        self.namespace, self.page, self.timeout = namespace, page, timeout
        self.backoff = backoff
        self.rv: str | None = None
        self.listed = asyncio.Event()  # set once the first list is in the Store
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resp: Any = None  # the open watch response, to unblock its reader

    async def run(self) -> None:
        # The worker thread hands every batch to this loop, in order; a list's last
        # batch is applied before the awaiting code below resumes.
        self._loop = asyncio.get_running_loop()
        delay = self.backoff
        while True:
            try:
                if self.rv is None:
                    names = await asyncio.to_thread(self._list)
                    self.store.lease_sync(names)
                    self.listed.set()
                    RELISTS.inc()
                await asyncio.to_thread(self._watch)
                delay = self.backoff
            except Gone as e:
                log.info("lease watch: %s; listing again", e)
                self.rv = None
            except asyncio.CancelledError:
                self.close()
                raise
            except Exception as e:  # the API server is away: try again, then slower
                log.warning("lease watch: %s; retrying in %.0f s", e, delay)
                await self.clock.sleep(delay)
                delay = min(delay * 2, 30.0)

    def _list(self) -> set[str]:
        """Every Lease, page by page, into the Store (from the worker thread, so the
        Store calls are made on the loop); returns the names seen."""
        names: set[str] = set()
        token: str | None = None
        while True:
            resp = self.api.list_namespaced_lease(
                self.namespace, limit=self.page, _continue=token, _preload_content=False,
                _request_timeout=(5, 60))
            body = json.loads(resp.data)
            items = body.get("items") or []
            self._deliver([("ADDED", obj) for obj in items])
            names.update(obj["metadata"]["name"] for obj in items)
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                self.rv = body["metadata"]["resourceVersion"]
                return names

    def close(self) -> None:
        """Unblock the reader thread (on shutdown), so the process exits at once."""
        resp = self._resp
        if resp is not None:
            shutdown = getattr(resp, "shutdown", None) or resp.close
            shutdown()

    def _deliver(self, batch: Batch) -> None:
        if batch:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._apply, batch)

    def _apply(self, batch: Batch) -> None:
        for kind, obj in batch:
            obj.setdefault("metadata", {}).setdefault("namespace", self.namespace)
            self.store.lease_event(kind, obj)
        EVENTS.inc(len(batch))

    def _watch(self) -> None:
        resp = self.api.list_namespaced_lease(
            self.namespace, watch=True, resource_version=self.rv,
            allow_watch_bookmarks=True, timeout_seconds=self.timeout,
            _preload_content=False, _request_timeout=(5, self.timeout + 30))
        self._resp = resp
        try:
            buf = b""
            for chunk in resp.stream(65536):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                batch: Batch = []
                for line in lines:
                    if not line.strip():
                        continue
                    ev = json.loads(line)
                    kind, obj = ev.get("type"), ev.get("object") or {}
                    if kind == "ERROR":
                        self._deliver(batch)
                        if obj.get("code") == 410:
                            raise Gone(obj.get("message", "410 Gone"))
                        raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                    self.rv = obj["metadata"]["resourceVersion"]
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        batch.append((kind, obj))
                self._deliver(batch)
        finally:
            self._resp = None
            resp.release_conn()
