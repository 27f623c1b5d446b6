"""In-memory indexes of Nodes, node Leases and NodeStatusPolicies, fed by the watch
handlers and read by the one monitor loop.

Only what the monitor needs is kept per object, so thousands of nodes stay cheap.
Lease freshness is judged by when *this process* saw a Lease's renewTime change (on
its monotonic clock), not by the timestamp itself: a node whose clock is off cannot
make itself look fresh or stale. What a new process cannot have seen is kept apart:
whether a node has been heard from since it first saw it (`LeaseInfo.renewed`,
`NodeInfo.posted`), and how old a Lease's renewTime looked then (`LeaseInfo.age`), so
the monitor can keep a node already marked unreachable so, and use the timestamp only
where a node's clock cannot hurt (see monitor.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

from nodeoperator import selector, taints
from nodeoperator.modes import OWNED_ANNOTATION, parse_owned

from nodeagent.api.clock import Clock
from nodeagent.api.kube import NODE_LEASE_NAMESPACE
from nodeagent.api.policy import HEARTBEAT_ANNOTATION, PolicyError, PolicySpec, parse_spec

LEASE_NAMESPACE = NODE_LEASE_NAMESPACE
UNREACHABLE_TAINT = taints.UNREACHABLE
# Conditions the agent posts that go Unknown together when it falls silent.
AGENT_CONDITIONS = ("Ready", "MemoryPressure", "DiskPressure", "PIDPressure")
# Conditions kept per node: those, and the ones that decide NoSchedule taints
# (NetworkUnavailable is the network plugin's: it never goes Unknown with the agent).
KEPT_CONDITIONS = frozenset(AGENT_CONDITIONS) | taints.CONDITIONS


@dataclasses.dataclass
class NodeInfo:
    name: str
    rv: str
    labels: dict[str, str]
    heartbeat: str | None  # the HEARTBEAT_ANNOTATION value
    taints: list[dict[str, Any]]
    conditions: dict[str, dict[str, Any]]  # KEPT_CONDITIONS present, by type
    first_seen: float  # monotonic; staleness starts here for a node with no Lease
    unschedulable: bool = False  # spec.unschedulable (cordoned)
    # monotonic: when this process saw the agent's Ready heartbeat (lastHeartbeatTime)
    # change, or first saw the Node. A status post is a sign of life as a renewal is.
    status_heard: float = 0.0
    uid: str = ""  # for Events about the node
    # the Ready lastHeartbeatTime changed since this process first saw the Node
    posted: bool = False
    # (key, effect) of the taints the operator added in coexist mode (OWNED_ANNOTATION)
    owned: frozenset[tuple[str, str]] = frozenset()


@dataclasses.dataclass
class LeaseInfo:
    name: str
    renew_time: str | None
    observed: float  # monotonic time this process saw renew_time change
    # renew_time changed since this process first saw the Lease, or the Lease was
    # created while we watched: the agent has been heard from by this process
    renewed: bool = False
    # at first sight: our wall clock minus renew_time, seconds (None: unknown)
    age: float | None = None


@dataclasses.dataclass
class PolicyInfo:
    name: str
    rv: str
    generation: int
    spec: PolicySpec | None  # None when invalid; `error` says why
    error: str | None
    status: dict[str, Any]
    uid: str = ""  # for Events about the policy


def parse_policy(body: Mapping[str, Any]) -> PolicyInfo:
    meta = body.get("metadata") or {}
    raw_spec = body.get("spec") or {}
    spec: PolicySpec | None = None
    error: str | None = None
    try:
        spec = parse_spec(raw_spec)
        selector.validate(spec.nodeSelector)
    except (PolicyError, TypeError) as e:
        spec, error = None, str(e)
    return PolicyInfo(name=meta.get("name", ""), rv=str(meta.get("resourceVersion", "")),
                      generation=int(meta.get("generation") or 0), spec=spec, error=error,
                      status=dict(body.get("status") or {}), uid=str(meta.get("uid") or ""))


class Store:
    """The indexes. Handlers call the *_event methods; the monitor reads the dicts."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.nodes: dict[str, NodeInfo] = {}
        self.leases: dict[str, LeaseInfo] = {}
        self.policies: dict[str, PolicyInfo] = {}
        self.stale: set[str] = set()  # maintained by the monitor: nodes it judged stale
        self.changed = asyncio.Event()  # wakes the monitor before its next period
        self.leases_listed = False  # a first full list of the Leases is in

    def node_event(self, kind: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        name = meta.get("name")
        if not name:
            return
        if kind == "DELETED":
            self.nodes.pop(name, None)
            self.changed.set()
            return
        old = self.nodes.get(name)
        annotations = meta.get("annotations") or {}
        conditions = {c["type"]: dict(c) for c in (body.get("status") or {}).get("conditions") or []
                      if c.get("type") in KEPT_CONDITIONS}
        info = NodeInfo(
            name=name, rv=str(meta.get("resourceVersion", "")),
            labels=dict(meta.get("labels") or {}),
            heartbeat=annotations.get(HEARTBEAT_ANNOTATION),
            taints=[dict(t) for t in (body.get("spec") or {}).get("taints") or []],
            conditions=conditions,
            first_seen=old.first_seen if old else self.clock.monotonic(),
            unschedulable=bool((body.get("spec") or {}).get("unschedulable")),
            uid=str(meta.get("uid") or ""),
            owned=parse_owned(annotations.get(OWNED_ANNOTATION)))
        beat = (conditions.get("Ready") or {}).get("lastHeartbeatTime")
        if old is None or beat != (old.conditions.get("Ready") or {}).get("lastHeartbeatTime"):
            info.status_heard = self.clock.monotonic()
            info.posted = old is not None
            if old is not None and name in self.stale:
                self.changed.set()  # a silent node posted: let it be judged at once
        else:
            info.status_heard = old.status_heard
            info.posted = old.posted
        self.nodes[name] = info
        # Labels decide the policy, conditions the NoSchedule taints (a Ready node
        # waits for no period to lose admission's not-ready); anything else is looked
        # at on the next period.
        if (old is None or old.labels != info.labels or old.heartbeat != info.heartbeat
                or taints.signature(old.conditions, old.unschedulable)
                != taints.signature(info.conditions, info.unschedulable)):
            self.changed.set()

    def lease_event(self, kind: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        name = meta.get("name")
        if not name or meta.get("namespace", LEASE_NAMESPACE) != LEASE_NAMESPACE:
            return
        if kind == "DELETED":
            self.leases.pop(name, None)
            return
        renew = (body.get("spec") or {}).get("renewTime")
        old = self.leases.get(name)
        if old is not None and old.renew_time == renew:
            return  # a relist or an unrelated field: not a renewal
        info = LeaseInfo(name=name, renew_time=renew, observed=self.clock.monotonic(),
                         renewed=old is not None or self.leases_listed)
        if old is None:
            seen = _parse_time(renew)
            if seen is not None:
                info.age = (self.clock.now() - seen).total_seconds()
        else:
            info.age = old.age
        self.leases[name] = info
        if name in self.stale:
            self.changed.set()  # a silent node is back: untaint it promptly

    def lease_sync(self, names: set[str]) -> None:
        """After a full list: forget Leases deleted while we were not watching."""
        for gone in set(self.leases) - names:
            del self.leases[gone]
        self.leases_listed = True

    def policy_event(self, kind: str | None, body: Mapping[str, Any]) -> None:
        name = (body.get("metadata") or {}).get("name")
        if not name:
            return
        if kind == "DELETED":
            self.policies.pop(name, None)
        else:
            self.policies[name] = parse_policy(body)
        self.changed.set()


def _parse_time(value: Any) -> dt.datetime | None:
    """A Lease's renewTime (MicroTime, RFC 3339); None if absent or unreadable."""
    if not isinstance(value, str) or not value:
        return None
    try:
        t = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)
