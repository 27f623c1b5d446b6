"""The ConfigMaps, Secrets and Services the agent's pods use, followed by watches through
the one reflector (nodeagent.api.reflector), never polled.

ConfigMaps and Secrets. Under the Node authorizer a node may read only the ones that
pods bound to it reference, and only one by one: `get`, or `list`/`watch` with the field
selector `metadata.name=<name>`; a list or watch of a whole namespace is refused (403).
So each referenced object has a watch of its own, as the kubelet's, shared by every pod
of the process that references it: started when the first pod needs it (`track`),
stopped when the last one goes (`release`). A change that alters an object's content
makes the pods that reference it sync again (`on_change`): their volumes are rewritten.

Services. The service environment variables (nodeagent.pods.env) need every Service of a
pod's namespace and `kubernetes` of `default`; nodes may list and watch all Services,
so one cluster-wide watch serves every pod. It starts when a container first needs it,
and keeps only what the variables are made of.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.client import brief, is_retriable
from nodeagent.api.clock import Clock
from nodeagent.api.kube import CONFIG_MAPS, SERVICES, Kube, Obj, Resource
from nodeagent.api.reflector import Reflector, ReflectorConfig

log = logging.getLogger(__name__)

Ref = tuple[Resource, str, str]  # (CONFIG_MAPS or SECRETS, namespace, name)


def ref_text(ref: Ref) -> str:
    """How the kubelet's messages name it: configmap "x", secret "x"."""
    return f'{"configmap" if ref[0] is CONFIG_MAPS else "secret"} "{ref[2]}"'


class ObjectUnavailable(Exception):
    """The object could not be read (refused, or the API server did not answer)."""


def _slim(obj: Obj) -> Obj:
    """What a pod can use of a ConfigMap or Secret (managedFields and the like dropped)."""
    meta = obj.get("metadata") or {}
    return {"metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                         "resourceVersion": meta.get("resourceVersion")},
            "data": obj.get("data") or {}, "binaryData": obj.get("binaryData") or {}}


def _content(obj: Obj | None) -> object:
    return None if obj is None else (obj["data"], obj["binaryData"])


class _Followed:
    """One watched object: the reflector's handler, and who uses it."""

    def __init__(self, ref: Ref, notify: Callable[[_Followed], None]) -> None:
        self.ref = ref
        self.obj: Obj | None = None
        self.synced = asyncio.Event()
        self.users: set[str] = set()  # pod uids
        self.reflector: Reflector | None = None
        self.task: asyncio.Task[None] | None = None
        self._notify = notify

    def _set(self, obj: Obj | None) -> None:
        new = None if obj is None else _slim(obj)
        changed = _content(new) != _content(self.obj)
        self.obj = new
        if self.synced.is_set() and changed:
            self._notify(self)
        self.synced.set()

    def on_list(self, items: list[Obj]) -> None:
        self._set(items[0] if items else None)

    def on_events(self, events: list[tuple[str, Obj]]) -> None:
        for kind, obj in events:
            self._set(None if kind == "DELETED" else obj)


class ObjectCache:
    """Referenced ConfigMaps and Secrets, one watch per object shared by its pods."""

    def __init__(self, kube: Kube, clock: Clock, *, answered: ApiAnswered | None = None,
                 wait: float = 10.0) -> None:
        self.kube = kube
        self.clock = clock
        self.answered = answered
        self.wait = wait  # how long a read waits for a new watch's first list
        self.on_change: Callable[[set[str]], None] | None = None  # pod uids to sync
        self._followed: dict[Ref, _Followed] = {}
        self._by_pod: dict[str, set[Ref]] = {}

    @property
    def watched(self) -> int:
        return len(self._followed)

    def track(self, uid: str, refs: Iterable[Ref]) -> None:
        """Pod `uid` uses exactly these objects (watches start for new ones, stop for
        those no pod uses any more)."""
        want = set(refs)
        have = self._by_pod.get(uid, set())
        for ref in want - have:
            f = self._followed.get(ref)
            if f is None:
                f = self._followed[ref] = self._start(ref)
            f.users.add(uid)
        self._drop(uid, have - want)
        if want:
            self._by_pod[uid] = want
        else:
            self._by_pod.pop(uid, None)

    def release(self, uid: str) -> None:
        """Pod `uid` is gone: its watches stop unless another pod uses them."""
        self._drop(uid, self._by_pod.pop(uid, set()))

    async def get(self, ref: Ref) -> Obj | None:
        """The object (None: it does not exist). It must be tracked by some pod. Raises
        ObjectUnavailable when it cannot be read."""
        f = self._followed.get(ref)
        if f is None:
            raise ObjectUnavailable(f"{ref_text(ref)}: not referenced by any pod")
        await _synced(f.synced, f.reflector, self.clock, self.wait, f"cannot read {ref_text(ref)}")
        return f.obj

    async def close(self) -> None:
        for ref in list(self._followed):
            self._stop(ref)
        self._by_pod.clear()
        await asyncio.sleep(0)

    # -- inside --
    def _start(self, ref: Ref) -> _Followed:
        res, ns, name = ref
        f = _Followed(ref, self._changed)
        config = ReflectorConfig(res, name=f"{res.plural} {ns}/{name}", namespace=ns,
                                 field_selector=f"metadata.name={name}")
        f.reflector = Reflector(self.kube, config, f, self.clock, answered=self.answered)
        f.task = asyncio.get_running_loop().create_task(f.reflector.run(),
                                                        name=f"watch {config.name}")
        return f

    def _drop(self, uid: str, refs: Iterable[Ref]) -> None:
        for ref in refs:
            f = self._followed.get(ref)
            if f is None:
                continue
            f.users.discard(uid)
            if not f.users:
                self._stop(ref)

    def _stop(self, ref: Ref) -> None:
        f = self._followed.pop(ref)
        if f.reflector is not None:
            f.reflector.stop()
        if f.task is not None:
            f.task.cancel()

    def _changed(self, f: _Followed) -> None:
        log.info("%s in %s changed; syncing the %d pod(s) using it", ref_text(f.ref),
                 f.ref[1], len(f.users))
        if self.on_change is not None and f.users:
            self.on_change(set(f.users))


