"""Virtual-node mode on the in-memory API, the fake runtime and FakeClock: one process
runs N Nodes (own Node, Lease, status, policy) over one node watch, one pod watch, one
runtime and one PLEG."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from nodeagent import config
from nodeagent.agent import Agent, Externals, Pools, build_runtime
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import LEASES, NODE_LEASE_NAMESPACE, NODES
from nodeagent.api.policy import (
    AGENT_LABEL,
    HEARTBEAT_ANNOTATION,
    Heartbeat,
    encode_heartbeat_annotation,
)
from nodeagent.pods.podupdate import Op
from nodeagent.pods.sources.api import APISource
from nodeagent.runtime.base import SandboxConfig
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import InlineExecutor, LoopRig, agent_config, agent_flags, aio, mkpod
from tests.fakekube import FakeKube

VIRTUAL_TAINT = {"key": "nodepulse.dev/virtual", "value": "true", "effect": "NoSchedule"}


# -- settings --

def test_count_and_prefix_make_the_names(tmp_path: Path) -> None:
    cfg = agent_config(tmp_path, "--virtual-nodes", "3", "--node-name-prefix", "vn")
    assert cfg.virtual and cfg.node_names == ("vn-0", "vn-1", "vn-2")
    assert cfg.agent_id == "vn"  # the label that finds them
    assert cfg.virtual_node_taints == (VIRTUAL_TAINT,)
    host = agent_config(tmp_path, "--node-name", "h1")
    assert not host.virtual and host.node_names == ("h1",)  # N=1: the host agent
    env = agent_config(tmp_path, env={"NODEPULSE_VIRTUAL_NODES": "2",
                              "NODEPULSE_NODE_NAME_PREFIX": "e"})
    assert env.node_names == ("e-0", "e-1")
    # the Helm chart passes --node-name-prefix=$(POD_NAME)- and --agent-id=$(POD_NAME)
    chart = agent_config(tmp_path, "--virtual-nodes", "2", "--node-name-prefix", "np-agent-0-",
                 "--agent-id", "np-agent-0")
    assert chart.node_names == ("np-agent-0-0", "np-agent-0-1")
    assert agent_config(tmp_path, "--virtual-nodes", "1", "--node-name-prefix",
                "np-").agent_id == "np"


def test_names_from_the_config_file_and_taint_choices(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("virtualNodes: [edge-a, edge-b]\nagentID: edge\n"
                    "virtualNodeTaint: 'pool=edge:NoExecute'\n")
    cfg = agent_config(tmp_path, "--config", str(path))
    assert cfg.node_names == ("edge-a", "edge-b") and cfg.agent_id == "edge"
    assert cfg.virtual_node_taints == ({"key": "pool", "value": "edge",
                                        "effect": "NoExecute"},)
    off = agent_config(tmp_path, "--virtual-nodes", "2", "--virtual-node-taint", "none")
    assert off.virtual_node_taints == ()


@pytest.mark.parametrize("argv, message", [
    (["--virtual-nodes", "2", "--pod-manifest-path", "/etc/pods"],
     "--pod-manifest-path: static pods are not supported with --virtual-nodes"),
    (["--virtual-nodes", "2", "--manifest-url", "http://127.0.0.1/p"],
     "--manifest-url: static pods are not supported"),
    (["--virtual-nodes", "2", "--runtime", "cri"], "--runtime cri: not supported"),
    (["--virtual-nodes", "2", "--node-name-prefix", "Big"],
     "--node-name-prefix: 'Big-1' is not a valid Node name"),
    (["--virtual-nodes", "-1"], "--virtual-nodes: must be between 0 and"),
    (["--virtual-nodes", "many"], "--virtual-nodes: expected a whole number"),
    (["--node-name-prefix", "vn"], "--node-name-prefix: only used with --virtual-nodes"),
    (["--virtual-nodes", "2", "--virtual-node-taint", "k=v:Sometimes"],
     "--virtual-node-taint: taint k: effect must be one of"),
])
def test_bad_virtual_settings_are_refused(tmp_path: Path, argv: list[str],
                                          message: str) -> None:
    with pytest.raises(config.ConfigError, match=message.replace("?", r"\?")):
        agent_config(tmp_path, *argv)


def test_duplicate_names_in_the_file_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("virtualNodes: [a, b, a]\n")
    with pytest.raises(config.ConfigError, match="virtualNodes: node name.s. listed twice: a"):
        agent_config(tmp_path, "--config", str(path))


def test_help_documents_the_identity(tmp_path: Path) -> None:
    from nodeagent.cli import build_parser
    text = " ".join(build_parser().format_help().split())
    assert "--virtual-nodes" in text and "--node-name-prefix" in text
    assert "ServiceAccount" in text and "NodeRestriction" in text


# -- nodes: registration, leases, one watch --

def make_agent(tmp_path: Path, *argv: str) -> tuple[Agent, FakeClock, FakeKube]:
    flags = agent_flags(tmp_path, *argv)
    clock = FakeClock()
    kube = FakeKube(now=clock.monotonic)
    inline = InlineExecutor()
    cfg = dataclasses.replace(config.load(flags, {}), port=None)  # no kubelet API here
    agent = Agent(cfg,
                  Externals(kube, clock, runtime=FakeRuntime(clock, images=[]),
                        pools=Pools(inline, inline), registry=CollectorRegistry(),
                        flags=flags, env={}))
    return agent, clock, kube


@aio
async def test_n_nodes_register_renew_on_schedule_over_one_watch(tmp_path: Path) -> None:
    n = 30
    agent, clock, kube = make_agent(tmp_path, "--virtual-nodes", str(n),
                                    "--node-name-prefix", "vn",
                                    "--register-with-taints", "team=a:NoSchedule")
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await settle()
    names = [f"vn-{i}" for i in range(n)]
    assert sorted(kube.items(NODES)) == sorted(names)
    for name in names:
        meta, spec = kube.obj(NODES, name)["metadata"], kube.obj(NODES, name)["spec"]
        assert meta["labels"][AGENT_LABEL] == "vn"
        assert meta["labels"]["nodepulse.dev/virtual"] == "true"
        assert meta["labels"]["kubernetes.io/hostname"] == name
        assert spec["taints"] == [{"key": "team", "value": "a", "effect": "NoSchedule"},
                                  VIRTUAL_TAINT]
    for _ in range(120):
        await clock.advance(1)
    assert agent.readyz() is None and agent.healthz() is None
    # one label-selector watch for all the nodes
    assert kube.count("list nodes") == 1 and kube.count("get nodes") <= n  # registration
    assert agent.watch is not None
    assert agent.watch.reflector.config.label_selector == f"{AGENT_LABEL}=vn"
    assert agent.watch.reflector.config.field_selector == ""
    for name in names:
        renewals = [c.at for c in kube.calls if c.key in ("create leases", "update leases")
                    and c.name == name]
        assert 11 <= len(renewals) <= 14, (name, renewals)  # every 10 s (jittered)
        gaps = [b - a for a, b in zip(renewals, [*renewals[1:], clock.monotonic()], strict=True)]
        assert max(gaps) < 40  # never older than the lease duration
    # status ticks share host readings: far fewer /proc reads than node ticks
    assert agent.shared_readings.reads <= 130 < n * 12
    stop.set()
    await task


@aio
async def test_each_virtual_node_follows_its_own_policy(tmp_path: Path) -> None:
    agent, clock, kube = make_agent(tmp_path, "--virtual-nodes", "3",
                                    "--node-name-prefix", "vn")
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await settle()
    fast = Heartbeat(leaseDurationSeconds=20, renewIntervalSeconds=5)
    kube.annotate(NODES, "vn-1", HEARTBEAT_ANNOTATION, encode_heartbeat_annotation("fast", fast))
    await settle()
    start = clock.monotonic()
    for _ in range(60):
        await clock.advance(1)

    def renewals(name: str) -> int:
        return sum(1 for c in kube.calls_of("update leases") if c.name == name
                   and c.at > start)
    assert agent.nodes["vn-1"].heartbeat.renewIntervalSeconds == 5
    assert agent.nodes["vn-0"].heartbeat.renewIntervalSeconds == 10
    assert renewals("vn-1") >= 10 and renewals("vn-0") <= 7 and renewals("vn-2") <= 7
    stop.set()
    await task


def test_no_taint_when_disabled(tmp_path: Path) -> None:
    async def main() -> None:
        agent, clock, kube = make_agent(tmp_path, "--virtual-nodes", "2",
                                        "--virtual-node-taint", "")
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await settle()
        assert all("taints" not in (n.get("spec") or {}) for n in kube.items(NODES).values())
        stop.set()
        await task
    asyncio.run(main())


# -- pods: one watch, one runtime, one PLEG, routed per node --

def vpod(uid: str, node: str) -> dict[str, Any]:
    return mkpod(f"p-{uid}", uid, node=node)


def rig_of(names: list[str]) -> LoopRig:
    clock = FakeClock()
    return LoopRig(FakeRuntime(clock, images=["localhost/busybox:1"]), clock, nodes=names)


@aio
async def test_pods_run_on_their_node_loop_with_one_pleg() -> None:
    rig = rig_of(["vn-0", "vn-1", "vn-2"])
    await rig.pods.start()
    await settle()
    rig.send(Op.ADD, vpod("a", "vn-0"), vpod("b", "vn-2"), vpod("x", "elsewhere"))
    relists = rig.rt.calls.get("relist", 0)
    for _ in range(10):
        await rig.clock.advance(1)
    assert rig.status("a")["phase"] == "Running" and rig.status("b")["phase"] == "Running"
    assert not rig.rt.running("x")  # not one of ours
    assert set(rig.loops.loops["vn-0"].pods) == {"a"}
    assert set(rig.loops.loops["vn-2"].pods) == {"b"}
    assert "vn-1" not in rig.loops.loops  # no pod: no loop, no queues, no metric series
    # one PLEG for the three nodes: one event stream, and no relist while it is up
    # (its period is a minute), not three
    assert rig.rt.calls["container_events"] == 1
    assert rig.rt.calls["relist"] == relists
    # a container dies: the shared PLEG's event reaches vn-2's loop, which restarts it
    cid = rig.rt.running("b")[0].id
    rig.rt.exit_container(cid, 3)
    for _ in range(3):
        await rig.clock.advance(1)
    st = [st for u, st in rig.patches() if u == "b"][-1]
    assert st["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 3
    assert len(rig.rt.running("b")) == 1 and len(rig.rt.running("a")) == 1
    # housekeeping across all nodes: another node's pod is no orphan; an unknown one is
    for _ in range(5):
        await rig.clock.advance(1)
    assert rig.rt.running("a") and rig.rt.running("b")
    rig.send(Op.REMOVE, vpod("a", "vn-0"))
    for _ in range(5):
        await rig.clock.advance(1)
    assert not rig.rt.running("a") and rig.rt.running("b")
    assert "a" not in rig.loops.owner
    assert rig.pods.health() is None
    await rig.pods.stop()
    calls = sum(rig.rt.calls.values())
    await rig.clock.advance(10)
    assert sum(rig.rt.calls.values()) == calls  # nothing runs after stop


@aio
async def test_orphans_unknown_to_every_node_are_removed() -> None:
    rig = rig_of(["vn-0", "vn-1"])
    await rig.pods.start()
    rig.send(Op.ADD, vpod("a", "vn-1"))
    for _ in range(4):
        await rig.clock.advance(1)
    assert rig.rt.running("a")
    # a pod left in the runtime by an earlier agent: no node has it
    await rig.rt.run_sandbox(SandboxConfig.from_pod(vpod("old", "vn-0")))
    assert "old" in {s.pod_uid for s in (await rig.rt.relist()).sandboxes}
    for _ in range(6):
        await rig.clock.advance(1)
    assert rig.rt.running("a")  # vn-1's pod is known: kept
    assert "old" not in {s.pod_uid for s in (await rig.rt.relist()).sandboxes}
    await rig.pods.stop()


def test_one_pod_watch_for_all_nodes_and_the_runtime(tmp_path: Path) -> None:
    cfg = agent_config(tmp_path, "--virtual-nodes", "4", "--node-name-prefix", "vn")
    assert isinstance(build_runtime(cfg), FakeRuntime)  # auto: fake for virtual nodes
    agent = Agent(cfg, Externals(FakeKube(), FakeClock(), registry=CollectorRegistry()))
    watches = [p for p in agent.pods.sources if isinstance(p, APISource)]
    assert len(agent.pods.sources) == 1 and len(watches) == 1
    assert watches[0].nodes == {"vn-0", "vn-1", "vn-2", "vn-3"}
    assert agent.pods.loops.node_names == {"vn-0", "vn-1", "vn-2", "vn-3"}
    assert agent.pods.loops.loops == {}  # each made when its node first has a pod
    assert isinstance(agent.pods.runtime, FakeRuntime)


@aio
async def test_resyncs_of_every_node_come_from_one_timer() -> None:
    names = [f"vn-{i}" for i in range(20)]
    rig = rig_of(names)
    await rig.pods.start()
    await settle()
    idle = rig.clock.sleepers
    rig.send(Op.ADD, vpod("a", "vn-3"), vpod("b", "vn-17"))
    for _ in range(5):
        await rig.clock.advance(1)
    assert rig.status("a")["phase"] == "Running" and rig.status("b")["phase"] == "Running"
    a, b = rig.loops.loops["vn-3"].workers, rig.loops.loops["vn-17"].workers
    before = a.syncs("a"), b.syncs("b")
    for _ in range(95):  # past the 60-90 s resync window: each pod is synced once more
        await rig.clock.advance(1)
    assert (a.syncs("a"), b.syncs("b")) == (before[0] + 1, before[1] + 1)
    # 20 node loops wait on no timer of their own: the sleepers did not grow with nodes
    assert idle < len(names)
    await rig.pods.stop()


class SaturatedServer(FakeKube):
    """A server that answers Lease writes slower than the nodes ask for them: each takes
    `service` seconds, and `separate(n)` gives a client with n request turns, a write
    waiting for its turn as over rest.Transport."""

    def __init__(self, clock: FakeClock, service: float) -> None:
        super().__init__(now=clock.monotonic)
        self.clock, self.service = clock, service

    def separate(self, connections: int) -> Any:
        return _Turns(self, asyncio.Semaphore(connections))


class _Turns:
    def __init__(self, server: SaturatedServer, turns: asyncio.Semaphore) -> None:
        self.server, self.turns = server, turns

    def __getattr__(self, verb: str) -> Any:
        call = getattr(self.server, verb)
        if verb not in ("get", "create", "update"):
            return call

        async def in_turn(res: Any, *args: Any, **kwargs: Any) -> Any:
            if res is not LEASES:
                return await call(res, *args, **kwargs)
            async with self.turns:
                await self.server.clock.sleep(self.server.service)
                return await call(res, *args, **kwargs)
        return in_turn


@aio
async def test_a_saturated_server_still_holds_every_lease_fresh(tmp_path: Path) -> None:
    """The server takes Lease writes at a third of the pace the nodes ask for them (one
    every 0.4 s against 75 nodes', 15 of them on a 5 s interval and a 20 s duration):
    each Lease is renewed less often, and still none is ever older than its duration
    as the server holds it. A renewal stamps its renewTime when it gets its turn, not
    while it waits for one, and the Lease that expires first goes first (in the order
    they fall due, the fast pool's would wait 26 s for each renewal)."""
    n, fast = 75, 15
    flags = agent_flags(tmp_path, "--virtual-nodes", str(n), "--node-name-prefix", "vn",
                        "--lease-concurrency", "1")
    clock = FakeClock()
    kube = SaturatedServer(clock, service=0.4)
    inline = InlineExecutor()
    cfg = dataclasses.replace(config.load(flags, {}), port=None)
    agent = Agent(cfg, Externals(kube, clock, runtime=FakeRuntime(clock, images=[]),
                                 pools=Pools(inline, inline), registry=CollectorRegistry(),
                                 flags=flags, env={}))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await settle()
    policy = encode_heartbeat_annotation(
        "fast", Heartbeat(leaseDurationSeconds=20, renewIntervalSeconds=5))
    for i in range(fast):
        kube.annotate(NODES, f"vn-{i}", HEARTBEAT_ANNOTATION, policy)
    oldest = {20: 0.0, 40: 0.0}  # by duration
    for second in range(360):
        await clock.advance(1)
        leases = kube.items(LEASES, NODE_LEASE_NAMESPACE)
        if second < 180:  # the first writes of all the nodes (a GET and a create each)
            continue
        assert len(leases) == n
        now = clock.now()
        for lease in leases.values():
            renewed = dt.datetime.strptime(lease["spec"]["renewTime"],
                                           "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC)
            duration = lease["spec"]["leaseDurationSeconds"]
            oldest[duration] = max(oldest[duration], (now - renewed).total_seconds())
    asked = (n - fast) * 360 / 10 + fast * 360 / 5
    assert kube.count("update leases") <= 360 / 0.4 < asked / 3  # the server's pace
    assert oldest[20] < 20 and oldest[40] < 40, oldest
    stop.set()
    await task
