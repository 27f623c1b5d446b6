"""The one monitor loop: every period (or sooner when a node, policy or a silent node's
Lease changes) it resolves each Node's policy, judges Lease freshness, and writes what
differs from what the indexes show: the heartbeat annotation, the unreachable taints,
Ready=Unknown, and each policy's status. Nothing is written when nothing changed.

NoExecute taints are paced per policy by a token bucket, and stop for a policy whose
share of stale nodes is above its maxUnreachableFraction (the partition guard): when
that many nodes fall silent together the likelier cause is the network, not the nodes.

A period only decides: its writes run in the background, at most `parallel` at a time
(limiter.py, the most urgent first), so writes for different nodes never wait for each
other, nor for a period to end, and a node with a write under way is not planned again
until the write is done and the watch shows it.

In coexist mode (lifecycle.py) the controller manager's node-lifecycle controller runs
too: the operator marks only the nodes of policies stricter than it, writes Ready=Unknown
before its NoExecute taint (that controller takes unreachable:NoExecute off any node
whose Ready is True), leaves the NoSchedule condition taints to it, and removes only
the taints it recorded as its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

from nodeoperator import selector, taints
from nodeoperator.limiter import Limiter
from nodeoperator.modes import OVERRIDDEN, OWNED_ANNOTATION, Lifecycle, encode_owned
from nodeoperator.nodeevents import NodeEvent, NodeEvents
from nodeoperator.resolve import Resolution, resolve
from nodeoperator.state import AGENT_CONDITIONS, UNREACHABLE_TAINT, NodeInfo, PolicyInfo, Store
from prometheus_client import Counter, Gauge, Histogram

from nodeagent.api.client import status_of
from nodeagent.api.clock import Clock
from nodeagent.api.policy import (
    GROUP,
    HEARTBEAT_ANNOTATION,
    KIND,
    VERSION,
    Failure,
    Heartbeat,
    PolicySpec,
    encode_heartbeat_annotation,
)

log = logging.getLogger("nodeoperator.monitor")

REASON = "NodeStatusUnknown"
DEFAULT_GROUP = ""  # nodes no policy matches
# The guard needs at least this many stale nodes, as the controller manager's zone
# states do: one or two silent nodes say nothing about a partition, and without it
# a one- or two-node pool could never have its pods evicted.
GUARD_MIN_STALE = 3
# A period runs this long after a node's grace runs out (the verdict needs strictly
# more silence than the grace), and, whatever wakes it, never sooner than MIN_GAP after
# the last one began: nodes that fall silent together, and a burst of Node updates (the
# watch showing a mass marking), are decided in one period, not one each, which bounds
# the monitor's CPU when writes no longer pace its periods.
EXPIRY_SLACK = 0.05
MIN_GAP = 0.2

WRITES = Counter("nodepulse_operator_writes_total", "API writes by the operator",
                 ["kind", "result"])
STALE = Gauge("nodepulse_operator_stale_nodes", "Nodes whose Lease is past their grace period")
TAINT_DELAY = Histogram("nodepulse_operator_taint_delay_seconds",
                        "From a node's grace expiry to the API server's answer to its "
                        "unreachable taint write",
                        buckets=(0.5, 1, 2, 3, 4, 5, 7.5, 10, 15, 20, 30, 60))
MODE = Gauge("nodepulse_operator_node_lifecycle_info",
             "The operator's node lifecycle mode (1 for the one in use)", ["mode"])
CLUSTER_GRACE = Gauge("nodepulse_operator_cluster_grace_period_seconds",
                      "The controller manager's node grace period the operator assumes "
                      "(coexist mode)")
POLICY_NODES = Gauge("nodepulse_operator_policy_nodes",
                     "Nodes each valid policy governs, by state: governed (all of them), "
                     "ready (heard from within the grace), unreachable (the status's "
                     "nodes, readyNodes and unreachableNodes)", ["policy", "state"])
POLICY_GUARD = Gauge("nodepulse_operator_policy_partition_guard",
                     "1 while a policy's partition guard withholds NoExecute taints",
                     ["policy"])
TICK = Histogram("nodepulse_operator_monitor_tick_seconds",
                 "One monitor period's deciding (its writes run after it, in the background)",
                 buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))


class Writer(Protocol):
    """API writes; each returns the object's new resourceVersion."""

    async def patch_node(self, name: str, patch: dict[str, Any]) -> str: ...

    async def patch_node_status(self, name: str, patch: dict[str, Any]) -> str: ...

    async def patch_policy_status(self, name: str, patch: dict[str, Any]) -> str: ...


class Pacer:
    """A token bucket per policy: at most `per_minute` NoExecute taints. It holds one
    monitor period's worth (at least one), so a high rate is not capped by the period."""

    def __init__(self, clock: Clock, window: float = 2.0) -> None:
        self.clock, self.window = clock, window
        self._tokens: dict[str, tuple[float, float]] = {}  # group -> (tokens, at)

    def take(self, group: str, per_minute: float) -> bool:
        if per_minute <= 0:
            return False
        now = self.clock.monotonic()
        cap = max(1.0, per_minute / 60.0 * self.window)
        tokens, at = self._tokens.get(group, (cap, now))
        tokens = min(cap, tokens + (now - at) * per_minute / 60.0)
        ok = tokens >= 1.0
        self._tokens[group] = (tokens - 1.0 if ok else tokens, now)
        return ok

    def refund(self, group: str) -> None:
        """Give back a token whose taint could not be written."""
        tokens, at = self._tokens.get(group, (0.0, self.clock.monotonic()))
        self._tokens[group] = (tokens + 1.0, at)


