"""Events the agent writes: on the Node (shape, the same problem written once per period) and on pods."""

from __future__ import annotations

import asyncio

from nodeagent.api.clock import FakeClock
from nodeagent.events import Events
from tests.conftest import aio
from tests.fakekube import FakeKube


@aio
async def test_events_are_shaped_and_deduplicated() -> None:
    clock = FakeClock()
    kube = FakeKube()
    ev = Events(kube, "n1", clock, node_uid=lambda: "node-uid-1", repeat_after=600.0)
    ev.warning("StaticPodMalformed", "file source: /m/a.yaml: malformed")
    ev.warning("StaticPodMalformed", "file source: /m/a.yaml: malformed")
    ev.warning("StaticPodTooLarge", "file source: /m/b.yaml: too large")
    await asyncio.wait_for(ev.drain(), 5)
    posts = kube.calls_of("create events")
    # posted concurrently: events of different reasons carry no order
    assert sorted(c.body["reason"] for c in posts if c.body) == ["StaticPodMalformed",
                                                                 "StaticPodTooLarge"]
    call = next(c for c in posts if c.body and c.body["reason"] == "StaticPodMalformed")
    body = call.body
    assert body is not None and call.namespace == "default"
    assert body["type"] == "Warning" and body["message"].endswith("a.yaml: malformed")
    assert body["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "n1",
                                      "uid": "node-uid-1"}
    assert body["firstTimestamp"] == "2026-01-01T00:00:00.000000Z"
    await clock.advance(600.0)
    ev.warning("StaticPodMalformed", "file source: /m/a.yaml: malformed")
    await asyncio.wait_for(ev.drain(), 5)
    assert kube.count("create events") == 3 and ev.written == 3
    assert kube.calls_of("get nodes") == []  # the UID is the registration's, not fetched


@aio
async def test_an_event_failure_is_not_fatal() -> None:
    kube = FakeKube()
    kube.fail("create events", ConnectionRefusedError("refused"))
    ev = Events(kube, "n1", FakeClock(), node_uid=lambda: "node-uid-1")
    ev.warning("StaticPodMalformed", "x")
    await asyncio.wait_for(ev.drain(), 30)
    assert ev.written == 0


@aio
async def test_a_node_event_waits_for_the_registration() -> None:
    kube = FakeKube()
    clock = FakeClock()
    uids: dict[str, str] = {}
    ev = Events(kube, "n1", clock, node_uid=lambda: uids.get("n1"), repeat_after=600.0)
    ev.warning("StaticPodMalformed", "file source: /m/a.yaml: malformed")
    await clock.advance(30.0)
    assert ev.written == 0 and kube.calls == []  # the Node is not registered yet
    uids["n1"] = "node-uid-1"
    await clock.advance(1.0)
    await asyncio.wait_for(ev.drain(), 5)
    assert ev.written == 1  # without a second report
    [call] = kube.calls_of("create events")
    assert call.body is not None and call.body["involvedObject"]["uid"] == "node-uid-1"


@aio
async def test_a_node_never_registered_gives_up_and_is_reported_again() -> None:
    kube = FakeKube()
    clock = FakeClock()
    uids: dict[str, str] = {}
    ev = Events(kube, "n1", clock, node_uid=lambda: uids.get("n1"), repeat_after=600.0)
    ev.warning("StaticPodMalformed", "malformed")
    await clock.advance(600.0)
    await asyncio.wait_for(ev.drain(), 5)
    assert ev.written == 0 and kube.calls == []
    uids["n1"] = "node-uid-1"
    ev.warning("StaticPodMalformed", "malformed")  # not held back as a repeat
    await asyncio.wait_for(ev.drain(), 5)
    assert ev.written == 1


@aio
async def test_pod_events_name_the_pod_and_container() -> None:
    kube = FakeKube()
    ev = Events(kube, "n1", FakeClock(), node_uid=lambda: "node-uid-1")
    pod = {"metadata": {"name": "web", "namespace": "shop", "uid": "pod-uid"},
           "spec": {"nodeName": "vn-7", "initContainers": [{"name": "setup"}],
                    "containers": [{"name": "app"}]}}
    ev.pod(pod, "Warning", "Failed", "Error: boom", container="setup")
    ev.pod(pod, "Warning", "Failed", "Error: boom", container="setup")  # once
    ev.pod(pod, "Normal", "Started", "Started container app", container="app")
    await asyncio.wait_for(ev.drain(), 5)
    bodies = {c.body["reason"]: c for c in kube.calls_of("create events") if c.body}
    assert set(bodies) == {"Failed", "Started"} and ev.written == 2
    failed = bodies["Failed"]
    assert failed.namespace == "shop" and failed.body is not None
    assert failed.body["involvedObject"] == {
        "apiVersion": "v1", "kind": "Pod", "name": "web", "namespace": "shop",
        "uid": "pod-uid", "fieldPath": "spec.initContainers{setup}"}
    assert failed.body["source"] == {"component": "nodepulse-agent", "host": "vn-7"}
    started = bodies["Started"].body
    assert started is not None and started["type"] == "Normal"
    assert started["involvedObject"]["fieldPath"] == "spec.containers{app}"
