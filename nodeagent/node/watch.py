"""One watch over the Nodes this process speaks for, resuming where it left off.

For a single node it is a single-object watch (fieldSelector metadata.name=<node>, which
is what node credentials may watch); for many virtual nodes, one label-selector watch
(nodepulse.dev/agent=<id>) covers them all. It lists once, then watches from the last
resourceVersion seen (bookmarks included), and lists again only on 410 Gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from nodeagent.api.clock import Clock, Wakeup
from nodeagent.node.kube import Kube, Obj, WatchStream
from nodeagent.node.lease import Call, _brief

log = logging.getLogger(__name__)

# (event type: ADDED/MODIFIED/DELETED/SYNC, the Node)
Handler = Callable[[str, Obj], None]


class NodeWatch:
    def __init__(self, kube: Kube, clock: Clock, call: Call, handler: Handler, *,
                 field_selector: str = "", label_selector: str = "",
                 timeout_seconds: int = 300) -> None:
        self.kube = kube
        self.clock = clock
        self.call = call
        self.handler = handler
        self.field_selector = field_selector
        self.label_selector = label_selector
        self.timeout_seconds = timeout_seconds
        self.resource_version: str | None = None
        self.lists = 0
        self.delivered = 0  # events the current (or last) watch stream delivered
        self._stream: WatchStream | None = None
        self._stopping = False
        self._backoff = Wakeup()  # api_answered ends a backoff under way

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while not self._stopping:
            self.delivered = 0
            try:
                fresh = self.resource_version is None
                if fresh:
                    await self._list()
                assert self.resource_version is not None
                rv, seen = await self.call(self._watch_once, self.resource_version, loop)
                self.resource_version = rv
                failures = 0
                if not seen and (rv is not None or fresh) and not self._stopping:
                    # ended at once with nothing (or 410 right after a list): don't spin
                    await self.clock.sleep(1.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._stopping:
                    break
                if self.delivered:
                    failures = 0  # the watch worked before it broke: a new backoff
                failures += 1
                delay = min(8.0, 0.5 * 2 ** min(failures, 4))
                log.warning("node watch: %s; again in %.1fs", _brief(e), delay)
                await self._backoff.wait(self.clock, delay)

    def api_answered(self) -> None:
        """Another request to the API server went through after failing (a Lease
        renewal): a backoff under way ends now."""
        self._backoff.wake()

    async def _list(self) -> None:
        data = await self.call(self.kube.list_nodes, self.field_selector,
                               self.label_selector, timeout=30.0)
        self.lists += 1
        self.resource_version = str(data["metadata"]["resourceVersion"])
        for item in data.get("items", []):
            self.handler("SYNC", item)

    def _watch_once(self, rv: str, loop: asyncio.AbstractEventLoop) -> tuple[str | None, int]:
        """Blocking: follow one watch until the server ends it. Returns the resourceVersion
        to resume from (None after 410: list again) and how many events came."""
        try:
            stream = self.kube.watch_nodes(rv, self.field_selector, self.label_selector,
                                           self.timeout_seconds)
        except ApiException as e:
            if e.status == 410:  # refused up front rather than as an ERROR event
                log.info("node watch: resourceVersion %s is gone; listing again", rv)
                return None, 0
            raise
        self._stream = stream
        seen = 0
        try:
            for event in stream:
                if self._stopping:
                    break
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        log.info("node watch: resourceVersion %s is too old; listing again", rv)
                        return None, seen
                    raise ApiException(status=obj.get("code") or 500,
                                       reason=obj.get("message") or obj.get("reason"))
                seen += 1
                self.delivered = seen
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind != "BOOKMARK":
                    loop.call_soon_threadsafe(self.handler, str(kind), obj)
        finally:
            self._stream = None
            try:
                stream.close()
            except Exception as e:  # must not hide the outcome (e.g. the 410 above)
                log.debug("node watch: closing the stream: %s", e)
        return rv, seen

    def stop(self) -> None:
        self._stopping = True
        stream = self._stream
        if stream is not None:
            stream.close()
