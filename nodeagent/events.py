"""Events the agent writes, with the node's own credentials: about its Node (in the
`default` namespace, as the kubelet's) and about the pods it runs (in the pod's
namespace, `involvedObject.fieldPath` naming the container when there is one).

The Node authorizer lets a node create Events. The same event (object, type, reason,
message) is written at most once per `repeat_after` seconds, so a bad manifest seen on
every rescan or a container in back-off does not flood the API server. An event about
the Node waits for its registration. Writing is best effort: an event that could not be
written is tried again the next time it is reported.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from nodeagent.api.client import brief
from nodeagent.api.clock import Clock, api_microtime
from nodeagent.api.kube import EVENTS, Kube

log = logging.getLogger(__name__)

REGISTRATION_POLL = 1.0  # seconds between looks at whether the Node is registered
NORMAL = "Normal"
WARNING = "Warning"


class Events:
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
        self._last: dict[tuple[str, ...], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.written = 0

    def warning(self, reason: str, message: str) -> None:
        """A Warning about the Node itself."""
        self.node(WARNING, reason, message)

    def node(self, type_: str, reason: str, message: str) -> None:
        """An event about the Node itself."""
        self._record(None, type_, reason, message, self.node_name)

    def pod(self, pod: Mapping[str, Any], type_: str, reason: str, message: str, *,
            container: str = "") -> None:
        """An event about a pod, or about one of its containers (`container` is its
        name; the fieldPath says which list it is in, as the kubelet's does)."""
        meta = pod.get("metadata") or {}
        ref = {"apiVersion": "v1", "kind": "Pod", "name": str(meta.get("name", "")),
               "namespace": str(meta.get("namespace") or "default"),
               "uid": str(meta.get("uid", ""))}
        if container:
            ref["fieldPath"] = f"spec.{_list_of(pod, container)}{{{container}}}"
        host = str((pod.get("spec") or {}).get("nodeName") or self.node_name)
        self._record(ref, type_, reason, message, host)

    async def drain(self) -> None:
        """Wait for the Events already scheduled (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _record(self, ref: dict[str, str] | None, type_: str, reason: str,
                message: str, host: str) -> None:
        now = self.clock.monotonic()
        key = (*(ref.values() if ref else ("Node",)), type_, reason, message)
        last = self._last.get(key)
        if last is not None and now - last < self.repeat_after:
            return
        self._last[key] = now
        task = asyncio.get_running_loop().create_task(
            self._post(ref, type_, reason, message, host, key, now))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, ref: dict[str, str] | None, type_: str, reason: str,
                    message: str, host: str, key: tuple[str, ...], asked: float) -> None:
        try:
            if ref is None:
                ref = {"apiVersion": "v1", "kind": "Node", "name": self.node_name,
                       "uid": await self._registered(asked)}
            namespace = ref.get("namespace", "default")
            ts = api_microtime(self.clock.now())
            body = {
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{ref['name']}.{secrets.token_hex(8)}",
                             "namespace": namespace},
                "involvedObject": ref,
                "reason": reason, "message": message[:1024], "type": type_,
                "source": {"component": self.component, "host": host},
                "reportingComponent": self.component, "reportingInstance": host,
                "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
            }
            await self.kube.create(EVENTS, body, timeout=10, parse=False)
            self.written += 1
        except Exception as e:  # an Event is best effort; the log line already exists
            log.info("could not write Event %s on %s %s: %s", reason,
                     ref["kind"] if ref else "Node", ref["name"] if ref else self.node_name,
                     brief(e))
            # not written (e.g. the Node is not registered yet): the next report posts it
            if self._last.get(key) == asked:
                del self._last[key]


    async def _registered(self, asked: float) -> str:
        """The Node's UID, waiting for the registration (sources report problems from
        the start, usually before the Node exists): once the period is over, it is
        given up, and a problem still there is reported again."""
        while (uid := self.node_uid()) is None:
            if self.clock.monotonic() - asked >= self.repeat_after:
                raise LookupError("the Node was not registered in time")
            await self.clock.sleep(REGISTRATION_POLL)
        return uid


def _list_of(pod: Mapping[str, Any], container: str) -> str:
    spec = pod.get("spec") or {}
    for group in ("initContainers", "ephemeralContainers"):
        if any(c.get("name") == container for c in spec.get(group) or []):
            return group
    return "containers"
