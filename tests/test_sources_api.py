"""The API source against a small in-test API server on 127.0.0.1 that speaks the
list/watch protocol (pagination, chunked watch streams, bookmarks, 410 ERROR events,
sendInitialEvents). The agent's real HTTP path (kubeconfig -> new_api_client -> raw
JSON requests -> stream splitting) is what runs; backoff sleeps are on a FakeClock.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from nodeagent.api.client import new_api_client
from nodeagent.api.clock import FakeClock, settle
from nodeagent.sources.api import INITIAL_EVENTS_END, APISource
from nodeagent.sources.merge import Merge
from nodeagent.sources.types import Op, PodUpdate, Source
from tests.test_merge import aio, until

WAIT = 5.0


def mkpod(name: str, node: str = "n1", image: str = "img") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": image}]},
            "status": {"phase": "Pending"}}


class FakeAPIServer:
    """Pods with resourceVersions, an event log, and the knobs a test needs: refuse
    requests (down), end all watch streams (drop), forget history (compact)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.rv = 100
        self.pods: dict[str, dict] = {}
        self.log: list[tuple[int, str, dict]] = []
        self.oldest = 0           # a watch from below this gets a 410 ERROR event
        self.generation = 0       # bumped to end every open watch
        self.down = False         # answer 503 to everything
        self.watchlist = True     # sendInitialEvents supported
        self.watchlist_unfinished = False  # initial events, then the stream just ends
        self.stopping = False
        self.requests: list[dict[str, str]] = []
        self.writes: list[tuple[str, str, dict]] = []  # (verb, path, body)
        self.nodes: dict[str, str] = {}  # name -> uid
        self.refuse_creates: tuple[int, str] | None = None
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                url = urllib.parse.urlsplit(self.path)
                q = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
                if url.path.startswith("/api/v1/nodes/"):
                    name = url.path.rsplit("/", 1)[1]
                    if name not in owner.nodes:
                        return self._json(404, {"kind": "Status", "code": 404})
                    return self._json(200, {"kind": "Node", "metadata": {
                        "name": name, "uid": owner.nodes[name]}})
                with owner.cond:
                    owner.requests.append(q)
                if url.path != "/api/v1/pods":
                    return self._json(404, {"kind": "Status", "code": 404})
                if owner.down:
                    return self._json(503, {"kind": "Status", "code": 503,
                                            "message": "down"})
                if q.get("watch") == "true":
                    return self._watch(q)
                return self._list(q)

            def _body(self) -> dict:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n)) if n else {}

            def do_POST(self) -> None:  # noqa: N802
                body = self._body()
                owner.writes.append(("POST", self.path, copy.deepcopy(body)))
                if self.path.endswith("/events"):
                    return self._json(201, body)
                if owner.refuse_creates:
                    code, msg = owner.refuse_creates
                    return self._json(code, {"kind": "Status", "code": code, "message": msg})
                ns = self.path.split("/")[4]
                body["metadata"]["namespace"] = ns
                key = f"{ns}/{body['metadata']['name']}"
                if key in owner.pods:
                    return self._json(409, {"kind": "Status", "code": 409})
                body["metadata"]["uid"] = f"uid-{owner.rv + 1}"
                self._json(201, owner.create(body))

            def do_DELETE(self) -> None:  # noqa: N802
                body = self._body()
                owner.writes.append(("DELETE", self.path, body))
                parts = self.path.split("/")
                key = f"{parts[4]}/{parts[6]}"
                pod = owner.pods.get(key)
                if pod is None:
                    return self._json(404, {"kind": "Status", "code": 404})
                want = (body.get("preconditions") or {}).get("uid")
                if want and want != pod["metadata"]["uid"]:
                    return self._json(409, {"kind": "Status", "code": 409})
                self._json(200, owner.delete(pod))

            def _json(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _list(self, q: dict[str, str]) -> None:
                with owner.cond:
                    items = [p for _, p in sorted(owner.pods.items()) if owner.match(q, p)]
                    rv = owner.rv
                start = int(q.get("continue", "0"))
                limit = int(q.get("limit", "0")) or len(items)
                page = [{k: v for k, v in p.items() if k not in ("kind", "apiVersion")}
                        for p in items[start:start + limit]]
                meta: dict[str, Any] = {"resourceVersion": str(rv)}
                if start + limit < len(items):
                    meta["continue"] = str(start + limit)
                self._json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": meta,
                                 "items": page})

            def _chunk(self, event: dict) -> None:
                data = json.dumps(event).encode() + b"\n"
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _watch(self, q: dict[str, str]) -> None:
                if q.get("sendInitialEvents") == "true" and not owner.watchlist:
                    return self._json(422, {"kind": "Status", "code": 422,
                                            "message": "sendInitialEvents unsupported"})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    with owner.cond:
                        gen = owner.generation
                        if q.get("sendInitialEvents") == "true":
                            since = owner.rv
                            for _, p in sorted(owner.pods.items()):
                                if owner.match(q, p):
                                    self._chunk({"type": "ADDED", "object": p})
                            if owner.watchlist_unfinished:
                                return
                            self._chunk({"type": "BOOKMARK", "object": {
                                "kind": "Pod", "apiVersion": "v1", "metadata": {
                                    "resourceVersion": str(since),
                                    "annotations": {INITIAL_EVENTS_END: "true"}}}})
                        else:
                            since = int(q["resourceVersion"])
                            if since < owner.oldest:
                                self._chunk({"type": "ERROR", "object": {
                                    "kind": "Status", "code": 410, "reason": "Expired",
                                    "message": f"too old resource version: {since} "
                                               f"({owner.oldest})"}})
                                return
                        sent = since
                        while not owner.stopping and owner.generation == gen:
                            for rv, etype, obj in owner.log:
                                if rv <= sent:
                                    continue
                                sent = rv
                                if etype == "BOOKMARK":
                                    if q.get("allowWatchBookmarks") == "true":
                                        self._chunk({"type": etype, "object": obj})
                                elif owner.match(q, obj):
                                    self._chunk({"type": etype, "object": obj})
                            owner.cond.wait(0.2)
                finally:
                    with contextlib.suppress(OSError):
                        self.wfile.write(b"0\r\n\r\n")
                    self.close_connection = True

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    @staticmethod
    def match(q: dict[str, str], pod: dict) -> bool:
        sel = q.get("fieldSelector", "")
        node = pod.get("spec", {}).get("nodeName", "")
        if sel.startswith("spec.nodeName!="):
            return node != sel.split("!=", 1)[1]
        if sel.startswith("spec.nodeName="):
            return node == sel.split("=", 1)[1]
        return True

    def _write(self, etype: str, pod: dict) -> dict:
        with self.cond:
            self.rv += 1
            pod = copy.deepcopy(pod)
            pod["metadata"]["resourceVersion"] = str(self.rv)
            key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
            if etype == "DELETED":
                self.pods.pop(key, None)
            else:
                self.pods[key] = pod
            self.log.append((self.rv, etype, pod))
            self.cond.notify_all()
            return pod

    def create(self, pod: dict) -> dict:
        return self._write("ADDED", pod)

    def update(self, pod: dict) -> dict:
        return self._write("MODIFIED", pod)

    def delete(self, pod: dict) -> dict:
        return self._write("DELETED", pod)

    def bump(self) -> None:
        """A write to something else: the global resourceVersion moves on."""
        with self.cond:
            self.rv += 1

    def bookmark(self) -> None:
        with self.cond:
            self.log.append((self.rv, "BOOKMARK", {"kind": "Pod", "apiVersion": "v1",
                                                   "metadata": {"resourceVersion":
                                                                str(self.rv)}}))
            self.cond.notify_all()

    def drop(self) -> None:
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def compact(self) -> None:
        with self.cond:
            self.oldest = self.rv

    def verbs(self) -> tuple[int, int]:
        """(LIST requests, WATCH requests) so far."""
        with self.cond:
            watches = sum(1 for q in self.requests if q.get("watch") == "true")
            return len(self.requests) - watches, watches

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def server() -> Iterator[FakeAPIServer]:
    yield from serving()


