"""The API source's (and the node watch's) backoff after an outage (found by the
network-cut e2e fault: after one outage had grown the backoff to its 30 s ceiling, every
later break of a healthy watch waited 30 s before reconnecting, because only a cleanly
ended stream reset it).

On the in-memory API: a connection cut mid-stream is a watch stream that breaks with a
connection error; the sources' backoff sleeps are on a FakeClock.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import NODES
from nodeagent.node.watch import NodeWatch
from nodeagent.sources.types import Op
from tests.conftest import until
from tests.fakekube import FakeKube
from tests.test_sources_api import Harness, mkpod, run


def test_backoff_starts_over_after_a_watch_that_worked() -> None:
    async def body(h: Harness) -> None:
        for _ in range(9):  # 0.5, 1, 2, 4, 8, 16, 30, 30, ...
            await until(lambda: h.clock.sleepers == 1)
            await h.clock.advance(30.0)
        await until(lambda: h.clock.sleepers == 1)  # failed again: waiting 30 s
        h.kube.down = False
        await h.clock.advance(30.0)
        await h.watching(1)
        h.create(mkpod("a"))
        assert await h.next() == (Op.ADD, ["a"])  # the watch works
        watches = h.verbs()[1]
        h.kube.drop(ConnectionResetError("cut"))  # the connection drops mid-stream
        await until(lambda: h.clock.sleepers == 1 and not h.r.connected.is_set())
        await h.clock.advance(1.0)  # the first step of a new backoff, not 30 s
        await until(lambda: h.verbs()[1] > watches)
        h.create(mkpod("b"))
        assert await h.next() == (Op.ADD, ["b"])
        assert h.r.relists == 0  # resumed from its resourceVersion

    def before(h: Harness) -> None:
        h.kube.down = True  # a long outage first: the backoff grows to its ceiling
    run(body, before=before)


def test_api_answered_ends_the_backoff_under_way() -> None:
    """The node's Lease goes through again (the ApiAnswered signal): the pod watch,
    waiting out a 30 s backoff, reconnects now; a later failure backs off again."""
    async def body(h: Harness) -> None:
        for _ in range(7):  # 0.5, 1, 2, 4, 8, 16, 30
            await until(lambda: h.clock.sleepers == 1)
            await h.clock.advance(30.0)
        await until(lambda: h.clock.sleepers == 1)  # failed again: waiting 30 s
        h.kube.down = False
        h.r.answered.fire()
        await h.watching(1)  # no clock advance: the wait ended
        assert h.r.connected.is_set()  # watching, not backing off
        verbs = h.verbs()
        h.create(mkpod("a"))
        assert await h.next() == (Op.ADD, ["a"])
        h.r.answered.fire()  # nothing under way: nothing changes
        await settle()
        h.create(mkpod("b"))
        assert await h.next() == (Op.ADD, ["b"])
        assert h.verbs() == verbs  # the same watch

    def before(h: Harness) -> None:
        h.kube.down = True
    run(body, before=before)


# ---- the node watch has the same rule (its ceiling is 8 s)
class NodeRig:
    """A node watch whose watches are refused (connection refused) while `down`."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.kube = FakeKube(now=self.clock.monotonic)
        self.kube.put(NODES, {"metadata": {"name": "n1"}})
        self.down = True
        self.kube.intercept("watch nodes", lambda _: ConnectionRefusedError("refused")
                            if self.down else None)
        self.seen: list[str] = []
        node = SimpleNamespace(on_node=lambda obj: self.seen.append(obj["metadata"]["name"]))
        self.watch = NodeWatch(self.kube, {"n1": node}, self.clock,  # type: ignore[dict-item]
                               agent_id="a")


def test_node_watch_backoff_starts_over_after_a_watch_that_worked() -> None:
    async def main() -> None:
        rig = NodeRig()
        kube, clock = rig.kube, rig.clock
        task = asyncio.create_task(rig.watch.run())
        await settle()
        for _ in range(6):  # refused: 1, 2, 4, 8, 8, 8 s
            await clock.advance(8.0)
        rig.down = False
        await clock.advance(8.0)
        kube.annotate(NODES, "n1", "x", "1")  # an event for the watch to deliver
        await settle()
        assert len(rig.seen) == 2  # the list, then the event: the watch worked...
        kube.drop(ConnectionResetError("Response ended prematurely"))  # ...then broke
        await settle()
        calls = kube.count("watch nodes")
        await clock.advance(1.0)  # the first step of a new backoff, not 8 s
        assert kube.count("watch nodes") > calls
        rig.watch.stop()
        await asyncio.wait_for(task, 1)
    asyncio.run(main())


def test_node_watch_backoff_ends_when_the_api_answers() -> None:
    async def main() -> None:
        rig = NodeRig()
        kube, clock = rig.kube, rig.clock
        task = asyncio.create_task(rig.watch.run())
        await settle()
        for _ in range(5):  # refused: 1, 2, 4, 8, 8 s
            await clock.advance(8.0)
        calls = kube.count("watch nodes")
        rig.watch.reflector.answered.fire()  # a Lease renewal went through: now, not in 8 s
        await settle()
        assert kube.count("watch nodes") == calls + 1
        rig.watch.stop()
        await asyncio.wait_for(task, 1)
    asyncio.run(main())
