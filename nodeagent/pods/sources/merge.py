"""The merge: per-source pod state, diffed into ADD/UPDATE/DELETE/REMOVE/RECONCILE.

Sources push either a full set (`set`: the file and HTTP sources on every change, the
API source after a list) or single changes (`upsert`/`remove`: API watch events). The
merge compares with what that source delivered before and puts a PodUpdate on
`updates` only for real changes, so a relist or a rescan that finds nothing new emits
nothing.

Pods are keyed by `namespace/name`. When two sources deliver the same name, the one
first in SOURCE_PRECEDENCE (file, http, api) is delivered, the other is hidden and
reported (log, metric, Node Event); if the winner goes away, the hidden pod is
delivered. Mirror pods from the API source are not pods to run: they are kept in
`mirrors` for the mirror manager and never reach `updates`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from nodeagent.pods.podupdate import (
    ANN_CONFIG_MIRROR,
    ANN_CONFIG_SEEN,
    SOURCE_PRECEDENCE,
    Op,
    Pod,
    PodUpdate,
    Source,
    SourcesReady,
    is_mirror,
    pod_full_name,
    pod_uid,
)
from nodeagent.pods.sources import sourcemetrics
from nodeagent.pods.sources.problems import Problems

# Order in which one change's updates are emitted: a replaced pod is removed before
# its successor (same name, new UID) is added.
_EMIT_ORDER = (Op.REMOVE, Op.ADD, Op.UPDATE, Op.DELETE, Op.RECONCILE)
_META_KEYS = ("labels", "deletionTimestamp", "deletionGracePeriodSeconds")


def classify(old: Pod, new: Pod) -> Op | None:
    """What changed between two versions of the same pod (same UID), or None."""
    if old is new:
        return None
    om, nm = old.get("metadata", {}), new.get("metadata", {})
    if (old.get("spec") != new.get("spec")
            or any(om.get(k) != nm.get(k) for k in _META_KEYS)
            or _annotations(om) != _annotations(nm)):
        return Op.DELETE if nm.get("deletionTimestamp") else Op.UPDATE
    if old.get("status") != new.get("status"):
        return Op.RECONCILE
    return None


def _annotations(meta: dict) -> dict:
    ann = meta.get("annotations") or {}
    if ANN_CONFIG_SEEN in ann:
        ann = {k: v for k, v in ann.items() if k != ANN_CONFIG_SEEN}
    return ann


class Merge:
    def __init__(self, sources: Iterable[Source], problems: Problems | None = None) -> None:
        configured = set(sources)
        self.updates: asyncio.Queue[PodUpdate] = asyncio.Queue()
        self.ready = SourcesReady(configured)
        self.problems = problems or Problems()
        # Only sources in here may deliver; SOURCE_PRECEDENCE orders them.
        self._order = [s for s in SOURCE_PRECEDENCE if s in configured]
        self._state: dict[Source, dict[str, Pod]] = {s: {} for s in self._order}
        self._visible: dict[str, tuple[Source, Pod]] = {}
        self._by_uid: dict[str, Pod] = {}
        self.mirrors: dict[str, Pod] = {}
        self._listeners: list[asyncio.Event] = []
        self._conflicts: set[tuple[str, Source, str]] = set()

    # -- what the sync loop and the mirror manager read ---------------------------------

    def pods(self) -> list[Pod]:
        """The merged set: what should run on this node now (mirror pods excluded)."""
        return [pod for _, pod in self._visible.values()]

    def pod(self, uid: str) -> Pod | None:
        return self._by_uid.get(uid)

    def static_pods(self) -> dict[str, Pod]:
        """Delivered static pods (file and HTTP) by namespace/name."""
        return {name: pod for name, (src, pod) in self._visible.items()
                if src in (Source.FILE, Source.HTTP)}

    def listen(self) -> asyncio.Event:
        """An Event set whenever the static pods or the mirror pods change (the listener
        clears it before looking)."""
        ev = asyncio.Event()
        self._listeners.append(ev)
        return ev

    # -- what the sources call ----------------------------------------------------------

    def set(self, source: Source, pods: Iterable[Pod]) -> None:
        """`pods` is everything `source` has now; marks the source ready."""
        self._check(source)
        new: dict[str, Pod] = {}
        mirrors: dict[str, Pod] = {}
        for pod in pods:
            if source is Source.API and is_mirror(pod):
                mirrors[pod_full_name(pod)] = pod
            else:
                new[pod_full_name(pod)] = pod
        old = self._state[source]
        changes: dict[str, Pod | None] = {n: p for n, p in new.items() if old.get(n) is not p}
        changes.update({n: None for n in old if n not in new})
        if source is Source.API:
            self._set_mirrors(mirrors)
        self._apply(source, changes)
        if not self.ready.seen(source):
            self.ready.mark(source)
            self._notify()  # readiness changes what may be done (orphan mirror pods)

    def upsert(self, source: Source, pod: Pod) -> None:
        self._check(source)
        name = pod_full_name(pod)
        if source is Source.API and is_mirror(pod):
            if self.mirrors.get(name) is not pod:
                self.mirrors[name] = pod
                self._mirror_status(name, pod)
                self._notify()
            return
        self._apply(source, {name: pod})

    def remove(self, source: Source, pod: Pod) -> None:
        self._check(source)
        name = pod_full_name(pod)
        if source is Source.API and is_mirror(pod):
            gone = self.mirrors.get(name)
            if gone is not None and pod_uid(gone) == pod_uid(pod):
                del self.mirrors[name]
                self._notify()
            return
        current = self._state[source].get(name)
        if current is not None and pod_uid(current) == pod_uid(pod):
            self._apply(source, {name: None})

    # -- internals ----------------------------------------------------------------------

    def _check(self, source: Source) -> None:
        if source not in self._state:
            raise ValueError(f"source {source.value!r} is not configured in this merge")

    def _set_mirrors(self, mirrors: dict[str, Pod]) -> None:
        changed = [n for n, p in mirrors.items() if self.mirrors.get(n) is not p]
        if changed or mirrors.keys() != self.mirrors.keys():
            self.mirrors = mirrors
            for name in changed:
                self._mirror_status(name, mirrors[name])
            self._notify()

    def _mirror_status(self, name: str, mirror: Pod) -> None:
        """A mirror pod is the API's copy of its static pod: the status it holds goes to
        the sync loop as that static pod's RECONCILE, as an API pod's does. A new mirror
        holds none, so the static pod's status is written again, also when the last
        write landed on the mirror this one replaced."""
        visible = self._visible.get(name)
        if visible is None or visible[0] not in (Source.FILE, Source.HTTP):
            return
        source, static = visible
        ann = mirror.get("metadata", {}).get("annotations") or {}
        if ann.get(ANN_CONFIG_MIRROR) != pod_uid(static):  # a static pod's uid is its hash
            return
        sourcemetrics.UPDATES.labels(Op.RECONCILE.value, source.value).inc()
        self.updates.put_nowait(PodUpdate(Op.RECONCILE,
                                          ({**static, "status": mirror.get("status") or {}},),
                                          source))

    def _notify(self) -> None:
        for ev in self._listeners:
            ev.set()

    def _apply(self, source: Source, changes: dict[str, Pod | None]) -> None:
        if not changes:
            return
        state = self._state[source]
        for name, pod in changes.items():
            if pod is None:
                state.pop(name, None)
            else:
                state[name] = pod
        sourcemetrics.PODS.labels(source.value).set(len(state))
        out: dict[Op, dict[Source, list[Pod]]] = {op: {} for op in _EMIT_ORDER}
        static_changed = False
        for name in changes:
            before = self._visible.get(name)
            after = self._winner(name)
            if before is None and after is None:
                continue
            if before is not None and after is not None and before[1] is after[1]:
                continue
            static_changed = static_changed or any(
                x is not None and x[0] is not Source.API for x in (before, after))
            if after is None:
                del self._visible[name]
            else:
                self._visible[name] = after
            if before is not None and (after is None or pod_uid(before[1]) != pod_uid(after[1])):
                out[Op.REMOVE].setdefault(before[0], []).append(before[1])
                self._by_uid.pop(pod_uid(before[1]), None)
                before = None
            if after is not None:
                self._by_uid[pod_uid(after[1])] = after[1]
                op = Op.ADD if before is None else classify(before[1], after[1])
                if op is not None:
                    out[op].setdefault(after[0], []).append(after[1])
        for op in _EMIT_ORDER:
            for src, pods in out[op].items():
                sourcemetrics.UPDATES.labels(op.value, src.value).inc(len(pods))
                self.updates.put_nowait(PodUpdate(op, tuple(pods), src))
        if static_changed:
            self._notify()

    def _winner(self, name: str) -> tuple[Source, Pod] | None:
        candidates = [(s, self._state[s][name]) for s in self._order if name in self._state[s]]
        if not candidates:
            return None
        winner = candidates[0]
        for loser, pod in candidates[1:]:
            key = (name, loser, pod_uid(pod))
            if key not in self._conflicts:
                self._conflicts.add(key)
                sourcemetrics.NAME_CONFLICTS.labels(winner[0].value, loser.value).inc()
                self.problems.report(
                    loser, "NameConflict",
                    f"pod {name} from the {loser.value} source is not run: the "
                    f"{winner[0].value} source has a pod of the same name, and "
                    f"{winner[0].value} takes precedence")
        return winner
