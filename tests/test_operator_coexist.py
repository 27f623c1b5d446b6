"""Coexist mode against a fake API server with a fake of the controller manager's
node-lifecycle controller beside the operator: strict policies marked first, lax ones
left to it, ownership of taints kept on the Node, no taint removed and put back, what
the policy cannot get said in its status and a Warning Event. Fake clock, no sleeps."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from nodeoperator.modes import (
    COEXIST,
    EXCLUSIVE,
    OWNED_ANNOTATION,
    Lifecycle,
    encode_owned,
    parse_duration,
    parse_owned,
)
from nodeoperator.monitor import Monitor
from nodeoperator.nodeevents import NodeEvents
from nodeoperator.state import UNREACHABLE_TAINT, Store
from prometheus_client import REGISTRY

from nodeagent.api.clock import FakeClock
from nodeagent.api.policy import parse_spec
from tests.fakeoperator import FakeApi, post_ready, spec, step

CM_CONDITIONS = ("Ready", "MemoryPressure", "DiskPressure", "PIDPressure")
BY_CONDITION = {("Ready", "False"): "node.kubernetes.io/not-ready",
                ("Ready", "Unknown"): UNREACHABLE_TAINT,
                ("MemoryPressure", "True"): "node.kubernetes.io/memory-pressure",
                ("DiskPressure", "True"): "node.kubernetes.io/disk-pressure",
                ("PIDPressure", "True"): "node.kubernetes.io/pid-pressure",
                ("NetworkUnavailable", "True"): "node.kubernetes.io/network-unavailable"}
CM_MESSAGE = "Kubelet stopped posting node status."


class ClusterApi(FakeApi):
    """The fake API server, recording after every write to a Node who made it and what
    its unreachable taints and Ready status were then; the controller manager's
    NoSchedule pass runs on every Node update, as its informer makes it do."""

    def __init__(self, store: Store, clock: FakeClock) -> None:
        super().__init__(store, clock)
        self.cm: FakeNodeLifecycle | None = None
        # node -> [(writer, unreachable effects, Ready status)]
        self.history: dict[str, list[tuple[str, frozenset[str], str | None]]] = {}
        self.events: list[dict[str, Any]] = []
        self.event_patches: list[str] = []  # names of Events whose count was raised

    def record(self, who: str, name: str) -> None:
        node = self.nodes[name]
        effects = frozenset(t["effect"] for t in node["spec"].get("taints") or []
                            if t["key"] == UNREACHABLE_TAINT)
        ready = next((c["status"] for c in node["status"].get("conditions", [])
                      if c["type"] == "Ready"), None)
        self.history.setdefault(name, []).append((who, effects, ready))

    def updated(self, who: str, name: str) -> None:
        self.record(who, name)
        if self.cm is not None:
            self.cm.no_schedule_pass(name)

    async def patch_node(self, name: str, patch: dict[str, Any]) -> str:
        rv = await super().patch_node(name, patch)
        self.updated("operator", name)
        return rv

    async def patch_node_status(self, name: str, patch: dict[str, Any]) -> str:
        rv = await super().patch_node_status(name, patch)
        self.updated("operator", name)
        return rv

    def post_ready(self, name: str) -> None:
        post_ready(self, name)
        self.updated("agent", name)

    def cm_write(self, name: str) -> None:
        self._bump(self.nodes[name])
        self.store.node_event("MODIFIED", copy.deepcopy(self.nodes[name]))
        self.writes.append(("cm", name, {}))
        self.updated("cm", name)

    def ops(self, name: str) -> list[tuple[str, dict[str, Any]]]:
        """The operator's writes to the node."""
        return [(kind, p) for kind, n, p in self.writes
                if n == name and kind in ("node", "node_status")]

    # ---- Events (NodeEvents' sink)
    async def create_event(self, namespace: str, body: dict[str, Any]) -> str:
        self.events.append(body)
        return "1"

    async def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> str:
        self.event_patches.append(name)
        return "1"

    def owned(self, name: str) -> frozenset[tuple[str, str]]:
        return parse_owned(self.nodes[name]["metadata"].get("annotations", {})
                           .get(OWNED_ANNOTATION))

    def noexecute(self, name: str) -> dict[str, Any] | None:
        return next((t for t in self.nodes[name]["spec"].get("taints") or []
                     if t["key"] == UNREACHABLE_TAINT and t["effect"] == "NoExecute"), None)