@dataclasses.dataclass
class NodeAction:
    name: str
    base_rv: str
    node_patch: dict[str, Any] | None = None  # annotation and/or taints
    status_patch: dict[str, Any] | None = None  # conditions -> Unknown
    taint_delay: float | None = None  # seconds past grace expiry when planned, a new taint
    over: float | None = None  # a stale node's seconds past grace expiry when planned
    heard: float = 0.0  # monotonic: the last sign of life of the node, as planned
    planned: float = 0.0  # monotonic
    granted: str | None = None  # the policy whose NoExecute token this action spends
    status_first: bool = False  # write the status before the node (coexist mode)
    events: list[NodeEvent] = dataclasses.field(default_factory=list)  # after node_patch
    status_events: list[NodeEvent] = dataclasses.field(default_factory=list)  # after status

    @property
    def priority(self) -> tuple[float, ...]:
        """Marking a stale node goes first, the longest overdue first; then the node's
        other writes (a taint off a node heard from again, annotations)."""
        return (0, -self.over) if self.over is not None else (1,)

    @property
    def second_priority(self) -> tuple[float, ...]:
        """A marking's second write (Ready=Unknown after the taint; the taint after it in
        coexist mode) waits for every marking's first: when hundreds of nodes fall
        silent together, all are tainted before any is written twice."""
        return (0.5, -self.over) if self.over is not None else (1,)


@dataclasses.dataclass
class GroupState:
    failure: Failure
    annotation: str  # the heartbeat annotation its nodes get
    acts: bool = True  # the operator marks these nodes (always, but in coexist mode)
    grace: float = 50.0  # after how long a silent node is marked (by us or the cluster)
    matched: int = 0
    stale: int = 0

    @classmethod
    def of(cls, policy: str | None, spec: PolicySpec | None, lifecycle: Lifecycle
           ) -> GroupState:
        """The group of a valid policy, or (None, None) of the nodes no policy matches."""
        failure = spec.failure if spec else Failure()
        heartbeat = spec.heartbeat if spec else Heartbeat()
        return cls(failure, encode_heartbeat_annotation(policy, heartbeat),
                   lifecycle.acts(failure), lifecycle.grace(failure))

    @property
    def guarded(self) -> bool:
        return (self.stale >= GUARD_MIN_STALE
                and self.stale / self.matched > self.failure.maxUnreachableFraction)


@dataclasses.dataclass
class Plan:
    nodes: list[NodeAction]
    policies: dict[str, dict[str, Any]]  # policy -> status to write
    groups: dict[str, GroupState]
    resolution: Resolution
    events: list[NodeEvent] = dataclasses.field(default_factory=list)  # partition guard
    # policy -> Events to post once its status is written (Effective turned False)
    policy_events: dict[str, list[NodeEvent]] = dataclasses.field(default_factory=dict)


