"""The kubelet API server with the fake runtime and an in-memory API: authentication,
authorization per subresource, caches, logs of what the fake runtime records,
--previous, 404s naming the pod or container, refusals of what a runtime cannot do,
stats, and the Node's daemonEndpoints."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from nodeagent.api.certificates import csr_pem, new_key, renew_at, validity
from nodeagent.api.clock import FakeClock
from nodeagent.node.status import StatusSettings, build_patch, compute_status, meaningful_changes
from nodeagent.runtime.base import (
    ContainerConfig,
    ContainerStats,
    PodRuntimeStatus,
    SandboxConfig,
    Unsupported,
)
from nodeagent.runtime.fake import FakeRuntime
from nodeagent.server.auth import KubeletAuth, User, request_attributes, user_of_certificate
from nodeagent.server.kubeletserver import KubeletServer, pick_container
from nodeagent.server.selfsigned import self_signed
from nodeagent.server.stats import StatsProvider
from nodeagent.server.tls import ServingCert
from tests.conftest import aio

NODE = "n1"


class FakeApi:
    """TokenReview: token "good-<user>" is <user>; SubjectAccessReview: `allowed` holds
    (user, subresource) pairs."""

    def __init__(self) -> None:
        self.allowed: set[tuple[str, str]] = set()
        self.token_reviews = 0
        self.access_reviews: list[dict[str, Any]] = []

    async def review_token(self, token: str) -> dict[str, Any]:
        self.token_reviews += 1
        if token.startswith("good-"):
            return {"authenticated": True, "user": {"username": token[5:], "groups": ["g"]}}
        return {"authenticated": False}

    async def review_access(self, spec: dict[str, Any]) -> dict[str, Any]:
        self.access_reviews.append(spec)
        attrs = spec["resourceAttributes"]
        return {"allowed": (spec["user"], attrs["subresource"]) in self.allowed}


class Host:
    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime
        self.pods: dict[str, dict[str, Any]] = {}

    def find_pod(self, namespace: str, name: str) -> tuple[str, dict[str, Any]] | None:
        for pod in self.pods.values():
            if (pod["metadata"]["namespace"], pod["metadata"]["name"]) == (namespace, name):
                return NODE, pod
        return None

    def all_pods(self) -> list[dict[str, Any]]:
        return list(self.pods.values())

    def node_pods(self, node: str) -> list[dict[str, Any]]:
        return [p for p in self.pods.values() if p["spec"]["nodeName"] == node]

    def runtime_pod(self, uid: str) -> PodRuntimeStatus:
        ids = {i for i, c in self.runtime.containers.items() if c.pod_uid == uid}
        return PodRuntimeStatus(uid, sandboxes=[s for s in self.runtime.sandboxes.values()
                                                if s.pod_uid == uid],
                                containers=[self.runtime.containers[i] for i in ids])


def pod(name: str, uid: str, restart: str = "Always") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid},
            "spec": {"nodeName": NODE, "restartPolicy": restart,
                     "containers": [{"name": "main", "image": "img"}]}}


async def start(runtime: FakeRuntime, host: Host, p: dict[str, Any], attempt: int = 0) -> str:
    sc = SandboxConfig.from_pod(p, log_root=str(host.root))  # type: ignore[attr-defined]
    sid = next((s.id for s in runtime.sandboxes.values() if s.pod_uid == sc.uid), None) \
        or await runtime.run_sandbox(sc)
    cc = ContainerConfig.from_pod(p, p["spec"]["containers"][0], attempt=attempt)
    cid = await runtime.create_container(sid, cc, sc)
    await runtime.start_container(cid)
    return cid


class Env:
    def __init__(self, tmp: Path) -> None:
        self.clock = FakeClock(dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC))
        self.runtime = FakeRuntime(self.clock)
        self.host = Host(self.runtime)
        self.host.root = tmp / "logs"  # type: ignore[attr-defined]
        self.api = FakeApi()
        self.auth = KubeletAuth(self.api, self.clock)
        cert = ServingCert(node=NODE, names=["127.0.0.1"], pki_dir=tmp / "pki", clock=self.clock)
        cert.load_self_signed()
        usage = StatsProvider(self.host, self.runtime, self.clock,
                              lambda: {"cpu_seconds": 12.5, "memory_usage": 3e9,
                                       "memory_working_set": 2e9, "memory_available": 5e9})
        self.server = KubeletServer(self.host, self.auth, cert, usage, node_names=[NODE],
                                    clock=self.clock, registry=CollectorRegistry(),
                                    health_checks={"x": lambda: None})
        self.client: TestClient[Any, Any]


@contextlib.asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[Env]:
    e = Env(tmp_path)
    e.client = TestClient(TestServer(e.server.app()))
    await e.client.start_server()
    try:
        yield e
    finally:
        await e.client.close()
        e.server.watch.close()


def bearer(user: str) -> dict[str, str]:
    return {"Authorization": f"Bearer good-{user}"}


@aio
async def test_no_credentials_401_bad_token_401(tmp_path: Path) -> None:
    async with serving(tmp_path) as env:
        r = await env.client.get("/healthz")
        assert r.status == 401
        r = await env.client.get("/healthz", headers={"Authorization": "Bearer nope"})
        assert r.status == 401


@aio
async def test_authorization_by_subresource_and_caches(tmp_path: Path) -> None:
    async with serving(tmp_path) as env:
        env.api.allowed = {("alice", "proxy")}
        p = pod("web", "u1")
        env.host.pods["u1"] = p
        cid = await start(env.runtime, env.host, p)
        env.runtime.write_log(cid, "hello\nworld\n")
        r = await env.client.get("/containerLogs/ns/web/main", headers=bearer("alice"))
        assert r.status == 200
        assert (await r.text()).endswith("hello\nworld\n")
        review = env.api.access_reviews[-1]
        assert review["resourceAttributes"] == {"verb": "get", "group": "", "version": "v1",
                                                "resource": "nodes", "subresource": "proxy",
                                                "name": NODE}
        assert review["user"] == "alice" and review["groups"] == ["g"]
        r = await env.client.get("/stats/summary", headers=bearer("alice"))
        assert r.status == 403
        assert "subresource(s)=[stats]" in await r.text()
        # answers are cached: the same requests again cost no API call
        calls = (env.api.token_reviews, len(env.api.access_reviews))
        await env.client.get("/containerLogs/ns/web/main", headers=bearer("alice"))
        await env.client.get("/stats/summary", headers=bearer("alice"))
        assert (env.api.token_reviews, len(env.api.access_reviews)) == calls
        # a refusal is kept 30 s, an allowance 5 min
        env.api.allowed.add(("alice", "stats"))
        await env.clock.advance(31)
        assert (await env.client.get("/stats/summary", headers=bearer("alice"))).status == 200


@aio
async def test_pods_and_healthz_try_their_own_subresource_first(tmp_path: Path) -> None:
    async with serving(tmp_path) as env:
        env.api.allowed = {("bob", "proxy")}
        assert (await env.client.get("/pods", headers=bearer("bob"))).status == 200
        subs = [r["resourceAttributes"]["subresource"] for r in env.api.access_reviews]
        assert subs == ["pods", "proxy"]


def test_request_attributes() -> None:
    assert request_attributes("GET", "/stats/summary") == ("get", ["stats"])
    assert request_attributes("GET", "/metrics/resource") == ("get", ["metrics"])
    assert request_attributes("POST", "/exec/ns/p/c") == ("create", ["proxy"])
    assert request_attributes("GET", "/containerLogs/ns/p/c") == ("get", ["proxy"])
    assert request_attributes("GET", "/healthz") == ("get", ["healthz", "proxy"])
    assert request_attributes("GET", "/podsx") == ("get", ["proxy"])
    assert request_attributes("GET", "/logs/syslog") == ("get", ["log"])


def test_user_of_a_client_certificate() -> None:
    cert = {"subject": ((("organizationName", "system:masters"),), (("commonName", "admin"),))}
    assert user_of_certificate(cert) == User("admin", groups=("system:masters",
                                                             "system:authenticated"))


@aio
async def test_unknown_pod_and_container_are_404_naming_them(tmp_path: Path) -> None:
    async with serving(tmp_path) as env:
        env.api.allowed = {("alice", "proxy")}
        r = await env.client.get("/containerLogs/ns/ghost/main", headers=bearer("alice"))
        assert r.status == 404 and "ns/ghost" in await r.text()
        env.host.pods["u1"] = pod("web", "u1")
        r = await env.client.get("/containerLogs/ns/web/nope", headers=bearer("alice"))
        assert r.status == 404 and "'nope'" in await r.text()
        r = await env.client.get("/containerLogs/ns/web/main", headers=bearer("alice"))
        assert r.status == 400 and "waiting to start" in await r.text()
        r = await env.client.get("/exec/ns/ghost/main?command=sh&output=1", headers=bearer("alice"))
        assert r.status == 404


@aio
async def test_previous_is_the_last_terminated_instance(tmp_path: Path) -> None:
    async with serving(tmp_path) as env:
        env.api.allowed = {("alice", "proxy")}
        p = pod("web", "u1")
        env.host.pods["u1"] = p
        first = await start(env.runtime, env.host, p, attempt=0)
        env.runtime.write_log(first, "from-the-first")
        env.runtime.exit_container(first, 1)
        second = await start(env.runtime, env.host, p, attempt=1)
        env.runtime.write_log(second, "from-the-second")
        prev = await (await env.client.get("/containerLogs/ns/web/main?previous=true",
                                           headers=bearer("alice"))).text()
        cur = await (await env.client.get("/containerLogs/ns/web/main", headers=bearer("alice"))).text()
        assert "from-the-first" in prev and "exited with code 1" in prev
        assert "from-the-second" in cur and "from-the-first" not in cur
        # a crashed container that will be restarted: --previous is that one, as lastState
        env.runtime.exit_container(second, 2)
        rs = env.host.runtime_pod("u1")
        assert pick_container(p, rs, "main", previous=True).id == second
        never = pod("job", "u2", restart="Never")
        assert pick_container(never, rs, "main", previous=True).id == first


@aio
async def test_streaming_is_refused_by_a_runtime_that_cannot(tmp_path: Path) -> None:
    async with serving(tmp_path) as env:
        env.api.allowed = {("alice", "proxy")}
        p = pod("web", "u1")
        env.host.pods["u1"] = p
        await start(env.runtime, env.host, p)
        r = await env.client.post("/exec/ns/web/main?command=sh&input=1&output=1",
                                  headers={**bearer("alice"), "Connection": "Upgrade",
                                           "Upgrade": "SPDY/3.1"})
        assert r.status == 501 and "fake runtime cannot exec" in await r.text()
        r = await env.client.post("/exec/ns/web/main?command=sh", headers=bearer("alice"))
        assert r.status == 400 and "at least 1 of stdin" in await r.text()


@aio
async def test_stats_and_resource_metrics(tmp_path: Path) -> None:
    async with serving(tmp_path) as env:
        env.api.allowed = {("m", "stats"), ("m", "metrics")}
        p = pod("web", "u1")
        env.host.pods["u1"] = p
        cid = await start(env.runtime, env.host, p)

        async def stats() -> list[ContainerStats]:
            return [ContainerStats(cid, env.clock.now(), cpu_usage_core_seconds=1.5,
                                   memory_working_set_bytes=4096)]
        env.runtime.container_stats = stats  # type: ignore[method-assign]
        text = await (await env.client.get("/metrics/resource", headers=bearer("m"))).text()
        ms = int(env.clock.now().timestamp() * 1000)
        assert f'container_cpu_usage_seconds_total{{container="main",namespace="ns",pod="web"}} ' \
               f'1.5 {ms}' in text
        assert f'container_memory_working_set_bytes{{container="main",namespace="ns",pod="web"}} ' \
               f'4096.0 {ms}' in text
        assert f"node_cpu_usage_seconds_total 12.5 {ms}" in text
        assert "resource_scrape_error 0" in text
        summary = await (await env.client.get("/stats/summary", headers=bearer("m"))).json()
        assert summary["node"]["nodeName"] == NODE
        assert summary["node"]["memory"]["workingSetBytes"] == 2_000_000_000
        c = summary["pods"][0]["containers"][0]
        assert c["cpu"]["usageCoreNanoSeconds"] == 1_500_000_000
        assert c["memory"]["workingSetBytes"] == 4096


@aio
async def test_a_runtime_that_measures_nothing_says_so(tmp_path: Path) -> None:
    async with serving(tmp_path) as env:
        env.api.allowed = {("m", "metrics")}

        async def unmeasured() -> list[ContainerStats]:
            raise Unsupported("this runtime measures no container usage")
        env.runtime.container_stats = unmeasured  # type: ignore[method-assign]
        text = await (await env.client.get("/metrics/resource", headers=bearer("m"))).text()
        assert "resource_scrape_error 1" in text


def test_daemon_endpoints_in_node_status() -> None:
    from nodeagent.node.host import HostReadings
    readings = HostReadings(cpu=2, memoryTotal=2**30, memoryAvailable=2**29, fsTotal=2**34,
                            fsAvailable=2**33, inodesTotal=1000, inodesFree=500, pidMax=1000,
                            pidsRunning=10)
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    old = compute_status(readings, StatusSettings(), [], now)
    new = compute_status(readings, StatusSettings(kubelet_port=10250), [], now)
    assert new["daemonEndpoints"] == {"kubeletEndpoint": {"Port": 10250}}
    changes = meaningful_changes(old, new)
    assert changes == ["daemonEndpoints"]
    assert build_patch(old, new, changes, False)["status"]["daemonEndpoints"] == \
        {"kubeletEndpoint": {"Port": 10250}}


def test_certificates(tmp_path: Path) -> None:
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    cert, key = self_signed("n1", ["127.0.0.1", "n1"], now)
    before, after = validity(cert)
    assert after - before > dt.timedelta(days=364)
    import random
    at = renew_at(before, after, random.Random(1))
    assert before + (after - before) * 0.7 <= at <= before + (after - before) * 0.9
    csr = csr_pem(new_key(), "n1", ["127.0.0.1"])
    from cryptography import x509
    req = x509.load_pem_x509_csr(csr)
    assert req.subject.rfc4514_string() == "CN=system:node:n1,O=system:nodes"
    path = tmp_path / "c.pem"
    path.write_bytes(cert + key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(path)


def test_fake_runtime_log_rotation(tmp_path: Path) -> None:
    from nodeagent.runtime.logrotation import LogRotation, tidy

    async def main() -> None:
        clock = FakeClock(dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC))
        rt = FakeRuntime(clock)
        host = Host(rt)
        host.root = tmp_path  # type: ignore[attr-defined]
        cid = await start(rt, host, pod("web", "u1"))
        path = rt.containers[cid].log_path
        rot = LogRotation(rt, lambda: [(cid, path)], clock, max_size=2048, max_files=3)
        for i in range(4):
            rt.write_log(cid, "x" * 3000)
            assert await rot.rotate_all() == 1
            await clock.advance(1)
            assert Path(path).stat().st_size == 0, i
        left = sorted(p.name for p in Path(path).parent.iterdir())
        # the current file, the newest rotated one as is, one older compressed
        assert left == ["0.log", "0.log.20260102-030407.gz", "0.log.20260102-030408"], left
        assert tidy(path, 3) == [str(Path(path).parent / "0.log.20260102-030408.gz")]

    asyncio.run(main())


@aio
async def test_one_server_for_many_nodes_authorizes_against_the_pods_node(tmp_path: Path) -> None:
    async with serving(tmp_path) as env:
        env.server.node_names = ["vn-0", "vn-1"]
        env.api.allowed = {("alice", "proxy"), ("alice", "stats")}
        p = pod("web", "u1")
        env.host.pods["u1"] = p
        env.host.find_pod = lambda ns, name: ("vn-1", p) if name == "web" else None  # type: ignore[method-assign,assignment]
        await start(env.runtime, env.host, p)
        review = env.api.review_access

        async def on_named_nodes_only(spec: dict[str, Any]) -> dict[str, Any]:
            answer = await review(spec)
            return answer if spec["resourceAttributes"]["name"] else {"allowed": False}
        env.api.review_access = on_named_nodes_only  # type: ignore[method-assign]
        assert (await env.client.get("/containerLogs/ns/web/main",
                                     headers=bearer("alice"))).status == 200
        # every Node first (denied: alice may only on Nodes by name), then the pod's
        assert [r["resourceAttributes"]["name"] for r in env.api.access_reviews] == ["", "vn-1"]
        env.api.review_access = review  # type: ignore[method-assign]
        assert (await env.client.get("/stats/summary", headers=bearer("alice"))).status == 200
        # a path naming no node: checked against every Node of the process
        assert env.api.access_reviews[-1]["resourceAttributes"]["name"] == ""


@aio
async def test_one_review_for_every_node_covers_each_of_them(tmp_path: Path) -> None:
    """metrics-server scraping a thousand virtual nodes, each at its own port: a user
    allowed on every Node is asked about once, not once a node."""
    async with serving(tmp_path) as env:
        env.server.node_names = ["vn-0", "vn-1"]
        env.api.allowed = {("alice", "stats")}
        for node in ("vn-0", "vn-1", "vn-0"):
            await env.server.auth.authorize(User("alice"), "GET", "/stats/summary", node,
                                            every_node_first=True)
        assert [r["resourceAttributes"]["name"] for r in env.api.access_reviews] == [""]


@aio
async def test_api_server_unreachable_is_401_then_500_and_not_cached(tmp_path: Path) -> None:
    async with serving(tmp_path) as env:
        env.api.allowed = {("alice", "proxy")}
        real = env.api.review_token

        async def down(token: str) -> dict[str, Any]:
            raise ConnectionError("connection refused")
        env.api.review_token = down  # type: ignore[method-assign]
        assert (await env.client.get("/healthz", headers=bearer("alice"))).status == 401
        env.api.review_token = real  # type: ignore[method-assign]
        real_review = env.api.review_access

        async def review_down(spec: dict[str, Any]) -> dict[str, Any]:
            raise ConnectionError("connection refused")
        env.api.review_access = review_down  # type: ignore[method-assign]
        r = await env.client.get("/containerLogs/ns/x/main", headers=bearer("alice"))
        assert r.status == 500 and "Authorization error (user=alice" in await r.text()
        env.api.review_access = real_review  # type: ignore[method-assign]
        r = await env.client.get("/containerLogs/ns/x/main", headers=bearer("alice"))
        assert r.status == 404  # allowed now: nothing failed was kept


def test_log_rotation_lets_other_work_run_between_batches(tmp_path: Path) -> None:
    """A round over thousands of logs does not hold the event loop: others run
    between its batches (and the logs are read as it goes)."""
    from nodeagent.runtime.logrotation import LogRotation

    async def main() -> None:
        clock = FakeClock()
        read: list[int] = []
        turns: list[int] = []

        def running_logs() -> Iterator[tuple[str, str]]:
            for i in range(3 * LogRotation.BATCH):
                read.append(i)
                yield f"c{i}", str(tmp_path / f"{i}.log")  # none there: nothing to rotate

        async def other() -> None:
            while True:
                turns.append(len(read))
                await asyncio.sleep(0)

        rot = LogRotation(FakeRuntime(clock), running_logs, clock, max_size=2048, max_files=3)
        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        turns.clear()
        assert await rot.rotate_all() == 0
        task.cancel()
        # the other task ran while the round was under way, between batches
        assert [n for n in turns if 0 < n < len(read)] == [LogRotation.BATCH, 2 * LogRotation.BATCH]

    asyncio.run(main())


@aio
async def test_the_kubelets_authentication_and_authorization_settings(tmp_path: Path) -> None:
    """authentication.webhook.enabled false: a bearer token is not reviewed (anonymous
    if allowed, else 401); authorization.mode AlwaysAllow: no SubjectAccessReview; the
    cache TTLs are the configured ones."""
    async with serving(tmp_path) as env:
        env.server.auth = KubeletAuth(env.api, env.clock, token_webhook=False, anonymous=True,
                                      authorize_all=True)
        r = await env.client.get("/pods", headers=bearer("alice"))
        assert r.status == 200
        assert env.api.token_reviews == 0 and env.api.access_reviews == []
        env.server.auth = KubeletAuth(env.api, env.clock, token_webhook=False)
        assert (await env.client.get("/pods", headers=bearer("alice"))).status == 401
        env.server.auth = KubeletAuth(env.api, env.clock, token_ttl=10, allowed_ttl=20,
                                      denied_ttl=5)
        env.api.allowed = {("alice", "pods")}
        assert (await env.client.get("/pods", headers=bearer("alice"))).status == 200
        env.api.allowed = set()
        await env.clock.advance(15)  # the token is asked again, the allowance is kept
        assert (await env.client.get("/pods", headers=bearer("alice"))).status == 200
        assert env.api.token_reviews == 2 and len(env.api.access_reviews) == 1
        await env.clock.advance(10)
        assert (await env.client.get("/pods", headers=bearer("alice"))).status == 403
        env.api.allowed = {("alice", "pods")}
        await env.clock.advance(6)  # a refusal is kept 5 s
        assert (await env.client.get("/pods", headers=bearer("alice"))).status == 200


@aio
async def test_without_debugging_handlers_logs_and_exec_are_not_served(tmp_path: Path) -> None:
    async with serving(tmp_path) as env:
        env.server.debugging_handlers = False
        env.api.allowed = {("alice", "proxy"), ("alice", "pods")}
        env.host.pods["u1"] = pod("web", "u1")
        for path in ("/containerLogs/ns/web/main", "/exec/ns/web/main?command=ls",
                     "/portForward/ns/web"):
            r = await env.client.get(path, headers=bearer("alice"))
            assert r.status == 404 and "enableDebuggingHandlers is false" in await r.text()
        assert (await env.client.get("/pods", headers=bearer("alice"))).status == 200


def test_tls13_only_serving(tmp_path: Path) -> None:
    clock = FakeClock(dt.datetime(2026, 1, 2, tzinfo=dt.UTC))
    cert = ServingCert(node=NODE, names=["127.0.0.1"], pki_dir=tmp_path, clock=clock,
                       tls13_only=True)
    assert cert.context.minimum_version == ssl.TLSVersion.TLSv1_3