class FakeNodeLifecycle:
    """What kube-controller-manager's node-lifecycle controller (v1.35) does to Nodes,
    as read in pkg/controller/nodelifecycle. Every `period` (its --node-monitor-period)
    a node whose Lease renewTime and Ready lastHeartbeatTime have not changed for
    `grace` gets its four conditions Unknown (written only when Ready changes); a node
    whose Ready is Unknown, whoever wrote it, is queued for unreachable:NoExecute, which
    a token bucket (0.1/s, burst 1) hands out (a NoExecute already there is rewritten
    with its own timeAdded); a node whose Ready is True loses it. The NoSchedule taints
    follow the conditions on every Node update."""

    def __init__(self, api: ClusterApi, clock: FakeClock, grace: float = 50,
                 period: float = 5, rate: float = 0.1) -> None:
        self.api, self.clock, self.grace, self.period, self.rate = api, clock, grace, period, rate
        self.probe: dict[str, tuple[Any, Any, float]] = {}
        self.queued: set[str] = set()  # its NoExecute queue's set: stays after a taint
        self.pending: list[str] = []  # its NoExecute queue
        self.tokens, self.refilled = 1.0, 0.0
        self.next_pass = 0.0
        self.evicting = True  # False: its zone is fully disrupted, no NoExecute changes
        api.cm = self

    def run(self) -> None:
        now = self.clock.monotonic()
        if now >= self.next_pass:
            self.next_pass = now + self.period
            for name in list(self.api.nodes):
                self.monitor_node(name, now)
        if self.evicting:
            self.tokens = min(1.0, self.tokens + (now - self.refilled) * self.rate)
            self.refilled = now
            while self.pending and self.tokens >= 1:
                self.tokens -= 1
                self.taint(self.pending.pop(0))

    def ready(self, name: str) -> str | None:
        return next((c["status"] for c in self.api.nodes[name]["status"].get("conditions", [])
                     if c["type"] == "Ready"), None)

    def monitor_node(self, name: str, now: float) -> None:
        node = self.api.nodes[name]
        conds = {c["type"]: c for c in node["status"].get("conditions", [])}
        seen = (self.api.leases.get(name), (conds.get("Ready") or {}).get("lastHeartbeatTime"))
        if name not in self.probe or self.probe[name][:2] != seen:
            self.probe[name] = (*seen, now)
        if now > self.probe[name][2] + self.grace and self.ready(name) != "Unknown":
            for ctype in CM_CONDITIONS:
                c = conds.setdefault(ctype, {"type": ctype})
                if c.get("status") != "Unknown":
                    c.update(status="Unknown", reason="NodeStatusUnknown",
                             message=CM_MESSAGE, lastTransitionTime="cm")
            node["status"]["conditions"] = list(conds.values())
            self.api.cm_write(name)
        if not self.evicting:
            return
        taint = self.api.noexecute(name)
        if self.ready(name) == "Unknown":
            if taint is None:
                self.queued.discard(name)
            if name not in self.queued:
                self.queued.add(name)
                self.pending.append(name)
        elif self.ready(name) == "True":
            self.queued.discard(name)
            if name in self.pending:
                self.pending.remove(name)
            if taint is not None:
                node["spec"]["taints"].remove(taint)
                self.api.cm_write(name)

    def taint(self, name: str) -> None:
        if name not in self.api.nodes or self.ready(name) != "Unknown":
            return
        node = self.api.nodes[name]
        rest = [t for t in node["spec"].get("taints") or [] if t is not self.api.noexecute(name)]
        node["spec"]["taints"] = [*rest, {"key": UNREACHABLE_TAINT, "effect": "NoExecute",
                                          "timeAdded": f"cm-{self.clock.monotonic()}"}]
        self.api.cm_write(name)

    def no_schedule_pass(self, name: str) -> None:
        node = self.api.nodes[name]
        want = {key for c in node["status"].get("conditions", [])
                if (key := BY_CONDITION.get((c["type"], c.get("status"))))}
        if node["spec"].get("unschedulable"):
            want.add("node.kubernetes.io/unschedulable")
        ours = set(BY_CONDITION.values()) | {"node.kubernetes.io/unschedulable"}
        taints = node["spec"].get("taints") or []
        have = {t["key"] for t in taints if t["effect"] == "NoSchedule" and t["key"] in ours}
        if have == want:
            return
        kept = [t for t in taints if t["effect"] != "NoSchedule" or t["key"] not in ours
                or t["key"] in want]
        node["spec"]["taints"] = kept + [{"key": k, "effect": "NoSchedule"}
                                         for k in sorted(want - have)]
        self.api.cm_write(name)