class Monitor:
    def __init__(self, store: Store, clock: Clock, writer: Writer, *,
                 period: float = 2.0, is_leader: Callable[[], bool] = lambda: True,
                 api_ok_since: Callable[[], float | None] = lambda: -math.inf,
                 parallel: int = 32, events: NodeEvents | None = None,
                 synced: Sequence[asyncio.Event] = (),
                 lifecycle: Lifecycle | None = None) -> None:
        """`synced`: set once each watch's first list is in the Store; no period runs
        before (a partial view would write defaults over policies, and back)."""
        self.store, self.clock, self.writer = store, clock, writer
        self.lifecycle = lifecycle or Lifecycle()
        for mode in ("exclusive", "coexist"):
            MODE.labels(mode).set(1 if mode == self.lifecycle.mode else 0)
        CLUSTER_GRACE.set(self.lifecycle.cluster_grace)
        self.synced = tuple(synced)
        self.events = events
        self.period = period
        self.is_leader = is_leader
        self.api_ok_since = api_ok_since
        self.pacer = Pacer(clock, period)
        self.next_stale: float | None = None  # from the last plan; see _timeout
        self._last_start = -math.inf  # monotonic, when the last period began
        self._slots = Limiter(parallel)
        # node -> what its action was worked out from, when it needed no write
        self._quiet: dict[str, tuple[Any, ...]] = {}
        self._exported_policies: set[str] = set()  # policies with metric series
        # "node/<name>" or "policy/<name>" -> its write under way
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._marking = 0  # of those, stale nodes' markings
        self.marked = asyncio.Event()  # set while no marking is under way (Events wait)
        self.marked.set()
        # object key -> resourceVersions our last write went through; until the
        # index shows a newer one, a difference is only our write not seen yet.
        self._written: dict[str, set[str]] = {}
        self.was_leader = False
        # policy group -> nodes told that its partition guard withholds their NoExecute
        self._guard_told: dict[str, set[str]] = {}

    # ---- the loop
    async def run(self) -> None:
        for ev in self.synced:
            await ev.wait()
        try:
            while True:
                await self._wait()
                leading = self.is_leader()
                if leading and not self.was_leader:
                    log.info("leading: taking over the monitor")
                    self._written.clear()
                    self._quiet.clear()
                    self._guard_told.clear()
                self.was_leader = leading
                if not leading:
                    continue
                try:
                    self.start_period()
                except Exception:  # one bad period must not stop the monitor
                    log.exception("monitor period failed")
        finally:
            for task in list(self._inflight.values()):
                task.cancel()

    async def _wait(self) -> None:
        if not self.store.changed.is_set():
            sleeper = asyncio.ensure_future(self.clock.sleep(self._timeout()))
            waker = asyncio.ensure_future(self.store.changed.wait())
            try:
                await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                waker.cancel()
        rest = self._last_start + MIN_GAP - self.clock.monotonic()
        if rest > 0:
            await self.clock.sleep(rest)
        self.store.changed.clear()

    def _timeout(self) -> float:
        """The period, or less when a node's grace runs out sooner: then the period
        runs just after (by EXPIRY_SLACK, which also gathers nodes expiring together),
        so a taint does not wait up to a whole period."""
        if self.next_stale is None or not self.was_leader:
            return self.period
        return min(self.period, max(self.next_stale - self.clock.monotonic() + EXPIRY_SLACK,
                                    0.0))

    def start_period(self) -> Plan:
        """Decide, and start the writes (they run in the background)."""
        started = self._last_start = self.clock.monotonic()
        plan = self.plan()
        for ev in plan.events:
            self._post(ev)
        for a in plan.nodes:
            self._start("node/" + a.name, self._apply_node(a), marking=a.over is not None)
        for name, status in plan.policies.items():
            self._start("policy/" + name,
                        self._apply_policy(name, status, plan.policy_events.get(name, [])))
        TICK.observe(max(0.0, self.clock.monotonic() - started))
        return plan

    async def tick(self) -> Plan:
        """A period, and then its writes awaited (tests, and anyone who must know the
        writes are done)."""
        plan = self.start_period()
        await self.drain()
        return plan

    async def drain(self) -> None:
        """Wait for the writes under way."""
        while self._inflight:
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)

    def _start(self, key: str, write: Coroutine[Any, Any, None], marking: bool = False
               ) -> None:
        task = asyncio.get_running_loop().create_task(write)
        self._inflight[key] = task
        if marking:
            self._marking += 1
            self.marked.clear()

        def done(_: asyncio.Task[None]) -> None:
            if self._inflight.get(key) is task:
                del self._inflight[key]
            if marking:
                self._marking -= 1
                if not self._marking:
                    self.marked.set()
        task.add_done_callback(done)

    def heard(self, name: str) -> float:
        """When this process last heard from a node: its Lease renewed or its agent's
        status post (our Unknown write keeps the lastHeartbeatTime, so it does not
        count), monotonic."""
        node, lease = self.store.nodes.get(name), self.store.leases.get(name)
        status = node.status_heard if node else -math.inf
        return max(lease.observed, status) if lease else status

    # ---- deciding
    def plan(self) -> Plan:
        store, now = self.store, self.clock.monotonic()
        policies = store.policies
        res = resolve(policies.values(), {n: i.labels for n, i in store.nodes.items()})
        groups = {DEFAULT_GROUP: GroupState.of(None, None, self.lifecycle)}
        for p in policies.values():
            if p.spec is not None:
                groups[p.name] = GroupState.of(p.name, p.spec, self.lifecycle)

        # Staleness first, so each group's stale share is known before any NoExecute.
        # Silence is counted from when we could hear again at the earliest: after an
        # API server outage, renewals that could not be made are nobody's fault.
        # None: our API calls are failing right now, so no silence counts.
        floor = self.api_ok_since()
        if floor is None:
            floor = now
        stale: dict[str, float] = {}  # node -> seconds past grace expiry
        next_stale = math.inf  # the earliest moment another node may turn stale
        for name, node in store.nodes.items():
            pname = res.effective[name]
            group = groups[pname or DEFAULT_GROUP]
            group.matched += 1
            lease = store.leases.get(name)
            # The agent's own status post counts as renewal does: a node that posts
            # Ready before its Lease renewal reaches us is not marked Unknown over it.
            heard = self.heard(name)
            silent = now - heard
            heard_since = node.posted or (lease is not None and lease.renewed)
            grace = group.grace
            due = heard + grace  # when it turns stale if nothing is heard meanwhile
            if not heard_since and lease is not None and lease.age is not None:
                # Not heard from since we first saw it: until then, our own clock only
                # says how long *we* have watched. Once we have watched for a whole
                # lease duration without a renewal (a live agent renews within it,
                # whatever its clock says), the renewTime tells how long before that it
                # went quiet. A node clock behind ours makes that look longer, so it
                # can bring a dead node's verdict forward, never a live one's.
                spec = policies[pname].spec if pname else None
                duration = (spec.heartbeat if spec else Heartbeat()).leaseDurationSeconds
                age = max(0.0, lease.age)
                if silent >= duration:
                    silent += age
                due = heard + min(grace, max(duration, grace - age))
            over = silent - grace
            marked = _has_taint(node, "NoSchedule")
            # The floor only holds back *new* verdicts: a node already marked
            # unreachable stays so until it renews, outage or not. So does one our
            # predecessor marked (tainted, Ready=Unknown) before we first saw it, until
            # we hear from it: a new process must not lift a verdict it cannot judge.
            verdict = marked and (node.conditions.get("Ready") or {}).get("status") == "Unknown"
            if (over > 0 and (now - floor > grace or marked)) or (verdict and not heard_since):
                stale[name] = max(over, 0.0)
                group.stale += 1
            elif group.acts:  # the others are the controller manager's to mark
                next_stale = min(next_stale, due if marked else max(due, floor + grace))
        store.stale = set(stale)
        self.next_stale = next_stale if next_stale < math.inf else None
        STALE.set(len(stale))
        self._export_policies(groups)

        # Nodes with a write under way, or whose last write the index does not show
        # yet, are left alone this time.
        pending = {name for name, node in store.nodes.items()
                   if node.rv in self._written.get("node/" + name, ())
                   or "node/" + name in self._inflight}
        for key in [k for k in self._written if k.startswith("node/")]:
            if key[5:] not in store.nodes:
                del self._written[key]

        # Longest silent first, so pacing serves nodes in the order they went quiet.
        grants: set[str] = set()
        for name in sorted(stale, key=lambda n: (-stale[n], n)):
            if name in pending:
                continue
            g = res.effective[name] or DEFAULT_GROUP
            group = groups[g]
            node = store.nodes[name]
            # In coexist mode a NoExecute of ours that someone removed (the controller
            # manager stops evictions when a whole zone is down) is not put back.
            if (group.acts and group.failure.taintUnreachable and not group.guarded
                    and not _has_taint(node, "NoExecute")
                    and (UNREACHABLE_TAINT, "NoExecute") not in node.owned
                    and self.pacer.take(g, group.failure.noExecuteTaintsPerMinute)):
                grants.add(name)

        actions = []
        # What a node needs follows from these alone: one that needed nothing is not
        # worked out again until one of them changes (most nodes, most periods; a
        # marked node stays so while it is silent).
        quiet: dict[str, tuple[Any, ...]] = {}
        for name, node in store.nodes.items():
            if name in pending:
                continue
            pname = res.effective[name]
            group = groups[pname or DEFAULT_GROUP]
            late = stale.get(name) if group.acts else None
            inputs = (node.rv, group.annotation, group.acts, group.failure.taintUnreachable,
                      late is not None, name in grants)
            if self._quiet.get(name) == inputs:
                quiet[name] = inputs
                continue
            if self.lifecycle.exclusive:
                action = self._node_action(node, pname, group, late, name in grants)
            else:
                action = self._coexist_action(node, pname, group, late, name in grants)
            if action.node_patch or action.status_patch:
                action.over, action.planned = late, now
                action.heard = self.heard(name)
                actions.append(action)
            else:
                quiet[name] = inputs
        self._quiet = quiet

        statuses, policy_events = {}, {}
        for key in [k for k in self._written if k.startswith("policy/")]:
            if key[7:] not in policies:
                del self._written[key]
        for p in policies.values():
            if (p.rv in self._written.get("policy/" + p.name, ())
                    or "policy/" + p.name in self._inflight):
                continue
            status = self._policy_status(p, res, groups.get(p.name), stale)
            if _status_differs(p.status, status):
                statuses[p.name] = status
                policy_events[p.name] = _overridden_events(p, status)
        return Plan(actions, statuses, groups, res, self._guard_events(res, groups, stale),
                    policy_events)

    def _export_policies(self, groups: Mapping[str, GroupState]) -> None:
        """Each valid policy's node counts and guard as metrics; a policy gone or
        turned invalid since the last period loses its series."""
        for name in self._exported_policies - groups.keys():
            for state in ("governed", "ready", "unreachable"):
                POLICY_NODES.remove(name, state)
            POLICY_GUARD.remove(name)
        self._exported_policies = {n for n in groups if n != DEFAULT_GROUP}
        for name in self._exported_policies:
            g = groups[name]
            POLICY_NODES.labels(name, "governed").set(g.matched)
            POLICY_NODES.labels(name, "ready").set(g.matched - g.stale)
            POLICY_NODES.labels(name, "unreachable").set(g.stale)
            POLICY_GUARD.labels(name).set(1 if g.acts and g.guarded else 0)

    def _guard_events(self, res: Resolution, groups: Mapping[str, GroupState],
                      stale: Mapping[str, float]) -> list[NodeEvent]:
        """Once per trip, each stale node whose NoExecute the guard withholds is told;
        when the guard lifts, the nodes told are told so."""
        out = []
        for g, group in groups.items():
            told = self._guard_told.get(g)
            whose = f"policy {g}" if g else "the default policy"
            share = (f"{group.stale} of {group.matched} node(s) unreachable, "
                     f"{{}} maxUnreachableFraction {group.failure.maxUnreachableFraction:g}")
            if group.guarded and group.failure.taintUnreachable and group.acts:
                told = self._guard_told.setdefault(g, set())
                for name in sorted(stale):
                    node = self.store.nodes[name]
                    if ((res.effective[name] or DEFAULT_GROUP) != g or name in told
                            or _has_taint(node, "NoExecute")):
                        continue
                    told.add(name)
                    out.append(NodeEvent(
                        name, node.uid, "Warning", "PartitionGuardTripped",
                        f"NoExecute tainting is stopped for {whose}: "
                        f"{share.format('more than')}; this node's pods are not evicted."))
            elif told is not None:
                del self._guard_told[g]
                for name in sorted(told):
                    node = self.store.nodes.get(name)
                    if node is not None:
                        out.append(NodeEvent(
                            name, node.uid, "Normal", "PartitionGuardLifted",
                            f"NoExecute tainting resumed for {whose}: "
                            f"{share.format('within')}."))
        for g in [g for g in self._guard_told if g not in groups]:
            del self._guard_told[g]  # the policy is gone
        return out

    @staticmethod
    def _heartbeat_patch(node: NodeInfo, group: GroupState) -> dict[str, Any]:
        """The annotation the agent follows, when it is not what the policy says."""
        if node.heartbeat == group.annotation:
            return {}
        return {"metadata": {"annotations": {HEARTBEAT_ANNOTATION: group.annotation}}}

    def _node_action(self, node: NodeInfo, policy: str | None, group: GroupState,
                     over: float | None, grant: bool) -> NodeAction:
        """Exclusive mode: the unreachable and condition taints are all ours."""
        action = NodeAction(node.name, node.rv)
        patch = self._heartbeat_patch(node, group)

        # Unreachable follows the Lease verdict: NoSchedule while stale, NoExecute
        # (paced, guarded) once granted and kept until the Lease is renewed.
        unreachable: dict[str, dict[str, Any]] = {}
        if over is not None:
            unreachable["NoSchedule"] = {"key": UNREACHABLE_TAINT, "effect": "NoSchedule"}
            existing = _find_taint(node, "NoExecute")
            if group.failure.taintUnreachable and (existing or grant):
                unreachable["NoExecute"] = {"key": UNREACHABLE_TAINT, "effect": "NoExecute",
                                            "timeAdded": _rfc3339(self.clock)}
                if not existing:
                    action.granted = policy or DEFAULT_GROUP
        # The other NoSchedule taints follow the conditions; a stale node's are the
        # Unknown ones this action writes, so it gets unreachable, never not-ready.
        by_condition = taints.wanted(
            _unknown(node.conditions) if over is not None else node.conditions,
            node.unschedulable,
            {t.get("key") for t in node.taints if t.get("effect") == "NoSchedule"})
        by_condition.discard(UNREACHABLE_TAINT)
        new_taints = _merge(node.taints, unreachable, by_condition)
        if new_taints != node.taints:
            action.events = _taint_events(node, new_taints, over is not None)
            _set_taints(patch, node, new_taints)
            if node.owned:  # a coexist-mode record: here every such taint is ours
                _annotate(patch, OWNED_ANNOTATION, None)
            if over is not None and not _has_taint(node, "NoSchedule"):
                action.taint_delay = over
        action.node_patch = patch or None
        if over is not None:
            self._mark_unknown(action, node, policy, group)
        return action

    def _coexist_action(self, node: NodeInfo, policy: str | None, group: GroupState,
                        over: float | None, grant: bool) -> NodeAction:
        """Coexist mode: Ready=Unknown and a NoExecute of ours for the nodes of the
        policies stricter than the controller manager (`over` is set only for those);
        the NoSchedule condition taints are the controller manager's. The status goes
        first: that controller takes unreachable:NoExecute off a node whose Ready is
        True. Our taints are recorded in OWNED_ANNOTATION, in the same write, and come
        off when the agent reports Ready=True again (while Ready is Unknown the
        controller manager would put a NoExecute straight back)."""
        action = NodeAction(node.name, node.rv, status_first=True)
        patch = self._heartbeat_patch(node, group)
        owned, new_taints = set(node.owned), list(node.taints)
        ready = (node.conditions.get("Ready") or {}).get("status")
        if over is not None:
            self._mark_unknown(action, node, policy, group)
            if grant:
                new_taints.append({"key": UNREACHABLE_TAINT, "effect": "NoExecute",
                                   "timeAdded": _rfc3339(self.clock)})
                owned.add((UNREACHABLE_TAINT, "NoExecute"))
                action.granted = policy or DEFAULT_GROUP
                action.taint_delay = over
        elif owned and ready == "True":
            new_taints = [t for t in node.taints
                          if (t.get("key"), t.get("effect")) not in owned]
            owned.clear()
        elif owned and ready != "Unknown" and not any(
                (t.get("key"), t.get("effect")) in owned for t in node.taints):
            owned.clear()  # taken off by someone else (e.g. swapped for not-ready)
        if new_taints != node.taints:
            action.events = _taint_events(node, new_taints, over is not None)
            _set_taints(patch, node, new_taints)
        if owned != node.owned:
            _annotate(patch, OWNED_ANNOTATION, encode_owned(owned))
        action.node_patch = patch or None
        return action

    def _mark_unknown(self, action: NodeAction, node: NodeInfo, policy: str | None,
                      group: GroupState) -> None:
        """The status part of a stale node's action: its conditions to Unknown (those
        not Unknown already: what someone else marked is not written over)."""
        conditions = self._unknown_conditions(node, policy, group)
        if conditions:
            action.status_patch = {"status": {"conditions": conditions}}
            if any(c["type"] == "Ready" for c in conditions):
                why = conditions[0]["message"].removeprefix("nodepulse-operator: ")
                action.status_events.append(NodeEvent(
                    node.name, node.uid, "Warning", REASON, f"Set Ready to Unknown: {why}"))

    def _unknown_conditions(self, node: NodeInfo, policy: str | None,
                            group: GroupState) -> list[dict[str, Any]]:
        now = _rfc3339(self.clock)
        grace = group.failure.gracePeriodSeconds
        whose = f"policy {policy}" if policy else "the default policy"
        if node.name in self.store.leases:
            message = (f"nodepulse-operator: the node's Lease has not been renewed for more "
                       f"than {grace}s (grace period of {whose}); its agent is down or cannot "
                       "reach the API server.")
        else:
            message = (f"nodepulse-operator: the node has had no Lease in kube-node-lease for "
                       f"more than {grace}s (grace period of {whose}); its agent never "
                       "started heartbeating.")
        out = []
        for ctype in AGENT_CONDITIONS:
            old = node.conditions.get(ctype)
            if ctype != "Ready" and old is None:
                continue  # only Ready is added when the agent never posted any
            if old is not None and old.get("status") == "Unknown":
                continue
            cond = {"type": ctype, "status": "Unknown", "reason": REASON,
                    "message": message, "lastTransitionTime": now}
            if old is not None and old.get("lastHeartbeatTime"):
                cond["lastHeartbeatTime"] = old["lastHeartbeatTime"]
            out.append(cond)
        return out

    def _policy_status(self, p: PolicyInfo, res: Resolution, group: GroupState | None,
                       stale: Mapping[str, float]) -> dict[str, Any]:
        old = {c.get("type"): c for c in p.status.get("conditions") or []}
        now = _rfc3339(self.clock)

        def cond(ctype: str, status: str, reason: str, message: str) -> dict[str, Any]:
            prev = old.get(ctype) or {}
            since = prev.get("lastTransitionTime") if prev.get("status") == status else None
            return {"type": ctype, "status": status, "reason": reason, "message": message,
                    "lastTransitionTime": since or now}

        status: dict[str, Any] = {"observedGeneration": p.generation,
                                  "nodeLifecycle": self.lifecycle.mode}
        if p.spec is None or group is None:
            status.update(selector="<invalid>", nodes=0, readyNodes=0, unreachableNodes=0)
            status["conditions"] = [
                cond("Ready", "False", "InvalidSpec", p.error or "invalid spec"),
                cond("Conflict", "False", "InvalidSpec", "the policy governs no node"),
                cond("PartitionGuard", "False", "InvalidSpec", "the policy governs no node"),
                cond("Effective", "False", "InvalidSpec", "the policy governs no node")]
            return status
        status.update(selector=selector.describe(p.spec.nodeSelector), nodes=group.matched,
                      readyNodes=group.matched - group.stale, unreachableNodes=group.stale)
        if group.matched:
            ready = cond("Ready", "True", "Resolved",
                         f"governs {group.matched} node(s); {group.stale} unreachable")
        else:
            ready = cond("Ready", "True", "NoMatchingNodes",
                         "valid, but no node is governed by this policy: its selector matches "
                         "none, or only nodes a higher-priority policy claims")
        conflicts = res.conflicts_of(p.name)
        if conflicts:
            parts = [f"{', '.join(c.policies)} (priority {p.spec.priority}) all match "
                     f"{len(c.nodes)} node(s), e.g. {c.nodes[0]}; {c.policies[0]} applies "
                     "as the first by name" for c in conflicts]
            conflict = cond("Conflict", "True", "EqualPriority", "; ".join(parts))
        else:
            conflict = cond("Conflict", "False", "NoConflict",
                            "no other policy of the same priority matches these nodes")
        f = p.spec.failure
        if not group.acts:
            guard = cond("PartitionGuard", "False", "LeftToControllerManager",
                         f"{group.stale} of {group.matched} node(s) unreachable; the controller "
                         "manager marks this policy's silent nodes and evicts their pods by its "
                         "own zone rules (node lifecycle mode coexist)")
        elif group.guarded:
            guard = cond("PartitionGuard", "True", "TooManyUnreachable",
                         f"{group.stale} of {group.matched} node(s) unreachable, more than "
                         f"maxUnreachableFraction {f.maxUnreachableFraction:g}: NoExecute "
                         "tainting is stopped for this policy")
        else:
            guard = cond("PartitionGuard", "False", "WithinLimit",
                         f"{group.stale} of {group.matched} node(s) unreachable, within "
                         f"maxUnreachableFraction {f.maxUnreachableFraction:g}")
        effective = cond("Effective", *self.lifecycle.effective(p.spec))
        status["conditions"] = [ready, conflict, guard, effective]
        return status

    # ---- writing
    def _outdated(self, a: NodeAction) -> bool:
        """Whether a write that waited for its slot was overtaken: the index shows a
        newer Node (the write would be refused, or decided on an old view), or a stale
        node was heard from meanwhile. The next period decides again."""
        node = self.store.nodes.get(a.name)
        if node is None:
            return True
        changed = node.rv != a.base_rv and node.rv not in self._written.get("node/" + a.name,
                                                                            ())
        return changed or (a.over is not None and self.heard(a.name) > a.heard)

    async def _apply_node(self, a: NodeAction) -> None:
        seen = [a.base_rv]
        posts: list[NodeEvent] = []  # the Events of the writes that went through
        node_written = False
        order = ("status", "node") if a.status_first else ("node", "status")
        parts = [p for p in order if (a.node_patch if p == "node" else a.status_patch)]
        try:
            # each write takes its own turn (see NodeAction.second_priority)
            for turn, part in enumerate(parts):
                async with self._slots.slot(a.priority if turn == 0 else a.second_priority):
                    if turn == 0 and self._outdated(a):
                        if a.granted is not None:
                            self.pacer.refund(a.granted)
                        WRITES.labels("node", "overtaken").inc()
                        self.store.changed.set()  # decided again at once
                        return
                    if not self.is_leader():
                        break
                    if part == "node":
                        assert a.node_patch is not None
                        patch = a.node_patch
                        if "resourceVersion" in patch["metadata"]:  # on top of our last
                            patch = {**patch, "metadata": {**patch["metadata"],
                                                           "resourceVersion": seen[-1]}}
                        seen.append(await self.writer.patch_node(a.name, patch))
                        node_written = True
                        WRITES.labels("node", "ok").inc()
                        posts += a.events
                        if a.taint_delay is not None:
                            TAINT_DELAY.observe(a.taint_delay + self.clock.monotonic()
                                                - a.planned)
                    else:
                        # Only on top of the version judged stale (or our own write on
                        # it): a status the agent posted meanwhile is not overwritten.
                        body = {**(a.status_patch or {}),
                                "metadata": {"resourceVersion": seen[-1]}}
                        seen.append(await self.writer.patch_node_status(a.name, body))
                        WRITES.labels("node_status", "ok").inc()
                        posts += a.status_events
        except Exception as e:
            if a.granted is not None and not node_written:
                self.pacer.refund(a.granted)
            _count_failure("node", e, a.name)
        # The last version we produced is what the index should settle on; the
        # versions before it (the one we read, and our first write's) need no
        # second look. Nothing written (or a first write refused): look again.
        if len(seen) > 1:
            self._written["node/" + a.name] = set(seen[:-1])
        else:
            self._written.pop("node/" + a.name, None)
        for ev in posts:
            self._post(ev)

    def _post(self, ev: NodeEvent) -> None:
        """In the background: Events never hold up a write or the next period."""
        if self.events is not None and self.is_leader():
            self.events.emit(ev)

    async def _apply_policy(self, name: str, status: dict[str, Any],
                            events: Sequence[NodeEvent] = ()) -> None:
        base = self.store.policies[name].rv
        async with self._slots.slot((2,)):  # after the nodes' writes
            if not self.is_leader():
                return
            try:
                await self.writer.patch_policy_status(name, {"status": status})
                WRITES.labels("policy_status", "ok").inc()
            except Exception as e:
                self._written.pop("policy/" + name, None)
                _count_failure("policy_status", e, name)
                return
        self._written["policy/" + name] = {base}
        for ev in events:
            self._post(ev)


