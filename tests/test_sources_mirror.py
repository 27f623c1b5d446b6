"""Mirror pods: created, replaced on change, deleted when the manifest goes (not
before all sources are ready), refused references reported, no writes when idle.
Runs the API source and the mirror manager against the in-memory API."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import PODS
from nodeagent.pods.podupdate import ANN_CONFIG_MIRROR, Pod, Source
from nodeagent.pods.sources.api import APISource
from nodeagent.pods.sources.merge import Merge
from nodeagent.pods.sources.mirror import MirrorManager
from nodeagent.pods.sources.problems import Problems
from nodeagent.pods.sources.static import check_pod, make_static_pod
from tests.conftest import Sink, aio, until
from tests.fakekube import Call, FakeKube, api_error

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def static(name: str, image: str = "busybox", **spec: object) -> Pod:
    doc = check_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                     "spec": {"containers": [{"name": "c", "image": image}], **spec}}, name)
    return make_static_pod(doc, Source.FILE, "n1", T0)


class Harness:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.kube = FakeKube(now=self.clock.monotonic)
        self.sink = Sink()
        self.merge = Merge([Source.API, Source.FILE], Problems(self.sink))
        self.answered = ApiAnswered(self.clock)
        self.src = APISource(self.kube, ["n1"], self.merge, self.clock, answered=self.answered)
        self.mirrors = MirrorManager(self.kube, "n1", self.merge, self.clock, resync=60.0,
                                     node_uid=lambda: "node-uid-1", answered=self.answered)

    def writes(self) -> list[Call]:
        return [c for c in self.kube.calls if c.verb in ("create", "delete")]

    def verbs(self) -> list[tuple[str, str]]:
        return [(c.verb, f"{c.namespace}/{c.name}") for c in self.writes()]

    async def settled(self, mirrors: dict[str, str]) -> None:
        """Wait until the watch shows exactly `mirrors` (name -> mirror hash) and the
        manager has made a pass over that view."""
        def shown() -> bool:
            return {n: p["metadata"]["annotations"][ANN_CONFIG_MIRROR]
                    for n, p in self.merge.mirrors.items()} == mirrors
        await until(shown)
        n = self.mirrors.passes
        await settle()
        await asyncio.wait_for(self.mirrors.wait_passes(n), 5)


def run(body: Callable[[Harness], Awaitable[None]],
        before: Callable[[Harness], None] | None = None) -> None:
    async def main() -> None:
        h = Harness()
        if before:
            before(h)
        tasks = [asyncio.create_task(h.src.run()), asyncio.create_task(h.mirrors.run())]
        try:
            await asyncio.wait_for(until(lambda: h.merge.ready.seen(Source.API)
                                         and h.src.reflector.connected.is_set()), 5)
            await body(h)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    aio(main)()


def uid(p: Pod) -> str:
    return p["metadata"]["uid"]


def test_created_replaced_deleted() -> None:
    async def body(h: Harness) -> None:
        web = static("web")
        h.merge.set(Source.FILE, [web])
        await h.settled({"default/web-n1": uid(web)})
        # a create tells the API-answers signal (the static pod's status writes, refused
        # until the mirror existed, go at once): once, after the POST
        assert h.answered.delivered == 1
        sent, = h.writes()
        assert (sent.verb, sent.resource, sent.namespace) == ("create", "pods", "default")
        assert sent.body is not None
        meta = sent.body["metadata"]
        assert meta["annotations"][ANN_CONFIG_MIRROR] == uid(web)
        assert meta["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": "n1",
                                            "uid": "node-uid-1", "controller": True}]
        assert sent.body["spec"]["nodeName"] == "n1" and "uid" not in meta
        # nothing to do: a resync writes nothing
        await h.clock.advance(60.0)
        await h.settled({"default/web-n1": uid(web)})
        assert len(h.writes()) == 1
        # the manifest changed: the mirror is replaced
        old_mirror_uid = h.merge.mirrors["default/web-n1"]["metadata"]["uid"]
        web2 = static("web", image="nginx")
        h.merge.set(Source.FILE, [web2])
        await h.settled({"default/web-n1": uid(web2)})
        assert h.verbs()[1:] == [("delete", "default/web-n1"), ("create", "default/web-n1")]
        options = h.writes()[1].body
        assert options == {"gracePeriodSeconds": 0, "preconditions": {"uid": old_mirror_uid}}
        # the manifest went: the mirror goes
        h.merge.set(Source.FILE, [])
        await h.settled({})
        assert h.verbs()[3:] == [("delete", "default/web-n1")]
        assert h.answered.delivered == 2  # the replacement's POST told; deletes tell nothing
    run(body)


def test_nothing_is_written_before_the_api_source_has_listed() -> None:
    async def main() -> None:
        merge = Merge([Source.API, Source.FILE])
        kube = FakeKube()
        mgr = MirrorManager(kube, "n1", merge, FakeClock(), node_uid=lambda: "node-uid-1")
        merge.set(Source.FILE, [static("web")])
        assert await mgr.sync_once() is True and mgr.creates == 0 and mgr.deletes == 0
        assert kube.calls == []
    aio(main)()


def test_orphans_wait_for_all_sources() -> None:
    def before(h: Harness) -> None:
        orphan = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "old-n1", "namespace": "default", "uid": "orphan-uid",
            "annotations": {ANN_CONFIG_MIRROR: "gone-hash"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]}}
        h.kube.put(PODS, orphan)

    async def body(h: Harness) -> None:
        await h.settled({"default/old-n1": "gone-hash"})
        assert not h.merge.ready.all_ready() and h.writes() == []  # file not ready yet
        h.merge.set(Source.FILE, [])  # now every source has delivered
        await h.settled({})
        assert h.verbs() == [("delete", "default/old-n1")]
    run(body, before)


def test_references_are_refused_and_reported() -> None:
    async def body(h: Harness) -> None:
        bad = static("bad", volumes=[{"name": "s", "secret": {"secretName": "x"}}])
        good = static("good")
        h.merge.set(Source.FILE, [bad, good])
        await h.settled({"default/good-n1": uid(good)})
        assert h.verbs() == [("create", "default/good-n1")]
        (reason, message), = h.sink.events
        assert reason == "StaticPodMirrorRefused"
        assert "default/bad-n1" in message and "spec.volumes[0].secret" in message
        await h.clock.advance(60.0)
        await h.settled({"default/good-n1": uid(good)})
        assert len(h.sink.events) == 1 and len(h.writes()) == 1
        assert {p["metadata"]["name"] for p in h.merge.pods()} == {"bad-n1", "good-n1"}
    run(body)


def test_a_refused_create_is_reported_and_retried() -> None:
    refused = [True]

    async def body(h: Harness) -> None:
        h.kube.intercept("create pods", lambda _: api_error(
            403, message='node "n1" can only create pods with an owner reference set to '
                         'itself') if refused[0] else None)
        web = static("web")
        h.merge.set(Source.FILE, [web])
        await until(lambda: len(h.writes()) == 1)
        await settle()
        assert h.clock.sleepers == 1  # waiting out the backoff
        (reason, message), = h.sink.events
        assert reason == "StaticPodMirrorRefused"
        assert "HTTP 403" in message and "owner reference" in message
        refused[0] = False
        await h.clock.advance(1.0)  # the retry after backoff
        await h.settled({"default/web-n1": uid(web)})
        assert len(h.writes()) == 2
    run(body)


def test_a_mirror_waits_for_its_node_to_be_registered() -> None:
    """The Node's UID comes from the node's own registration; before it, no create."""
    uids: dict[str, str] = {}

    async def body(h: Harness) -> None:
        h.mirrors.node_uid = lambda: uids.get("n1")
        web = static("web")
        h.merge.set(Source.FILE, [web])
        await until(lambda: h.mirrors.passes >= 2)  # the source listed; the file came
        await settle()
        assert h.writes() == [] and h.clock.sleepers == 1
        uids["n1"] = "node-uid-1"
        await h.clock.advance(1.0)  # the retry after backoff
        await h.settled({"default/web-n1": uid(web)})
        assert h.verbs() == [("create", "default/web-n1")]
        assert not [c for c in h.kube.calls if c.resource == "nodes"]  # never fetched
    run(body)
