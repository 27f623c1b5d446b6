"""Simulated usage on the fake runtime (virtual nodes): the expressions, the containers'
usage from their pod's annotations (or the agent's defaults), and the kubelet API
serving each virtual node on a port of its own with its pods' usage plus its base."""

from __future__ import annotations

import argparse
import datetime as dt
import math
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from nodeagent import config
from nodeagent.api.clock import FakeClock
from nodeagent.runtime.base import ContainerConfig, PodRuntimeStatus, SandboxConfig
from nodeagent.runtime.fake import FakeRuntime
from nodeagent.runtime.script import ScriptError, script_for
from nodeagent.runtime.usage import Usage, UsageError, parse_usage
from nodeagent.server.auth import KubeletAuth
from nodeagent.server.kubeletserver import KubeletServer, ServerSettings
from nodeagent.server.stats import SimulatedNode, StatsProvider
from nodeagent.server.tls import ServingCert
from tests.conftest import aio

T0 = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
TOKEN = {"Authorization": "Bearer scraper"}


class Api:
    """Every token is the scraper, allowed everything."""

    async def review_token(self, token: str) -> dict[str, Any]:
        return {"authenticated": True, "user": {"username": "scraper", "groups": []}}

    async def review_access(self, spec: dict[str, Any]) -> dict[str, Any]:
        return {"allowed": True}


class Host:
    """The pods bound here (to any of the nodes) and what the runtime has of them."""

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime
        self.pods: dict[str, dict[str, Any]] = {}

    def find_pod(self, namespace: str, name: str) -> tuple[str, dict[str, Any]] | None:
        return next(((p["spec"]["nodeName"], p) for p in self.pods.values()
                     if (p["metadata"]["namespace"], p["metadata"]["name"]) == (namespace, name)),
                    None)

    def all_pods(self) -> list[dict[str, Any]]:
        return list(self.pods.values())

    def node_pods(self, node: str) -> list[dict[str, Any]]:
        return [p for p in self.pods.values() if p["spec"]["nodeName"] == node]

    def runtime_pod(self, uid: str) -> PodRuntimeStatus:
        return PodRuntimeStatus(uid, sandboxes=[s for s in self.runtime.sandboxes.values()
                                                if s.pod_uid == uid],
                                containers=[c for c in self.runtime.containers.values()
                                            if c.pod_uid == uid])


def test_a_constant_a_ramp_and_a_sine() -> None:
    flat = parse_usage("250m", "x")
    assert (flat.at(99), flat.integral(10)) == (0.25, 2.5)
    ramp = parse_usage("ramp(100m, 900m, 2m)", "x")
    assert ramp.at(0) == pytest.approx(0.1) and ramp.at(60) == pytest.approx(0.5)
    assert ramp.at(500) == pytest.approx(0.9)
    # the area under the ramp (2 min averaging 0.5 cores), then 0.9 a second
    assert ramp.integral(120) == pytest.approx(60.0)
    assert ramp.integral(130) == pytest.approx(69.0)
    sine = parse_usage("sine(500m, 300m, 1m)", "x")
    assert sine.at(15) == pytest.approx(0.8) and sine.at(45) == pytest.approx(0.2)
    assert sine.integral(60) == pytest.approx(30.0)  # a whole period: the mean's
    assert sine.integral(30) == pytest.approx(15 + 0.3 * 60 / math.pi)
    assert parse_usage("64Mi", "x").at(5) == 64 * 2**20
    assert Usage(1.0).integral(-5) == 0.0  # nothing before the start


@pytest.mark.parametrize(("text", "complaint"), [
    ("lots", "is not a quantity"),
    ("-1", "must not be negative"),
    ("ramp(1, 2)", "takes 3 values"),
    ("ramp(1, 2, soon)", "soon"),
    ("ramp(1, 2, 0s)", "more than 0"),
    ("sine(100m, 200m, 1m)", "amplitude exceeds the mean"),
    ("wave(1, 2, 3s)", "is not a quantity"),
])
def test_a_bad_expression_names_where_it_came_from(text: str, complaint: str) -> None:
    with pytest.raises(UsageError, match="annotation fake.nodepulse.dev/cpu") as e:
        parse_usage(text, "annotation fake.nodepulse.dev/cpu")
    assert complaint in str(e.value)


def test_the_annotations_per_pod_and_per_container() -> None:
    annotations = {"fake.nodepulse.dev/cpu": "200m", "fake.nodepulse.dev/memory.side": "10Mi"}
    main, side = script_for(annotations, "main"), script_for(annotations, "side")
    assert main.cpu == Usage(0.2) and main.memory is None
    assert side.cpu == Usage(0.2) and side.memory == Usage(10 * 2**20)
    with pytest.raises(ScriptError, match="fake.nodepulse.dev/memory: 'x' is not a quantity"):
        script_for({"fake.nodepulse.dev/memory": "x"}, "main")


def test_the_agents_defaults_are_checked_at_start() -> None:
    p = argparse.ArgumentParser()
    config.add_flags(p)
    cfg = config.parse_args(["--node-name", "n1", "--fake-cpu", "ramp(0, 1, 1m)",
                             "--fake-node-memory", "1Gi"], p, {})
    assert (cfg.fake_cpu, cfg.fake_node_memory) == ("ramp(0, 1, 1m)", "1Gi")
    with pytest.raises(config.ConfigError, match="--fake-node-cpu"):
        config.parse_args(["--node-name", "n1", "--fake-node-cpu", "sine(1, 2, 3s)"], p, {})


