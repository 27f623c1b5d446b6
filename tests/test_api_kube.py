"""The API layer: paths from the resource table, the requests RestKube sends (recorded by
an in-process server on loopback), its watches read on the event loop, its transport
failures, and the in-memory fake's semantics the other tests rely on."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from nodeagent.api.client import ApiError, Credentials, brief, is_retriable
from nodeagent.api.kube import (
    CERTIFICATE_SIGNING_REQUESTS,
    EVENTS,
    LEASES,
    MERGE,
    NODE_LEASE_NAMESPACE,
    NODE_STATUS_POLICIES,
    NODES,
    PODS,
    SUBJECT_ACCESS_REVIEWS,
    TOKEN_REVIEWS,
    RestKube,
    describe,
    with_shared_strings,
)
from nodeagent.api.rest import METADATA_ONLY, client_timeout, json_lines, transport_error
from tests.conftest import aio
from tests.fakekube import FakeKube, api_error


def test_paths_come_from_the_table() -> None:
    assert NODES.path() == "/api/v1/nodes"
    assert NODES.path(name="n1", subresource="status") == "/api/v1/nodes/n1/status"
    assert PODS.path() == "/api/v1/pods"  # every namespace
    assert PODS.path("ns", "p", "status") == "/api/v1/namespaces/ns/pods/p/status"
    assert EVENTS.path("default") == "/api/v1/namespaces/default/events"
    assert LEASES.path(NODE_LEASE_NAMESPACE, "n1") == \
        "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n1"
    assert NODE_STATUS_POLICIES.path(name="p", subresource="status") == \
        "/apis/nodepulse.dev/v1alpha1/nodestatuspolicies/p/status"
    assert CERTIFICATE_SIGNING_REQUESTS.path(name="csr-1") == \
        "/apis/certificates.k8s.io/v1/certificatesigningrequests/csr-1"
    assert TOKEN_REVIEWS.path() == "/apis/authentication.k8s.io/v1/tokenreviews"
    assert SUBJECT_ACCESS_REVIEWS.path() == \
        "/apis/authorization.k8s.io/v1/subjectaccessreviews"
    assert LEASES.api_version == "coordination.k8s.io/v1" and PODS.api_version == "v1"
    with pytest.raises(ValueError, match="not namespaced"):
        NODES.path("ns")
    with pytest.raises(ValueError, match="a namespace is needed"):
        PODS.path(name="p")
    assert describe({"metadata": {"name": "p", "namespace": "ns"}}) == "ns/p"
    assert describe({"metadata": {"name": "n1"}}) == "n1"


Chunk = bytes | asyncio.Event  # an Event: wait until the test sets it


class Recorder:
    """An API server on loopback that records each request and answers from a script:
    (status, body) or (status, [chunks]) sent one chunk at a time, an Event among them
    holding the rest back until the test sets it."""

    def __init__(self, answers: Sequence[tuple[int, bytes | list[Chunk]]]) -> None:
        self.answers = list(answers)
        self.sent: list[dict[str, Any]] = []
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.server = TestServer(app)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.sent.append({"method": request.method, "url": str(request.rel_url),
                          "headers": dict(request.headers),
                          "body": json.loads(body) if body else None})
        status, data = self.answers.pop(0)
        chunks = data if isinstance(data, list) else [data]
        resp = web.StreamResponse(status=status)
        resp.content_type = "application/json"
        await resp.prepare(request)
        for chunk in chunks:
            if isinstance(chunk, asyncio.Event):
                await chunk.wait()
            else:
                await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def __aenter__(self) -> RestKube:
        await self.server.start_server()
        creds = Credentials(str(self.server.make_url("")), source="test", token="t")
        self.kube = RestKube(creds, connections=2, component="test")
        return self.kube

    async def __aexit__(self, *exc: object) -> None:
        await self.kube.aclose()
        await self.server.close()


@aio
async def test_verbs_send_the_paths_queries_and_bodies() -> None:
    node = json.dumps({"metadata": {"name": "n1", "resourceVersion": "7"}}).encode()
    r = Recorder([(200, node)] * 6 + [(404, b'{"message": "nope"}')])
    async with r as kube:
        assert (await kube.get(NODES, "n1", timeout=10))["metadata"]["resourceVersion"] == "7"
        await kube.list(PODS, field_selector="spec.nodeName=n1", limit=500, cont="abc")
        await kube.patch(NODES, "n1", {"status": {}}, subresource="status")
        lease = kube.separate(1)  # turns of its own, the same server, credentials, pool
        await lease.update(LEASES, {"metadata": {"name": "n1",
                                                 "namespace": NODE_LEASE_NAMESPACE}})
        assert await kube.patch(NODE_STATUS_POLICIES, "p", {"status": {}},
                                subresource="status", content_type=MERGE, parse=False) == {}
        await kube.delete(PODS, "p", namespace="ns", options={"gracePeriodSeconds": 0})
        with pytest.raises(ApiError) as e:
            await kube.create(EVENTS, {"metadata": {"name": "e", "namespace": "default"}})
        assert e.value.status == 404 and brief(e.value) == "HTTP 404 Not Found: nope"
        # keep-alive: one connection, the separate kube's request taking it while idle
        assert kube.transport.opened == lease.transport.opened == 1
    got = [(s["method"], s["url"]) for s in r.sent]
    assert got == [
        ("GET", "/api/v1/nodes/n1"),
        ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1&limit=500&continue=abc"),
        ("PATCH", "/api/v1/nodes/n1/status"),
        ("PUT", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n1"),
        ("PATCH", "/apis/nodepulse.dev/v1alpha1/nodestatuspolicies/p/status"),
        ("DELETE", "/api/v1/namespaces/ns/pods/p"),
        ("POST", "/api/v1/namespaces/default/events")]
    assert r.sent[0]["headers"]["Authorization"] == "Bearer t"
    assert r.sent[0]["headers"]["User-Agent"] == "nodepulse/test"
    assert "Content-Type" not in r.sent[0]["headers"]  # no body, no type
    assert r.sent[2]["headers"]["Content-Type"] == "application/strategic-merge-patch+json"
    assert r.sent[4]["headers"]["Content-Type"] == "application/merge-patch+json"
    assert r.sent[5]["body"] == {"apiVersion": "v1", "kind": "DeleteOptions",
                                 "gracePeriodSeconds": 0}
    # an answer that is parsed is asked for whole; one that is not, as metadata only
    assert r.sent[2]["headers"]["Accept"] == "application/json"
    assert r.sent[4]["headers"]["Accept"] == METADATA_ONLY


@aio
async def test_at_most_connections_requests_at_once_the_rest_wait_their_turn() -> None:
    gate = asyncio.Event()
    node = json.dumps({"metadata": {"name": "n1"}}).encode()
    held: list[Chunk] = [gate, node]
    r = Recorder([(200, held)] * 10 + [(200, [node])])
    async with r as kube:  # connections=2
        burst = [asyncio.ensure_future(kube.get(NODES, "n1", timeout=30)) for _ in range(10)]
        await until_sent(r, 2)
        watch = await kube.watch(NODES)  # a watch takes no turn
        await watch.aclose()
        assert len(r.sent) == 3  # two requests held by the server, the watch
        gate.set()
        assert len(await asyncio.gather(*burst)) == 10
        assert kube.transport.opened == 3  # two for the requests, one for the watch


@aio
async def test_a_separate_transport_waits_for_no_turn_and_reuses_the_idle_connections() -> None:
    gate = asyncio.Event()
    node = json.dumps({"metadata": {"name": "n1"}}).encode()
    held: list[Chunk] = [gate, node]
    r = Recorder([(200, held)] * 2 + [(200, [node])] * 4)
    async with r as kube:  # connections=2
        burst = [asyncio.ensure_future(kube.get(NODES, "n1", timeout=30)) for _ in range(2)]
        await until_sent(r, 2)
        lease = kube.separate(1)
        # both turns of kube are held by the server: the lease's request is not behind them
        assert (await lease.get(NODES, "n1", timeout=30))["metadata"]["name"] == "n1"
        assert kube.transport.opened == 3
        gate.set()
        await asyncio.gather(*burst)
        # three idle connections now, whoever opened them: no new one for either
        await asyncio.gather(lease.get(NODES, "n1", timeout=30),
                             kube.get(NODES, "n1", timeout=30),
                             kube.get(NODES, "n1", timeout=30))
        assert kube.transport.opened == lease.transport.opened == 3


async def until_sent(r: Recorder, n: int) -> None:
    for _ in range(1000):
        if len(r.sent) >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(r.sent)} requests reached the server, not {n}")


@aio
async def test_transport_failures_are_connection_and_timeout_errors() -> None:
    # nothing listens there
    kube = RestKube(Credentials("http://127.0.0.1:1", source="test"))
    try:
        with pytest.raises(ConnectionError) as e:
            await kube.get(NODES, "n1", timeout=5)
    finally:
        await kube.aclose()
    assert is_retriable(e.value) and "GET /api/v1/nodes/n1" in str(e.value)
    late = transport_error("PUT", "/x", aiohttp.ServerTimeoutError("read"))
    assert isinstance(late, TimeoutError) and is_retriable(late)
    # a number bounds the whole request (a Lease write must land before it expires);
    # (connect, read) bounds connecting and each read (a watch)
    assert client_timeout(2.5).total == 2.5
    t = client_timeout((10.0, 330.0))
    assert (t.total, t.sock_connect, t.sock_read) == (None, 10.0, 330.0)
    assert client_timeout(None).total is None


@aio
async def test_a_watch_is_read_chunk_by_chunk_on_the_loop() -> None:
    events = [{"type": "ADDED", "object": {"metadata": {"name": f"p{i}"}}} for i in range(3)]
    lines = [json.dumps(e).encode() + b"\n" for e in events]
    more, rest, hold = asyncio.Event(), asyncio.Event(), asyncio.Event()
    # the second event cut in two: it comes with the third
    chunks: list[Chunk] = [lines[0], more, lines[1][:7], rest, lines[1][7:] + lines[2]]
    r = Recorder([(200, chunks), (410, b'{"code": 410}'), (200, [lines[0], hold])])
    async with r as kube:
        stream = await kube.watch(PODS, resource_version="5",
                                  field_selector="spec.nodeName=n1", timeout_seconds=300)
        it = aiter(stream)
        assert [e["object"]["metadata"]["name"] for e in await anext(it)] == ["p0"]
        more.set()
        second = asyncio.ensure_future(anext(it))
        await asyncio.sleep(0)
        assert not second.done()  # half a line is not an event
        rest.set()
        assert [e["object"]["metadata"]["name"] for e in await second] == ["p1", "p2"]
        with pytest.raises(StopAsyncIteration):
            await anext(it)
        url = r.sent[0]["url"]
        for q in ("watch=true", "allowWatchBookmarks=true", "timeoutSeconds=300",
                  "resourceVersion=5", "fieldSelector=spec.nodeName%3Dn1"):
            assert q in url, url
        await stream.aclose()
        with pytest.raises(ApiError) as e:  # refused: raised by watch() itself
            await kube.watch(PODS, send_initial_events=True)
        assert e.value.status == 410
        assert "sendInitialEvents=true" in r.sent[1]["url"]
        assert "resourceVersionMatch=NotOlderThan" in r.sent[1]["url"]
        # closed from another thread while the server holds the stream open: the read
        # under way ends (as a network failure would end it)
        stream = await kube.watch(PODS)
        it = aiter(stream)
        assert (await anext(it))[0]["object"]["metadata"]["name"] == "p0"
        waiting = asyncio.ensure_future(anext(it))
        await asyncio.to_thread(stream.close)
        with pytest.raises((ConnectionError, StopAsyncIteration)):
            await waiting
        hold.set()


def test_stream_lines_split_across_chunks() -> None:
    lines = [json.dumps({"n": i}).encode() + b"\n" for i in range(3)]
    blob = b"".join(lines)
    chunks = [blob[:5], blob[5:20], blob[20:]]
    assert [o for batch in json_lines(iter(chunks)) for o in batch] == [{"n": i} for i in range(3)]
    assert list(json_lines(iter([b'{"a": 1}']))) == [[{"a": 1}]]  # no final newline


# -- the fake, where other tests lean on it --

@aio
async def test_fake_keeps_versions_conflicts_and_preconditions() -> None:
    kube = FakeKube()
    lease = await kube.create(LEASES, {"metadata": {"name": "n1",
                                                    "namespace": NODE_LEASE_NAMESPACE}})
    with pytest.raises(ApiError) as e:
        await kube.create(LEASES, lease)
    assert e.value.status == 409
    kube.touch(LEASES, "n1", NODE_LEASE_NAMESPACE)
    with pytest.raises(ApiError) as e:
        await kube.update(LEASES, lease)  # an old resourceVersion
    assert e.value.status == 409
    pod = kube.put(PODS, {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                          "status": {"conditions": [{"type": "Ready", "status": "False",
                                                     "reason": "x"}]}})
    with pytest.raises(ApiError) as e:  # another pod of the same name: its uid is immutable
        await kube.patch(PODS, "p", {"metadata": {"uid": "u0"}, "status": {}},
                         namespace="ns", subresource="status")
    assert e.value.status == 422 and "metadata.uid" in str(e.value.body)
    with pytest.raises(ApiError) as e:  # two addresses of one family (strategic merge)
        await kube.patch(PODS, "p", {"status": {"podIPs": [{"ip": "10.0.0.1"}]}},
                         namespace="ns", subresource="status")
        await kube.patch(PODS, "p", {"status": {"podIPs": [{"ip": "10.0.0.2"}]}},
                         namespace="ns", subresource="status")
    assert e.value.status == 422 and "status.podIPs" in str(e.value.body)
    await kube.patch(PODS, "p", {"status": {"podIPs": [{"$patch": "replace"},
                                                       {"ip": "10.0.0.2"}]}},
                     namespace="ns", subresource="status")
    assert kube.obj(PODS, "p", "ns")["status"]["podIPs"] == [{"ip": "10.0.0.2"}]
    await kube.patch(PODS, "p", {"status": {"podIPs": None}}, namespace="ns",
                     subresource="status")
    await kube.patch(PODS, "p", {"metadata": {"uid": "u1"}, "status": {
        "phase": "Running", "conditions": [{"type": "Ready", "status": "True",
                                            "reason": None}]}},
        namespace="ns", subresource="status")
    st = kube.obj(PODS, "p", "ns")["status"]
    assert st == {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    assert int(kube.obj(PODS, "p", "ns")["metadata"]["resourceVersion"]) > \
        int(pod["metadata"]["resourceVersion"])
    kube.fail("get nodes", api_error(500))
    kube.put(NODES, {"metadata": {"name": "n1"}})
    with pytest.raises(ApiError):
        await kube.get(NODES, "n1")
    assert (await kube.get(NODES, "n1"))["metadata"]["uid"] == "uid-n1"
    assert [c.key for c in kube.calls][-2:] == ["get nodes", "get nodes"]


@aio
async def test_fake_watch_replays_follows_and_expires() -> None:
    kube = FakeKube()
    kube.put(NODES, {"metadata": {"name": "a", "labels": {"pool": "x"}}})
    rv = kube.resource_version
    kube.put(NODES, {"metadata": {"name": "b"}})
    kube.put(NODES, {"metadata": {"name": "c", "labels": {"pool": "x"}}})
    stream = await kube.watch(NODES, resource_version=rv, label_selector="pool=x")
    it = aiter(stream)
    assert [e["object"]["metadata"]["name"] for e in await anext(it)] == ["c"]
    later = asyncio.ensure_future(anext(it))
    await asyncio.sleep(0)
    assert not later.done()  # waits for more
    kube.annotate(NODES, "a", "k", "v")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in await later] == \
        [("MODIFIED", "a")]
    kube.drop()
    with pytest.raises(StopAsyncIteration):
        await anext(it)
    kube.compact()
    old = await kube.watch(NODES, resource_version=rv)
    assert [e["object"]["code"] async for batch in old for e in batch] == [410]


def test_shared_strings_leave_out_the_resource_version() -> None:
    """Keys and short values are interned, shared by every node's kept Lease; the
    resourceVersion, new with each write, is not: interned, each would go into the
    interpreter's table and out again, and that churn grows the table."""
    rv = str(918273645)  # made at run time: no constant of this module is the same object
    kept = with_shared_strings(json.loads(json.dumps(
        {"metadata": {"namespace": NODE_LEASE_NAMESPACE, "resourceVersion": rv}})))
    meta = kept["metadata"]
    assert meta == {"namespace": NODE_LEASE_NAMESPACE, "resourceVersion": rv}
    assert sys.intern(str(918273645)) is not meta["resourceVersion"]
    assert sys.intern("".join(NODE_LEASE_NAMESPACE)) is meta["namespace"]