def _overridden_events(p: PolicyInfo, status: Mapping[str, Any]) -> list[NodeEvent]:
    """A Warning Event on the policy when what the controller manager overrides of it
    changes (its Effective condition turns False, or says something new)."""
    def effective(s: Mapping[str, Any]) -> dict[str, Any]:
        return next((c for c in s.get("conditions") or [] if c.get("type") == "Effective"), {})

    new, old = effective(status), effective(p.status)
    if new.get("reason") != OVERRIDDEN or (
            old.get("reason") == OVERRIDDEN and old.get("message") == new.get("message")):
        return []
    return [NodeEvent(p.name, p.uid, "Warning", OVERRIDDEN, new["message"], kind=KIND,
                      api_version=f"{GROUP}/{VERSION}")]


def _set_taints(patch: dict[str, Any], node: NodeInfo, new: list[dict[str, Any]]) -> None:
    # The taint list is replaced whole, so only on top of the version we read.
    patch.setdefault("metadata", {})["resourceVersion"] = node.rv
    patch["spec"] = {"taints": new}


def _annotate(patch: dict[str, Any], key: str, value: str | None) -> None:
    """Set (or, with None, remove) an annotation in a strategic merge patch."""
    patch.setdefault("metadata", {}).setdefault("annotations", {})[key] = value


