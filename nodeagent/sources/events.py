"""Warning Events on the Node, written with the node's own credentials.

The Node authorizer lets a node create Events; like the kubelet's, they go to the
`default` namespace with the Node as involved object (its UID from the node's
registration). The same reason and message are written at most once per `repeat_after`
seconds, so a bad manifest seen on every rescan does not flood the API server.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

from nodeagent.api.client import brief
from nodeagent.api.clock import Clock
from nodeagent.api.kube import EVENTS, Kube
from nodeagent.sources.static import rfc3339

log = logging.getLogger("nodeagent.sources")


class NodeEvents:
    def __init__(self, kube: Kube, node_name: str, clock: Clock, *,
                 node_uid: Callable[[], str | None], component: str = "nodepulse-agent",
                 repeat_after: float = 600.0) -> None:
        """`node_uid`: the Node's UID once it is registered (None before)."""
        self.kube = kube
        self.node_name = node_name
        self.node_uid = node_uid
        self.clock = clock
        self.component = component
        self.repeat_after = repeat_after
        self._last: dict[tuple[str, str], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.written = 0

    def warning(self, reason: str, message: str) -> None:
        now = self.clock.monotonic()
        key = (reason, message)
        last = self._last.get(key)
        if last is not None and now - last < self.repeat_after:
            return
        self._last[key] = now
        task = asyncio.get_running_loop().create_task(self._post(reason, message, now))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the Events already scheduled (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _post(self, reason: str, message: str, asked: float) -> None:
        try:
            uid = self.node_uid()
            if uid is None:
                raise LookupError("the Node is not registered yet")
            ts = rfc3339(self.clock.now())
            body = {
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{self.node_name}.{secrets.token_hex(8)}",
                             "namespace": "default"},
                "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node_name,
                                   "uid": uid},
                "reason": reason, "message": message[:1024], "type": "Warning",
                "source": {"component": self.component, "host": self.node_name},
                "reportingComponent": self.component, "reportingInstance": self.node_name,
                "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
            }
            await self.kube.create(EVENTS, body, timeout=10, parse=False)
            self.written += 1
        except Exception as e:  # an Event is best effort; the log line already exists
            log.info("could not write Event %s on node %s: %s", reason, self.node_name,
                     brief(e))
            # not written (e.g. the Node is not registered yet): the next report posts it
            if self._last.get((reason, message)) == asked:
                del self._last[(reason, message)]
