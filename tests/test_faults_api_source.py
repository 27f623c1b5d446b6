"""The API source's (and the node watch's) backoff after an outage (found by the network-cut e2e fault: after
one outage had grown the backoff to its 30 s ceiling, every later break of a healthy
watch waited 30 s before reconnecting, because only a cleanly ended stream reset it).

The in-test API server of tests/test_sources_api.py sits behind a loopback TCP proxy
that can drop the connection mid-stream, as a network cut does; the source's backoff
sleeps are on a FakeClock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from e2e.tcpproxy import TcpProxy
from nodeagent.api.client import new_api_client
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import NODES
from nodeagent.node.watch import NodeWatch
from nodeagent.sources.api import APISource
from nodeagent.sources.types import Op
from tests.fakekube import FakeKube
from tests.test_merge import until
from tests.test_sources_api import FakeAPIServer, Harness, kubeconfig, mkpod, run, serving


@pytest.fixture
def server() -> Iterator[FakeAPIServer]:
    yield from serving()


def run_via(proxy: TcpProxy, server: FakeAPIServer, tmp_path: Path,
            body: Callable[[Harness], Awaitable[None]]) -> None:
    """tests/test_sources_api.run, with the source talking to the server through
    `proxy`."""
    async def main() -> None:
        h = Harness(server, tmp_path, ["n1"])
        h.api.close()
        h.api = new_api_client(kubeconfig(tmp_path, f"http://127.0.0.1:{proxy.port}"))
        h.src = APISource(h.api, ["n1"], h.merge, h.clock)
        task = asyncio.create_task(h.src.run())
        try:
            await body(h)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            h.api.close()
    asyncio.run(main())


def test_backoff_starts_over_after_a_watch_that_worked(server: FakeAPIServer,
                                                       tmp_path: Path) -> None:
    target = int(server.url.rsplit(":", 1)[1])
    with TcpProxy("127.0.0.1", target) as proxy:
        server.down = True  # a long outage first: the backoff grows to its ceiling

        async def body(h: Harness) -> None:
            for _ in range(9):  # 0.5, 1, 2, 4, 8, 16, 30, 30, ...
                await until(lambda: h.clock.sleepers == 1)
                await h.clock.advance(30.0)
            await until(lambda: h.clock.sleepers == 1)  # failed again: waiting 30 s
            server.down = False
            await h.clock.advance(30.0)
            await h.watching(1)
            server.create(mkpod("a"))
            assert await h.next() == (Op.ADD, ["a"])  # the watch works
            watches = server.verbs()[1]
            proxy.cut()     # the connection drops mid-stream: no clean end
            proxy.resume()
            await until(lambda: h.clock.sleepers == 1 and not h.src.connected.is_set())
            await h.clock.advance(1.0)  # the first step of a new backoff, not 30 s
            await until(lambda: server.verbs()[1] > watches)
            server.create(mkpod("b"))
            assert await h.next() == (Op.ADD, ["b"])
            assert h.src.relists == 0  # resumed from its resourceVersion

        run_via(proxy, server, tmp_path, body)


def test_api_answered_ends_the_backoff_under_way(server: FakeAPIServer,
                                                 tmp_path: Path) -> None:
    """The node's Lease goes through again (api_answered): the pod watch, waiting out a
    30 s backoff, reconnects now; a later failure backs off again."""
    server.down = True

    async def body(h: Harness) -> None:
        for _ in range(7):  # 0.5, 1, 2, 4, 8, 16, 30
            await until(lambda: h.clock.sleepers == 1)
            await h.clock.advance(30.0)
        await until(lambda: h.clock.sleepers == 1)  # failed again: waiting 30 s
        server.down = False
        h.src.api_answered()
        await h.watching(1)  # no clock advance: the wait ended
        assert h.clock.sleepers == 0
        verbs = server.verbs()
        server.create(mkpod("a"))
        assert await h.next() == (Op.ADD, ["a"])
        h.src.api_answered()  # nothing under way: nothing changes
        server.create(mkpod("b"))
        assert await h.next() == (Op.ADD, ["b"])
        assert server.verbs() == verbs  # the same watch

    run(server, tmp_path, body)


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
