"""Pod sources against the real control plane, with a node's own credentials
(Node authorizer + NodeRestriction), driven in-process on an asyncio loop.

- a manifest dropped in the folder yields a mirror pod; edit -> replaced; a touch -> no
  API write (API server metrics); bad manifest -> Warning Event on the Node; delete ->
  mirror deleted;
- what NodeRestriction admits as a mirror pod is what static.mirror_problem predicts;
- a dropped watch resumes from its resourceVersion without a relist or LIST, and a pod
  created while it was down is delivered once;
- an API server restart: no LIST (API server metrics), the pod created during the
  outage is delivered once.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness.apirequests import request_json
from e2e.harness.waits import eventually as eventually_sync
from nodeagent.api.client import load_credentials, new_api_client
from nodeagent.api.clock import FakeClock, RealClock, settle
from nodeagent.api.kube import RestKube
from nodeagent.events import Events
from nodeagent.pods.podupdate import ANN_CONFIG_HASH, ANN_CONFIG_MIRROR, Op, PodUpdate, Source
from nodeagent.pods.sources.api import APISource
from nodeagent.pods.sources.file import FileSource
from nodeagent.pods.sources.merge import Merge
from nodeagent.pods.sources.mirror import MirrorManager
from nodeagent.pods.sources.problems import Problems
from nodeagent.pods.sources.static import check_pod, make_static_pod, mirror_pod, mirror_problem
from nodepulse_dev import Cluster

WAIT = 30.0


def now_rfc3339() -> str:
    """Now, in the form of the audit log's requestReceivedTimestamp (comparable as text)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def eventually(pred: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = await asyncio.to_thread(pred)
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def register_node(cluster: Cluster) -> tuple[str, client.ApiClient]:
    """A fresh Node, registered by the node itself; returns its name and credentials."""
    name = f"src-{uuid.uuid4().hex[:8]}"
    api = new_api_client(cluster.node_kubeconfig(name), component="e2e-node")
    node = request_json(api, "POST", "/api/v1/nodes",
                        body={"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    UIDS[name] = node["metadata"]["uid"]  # as the agent's registration learns it
    return name, api


UIDS: dict[str, str] = {}


def node_kube(cluster: Cluster, node: str) -> RestKube:
    """The agent's way to the API, with the node's own credentials."""
    return RestKube(load_credentials(cluster.node_kubeconfig(node)), component="e2e-node")


def cleanup(cluster: Cluster, node: str, pods: tuple[str, ...] | list[str] = ()) -> None:
    """Remove what a test made: its pods (at once, no kubelet will confirm) and Node."""
    admin = cluster.api_client()
    for name in pods:
        with contextlib.suppress(ApiException):
            request_json(admin, "DELETE", f"/api/v1/namespaces/default/pods/{name}",
                         body={"gracePeriodSeconds": 0})
    with contextlib.suppress(ApiException):
        request_json(admin, "DELETE", f"/api/v1/nodes/{node}")


def manifest(image: str = "busybox:1", extra: str = "") -> str:
    return ("apiVersion: v1\nkind: Pod\nmetadata:\n  name: web\n  labels: {app: web}\n"
            f"spec:\n  containers:\n  - name: c\n    image: {image}\n"
            f"    command: [sleep, '3600']\n{extra}")


def test_static_manifest_to_mirror_pod_lifecycle(cluster: Cluster, tmp_path: Path) -> None:
    node, api = register_node(cluster)
    admin = client.CoreV1Api(cluster.api_client())
    folder = tmp_path / "manifests"
    folder.mkdir()
    mirror_name = f"web-{node}"

    def mirror() -> dict | None:
        try:
            return request_json(cluster.api_client(), "GET",
                                f"/api/v1/namespaces/default/pods/{mirror_name}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def body() -> None:
        clock = RealClock()
        kube = node_kube(cluster, node)
        events = Events(kube, node, clock, node_uid=lambda: UIDS[node])
        merge = Merge([Source.API, Source.FILE], Problems(events))
        src = FileSource(folder, node, merge, clock, debounce=0.05)
        watch = APISource(kube, [node], merge, clock)
        mirrors = MirrorManager(kube, node, merge, clock, node_uid=lambda: UIDS[node])
        tasks = [asyncio.create_task(x.run()) for x in (src, watch, mirrors)]
        try:
            await asyncio.wait_for(merge.ready.wait(), WAIT)

            # dropped in -> mirror pod, shaped as NodeRestriction wants, made by the node
            (folder / "web.yaml").write_text(manifest())
            m = await eventually(mirror, "the mirror pod")
            static = next(p for p in merge.pods() if p["metadata"]["name"] == mirror_name)
            h1 = static["metadata"]["annotations"][ANN_CONFIG_HASH]
            assert m["metadata"]["annotations"][ANN_CONFIG_MIRROR] == h1
            assert m["metadata"]["ownerReferences"][0]["kind"] == "Node"
            assert m["metadata"]["ownerReferences"][0]["name"] == node
            assert m["spec"]["nodeName"] == node
            assert m["metadata"]["labels"] == {"app": "web"}
            await eventually(lambda: mirror_name in {n.split("/")[1] for n in merge.mirrors},
                             "the watch to see the mirror pod")

            # edited -> the mirror pod is replaced by one with the new hash
            (folder / "web.yaml").write_text(manifest(image="busybox:2"))

            def replaced() -> dict | None:
                m2 = mirror()
                ok = m2 and m2["metadata"]["annotations"][ANN_CONFIG_MIRROR] != h1
                return m2 if ok else None
            m2 = await eventually(replaced, "the mirror pod to be replaced")
            assert m2["spec"]["containers"][0]["image"] == "busybox:2"
            assert m2["metadata"]["uid"] != m["metadata"]["uid"]
            await eventually(lambda: merge.mirrors.get(f"default/{mirror_name}", {})
                             .get("metadata", {}).get("uid") == m2["metadata"]["uid"],
                             "the watch to see the new mirror pod")

            # touch, identical rewrite -> no pod write in the API server at all
            touched = now_rfc3339()
            batches = src.batches
            os.utime(folder / "web.yaml")
            (folder / "web.yaml").write_text(manifest(image="busybox:2"))
            await asyncio.wait_for(src.wait_batches(batches + 1), WAIT)
            passes = mirrors.passes
            mirrors.answered.fire()  # and let the mirror manager look again
            await asyncio.wait_for(mirrors.wait_passes(passes + 1), WAIT)
            # witnessed by the API server's audit log, per user: other tests' controllers
            # may write pods meanwhile, this node must not
            writes = [f"{e['verb']} {e['objectRef'].get('name')}"
                      for e in cluster.audit_events()
                      if e["user"]["username"] == f"system:node:{node}"
                      and e["verb"] != "list" and e["requestReceivedTimestamp"] > touched]
            assert writes == [], f"touching the manifest made the node write pods: {writes}"

            # a bad edit -> Warning Event on the Node, the pod and its mirror stay
            (folder / "web.yaml").write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: [")

            def warning() -> list:
                evs = admin.list_namespaced_event(
                    "default", field_selector=f"involvedObject.name={node}").items
                return [e for e in evs if e.reason == "StaticPodMalformed"]
            (ev,) = await eventually(warning, "the Warning Event on the Node")
            assert ev.type == "Warning" and "web.yaml" in ev.message
            assert "malformed YAML/JSON" in ev.message and ev.involved_object.kind == "Node"
            still = mirror()
            assert still is not None and still["metadata"]["uid"] == m2["metadata"]["uid"]

            # deleted -> the mirror pod goes
            (folder / "web.yaml").unlink()
            await eventually(lambda: mirror() is None, "the mirror pod to be deleted")
            ups: list[PodUpdate] = []
            while not merge.updates.empty():
                ups.append(merge.updates.get_nowait())
            file_ops = [u.op for u in ups if u.source is Source.FILE]
            assert [op for op in file_ops if op is not Op.RECONCILE] == [
                Op.ADD, Op.REMOVE, Op.ADD, Op.REMOVE]
            # each mirror pod's status went to its static pod, as an API pod's would
            assert Op.RECONCILE in file_ops
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await events.drain()
            await kube.aclose()
    try:
        asyncio.run(body())
    finally:
        cleanup(cluster, node, [mirror_name])


@pytest.mark.parametrize("patch", [
    {},
    {"serviceAccountName": "default"},
    {"volumes": [{"name": "s", "secret": {"secretName": "x"}}]},
    {"volumes": [{"name": "c", "configMap": {"name": "x"}}]},
    {"volumes": [{"name": "p", "persistentVolumeClaim": {"claimName": "x"}}]},
    {"containers": [{"name": "c", "image": "i", "env": [
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}]},
], ids=["plain", "service-account", "secret", "configmap", "pvc", "env-secret"])
def test_mirror_problem_predicts_node_restriction(cluster: Cluster, patch: dict) -> None:
    node, api = register_node(cluster)
    node_uid = request_json(api, "GET", f"/api/v1/nodes/{node}")["metadata"]["uid"]
    doc = check_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "m"},
                     "spec": {"containers": [{"name": "c", "image": "i"}], **patch}}, "m")
    static = make_static_pod(doc, Source.FILE, node, RealClock().now())
    body = mirror_pod(static, node_uid)
    predicted = mirror_problem(static)
    try:
        create_mirror(api, node, body)
    except ApiException as e:
        assert predicted is not None, f"the API server refused a mirror we allow: {e.body}"
        assert e.status == 403
    else:
        assert predicted is None, f"the API server admitted a mirror we refuse: {predicted}"
        request_json(api, "DELETE", f"/api/v1/namespaces/default/pods/m-{node}",
                     body={"gracePeriodSeconds": 0})
    # and the shape matters: without the owner reference, a node is refused
    bare = copy.deepcopy(mirror_pod(make_static_pod(
        check_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bare"},
                   "spec": {"containers": [{"name": "c", "image": "i"}]}}, "b"),
        Source.FILE, node, RealClock().now()), node_uid))
    del bare["metadata"]["ownerReferences"]
    with pytest.raises(ApiException) as refused:
        request_json(api, "POST", "/api/v1/namespaces/default/pods", body=bare)
    assert refused.value.status == 403 and "owner reference" in str(refused.value.body)
    cleanup(cluster, node)


