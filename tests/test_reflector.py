"""The one list-and-watch, on the in-memory API and a fake clock: pagination, resume
from the last resourceVersion (bookmarks included), relist only on 410 (LIST or the
streaming list), backoff (doubling, starting over, Retry-After served in full), and the
API-answers-again signal both ways."""

from __future__ import annotations

import asyncio
from typing import Any

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import NODES, Obj
from nodeagent.api.reflector import Reflector, ReflectorConfig
from tests.conftest import aio
from tests.fakekube import FakeKube, api_error


class Seen:
    """A handler that writes down what it was given."""

    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self.changes: list[tuple[str, str]] = []

    def on_list(self, items: list[Obj]) -> None:
        self.lists.append(sorted(o["metadata"]["name"] for o in items))

    def on_events(self, events: list[tuple[str, Obj]]) -> None:
        self.changes += [(kind, o["metadata"]["name"]) for kind, o in events]


class Rig:
    def __init__(self, **config: Any) -> None:
        self.clock = FakeClock()
        self.kube = FakeKube(now=self.clock.monotonic)
        self.seen = Seen()
        self.answered = ApiAnswered(self.clock)
        self.r = Reflector(self.kube, ReflectorConfig(NODES, "test watch", **config),
                           self.seen, self.clock, answered=self.answered)
        self.task: asyncio.Task[None] | None = None

    def node(self, name: str, **labels: str) -> None:
        self.kube.put(NODES, {"metadata": {"name": name, "labels": labels}})

    async def start(self, down: bool = False) -> None:
        """Run the reflector; `down`: against an API server that answers 503."""
        self.kube.down = down
        self.task = asyncio.create_task(self.r.run())
        await settle()

    async def stop(self) -> None:
        self.r.stop()
        assert self.task is not None
        await asyncio.wait_for(self.task, 1)  # stop() alone ends run()


@aio
async def test_pages_then_watch_from_the_list_and_resume_without_relist() -> None:
    rig = Rig(page_size=2, label_selector="pool=a")
    for i in range(5):
        rig.node(f"n{i}", pool="a")
    rig.node("other", pool="b")
    await rig.start()
    assert rig.seen.lists == [[f"n{i}" for i in range(5)]]
    lists = rig.kube.calls_of("list nodes")
    assert [c.query.get("cont") for c in lists] == [None, f"{106}:2", f"{106}:4"]
    assert all(c.query["limit"] == 2 and c.query["labelSelector"] == "pool=a" for c in lists)
    watch = rig.kube.calls_of("watch nodes")[0]
    assert watch.query["resourceVersion"] == "106" and rig.r.connected.is_set()
    assert 300 <= watch.query["timeoutSeconds"] <= 600  # jittered: watches do not end together
    rig.kube.annotate(NODES, "n1", "k", "v")
    rig.kube.remove(NODES, "n2")
    rig.node("n9", pool="a")
    await settle()
    assert rig.seen.changes == [("MODIFIED", "n1"), ("DELETED", "n2"), ("ADDED", "n9")]
    rig.kube.bump()
    rig.kube.bookmark(NODES)  # moves the resourceVersion on, delivers nothing
    await settle()
    assert rig.r.resource_version == rig.kube.resource_version
    held = rig.r.resource_version
    rig.kube.drop()  # the server ends the watch: reopened from where it was
    await settle()
    assert rig.kube.calls_of("watch nodes")[-1].query["resourceVersion"] == held
    assert rig.r.lists == 1 and rig.r.relists == 0 and rig.r.resumes == 1
    assert rig.kube.count("list nodes") == 3 and len(rig.seen.changes) == 3
    await rig.stop()


@aio
async def test_410_relists_by_list_or_by_streaming_list() -> None:
    for streaming in (False, True):
        rig = Rig(streaming_relist=streaming)
        rig.node("a")
        rig.node("b")
        await rig.start()
        rig.kube.drop(ConnectionResetError("cut"))
        rig.kube.down = True
        await settle()
        rig.kube.remove(NODES, "a")
        rig.node("c")
        rig.kube.compact()
        rig.kube.down = False
        await rig.clock.advance(0.5)  # the backoff; the resume gets 410; the relist
        assert rig.seen.lists == [["a", "b"], ["b", "c"]], streaming
        assert rig.r.relists == 1 and rig.r.lists == 2
        assert rig.kube.count("list nodes") == (1 if streaming else 2)
        rig.node("d")  # and the watch goes on from the relist
        await settle()
        assert rig.seen.changes[-1] == ("ADDED", "d")
        await rig.stop()


