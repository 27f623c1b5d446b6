"""The few API calls the node needs, as plain JSON in and out.

Blocking (call from a thread). Responses are parsed as plain dicts: cheaper than the
client's models when one process speaks for many nodes, and the bodies we send are
exactly what we built. FakeKube (fakekube.py) implements the same protocol in memory.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any, Protocol

from kubernetes import client

LEASE_NAMESPACE = "kube-node-lease"
SMP = "application/strategic-merge-patch+json"
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
        self.core = client.CoreV1Api(api)
        self.coord = client.CoordinationV1Api(api)

    @staticmethod
    def _json(resp: Any) -> Obj:
        data: Obj = json.loads(resp.data)
        return data

    def get_node(self, name: str, timeout: float | None = None) -> Obj:
        return self._json(self.core.read_node(name, _preload_content=False,
                                              _request_timeout=timeout))

    def create_node(self, body: Obj, timeout: float | None = None) -> Obj:
        return self._json(self.core.create_node(body, _preload_content=False,
                                                _request_timeout=timeout))

    def patch_node(self, name: str, body: Obj, timeout: float | None = None) -> Obj:
        return self._json(self.core.patch_node(name, body, _content_type=SMP,
                                               _preload_content=False,
                                               _request_timeout=timeout))

    def patch_node_status(self, name: str, body: Obj, timeout: float | None = None) -> Obj:
        return self._json(self.core.patch_node_status(name, body, _content_type=SMP,
                                                      _preload_content=False,
                                                      _request_timeout=timeout))

    def get_lease(self, name: str, timeout: float | None = None) -> Obj:
        return self._json(self.coord.read_namespaced_lease(
            name, LEASE_NAMESPACE, _preload_content=False, _request_timeout=timeout))

    def create_lease(self, body: Obj, timeout: float | None = None) -> Obj:
        return self._json(self.coord.create_namespaced_lease(
            LEASE_NAMESPACE, body, _preload_content=False, _request_timeout=timeout))

    def update_lease(self, name: str, body: Obj, timeout: float | None = None) -> Obj:
        return self._json(self.coord.replace_namespaced_lease(
            name, LEASE_NAMESPACE, body, _preload_content=False, _request_timeout=timeout))

    def list_nodes(self, field_selector: str = "", label_selector: str = "",
                   timeout: float | None = None) -> Obj:
        return self._json(self.core.list_node(
            field_selector=field_selector or None, label_selector=label_selector or None,
            _preload_content=False, _request_timeout=timeout))

    def watch_nodes(self, resource_version: str, field_selector: str = "",
                    label_selector: str = "", timeout_seconds: int = 300) -> WatchStream:
        resp = self.core.list_node(
            watch=True, resource_version=resource_version, allow_watch_bookmarks=True,
            field_selector=field_selector or None, label_selector=label_selector or None,
            timeout_seconds=timeout_seconds, _preload_content=False,
            # read timeout a little past the server's own end of the watch
            _request_timeout=(10, timeout_seconds + 30))
        return _Stream(resp)


class _Stream:
    """Watch events, one JSON object per line, from a streaming response."""

    def __init__(self, resp: Any) -> None:
        self._resp = resp

    def __iter__(self) -> Iterator[Obj]:
        buf = b""
        for chunk in self._resp.stream(65536, decode_content=True):
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    yield json.loads(line)
        if buf.strip():
            yield json.loads(buf)

    def close(self) -> None:
        # shutdown() wakes a reader blocked in another thread; either call may refuse
        # when the response already ended, which is fine: it is closed either way
        with contextlib.suppress(Exception):
            self._resp.shutdown()
        with contextlib.suppress(Exception):
            self._resp.release_conn()
