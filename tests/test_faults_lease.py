"""Lease renewal after an outage longer than the lease (found by the etcd-restart e2e
fault: a lapsed Lease was renewed with a 0.05 s request timeout, so a server that
needs a moment to answer never saw a renewal land). Fake clock, no sleeping."""

from __future__ import annotations

import asyncio
import random

from prometheus_client import CollectorRegistry

from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.policy import Heartbeat
from nodeagent.node.heartbeatmetrics import NodeMetrics
from nodeagent.node.lease import LeaseRenewer
from nodeagent.node.scheduler import DueScheduler
from tests.fakekube import Call, FakeKube, api_error

SERVER_LATENCY = 0.2  # seconds the recovering server takes to answer a write


class SlowAfterOutage(FakeKube):
    """Down (503, as etcd times out) while `outage`; afterwards every write takes
    SERVER_LATENCY, so an attempt whose timeout is shorter ends in a timeout, as over a
    real socket."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(now=clock.monotonic)
        self.outage = False
        self.intercept("update leases", self._slow)

    def _slow(self, call: Call) -> BaseException | None:
        if self.outage:
            return api_error(503, message="etcdserver: request timed out")
        if isinstance(call.timeout, float) and call.timeout < SERVER_LATENCY:
            return TimeoutError(f"read timed out (timeout={call.timeout:.3f})")
        return None


def writes(kube: FakeKube) -> list[tuple[float, float]]:
    """(when, request timeout) of each Lease write."""
    return [(c.at, c.timeout) for c in kube.calls_of("update leases")
            if isinstance(c.timeout, float)]


def test_a_lapsed_lease_is_renewed_once_the_server_answers_again() -> None:
    async def main() -> None:
        clock = FakeClock()
        kube = SlowAfterOutage(clock)
        registry = CollectorRegistry()
        hb = Heartbeat(leaseDurationSeconds=10, renewIntervalSeconds=2)
        renewer = LeaseRenewer("n1", kube, clock, NodeMetrics(registry), hb,
                               rng=random.Random(3))
        sched: DueScheduler[str] = DueScheduler(clock, lambda _k: renewer.renew())
        task = asyncio.create_task(sched.run())
        sched.schedule("n1", clock.monotonic())
        await settle()
        await clock.advance(5)
        assert renewer.health() is None
        kube.outage = True                 # longer than the 10 s lease
        await clock.advance(20)
        assert renewer.health() is not None
        kube.outage = False                # back, answering in 0.2 s
        back = clock.monotonic()
        await clock.advance(3)           # a failed renewal is retried within 2 s
        late = [(at, t) for at, t in writes(kube) if at >= back]
        assert late, "no renewal attempt after the server came back"
        assert all(t is not None and t >= 1.0 for _, t in late), late  # a real timeout
        assert renewer.health() is None, renewer.health()
        assert renewer.last_renewed is not None and renewer.last_renewed >= back
        await sched.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())


def test_attempts_before_expiry_still_fit_the_lease() -> None:
    """The fix keeps the retry ceiling: an attempt that starts while there is time
    for one (1 s here) is given no more time than is left of the lease."""
    async def main() -> None:
        clock = FakeClock()
        kube = SlowAfterOutage(clock)
        hb = Heartbeat(leaseDurationSeconds=10, renewIntervalSeconds=2)
        renewer = LeaseRenewer("n1", kube, clock, NodeMetrics(CollectorRegistry()), hb,
                               rng=random.Random(3))
        sched: DueScheduler[str] = DueScheduler(clock, lambda _k: renewer.renew())
        task = asyncio.create_task(sched.run())
        sched.schedule("n1", clock.monotonic())
        await settle()
        renewed = renewer.last_renewed
        assert renewed is not None
        kube.outage = True
        await clock.advance(9.5)
        before = [(at, t) for at, t in writes(kube) if at <= renewed + 10 - 1.0]
        assert len(before) >= 3
        assert all(t is not None and at + t <= renewed + 10 for at, t in before), before
        await sched.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())
