"""Mirror pods: the API server's copy of each static pod, kept in step.

Desired: one mirror per static pod the merge delivers for this node, annotated
`kubernetes.io/config.mirror` = the static pod's config hash. Actual: the mirror pods
the API source sees (the watch covers every pod bound to the node, mirrors included).

- missing -> create (shaped as NodeRestriction admits from the node: see
  static.mirror_pod; a static pod that references a secret, configmap, PVC or service
  account cannot have one: reported once, the static pod still runs);
- hash differs (the manifest changed) -> delete (UID precondition) and create anew:
  a node may create and delete mirror pods, never update them;
- no static pod any more -> delete, but only once all sources are ready (before that
  a missing static pod proves nothing).

Runs when the merge reports a change to static or mirror pods, and every `resync`
seconds, once the API source has listed what exists (so an agent restart does not
create mirrors blindly); nothing changed means no API call. Failures retry with backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from nodeagent.api.client import is_retriable
from nodeagent.api.clock import Clock
from nodeagent.api.rest import request_json
from nodeagent.sources import metrics
from nodeagent.sources.merge import Merge
from nodeagent.sources.problems import Problems
from nodeagent.sources.static import mirror_pod, mirror_problem
from nodeagent.sources.types import (
    ANN_CONFIG_HASH,
    ANN_CONFIG_MIRROR,
    ANN_CONFIG_SOURCE,
    Pod,
    Source,
    pod_node_name,
    pod_uid,
)

log = logging.getLogger("nodeagent.sources")


def _ann(pod: Pod, key: str) -> str | None:
    return (pod.get("metadata", {}).get("annotations") or {}).get(key)


class MirrorManager:
    def __init__(self, api: client.ApiClient, node_name: str, merge: Merge, clock: Clock, *,
                 problems: Problems | None = None, resync: float = 60.0,
                 backoff_initial: float = 1.0, backoff_max: float = 60.0) -> None:
        self.api = api
        self.node_name = node_name
        self.merge = merge
        self.clock = clock
        self.problems = problems or merge.problems
        self.resync = resync
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._node_uid: str | None = None
        self._created: dict[str, str] = {}   # name -> hash created, not yet seen by the watch
        self._deleted: dict[str, str] = {}   # name -> UID deleted, maybe still seen
        self._refused: dict[str, str] = {}   # name -> problem reported
        self.creates = 0
        # called after a mirror pod is created: its static pod's status, retried on 404
        # until now, can go at once
        self.on_created: list[Callable[[], None]] = []
        self.deletes = 0
        self.passes = 0
        self._pass_cond = asyncio.Condition()
        self._changed = merge.listen()

    def resync_now(self) -> None:
        """Make a pass now rather than at the next change or resync."""
        self._changed.set()

    async def run(self) -> None:
        changed = self._changed
        delay = 0.0
        while True:
            changed.clear()
            try:
                ok = await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug or an unexpected answer: log, retry later
                log.exception("mirror pods: %s", e)
                ok = False
            async with self._pass_cond:
                self.passes += 1
                self._pass_cond.notify_all()
            delay = 0.0 if ok else min(self.backoff_max, max(self.backoff_initial, delay * 2))
            await self._wait(changed, delay or self.resync)

    async def wait_passes(self, n: int) -> None:
        async with self._pass_cond:
            await self._pass_cond.wait_for(lambda: self.passes >= n)

    async def _wait(self, changed: asyncio.Event, timeout: float) -> None:
        waiter = asyncio.ensure_future(changed.wait())
        sleeper = asyncio.ensure_future(self.clock.sleep(timeout))
        _, pending = await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()

    async def sync_once(self) -> bool:
        """One pass. Returns False if something failed and should be retried soon."""
        if not self.merge.ready.seen(Source.API):
            return True  # which mirrors exist is not known yet: creating now would be blind
        desired = {name: pod for name, pod in self.merge.static_pods().items()
                   if pod_node_name(pod) == self.node_name}
        actual = {name: pod for name, pod in self.merge.mirrors.items()
                  if pod_node_name(pod) == self.node_name}
        ok = True
        for name in list(self._created):
            if name in actual or name not in desired:
                self._created.pop(name)
        for name, uid in list(self._deleted.items()):
            if name not in actual or pod_uid(actual[name]) != uid:
                self._deleted.pop(name)
        for name in list(self._refused):
            if name not in desired:
                self._refused.pop(name)
        for name, static in desired.items():
            want = _ann(static, ANN_CONFIG_HASH)
            have = actual.get(name)
            if have is not None and name not in self._deleted:
                if _ann(have, ANN_CONFIG_MIRROR) == want:
                    continue
                if have.get("metadata", {}).get("deletionTimestamp"):
                    continue  # going away; create once it is gone
                ok = await self._delete(have, "outdated") and ok
                if name in actual and name not in self._deleted:
                    continue
            elif have is not None:
                continue  # our delete is not yet seen by the watch
            if self._created.get(name) == want:
                continue  # created; the watch has not shown it yet
            ok = await self._create(name, static) and ok
        if self.merge.ready.all_ready():
            for name, have in actual.items():
                if (name not in desired and name not in self._deleted
                        and not have.get("metadata", {}).get("deletionTimestamp")):
                    ok = await self._delete(have, "orphaned") and ok
        return ok

    async def _uid_of_node(self) -> str:
        if self._node_uid is None:
            node = await asyncio.to_thread(request_json, self.api, "GET",
                                           f"/api/v1/nodes/{self.node_name}", timeout=10.0)
            self._node_uid = node["metadata"]["uid"]
        return self._node_uid

    async def _create(self, name: str, static: Pod) -> bool:
        problem = mirror_problem(static)
        source = Source(_ann(static, ANN_CONFIG_SOURCE) or "file")
        if problem is not None:
            if self._refused.get(name) != problem:
                self._refused[name] = problem
                self.problems.report(source, "MirrorRefused",
                                     f"static pod {name} gets no mirror pod: it {problem}, "
                                     "which a node may not create; it runs without one")
            return True
        ns = static["metadata"]["namespace"]
        try:
            body = mirror_pod(static, await self._uid_of_node())
            await asyncio.to_thread(request_json, self.api, "POST",
                                    f"/api/v1/namespaces/{ns}/pods", body=body, timeout=30.0)
        except ApiException as e:
            metrics.MIRROR_WRITES.labels("create", "error").inc()
            if e.status == 409:
                return True  # already there: the watch will show what it is
            if e.status == 404:
                self._node_uid = None  # the Node (or namespace) is missing
            if e.status == 403 and "UID mismatch" in str(e.body):
                self._node_uid = None  # the Node was re-created
            message = f"creating mirror pod {name}: HTTP {e.status}: {_message(e)}"
            if not is_retriable(e) and self._refused.get(name) != message:
                self._refused[name] = message
                self.problems.report(source, "MirrorRefused", message)
            log.info("mirror pods: %s", message)
            return False
        except Exception as e:
            metrics.MIRROR_WRITES.labels("create", "error").inc()
            log.info("mirror pods: creating %s: %s", name, e)
            return False
        metrics.MIRROR_WRITES.labels("create", "ok").inc()
        self.creates += 1
        self._created[name] = _ann(static, ANN_CONFIG_HASH) or ""
        self._refused.pop(name, None)
        for hook in self.on_created:
            hook()
        return True

    async def _delete(self, mirror: Pod, why: str) -> bool:
        meta = mirror["metadata"]
        name = f"{meta['namespace']}/{meta['name']}"
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": meta["uid"]}}
        try:
            await asyncio.to_thread(request_json, self.api, "DELETE",
                                    f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                    body=body, timeout=30.0)
        except ApiException as e:
            if e.status in (404, 409):  # gone already, or another incarnation
                self._deleted[name] = meta["uid"]
                return True
            metrics.MIRROR_WRITES.labels("delete", "error").inc()
            log.info("mirror pods: deleting %s (%s): HTTP %s: %s", name, why, e.status,
                     _message(e))
            return False
        except Exception as e:
            metrics.MIRROR_WRITES.labels("delete", "error").inc()
            log.info("mirror pods: deleting %s (%s): %s", name, why, e)
            return False
        metrics.MIRROR_WRITES.labels("delete", "ok").inc()
        log.info("mirror pods: deleted %s (%s)", name, why)
        self.deletes += 1
        self._deleted[name] = meta["uid"]
        return True


def _message(e: ApiException) -> str:
    try:
        return str(json.loads(e.body or b"{}").get("message") or e.reason)
    except ValueError:
        return str(e.reason)