def _count_failure(kind: str, exc: BaseException, name: str) -> None:
    code = status_of(exc)
    if code == 409:
        WRITES.labels(kind, "conflict").inc()
        log.debug("%s %s changed under us; next period retries", kind, name)
    elif code == 404:
        WRITES.labels(kind, "gone").inc()
    else:
        WRITES.labels(kind, "error").inc()
        log.warning("writing %s %s failed: %s", kind, name, exc)


def _taint_events(node: NodeInfo, new: list[dict[str, Any]], stale: bool) -> list[NodeEvent]:
    """One Event per taint of ours added or removed, saying why."""
    def keys(ts: list[dict[str, Any]]) -> set[tuple[str, str]]:
        return {(t.get("key") or "", t.get("effect") or "") for t in ts}

    old_keys, new_keys = keys(node.taints), keys(new)
    conditions = _unknown(node.conditions) if stale else node.conditions
    out = []
    for key, effect in sorted(new_keys - old_keys):
        taint = f"{key}:{effect}"
        if key == UNREACHABLE_TAINT and effect == "NoExecute":
            out.append(NodeEvent(node.name, node.uid, "Warning", "EvictionStarted",
                                 f"Added taint {taint}: the node's Lease is stale, so the "
                                 "pods that do not tolerate it are evicted."))
        elif key == UNREACHABLE_TAINT:
            out.append(NodeEvent(node.name, node.uid, "Warning", "TaintAdded",
                                 f"Added taint {taint}: the node's Lease is stale, so no new "
                                 "pods are scheduled onto it."))
        else:
            out.append(NodeEvent(node.name, node.uid, "Normal", "TaintAdded",
                                 f"Added taint {taint}: {_why(key, conditions, node)}."))
    for key, effect in sorted(old_keys - new_keys):
        taint = f"{key}:{effect}"
        if key == UNREACHABLE_TAINT and effect == "NoExecute":
            out.append(NodeEvent(node.name, node.uid, "Normal", "EvictionStopped",
                                 f"Removed taint {taint}: the node's agent is heard from "
                                 "again, so its pods are no longer evicted."))
        elif key == UNREACHABLE_TAINT:
            out.append(NodeEvent(node.name, node.uid, "Normal", "TaintRemoved",
                                 f"Removed taint {taint}: the node's agent is heard from "
                                 "again (Lease renewed or status posted)."))
        else:
            out.append(NodeEvent(node.name, node.uid, "Normal", "TaintRemoved",
                                 f"Removed taint {taint}: {_why(key, conditions, node)}."))
    return out


