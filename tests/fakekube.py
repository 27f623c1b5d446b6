"""An in-memory API server for unit tests: the one fake of nodeagent.api.kube.Kube.

Resource-agnostic, for any resource of the table: a store per resource with
resourceVersions (one counter for all, as etcd's), conflicts on update and on patch
preconditions, an event history that watches replay and then follow, compaction
(410 Gone), the streaming list (sendInitialEvents), paginated lists with continue
tokens, the label and field selectors nodepulse sends, the strategic-merge-patch subset
it sends and JSON merge patch, failure injection per verb and resource, and a log of
every call. It runs on the event loop: no threads, so FakeClock tests stay
deterministic.

Call keys name the verb and the resource, as a test reads them: "update leases",
"patch nodes/status", "list pods", "watch nodes", "create events".
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import itertools
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from nodeagent.api.client import ApiError
from nodeagent.api.kube import MERGE, STRATEGIC_MERGE, Obj, Resource, WatchStream
from nodeagent.api.reflector import INITIAL_EVENTS_END
from nodeagent.api.rest import Timeout

_REASONS = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 409: "Conflict",
            410: "Gone", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
            503: "ServiceUnavailable", 504: "GatewayTimeout"}


def api_error(status: int, reason: str = "", message: str = "",
              retry_after: float | None = None, fields: tuple[str, ...] = ()) -> ApiError:
    """What the client raises for an answer with this status; `fields`: the causes an
    Invalid answer names (details.causes[].field)."""
    reason = reason or _REASONS.get(status, "Error")
    body: dict[str, Any] = {"kind": "Status", "code": status, "message": message or reason}
    if fields:
        body["details"] = {"causes": [{"reason": "FieldValueInvalid", "field": f}
                                      for f in fields]}
    return ApiError(status, reason, json.dumps(body),
                    None if retry_after is None else {"Retry-After": str(retry_after)})


@dataclasses.dataclass
class Call:
    at: float  # the fake's `now()` when the call was made
    verb: str
    resource: str  # the plural, with "/subresource"
    namespace: str | None
    name: str | None
    body: Obj | None
    timeout: Timeout
    query: dict[str, Any]
    error: BaseException | None = None  # what the call raised
    held: bool = False  # sent, not answered yet (see FakeKube.hold)

    @property
    def key(self) -> str:
        return f"{self.verb} {self.resource}"


P = ParamSpec("P")
T = TypeVar("T")


def _logged(verb: Callable[Concatenate[FakeKube, P], Coroutine[Any, Any, T]]
            ) -> Callable[Concatenate[FakeKube, P], Coroutine[Any, Any, T]]:
    """Writes down on the call's log entry what it raised."""
    @functools.wraps(verb)
    async def call(self: FakeKube, /, *args: P.args, **kwargs: P.kwargs) -> T:
        mine = len(self.calls)  # each verb logs its call before it first awaits
        try:
            return await verb(self, *args, **kwargs)
        except BaseException as e:
            if len(self.calls) > mine:
                self.calls[mine].error = e
            raise
    return call


# An injected failure: raised as it is, or a function of the call that returns one
# (or None to let the call through).
Failure = BaseException | Callable[[Call], BaseException | None]