# -- Services ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ServicePort:
    name: str
    port: int
    protocol: str


@dataclass(frozen=True)
class ServiceInfo:
    """What the environment variables of a Service are made of."""
    name: str
    cluster_ip: str
    ports: tuple[ServicePort, ...]


def _service_info(obj: Obj) -> ServiceInfo | None:
    spec = obj.get("spec") or {}
    ip = str(spec.get("clusterIP") or "")
    if ip in ("", "None"):
        return None  # headless or without an address: no variables
    ports = tuple(ServicePort(str(p.get("name") or ""), int(p.get("port") or 0),
                              str(p.get("protocol") or "TCP"))
                  for p in spec.get("ports") or [])
    if not ports:
        return None
    return ServiceInfo(str((obj.get("metadata") or {}).get("name") or ""), ip, ports)


class ServiceCache:
    """Every Service of the cluster that has a cluster IP, from one watch."""

    def __init__(self, kube: Kube, clock: Clock, *, answered: ApiAnswered | None = None,
                 wait: float = 10.0) -> None:
        self.kube = kube
        self.clock = clock
        self.answered = answered
        self.wait = wait
        self.synced = asyncio.Event()
        self._services: dict[tuple[str, str], ServiceInfo] = {}
        self._reflector: Reflector | None = None
        self._task: asyncio.Task[None] | None = None

    def on_list(self, items: list[Obj]) -> None:
        self._services = {}
        self.on_events([("ADDED", o) for o in items])
        self.synced.set()

    def on_events(self, events: list[tuple[str, Obj]]) -> None:
        for kind, obj in events:
            meta = obj.get("metadata") or {}
            key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
            info = None if kind == "DELETED" else _service_info(obj)
            if info is None:
                self._services.pop(key, None)
            else:
                self._services[key] = info

    def start(self) -> None:
        """Start the watch (once), as the sync loops start: the first pod's containers
        then find the Services read, instead of waiting for their list."""
        if self._reflector is None:
            config = ReflectorConfig(SERVICES, name="services")
            self._reflector = Reflector(self.kube, config, self, self.clock,
                                        answered=self.answered)
            self._task = asyncio.get_running_loop().create_task(self._reflector.run(),
                                                                name="watch services")

    async def run(self) -> None:
        """The watch, until cancelled: run beside the sync loops."""
        self.start()
        assert self._task is not None
        await self._task

    async def services(self, namespace: str, links: bool, wait: bool = True,
                       ) -> list[ServiceInfo]:
        """The Services whose variables a pod of `namespace` gets: those of its namespace
        when `links` (enableServiceLinks), and `kubernetes` of `default` always (a
        Service of that name in the pod's own namespace wins). Raises
        ObjectUnavailable while the Services cannot be read, unless told not to `wait`
        for them (a static pod: it may be the API server itself), which takes those
        read so far, none before the first list."""
        self.start()
        if wait:
            await _synced(self.synced, self._reflector, self.clock, self.wait,
                          "services have not yet been read at least once, cannot construct "
                          "envvars")
        out: dict[str, ServiceInfo] = {}
        master = self._services.get(("default", "kubernetes"))
        if links:
            out.update({name: s for (ns, name), s in self._services.items()
                        if ns == namespace})
        if master is not None and "kubernetes" not in out:
            out["kubernetes"] = master
        return list(out.values())

    async def close(self) -> None:
        if self._reflector is not None:
            self._reflector.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def _synced(synced: asyncio.Event, reflector: Reflector | None, clock: Clock,
                  wait: float, what: str) -> None:
    """Until the watch's first list is in; ObjectUnavailable(`what`: why) when it is
    refused (403: not for this node) or not in within `wait` seconds."""
    deadline = clock.monotonic() + wait
    while not synced.is_set():
        err = reflector.last_error if reflector else None
        if err is not None and not is_retriable(err):
            raise ObjectUnavailable(f"{what}: {brief(err)}")
        left = deadline - clock.monotonic()
        if left <= 0:
            why = f": {brief(err)}" if err is not None else ""
            raise ObjectUnavailable(f"{what}: no answer within {wait:.0f}s{why}")
        waits = [asyncio.ensure_future(synced.wait()), asyncio.ensure_future(clock.sleep(left))]
        if reflector is not None:
            reflector.failed.clear()
            waits.append(asyncio.ensure_future(reflector.failed.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