def create_mirror(api: client.ApiClient, node: str, body: dict) -> None:
    """POST a mirror pod. NodeRestriction looks the Node up in the API server's cache,
    which may not hold a Node created a moment ago: it answers 404 naming the Node until
    it does (the agent retries such a refusal too); any other refusal is raised."""
    def post() -> bool | None:
        try:
            request_json(api, "POST", "/api/v1/namespaces/default/pods", body=body)
        except ApiException as e:
            details = json.loads(e.body or "{}").get("details", {}) if e.status == 404 else {}
            if details.get("kind") == "nodes" and details.get("name") == node:
                return None
            raise
        return True
    eventually_sync(post, f"the API server's cache to hold Node {node}", timeout=WAIT)


def bound_pod(name: str, node: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "automountServiceAccountToken": False,
                     "containers": [{"name": "c", "image": "busybox:1"}]}}


def names(ups: list[PodUpdate], op: Op) -> list[str]:
    return [p["metadata"]["name"] for u in ups if u.op is op for p in u.pods]


async def drain(merge: Merge, quiet: float = 1.0) -> list[PodUpdate]:
    """Every update until none arrives for `quiet` seconds."""
    out: list[PodUpdate] = []
    while True:
        try:
            out.append(await asyncio.wait_for(merge.updates.get(), quiet))
        except TimeoutError:
            return out


