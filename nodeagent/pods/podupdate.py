"""What flows from the pod sources, through the merge, to the sync loop.

Pods are plain dicts in the API server's JSON form (what `GET /api/v1/.../pods/x`
returns, camelCase keys: `pod["metadata"]["uid"]`, `pod["spec"]["containers"]`).
No model objects: dicts are cheap to hash and compare, and the kubernetes client is
called with `_preload_content=False` so its body is parsed once by `json.loads`.

Identity:
- A pod is identified by `metadata.uid` (the merge keys every source by UID).
- API pods carry the API server's UID.
- Static pods (from the manifest folder or URL) get a deterministic UID derived from
  source + normalized content + node name (see nodeagent.pods.sources.static). Editing a
  static manifest therefore changes its UID: the sync loop sees REMOVE(old) then
  ADD(new), in that order, like the kubelet (the static pod restarts).
- Mirror pods (the API server's copy of a static pod, annotated
  `kubernetes.io/config.mirror`) never reach the sync loop as pods to run; the merge
  hands them to the mirror manager only. The status of a static pod is meant to be
  written to its mirror pod (same namespace/name).

Consumers must treat pod dicts as read-only: the merge keeps references to them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

Pod = dict[str, Any]
"""A pod in the API's JSON form (see the module docstring)."""


class Source(enum.StrEnum):
    """Where a pod came from. The value is what `kubernetes.io/config.source` holds."""

    API = "api"    # pods bound to this node in the API server (watch)
    FILE = "file"  # static pods from --pod-manifest-path
    HTTP = "http"  # static pods from --manifest-url


# Precedence when two sources deliver a pod with the same namespace/name: the first
# in this tuple wins (node-local configuration beats the API). The loser is reported
# (log, metric, Node Event) and not delivered.
SOURCE_PRECEDENCE: tuple[Source, ...] = (Source.FILE, Source.HTTP, Source.API)


class Op(enum.StrEnum):
    """What the sync loop must do with the pods of a PodUpdate."""

    ADD = "ADD"
    """Pods new to this node: start them."""
    UPDATE = "UPDATE"
    """The spec or metadata (labels, annotations) of known pods changed: sync them."""
    DELETE = "DELETE"
    """Graceful delete: the pod has `metadata.deletionTimestamp` in the API. Stop its
    containers within `metadata.deletionGracePeriodSeconds` (fallback
    `spec.terminationGracePeriodSeconds`, then 30 s); the status manager then finishes
    the deletion in the API."""
    REMOVE = "REMOVE"
    """The pod is gone from its source (deleted from the API, manifest removed, or
    replaced by an edited static pod with a new UID): kill it and forget it."""
    RECONCILE = "RECONCILE"
    """Only `status` changed in the API (someone else wrote it): nothing to run,
    but the status manager may want to reconcile what it believes."""


@dataclasses.dataclass(frozen=True, slots=True)
class PodUpdate:
    """One batch from the merge. All pods share `op`; `source` is where they came from.

    Within one PodUpdate the pods are distinct UIDs. Updates for one UID arrive in the
    order they happened. An update is emitted only when a pod really changed
    (spec/metadata for UPDATE, status for RECONCILE): a touched file, a relist or an
    HTTP poll with nothing new produces no PodUpdate at all.
    """

    op: Op
    pods: tuple[Pod, ...]
    source: Source


def pod_uid(pod: Pod) -> str:
    return str(pod.get("metadata", {}).get("uid", ""))


def pod_full_name(pod: Pod) -> str:
    """`namespace/name`: unique across sources on one node (collisions are resolved by
    SOURCE_PRECEDENCE)."""
    meta = pod.get("metadata", {})
    return f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"


def pod_node_name(pod: Pod) -> str:
    """The node the pod belongs to (in virtual-node mode one process serves many)."""
    return str(pod.get("spec", {}).get("nodeName", ""))


# Annotations the kubelet puts on static and mirror pods; same meaning here.
ANN_CONFIG_HASH = "kubernetes.io/config.hash"      # static pod's content hash (== its UID)
ANN_CONFIG_SOURCE = "kubernetes.io/config.source"  # "file", "http" or "api"
ANN_CONFIG_SEEN = "kubernetes.io/config.seen"      # RFC 3339 time the agent first saw it
ANN_CONFIG_MIRROR = "kubernetes.io/config.mirror"  # on mirror pods: the static pod's hash


def is_mirror(pod: Pod) -> bool:
    return ANN_CONFIG_MIRROR in (pod.get("metadata", {}).get("annotations") or {})


def is_static(pod: Mapping[str, Any]) -> bool:
    src = (pod.get("metadata", {}).get("annotations") or {}).get(ANN_CONFIG_SOURCE)
    return src in (Source.FILE.value, Source.HTTP.value)


class SourcesReady:
    """Which configured sources have delivered their first full set.

    The merge marks a source when its first complete list arrives (API: the initial
    paginated list; file: the first folder scan; HTTP: the first good response). The
    sync loop must not kill pods it finds running in the runtime but not in any source
    ("orphans") until `all_ready()`: before that, absence proves nothing.
    """

    def __init__(self, configured: set[Source]) -> None:
        self.configured = frozenset(configured)
        self._seen: set[Source] = set()
        self._event = asyncio.Event()
        if not self.configured:
            self._event.set()

    def mark(self, source: Source) -> None:
        self._seen.add(source)
        if self.configured <= self._seen:
            self._event.set()

    def seen(self, source: Source) -> bool:
        return source in self._seen

    def all_ready(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


# The merge (nodeagent.pods.sources.merge.Merge) is what the sync loop consumes:
#   merge.updates: asyncio.Queue[PodUpdate]  -- every change, in order
#   merge.ready: SourcesReady                -- see above
#   merge.pods() -> list[Pod]                -- the current merged set (non-mirror)
#   merge.pod(uid) -> Pod | None
