"""Small helpers the e2e modules share: waiting for a condition, finding the processes
a test started (every container the tests run carries NP_E2E=<marker>), and plain
blocking API requests over the kubernetes client."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.cluster.cluster import free_port

__all__ = ["alive", "create_namespace", "environ", "eventually", "first_seen", "free_port",
           "marked", "node_registered", "request", "request_json", "stop_process"]

T = TypeVar("T")
K = TypeVar("K")


def eventually(pred: Callable[[], T | None], what: str, timeout: float = 60.0,
               every: float = 0.25,
               tolerate: tuple[type[BaseException], ...] = ()) -> T:
    """Poll `pred` until it returns something truthy, and return that. Exceptions of the
    `tolerate` types count as "not yet" (e.g. while the control plane comes back)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            got = pred()
            if got:
                return got
        except tolerate as e:
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}"
                                 + (f" (last error: {last})" if last else ""))
        time.sleep(every)


def create_namespace(core: client.CoreV1Api, name: str) -> None:
    """Create the namespace and wait for its default ServiceAccount: pods are refused
    until it exists."""
    core.create_namespace({"metadata": {"name": name}})
    eventually(lambda: core.list_namespaced_service_account(
        name, field_selector="metadata.name=default").items,
        f"the default ServiceAccount of namespace {name}")


def node_registered(core: client.CoreV1Api, name: str,
                    running: Callable[[], bool] = lambda: True) -> None:
    """Wait for the Node `name` to be registered; `running`: whether its agent still
    runs (else the wait ends in its timeout, the message naming the node)."""
    eventually(lambda: running() and core.list_node(
        field_selector=f"metadata.name={name}").items, f"node {name} registered")


def first_seen(keys: Iterable[K], holds: Callable[[K], bool], what: str,
               timeout: float = 60.0,
               tolerate: tuple[type[BaseException], ...] = ()) -> dict[K, float]:
    """Poll until `holds(key)` has been true once for every key (`eventually`, with
    its `tolerate`); when (wall clock) each was first seen to hold."""
    seen: dict[K, float] = {}
    pending = list(keys)

    def all_seen() -> bool:
        for k in pending:
            if k not in seen and holds(k):
                seen[k] = time.time()
        return len(seen) == len(pending)
    eventually(all_seen, what, timeout, tolerate=tolerate)
    return seen


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def environ(pid: int) -> dict[bytes, bytes]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def marked(value: str) -> list[int]:
    """Live processes whose environment has NP_E2E=<value>: the sweep that proves
    nothing a test started is left."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if environ(int(d.name)).get(b"NP_E2E") == value.encode() and alive(int(d.name)):
                    out.append(int(d.name))
    return out


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    """SIGTERM a process a test started, SIGKILL it if it has not exited in `timeout`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def request(api: client.ApiClient, method: str, path: str, *,
            query: dict[str, Any] | None = None, body: Any = None,
            timeout: float | tuple[float, float] = 30.0) -> urllib3.BaseHTTPResponse:
    """Send the request; return the unread urllib3 response (for streaming).
    Raises ApiException for a non-2xx status, like the generated methods."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    params = [(k, str(v).lower() if isinstance(v, bool) else str(v))
              for k, v in (query or {}).items() if v is not None]
    m, url, hdrs, data, post = api.param_serialize(
        method, path, query_params=params, header_params=headers, body=body,
        auth_settings=["BearerToken"])
    resp = api.call_api(m, url, hdrs, data, post, _request_timeout=timeout)
    if not 200 <= resp.status <= 299:
        resp.read()
        raise ApiException.from_response(http_resp=resp, body=None, data=None)
    return resp.response


def request_json(api: client.ApiClient, method: str, path: str, *,
                 query: dict[str, Any] | None = None, body: Any = None,
                 timeout: float = 30.0) -> Any:
    """The answer's JSON (the connection goes back to the pool)."""
    resp = request(api, method, path, query=query, body=body, timeout=timeout)
    try:
        return json.loads(resp.data)
    finally:
        resp.release_conn()