class FakeKube:
    def __init__(self, now: Callable[[], float] = lambda: 0.0) -> None:
        self.calls: list[Call] = []
        self.down = False  # every call answers 503
        self.watchlist = True  # sendInitialEvents is served (else 422)
        self.watchlist_unfinished = False  # the initial events, then the stream just ends
        self.expire_next_watch = False  # the next watch gets 410 whatever its version
        self.close_error: Exception | None = None  # closing a watch stream raises this
        self.compacted = 0  # history before this resourceVersion is gone
        self._now = now
        self._rv = 100
        self._uids = itertools.count(1)
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {}  # plural -> (ns, name) -> obj
        self._history: dict[str, list[tuple[int, str, Obj]]] = {}  # plural -> (rv, type, obj)
        self._streams: set[_Stream] = set()
        self._failures: dict[str, list[Failure]] = {}
        self._intercepts: dict[str, Callable[[Call], BaseException | None]] = {}
        self._answers: dict[str, Callable[[Call], Obj]] = {}

        self._holds: dict[tuple[str, str], asyncio.Event] = {}

    # -- test controls ----------------------------------------------------------------

    def fail(self, key: str, *errors: Failure) -> None:
        """The next calls with this key ("update leases") fail with these, in order."""
        self._failures.setdefault(key, []).extend(errors)

    def intercept(self, key: str, fn: Callable[[Call], BaseException | None] | None) -> None:
        """Every call with this key asks `fn` first: an error it returns is raised
        (None lets the call through). `fn=None` ends it."""
        if fn is None:
            self._intercepts.pop(key, None)
        else:
            self._intercepts[key] = fn

    def answer(self, key: str, fn: Callable[[Call], Obj]) -> None:
        """Calls with this key that the fake cannot serve from its store (a create on a
        subresource: "create serviceaccounts/token") are answered by `fn(call)`."""
        self._answers[key] = fn

    def hold(self, key: str, name: str) -> asyncio.Event:
        """Writes with this key ("patch nodes") to the object `name` are answered only
        once the returned Event is set, as by a slow API server: each is logged when
        sent and takes effect (and may conflict) when answered."""
        return self._holds.setdefault((key, name), asyncio.Event())

    def in_flight(self, key: str) -> int:
        """Calls with this key sent and not answered yet (held)."""
        return sum(1 for c in self.calls_of(key) if c.held)

    def calls_of(self, key: str, ok: bool | None = None) -> list[Call]:
        """The calls with this key; `ok`: only those that went through (or failed)."""
        return [c for c in self.calls if c.key == key
                and (ok is None or (c.error is None) == ok)]

    def count(self, key: str, ok: bool | None = None) -> int:
        return len(self.calls_of(key, ok))

    def times(self, key: str) -> list[float]:
        return [c.at for c in self.calls_of(key)]

    def bodies(self, key: str) -> list[Obj]:
        return [c.body for c in self.calls_of(key) if c.body is not None]

    def put(self, res: Resource, obj: Obj) -> Obj:
        """Create or replace, as an admin or another controller would (not logged):
        a uid is given if it has none, the resourceVersion moves on, watches see it."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if res.namespaced:
            meta.setdefault("namespace", "default")
        key = self._key(res, meta.get("namespace"), meta["name"])
        store = self._objects.setdefault(res.plural, {})
        meta.setdefault("uid", (store.get(key) or {}).get("metadata", {}).get("uid")
                        or f"uid-{meta['name']}")
        kind = "MODIFIED" if key in store else "ADDED"
        return self._write(res, key, obj, kind)

    def remove(self, res: Resource, name: str, namespace: str | None = None) -> None:
        """Delete as someone else would: watches see DELETED."""
        key = self._key(res, namespace, name)
        obj = self._objects.get(res.plural, {}).pop(key)
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._record(res, "DELETED", obj)

    def obj(self, res: Resource, name: str, namespace: str | None = None) -> Obj:
        """The stored object (a copy); KeyError if there is none."""
        return copy.deepcopy(self._objects.get(res.plural, {})[self._key(res, namespace, name)])

    def has(self, res: Resource, name: str, namespace: str | None = None) -> bool:
        return self._key(res, namespace, name) in self._objects.get(res.plural, {})

    def items(self, res: Resource, namespace: str | None = None) -> dict[str, Obj]:
        """name -> object (copies), of one namespace or of all (cluster-scoped)."""
        return {name: copy.deepcopy(o) for (ns, name), o in
                sorted(self._objects.get(res.plural, {}).items())
                if namespace is None or ns == namespace}

    def annotate(self, res: Resource, name: str, key: str, value: str | None,
                 namespace: str | None = None) -> Obj:
        obj = self.obj(res, name, namespace)
        ann = obj["metadata"].setdefault("annotations", {})
        if value is None:
            ann.pop(key, None)
        else:
            ann[key] = value
        return self.put(res, obj)

    def touch(self, res: Resource, name: str, namespace: str | None = None) -> None:
        """Someone else wrote the object: its resourceVersion moves on."""
        self.put(res, self.obj(res, name, namespace))

    def bump(self) -> None:
        """A write to something else: the resourceVersion moves on."""
        self._rv += 1

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    def bookmark(self, res: Resource) -> None:
        """Watches of `res` that asked for bookmarks get one at the current version."""
        self._record(res, "BOOKMARK", {"kind": res.kind, "apiVersion": res.api_version,
                                       "metadata": {"resourceVersion": str(self._rv)}})

    def compact(self) -> None:
        """Forget the history: watches from an older resourceVersion get 410 Gone."""
        self.compacted = self._rv

    def drop(self, error: BaseException | None = None) -> None:
        """End every open watch: cleanly (the server closed it) or, with `error`, as a
        broken connection."""
        for s in list(self._streams):
            s.end(error)

    @property
    def watches_open(self) -> int:
        return len(self._streams)

    # -- the verbs --------------------------------------------------------------------

    def separate(self, connections: int) -> FakeKube:
        return self  # no connections here

    @_logged
    async def get(self, res: Resource, name: str, *, namespace: str | None = None,
                  subresource: str | None = None, timeout: Timeout = 30.0) -> Obj:
        self._enter("get", res, namespace, name, None, timeout, subresource=subresource)
        return copy.deepcopy(self._existing(res, namespace, name))

    @_logged
    async def list(self, res: Resource, *, namespace: str | None = None,
                   label_selector: str = "", field_selector: str = "", limit: int = 0,
                   cont: str = "", timeout: Timeout = 60.0) -> Obj:
        self._enter("list", res, namespace, None, None, timeout, labelSelector=label_selector,
                    fieldSelector=field_selector, limit=limit, cont=cont)
        rv, start = self._rv, 0
        if cont:
            token_rv, _, offset = cont.partition(":")
            rv, start = int(token_rv), int(offset)
            if rv < self.compacted:
                raise api_error(410, "Expired", "the continue token has expired")
        items = [_listed(o) for (ns, _), o in sorted(self._objects.get(res.plural, {}).items())
                 if (namespace is None or ns == namespace)
                 and _matches(o, label_selector, field_selector)]
        end = start + limit if limit else len(items)
        meta: Obj = {"resourceVersion": str(rv)}
        if end < len(items):
            meta["continue"] = f"{rv}:{end}"
        return {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": meta,
                "items": items[start:end]}

    @_logged
    async def watch(self, res: Resource, *, namespace: str | None = None,
                    resource_version: str = "", label_selector: str = "",
                    field_selector: str = "", timeout_seconds: int = 300,
                    send_initial_events: bool = False) -> WatchStream:
        self._enter("watch", res, namespace, None, None, None,
                    resourceVersion=resource_version, labelSelector=label_selector,
                    fieldSelector=field_selector, timeoutSeconds=timeout_seconds,
                    sendInitialEvents=send_initial_events)

        def selected(o: Obj) -> bool:
            return (namespace is None or o["metadata"].get("namespace") == namespace) and \
                _matches(o, label_selector, field_selector)

        first: list[Obj] = []
        ends = False
        if send_initial_events:
            if not self.watchlist:
                raise api_error(422, "Invalid", "sendInitialEvents is not supported")
            since = self._rv
            first = [{"type": "ADDED", "object": copy.deepcopy(o)}
                     for _, o in sorted(self._objects.get(res.plural, {}).items()) if selected(o)]
            if self.watchlist_unfinished:
                ends = True
            else:
                first.append({"type": "BOOKMARK", "object": {
                    "kind": res.kind, "apiVersion": res.api_version, "metadata": {
                        "resourceVersion": str(since),
                        "annotations": {INITIAL_EVENTS_END: "true"}}}})
        else:
            since = int(resource_version or self._rv)
            if since < self.compacted or self.expire_next_watch:
                self.expire_next_watch = False  # (fail("watch ...", api_error(410)): HTTP 410)
                first = [{"type": "ERROR", "object": {
                    "kind": "Status", "code": 410, "reason": "Expired",
                    "message": f"too old resource version: {since} ({self.compacted})"}}]
                ends = True
        stream = _Stream(self, res, selected, since, first, ends)
        if not ends:
            self._streams.add(stream)
        return stream

    @_logged
    async def create(self, res: Resource, body: Obj, *, namespace: str | None = None,
                     name: str | None = None, subresource: str | None = None,
                     timeout: Timeout = 30.0, parse: bool = True) -> Obj:
        meta = body.get("metadata") or {}
        ns = namespace if namespace is not None else (
            meta.get("namespace") if res.namespaced else None)
        if subresource is not None:
            assert name is not None, "a subresource belongs to a named object"
            self._enter("create", res, ns, name, body, timeout, subresource=subresource)
            self._existing(res, ns, name)
            answer = self._answers.get(self.calls[-1].key)
            if answer is None:
                raise api_error(404, "NotFound", f"{res.plural}/{subresource}: no answer set")
            return self._answer(answer(self.calls[-1]), parse)
        self._enter("create", res, ns, meta.get("name"), body, timeout)
        key = self._key(res, ns, meta["name"])
        if key in self._objects.get(res.plural, {}):
            raise api_error(409, "AlreadyExists", f"{res.plural} {meta['name']} already exists")
        obj = copy.deepcopy(body)
        obj.setdefault("apiVersion", res.api_version)
        obj.setdefault("kind", res.kind)
        if res.namespaced:
            obj["metadata"]["namespace"] = ns
        obj["metadata"]["uid"] = f"uid-{meta['name']}-{next(self._uids)}"
        return self._answer(self._write(res, key, obj, "ADDED"), parse)

    @_logged
    async def update(self, res: Resource, body: Obj, *, subresource: str | None = None,
                     timeout: Timeout = 30.0, parse: bool = True) -> Obj:
        meta = body.get("metadata") or {}
        ns = meta.get("namespace") if res.namespaced else None
        self._enter("update", res, ns, meta.get("name"), body, timeout, subresource=subresource)
        current = self._existing(res, ns, meta["name"])
        if meta.get("resourceVersion") not in (None, current["metadata"]["resourceVersion"]):
            raise api_error(409, "Conflict", "the object has been modified")
        obj = copy.deepcopy(body)
        obj["metadata"]["uid"] = current["metadata"].get("uid")
        if subresource == "status":
            obj = {**current, "status": obj.get("status")}
        return self._answer(self._write(res, self._key(res, ns, meta["name"]), obj,
                                        "MODIFIED"), parse)

    @_logged
    async def patch(self, res: Resource, name: str, body: Obj, *,
                    namespace: str | None = None, subresource: str | None = None,
                    content_type: str = STRATEGIC_MERGE, timeout: Timeout = 30.0,
                    parse: bool = True) -> Obj:
        call = self._enter("patch", res, namespace, name, body, timeout,
                           subresource=subresource, contentType=content_type)
        await self._answered(call)
        current = self._existing(res, namespace, name)
        _preconditions(current, body.get("metadata") or {})
        merge = strategic_merge if content_type == STRATEGIC_MERGE else merge_patch
        if content_type not in (STRATEGIC_MERGE, MERGE):
            raise api_error(415, "UnsupportedMediaType", content_type)
        if subresource == "status":  # the status subresource changes the status only
            obj = {**current, "status": merge(current.get("status") or {},
                                              body.get("status") or {})}
            if res.plural == "pods":
                _validate_pod_ips(name, obj["status"])
        else:  # and the main resource everything but the status
            obj = merge(current, {k: v for k, v in body.items() if k != "status"})
        obj["metadata"]["uid"] = current["metadata"].get("uid")
        return self._answer(self._write(res, self._key(res, namespace, name), obj,
                                        "MODIFIED"), parse)

    @_logged
    async def delete(self, res: Resource, name: str, *, namespace: str | None = None,
                     options: Obj | None = None, timeout: Timeout = 30.0,
                     parse: bool = True) -> Obj:
        self._enter("delete", res, namespace, name, options, timeout)
        current = self._existing(res, namespace, name)
        want = ((options or {}).get("preconditions") or {}).get("uid")
        if want and want != current["metadata"].get("uid"):
            raise api_error(409, "Conflict", f"Precondition failed: UID in precondition: {want}")
        self.remove(res, name, namespace)
        return self._answer(current, parse)

    # -- inside -----------------------------------------------------------------------

    def _key(self, res: Resource, namespace: str | None, name: str) -> tuple[str, str]:
        if res.namespaced and not namespace:
            raise ValueError(f"{res.plural}/{name}: a namespace is needed")
        return (namespace or "", name)

    def _existing(self, res: Resource, namespace: str | None, name: str) -> Obj:
        obj = self._objects.get(res.plural, {}).get(self._key(res, namespace, name))
        if obj is None:
            raise api_error(404, "NotFound", f'{res.plural} "{name}" not found')
        return obj

    def _enter(self, verb: str, res: Resource, namespace: str | None, name: str | None,
               body: Obj | None, timeout: Timeout, subresource: str | None = None,
               **query: Any) -> Call:
        plural = res.plural + (f"/{subresource}" if subresource else "")
        call = Call(self._now(), verb, plural, namespace, name, copy.deepcopy(body), timeout,
                    {k: v for k, v in query.items() if v not in (None, "", 0, False)})
        self.calls.append(call)
        queue = self._failures.get(call.key)
        if queue:
            failure = queue.pop(0)
            err = failure if isinstance(failure, BaseException) else failure(call)
            if err is not None:
                raise err
        intercept = self._intercepts.get(call.key)
        if intercept is not None and (err := intercept(call)) is not None:
            raise err
        if self.down:
            raise api_error(503, "ServiceUnavailable", "down")
        return call

    async def _answered(self, call: Call) -> None:
        gate = self._holds.get((call.key, call.name or ""))
        if gate is not None and not gate.is_set():
            call.held = True
            try:
                await gate.wait()
            finally:
                call.held = False

    def _write(self, res: Resource, key: tuple[str, str], obj: Obj, kind: str) -> Obj:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._objects.setdefault(res.plural, {})[key] = obj
        self._record(res, kind, obj)
        return copy.deepcopy(obj)

    def _record(self, res: Resource, kind: str, obj: Obj) -> None:
        self._history.setdefault(res.plural, []).append((self._rv, kind, copy.deepcopy(obj)))
        for s in self._streams:
            if s.res == res:
                s.wake()

    @staticmethod
    def _answer(obj: Obj, parse: bool) -> Obj:
        return obj if parse else {}


class _Stream:
    """One watch: its first events (ERROR 410, or a streaming list), then the history
    after `since` and whatever is written while it is open."""

    def __init__(self, kube: FakeKube, res: Resource, selected: Callable[[Obj], bool],
                 since: int, first: list[Obj], ends: bool) -> None:
        self.kube, self.res, self.selected = kube, res, selected
        self.sent = since
        self.first = first
        self.ends = ends  # after the first events (nothing follows)
        self.error: BaseException | None = None
        self.closed = False
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    def end(self, error: BaseException | None) -> None:
        self.ends, self.error = True, error
        self.kube._streams.discard(self)
        self._wake.set()

    def __aiter__(self) -> AsyncIterator[list[Obj]]:
        return self._events()

    async def _events(self) -> AsyncIterator[list[Obj]]:
        if self.first:
            batch, self.first = self.first, []
            yield batch
        while not self.closed:
            batch = [{"type": kind, "object": copy.deepcopy(obj)}
                     for rv, kind, obj in self.kube._history.get(self.res.plural, [])
                     if rv > self.sent and (kind == "BOOKMARK" or self.selected(obj))]
            self.sent = max([self.sent, *(rv for rv, _, _ in
                                          self.kube._history.get(self.res.plural, []))])
            if batch and not self.ends:
                yield batch
                continue
            if self.ends:
                if self.error is not None:
                    raise self.error
                return
            self._wake.clear()
            await self._wake.wait()

    def close(self) -> None:
        self.closed = True
        self.kube._streams.discard(self)
        self._wake.set()
        if self.kube.close_error is not None:
            raise self.kube.close_error

    async def aclose(self) -> None:
        self.close()


def _listed(obj: Obj) -> Obj:
    """A list's items carry no kind and apiVersion (the list has them)."""
    return {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("kind", "apiVersion")}


