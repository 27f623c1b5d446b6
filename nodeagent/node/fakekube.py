"""An in-memory stand-in for the API calls in kube.py, for unit tests.

Keeps resourceVersions and conflicts like the API server, applies the subset of
strategic merge patch the agent sends, logs every call, and fails calls on request.
"""

from __future__ import annotations

import concurrent.futures
import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes.client.exceptions import ApiException

from nodeagent.node.kube import Obj


def api_error(status: int, reason: str = "") -> ApiException:
    return ApiException(status=status, reason=reason or {
        404: "NotFound", 409: "Conflict", 410: "Gone", 500: "InternalError",
        503: "ServiceUnavailable", 429: "TooManyRequests"}.get(status, "Error"))


def merge_patch(target: Obj, patch: Obj) -> Obj:
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and value and value[0] == {"$patch": "replace"}:
            out[key] = copy.deepcopy(value[1:])
        elif key in ("conditions", "addresses") and isinstance(value, list):
            merged = {item["type"]: item for item in out.get(key, [])}
            for item in value:
                merged[item["type"]] = {**merged.get(item["type"], {}), **item}
            out[key] = list(merged.values())
        elif isinstance(value, dict):
            out[key] = merge_patch(out.get(key) or {}, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class FakeKube:
    def __init__(self, now: Callable[[], float] = lambda: 0.0) -> None:
        self.nodes: dict[str, Obj] = {}
        self.leases: dict[str, Obj] = {}
        self.calls: list[tuple[float, str, str, Any]] = []  # (time, method, name, timeout)
        self.bodies: list[tuple[str, Obj]] = []
        self.events: list[tuple[int, str, Obj]] = []  # node watch events (rv, type, obj)
        self.compacted = 0  # watches from a resourceVersion below this get 410
        self.expire_next_watch = False  # the next watch gets 410 whatever its version
        self.close_error: Exception | None = None  # watch streams fail to close with this
        self._failures: dict[str, list[BaseException | Callable[[], BaseException | None]]] = {}
        self._rv = 100
        self._now = now
        self._lock = threading.Lock()

    # -- test controls --
    def fail(self, method: str, *errors: BaseException | Callable[[], BaseException | None]) -> None:
        """The next calls of `method` raise these, in order (a callable decides at call time;
        returning None lets the call through)."""
        self._failures.setdefault(method, []).extend(errors)

    def count(self, method: str) -> int:
        return sum(1 for c in self.calls if c[1] == method)

    def times(self, method: str) -> list[float]:
        return [c[0] for c in self.calls if c[1] == method]

    def _enter(self, method: str, name: str, timeout: float | None, body: Obj | None = None) -> None:
        self.calls.append((self._now(), method, name, timeout))
        if body is not None:
            self.bodies.append((method, copy.deepcopy(body)))
        queue = self._failures.get(method)
        if queue:
            err = queue.pop(0)
            if callable(err) and not isinstance(err, BaseException):
                err = err()  # type: ignore[assignment]
            if err is not None:
                raise err  # type: ignore[misc]

    def _bump(self, obj: Obj) -> Obj:
        self._rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        return obj

    def _node_event(self, kind: str, node: Obj) -> None:
        self.events.append((self._rv, kind, copy.deepcopy(node)))

    # -- nodes --
    def get_node(self, name: str, timeout: float | None = None) -> Obj:
        with self._lock:
            self._enter("get_node", name, timeout)
            if name not in self.nodes:
                raise api_error(404)
            return copy.deepcopy(self.nodes[name])

    def create_node(self, body: Obj, timeout: float | None = None) -> Obj:
        with self._lock:
            name = body["metadata"]["name"]
            self._enter("create_node", name, timeout, body)
            if name in self.nodes:
                raise api_error(409, "AlreadyExists")
            node = self._bump(copy.deepcopy(body))
            node["metadata"]["uid"] = f"uid-{name}-{self._rv}"
            self.nodes[name] = node
            self._node_event("ADDED", node)
            return copy.deepcopy(node)

    def put_node(self, node: Obj) -> None:
        """Create or replace as an admin would (no call is logged)."""
        with self._lock:
            name = node["metadata"]["name"]
            node = self._bump(copy.deepcopy(node))
            node["metadata"].setdefault("uid", f"uid-{name}")
            kind = "MODIFIED" if name in self.nodes else "ADDED"
            self.nodes[name] = node
            self._node_event(kind, node)

    def annotate(self, name: str, key: str, value: str | None) -> None:
        node = copy.deepcopy(self.nodes[name])
        ann = node["metadata"].setdefault("annotations", {})
        if value is None:
            ann.pop(key, None)
        else:
            ann[key] = value
        self.put_node(node)

    def delete_node(self, name: str) -> None:
        with self._lock:
            node = self.nodes.pop(name)
            self._rv += 1
            self._node_event("DELETED", node)

    def patch_node(self, name: str, body: Obj, timeout: float | None = None) -> Obj:
        with self._lock:
            self._enter("patch_node", name, timeout, body)
            if name not in self.nodes:
                raise api_error(404)
            node = self._bump(merge_patch(self.nodes[name], body))
            self.nodes[name] = node
            self._node_event("MODIFIED", node)
            return copy.deepcopy(node)

    def patch_node_status(self, name: str, body: Obj, timeout: float | None = None) -> Obj:
        with self._lock:
            self._enter("patch_node_status", name, timeout, body)
            if name not in self.nodes:
                raise api_error(404)
            node = self.nodes[name]
            node = self._bump({**node, "status": merge_patch(node.get("status") or {},
                                                              body.get("status", {}))})
            self.nodes[name] = node
            self._node_event("MODIFIED", node)
            return copy.deepcopy(node)

    def list_nodes(self, field_selector: str = "", label_selector: str = "",
                   timeout: float | None = None) -> Obj:
        with self._lock:
            self._enter("list_nodes", field_selector, timeout)
            items = [copy.deepcopy(n) for n in self.nodes.values()
                     if _matches(n, field_selector, label_selector)]
            return {"metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def watch_nodes(self, resource_version: str, field_selector: str = "",
                    label_selector: str = "", timeout_seconds: int = 300) -> _FakeStream:
        with self._lock:
            self._enter("watch_nodes", resource_version, None)
            rv = int(resource_version)
            if rv < self.compacted or self.expire_next_watch:
                self.expire_next_watch = False
                events: list[Obj] = [{"type": "ERROR", "object": {
                    "kind": "Status", "code": 410, "reason": "Expired"}}]
            else:
                events = [{"type": kind, "object": copy.deepcopy(obj)}
                          for erv, kind, obj in self.events
                          if erv > rv and _matches(obj, field_selector, label_selector)]
            return _FakeStream(events, self.close_error)

    # -- leases --
    def get_lease(self, name: str, timeout: float | None = None) -> Obj:
        with self._lock:
            self._enter("get_lease", name, timeout)
            if name not in self.leases:
                raise api_error(404)
            return copy.deepcopy(self.leases[name])

    def create_lease(self, body: Obj, timeout: float | None = None) -> Obj:
        with self._lock:
            name = body["metadata"]["name"]
            self._enter("create_lease", name, timeout, body)
            if name in self.leases:
                raise api_error(409, "AlreadyExists")
            lease = self._bump(copy.deepcopy(body))
            self.leases[name] = lease
            return copy.deepcopy(lease)

    def update_lease(self, name: str, body: Obj, timeout: float | None = None) -> Obj:
        with self._lock:
            self._enter("update_lease", name, timeout, body)
            if name not in self.leases:
                raise api_error(404)
            current = self.leases[name]
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                raise api_error(409)
            lease = self._bump(copy.deepcopy(body))
            self.leases[name] = lease
            return copy.deepcopy(lease)

    def touch_lease(self, name: str) -> None:
        """Someone else writes the Lease, so our cached copy is stale."""
        with self._lock:
            self._bump(self.leases[name])


def _matches(obj: Obj, field_selector: str, label_selector: str) -> bool:
    meta = obj.get("metadata", {})
    if field_selector.startswith("metadata.name=") and \
            meta.get("name") != field_selector.split("=", 1)[1]:
        return False
    labels = meta.get("labels") or {}
    for term in filter(None, label_selector.split(",")):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    return True


class _FakeStream:
    def __init__(self, events: list[Obj], close_error: Exception | None = None) -> None:
        self._events = events
        self._close_error = close_error
        self.closed = False

    def __iter__(self) -> Iterator[Obj]:
        for e in self._events:
            if self.closed:
                return
            yield e

    def close(self) -> None:
        self.closed = True
        if self._close_error:
            raise self._close_error


class InlineExecutor(concurrent.futures.Executor):
    """Runs each call at once in the caller's thread: blocking work under a FakeClock
    finishes within the test's own steps."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # delivered to the awaiting coroutine
            fut.set_exception(e)
        return fut
