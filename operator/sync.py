"""Knowing when kopf's first lists of Nodes and policies are in the Store.

kopf delivers a list through per-object workers and says nothing when it is done, so a
new operator (restart, rolling update, failover) that acted at once would act on a
partial view: a node whose policy has not arrived yet gets the defaults written, then
the policy again; a policy's status is rewritten with half its nodes. So before the
monitor's first period (and before /readyz), the names are listed once, page by page,
and the Store must hold every one of them. kopf stays the only feeder of the Store (its
stream is consistent in itself; a second feeder could put back an older version).
A name that does not arrive is looked up on its own (a LIST by metadata.name: the
operator's RBAC grants list, not get): deleted meanwhile, it is not waited for (looked
up only while kopf makes no progress, a few at a time, so a slow first delivery at
thousands of Nodes costs no lookups).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nodeoperator.state import Store

from nodeagent.api.client import status_of
from nodeagent.api.clock import Clock
from nodeagent.api.kube import NODE_STATUS_POLICIES, NODES, Kube

log = logging.getLogger("nodeoperator.sync")


class InitialSync:
    def __init__(self, kube: Kube, store: Store, clock: Clock, *,
                 page: int = 500, poll: float = 0.2, recheck: float = 5.0,
                 backoff: float = 1.0, lookups: int = 20) -> None:
        self.kube, self.store, self.clock = kube, store, clock
        self.page, self.poll, self.recheck, self.backoff = page, poll, recheck, backoff
        self.lookups = lookups  # at most this many lookups per kind per recheck
        self.done = asyncio.Event()
        self.pending: dict[str, set[str]] = {}  # kind -> names not in the Store yet

    async def run(self) -> None:
        delay = self.backoff
        while True:
            try:
                nodes = await self._names(self._list_nodes)
                policies = await self._names(self._list_policies)
                break
            except Exception as e:  # the API server is away: try again, then slower
                log.warning("listing Nodes and policies: %s; retrying in %.0f s", e, delay)
                await self.clock.sleep(delay)
                delay = min(delay * 2, 30.0)
        self.pending = {"node": nodes, "policy": policies}
        waited, before = 0.0, len(nodes) + len(policies)
        while True:
            self._arrived()
            left = sum(len(v) for v in self.pending.values())
            if not left:
                break
            if waited >= self.recheck:
                waited = 0.0
                if left == before:  # kopf made no progress: look the stragglers up
                    await self._drop_deleted()
                    continue
                before = left
            await self.clock.sleep(self.poll)
            waited += self.poll
        log.info("the views of %d Nodes and %d policies are complete", len(nodes),
                 len(policies))
        self.done.set()

    def _arrived(self) -> None:
        for kind, have in (("node", self.store.nodes), ("policy", self.store.policies)):
            self.pending[kind] = {n for n in self.pending[kind] if n not in have}

    async def _drop_deleted(self) -> None:
        """Names still missing: those deleted since the list are not waited for."""
        for kind, fetch in (("node", self._list_nodes), ("policy", self._list_policies)):
            for name in sorted(self.pending[kind])[:self.lookups]:
                try:
                    found = await fetch(None, f"metadata.name={name}")
                except Exception as e:
                    log.info("looking up %s %s: %s", kind, name, e)
                    continue
                if not found.get("items"):
                    self.pending[kind].discard(name)
        log.info("waiting for the watches to deliver %s",
                 ", ".join(f"{len(v)} {k}(s)" for k, v in self.pending.items() if v) or "-")

    async def _names(self, fetch: Callable[[str | None], Awaitable[dict[str, Any]]]
                     ) -> set[str]:
        names: set[str] = set()
        token: str | None = None
        while True:
            body = await fetch(token)
            names.update(obj["metadata"]["name"] for obj in body.get("items") or [])
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                return names

    async def _list_nodes(self, token: str | None, field_selector: str = "") -> dict[str, Any]:
        return await self.kube.list(NODES, limit=self.page, cont=token or "",
                                    field_selector=field_selector, timeout=(5, 60))

    async def _list_policies(self, token: str | None,
                             field_selector: str = "") -> dict[str, Any]:
        try:
            return await self.kube.list(NODE_STATUS_POLICIES, limit=self.page,
                                        cont=token or "", field_selector=field_selector,
                                        timeout=(5, 60))
        except Exception as e:
            if status_of(e) == 404:  # no CRD (yet): no policies to wait for
                return {}
            raise
