"""The operator's Events on Nodes: what `kubectl describe node` shows. One per change
the monitor makes (never per period), on the Node (kind, name, uid), aggregated when
the same thing repeats, capped per node, and only from the leader. No test sleeps."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from nodeoperator.monitor import Monitor
from nodeoperator.nodeevents import NodeEvent, NodeEvents
from nodeoperator.state import Store

from nodeagent.api.client import ApiError
from nodeagent.api.clock import FakeClock
from tests.fakeoperator import ALONE, FakeApi, post, register, spec, step


class EventApi(FakeApi):
    """FakeApi that also keeps Events (namespace, name) -> body, and Node uids."""

    def __init__(self, store: Store, clock: FakeClock) -> None:
        super().__init__(store, clock)
        self.events: dict[tuple[str, str], dict[str, Any]] = {}
        self.event_calls: list[tuple[str, str]] = []  # (create|patch, name)
        self.fail_events = False

    def add_node(self, name: str, labels: dict[str, str] | None = None,
                 ready: str | None = "True") -> None:
        super().add_node(name, labels, ready)
        body = self.nodes[name]
        body["metadata"]["uid"] = f"uid-{name}"
        self.store.node_event("MODIFIED", copy.deepcopy(body))

    async def create_event(self, namespace: str, body: dict[str, Any]) -> str:
        if self.fail_events:
            raise ApiError(status=500, reason="Internal")
        name = body["metadata"]["name"]
        assert (namespace, name) not in self.events
        self.events[(namespace, name)] = copy.deepcopy(body)
        self.event_calls.append(("create", name))
        return "1"

    async def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> str:
        if (namespace, name) not in self.events:
            raise ApiError(status=404, reason="Not Found")
        self.events[(namespace, name)].update(patch)
        self.event_calls.append(("patch", name))
        return "2"

    def about(self, node: str) -> list[tuple[str, str, str, int]]:
        """(type, reason, message, count) of the Events on `node`, oldest first."""
        return [(e["type"], e["reason"], e["message"], e["count"])
                for e in self.events.values() if e["involvedObject"]["name"] == node]

    def reasons(self, node: str) -> list[str]:
        return [r for _, r, _, _ in self.about(node)]


class Draining(Monitor):
    """Waits for the Events a period emitted (they are posted in the background)."""

    async def tick(self) -> Any:
        plan = await super().tick()
        assert self.events is not None
        await self.events.drain()
        return plan


Env = tuple[FakeClock, Store, EventApi, Monitor]


def run(test: Any, **events: Any) -> None:
    async def main() -> None:
        clock = FakeClock()
        store = Store(clock)
        api = EventApi(store, clock)
        rec = NodeEvents(api, clock, instance="op-a", **events)
        await test((clock, store, api, Draining(store, clock, api, period=2, events=rec, lifecycle=ALONE)))
    asyncio.run(main())


def test_stale_node_events_then_recovery_events() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("fast", spec(grace=15))
        api.add_node("n1")
        api.renew("n1")
        await mon.tick()
        assert api.events == {}  # a healthy node: nothing to say
        await step(clock, mon, 16)
        assert api.taints("n1") == {"NoSchedule", "NoExecute"}
        assert sorted(api.reasons("n1")) == ["EvictionStarted", "NodeStatusUnknown",
                                             "TaintAdded"]
        for (ns, name), e in api.events.items():
            assert ns == "default" and name.startswith("n1.")
            assert e["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "n1",
                                           "uid": "uid-n1"}
            assert e["reportingComponent"] == "nodepulse-operator"
            assert e["source"] == {"component": "nodepulse-operator"}
            assert e["reportingInstance"] == "op-a" and e["count"] == 1
            assert e["message"][0].isupper() and e["message"].endswith(".")
        by_reason = {r: (ty, m) for ty, r, m, _ in api.about("n1")}
        assert by_reason["NodeStatusUnknown"][0] == "Warning"
        assert "Set Ready to Unknown" in by_reason["NodeStatusUnknown"][1]
        assert "15s" in by_reason["NodeStatusUnknown"][1]
        assert "policy fast" in by_reason["NodeStatusUnknown"][1]
        assert "node.kubernetes.io/unreachable:NoSchedule" in by_reason["TaintAdded"][1]
        assert "node.kubernetes.io/unreachable:NoExecute" in by_reason["EvictionStarted"][1]
        assert by_reason["EvictionStarted"][0] == "Warning"

        # ticks with nothing to change post nothing more
        calls = len(api.event_calls)
        for _ in range(5):
            await step(clock, mon, 2)
        assert len(api.event_calls) == calls

        api.renew("n1")
        await mon.tick()
        assert api.taints("n1") == set()
        new = [r for r in api.reasons("n1")][3:]
        assert sorted(new) == ["EvictionStopped", "TaintRemoved"]
        assert all(ty == "Normal" for ty, r, _, _ in api.about("n1") if r in new)
    run(t)


def test_a_flapping_node_aggregates_into_one_event_per_reason() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("p", spec(grace=15, taintUnreachable=False))
        api.add_node("n1")
        for _ in range(3):  # silent past grace, then back: three times
            api.renew("n1")
            await mon.tick()
            await step(clock, mon, 16)
            assert api.taints("n1") == {"NoSchedule"}
        api.renew("n1")
        await mon.tick()
        counts = {r: c for _, r, _, c in api.about("n1")}
        # Ready=Unknown is written once: the agent never posted Ready again here
        assert counts == {"TaintAdded": 3, "TaintRemoved": 3, "NodeStatusUnknown": 1}
        assert len(api.events) == 3
        assert [k for k, _ in api.event_calls].count("patch") == 4
        # past the window, the same thing is a new Event
        await step(clock, mon, 700)
        assert api.taints("n1") == {"NoSchedule"}
        assert [r for r in api.reasons("n1")].count("TaintAdded") == 2
    run(t)


def test_an_expired_event_is_written_anew() -> None:
    async def t() -> None:
        clock = FakeClock()
        api = EventApi(Store(clock), clock)
        rec = NodeEvents(api, clock)
        ev = NodeEvent("n1", "u1", "Normal", "TaintRemoved", "Removed taint x: y.")
        await rec.post(ev)
        api.events.clear()  # the API server's Event TTL ran out
        await clock.advance(5)
        await rec.post(ev)
        assert [k for k, _ in api.event_calls] == ["create", "create"]
        assert api.about("n1") == [("Normal", "TaintRemoved", "Removed taint x: y.", 1)]
    asyncio.run(t())


def test_events_are_capped_per_node_and_failures_are_swallowed() -> None:
    async def t() -> None:
        clock = FakeClock()
        api = EventApi(Store(clock), clock)
        rec = NodeEvents(api, clock, burst=3, refill_every=30)
        for i in range(5):
            await rec.post(NodeEvent("n1", "u1", "Normal", "TaintAdded", f"Message {i}."))
        await rec.post(NodeEvent("n2", "u2", "Normal", "TaintAdded", "Message."))
        assert len(api.about("n1")) == 3 and rec.dropped == 2
        assert len(api.about("n2")) == 1  # buckets are per node
        await clock.advance(30)
        await rec.post(NodeEvent("n1", "u1", "Normal", "TaintAdded", "Message 9."))
        assert len(api.about("n1")) == 4
        api.fail_events = True
        await rec.post(NodeEvent("n3", "u3", "Normal", "TaintAdded", "Message."))  # no raise
        assert api.about("n3") == []
    asyncio.run(t())


def test_partition_guard_trip_and_lift_are_told_to_each_node_once() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("pool", spec(grace=15, maxUnreachableFraction=0.5,
                                    noExecuteTaintsPerMinute=600))
        for i in range(4):
            api.add_node(f"n{i}")
            api.renew(f"n{i}")
        await step(clock, mon, 10)
        api.renew("n3")
        await step(clock, mon, 11)
        for _ in range(3):
            api.renew("n3")  # n3 keeps renewing
            await step(clock, mon, 2)
        for i in range(3):
            assert api.taints(f"n{i}") == {"NoSchedule"}
            tripped = [(ty, m) for ty, r, m, _ in api.about(f"n{i}")
                       if r == "PartitionGuardTripped"]
            assert len(tripped) == 1 and tripped[0][0] == "Warning"
            assert "policy pool" in tripped[0][1] and "3 of 4" in tripped[0][1]
            assert "EvictionStarted" not in api.reasons(f"n{i}")
        assert api.about("n3") == []
        api.renew("n0")
        api.renew("n1")
        await step(clock, mon, 1)
        for i in range(3):
            assert api.reasons(f"n{i}").count("PartitionGuardLifted") == 1
        assert "EvictionStarted" in api.reasons("n2")  # NoExecute resumes for it
        lifted = next(m for _, r, m, _ in api.about("n2") if r == "PartitionGuardLifted")
        assert "1 of 4" in lifted and "within" in lifted
    run(t)


def test_condition_taint_events_say_which_condition() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        register(api, "n1")
        api.nodes["n1"]["metadata"]["uid"] = "uid-n1"
        api.renew("n1")
        post(api, "n1", Ready="True", DiskPressure="True")
        await mon.tick()
        got = {(r, m) for _, r, m, _ in api.about("n1")}
        assert got == {
            ("TaintRemoved", "Removed taint node.kubernetes.io/not-ready:NoSchedule: "
                             "Ready is True."),
            ("TaintAdded", "Added taint node.kubernetes.io/disk-pressure:NoSchedule: "
                           "DiskPressure is True.")}
        assert all(e["involvedObject"]["uid"] == "uid-n1" for e in api.events.values())
        post(api, "n1", DiskPressure="False")
        await mon.tick()
        assert ("TaintRemoved", "Removed taint node.kubernetes.io/disk-pressure:NoSchedule: "
                                "DiskPressure is False.") in {
            (r, m) for _, r, m, _ in api.about("n1")}
    run(t)


def test_the_standby_and_a_failed_write_post_nothing() -> None:
    async def t() -> None:
        clock = FakeClock()
        store = Store(clock)
        api = EventApi(store, clock)
        rec = NodeEvents(api, clock)
        standby = Draining(store, clock, api, period=2, is_leader=lambda: False, events=rec)
        api.add_policy("p", spec(grace=15))
        api.add_node("n1")
        await clock.advance(20)
        await standby.tick()
        assert api.events == {} and api.writes == []

        leader = Draining(store, clock, api, period=2, events=rec, lifecycle=ALONE)
        api.nodes["n1"]["metadata"]["resourceVersion"] = "stale"  # every write: 409
        await leader.tick()
        assert api.events == {}
    asyncio.run(t())


def test_emit_posts_in_the_background_and_drops_past_max_pending() -> None:
    async def t() -> None:
        clock = FakeClock()
        api = EventApi(Store(clock), clock)
        rec = NodeEvents(api, clock, max_pending=3, burst=100)
        for i in range(5):
            rec.emit(NodeEvent(f"n{i}", "u", "Normal", "TaintAdded", "Added taint x: y."))
        assert api.events == {}  # nothing posted yet: emit does not wait
        await rec.drain()
        assert sorted(e["involvedObject"]["name"] for e in api.events.values()) == [
            "n0", "n1", "n2"]
        assert rec.dropped == 2
    asyncio.run(t())