def test_dropped_watch_resumes_without_relist(cluster: Cluster) -> None:
    node, api = register_node(cluster)
    admin_api = cluster.api_client()
    name_a, name_b = f"a-{node}", f"b-{node}"
    request_json(admin_api, "POST", "/api/v1/namespaces/default/pods",
                 body=bound_pod(name_a, node))

    async def body() -> None:
        clock = FakeClock()  # backoff waits only when the test says so
        merge = Merge([Source.API])
        kube = node_kube(cluster, node)
        src = APISource(kube, [node], merge, clock)
        task = asyncio.create_task(src.run())
        try:
            await asyncio.wait_for(merge.ready.wait(), WAIT)
            await asyncio.wait_for(src.reflector.connected.wait(), WAIT)
            assert names(await drain(merge), Op.ADD) == [name_a]
            dropped = now_rfc3339()
            rv_before = src.reflector.resource_version
            src.reflector.drop_connection()
            await eventually(lambda: clock.sleepers == 1 and not src.reflector.connected.is_set(),
                             "the source to back off")
            await asyncio.to_thread(request_json, admin_api, "POST",
                                    "/api/v1/namespaces/default/pods",
                                    body=bound_pod(name_b, node))
            await clock.advance(1.0)
            # the reconnect (a new TLS connection) brings b's ADD; then nothing more
            ups = [await asyncio.wait_for(merge.updates.get(), WAIT), *await drain(merge)]
            assert names(ups, Op.ADD) == [name_b]  # delivered once
            assert names(ups, Op.REMOVE) == []
            assert src.reflector.relists == 0 and src.reflector.lists == 1 and src.reflector.resumes >= 1
            assert int(src.reflector.resource_version or 0) > int(rv_before or 0)
            # the audit log, per user: other clients (the namespace controller cleaning
            # up earlier tests) may list pods meanwhile, this node must not
            lists = [e for e in cluster.audit_events()
                     if e["user"]["username"] == f"system:node:{node}"
                     and e["verb"] == "list" and e["objectRef"]["resource"] == "pods"
                     and e["requestReceivedTimestamp"] > dropped]
            assert lists == [], "the node LISTed pods to resume its watch"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await settle()
            await kube.aclose()
    try:
        asyncio.run(body())
    finally:
        cleanup(cluster, node, [name_a, name_b])


