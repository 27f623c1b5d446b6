"""The monitor's writes through the kubernetes client (handed an ApiClient built by
nodeagent.api.client), each in a worker thread."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client

from nodeagent.api.policy import GROUP, PLURAL, VERSION

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
TIMEOUT = 5  # seconds per write; see election.py for why it must stay short


class KubeWriter:
    def __init__(self, api_client: client.ApiClient, workers: int = 16) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="writer")
        # Events have threads of their own: they never queue ahead of a taint write.
        self._events_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="events")

    async def _run(self, fn: Any, *args: Any, content_type: str,
                   pool: ThreadPoolExecutor | None = None) -> str:
        def call() -> str:
            resp = fn(*args, _content_type=content_type, _preload_content=False,
                      _request_timeout=TIMEOUT)
            return str(json.loads(resp.data)["metadata"]["resourceVersion"])
        return await asyncio.get_running_loop().run_in_executor(pool or self._pool, call)

    async def patch_node(self, name: str, patch: dict[str, Any]) -> str:
        # Strategic merge: a Node's taint list has no merge key, so it is replaced
        # whole, guarded by the resourceVersion in the patch.
        return await self._run(self.core.patch_node, name, patch, content_type=STRATEGIC)

    async def patch_node_status(self, name: str, patch: dict[str, Any]) -> str:
        # Conditions merge by type: only the ones we send change.
        return await self._run(self.core.patch_node_status, name, patch,
                               content_type=STRATEGIC)

    async def patch_policy_status(self, name: str, patch: dict[str, Any]) -> str:
        return await self._run(self.custom.patch_cluster_custom_object_status, GROUP, VERSION,
                               PLURAL, name, patch, content_type=MERGE)

    async def create_event(self, namespace: str, body: dict[str, Any]) -> str:
        return await self._run(self.core.create_namespaced_event, namespace, body,
                               content_type="application/json", pool=self._events_pool)

    async def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> str:
        return await self._run(self.core.patch_namespaced_event, name, namespace, patch,
                               content_type=MERGE, pool=self._events_pool)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._events_pool.shutdown(wait=False, cancel_futures=True)
