"""Warning Events on the Node, written with the node's own credentials.

The Node authorizer lets a node create Events; like the kubelet's, they go to the
`default` namespace with the Node as involved object. The same reason and message are
written at most once per `repeat_after` seconds, so a bad manifest seen on every rescan
does not flood the API server.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from kubernetes import client

from nodeagent.api.clock import Clock
from nodeagent.api.rest import request_json
from nodeagent.sources.static import rfc3339

log = logging.getLogger("nodeagent.sources")


class NodeEvents:
    def __init__(self, api: client.ApiClient, node_name: str, clock: Clock, *,
                 component: str = "nodepulse-agent", repeat_after: float = 600.0) -> None:
        self.api = api
        self.node_name = node_name
        self.clock = clock
        self.component = component
        self.repeat_after = repeat_after
        self._last: dict[tuple[str, str], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._node_uid: str | None = None
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
            if self._node_uid is None:
                node = await asyncio.to_thread(request_json, self.api, "GET",
                                               f"/api/v1/nodes/{self.node_name}", timeout=10)
                self._node_uid = node["metadata"]["uid"]
            ts = rfc3339(self.clock.now())
            body = {
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{self.node_name}.{secrets.token_hex(8)}",
                             "namespace": "default"},
                "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node_name,
                                   "uid": self._node_uid},
                "reason": reason, "message": message[:1024], "type": "Warning",
                "source": {"component": self.component, "host": self.node_name},
                "reportingComponent": self.component, "reportingInstance": self.node_name,
                "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
            }
            await asyncio.to_thread(request_json, self.api, "POST",
                                    "/api/v1/namespaces/default/events", body=body, timeout=10)
            self.written += 1
        except Exception as e:  # an Event is best effort; the log line already exists
            log.info("could not write Event %s on node %s: %s", reason, self.node_name, e)
            # not written (e.g. the Node is not registered yet): the next report posts it
            if self._last.get((reason, message)) == asked:
                del self._last[(reason, message)]
