"""Mirror pods: created, replaced on change, deleted when the manifest goes (not
before all sources are ready), refused references reported, no writes when idle.
Runs the API source and the mirror manager against the in-test API server."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from nodeagent.api.client import new_api_client
from nodeagent.api.clock import FakeClock, settle
from nodeagent.sources.api import APISource
from nodeagent.sources.merge import Merge
from nodeagent.sources.mirror import MirrorManager
from nodeagent.sources.problems import Problems
from nodeagent.sources.static import check_pod, make_static_pod
from nodeagent.sources.types import ANN_CONFIG_MIRROR, Pod, Source
from tests.test_merge import Sink, aio, until
from tests.test_sources_api import FakeAPIServer, kubeconfig, serving


@pytest.fixture
def server() -> Iterator[FakeAPIServer]:
    yield from serving()


T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def static(name: str, image: str = "busybox", **spec: object) -> Pod:
    doc = check_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                     "spec": {"containers": [{"name": "c", "image": image}], **spec}}, name)
    return make_static_pod(doc, Source.FILE, "n1", T0)


class Harness:
    def __init__(self, server: FakeAPIServer, tmp_path: Path) -> None:
        self.server = server
        server.nodes["n1"] = "node-uid-1"
        self.clock = FakeClock()
        self.sink = Sink()
        self.merge = Merge([Source.API, Source.FILE], Problems(self.sink))
        self.api = new_api_client(kubeconfig(tmp_path, server.url))
        self.src = APISource(self.api, ["n1"], self.merge, self.clock)
        self.mirrors = MirrorManager(self.api, "n1", self.merge, self.clock, resync=60.0)

    def writes(self) -> list[tuple[str, str]]:
        return [(verb, path) for verb, path, _ in self.server.writes]

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


def run(server: FakeAPIServer, tmp_path: Path, body: Callable[[Harness], Awaitable[None]],
        before: Callable[[FakeAPIServer], None] | None = None) -> None:
    async def main() -> None:
        h = Harness(server, tmp_path)
        if before:
            before(server)
        tasks = [asyncio.create_task(h.src.run()), asyncio.create_task(h.mirrors.run())]
        try:
            await asyncio.wait_for(_api_ready(h), 5)
            await body(h)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            h.api.close()
    aio(main())


async def _api_ready(h: Harness) -> None:
    await until(lambda: h.merge.ready.seen(Source.API) and h.src.connected.is_set())


def uid(p: Pod) -> str:
    return p["metadata"]["uid"]


def test_created_replaced_deleted(server: FakeAPIServer, tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        created: list[int] = []  # the hook the pod status writes retry on
        h.mirrors.on_created.append(lambda: created.append(len(server.writes)))
        web = static("web")
        h.merge.set(Source.FILE, [web])
        await h.settled({"default/web-n1": uid(web)})
        await until(lambda: bool(created))  # the watch may show the mirror first
        assert created == [1]  # told once, after the POST
        (verb, path, sent), = server.writes
        assert (verb, path) == ("POST", "/api/v1/namespaces/default/pods")
        meta = sent["metadata"]
        assert meta["annotations"][ANN_CONFIG_MIRROR] == uid(web)
        assert meta["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": "n1",
                                            "uid": "node-uid-1", "controller": True}]
        assert sent["spec"]["nodeName"] == "n1" and "uid" not in meta
        # nothing to do: a resync writes nothing
        await h.clock.advance(60.0)
        await h.settled({"default/web-n1": uid(web)})
        assert len(server.writes) == 1
        # the manifest changed: the mirror is replaced
        old_mirror_uid = h.merge.mirrors["default/web-n1"]["metadata"]["uid"]
        web2 = static("web", image="nginx")
        h.merge.set(Source.FILE, [web2])
        await h.settled({"default/web-n1": uid(web2)})
        assert h.writes()[1:] == [("DELETE", "/api/v1/namespaces/default/pods/web-n1"),
                                  ("POST", "/api/v1/namespaces/default/pods")]
        assert server.writes[1][2]["preconditions"] == {"uid": old_mirror_uid}
        assert server.writes[1][2]["gracePeriodSeconds"] == 0
        # the manifest went: the mirror goes
        h.merge.set(Source.FILE, [])
        await h.settled({})
        assert h.writes()[3:] == [("DELETE", "/api/v1/namespaces/default/pods/web-n1")]
        await until(lambda: len(created) >= 2)
        assert created == [1, 3]  # the replacement's POST told; deletes tell nothing
    run(server, tmp_path, body)


def test_nothing_is_written_before_the_api_source_has_listed(tmp_path: Path) -> None:
    async def main() -> None:
        merge = Merge([Source.API, Source.FILE])
        api = new_api_client(kubeconfig(tmp_path, "http://127.0.0.1:9"))  # never reached
        mgr = MirrorManager(api, "n1", merge, FakeClock())
        merge.set(Source.FILE, [static("web")])
        assert await mgr.sync_once() is True and mgr.creates == 0 and mgr.deletes == 0
        api.close()
    aio(main())


def test_orphans_wait_for_all_sources(server: FakeAPIServer, tmp_path: Path) -> None:
    def before(s: FakeAPIServer) -> None:
        orphan = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "old-n1", "namespace": "default", "uid": "orphan-uid",
            "annotations": {ANN_CONFIG_MIRROR: "gone-hash"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]}}
        s.create(orphan)

    async def body(h: Harness) -> None:
        await h.settled({"default/old-n1": "gone-hash"})
        assert not h.merge.ready.all_ready() and server.writes == []  # file not ready yet
        h.merge.set(Source.FILE, [])  # now every source has delivered
        await h.settled({})
        assert h.writes() == [("DELETE", "/api/v1/namespaces/default/pods/old-n1")]
    run(server, tmp_path, body, before)


def test_references_are_refused_and_reported(server: FakeAPIServer, tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        bad = static("bad", volumes=[{"name": "s", "secret": {"secretName": "x"}}])
        good = static("good")
        h.merge.set(Source.FILE, [bad, good])
        await h.settled({"default/good-n1": uid(good)})
        assert h.writes() == [("POST", "/api/v1/namespaces/default/pods")]
        (reason, message), = h.sink.events
        assert reason == "StaticPodMirrorRefused"
        assert "default/bad-n1" in message and "spec.volumes[0].secret" in message
        await h.clock.advance(60.0)
        await h.settled({"default/good-n1": uid(good)})
        assert len(h.sink.events) == 1 and len(server.writes) == 1
        assert {p["metadata"]["name"] for p in h.merge.pods()} == {"bad-n1", "good-n1"}
    run(server, tmp_path, body)


def test_a_refused_create_is_reported_and_retried(server: FakeAPIServer,
                                                  tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        server.refuse_creates = (403, 'node "n1" can only create pods with an owner '
                                      'reference set to itself')
        web = static("web")
        h.merge.set(Source.FILE, [web])
        await until(lambda: len(server.writes) == 1 and h.clock.sleepers == 1)
        (reason, message), = h.sink.events
        assert reason == "StaticPodMirrorRefused"
        assert "HTTP 403" in message and "owner reference" in message
        server.refuse_creates = None
        await h.clock.advance(1.0)  # the retry after backoff
        await h.settled({"default/web-n1": uid(web)})
        assert len(server.writes) == 2
    run(server, tmp_path, body)
