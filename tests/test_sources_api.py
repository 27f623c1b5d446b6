"""The API source against the in-memory API (tests/fakekube.py), which speaks the
list/watch protocol: pagination, watch streams, bookmarks, 410 ERROR events,
sendInitialEvents. Listing, resuming and relisting are the reflector's (its own tests
are tests/test_reflector.py); here, what reaches the merge, and when. Backoff sleeps
are on a FakeClock.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import PODS, Obj
from nodeagent.pods.podupdate import Op, PodUpdate, Source
from nodeagent.pods.sources.api import APISource
from nodeagent.pods.sources.merge import Merge
from tests.conftest import mkpod, until
from tests.fakekube import FakeKube

WAIT = 5.0


class Harness:
    def __init__(self, nodes: list[str], kube: FakeKube | None = None, **kw: Any) -> None:
        self.clock = FakeClock()
        self.kube = kube or FakeKube()
        self.kube._now = self.clock.monotonic
        self.merge = Merge([Source.API])
        self.src = APISource(self.kube, nodes, self.merge, self.clock, **kw)
        self.r = self.src.reflector

    # the API server's side
    def create(self, pod: Obj) -> Obj:
        return self.kube.put(PODS, pod)

    update = create

    def delete(self, pod: Obj) -> None:
        self.kube.remove(PODS, pod["metadata"]["name"], pod["metadata"]["namespace"])

    def verbs(self) -> tuple[int, int]:
        """(LIST requests, WATCH requests) so far."""
        return self.kube.count("list pods"), self.kube.count("watch pods")

    async def next(self) -> tuple[Op, list[str]]:
        u: PodUpdate = await asyncio.wait_for(self.merge.updates.get(), WAIT)
        return u.op, sorted(p["metadata"]["name"] for p in u.pods)

    def nothing(self) -> None:
        assert self.merge.updates.empty(), self.merge.updates.get_nowait()

    async def watching(self, n: int) -> None:
        """Wait until the source has opened its n-th watch."""
        await until(lambda: self.r.watches >= n and self.kube.watches_open >= 1, timeout=WAIT)


def run(body: Callable[[Harness], Awaitable[None]], nodes: list[str] | None = None,
        before: Callable[[Harness], object] | None = None, **kw: Any) -> None:
    async def main() -> None:
        h = Harness(nodes or ["n1"], **kw)
        if before:
            before(h)
        task = asyncio.create_task(h.src.run())
        try:
            await body(h)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())


def test_paginated_list_then_watch_from_its_version() -> None:
    def before(h: Harness) -> None:
        for i in range(5):
            h.create(mkpod(f"p{i}"))
        h.create(mkpod("elsewhere", node="n2"))

    async def body(h: Harness) -> None:
        assert await h.next() == (Op.ADD, [f"p{i}" for i in range(5)])
        await h.watching(1)
        lists = h.kube.calls_of("list pods")
        assert [c.query.get("cont", "").partition(":")[2] for c in lists] == ["", "2", "4"]
        assert all(c.query["limit"] == 2 and c.query["fieldSelector"] == "spec.nodeName=n1"
                   for c in lists)
        watch = h.kube.calls_of("watch pods")[-1]
        assert watch.query["resourceVersion"] == h.kube.resource_version
        assert h.merge.ready.all_ready() and h.r.lists == 1
        pod = h.merge.pods()[0]
        assert pod["kind"] == "Pod" and pod["apiVersion"] == "v1"  # a LIST's items lack them
    run(body, before=before, page_size=2)


def test_watch_events_become_ops() -> None:
    async def body(h: Harness) -> None:
        await h.watching(1)
        h.nothing()
        a = h.create(mkpod("a"))
        assert await h.next() == (Op.ADD, ["a"])
        h.create(mkpod("other", node="n2"))  # not ours: filtered by the server
        b = copy.deepcopy(a)
        b["spec"]["containers"][0]["image"] = "img2"
        h.update(b)
        assert await h.next() == (Op.UPDATE, ["a"])
        c = copy.deepcopy(b)
        c["status"] = {"phase": "Running"}
        h.update(c)
        assert await h.next() == (Op.RECONCILE, ["a"])
        h.update(c)  # a write that changes nothing the node cares about
        d = copy.deepcopy(c)
        d["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:30Z"
        d["metadata"]["deletionGracePeriodSeconds"] = 30
        h.update(d)
        assert await h.next() == (Op.DELETE, ["a"])
        h.delete(d)
        assert await h.next() == (Op.REMOVE, ["a"])
        await settle()
        h.nothing()
        assert h.r.lists == 1 and h.r.relists == 0
        assert h.r.resource_version == h.kube.resource_version
    run(body)


def test_pods_are_kept_without_their_managed_fields() -> None:
    """Nothing reads them, and they are a large part of every pod the agent keeps."""
    def with_fields(name: str) -> Obj:
        pod = mkpod(name)
        pod["metadata"]["managedFields"] = [{"manager": "kube-controller-manager",
                                             "operation": "Update", "fieldsV1": {}}]
        return pod

    async def body(h: Harness) -> None:
        assert await h.next() == (Op.ADD, ["listed"])
        await h.watching(1)
        h.create(with_fields("watched"))
        assert await h.next() == (Op.ADD, ["watched"])
        kept = {p["metadata"]["name"]: p["metadata"] for p in h.merge.pods()}
        assert set(kept) == {"listed", "watched"}
        assert not any("managedFields" in meta for meta in kept.values())
    run(body, before=lambda h: h.create(with_fields("listed")))


def test_dropped_connection_resumes_from_last_version() -> None:
    async def body(h: Harness) -> None:
        assert await h.next() == (Op.ADD, ["a"])
        await h.watching(1)
        h.kube.bump()
        h.kube.bump()
        h.kube.bookmark(PODS)  # the bookmark moves our resourceVersion on
        await until(lambda: h.r.resource_version == h.kube.resource_version)
        seen = h.r.resource_version
        h.kube.down = True
        h.kube.drop()
        # the stream ends (a resume), the reconnect fails: backoff on the fake clock
        await until(lambda: h.clock.sleepers == 1 and h.verbs()[1] >= 2)
        created = h.create(mkpod("during-outage"))
        h.kube.down = False
        await h.clock.advance(1.0)
        assert await h.next() == (Op.ADD, ["during-outage"])
        await settle()
        h.nothing()  # delivered once
        assert h.kube.calls_of("watch pods")[-1].query["resourceVersion"] == seen
        assert h.verbs()[0] == 1  # still only the initial LIST
        assert h.r.lists == 1 and h.r.relists == 0 and h.r.resumes >= 2
        assert h.r.resource_version == created["metadata"]["resourceVersion"]
        # the API server answers again: told once, when the watch reopened (the first
        # connect and the plain resume before the outage are no reconnect)
        assert h.r.answered.delivered == 1
    run(body, before=lambda h: h.kube.put(PODS, mkpod("a")))


def _outage_changes(h: Harness, a: dict, b: dict) -> None:
    """While the source is disconnected: delete a, change b, add c, then let history
    go so that the source's resourceVersion is too old (410)."""
    h.kube.down = True
    h.kube.drop(ConnectionResetError("the API server went away"))
    h.delete(a)
    b2 = copy.deepcopy(b)
    b2["spec"]["containers"][0]["image"] = "img2"
    h.update(b2)
    h.create(mkpod("c"))
    h.kube.compact()


