"""Lease renewal: schedule and jitter, retry ceiling, conflicts, recreation. Fake clock."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from prometheus_client import CollectorRegistry

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import LEASES, NODE_LEASE_NAMESPACE
from nodeagent.api.policy import Heartbeat
from nodeagent.node.heartbeatmetrics import NodeMetrics
from nodeagent.node.lease import LeaseRenewer, renew_delay
from nodeagent.node.scheduler import DueScheduler
from tests.fakekube import FakeKube, api_error

HB = Heartbeat()  # 40 s duration, 10 s interval


def run(coro):
    return asyncio.run(coro)


class Rig:
    def __init__(self, hb: Heartbeat = HB, jitter: float = 0.04, seed: int = 1) -> None:
        self.clock = FakeClock()
        self.kube = FakeKube(now=self.clock.monotonic)
        self.registry = CollectorRegistry()
        self.metrics = NodeMetrics(self.registry)
        self.answered = ApiAnswered(self.clock)
        self.renewer = LeaseRenewer("n1", self.kube, self.clock, self.metrics, hb,
                                    answered=self.answered, jitter=jitter,
                                    rng=random.Random(seed))
        self.renewer.owner_uid = "uid-n1"
        self.sched: DueScheduler[str] = DueScheduler(self.clock,
                                                     lambda _k: self.renewer.renew())

    def metric(self, result: str) -> float:
        return self.registry.get_sample_value("nodepulse_lease_renewals_total",
                                              {"result": result}) or 0.0

    async def start(self) -> asyncio.Task[None]:
        task = asyncio.create_task(self.sched.run())
        self.sched.schedule("n1", self.clock.monotonic())
        await settle()
        return task

    async def finish(self, task: asyncio.Task[None]) -> None:
        await self.sched.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("interval, duration", [(10, 40), (2, 40), (35, 40), (1, 5)])
def test_renew_delay_within_jitter_and_before_expiry(interval, duration):
    for i in range(-100, 101):
        d = renew_delay(interval, duration, 0.04, i / 100)
        assert d <= duration * 0.9
        assert min(interval * 0.96, duration * 0.9) <= d <= interval * 1.04


def test_creates_then_renews_on_jittered_interval_with_one_put_each():
    async def main():
        rig = Rig()
        task = await rig.start()
        assert rig.kube.count("create leases") == 1
        lease = rig.kube.obj(LEASES, "n1", NODE_LEASE_NAMESPACE)
        assert lease["spec"]["holderIdentity"] == "n1"
        assert lease["spec"]["leaseDurationSeconds"] == 40
        assert lease["metadata"]["ownerReferences"][0] == {
            "apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-n1"}
        await rig.clock.advance(60.5)
        puts = rig.kube.times("update leases")
        gaps = [b - a for a, b in zip([0.0, *puts], puts, strict=False)]
        assert len(puts) in (5, 6)
        assert all(9.6 <= g <= 10.4 for g in gaps), gaps
        assert rig.kube.count("get leases") == 1  # only before the first create
        assert rig.metric("success") == len(puts)
        last = rig.clock.now() - __import__("datetime").timedelta(seconds=60.5 - puts[-1])
        assert rig.kube.obj(LEASES, "n1", NODE_LEASE_NAMESPACE)["spec"]["renewTime"] == last.strftime(
            "%Y-%m-%dT%H:%M:%S.%fZ")
        await rig.finish(task)
    run(main())


def test_retry_ceiling_never_lands_after_the_lease_expires():
    async def main():
        rig = Rig()
        task = await rig.start()
        renewed = rig.renewer.last_renewed
        assert renewed == 0.0
        # the server answers, but only with errors, for a long while
        rig.kube.fail("update leases", *[api_error(503)] * 30)
        await rig.clock.advance(39.99)
        assert rig.metric("failed") == 1  # gave up before the lease ran out
        attempts = rig.kube.calls_of("update leases")
        assert len(attempts) >= 5  # it kept trying
        for c in attempts:
            assert isinstance(c.timeout, float)
            assert c.at + c.timeout <= renewed + 40  # an attempt cannot land after expiry
        assert attempts[-1].at > renewed + 30  # ...and used the time there was
        await rig.clock.advance(0.02)
        assert rig.renewer.health() is not None  # /healthz goes red
        await rig.clock.advance(60)  # the server recovers: renewals resume
        assert rig.metric("success") >= 1 and rig.renewer.health() is None
        await rig.finish(task)
    run(main())


def test_transient_errors_are_retried_quickly():
    async def main():
        rig = Rig()
        task = await rig.start()
        rig.kube.fail("update leases", api_error(500), api_error(429), ConnectionError("reset"))
        await rig.clock.advance(15)
        times = rig.kube.times("update leases")
        assert len(times) == 4
        assert times[-1] - times[0] < 5  # short backoff, not another interval
        assert rig.metric("retried") == 3 and rig.metric("success") == 1
        assert rig.renewer.health() is None
        await rig.finish(task)
    run(main())


def test_refusal_is_not_retried():
    async def main():
        rig = Rig()
        task = await rig.start()
        rig.kube.fail("update leases", api_error(403, "Forbidden"))
        await rig.clock.advance(10.5)
        assert rig.kube.count("update leases") == 1
        assert rig.metric("failed") == 1
        await rig.clock.advance(2.5)  # tried again soon, as a new renewal
        assert rig.kube.count("update leases") == 2 and rig.metric("success") == 1
        await rig.finish(task)
    run(main())


def test_conflict_rereads_and_retries_at_once():
    async def main():
        rig = Rig()
        task = await rig.start()
        rig.kube.touch(LEASES, "n1", NODE_LEASE_NAMESPACE)  # someone else wrote it
        await rig.clock.advance(10.5)
        methods = [c.key for c in rig.kube.calls]
        assert methods[-3:] == ["update leases", "get leases", "update leases"]
        t_conflict, t_ok = rig.kube.times("update leases")[-2:]
        assert t_ok == t_conflict
        assert rig.metric("conflict") == 1 and rig.metric("success") == 1
        await rig.finish(task)
    run(main())


def test_deleted_lease_is_recreated():
    async def main():
        rig = Rig()
        task = await rig.start()
        rig.kube.remove(LEASES, "n1", NODE_LEASE_NAMESPACE)
        await rig.clock.advance(10.5)
        assert rig.kube.count("create leases") == 2
        assert rig.kube.obj(LEASES, "n1", NODE_LEASE_NAMESPACE)["spec"]["holderIdentity"] == "n1"
        assert rig.metric("created") == 2
        await rig.clock.advance(10)
        assert rig.kube.count("update leases") >= 1
        await rig.finish(task)
    run(main())


def test_settings_change_takes_effect_at_once():
    async def main():
        rig = Rig(jitter=0)
        task = await rig.start()
        await rig.clock.advance(3)
        rig.renewer.heartbeat = Heartbeat(renewIntervalSeconds=2)
        rig.sched.schedule("n1", rig.renewer.replan())
        await settle()
        assert rig.kube.times("update leases") == [3.0]  # 2 s after the last renewal had passed
        await rig.clock.advance(4)
        assert rig.kube.times("update leases") == [3.0, 5.0, 7.0]
        await rig.finish(task)
    run(main())


def test_the_lease_expires_from_the_renew_time_the_server_holds(monkeypatch):
    """A slow answer: the Lease the server holds was stamped when the PUT was sent, so
    the renewer counts its expiry and its next renewal from then, not from the answer."""
    async def main():
        rig = Rig(jitter=0.0)
        task = await rig.start()  # created at 0
        sent: list[float] = []
        put = rig.kube.update

        async def answered_after_6_s(*args, **kwargs):
            sent.append(rig.clock.monotonic())
            await rig.clock.sleep(6)
            return await put(*args, **kwargs)
        monkeypatch.setattr(rig.kube, "update", answered_after_6_s)
        await rig.clock.advance(16.5)  # the renewal due at 10, answered at 16
        assert sent == [10.0] and rig.kube.count("update leases") == 1
        lease = rig.kube.obj(LEASES, "n1", NODE_LEASE_NAMESPACE)
        assert lease["spec"]["renewTime"].endswith(":00:10.000000Z")
        assert rig.renewer.deadline() == 10.0 + 40
        assert rig.renewer.next_due() == 10.0 + 10
        await rig.finish(task)
    run(main())


def test_a_renewal_after_unreachable_attempts_tells_once():
    """The API-answers-again signal (the watches and writes waiting out a backoff then go)
    fires when a renewal goes through after attempts that could not reach the API server,
    and only then: not for renewals that went through the first time, nor after a
    refusal (an answer)."""
    async def main():
        rig = Rig()
        told: list[float] = []

        async def listen() -> None:
            while True:
                if await rig.answered.wait(1000):
                    told.append(rig.clock.monotonic())
        listener = asyncio.create_task(listen())
        task = await rig.start()
        await rig.clock.advance(20.5)  # created, then two renewals
        assert told == [] and rig.metric("success") == 2
        rig.kube.fail("update leases", api_error(503), ConnectionError("refused"),
                      api_error(504))
        await rig.clock.advance(15)
        assert rig.metric("retried") == 3 and rig.metric("success") == 3
        assert told == [rig.kube.times("update leases")[-1]]  # once, at the success
        rig.kube.fail("update leases", api_error(403, "Forbidden"), api_error(409))
        await rig.clock.advance(30)
        assert rig.metric("failed") == 1 and len(told) == 1
        listener.cancel()
        await rig.finish(task)
    run(main())


def test_the_kept_lease_drops_the_servers_managed_fields():
    """Between renewals each node keeps the server's last answer; its managedFields
    (most of its bytes, times thousands of virtual nodes) are not kept, nor sent."""
    async def main():
        rig = Rig()
        rig.kube.put(LEASES, {"metadata": {"name": "n1", "namespace": NODE_LEASE_NAMESPACE,
                                           "managedFields": [{"manager": "someone"}]},
                              "spec": {"holderIdentity": "n1"}})
        task = await rig.start()
        await rig.clock.advance(21)
        assert rig.kube.count("get leases") == 1 and rig.kube.count("update leases") == 3
        assert all("managedFields" not in b["metadata"] for b in rig.kube.bodies("update leases"))
        assert rig.renewer.lease is not None
        assert "managedFields" not in rig.renewer.lease["metadata"]
        await rig.finish(task)
    run(main())


def test_the_kept_leases_of_two_nodes_share_their_keys_and_short_strings():
    """Each node keeps its Lease between renewals; a thousand nodes' would each hold a
    copy of every key and of the namespace, kinds and versions as decoded. The kept
    ones share them; what the server answered is kept unchanged in value."""
    uid = "5f1c2a9e-1111-4000-8000-000000000001"

    async def kept(node: str) -> dict:
        rig = Rig()
        rig.renewer.node, rig.renewer.owner_uid = node, uid
        answer = json.dumps({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": node, "namespace": NODE_LEASE_NAMESPACE, "uid": uid,
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                                              "name": node, "uid": uid}]},
            "spec": {"holderIdentity": node, "leaseDurationSeconds": 40}})
        rig.kube.put(LEASES, json.loads(answer))  # as decoded from the server's JSON
        task = await rig.start()
        assert rig.kube.count("get leases") == 1 and rig.kube.count("update leases") == 1
        lease = rig.renewer.lease
        assert lease is not None and lease["metadata"]["uid"] == uid
        assert lease["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}]
        await rig.finish(task)
        return lease

    a, b = run(kept("vn-1")), run(kept("vn-2"))
    for x, y in ((a, b), (a["metadata"], b["metadata"]), (a["spec"], b["spec"]),
                 (a["metadata"]["ownerReferences"][0], b["metadata"]["ownerReferences"][0])):
        assert [id(k) for k in x] == [id(k) for k in y]
    assert a["metadata"]["namespace"] is b["metadata"]["namespace"]
    assert a["apiVersion"] is b["apiVersion"] and a["kind"] is b["kind"]


def test_nodes_started_together_spread_their_first_renewal_over_the_interval():
    async def main():
        clock = FakeClock()
        kube = FakeKube(now=clock.monotonic)
        metrics = NodeMetrics(CollectorRegistry())
        rng = random.Random(7)

        def renewers(spread: bool) -> list[LeaseRenewer]:
            return [LeaseRenewer(f"n{i}-{spread}", kube, clock, metrics, HB, rng=rng,
                                 spread_first=spread) for i in range(50)]
        # each creates its Lease now; the next renewal is due at most one interval on
        together = [await r.renew() for r in renewers(True)]
        apart = [await r.renew() for r in renewers(False)]
        assert all(0 < due <= 10.4 for due in together)
        assert max(together) - min(together) > 8  # over the interval, not bunched
        assert all(9.6 <= due <= 10.4 for due in apart)  # the jitter alone
        # after the first, each renews on the interval as before
        first = renewers(True)[0]
        due = await first.renew()
        await clock.advance(due)
        assert 9.6 <= await first.renew() - due <= 10.4
    run(main())
