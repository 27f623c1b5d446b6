"""The monitor's writes, through the one API layer (nodeagent.api.kube), on connections
of their own: the Events' never queue ahead of a taint write."""

from __future__ import annotations

from typing import Any

from nodeagent.api.kube import (
    EVENTS,
    MERGE,
    NODE_STATUS_POLICIES,
    NODES,
    STRATEGIC_MERGE,
    Kube,
    Obj,
)

TIMEOUT = 5  # seconds per write; see election.py for why it must stay short
EVENT_WRITERS = 4  # Events are posted with request turns of their own, this many at once


def _version(written: Obj) -> str:
    return str(written["metadata"]["resourceVersion"])


class KubeWriter:
    def __init__(self, kube: Kube, workers: int = 16) -> None:
        self.kube = kube.separate(workers)
        self.events = kube.separate(EVENT_WRITERS)

    async def patch_node(self, name: str, patch: dict[str, Any]) -> str:
        # Strategic merge: a Node's taint list has no merge key, so it is replaced
        # whole, guarded by the resourceVersion in the patch.
        return _version(await self.kube.patch(NODES, name, patch, content_type=STRATEGIC_MERGE,
                                              timeout=TIMEOUT))

    async def patch_node_status(self, name: str, patch: dict[str, Any]) -> str:
        # Conditions merge by type: only the ones we send change.
        return _version(await self.kube.patch(NODES, name, patch, subresource="status",
                                              content_type=STRATEGIC_MERGE, timeout=TIMEOUT))

    async def patch_policy_status(self, name: str, patch: dict[str, Any]) -> str:
        return _version(await self.kube.patch(NODE_STATUS_POLICIES, name, patch,
                                              subresource="status", content_type=MERGE,
                                              timeout=TIMEOUT))

    async def create_event(self, namespace: str, body: dict[str, Any]) -> str:
        return _version(await self.events.create(EVENTS, body, namespace=namespace,
                                                 timeout=TIMEOUT))

    async def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> str:
        return _version(await self.events.patch(EVENTS, name, patch, namespace=namespace,
                                                content_type=MERGE, timeout=TIMEOUT))