@aio
async def test_streaming_relist_refused_or_unfinished_falls_back_to_list() -> None:
    for how in ("refused", "unfinished"):
        rig = Rig(streaming_relist=True)
        rig.node("a")
        rig.kube.watchlist = how != "refused"
        rig.kube.watchlist_unfinished = how == "unfinished"
        await rig.start()
        rig.kube.compact()
        rig.kube.expire_next_watch = True
        rig.kube.drop()  # ended at once with nothing: the next watch waits a second
        await rig.clock.advance(1)
        if how == "unfinished":  # a half-delivered relist changes nothing, then a backoff
            assert rig.seen.lists == [["a"]] and rig.clock.sleepers >= 1
            await rig.clock.advance(0.5)
        assert not rig.r.streaming_relist and rig.kube.count("list nodes") == 2, how
        assert rig.seen.lists == [["a"], ["a"]]
        await rig.stop()


@aio
async def test_an_expired_continue_token_starts_the_list_over() -> None:
    rig = Rig(page_size=1)
    rig.node("a")
    rig.node("b")
    tokens: list[str] = []

    def expire(call: Any) -> Any:
        tokens.append(call.query.get("cont", ""))
        return api_error(410, "Expired") if len(tokens) == 2 else None
    rig.kube.fail("list nodes", expire, expire)
    await rig.start()
    assert rig.seen.lists == [["a", "b"]] and tokens[0] == ""
    assert [c.query.get("cont") is None for c in rig.kube.calls_of("list nodes")] == \
        [True, False, True, False]
    await rig.stop()


@aio
async def test_backoff_doubles_to_its_ceiling_and_starts_over_after_a_working_watch() -> None:
    rig = Rig(backoff_initial=1.0, backoff_max=8.0)
    await rig.start(down=True)
    waits = []
    for _ in range(5):
        before = rig.kube.count("list nodes")
        t0 = rig.clock.monotonic()
        while rig.kube.count("list nodes") == before:
            await rig.clock.advance(0.5)
        waits.append(rig.clock.monotonic() - t0)
    assert waits == [1, 2, 4, 8, 8]
    rig.kube.down = False
    await rig.clock.advance(8)
    rig.node("a")
    await settle()
    assert rig.seen.changes == [("ADDED", "a")]  # the watch worked...
    rig.kube.drop(ConnectionResetError("cut"))  # ...then broke mid-stream
    await settle()
    watches = rig.kube.count("watch nodes")
    await rig.clock.advance(1)  # the first step of a new backoff, not 8 s
    assert rig.kube.count("watch nodes") == watches + 1 and rig.r.relists == 0
    await rig.stop()


@aio
async def test_the_signal_ends_a_backoff_but_not_a_retry_after() -> None:
    rig = Rig(backoff_initial=0.5, backoff_max=30.0)
    await rig.start(down=True)
    for _ in range(7):  # 0.5, 1, 2, ... 30
        await rig.clock.advance(30)
    calls = len(rig.kube.calls)
    rig.kube.down = False
    rig.answered.fire()  # another request went through: try now
    await settle()
    assert len(rig.kube.calls) == calls + 2  # the list and the watch
    assert rig.r.connected.is_set()
    # the server asks for 20 s: a signal meanwhile does not cut that short
    rig.kube.fail("watch nodes", api_error(429, retry_after=20))
    rig.kube.drop()
    await rig.clock.advance(1)  # (a watch that ended at once with nothing: 1 s)
    assert rig.kube.count("watch nodes") == 2  # refused with 429
    rig.answered.fire()
    await rig.clock.advance(19.5)
    assert rig.kube.count("watch nodes") == 2
    await rig.clock.advance(0.5)
    assert rig.kube.count("watch nodes") == 3
    await rig.stop()


@aio
async def test_fires_the_signal_when_it_gets_through_after_failures() -> None:
    rig = Rig()
    rig.kube.fail("list nodes", ConnectionRefusedError("refused"))
    await rig.start()
    assert rig.answered.delivered == 0
    await rig.clock.advance(0.5)
    assert rig.seen.lists == [[]] and rig.answered.delivered == 1
    rig.kube.drop()  # a plain resume is no news
    await settle()
    await rig.clock.advance(1)
    assert rig.answered.delivered == 1
    await rig.stop()


@aio
async def test_a_close_error_does_not_hide_the_410() -> None:
    rig = Rig()
    await rig.start()
    rig.kube.expire_next_watch = True
    rig.kube.close_error = RuntimeError("already released to the pool")
    rig.kube.drop()
    await settle()
    await rig.clock.advance(1)
    assert rig.r.relists == 1 and rig.r.lists == 2
    rig.kube.close_error = None
    await rig.stop()
