"""The monitor's writes run in the background, bounded and most urgent first: a slow
write for one node holds back neither another node's taint nor the next period; a write
that waited is not sent when the node was heard from meanwhile; a node with a write
under way is not planned twice. Against tests/fakekube.py (writes held to play a slow
API server) through the operator's KubeWriter, on a FakeClock; no test sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from nodeoperator.limiter import Limiter
from nodeoperator.modes import EXCLUSIVE, Lifecycle
from nodeoperator.monitor import Monitor
from nodeoperator.nodeevents import NodeEvents
from nodeoperator.state import UNREACHABLE_TAINT, Store
from nodeoperator.writes import KubeWriter
from prometheus_client import REGISTRY

from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import NODE_STATUS_POLICIES, NODES
from nodeagent.api.policy import HEARTBEAT_ANNOTATION, encode_heartbeat_annotation
from tests.fakekube import FakeKube

ALONE = Lifecycle(EXCLUSIVE)
PATCH = "patch nodes"


class Rig:
    """A FakeKube, the Store fed by a watch on it, a monitor writing through
    KubeWriter, and its loop running."""

    def __init__(self, parallel: int) -> None:
        self.clock = FakeClock()
        self.kube = FakeKube(now=self.clock.monotonic)
        self.store = Store(self.clock)
        self.store.lease_sync(set())
        self.writer = KubeWriter(self.kube)
        self.events = NodeEvents(self.writer, self.clock)
        self.monitor = Monitor(self.store, self.clock, self.writer, period=2,
                               parallel=parallel, lifecycle=ALONE, events=self.events)
        self.events.after = self.monitor.marked.wait  # as app.py wires them
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        stream = await self.kube.watch(NODES, resource_version=self.kube.resource_version)

        async def follow() -> None:
            async for batch in stream:
                for ev in batch:
                    self.store.node_event(ev["type"], ev["object"])
        self.tasks += [asyncio.create_task(follow()), asyncio.create_task(self.monitor.run())]
        await settle()

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def policy(self, grace: int = 15, **failure: Any) -> None:
        body = {"metadata": {"name": "p", "generation": 1},
                "spec": {"nodeSelector": {}, "heartbeat": {"leaseDurationSeconds": 10},
                         "failure": {"gracePeriodSeconds": grace, **failure}}}
        self.store.policy_event("ADDED", self.kube.put(NODE_STATUS_POLICIES, body))

    def node(self, name: str, annotated: bool = True) -> None:
        ann = {}
        if annotated:  # as the policy says: nothing to write
            spec = self.store.policies["p"].spec
            assert spec is not None
            ann = {HEARTBEAT_ANNOTATION: encode_heartbeat_annotation("p", spec.heartbeat)}
        self.store.node_event("ADDED", self.kube.put(NODES, {
            "metadata": {"name": name, "annotations": ann}, "spec": {},
            "status": {"conditions": [{"type": "Ready", "status": "True",
                                       "lastHeartbeatTime": "2026-01-01T00:00:00Z"}]}}))

    def renew(self, name: str) -> None:
        self.store.lease_event("MODIFIED", {
            "metadata": {"name": name, "namespace": "kube-node-lease"},
            "spec": {"renewTime": self.clock.now().isoformat()}})

    def taints(self, name: str) -> set[str]:
        return {t["effect"] for t in self.kube.obj(NODES, name)["spec"].get("taints") or []
                if t["key"] == UNREACHABLE_TAINT}

    def ready(self, name: str) -> str:
        return next(c["status"] for c in self.kube.obj(NODES, name)["status"]["conditions"]
                    if c["type"] == "Ready")

    def patched(self) -> list[str]:
        """The nodes whose (main resource) patches were sent, in order."""
        return [c.name or "" for c in self.kube.calls_of(PATCH)]


def run(parallel: int, test: Callable[[Rig], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        rig = Rig(parallel)
        try:
            await test(rig)
        finally:
            await rig.stop()
    asyncio.run(main())


def writes(result: str) -> float:
    return REGISTRY.get_sample_value("nodepulse_operator_writes_total",
                                     {"kind": "node", "result": result}) or 0.0


def test_limiter_bounds_and_lets_the_most_urgent_in_first() -> None:
    async def main() -> None:
        lim = Limiter(2)
        order: list[str] = []
        release = {n: asyncio.Event() for n in ("a", "b", "late", "soon", "routine", "gone")}

        async def hold(name: str, priority: tuple[float, ...]) -> None:
            async with lim.slot(priority):
                order.append(name)
                await release[name].wait()
        tasks = {n: asyncio.create_task(hold(n, p)) for n, p in [
            ("a", (1,)), ("b", (1,)), ("routine", (1,)), ("soon", (0, -5)),
            ("gone", (0, -20)), ("late", (0, -9))]}
        await settle()
        assert order == ["a", "b"] and lim.active == 2 and lim.waiting == 4
        tasks["gone"].cancel()  # gave up waiting: its turn is skipped, no slot lost
        await settle()
        assert lim.waiting == 3
        release["a"].set()
        await settle()
        assert order == ["a", "b", "late"]  # the longest overdue, not the first to come
        release["b"].set()
        release["late"].set()
        await settle()
        assert order == ["a", "b", "late", "soon", "routine"] and lim.active == 2
        release["soon"].set()
        release["routine"].set()
        await settle()
        assert lim.active == 0 and lim.waiting == 0
        with pytest.raises(ValueError, match="at least 1"):
            Limiter(0)
    asyncio.run(main())


def test_a_slow_write_holds_back_neither_another_nodes_taint_nor_the_period() -> None:
    async def t(rig: Rig) -> None:
        rig.policy(grace=15, noExecuteTaintsPerMinute=600)
        for n in ("n1", "n2"):
            rig.node(n)
            rig.renew(n)
        await rig.start()
        slow = rig.kube.hold(PATCH, "n1")  # the API server sits on n1's taint write
        for _ in range(5):  # n2 renews for 5 s more
            await rig.clock.advance(1)
            rig.renew("n2")
        await rig.clock.advance(11)  # 16 s: n1 is past its grace
        assert rig.kube.in_flight(PATCH) == 1 and rig.taints("n1") == set()
        periods = REGISTRY.get_sample_value("nodepulse_operator_monitor_tick_seconds_count")
        await rig.clock.advance(5)  # 21 s: n2's grace runs out while n1's write waits
        assert rig.taints("n2") == {"NoSchedule", "NoExecute"} and rig.ready("n2") == "Unknown"
        assert (REGISTRY.get_sample_value("nodepulse_operator_monitor_tick_seconds_count")
                or 0) > (periods or 0)  # and the periods went on meanwhile
        assert rig.patched().count("n1") == 1  # n1 was not planned again while in flight
        slow.set()
        await settle()
        assert rig.taints("n1") == {"NoSchedule", "NoExecute"} and rig.ready("n1") == "Unknown"
        await rig.clock.advance(6)
        assert rig.patched().count("n1") == 1 and rig.patched().count("n2") == 1
    run(4, t)


def test_past_the_limit_writes_wait_and_a_stale_node_goes_first() -> None:
    async def t(rig: Rig) -> None:
        rig.policy(grace=15)
        rig.node("s")
        rig.renew("s")
        await rig.start()
        await rig.clock.advance(14)
        rig.renew("s")  # s last heard at 14 s, so due at 29 s
        # A policy change: the annotation is rewritten on many nodes at once.
        holds = {n: rig.kube.hold(PATCH, n) for n in ("a", "b")}
        for n in ("a", "b", "c", "d"):
            rig.node(n, annotated=False)
            rig.renew(n)
        await rig.clock.advance(2)
        assert rig.patched() == ["a", "b"]  # two at a time; c and d wait
        for _ in range(14):  # to 30 s: s is stale, its marking waits too
            await rig.clock.advance(1)
            for n in ("a", "b", "c", "d"):
                rig.renew(n)
        assert rig.patched() == ["a", "b"] and rig.taints("s") == set()
        holds["a"].set()
        await settle()
        # The freed slot goes to the stale node, not to the next annotation.
        assert rig.patched()[:3] == ["a", "b", "s"] and rig.taints("s") == {"NoSchedule",
                                                                           "NoExecute"}
        holds["b"].set()
        await rig.clock.advance(1)
        assert sorted(rig.patched()) == ["a", "b", "c", "d", "s"]
    run(2, t)


def test_a_waiting_marking_is_not_sent_once_the_node_is_heard_from() -> None:
    async def t(rig: Rig) -> None:
        rig.policy(grace=15, noExecuteTaintsPerMinute=1)
        rig.node("s")
        rig.renew("s")
        await rig.start()
        busy = rig.kube.hold(PATCH, "x")
        rig.node("x", annotated=False)  # takes the one slot
        for _ in range(31):  # to 15.5 s: s is stale; its marking waits for the slot
            rig.renew("x")
            await rig.clock.advance(0.5)
        assert rig.patched() == ["x"]
        overtaken = writes("overtaken")
        rig.renew("s")  # the agent is back before the write went out
        busy.set()
        await settle()
        assert rig.patched() == ["x"] and writes("overtaken") == overtaken + 1
        assert rig.taints("s") == set() and rig.ready("s") == "True"
        # Its NoExecute token was given back: the next silence is tainted at once.
        for _ in range(32):
            rig.renew("x")
            await rig.clock.advance(0.5)
        assert rig.taints("s") == {"NoSchedule", "NoExecute"}
    run(1, t)


def test_a_marking_s_events_wait_while_other_nodes_are_being_marked() -> None:
    async def t(rig: Rig) -> None:
        rig.policy(grace=15, noExecuteTaintsPerMinute=600)
        for n in ("n1", "n2"):
            rig.node(n)
            rig.renew(n)
        await rig.start()
        slow = rig.kube.hold(PATCH, "n2")
        for _ in range(5):  # n1 renews for 5 s more
            await rig.clock.advance(1)
            rig.renew("n1")
        await rig.clock.advance(16)  # 21 s: n2's marking waits, n1's went through
        assert rig.taints("n1") == {"NoSchedule", "NoExecute"} and rig.ready("n1") == "Unknown"
        assert rig.kube.count("create events") == 0  # n1's Events wait for n2's marking
        slow.set()
        await rig.clock.advance(1)
        reasons = {(b["involvedObject"]["name"], b["reason"], b["firstTimestamp"])
                   for b in rig.kube.bodies("create events")}
        # Stamped when they happened (n1 marked at 20.05 s), not when posted.
        assert {r for r in reasons if r[0] == "n1"} == {
            ("n1", "TaintAdded", "2026-01-01T00:00:20Z"),
            ("n1", "EvictionStarted", "2026-01-01T00:00:20Z"),
            ("n1", "NodeStatusUnknown", "2026-01-01T00:00:20Z")}
        assert {r[1] for r in reasons if r[0] == "n2"} == {"TaintAdded", "EvictionStarted",
                                                           "NodeStatusUnknown"}
    run(4, t)


def test_nodes_falling_silent_together_are_all_tainted_before_any_is_written_twice() -> None:
    """Each marking is two writes (the taint, then Ready=Unknown); with one slot, the
    taints of every node silent at once go before the first status write."""
    async def t(rig: Rig) -> None:
        rig.policy(grace=15)
        names = ["a", "b", "c"]
        for n in names:
            rig.node(n)
            rig.renew(n)
        await rig.start()
        held = rig.kube.hold(PATCH, "a")  # a slow API server: the others queue meanwhile
        await rig.clock.advance(17)  # all three silent past their grace together
        held.set()
        for _ in range(3):
            await rig.clock.advance(1)
        calls = [f"{c.resource} {c.name}" for c in rig.kube.calls
                 if c.key in ("patch nodes", "patch nodes/status")]
        assert calls[:3] == ["nodes a", "nodes b", "nodes c"], calls
        assert sorted(calls[3:]) == ["nodes/status a", "nodes/status b", "nodes/status c"]
        assert all(rig.ready(n) == "Unknown" and "NoSchedule" in rig.taints(n) for n in names)
    run(1, t)
