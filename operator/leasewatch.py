"""The node Leases in kube-node-lease, listed and watched outside kopf.

Leases are the hot stream (every node renews every few seconds: hundreds of events a
second at thousands of nodes). kopf spends over a millisecond of CPU on each event
(per-object workers, diffs, handler selection); this watch only parses the JSON line
and hands it to the Store. Listing (paginated), watching from the last resourceVersion
(bookmarks keep it fresh), relisting only on 410 Gone and backing off are the
reflector's (nodeagent.api.reflector); what is done with a Lease is here. Nodes and
policies, which change rarely, stay with kopf.
"""

from __future__ import annotations

import asyncio
import logging

from nodeoperator.state import Store
from prometheus_client import Counter

from nodeagent.api.clock import Clock
from nodeagent.api.kube import LEASES, NODE_LEASE_NAMESPACE, Kube, Obj
from nodeagent.api.reflector import Reflector, ReflectorConfig

log = logging.getLogger("nodeoperator.leasewatch")

EVENTS = Counter("nodepulse_operator_lease_events_total", "Lease watch events handled")
RELISTS = Counter("nodepulse_operator_lease_relists_total", "Lease lists (start, 410 Gone)")


class LeaseWatch:
    def __init__(self, kube: Kube, store: Store, clock: Clock, *,
                 namespace: str = NODE_LEASE_NAMESPACE, page: int = 500,
                 timeout: int = 300, backoff: float = 1.0) -> None:
        self.store = store
        self.namespace = namespace
        self.listed = asyncio.Event()  # set once the first list is in the Store
        self.reflector = Reflector(kube, ReflectorConfig(
            LEASES, "lease watch", namespace=namespace, page_size=page,
            watch_timeout=timeout, backoff_initial=backoff, backoff_max=30.0), self, clock)

    async def run(self) -> None:
        await self.reflector.run()

    def close(self) -> None:
        """End the watch (on shutdown), so the process exits at once."""
        self.reflector.stop()

    # -- what the reflector hands over --
    def on_list(self, items: list[Obj]) -> None:
        self._apply([("ADDED", obj) for obj in items])
        self.store.lease_sync({obj["metadata"]["name"] for obj in items})
        self.listed.set()
        RELISTS.inc()

    def on_events(self, events: list[tuple[str, Obj]]) -> None:
        self._apply(events)

    def _apply(self, batch: list[tuple[str, Obj]]) -> None:
        for kind, obj in batch:
            obj.setdefault("metadata", {}).setdefault("namespace", self.namespace)
            self.store.lease_event(kind, obj)
        EVENTS.inc(len(batch))
