"""The manifest URL source against a local HTTP server started by the test."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import REGISTRY

from nodeagent.api.clock import FakeClock
from nodeagent.pods.podupdate import Op, Source
from nodeagent.pods.sources.http import HTTPSource
from nodeagent.pods.sources.merge import Merge
from nodeagent.pods.sources.problems import Problems
from tests.conftest import Sink, until


def pod_doc(name: str, image: str = "busybox") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": image}]}}


class Server:
    """Serves `body` with an ETag and Last-Modified; answers 304 to a matching
    If-None-Match; records every request's headers."""

    def __init__(self) -> None:
        self.body = b""
        self.etag: str | None = '"v1"'
        self.last_modified: str | None = "Thu, 01 Jan 2026 00:00:00 GMT"
        self.status = 200
        self.send_length = True  # False: no Content-Length, the body ends at close
        self.sent = 0            # body bytes the client took
        self.requests: list[dict[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                owner.requests.append(dict(self.headers.items()))
                if owner.status != 200:
                    self.send_response(owner.status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if owner.etag and self.headers.get("If-None-Match") == owner.etag:
                    self.send_response(304)
                    self.end_headers()
                    return
                self.send_response(200)
                if owner.etag:
                    self.send_header("ETag", owner.etag)
                if owner.last_modified:
                    self.send_header("Last-Modified", owner.last_modified)
                if owner.send_length:
                    self.send_header("Content-Length", str(len(owner.body)))
                self.end_headers()
                view = memoryview(owner.body)
                try:
                    for i in range(0, len(view), 1 << 16):
                        self.wfile.write(view[i:i + (1 << 16)])
                        owner.sent += len(view[i:i + (1 << 16)])
                except OSError:
                    pass  # the client stopped reading and closed

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/pods"

    def set(self, docs: list[dict], etag: str | None) -> None:
        self.body = json.dumps({"apiVersion": "v1", "kind": "PodList", "items": docs}).encode()
        self.etag = etag


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    s.thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()
    s.thread.join()


def setup(url: str, max_bytes: int | None = None,
          **kw: object) -> tuple[Merge, HTTPSource, Sink]:
    sink = Sink()
    merge = Merge([Source.HTTP], Problems(sink))
    src = HTTPSource(url, "n1", merge, FakeClock(), headers={"X-Token": "t"}, **kw)  # type: ignore[arg-type]
    if max_bytes is not None:
        src.max_bytes = max_bytes
    return merge, src, sink


def ops(m: Merge) -> list[tuple[Op, list[str]]]:
    out = []
    while not m.updates.empty():
        u = m.updates.get_nowait()
        out.append((u.op, sorted(p["metadata"]["name"] for p in u.pods)))
    return out


def polls(result: str) -> float:
    return REGISTRY.get_sample_value("nodepulse_source_http_polls_total",
                                     {"result": result}) or 0.0


def test_conditional_polls(server: Server) -> None:
    async def main() -> None:
        merge, src, _ = setup(server.url)
        server.set([pod_doc("a"), pod_doc("b")], '"v1"')
        assert not merge.ready.all_ready()
        assert await src.poll() == "changed"
        assert merge.ready.all_ready()
        assert ops(merge) == [(Op.ADD, ["a-n1", "b-n1"])]
        assert server.requests[0]["X-Token"] == "t"
        assert "If-None-Match" not in server.requests[0]
        before = polls("not_modified")
        assert await src.poll() == "not_modified"
        assert server.requests[1]["If-None-Match"] == '"v1"'
        assert server.requests[1]["If-Modified-Since"] == "Thu, 01 Jan 2026 00:00:00 GMT"
        assert polls("not_modified") == before + 1
        server.etag = '"v2"'  # a new ETag, the same bytes: no parsing, nothing emitted
        assert await src.poll() == "unchanged"
        server.set([pod_doc("b"), pod_doc("a")], '"v3"')  # reordered: same pods
        assert await src.poll() == "changed"
        assert ops(merge) == []
        server.set([pod_doc("a", "nginx"), pod_doc("c")], '"v4"')
        assert await src.poll() == "changed"
        assert ops(merge) == [(Op.REMOVE, ["a-n1", "b-n1"]), (Op.ADD, ["a-n1", "c-n1"])]
        assert {p["metadata"]["annotations"]["kubernetes.io/config.source"]
                for p in merge.pods()} == {"http"}
    asyncio.run(main())


def test_without_validators_unchanged_body_is_not_a_change(server: Server) -> None:
    async def main() -> None:
        merge, src, _ = setup(server.url)
        server.set([pod_doc("a")], None)
        server.last_modified = None
        assert await src.poll() == "changed"
        ops(merge)
        assert await src.poll() == "unchanged"
        assert "If-None-Match" not in server.requests[1]
        assert ops(merge) == []
    asyncio.run(main())


def test_errors_keep_the_last_good_set(server: Server) -> None:
    async def main() -> None:
        merge, src, sink = setup(server.url)
        server.set([pod_doc("a")], '"v1"')
        await src.poll()
        good = merge.pods()
        ops(merge)
        server.body, server.etag = b"kind: [", '"bad1"'
        assert await src.poll() == "error"
        assert "malformed YAML/JSON" in sink.events[-1][1]
        assert "keeping the last good set (1 pods)" in sink.events[-1][1]
        server.set([pod_doc("a"), {"apiVersion": "v1", "kind": "Pod",
                                   "metadata": {"name": "b"}}], '"bad2"')
        assert await src.poll() == "error"
        assert "items[1]: missing required field spec" in sink.events[-1][1]
        server.set([pod_doc("a"), pod_doc("a")], '"bad3"')
        assert await src.poll() == "error"
        assert "defined twice" in sink.events[-1][1]
        server.status = 500
        assert await src.poll() == "error"
        assert sink.events[-1] == ("StaticPodHTTPError", f"http source: GET {server.url}: "
                                   "HTTP 500; keeping the last good set (1 pods)")
        assert await src.poll() == "error"  # the same problem is reported once
        assert len(sink.events) == 4
        assert ops(merge) == [] and merge.pods() == good
        server.status = 200
        server.set([pod_doc("a"), pod_doc("b")], '"v2"')
        assert await src.poll() == "changed"
        assert ops(merge) == [(Op.ADD, ["b-n1"])]
    asyncio.run(main())


def test_unreachable_before_first_good_body_is_not_ready() -> None:
    async def main() -> None:
        merge, src, sink = setup("http://127.0.0.1:9/pods", timeout=2.0)
        assert await src.poll() == "error"
        assert not merge.ready.all_ready()
        assert "GET http://127.0.0.1:9/pods failed" in sink.events[0][1]
    asyncio.run(main())


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="only http"):
        setup("file:///etc/passwd")


def test_run_polls_on_the_clock(server: Server) -> None:
    async def main() -> None:
        merge, src, _ = setup(server.url)
        clock = src.clock
        assert isinstance(clock, FakeClock)
        server.set([pod_doc("a")], '"v1"')
        task = asyncio.create_task(src.run())
        try:
            await asyncio.wait_for(merge.ready.wait(), 5)
            await until(lambda: clock.sleepers == 1)  # the first poll's thread returned
            assert src.polls == 1
            await clock.advance(19.9)
            assert src.polls == 1
            await clock.advance(0.1)
            await until(lambda: src.polls == 2 and clock.sleepers == 1)
            assert len(server.requests) == 2
            assert ops(merge) == [(Op.ADD, ["a-n1"])]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())


def test_too_large_bodies_are_not_read(server: Server) -> None:
    async def main() -> None:
        merge, src, sink = setup(server.url, max_bytes=4096)
        server.set([pod_doc("a")], '"v1"')
        await src.poll()
        ops(merge)
        good = merge.pods()
        server.body, server.etag = b"#" * (8 << 20), '"big"'
        server.sent = 0
        assert await src.poll() == "error"
        assert sink.events[-1] == ("StaticPodTooLarge", f"http source: GET {server.url}: "
                                   f"Content-Length {8 << 20} is over the limit of 4096 "
                                   "bytes; not read; keeping the last good set (1 pods)")
        assert server.sent < 8 << 20  # the client hung up before the body was sent
        server.send_length = False  # no length: read up to the limit, then refused
        server.etag = '"big2"'
        assert await src.poll() == "error"
        assert sink.events[-1] == ("StaticPodTooLarge", f"http source: GET {server.url}: "
                                   "body over the limit of 4096 bytes; keeping the last "
                                   "good set (1 pods)")
        assert merge.pods() == good and ops(merge) == []
    asyncio.run(main())


def test_host_access_refused_unless_allowed(server: Server) -> None:
    net = {**pod_doc("b"), "spec": {"hostNetwork": True,
                                    "containers": [{"name": "c", "image": "i"}]}}

    async def main() -> None:
        merge, src, sink = setup(server.url)
        server.set([pod_doc("a")], '"v1"')
        await src.poll()
        ops(merge)
        server.set([pod_doc("a"), net], '"v2"')
        assert await src.poll() == "error"
        reason, message = sink.events[-1]
        assert reason == "StaticPodForbidden"
        assert f"{server.url} (pod default/b): spec.hostNetwork is set" in message
        assert "allowPrivileged: true" in message and "keeping the last good set" in message
        assert ops(merge) == []
        merge, src, sink = setup(server.url, allow_privileged=True)
        assert await src.poll() == "changed"
        assert ops(merge) == [(Op.ADD, ["a-n1", "b-n1"])] and sink.events == []
    asyncio.run(main())