def pod(name: str, uid: str, node: str, annotations: dict[str, str] | None = None
        ) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid,
                         "annotations": annotations or {}},
            "spec": {"nodeName": node, "restartPolicy": "Always",
                     "containers": [{"name": "main", "image": "img"}]}}


async def run_pod(runtime: FakeRuntime, host: Host, p: dict[str, Any]) -> str:
    host.pods[p["metadata"]["uid"]] = p
    sc = SandboxConfig.from_pod(p, log_root="")
    sid = await runtime.run_sandbox(sc)
    cid = await runtime.create_container(
        sid, ContainerConfig.from_pod(p, p["spec"]["containers"][0]), sc)
    await runtime.start_container(cid)
    return cid


@aio
async def test_fake_containers_report_what_their_pods_say() -> None:
    clock = FakeClock(T0)
    runtime = FakeRuntime(clock, default_memory=Usage(2**20))
    host = Host(runtime)
    busy = await run_pod(runtime, host, pod("busy", "u1", "vn-0", {
        "fake.nodepulse.dev/cpu": "ramp(0, 1, 10s)", "fake.nodepulse.dev/memory": "64Mi"}))
    idle = await run_pod(runtime, host, pod("idle", "u2", "vn-0"))
    await clock.advance(20)
    stats = {s.container_id: s for s in await runtime.container_stats()}
    assert stats[busy].cpu_usage_core_seconds == pytest.approx(5 + 10)  # the ramp, then 1
    assert stats[busy].memory_working_set_bytes == 64 * 2**20
    assert stats[idle].cpu_usage_core_seconds == 0.0  # the default: nothing runs
    assert stats[idle].memory_working_set_bytes == 2**20
    await runtime.stop_container(busy, 0)
    assert [s.container_id for s in await runtime.container_stats()] == [idle]


@aio
async def test_each_virtual_node_has_a_port_with_its_own_pods_and_usage(tmp_path: Path) -> None:
    """The API server and metrics-server reach a virtual node at the port in its
    daemonEndpoints; there the node is alone: its pods, and its pods' usage plus its
    base. Its CPU counter keeps what a removed pod used."""
    clock = FakeClock(T0)
    runtime = FakeRuntime(clock)
    host = Host(runtime)
    cert = ServingCert(node="vn-0", names=["127.0.0.1"], pki_dir=tmp_path / "pki", clock=clock)
    cert.load_self_signed()
    usage = StatsProvider(host, runtime, clock, simulated=SimulatedNode(
        cpu=Usage(0.1), memory=Usage(100e6), memory_capacity=1e9))
    server = KubeletServer(host, KubeletAuth(Api(), clock), cert, usage,
                           node_names=["vn-0", "vn-1"], clock=clock,
                           registry=CollectorRegistry(),
                           settings=ServerSettings(address="127.0.0.1", port=0,
                                                   per_node_ports=True))
    await server.start()
    tls = ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    try:
        assert set(server.node_ports) == {"vn-0", "vn-1"}
        assert len({*server.node_ports.values(), server.port}) == 3
        a = await run_pod(runtime, host, pod("a", "u1", "vn-0", {"fake.nodepulse.dev/cpu": "500m",
                                                                "fake.nodepulse.dev/memory": "50M"}))
        await run_pod(runtime, host, pod("b", "u2", "vn-1", {"fake.nodepulse.dev/cpu": "2"}))
        await clock.advance(10)

        async with aiohttp.ClientSession() as http:
            async def get(node: str, path: str) -> aiohttp.ClientResponse:
                url = f"https://127.0.0.1:{server.node_ports[node]}{path}"
                r = await http.get(url, headers=TOKEN, ssl=tls)
                assert r.status == 200, await r.text()
                return r

            summary = await (await get("vn-0", "/stats/summary")).json()
            assert summary["node"]["nodeName"] == "vn-0"
            assert [p["podRef"]["name"] for p in summary["pods"]] == ["a"]
            node = summary["node"]
            assert node["cpu"]["usageCoreNanoSeconds"] == int((0.1 + 0.5) * 10 * 1e9)
            assert node["memory"]["workingSetBytes"] == 150_000_000
            assert node["memory"]["availableBytes"] == 850_000_000
            pods = await (await get("vn-1", "/pods")).json()
            assert [p["metadata"]["name"] for p in pods["items"]] == ["b"]
            text = await (await get("vn-1", "/metrics/resource")).text()
            assert 'pod_cpu_usage_seconds_total{namespace="ns",pod="b"} 20.0' in text
            assert "node_cpu_usage_seconds_total 21.0 " in text  # 2 cores and the base
            # one measurement of the runtime served both nodes' requests of that second
            assert runtime.calls["container_stats"] == 1
            # the shared port answers for every node
            r = await http.get(f"https://127.0.0.1:{server.port}/pods", headers=TOKEN,
                               ssl=tls)
            assert len((await r.json())["items"]) == 2

            await runtime.stop_container(a, 0)
            await clock.advance(10)
            node = (await (await get("vn-0", "/stats/summary")).json())["node"]
            assert node["cpu"]["usageCoreNanoSeconds"] == int((0.1 * 20 + 0.5 * 10) * 1e9)
            assert node["memory"]["workingSetBytes"] == 100_000_000
    finally:
        await server.stop()
