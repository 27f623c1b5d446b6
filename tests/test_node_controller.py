"""A node's heartbeat end to end against the in-memory API, on a fake clock:
registration, reporting cadence, policy hot-reload, the node watch, legacy mode."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import random
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from nodeagent.agent import build_node_controller
from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import LEASES, NODE_LEASE_NAMESPACE, NODES
from nodeagent.api.policy import AGENT_LABEL, HEARTBEAT_ANNOTATION, Heartbeat
from nodeagent.node.controller import (
    AS_REGISTERED,
    NodeController,
    NodeControllerConfig,
    NodeSpec,
)
from nodeagent.node.heartbeatmetrics import NodeMetrics
from nodeagent.node.nodewatch import NodeWatch
from nodeagent.node.scheduler import Blocking, DueScheduler
from nodeagent.node.status import StatusSettings
from tests.conftest import READINGS, SETTINGS, InlineExecutor
from tests.fakekube import FakeKube, api_error

DEFAULT_HB = Heartbeat()


def run(coro):
    return asyncio.run(coro)


def annotation(**hb: Any) -> str:
    return json.dumps({"policy": "fast", **hb})


class Rig:
    def __init__(self, hb: Heartbeat = DEFAULT_HB, legacy: bool = False,
                 settings: StatusSettings = SETTINGS, status_call=None) -> None:
        self.clock = FakeClock()
        self.kube = FakeKube(now=self.clock.monotonic)
        self.registry = CollectorRegistry()
        self.metrics = NodeMetrics(self.registry)
        self.readings = READINGS
        self.images: list[dict[str, Any]] = []
        self.pressure: dict[str, str] = {}  # what the eviction manager says holds
        self.nodes: dict[str, NodeController] = {}
        self.renewals: DueScheduler[str] = DueScheduler(
            self.clock, lambda k: self.nodes[k].renew(), "renewals")
        self.ticker: DueScheduler[str] = DueScheduler(
            self.clock, lambda k: self.nodes[k].tick(), "status")
        answered = ApiAnswered(self.clock)
        self.config = NodeControllerConfig(
            kube=self.kube, lease_kube=self.kube, clock=self.clock, metrics=self.metrics,
            heartbeat=hb, status=settings, probe=lambda: self.readings,
            status_call=status_call or Blocking(InlineExecutor()), renewals=self.renewals,
            ticker=self.ticker, answered=answered, uids={}, images=lambda: self.images,
            pressure=lambda node: self.pressure, legacy=legacy)
        self.node = build_node_controller(
            NodeSpec("n1", agent_id="agent-a", labels={"pool": "x"}), self.config,
            random.Random(3))
        self.nodes["n1"] = self.node
        self.watch = NodeWatch(self.kube, self.nodes, self.clock, agent_id="agent-a",
                               answered=answered)
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self, watch: bool = True) -> None:
        self.tasks = [asyncio.create_task(self.renewals.run()),
                      asyncio.create_task(self.ticker.run())]
        if watch:
            self.tasks.append(asyncio.create_task(self.watch.run()))
        self.node.start()
        await settle()

    async def stop(self) -> None:
        self.watch.stop()
        await self.renewals.stop()
        await self.ticker.stop()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def reports(self, reason: str) -> float:
        return self.registry.get_sample_value("nodepulse_node_status_reports_total",
                                              {"reason": reason}) or 0.0

    def status_bodies(self) -> list[dict[str, Any]]:
        return [b["status"] for b in self.kube.bodies("patch nodes/status")]


def test_a_condition_changed_by_someone_else_is_written_back_once():
    """The operator marks a node Ready=Unknown while its Lease looked stale; the agent,
    still running, writes Ready=True back at its next update, and only that."""
    async def main():
        rig = Rig()
        await rig.start()
        await rig.clock.advance(1)
        patches = rig.kube.count("patch nodes/status")
        node = copy.deepcopy(rig.kube.obj(NODES, "n1"))
        for c in node["status"]["conditions"]:
            if c["type"] == "Ready":
                c.update(status="Unknown", reason="NodeStatusUnknown")
        rig.kube.put(NODES, node)  # as the operator would write it
        await rig.clock.advance(10)
        assert rig.kube.count("patch nodes/status") - patches == 1
        sent = rig.status_bodies()[-1]["conditions"]
        assert [(c["type"], c["status"]) for c in sent] == [("Ready", "True")]
        ready = next(c for c in rig.kube.obj(NODES, "n1")["status"]["conditions"]
                     if c["type"] == "Ready")
        assert ready["status"] == "True"
        await rig.clock.advance(60)  # our own write's event is not news
        assert rig.kube.count("patch nodes/status") - patches == 1
        await rig.stop()
    run(main())


def test_registers_node_then_only_lease_traffic_for_a_minute():
    async def main():
        rig = Rig()
        await rig.start()
        node = rig.kube.obj(NODES, "n1")
        assert node["metadata"]["labels"] == {
            "kubernetes.io/hostname": "n1", "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64", AGENT_LABEL: "agent-a", "pool": "x"}
        assert node["status"]["capacity"]["pods"] == "110"
        assert [c["status"] for c in node["status"]["conditions"]] == [
            "False", "False", "False", "True"]
        lease = rig.kube.obj(LEASES, "n1", NODE_LEASE_NAMESPACE)
        assert lease["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]
        assert rig.reports("register") == 1
        patches, puts = rig.kube.count("patch nodes/status"), rig.kube.count("update leases")
        await rig.clock.advance(60)
        assert rig.kube.count("patch nodes/status") - patches == 0
        assert rig.kube.count("update leases") - puts in (5, 6, 7)
        assert rig.node.health() is None
        # nothing new to report: one status is kept (thousands of nodes), the reported one
        assert rig.node.computed is rig.node.reported
        await rig.stop()
    run(main())


def test_adopts_an_existing_node_and_fixes_its_labels():
    async def main():
        rig = Rig()
        rig.kube.put(NODES, {"metadata": {"name": "n1", "labels": {"kubernetes.io/os": "linux",
                                                                  "keep": "me"}}})
        await rig.start(watch=False)
        assert rig.kube.count("create nodes") == 0
        labels = rig.kube.obj(NODES, "n1")["metadata"]["labels"]
        assert labels["keep"] == "me" and labels[AGENT_LABEL] == "agent-a"
        assert rig.reports("register") == 1
        await rig.stop()
    run(main())


def test_report_period_sends_full_heartbeats():
    async def main():
        rig = Rig(hb=Heartbeat(statusReportFrequencySeconds=20))
        await rig.start(watch=False)
        await rig.clock.advance(60.5)
        assert rig.reports("period") == 3
        body = rig.status_bodies()[-1]
        assert list(body) == ["conditions"] and len(body["conditions"]) == 4
        await rig.stop()
    run(main())


def test_condition_change_reported_within_one_update_period():
    async def main():
        rig = Rig()
        await rig.start(watch=False)
        await rig.clock.advance(13)
        rig.pressure = {"DiskPressure": "below eviction threshold: nodefs.available<10%"}
        await rig.clock.advance(10)
        assert rig.reports("change") == 1
        body = rig.status_bodies()[-1]
        assert [c["type"] for c in body["conditions"]] == ["DiskPressure"]
        disk = next(c for c in rig.kube.obj(NODES, "n1")["status"]["conditions"]
                    if c["type"] == "DiskPressure")
        assert disk["status"] == "True"
        await rig.clock.advance(30)  # no change since: no more patches
        assert rig.reports("change") == 1
        rig.images = [{"names": ["localhost/busybox:1"], "sizeBytes": 100}]
        await rig.clock.advance(10)
        assert rig.reports("change") == 2
        assert rig.status_bodies()[-1] == {"images": rig.images}
        await rig.stop()
    run(main())


def test_policy_annotation_takes_effect_within_one_old_interval():
    async def main():
        rig = Rig()
        await rig.start()
        await rig.clock.advance(21)
        before = rig.kube.times("update leases")
        rig.kube.annotate(NODES, "n1", HEARTBEAT_ANNOTATION,
                          annotation(leaseDurationSeconds=40, renewIntervalSeconds=2))
        await rig.clock.advance(1)  # the watch delivers the change
        await rig.clock.advance(10)
        after = [t for t in rig.kube.times("update leases") if t > 21]
        assert after and after[0] - 21 <= 10  # followed within one old interval
        gaps = [b - a for a, b in zip(after, after[1:], strict=False)]
        assert len(after) >= 4 and all(1.9 <= g <= 2.1 for g in gaps), (before, after)
        assert rig.node.policy_name == "fast"
        assert rig.watch.reflector.lists == 1
        await rig.stop()
    run(main())


def test_invalid_annotation_refused_last_good_kept_and_removal_restores_local():
    async def main():
        rig = Rig()
        await rig.start()
        rig.kube.annotate(NODES, "n1", HEARTBEAT_ANNOTATION, annotation(renewIntervalSeconds=5))
        await rig.clock.advance(2)
        good = rig.node.heartbeat
        assert good.renewIntervalSeconds == 5
        for bad in ["{not json", annotation(renewIntervalSeconds=50),
                    annotation(leaseDurationSeconds="forty"), annotation(bogus=1)]:
            rig.kube.annotate(NODES, "n1", HEARTBEAT_ANNOTATION, bad)
            await rig.clock.advance(2)
            assert rig.node.heartbeat == good
        assert rig.registry.get_sample_value("nodepulse_heartbeat_policy_updates_total",
                                             {"result": "refused"}) == 4
        rig.kube.annotate(NODES, "n1", HEARTBEAT_ANNOTATION, None)
        await rig.clock.advance(2)
        assert rig.node.heartbeat == Heartbeat() and rig.node.policy_name is None
        await rig.stop()
    run(main())


def test_watch_resumes_from_last_version_and_relists_only_on_410():
    async def main():
        rig = Rig()
        await rig.start()
        await rig.clock.advance(5)
        rvs = [int(c.query["resourceVersion"]) for c in rig.kube.calls_of("watch nodes")]
        assert rvs == sorted(rvs) and rig.watch.reflector.lists == 1
        # history gone (e.g. the API server restarted): the next watch gets 410, and
        # the stream refuses to close as a finished response does
        rig.kube.expire_next_watch = True
        rig.kube.close_error = RuntimeError("already released to the pool")
        rig.kube.drop()  # the server ends the watch; the next one gets 410
        await rig.clock.advance(1.5)
        assert rig.watch.reflector.lists == 2
        rig.kube.drop()
        await rig.clock.advance(5)
        assert rig.watch.reflector.lists == 2  # resumed from the new list, no relist loop
        rig.kube.close_error = None
        rig.kube.fail("watch nodes", api_error(410))  # as an HTTP status this time
        rig.kube.drop()
        await rig.clock.advance(2.5)
        assert rig.watch.reflector.lists == 3
        rig.kube.annotate(NODES, "n1", HEARTBEAT_ANNOTATION, annotation(renewIntervalSeconds=3))
        await rig.clock.advance(2)
        assert rig.node.heartbeat.renewIntervalSeconds == 3
        rig.kube.fail("watch nodes", api_error(500), ConnectionError("reset"))
        rig.kube.drop()
        await rig.clock.advance(5)  # errors: back off and resume, no new list
        assert rig.watch.reflector.lists == 3 and rig.watch.reflector.relists == 2
        rig.kube.annotate(NODES, "n1", HEARTBEAT_ANNOTATION, annotation(renewIntervalSeconds=4))
        await rig.clock.advance(2)
        assert rig.node.heartbeat.renewIntervalSeconds == 4
        await rig.stop()
    run(main())


def test_renewal_never_waits_behind_a_stuck_status_computation():
    async def main():
        stuck = asyncio.Event()
        inline = Blocking(InlineExecutor())
        ready = {"registered": False}

        async def status_call(fn, *args, **kwargs):
            if ready["registered"] and getattr(fn, "__name__", "") == "_compute":
                await stuck.wait()  # the status pool is jammed
            result = await inline(fn, *args, **kwargs)
            ready["registered"] = True
            return result

        rig = Rig(status_call=status_call)
        await rig.start(watch=False)
        await rig.clock.advance(60)
        assert rig.kube.count("update leases") >= 5
        assert rig.node.health() is None
        stuck.set()
        await rig.stop()
    run(main())


def test_deleted_node_is_registered_again():
    async def main():
        rig = Rig()
        await rig.start(watch=False)
        rig.kube.remove(NODES, "n1")
        rig.pressure = {"DiskPressure": "d"}  # forces a patch
        await rig.clock.advance(10)
        await rig.clock.advance(10)
        assert rig.kube.count("create nodes") == 2 and rig.kube.has(NODES, "n1")
        assert rig.reports("register") == 2
        await rig.stop()
    run(main())


def test_the_uid_of_a_re_created_node_is_followed():
    """The Node's UID is learnt at registration (mirror pods and Events point at it, not
    fetched again) and followed when someone else re-creates the Node."""
    async def main():
        rig = Rig()
        await rig.start()
        first = rig.kube.obj(NODES, "n1")["metadata"]["uid"]
        assert rig.config.uids == {"n1": first} and rig.kube.count("get nodes") == 1
        node = rig.kube.obj(NODES, "n1")
        node["metadata"]["uid"] = "uid-again"  # its delete was never seen by the watch
        rig.kube.put(NODES, node)
        await rig.clock.advance(11)
        assert rig.config.uids == {"n1": "uid-again"}
        owner = rig.kube.obj(LEASES, "n1", NODE_LEASE_NAMESPACE)["metadata"]["ownerReferences"]
        assert owner[0]["uid"] == "uid-again"
        await rig.stop()
    run(main())


def test_registration_retries_until_the_server_answers():
    async def main():
        rig = Rig()
        rig.kube.fail("get nodes", api_error(503), api_error(503))
        await rig.start(watch=False)
        assert not rig.kube.has(NODES, "n1")
        await rig.clock.advance(11)
        assert rig.kube.has(NODES, "n1") and rig.reports("register") == 1
        await rig.stop()
    run(main())


def test_legacy_mode_writes_full_status_every_period_and_no_lease():
    async def main():
        rig = Rig(legacy=True)
        await rig.start(watch=False)
        await rig.clock.advance(60.5)
        assert rig.reports("legacy") == 7
        assert rig.kube.count("create leases") + rig.kube.count("update leases") == 0
        assert all({"capacity", "conditions", "nodeInfo"} <= b.keys()
                   for b in rig.status_bodies())
        assert rig.node.health() is None
        await rig.stop()
    run(main())


# -- the Node watch's backoff has the same rule as the pod source's (its ceiling is 8 s)
class NodeRig:
    """A node watch whose watches are refused (connection refused) while `down`."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.kube = FakeKube(now=self.clock.monotonic)
        self.kube.put(NODES, {"metadata": {"name": "n1"}})
        self.down = True
        self.kube.intercept("watch nodes", lambda _: ConnectionRefusedError("refused")
                            if self.down else None)
        self.seen: list[str] = []
        node = SimpleNamespace(on_node=lambda obj: self.seen.append(obj["metadata"]["name"]))
        self.watch = NodeWatch(self.kube, {"n1": node}, self.clock,  # type: ignore[dict-item]
                               agent_id="a")
        self.task: asyncio.Task[None] | None = None

    async def refused(self, times: int) -> None:
        """Start the watch; the first `times` backoffs (of at most 8 s) pass refused."""
        self.task = asyncio.create_task(self.watch.run())
        await settle()
        for _ in range(times):
            await self.clock.advance(8.0)

    async def stop(self) -> None:
        self.watch.stop()
        assert self.task is not None
        await asyncio.wait_for(self.task, 1)