def test_apiserver_restart_no_list_and_once(cluster: Cluster) -> None:
    if not hasattr(cluster, "pids"):
        pytest.fail("restarting the API server needs the local control plane")
    node, api = register_node(cluster)
    admin_api = cluster.api_client()
    before_name, during_name = f"before-{node}", f"during-{node}"
    request_json(admin_api, "POST", "/api/v1/namespaces/default/pods",
                 body=bound_pod(before_name, node))

    async def body() -> None:
        clock = FakeClock()
        merge = Merge([Source.API])
        kube = node_kube(cluster, node)
        src = APISource(kube, [node], merge, clock)
        task = asyncio.create_task(src.run())
        try:
            await asyncio.wait_for(merge.ready.wait(), WAIT)
            await asyncio.wait_for(src.reflector.connected.wait(), WAIT)
            assert names(await drain(merge), Op.ADD) == [before_name]
            restarted = now_rfc3339()
            await asyncio.to_thread(cluster.restart_apiserver)
            # the watch broke; the source waits on its (fake) backoff clock
            await eventually(lambda: clock.sleepers == 1, "the source to back off")
            # created while the source is disconnected
            await asyncio.to_thread(request_json, cluster.api_client(), "POST",
                                    "/api/v1/namespaces/default/pods",
                                    body=bound_pod(during_name, node))
            deadline = time.monotonic() + WAIT
            while not src.reflector.connected.is_set() and time.monotonic() < deadline:
                await clock.advance(30.0)  # each retry waits its backoff
                await asyncio.sleep(0.2)
            ups = await drain(merge, quiet=2.0)
            assert names(ups, Op.ADD) == [during_name]  # once
            assert names(ups, Op.REMOVE) == [] and names(ups, Op.UPDATE) == []
            # the scheduler and the controller manager may relist pods after the
            # restart; what must not happen is a LIST of pods by this node
            by_node = [e for e in cluster.audit_events()
                       if e["user"]["username"] == f"system:node:{node}"
                       and e["objectRef"]["resource"] == "pods"
                       and e["requestReceivedTimestamp"] > restarted]
            assert by_node == [], "the node LISTed pods after the API server restart"
            print(f"\nafter the restart: resumes={src.reflector.resumes} relists={src.reflector.relists} "
                  f"(410 Gone answered by the new watch cache -> streaming relist) "
                  f"lists={src.reflector.lists} watches={src.reflector.watches}")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await kube.aclose()
    try:
        asyncio.run(body())
    finally:
        cleanup(cluster, node, [before_name, during_name])
