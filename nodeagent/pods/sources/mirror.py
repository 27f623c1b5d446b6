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
create mirrors blindly); nothing changed means no API call. Failures retry with backoff,
which ends when the API server answers again (the ApiAnswered signal). A mirror pod
created fires that signal: its static pod's status writes, refused with 404 until the
mirror existed, go at once.

The Node's UID (a mirror pod is owned by its Node) comes from the node's registration,
not from a request of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.client import ApiError, brief, is_retriable
from nodeagent.api.clock import Clock
from nodeagent.api.kube import PODS, Kube, describe
from nodeagent.pods.podupdate import (
    ANN_CONFIG_HASH,
    ANN_CONFIG_MIRROR,
    ANN_CONFIG_SOURCE,
    Pod,
    Source,
    pod_node_name,
    pod_uid,
)
from nodeagent.pods.sources import sourcemetrics
from nodeagent.pods.sources.merge import Merge
from nodeagent.pods.sources.static import mirror_pod, mirror_problem

log = logging.getLogger("nodeagent.pods.sources")


def _ann(pod: Pod, key: str) -> str | None:
    return (pod.get("metadata", {}).get("annotations") or {}).get(key)


class MirrorManager:
    # a pass that failed is tried again after this, doubling up to BACKOFF_MAX
    BACKOFF_INITIAL, BACKOFF_MAX = 1.0, 60.0

    def __init__(self, kube: Kube, node_name: str, merge: Merge, clock: Clock, *,
                 node_uid: Callable[[], str | None], answered: ApiAnswered | None = None,
                 resync: float = 60.0) -> None:
        """`node_uid`: the Node's UID once it is registered (None before). Problems are
        reported through the merge's (merge.problems)."""
        self.kube = kube
        self.node_name = node_name
        self.node_uid = node_uid
        self.merge = merge
        self.clock = clock
        self.answered = answered or ApiAnswered(clock)
        self.problems = merge.problems
        self.resync = resync
        self._created: dict[str, str] = {}   # name -> hash created, not yet seen by the watch
        self._deleted: dict[str, str] = {}   # name -> UID deleted, maybe still seen
        self._refused: dict[str, str] = {}   # name -> problem reported
        self.creates = 0
        self.deletes = 0
        self.passes = 0
        self._pass_cond = asyncio.Condition()
        self._changed = merge.listen()

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
            delay = 0.0 if ok else min(self.BACKOFF_MAX, max(self.BACKOFF_INITIAL, delay * 2))
            await self._wait(changed, delay or self.resync)

    async def wait_passes(self, n: int) -> None:
        async with self._pass_cond:
            await self._pass_cond.wait_for(lambda: self.passes >= n)

    async def _wait(self, changed: asyncio.Event, timeout: float) -> None:
        """Until a change, the API server answering again, or `timeout`."""
        waits = {asyncio.ensure_future(changed.wait()),
                 asyncio.ensure_future(self.answered.wait(timeout))}
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
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
        uid = self.node_uid()
        if uid is None:
            log.info("mirror pods: %s waits for its Node to be registered", name)
            return False
        try:
            await self.kube.create(PODS, mirror_pod(static, uid), timeout=30.0, parse=False)
        except ApiError as e:
            sourcemetrics.MIRROR_WRITES.labels("create", "error").inc()
            if e.status == 409:
                return True  # already there: the watch will show what it is
            # 404: the Node or the namespace is missing; 403 "UID mismatch": the Node was
            # re-created (its registration learns the new UID): retried
            message = f"creating mirror pod {name}: {brief(e)}"
            if not is_retriable(e) and self._refused.get(name) != message:
                self._refused[name] = message
                self.problems.report(source, "MirrorRefused", message)
            log.info("mirror pods: %s", message)
            return False
        except Exception as e:
            sourcemetrics.MIRROR_WRITES.labels("create", "error").inc()
            log.info("mirror pods: creating %s: %s", name, e)
            return False
        sourcemetrics.MIRROR_WRITES.labels("create", "ok").inc()
        self.creates += 1
        self._created[name] = _ann(static, ANN_CONFIG_HASH) or ""
        self._refused.pop(name, None)
        self.answered.fire()
        return True

    async def _delete(self, mirror: Pod, why: str) -> bool:
        meta = mirror["metadata"]
        name = describe(mirror)
        try:
            await self.kube.delete(PODS, meta["name"], namespace=meta["namespace"], options={
                "gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
                timeout=30.0, parse=False)
        except ApiError as e:
            if e.status in (404, 409):  # gone already, or another incarnation
                self._deleted[name] = meta["uid"]
                return True
            sourcemetrics.MIRROR_WRITES.labels("delete", "error").inc()
            log.info("mirror pods: deleting %s (%s): %s", name, why, brief(e))
            return False
        except Exception as e:
            sourcemetrics.MIRROR_WRITES.labels("delete", "error").inc()
            log.info("mirror pods: deleting %s (%s): %s", name, why, e)
            return False
        sourcemetrics.MIRROR_WRITES.labels("delete", "ok").inc()
        log.info("mirror pods: deleted %s (%s)", name, why)
        self.deletes += 1
        self._deleted[name] = meta["uid"]
        return True