def serving() -> Iterator[FakeAPIServer]:
    s = FakeAPIServer()
    s.thread.start()
    yield s
    with s.cond:
        s.stopping = True
        s.cond.notify_all()
    s.httpd.shutdown()
    s.httpd.server_close()


def kubeconfig(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": url}}],
        "users": [{"name": "t", "user": {"token": "node-token"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    return path


class Harness:
    def __init__(self, server: FakeAPIServer, tmp_path: Path, nodes: list[str],
                 **kw: Any) -> None:
        self.server = server
        self.clock = FakeClock()
        self.merge = Merge([Source.API])
        self.api = new_api_client(kubeconfig(tmp_path, server.url))
        self.src = APISource(self.api, nodes, self.merge, self.clock, **kw)

    async def next(self) -> tuple[Op, list[str]]:
        u: PodUpdate = await asyncio.wait_for(self.merge.updates.get(), WAIT)
        return u.op, sorted(p["metadata"]["name"] for p in u.pods)

    def nothing(self) -> None:
        assert self.merge.updates.empty(), self.merge.updates.get_nowait()

    async def watching(self, n: int) -> None:
        """Wait until the source has opened its n-th watch and the server has it."""
        await until(lambda: self.src.watches >= n and self.server.verbs()[1] >= n, WAIT)
        await until(lambda: self.src.connected.is_set() or self.src.events > 0, WAIT)

    async def synced(self) -> None:
        """Wait until the source has seen everything the server has written."""
        await until(lambda: self.src.resource_version is not None
                    and int(self.src.resource_version) >= max(
                        [rv for rv, _, obj in self.server.log
                         if FakeAPIServer.match({"fieldSelector": self.src.field_selector},
                                                obj)] or [0]), WAIT)
        await settle()


def run(server: FakeAPIServer, tmp_path: Path, body: Callable[[Harness], Awaitable[None]],
        nodes: list[str] | None = None, **kw: Any) -> None:
    async def main() -> None:
        h = Harness(server, tmp_path, nodes or ["n1"], **kw)
        task = asyncio.create_task(h.src.run())
        try:
            await body(h)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            h.api.close()
    aio(main())


def test_paginated_list_then_watch_from_its_version(server: FakeAPIServer,
                                                    tmp_path: Path) -> None:
    for i in range(5):
        server.create(mkpod(f"p{i}"))
    server.create(mkpod("elsewhere", node="n2"))

    async def body(h: Harness) -> None:
        assert await h.next() == (Op.ADD, [f"p{i}" for i in range(5)])
        await h.watching(1)
        lists = [q for q in server.requests if q.get("watch") != "true"]
        assert [q.get("continue") for q in lists] == [None, "2", "4"]
        assert all(q["limit"] == "2" and q["fieldSelector"] == "spec.nodeName=n1"
                   for q in lists)
        watch = server.requests[-1]
        assert watch["resourceVersion"] == str(server.rv)
        assert watch["allowWatchBookmarks"] == "true" and watch["watch"] == "true"
        assert h.merge.ready.all_ready() and h.src.lists == 1
        pod = h.merge.pods()[0]
        assert pod["kind"] == "Pod" and pod["apiVersion"] == "v1"
    run(server, tmp_path, body, page_size=2)


def test_watch_events_become_ops(server: FakeAPIServer, tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        await h.watching(1)
        h.nothing()
        a = server.create(mkpod("a"))
        assert await h.next() == (Op.ADD, ["a"])
        server.create(mkpod("other", node="n2"))  # not ours: filtered by the server
        b = copy.deepcopy(a)
        b["spec"]["containers"][0]["image"] = "img2"
        server.update(b)
        assert await h.next() == (Op.UPDATE, ["a"])
        c = copy.deepcopy(b)
        c["status"] = {"phase": "Running"}
        server.update(c)
        assert await h.next() == (Op.RECONCILE, ["a"])
        server.update(c)  # a write that changes nothing the node cares about
        d = copy.deepcopy(c)
        d["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:30Z"
        d["metadata"]["deletionGracePeriodSeconds"] = 30
        server.update(d)
        assert await h.next() == (Op.DELETE, ["a"])
        server.delete(d)
        assert await h.next() == (Op.REMOVE, ["a"])
        await h.synced()
        h.nothing()
        assert h.src.lists == 1 and h.src.relists == 0
    run(server, tmp_path, body)


def test_dropped_connection_resumes_from_last_version(server: FakeAPIServer,
                                                      tmp_path: Path) -> None:
    server.create(mkpod("a"))

    async def body(h: Harness) -> None:
        reconnects: list[int] = []
        h.src.on_reconnect.append(lambda: reconnects.append(h.src.watches))
        assert await h.next() == (Op.ADD, ["a"])
        await h.watching(1)
        server.bump()
        server.bump()
        server.bookmark()  # the bookmark moves our resourceVersion on
        await until(lambda: h.src.resource_version == str(server.rv))
        seen = h.src.resource_version
        server.down = True
        server.drop()
        # the stream ends (a resume), the reconnect fails: backoff on the fake clock
        await until(lambda: h.clock.sleepers == 1 and server.verbs()[1] >= 2)
        created = server.create(mkpod("during-outage"))
        server.down = False
        await h.clock.advance(1.0)
        assert await h.next() == (Op.ADD, ["during-outage"])
        await h.synced()
        h.nothing()  # delivered once
        watches = [q for q in server.requests if q.get("watch") == "true"]
        assert watches[-1]["resourceVersion"] == seen
        assert server.verbs()[0] == 1  # still only the initial LIST
        assert h.src.lists == 1 and h.src.relists == 0 and h.src.resumes >= 2
        assert h.src.resource_version == created["metadata"]["resourceVersion"]
        # the API server answers again: the hooks ran once, when the watch reopened
        # (the first connect and the plain resume before the outage are no reconnect)
        assert reconnects == [h.src.watches]
    run(server, tmp_path, body)


def _outage_changes(server: FakeAPIServer, a: dict, b: dict) -> None:
    """While the source is disconnected: delete a, change b, add c, then let history
    go so that the source's resourceVersion is too old (410)."""
    server.down = True
    server.drop()
    server.delete(a)
    b2 = copy.deepcopy(b)
    b2["spec"]["containers"][0]["image"] = "img2"
    server.update(b2)
    server.create(mkpod("c"))
    server.compact()


@pytest.mark.parametrize("watchlist", [True, False])
def test_gone_relists_and_emits_only_differences(server: FakeAPIServer, tmp_path: Path,
                                                 watchlist: bool) -> None:
    a, b = server.create(mkpod("a")), server.create(mkpod("b"))
    server.create(mkpod("same"))
    server.watchlist = watchlist

    async def body(h: Harness) -> None:
        assert await h.next() == (Op.ADD, ["a", "b", "same"])
        await h.watching(1)
        _outage_changes(server, a, b)
        await until(lambda: h.clock.sleepers == 1)
        server.down = False
        await h.clock.advance(1.0)
        got = [await h.next(), await h.next(), await h.next()]
        assert got == [(Op.REMOVE, ["a"]), (Op.ADD, ["c"]), (Op.UPDATE, ["b"])]
        await h.synced()
        h.nothing()
        assert h.src.relists == 1 and h.src.lists == 2
        lists, _ = server.verbs()
        if watchlist:
            assert lists == 1  # the relist streamed through a watch: no LIST call
            assert any(q.get("sendInitialEvents") == "true" for q in server.requests)
        else:
            assert lists == 2 and not h.src.streaming_relist  # fell back to LIST
        server.create(mkpod("after"))  # and the watch goes on from the relist
        assert await h.next() == (Op.ADD, ["after"])
    run(server, tmp_path, body)


def test_streaming_relist_that_never_finishes_falls_back_to_list(
        server: FakeAPIServer, tmp_path: Path) -> None:
    a, b = server.create(mkpod("a")), server.create(mkpod("b"))
    server.watchlist_unfinished = True

    async def body(h: Harness) -> None:
        assert await h.next() == (Op.ADD, ["a", "b"])
        await h.watching(1)
        _outage_changes(server, a, b)
        await until(lambda: h.clock.sleepers == 1)
        server.down = False
        await h.clock.advance(1.0)  # resume -> 410 -> streaming relist, which ends early
        await until(lambda: not h.src.streaming_relist and h.clock.sleepers == 1)
        h.nothing()  # a half-delivered relist changes nothing
        await h.clock.advance(30.0)  # the retry relists with LIST
        got = [await h.next(), await h.next(), await h.next()]
        assert got == [(Op.REMOVE, ["a"]), (Op.ADD, ["c"]), (Op.UPDATE, ["b"])]
        assert server.verbs()[0] == 2 and h.src.relists == 1
    run(server, tmp_path, body)


def test_many_nodes_share_one_watch(server: FakeAPIServer, tmp_path: Path) -> None:
    server.create(mkpod("on-n1", node="n1"))
    server.create(mkpod("on-n2", node="n2"))
    server.create(mkpod("on-n3", node="n3"))

    async def body(h: Harness) -> None:
        assert await h.next() == (Op.ADD, ["on-n1", "on-n2"])
        await h.watching(1)
        assert server.requests[0]["fieldSelector"] == "spec.nodeName!="
        server.create(mkpod("late-n3", node="n3"))
        server.create(mkpod("late-n2", node="n2"))
        assert await h.next() == (Op.ADD, ["late-n2"])
        await h.synced()
        h.nothing()
        assert {p["spec"]["nodeName"] for p in h.merge.pods()} == {"n1", "n2"}
    run(server, tmp_path, body, nodes=["n1", "n2"])


def test_needs_a_node(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one node"):
        APISource(None, [], Merge([Source.API]), FakeClock())


def test_cancel_stops_the_reader_thread(server: FakeAPIServer, tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(server, tmp_path, ["n1"])
        task = asyncio.create_task(h.src.run())
        await h.watching(1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not [t for t in threading.enumerate() if t.name == "api-source-watch"]
        h.api.close()
    aio(main())