@pytest.mark.parametrize("watchlist", [True, False])
def test_gone_relists_and_emits_only_differences(watchlist: bool) -> None:
    pods: list[Obj] = []

    def before(h: Harness) -> None:
        pods.extend([h.create(mkpod("a")), h.create(mkpod("b"))])
        h.create(mkpod("same"))
        h.kube.watchlist = watchlist

    async def body(h: Harness) -> None:
        assert await h.next() == (Op.ADD, ["a", "b", "same"])
        await h.watching(1)
        _outage_changes(h, *pods)
        await until(lambda: h.clock.sleepers == 1)
        h.kube.down = False
        await h.clock.advance(1.0)
        got = [await h.next(), await h.next(), await h.next()]
        assert got == [(Op.REMOVE, ["a"]), (Op.ADD, ["c"]), (Op.UPDATE, ["b"])]
        await settle()
        h.nothing()
        assert h.r.relists == 1 and h.r.lists == 2
        lists, _ = h.verbs()
        if watchlist:
            assert lists == 1  # the relist streamed through a watch: no LIST call
            assert any(c.query.get("sendInitialEvents") for c in h.kube.calls_of("watch pods"))
        else:
            assert lists == 2 and not h.r.streaming_relist  # fell back to LIST
        h.create(mkpod("after"))  # and the watch goes on from the relist
        assert await h.next() == (Op.ADD, ["after"])
    run(body, before=before)


def test_streaming_relist_that_never_finishes_falls_back_to_list() -> None:
    pods: list[Obj] = []

    def before(h: Harness) -> None:
        pods.extend([h.create(mkpod("a")), h.create(mkpod("b"))])
        h.kube.watchlist_unfinished = True

    async def body(h: Harness) -> None:
        assert await h.next() == (Op.ADD, ["a", "b"])
        await h.watching(1)
        _outage_changes(h, *pods)
        await until(lambda: h.clock.sleepers == 1)
        h.kube.down = False
        await h.clock.advance(0.5)  # resume -> 410 -> streaming relist, which ends early
        await until(lambda: not h.r.streaming_relist and h.clock.sleepers >= 1)
        h.nothing()  # a half-delivered relist changes nothing
        await h.clock.advance(30.0)  # the retry relists with LIST
        got = [await h.next(), await h.next(), await h.next()]
        assert got == [(Op.REMOVE, ["a"]), (Op.ADD, ["c"]), (Op.UPDATE, ["b"])]
        assert h.verbs()[0] == 2 and h.r.relists == 1
    run(body, before=before)


def test_many_nodes_share_one_watch() -> None:
    def before(h: Harness) -> None:
        h.create(mkpod("on-n1", node="n1"))
        h.create(mkpod("on-n2", node="n2"))
        h.create(mkpod("on-n3", node="n3"))

    async def body(h: Harness) -> None:
        assert await h.next() == (Op.ADD, ["on-n1", "on-n2"])
        await h.watching(1)
        assert h.kube.calls_of("list pods")[0].query["fieldSelector"] == "spec.nodeName!="
        h.create(mkpod("late-n3", node="n3"))
        h.create(mkpod("late-n2", node="n2"))
        assert await h.next() == (Op.ADD, ["late-n2"])
        await settle()
        h.nothing()
        assert {p["spec"]["nodeName"] for p in h.merge.pods()} == {"n1", "n2"}
    run(body, nodes=["n1", "n2"], before=before)


def test_needs_a_node() -> None:
    with pytest.raises(ValueError, match="at least one node"):
        APISource(FakeKube(), [], Merge([Source.API]), FakeClock())


# -- backoff after an outage (found by the network-cut e2e fault: after one outage had
# grown the backoff to its 30 s ceiling, every later break of a healthy watch waited
# 30 s before reconnecting, because only a cleanly ended stream reset it). A connection
# cut mid-stream is a watch stream that breaks with a connection error.

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
