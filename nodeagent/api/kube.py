"""The one way nodepulse reaches the API server: a table of resources, generic verbs.

    node = await kube.get(NODES, "n1")
    await kube.patch(PODS, "web", {"status": ...}, namespace="ns", subresource="status")
    page = await kube.list(PODS, field_selector="spec.nodeName=n1", limit=500)
    stream = await kube.watch(LEASES, namespace=NODE_LEASE_NAMESPACE, resource_version=rv)

Objects are plain dicts in the API's JSON form, in and out (nothing is dropped, and
they are cheap to hash and compare). Every path is built here from the table below:
adding a resource is one line there. Errors are ApiError (client.py; `status_of`,
`is_retriable` there read them); transport failures are ConnectionError or TimeoutError.

`Kube` is the interface; `RestKube` is the real one (its HTTP is in rest.py, the only
module that speaks HTTP, on the event loop). Unit tests use the in-memory fake in tests/fakekube.py. Watches
are followed by nodeagent.api.reflector, not read directly.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import AsyncIterator
from typing import Any, Protocol
from urllib.parse import quote

from nodeagent.api import policy
from nodeagent.api.client import Credentials
from nodeagent.api.rest import Timeout, Transport

Obj = dict[str, Any]

JSON = "application/json"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


@dataclasses.dataclass(frozen=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
        """The URL path; without a namespace, a namespaced resource's path covers all
        namespaces (for list and watch)."""
        out = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if namespace is not None:
            if not self.namespaced:
                raise ValueError(f"{self.plural} are not namespaced")
            out += f"/namespaces/{quote(namespace, safe='')}"
        elif self.namespaced and name is not None:
            raise ValueError(f"{self.plural}/{name}: a namespace is needed")
        out += f"/{self.plural}"
        if name is not None:
            out += f"/{quote(name, safe='')}"
        if subresource is not None:
            out += f"/{subresource}"
        return out

    def __str__(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


# The resources nodepulse uses: one line each.
#                       group                  version         plural         kind   namespaced
NODES = Resource("", "v1", "nodes", "Node", False)
PODS = Resource("", "v1", "pods", "Pod", True)
EVENTS = Resource("", "v1", "events", "Event", True)
CONFIG_MAPS = Resource("", "v1", "configmaps", "ConfigMap", True)
SECRETS = Resource("", "v1", "secrets", "Secret", True)
SERVICES = Resource("", "v1", "services", "Service", True)
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount", True)
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease", True)
NODE_STATUS_POLICIES = Resource(policy.GROUP, policy.VERSION, policy.PLURAL, policy.KIND, False)
TOKEN_REVIEWS = Resource("authentication.k8s.io", "v1", "tokenreviews", "TokenReview", False)
SUBJECT_ACCESS_REVIEWS = Resource("authorization.k8s.io", "v1", "subjectaccessreviews",
                                  "SubjectAccessReview", False)
CERTIFICATE_SIGNING_REQUESTS = Resource("certificates.k8s.io", "v1",
                                        "certificatesigningrequests",
                                        "CertificateSigningRequest", False)
RUNTIME_CLASSES = Resource("node.k8s.io", "v1", "runtimeclasses", "RuntimeClass", False)
SECRETS = Resource("", "v1", "secrets", "Secret", True)
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount", True)

NODE_LEASE_NAMESPACE = "kube-node-lease"  # where each node's heartbeat Lease lives


def namespace_of(obj: Obj) -> str | None:
    return (obj.get("metadata") or {}).get("namespace")


def name_of(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


# strings up to this length are shared by interning: names, kinds, API versions,
# namespaces and second-precision times; longer ones (uids, fine times, messages) are
# mostly one object's own
SHARED_STRING_MAX = 24
# Values new with every write, so never shared: interned, each would go into the
# interpreter's table of interned strings and out again, and that churn makes the table
# grow (a one-time step of RSS, issue 40) for nothing.
UNSHARED_VALUES = frozenset({"resourceVersion"})


def with_shared_strings(value: Any, key: str = "") -> Any:
    """`value` (found under `key`) rebuilt with its keys and short strings interned. An
    object kept per node (thousands in a process) then shares them with every other one,
    where a decoded object holds its own copy of each: a kept Lease is half the size."""
    if isinstance(value, dict):
        return {sys.intern(k): with_shared_strings(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [with_shared_strings(v, key) for v in value]
    if isinstance(value, str) and len(value) <= SHARED_STRING_MAX \
            and key not in UNSHARED_VALUES:
        return sys.intern(value)
    return value


def describe(obj: Obj) -> str:
    """How a log line names an object: namespace/name, or name for cluster-scoped ones."""
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name', '')}" if ns else str(meta.get("name", ""))


class WatchStream(Protocol):
    """An open watch: batches of events ({"type": ..., "object": ...}) as they arrive;
    the iteration ends when the server ends the watch and raises when it breaks."""

    def __aiter__(self) -> AsyncIterator[list[Obj]]: ...

    def close(self) -> None:
        """End the stream now (from any thread; more than once is fine)."""

    async def aclose(self) -> None:
        """Close, and wait until nothing reads the stream any more."""


class Kube(Protocol):
    """The verbs, on any resource of the table. `timeout`: seconds for the request
    (or (connect, read)). `parse=False`: the answer is not needed, so it is asked for
    as the object's metadata only, not parsed, and {} is returned (a pod's status PATCH
    would answer with the whole pod)."""

    def separate(self, connections: int) -> Kube:
        """The same API server with request turns of its own (at most `connections`
        requests at once; the keep-alive connections are one pool): callers that must
        not wait behind each other (Lease writes, status work, the operator's Events)
        each use their own."""

    async def get(self, res: Resource, name: str, *, namespace: str | None = None,
                  subresource: str | None = None, timeout: Timeout = 30.0) -> Obj: ...

    async def list(self, res: Resource, *, namespace: str | None = None,
                   label_selector: str = "", field_selector: str = "", limit: int = 0,
                   cont: str = "", timeout: Timeout = 60.0) -> Obj:
        """One page (`limit` items at most, 0: all); its metadata.continue, if any,
        is the `cont` of the next page."""

    async def watch(self, res: Resource, *, namespace: str | None = None,
                    resource_version: str = "", label_selector: str = "",
                    field_selector: str = "", timeout_seconds: int = 300,
                    send_initial_events: bool = False) -> WatchStream:
        """Open a watch (with bookmarks) from `resource_version`; with
        `send_initial_events`, a streaming list first (ending with the bookmark
        annotated k8s.io/initial-events-end). Raises if the server refuses it."""

    async def create(self, res: Resource, body: Obj, *, namespace: str | None = None,
                     name: str | None = None, subresource: str | None = None,
                     timeout: Timeout = 30.0, parse: bool = True) -> Obj:
        """POST `body`; the namespace defaults to the body's. With `name` and
        `subresource`, a POST to an object's subresource (a ServiceAccount's token)."""

    async def update(self, res: Resource, body: Obj, *, subresource: str | None = None,
                     timeout: Timeout = 30.0, parse: bool = True) -> Obj:
        """PUT `body` (name, namespace and the resourceVersion it replaces from its
        metadata)."""

    async def patch(self, res: Resource, name: str, body: Obj, *,
                    namespace: str | None = None, subresource: str | None = None,
                    content_type: str = STRATEGIC_MERGE, timeout: Timeout = 30.0,
                    parse: bool = True) -> Obj: ...

    async def delete(self, res: Resource, name: str, *, namespace: str | None = None,
                     options: Obj | None = None, timeout: Timeout = 30.0,
                     parse: bool = True) -> Obj:
        """DELETE with DeleteOptions `options` (e.g. gracePeriodSeconds,
        preconditions)."""


class RestKube:
    """Kube over HTTP: rest.Transport, with the Credentials nodeagent.api.client loads
    (`component` names the program in the User-Agent). Requests run on the event loop;
    `separate` gives a RestKube with request turns of its own (the connections are one
    pool); `aclose` closes the connections of the pool."""

    def __init__(self, creds: Credentials, connections: int = 16, *,
                 component: str = "nodepulse", transport: Transport | None = None) -> None:
        self.creds = creds
        self.transport = transport or Transport(creds, connections, component)

    def separate(self, connections: int) -> RestKube:
        return RestKube(self.creds, transport=self.transport.separate(connections))

    async def aclose(self) -> None:
        await self.transport.aclose()

    async def _call(self, method: str, path: str, *, query: dict[str, Any] | None = None,
                    body: Obj | None = None, content_type: str = JSON,
                    timeout: Timeout, parse: bool = True) -> Obj:
        answer = await self.transport.request(method, path, query=query, body=body,
                                              timeout=timeout, content_type=content_type,
                                              parse=parse)
        return answer if parse else {}

    async def get(self, res: Resource, name: str, *, namespace: str | None = None,
                  subresource: str | None = None, timeout: Timeout = 30.0) -> Obj:
        return await self._call("GET", res.path(namespace, name, subresource),
                                timeout=timeout)

    async def list(self, res: Resource, *, namespace: str | None = None,
                   label_selector: str = "", field_selector: str = "", limit: int = 0,
                   cont: str = "", timeout: Timeout = 60.0) -> Obj:
        return await self._call("GET", res.path(namespace), timeout=timeout, query={
            "labelSelector": label_selector or None, "fieldSelector": field_selector or None,
            "limit": limit or None, "continue": cont or None})

    async def watch(self, res: Resource, *, namespace: str | None = None,
                    resource_version: str = "", label_selector: str = "",
                    field_selector: str = "", timeout_seconds: int = 300,
                    send_initial_events: bool = False) -> WatchStream:
        query: dict[str, Any] = {
            "watch": True, "allowWatchBookmarks": True, "timeoutSeconds": timeout_seconds,
            "labelSelector": label_selector or None, "fieldSelector": field_selector or None}
        if send_initial_events:
            query.update(sendInitialEvents=True, resourceVersionMatch="NotOlderThan")
        else:
            query["resourceVersion"] = resource_version
        # the read timeout a little past the server's own end of the watch
        return await self.transport.watch(res.path(namespace), query,
                                          timeout=(10.0, timeout_seconds + 30.0))

    async def create(self, res: Resource, body: Obj, *, namespace: str | None = None,
                     name: str | None = None, subresource: str | None = None,
                     timeout: Timeout = 30.0, parse: bool = True) -> Obj:
        ns = namespace if namespace is not None else (namespace_of(body) if res.namespaced
                                                       else None)
        return await self._call("POST", res.path(ns, name, subresource), body=body,
                                timeout=timeout, parse=parse)

    async def update(self, res: Resource, body: Obj, *, subresource: str | None = None,
                     timeout: Timeout = 30.0, parse: bool = True) -> Obj:
        path = res.path(namespace_of(body) if res.namespaced else None, name_of(body),
                        subresource)
        return await self._call("PUT", path, body=body, timeout=timeout, parse=parse)

    async def patch(self, res: Resource, name: str, body: Obj, *,
                    namespace: str | None = None, subresource: str | None = None,
                    content_type: str = STRATEGIC_MERGE, timeout: Timeout = 30.0,
                    parse: bool = True) -> Obj:
        return await self._call("PATCH", res.path(namespace, name, subresource), body=body,
                                content_type=content_type, timeout=timeout, parse=parse)

    async def delete(self, res: Resource, name: str, *, namespace: str | None = None,
                     options: Obj | None = None, timeout: Timeout = 30.0,
                     parse: bool = True) -> Obj:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", **(options or {})}
        return await self._call("DELETE", res.path(namespace, name), body=body,
                                timeout=timeout, parse=parse)