def _why(key: str, conditions: Mapping[str, dict[str, Any]], node: NodeInfo) -> str:
    """The state of what a condition taint follows, e.g. `DiskPressure is True`."""
    if key == taints.UNSCHEDULABLE:
        return "the node is " + ("cordoned" if node.unschedulable else "no longer cordoned")
    ctype = next((c for (c, _), k in taints.BY_CONDITION.items() if k == key), "")
    status = (conditions.get(ctype) or {}).get("status")
    return f"{ctype} is {status}" if status else f"the node has no {ctype} condition"


def _unknown(conditions: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The conditions as they are once a stale node's are marked Unknown."""
    out = dict(conditions)
    for ctype in AGENT_CONDITIONS:
        if ctype in out or ctype == "Ready":
            out[ctype] = {**out.get(ctype, {}), "status": "Unknown"}
    return out


def _merge(current: list[dict[str, Any]], unreachable: Mapping[str, dict[str, Any]],
           by_condition: set[str]) -> list[dict[str, Any]]:
    """The node's taint list with ours made to match: taints that stay keep their
    place and fields (timeAdded), new ones go last, anyone else's are left alone. An
    unchanged set gives back an equal list, so nothing is written."""
    out, have = [], set()
    for t in current:
        key, effect = t.get("key"), t.get("effect")
        if key == UNREACHABLE_TAINT:
            if effect not in unreachable or effect in have:
                continue
            have.add(effect)
        elif effect == "NoSchedule" and key in taints.MANAGED:
            if key not in by_condition or key in have:
                continue
            have.add(key)
        out.append(t)
    out += [t for effect, t in unreachable.items() if effect not in have]
    out += [{"key": key, "effect": "NoSchedule"} for key in sorted(by_condition - have)]
    return out


def _find_taint(node: NodeInfo, effect: str) -> dict[str, Any] | None:
    for t in node.taints:
        if t.get("key") == UNREACHABLE_TAINT and t.get("effect") == effect:
            return t
    return None


def _has_taint(node: NodeInfo, effect: str) -> bool:
    return _find_taint(node, effect) is not None


def _rfc3339(clock: Clock) -> str:
    return clock.now().strftime("%Y-%m-%dT%H:%M:%SZ")


def _status_differs(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    return any(old.get(k) != v for k, v in new.items())