def test_node_watch_backoff_starts_over_after_a_watch_that_worked() -> None:
    async def main() -> None:
        rig = NodeRig()
        kube, clock = rig.kube, rig.clock
        await rig.refused(6)  # 1, 2, 4, 8, 8, 8 s
        rig.down = False
        await clock.advance(8.0)
        kube.annotate(NODES, "n1", "x", "1")  # an event for the watch to deliver
        await settle()
        assert len(rig.seen) == 2  # the list, then the event: the watch worked...
        kube.drop(ConnectionResetError("Response ended prematurely"))  # ...then broke
        await settle()
        calls = kube.count("watch nodes")
        await clock.advance(1.0)  # the first step of a new backoff, not 8 s
        assert kube.count("watch nodes") > calls
        await rig.stop()
    asyncio.run(main())


def test_node_watch_backoff_ends_when_the_api_answers() -> None:
    async def main() -> None:
        rig = NodeRig()
        kube = rig.kube
        await rig.refused(5)  # 1, 2, 4, 8, 8 s
        calls = kube.count("watch nodes")
        rig.watch.reflector.answered.fire()  # a Lease renewal went through: now, not in 8 s
        await settle()
        assert kube.count("watch nodes") == calls + 1
        await rig.stop()
    asyncio.run(main())


