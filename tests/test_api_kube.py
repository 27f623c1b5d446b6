"""The API layer: paths from the resource table, the requests RestKube sends through the
client (recorded at the client's call_api, no server), the watch reader's thread, and
the in-memory fake's semantics the other tests rely on."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.client.rest import RESTResponse

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
)
from nodeagent.api.rest import json_lines
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


class Recorder:
    """An ApiClient whose call_api records what would be sent and answers from a script."""

    def __init__(self, answers: Sequence[tuple[int, bytes | list[bytes]]]) -> None:
        cfg = client.Configuration()
        cfg.host = "https://127.0.0.1:1"
        cfg.api_key = {"BearerToken": "t"}
        cfg.api_key_prefix = {"BearerToken": "Bearer"}
        self.api = client.ApiClient(cfg)
        self.api.call_api = self.call_api
        self.answers = list(answers)
        self.sent: list[dict[str, Any]] = []
        self.responses: list[urllib3.HTTPResponse] = []

    def call_api(self, method: str, url: str, headers: dict[str, str], body: Any,
                 post: Any, _request_timeout: Any = None) -> RESTResponse:
        self.sent.append({"method": method, "url": url, "headers": headers, "body": body,
                          "timeout": _request_timeout})
        status, data = self.answers.pop(0)
        chunks = data if isinstance(data, list) else [data]
        resp = urllib3.HTTPResponse(body=io.BytesIO(b"".join(chunks)), status=status,
                                    preload_content=False)
        self.responses.append(resp)
        return RESTResponse(resp)


@aio
async def test_verbs_send_the_paths_queries_and_bodies() -> None:
    node = json.dumps({"metadata": {"name": "n1", "resourceVersion": "7"}}).encode()
    r = Recorder([(200, node)] * 6 + [(404, b'{"message": "nope"}')])
    kube = RestKube(r.api)
    assert (await kube.get(NODES, "n1", timeout=10))["metadata"]["resourceVersion"] == "7"
    await kube.list(PODS, field_selector="spec.nodeName=n1", limit=500, cont="abc")
    await kube.patch(NODES, "n1", {"status": {}}, subresource="status")
    await kube.update(LEASES, {"metadata": {"name": "n1", "namespace": NODE_LEASE_NAMESPACE}})
    assert await kube.patch(NODE_STATUS_POLICIES, "p", {"status": {}}, subresource="status",
                            content_type=MERGE, parse=False) == {}
    await kube.delete(PODS, "p", namespace="ns", options={"gracePeriodSeconds": 0})
    with pytest.raises(ApiException) as e:
        await kube.create(EVENTS, {"metadata": {"name": "e", "namespace": "default"}})
    assert e.value.status == 404
    got = [(s["method"], s["url"].split("127.0.0.1:1", 1)[1]) for s in r.sent]
    assert got == [
        ("GET", "/api/v1/nodes/n1"),
        ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1&limit=500&continue=abc"),
        ("PATCH", "/api/v1/nodes/n1/status"),
        ("PUT", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n1"),
        ("PATCH", "/apis/nodepulse.dev/v1alpha1/nodestatuspolicies/p/status"),
        ("DELETE", "/api/v1/namespaces/ns/pods/p"),
        ("POST", "/api/v1/namespaces/default/events")]
    assert r.sent[0]["timeout"] == 10 and r.sent[0]["headers"]["authorization"] == "Bearer t"
    assert r.sent[2]["headers"]["Content-Type"] == "application/strategic-merge-patch+json"
    assert r.sent[4]["headers"]["Content-Type"] == "application/merge-patch+json"
    assert r.sent[5]["body"] == {"apiVersion": "v1", "kind": "DeleteOptions",
                                 "gracePeriodSeconds": 0}
    # every answer was read to its end (the connection can go back to the pool)
    assert [resp._fp_bytes_read for resp in r.responses] == [len(node)] * 6 + [19]


@aio
async def test_a_watch_is_read_by_its_own_thread_chunk_by_chunk() -> None:
    events = [{"type": "ADDED", "object": {"metadata": {"name": f"p{i}"}}} for i in range(3)]
    data = b"".join(json.dumps(e).encode() + b"\n" for e in events)
    r = Recorder([(200, data), (410, b'{"code": 410}')])
    kube = RestKube(r.api)
    stream = await kube.watch(PODS, resource_version="5", field_selector="spec.nodeName=n1",
                              timeout_seconds=300)
    got = [e async for batch in stream for e in batch]
    assert got == events
    url = r.sent[0]["url"]
    for q in ("watch=true", "allowWatchBookmarks=true", "timeoutSeconds=300",
              "resourceVersion=5", "fieldSelector=spec.nodeName%3Dn1"):
        assert q in url, url
    assert r.sent[0]["timeout"] == (10.0, 330.0)
    await stream.aclose()
    assert not [t for t in threading.enumerate() if t.name == "watch-pods"]
    with pytest.raises(ApiException) as e:  # refused: raised by watch() itself
        await kube.watch(PODS, send_initial_events=True)
    assert e.value.status == 410
    assert "sendInitialEvents=true" in r.sent[1]["url"]
    assert "resourceVersionMatch=NotOlderThan" in r.sent[1]["url"]


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
    with pytest.raises(ApiException) as e:
        await kube.create(LEASES, lease)
    assert e.value.status == 409
    kube.touch(LEASES, "n1", NODE_LEASE_NAMESPACE)
    with pytest.raises(ApiException) as e:
        await kube.update(LEASES, lease)  # an old resourceVersion
    assert e.value.status == 409
    pod = kube.put(PODS, {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                          "status": {"conditions": [{"type": "Ready", "status": "False",
                                                     "reason": "x"}]}})
    with pytest.raises(ApiException) as e:  # another pod of the same name
        await kube.patch(PODS, "p", {"metadata": {"uid": "u0"}, "status": {}},
                         namespace="ns", subresource="status")
    assert e.value.status == 409
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
    with pytest.raises(ApiException):
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