def _field(obj: Obj, path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def _matches(obj: Obj, label_selector: str, field_selector: str) -> bool:
    """Equality-based selectors: k=v, k==v, k!=v, and (labels) k for 'has k'."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in label_selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term not in labels:
            return False
    for term in filter(None, (t.strip() for t in field_selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if _field(obj, k) == v:
                return False
        else:
            k, v = term.replace("==", "=").split("=", 1)
            if _field(obj, k) != v:
                return False
    return True


def _preconditions(current: Obj, meta: Obj) -> None:
    """A patch's uid and resourceVersion: another uid makes the patched object invalid
    (the uid is immutable: 422 naming metadata.uid), another resourceVersion conflicts."""
    have = current["metadata"]
    if meta.get("uid") is not None and meta["uid"] != have.get("uid"):
        raise api_error(422, "Invalid", f'metadata.uid: Invalid value: "{meta["uid"]}": '
                        "field is immutable", fields=("metadata.uid",))
    if meta.get("resourceVersion") is not None and \
            meta["resourceVersion"] != have.get("resourceVersion"):
        raise api_error(409, "Conflict", f"Precondition failed: resourceVersion "
                        f"{meta['resourceVersion']}")


def _validate_pod_ips(name: str, status: Obj) -> None:
    """The API server's rule for a pod's podIPs and hostIPs: one address per family."""
    for key in ("podIPs", "hostIPs"):
        families = [":" in str(item.get("ip")) for item in status.get(key) or []]
        if len(families) != len(set(families)):
            raise api_error(422, "Invalid", f'Pod "{name}" is invalid: status.{key}: Invalid '
                            f"value: {status[key]}: may specify no more than one IP for each "
                            "IP family", fields=(f"status.{key}",))


# Lists the strategic merge patch merges item by item, by this key (the agent's and the
# operator's patches touch only these); any other list is replaced.
MERGE_KEYS = {"conditions": "type", "addresses": "type", "podIPs": "ip", "hostIPs": "ip",
              "ownerReferences": "uid"}


def strategic_merge(target: Obj, patch: Obj) -> Obj:
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and value and value[0] == {"$patch": "replace"}:
            out[key] = copy.deepcopy(value[1:])
        elif key in MERGE_KEYS and isinstance(value, list):
            mk = MERGE_KEYS[key]
            merged = {item[mk]: item for item in out.get(key) or []}
            for item in value:
                if item.get("$patch") == "delete":  # the item of that key goes
                    merged.pop(item[mk], None)
                    continue
                merged[item[mk]] = strategic_merge(merged.get(item[mk], {}), item)
            out[key] = list(merged.values())
        elif isinstance(value, dict):
            out[key] = strategic_merge(out.get(key) or {}, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_patch(target: Obj, patch: Obj) -> Obj:
    """JSON merge patch (RFC 7386): objects merge, null deletes, lists are replaced."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            current = out.get(key)
            out[key] = merge_patch(current if isinstance(current, dict) else {}, value)
        else:
            out[key] = copy.deepcopy(value)
    return out