Env = tuple[FakeClock, Store, ClusterApi, Monitor, FakeNodeLifecycle]
STRICT = {"matchLabels": {"pool": "strict"}}
LAX = {"matchLabels": {"pool": "lax"}}


def monitor(store: Store, clock: FakeClock, api: ClusterApi) -> Monitor:
    """An operator in coexist mode with the controller manager's default grace."""
    return Monitor(store, clock, api, period=2, lifecycle=Lifecycle(COEXIST, 50),
                   events=NodeEvents(api, clock, instance="op"))


def run(test: Callable[[Env], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        clock = FakeClock()
        store = Store(clock)
        store.lease_sync(set())
        api = ClusterApi(store, clock)
        cm = FakeNodeLifecycle(api, clock, grace=50)
        cm.next_pass = 3  # its passes at 3, 8, 13 s...: apart from the policies' graces
        await test((clock, store, api, monitor(store, clock, api), cm))
    asyncio.run(main())


async def second(env: Env, renewing: set[str], seconds: int = 1) -> None:
    """Seconds pass: the nodes in `renewing` renew their Leases each second, the
    operator runs a period and the controller manager a monitor pass."""
    clock, _, api, mon, cm = env
    for _ in range(seconds):
        for n in sorted(renewing):
            api.renew(n)
        await step(clock, mon, 1)
        assert mon.events is not None
        await mon.events.drain()
        cm.run()


def assert_no_fight(api: ClusterApi) -> None:
    """No unreachable taint was added while the node's Ready was not Unknown, or
    removed while it was Unknown: what would make the other side put it back."""
    for name, hist in api.history.items():
        for (_, before, _), (who, after, ready) in zip(hist, hist[1:], strict=False):
            added, removed = after - before, before - after
            assert not added or ready == "Unknown", (name, who, hist)
            assert not removed or ready == "True", (name, who, hist)


def condition(api: ClusterApi, policy: str, ctype: str) -> dict[str, Any]:
    return next(c for c in api.policies[policy]["status"]["conditions"] if c["type"] == ctype)


def test_a_strict_policy_marks_first_and_the_controller_manager_agrees() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon, cm = env
        api.add_policy("strict", spec(grace=20, sel=STRICT))
        api.add_node("s1", {"pool": "strict"})
        api.add_node("h1", {"pool": "strict"})
        await second(env, {"s1", "h1"})
        await second(env, {"h1"}, 19)  # 20 s of silence: not yet more than the grace
        assert api.ready("s1")["status"] == "True"
        await second(env, {"h1"})
        ready = api.ready("s1")
        assert ready["status"] == "Unknown" and ready["message"].startswith("nodepulse-operator")
        # Ready first, then our NoExecute, recorded as ours; the NoSchedule is the
        # controller manager's (its pass runs on our status write, so our taint write
        # right after meets a newer version: 409, and the next period makes it).
        await second(env, {"h1"})
        writes = [(kind, sorted(p)) for kind, p in api.ops("s1")][1:]
        assert writes == [("node_status", ["metadata", "status"]),
                          ("node", ["metadata", "spec"])]
        assert api.taints("s1") == {"NoSchedule", "NoExecute"}
        assert api.owned("s1") == {(UNREACHABLE_TAINT, "NoExecute")}
        assert [w for w, effects, _ in api.history["s1"] if "NoSchedule" in effects][0] == "cm"
        ops = len(api.ops("s1"))
        await second(env, {"h1"}, 40)  # past the controller manager's 50 s
        assert api.ready("s1")["message"].startswith("nodepulse-operator")  # not rewritten
        assert api.taints("s1") == {"NoSchedule", "NoExecute"}
        assert len(api.ops("s1")) == ops
        # Back: a renewal alone changes nothing (Ready is still Unknown, and the
        # controller manager would put a NoExecute straight back); Ready=True does.
        await second(env, {"h1", "s1"}, 3)
        assert api.taints("s1") == {"NoSchedule", "NoExecute"}
        api.post_ready("s1")
        await second(env, {"h1", "s1"})
        assert api.taints("s1") == set() and api.owned("s1") == set()
        assert OWNED_ANNOTATION not in api.nodes["s1"]["metadata"]["annotations"]
        assert api.taints("h1") == set() and len(api.ops("h1")) == 1  # the annotation
        assert_no_fight(api)
        reasons = sorted(e["reason"] for e in api.events
                         if e["involvedObject"]["name"] == "s1")
        assert reasons == ["EvictionStarted", "NodeStatusUnknown"] or \
            reasons == ["EvictionStarted", "EvictionStopped", "NodeStatusUnknown"]
    run(t)


def test_a_lax_policy_is_left_to_the_controller_manager_and_says_so() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon, cm = env
        api.add_policy("lax", spec(grace=90, lease=40, sel=LAX))
        api.add_node("l1", {"pool": "lax"})
        await second(env, {"l1"})
        effective = condition(api, "lax", "Effective")
        assert effective["status"] == "False"
        assert effective["reason"] == "OverriddenByControllerManager"
        assert "spec.failure.gracePeriodSeconds is 90s" in effective["message"]
        assert "(50s)" in effective["message"]
        assert api.policies["lax"]["status"]["nodeLifecycle"] == "coexist"
        warnings = [e for e in api.events if e["involvedObject"]["kind"] == "NodeStatusPolicy"]
        assert [(e["type"], e["reason"], e["involvedObject"]["name"],
                 e["involvedObject"]["apiVersion"]) for e in warnings] == [
            ("Warning", "OverriddenByControllerManager", "lax", "nodepulse.dev/v1alpha1")]
        assert warnings[0]["message"] == effective["message"]
        ops = len(api.ops("l1"))  # the heartbeat annotation
        await second(env, set(), 60)
        ready = api.ready("l1")
        assert ready["status"] == "Unknown" and ready["message"] == CM_MESSAGE
        assert api.taints("l1") == {"NoSchedule", "NoExecute"}
        # Counted as unreachable in its status, but nothing written to it by us.
        assert api.policies["lax"]["status"]["unreachableNodes"] == 1
        api.post_ready("l1")
        await second(env, {"l1"}, 2)
        assert api.taints("l1") == set()
        assert len(api.ops("l1")) == ops
        assert len([e for e in api.events if e["involvedObject"]["kind"] != "Node"]) == 1
        assert not [e for e in api.events if e["involvedObject"]["name"] == "l1"]
        assert_no_fight(api)
    run(t)


@pytest.mark.parametrize(("failure", "heartbeat", "says"), [
    ({"gracePeriodSeconds": 60}, {}, ["spec.failure.gracePeriodSeconds is 60s"]),
    ({"gracePeriodSeconds": 20, "taintUnreachable": False}, {},
     ["spec.failure.taintUnreachable is false",
      "the shorter spec.failure.gracePeriodSeconds (20s) is not applied"]),
    ({"gracePeriodSeconds": 120}, {"leaseDurationSeconds": 120, "renewIntervalSeconds": 50},
     ["spec.failure.gracePeriodSeconds is 120s", "spec.heartbeat.renewIntervalSeconds is 50s"]),
])
def test_what_the_controller_manager_overrides_is_named(
        failure: dict[str, Any], heartbeat: dict[str, Any], says: list[str]) -> None:
    lc = Lifecycle(COEXIST, 50)
    policy = parse_spec({"heartbeat": {"leaseDurationSeconds": 10, **heartbeat},
                         "failure": failure})
    status, reason, message = lc.effective(policy)
    assert (status, reason) == ("False", "OverriddenByControllerManager")
    assert all(s in message for s in says) and "50s" in message
    assert not lc.acts(policy.failure) and lc.grace(policy.failure) == 50
    # The same policy where the operator runs alone: all of it applies.
    assert Lifecycle(EXCLUSIVE).effective(policy)[:2] == ("True", "Exclusive")
    assert Lifecycle(EXCLUSIVE).acts(policy.failure)


def test_effective_when_stricter_or_the_same() -> None:
    lc = Lifecycle(COEXIST, 50)
    strict = parse_spec({"heartbeat": {"leaseDurationSeconds": 10},
                         "failure": {"gracePeriodSeconds": 20}})
    assert lc.effective(strict)[:2] == ("True", "StricterThanCluster")
    assert lc.acts(strict.failure) and lc.grace(strict.failure) == 20
    same = parse_spec({})
    assert lc.effective(same)[:2] == ("True", "SameAsCluster")
    assert not lc.acts(same.failure)


def test_the_warning_event_is_posted_once_per_change() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon, cm = env
        api.add_policy("p", spec(grace=60))
        await second(env, set(), 5)
        api.add_policy("p", spec(grace=70), generation=2)  # says something new
        await second(env, set(), 5)
        api.add_policy("p", spec(grace=20), generation=3)  # effective again
        await second(env, set(), 5)
        assert condition(api, "p", "Effective")["reason"] == "StricterThanCluster"
        api.add_policy("p", spec(grace=60), generation=4)  # overridden again
        await second(env, set(), 5)
        # The first message again within 10 minutes: that Event's count goes up.
        made = [e for e in api.events if e["involvedObject"]["name"] == "p"]
        assert len(made) == 2 and "60s" in made[0]["message"] and "70s" in made[1]["message"]
        assert api.event_patches == [made[0]["metadata"]["name"]]
        # A new leader (fresh indexes) finds the status as it should be: no Event.
        store_b = Store(clock)
        store_b.lease_sync(set())
        api.store = store_b
        api.deliver()
        mon_b = monitor(store_b, clock, api)
        await second((clock, store_b, api, mon_b, cm), set(), 3)
        assert len(api.events) == 2 and len(api.event_patches) == 1
    run(t)


def test_ownership_is_kept_on_the_node_for_a_new_leader() -> None:
    """Leader A marks a strict node; the controller manager marks a lax one. A new
    leader B (fresh indexes from the API) knows the first NoExecute is its own and the
    second is not: when both come back it removes only its own."""
    async def t(env: Env) -> None:
        clock, store, api, mon, cm = env
        api.add_policy("strict", spec(grace=20, sel=STRICT))
        api.add_policy("lax", spec(grace=90, lease=40, sel=LAX))
        for n, pool in (("s1", "strict"), ("l1", "lax"), ("h1", "strict"), ("h2", "lax")):
            api.add_node(n, {"pool": pool})
        await second(env, {"s1", "l1", "h1", "h2"})
        await second(env, {"h1", "h2"}, 60)
        assert api.owned("s1") == {(UNREACHABLE_TAINT, "NoExecute")}
        assert api.owned("l1") == set() and api.noexecute("l1") is not None
        # A is gone; B starts from what the API server holds.
        store_b = Store(clock)
        api.store = store_b
        store_b.lease_sync(set())
        for n in api.nodes:
            store_b.node_event("ADDED", copy.deepcopy(api.nodes[n]))
        for p in api.policies.values():
            store_b.policy_event("ADDED", copy.deepcopy(p))
        mon_b = monitor(store_b, clock, api)
        env_b = (clock, store_b, api, mon_b, cm)
        writes = len(api.writes)
        await second(env_b, {"h1", "h2"}, 5)
        assert [w for w in api.writes[writes:] if w[0] != "policy_status"] == []
        cm.evicting = False  # the controller manager's NoExecute pass held back
        api.post_ready("s1")
        api.post_ready("l1")
        await second(env_b, {"h1", "h2", "s1", "l1"})
        assert api.noexecute("s1") is None and api.owned("s1") == set()
        assert api.noexecute("l1") is not None  # not ours: left to the controller manager
        assert [w[1] for w in api.writes[writes:] if w[0] == "node"] == ["s1"]
        cm.evicting = True
        await second(env_b, {"h1", "h2", "s1", "l1"})
        assert api.noexecute("l1") is None
        assert_no_fight(api)
    run(t)


def test_a_noexecute_of_ours_someone_removed_is_not_put_back() -> None:
    """The controller manager takes every NoExecute off when a whole zone is down;
    an admin may too. The operator does not undo it while the node is silent, and
    forgets the record once the node is back."""
    async def t(env: Env) -> None:
        clock, store, api, mon, cm = env
        api.add_policy("strict", spec(grace=20, sel=STRICT))
        api.add_node("s1", {"pool": "strict"})
        await second(env, {"s1"})
        await second(env, set(), 22)
        assert api.noexecute("s1") is not None
        cm.evicting = False
        api.nodes["s1"]["spec"]["taints"].remove(api.noexecute("s1"))
        api.cm_write("s1")
        await second(env, set(), 30)
        assert api.noexecute("s1") is None and api.owned("s1") != set()
        api.post_ready("s1")
        await second(env, {"s1"}, 2)
        assert api.owned("s1") == set()
        cm.evicting = True
        await second(env, set(), 25)  # silent again: ours again
        assert api.owned("s1") == {(UNREACHABLE_TAINT, "NoExecute")}
    run(t)


def test_no_noexecute_when_the_policy_forbids_it_or_the_guard_holds() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon, cm = env
        api.add_policy("quiet", spec(grace=20, taintUnreachable=False, sel=STRICT))
        api.add_node("q1", {"pool": "strict"})
        await second(env, {"q1"})
        await second(env, set(), 30)
        # Not marked by us: Unknown now would have the controller manager evict now.
        assert api.ready("q1")["status"] == "True" and len(api.ops("q1")) == 1
        await second(env, set(), 30)  # the controller manager's 50 s, at its pass
        assert api.ready("q1")["message"] == CM_MESSAGE
        assert len(api.ops("q1")) == 1
    run(t)


def test_the_partition_guard_of_a_policy_left_to_the_controller_manager() -> None:
    """Three of four lax nodes silent: the guard is not the operator's to trip (it adds
    no NoExecute for them), and the status says whose rules apply."""
    async def t(env: Env) -> None:
        clock, store, api, mon, cm = env
        api.add_policy("lax", spec(grace=90, lease=40, sel=LAX, maxUnreachableFraction=0.5))
        for i in range(4):
            api.add_node(f"l{i}", {"pool": "lax"})
        await second(env, {f"l{i}" for i in range(4)})
        await second(env, {"l3"}, 60)
        guard = condition(api, "lax", "PartitionGuard")
        assert (guard["status"], guard["reason"]) == ("False", "LeftToControllerManager")
        assert "3 of 4" in guard["message"]
        assert not [e for e in api.events if e["reason"].startswith("PartitionGuard")]
    run(t)


def test_condition_taints_are_the_controller_managers() -> None:
    """Admission's not-ready on a Ready node, a cordon, DiskPressure: in coexist mode
    none is the operator's to add or remove."""
    async def t(env: Env) -> None:
        clock, store, api, mon, cm = env
        api.cm = None  # its passes would take these off: here only the operator runs
        api.add_node("n1")
        api.nodes["n1"]["spec"] = {"unschedulable": True, "taints": [
            {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]}
        api.nodes["n1"]["status"]["conditions"].append({"type": "DiskPressure", "status": "True"})
        api.deliver()
        await step(clock, mon, 1)
        await step(clock, mon, 1)
        assert [sorted(p["metadata"]["annotations"]) for _, p in api.ops("n1")] == [
            ["nodepulse.dev/heartbeat"]]
        assert api.nodes["n1"]["spec"]["taints"] == [
            {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]
    run(t)


def test_no_taint_is_removed_and_put_back_over_three_minutes() -> None:
    """Strict and lax pools whose nodes go silent and come back on their own
    schedules, healthy nodes beside them, and both controllers at work."""
    async def t(env: Env) -> None:
        clock, store, api, mon, cm = env
        api.add_policy("strict", spec(grace=20, sel=STRICT, noExecuteTaintsPerMinute=60))
        api.add_policy("lax", spec(grace=90, lease=40, sel=LAX))
        pools = {"s0": "strict", "s1": "strict", "l0": "lax", "l1": "lax",
                 **{f"h{i}": "strict" if i % 2 else "lax" for i in range(4)}}
        for n, pool in pools.items():
            api.add_node(n, {"pool": pool})
        # (silent for, up for, offset) in seconds
        cycles = {"s0": (30, 20, 0), "s1": (40, 15, 12), "l0": (70, 20, 5), "l1": (60, 25, 40)}
        for sec in range(180):
            up = set(pools)
            for n, (silent, back, offset) in cycles.items():
                phase = (sec - offset) % (silent + back) if sec >= offset else silent + back
                if phase < silent:
                    up.discard(n)
                elif phase == silent and (api.ready(n)["status"] != "True"):
                    api.renew(n)
                    api.post_ready(n)  # the agent is back: it renews, then posts Ready
            await second(env, up)
        assert_no_fight(api)
        for n in ("l0", "l1"):
            assert len(api.ops(n)) == 1  # the heartbeat annotation only
            assert any(ready == "Unknown" for _, _, ready in api.history[n])
        for n in ("s0", "s1"):
            marked = [p for kind, p in api.ops(n) if kind == "node_status"]
            assert len(marked) >= 2  # each silence marked by us, before the cluster
        assert all(len(api.ops(f"h{i}")) == 1 for i in range(4))
    run(t)


def test_mode_on_metrics_and_durations() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon, cm = env
        assert REGISTRY.get_sample_value("nodepulse_operator_node_lifecycle_info",
                                         {"mode": "coexist"}) == 1
        assert REGISTRY.get_sample_value("nodepulse_operator_node_lifecycle_info",
                                         {"mode": "exclusive"}) == 0
        assert REGISTRY.get_sample_value(
            "nodepulse_operator_cluster_grace_period_seconds") == 50
    run(t)
    assert parse_duration("50s") == 50 and parse_duration("1m30s") == 90
    assert parse_duration("40") == 40 and parse_duration("1.5m") == 90
    assert parse_duration("500ms") == 0.5
    for bad in ("", "fifty", "50x", "s50", "1m 30s"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)
    with pytest.raises(ValueError, match="positive"):
        Lifecycle(COEXIST, 0)
    with pytest.raises(ValueError, match="exclusive, coexist"):
        Lifecycle("both")
    owned = {(UNREACHABLE_TAINT, "NoExecute"), ("example.com/x", "NoSchedule")}
    assert parse_owned(encode_owned(owned)) == owned
    assert encode_owned(()) is None and parse_owned("junk,:x,a:") == frozenset()
