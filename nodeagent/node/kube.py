"""The few API calls the node needs, as plain JSON in and out (nodeagent.api.rest).

Blocking (call from a thread). FakeKube (fakekube.py) implements the same protocol in
memory.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any, Protocol

import urllib3
from kubernetes import client

from nodeagent.api.kube import STRATEGIC_MERGE as SMP
from nodeagent.api.rest import json_lines, request, request_json

LEASE_NAMESPACE = "kube-node-lease"
NODES = "/api/v1/nodes"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases"
Obj = dict[str, Any]


class Kube(Protocol):
    def get_node(self, name: str, timeout: float | None = None) -> Obj: ...
    def create_node(self, body: Obj, timeout: float | None = None) -> Obj: ...
    def patch_node(self, name: str, body: Obj, timeout: float | None = None) -> Obj: ...
    def patch_node_status(self, name: str, body: Obj, timeout: float | None = None) -> Obj: ...
    def get_lease(self, name: str, timeout: float | None = None) -> Obj: ...
    def create_lease(self, body: Obj, timeout: float | None = None) -> Obj: ...
    def update_lease(self, name: str, body: Obj, timeout: float | None = None) -> Obj: ...
    def list_nodes(self, field_selector: str = "", label_selector: str = "",
                   timeout: float | None = None) -> Obj: ...
    def watch_nodes(self, resource_version: str, field_selector: str = "",
                    label_selector: str = "", timeout_seconds: int = 300) -> WatchStream: ...


class WatchStream(Protocol):
    def __iter__(self) -> Iterator[Obj]: ...
    def close(self) -> None: ...


def body_size(body: Obj) -> int:
    """Bytes the request body takes on the wire (the client sends json.dumps)."""
    return len(json.dumps(body).encode())


class RealKube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def _call(self, method: str, path: str, timeout: float | None, body: Obj | None = None,
              query: dict[str, Any] | None = None, content_type: str = "application/json"
              ) -> Obj:
        data: Obj = request_json(self.api, method, path, query=query, body=body,
                                 timeout=timeout, content_type=content_type)
        return data

    def get_node(self, name: str, timeout: float | None = None) -> Obj:
        return self._call("GET", f"{NODES}/{name}", timeout)

    def create_node(self, body: Obj, timeout: float | None = None) -> Obj:
        return self._call("POST", NODES, timeout, body)

    def patch_node(self, name: str, body: Obj, timeout: float | None = None) -> Obj:
        return self._call("PATCH", f"{NODES}/{name}", timeout, body, content_type=SMP)

    def patch_node_status(self, name: str, body: Obj, timeout: float | None = None) -> Obj:
        return self._call("PATCH", f"{NODES}/{name}/status", timeout, body, content_type=SMP)

    def get_lease(self, name: str, timeout: float | None = None) -> Obj:
        return self._call("GET", f"{LEASES}/{name}", timeout)

    def create_lease(self, body: Obj, timeout: float | None = None) -> Obj:
        return self._call("POST", LEASES, timeout, body)

    def update_lease(self, name: str, body: Obj, timeout: float | None = None) -> Obj:
        return self._call("PUT", f"{LEASES}/{name}", timeout, body)

    def list_nodes(self, field_selector: str = "", label_selector: str = "",
                   timeout: float | None = None) -> Obj:
        return self._call("GET", NODES, timeout, query={
            "fieldSelector": field_selector or None, "labelSelector": label_selector or None})

    def watch_nodes(self, resource_version: str, field_selector: str = "",
                    label_selector: str = "", timeout_seconds: int = 300) -> WatchStream:
        resp = request(self.api, "GET", NODES, query={
            "watch": True, "resourceVersion": resource_version, "allowWatchBookmarks": True,
            "fieldSelector": field_selector or None, "labelSelector": label_selector or None,
            "timeoutSeconds": timeout_seconds},
            # read timeout a little past the server's own end of the watch
            timeout=(10, timeout_seconds + 30))
        return _Stream(resp)


class _Stream:
    """Watch events from a streaming response."""

    def __init__(self, resp: urllib3.BaseHTTPResponse) -> None:
        self._resp = resp

    def __iter__(self) -> Iterator[Obj]:
        for objs in json_lines(self._resp.stream(65536, decode_content=True)):
            yield from objs

    def close(self) -> None:
        # shutdown() wakes a reader blocked in another thread; either call may refuse
        # when the response already ended, which is fine: it is closed either way
        with contextlib.suppress(Exception):
            self._resp.shutdown()
        with contextlib.suppress(Exception):
            self._resp.release_conn()