def test_nodes_started_together_spread_their_status_ticks_over_the_period():
    async def main():
        rig = Rig()
        config = dataclasses.replace(rig.config, started_together=True)
        rng = random.Random(5)
        for i in range(30):
            name = f"v{i}"
            rig.nodes[name] = build_node_controller(NodeSpec(name, agent_id="agent-a"),
                                                    config, rng)
        await rig.start(watch=False)
        for name, node in rig.nodes.items():
            if name != "n1":
                node.start()
        await settle()
        # every node registered and reported now; the next ticks fall over the period
        ticks = [rig.ticker.due(name) or 0.0 for name in rig.nodes if name != "n1"]
        assert all(0 < t <= 10 for t in ticks)
        assert max(ticks) - min(ticks) > 7
        assert rig.ticker.due("n1") == 10  # one not started with others: the period
        # from then on, each ticks once a period
        first = rig.nodes["v0"]
        t0 = rig.ticker.due("v0")
        assert t0 is not None
        await rig.clock.advance(t0 + 0.01)
        assert rig.ticker.due("v0") == t0 + 10 and first.registered
        await rig.stop()
    run(main())


def test_what_pod_admission_reads_of_the_node():
    """Before the Node is registered (a static pod may come first): the labels and
    taints it registers with and the allocatable of a host reading; then the Node as
    the API has it, with the allocatable this agent computes over the API's."""
    async def main():
        rig = Rig()
        rig.node.spec.taints = [{"key": "k", "value": "v", "effect": "NoExecute"}]
        early = rig.node.admission_node()
        assert early is not None
        assert early["metadata"]["labels"]["pool"] == "x"
        assert early["spec"]["taints"] == [{"key": "k", "value": "v", "effect": "NoExecute"}]
        # 4 cpus and 8Gi, less what SETTINGS reserve (500m, 1Gi) and the hard eviction
        # threshold of memory (100Mi)
        assert (early["status"]["allocatable"]["cpu"], early["status"]["allocatable"]["memory"],
                early["status"]["allocatable"]["pods"]) == ("3500m", "7068Mi", "110")
        await rig.start()
        node = rig.kube.obj(NODES, "n1")
        node["metadata"]["labels"]["disk"] = "ssd"
        node["spec"]["taints"] = []
        node["status"]["allocatable"] = {**node["status"]["allocatable"], "cpu": "100",
                                         "example.com/foo": "2"}
        rig.kube.put(NODES, node)
        await settle()
        seen = rig.node.admission_node()
        assert seen is not None
        assert seen["metadata"]["labels"]["disk"] == "ssd" and seen["spec"]["taints"] == []
        assert seen["status"]["allocatable"]["example.com/foo"] == "2"
        assert seen["status"]["allocatable"]["cpu"] == "3500m"  # its own figure wins
        await rig.stop()
    run(main())


