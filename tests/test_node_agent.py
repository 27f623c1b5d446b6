"""The composition root on the in-memory API: runs, reports health, follows its config
file, stops cleanly."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from nodeagent import __version__, config
from nodeagent.agent import Agent
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import LEASES, NODE_LEASE_NAMESPACE, NODES
from nodeagent.api.serve import HealthServer
from nodeagent.node.controller import NodeSpec
from tests.conftest import AgentRig
from tests.fakekube import FakeKube


def make_agent(tmp_path, argv: list[str]) -> tuple[Agent, FakeClock, FakeKube]:
    rig = AgentRig(tmp_path, *argv, images=["localhost/pause:1"], image_size=700_000)
    return rig.agent, rig.clock, rig.kube


def test_runs_reports_health_and_stops(tmp_path):
    async def main():
        agent, clock, kube = make_agent(tmp_path, [])
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await settle()
        assert agent.readyz() is None and agent.healthz() is None
        node = kube.obj(NODES, "n1")
        assert node["status"]["images"] == [{"names": ["localhost/pause:1"],
                                             "sizeBytes": 700_000}]
        assert node["status"]["nodeInfo"]["kubeletVersion"] == f"v{__version__}-nodepulse"
        assert kube.has(LEASES, "n1", NODE_LEASE_NAMESPACE)
        await clock.advance(30)
        assert agent.healthz() is None
        kube.fail("update leases", *[ConnectionError("down")] * 1000)
        await clock.advance(45)
        assert "lease n1" in (agent.healthz() or "")
        stop.set()
        await task  # returns: the loops stopped and the pools closed
        writes = len(kube.calls)
        await clock.advance(60)
        assert len(kube.calls) == writes  # nothing runs after stop
    asyncio.run(main())


def test_condition_follows_config_file_threshold_change(tmp_path, caplog):
    async def main():
        path = tmp_path / "agent.yaml"
        path.write_text("evictionHard: {nodefs.available: '0%'}\n")
        agent, clock, kube = make_agent(tmp_path, ["--config", str(path)])
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await settle()
        disk = {c["type"]: c["status"] for c in kube.obj(NODES, "n1")["status"]["conditions"]}
        assert disk["DiskPressure"] == "False"
        await clock.advance(5)
        path.write_text("evictionHard: {nodefs.available: 1Pi}\n")  # any fs is below 1Pi
        os.utime(path, (1, 1))
        await clock.advance(10)
        disk = {c["type"]: c["status"] for c in kube.obj(NODES, "n1")["status"]["conditions"]}
        assert disk["DiskPressure"] == "True"
        path.write_text("evictionHard: {nodefs.available: 'lots'}\n")  # refused, kept
        os.utime(path, (2, 2))
        await clock.advance(10)
        assert agent.cfg.eviction_hard["nodefs.available"].value == 2**50
        # settings read once at start are kept, and the log says a restart applies them
        path.write_text("evictionHard: {nodefs.available: 1Pi}\nallowPrivileged: true\n")
        os.utime(path, (3, 3))
        await clock.advance(10)
        assert not agent.cfg.allow_privileged
        restart = [r.getMessage() for r in caplog.records if "take effect on restart" in
                   r.getMessage()]
        assert restart and "allow_privileged" in restart[-1]  # (and the rig's own port)
        stop.set()
        await task
    asyncio.run(main())


def test_many_nodes_share_one_watch_and_two_schedulers(tmp_path):
    async def main():
        agent, clock, kube = make_agent(tmp_path, ["--agent-id", "pool-a"])
        for i in range(2, 6):
            agent.add_node(NodeSpec(f"n{i}", "pool-a"))
        agent.add_node(NodeSpec("n1", "pool-a"))
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await settle()
        await clock.advance(60)
        assert sorted(kube.items(LEASES)) == ["n1", "n2", "n3", "n4", "n5"]
        assert kube.count("list nodes") == 1
        listed = kube.calls_of("list nodes")[0].query  # by label, not by name
        assert listed["labelSelector"] == "nodepulse.dev/agent=pool-a"
        assert "fieldSelector" not in listed
        assert kube.count("update leases") >= 5 * 5
        assert kube.count("patch nodes/status") == 5  # registration reports only
        stop.set()
        await task
    asyncio.run(main())


def test_health_server_on_ipv6_loopback_and_a_taken_port(tmp_path):
    server = HealthServer("::1", 0, CollectorRegistry())
    server.start()
    try:
        with urllib.request.urlopen(f"http://[::1]:{server.port}/healthz", timeout=5) as r:
            assert r.read() == b"ok\n"
        # the port is taken: a clear error naming the flag, before anything is written
        agent, _, kube = make_agent(tmp_path, [])
        agent.cfg = dataclasses.replace(agent.cfg, healthz_bind_address=("::1", server.port))
        with pytest.raises(config.ConfigError,
                           match=rf"--healthz-bind-address: cannot listen on ::1:{server.port}"):
            asyncio.run(agent.run(asyncio.Event()))
        assert not kube.calls
    finally:
        server.stop()


def test_metrics_count_the_event_loops_tasks_not_yet_done():
    async def main() -> tuple[float, float]:
        server = HealthServer("127.0.0.1", 0, CollectorRegistry())
        server.start()
        try:
            def scrape() -> float:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                            timeout=5) as r:
                    text = r.read().decode()
                return next(s.value for f in text_string_to_metric_families(text)
                            for s in f.samples if s.name == "nodepulse_asyncio_tasks")
            before = await asyncio.to_thread(scrape)
            gate = asyncio.Event()
            waiting = [asyncio.create_task(gate.wait()) for _ in range(5)]
            during = await asyncio.to_thread(scrape)
            gate.set()
            await asyncio.gather(*waiting)
            return before, during
        finally:
            server.stop()
    before, during = asyncio.run(main())
    assert during == before + 5