def test_a_node_nobody_changed_holds_nothing_of_its_own_for_admission():
    """Thousands of virtual nodes: a Node the API shows as it was registered shares one
    empty record, and admission reads the same Node from it."""
    async def main():
        rig = Rig()
        await rig.start()
        await settle()
        assert rig.node.seen is AS_REGISTERED
        node = rig.node.admission_node()
        assert node is not None
        assert node["metadata"]["labels"] == rig.kube.obj(NODES, "n1")["metadata"]["labels"]
        assert node["spec"]["taints"] == []
        assert node["status"]["allocatable"] == rig.kube.obj(NODES, "n1")["status"]["allocatable"]
        await rig.stop()
    run(main())


def test_a_node_that_exists_renews_its_lease_before_its_registration_is_done():
    """An agent started again (its Nodes exist) renews each Lease as soon as the node
    watch shows the Node, not after the node's registration, which waits behind other
    nodes' status writes (bench.soak: 200 virtual nodes took two minutes to register
    after a restart, their Leases stale and the nodes tainted while the agent ran)."""
    async def main():
        rig = Rig()
        rig.kube.put(NODES, {"metadata": {"name": "n1", "uid": "uid-1",
                                          "labels": {AGENT_LABEL: "agent-a", "pool": "x"}}})
        rig.kube.fail("get nodes", *[api_error(503)] * 20)  # registration stuck
        await rig.start()
        await rig.clock.advance(60)
        assert not rig.node.registered
        assert rig.kube.count("create leases") + rig.kube.count("update leases") >= 5
        assert rig.node.health() is None
        lease = rig.kube.obj(LEASES, "n1", NODE_LEASE_NAMESPACE)
        assert lease["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        await rig.stop()
    run(main())
