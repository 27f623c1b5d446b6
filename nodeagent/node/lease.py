"""A node's Lease in kube-node-lease: created if missing, renewed on a jittered interval.

One LeaseRenewer per node; the shared DueScheduler decides when each one runs, and
its API calls go over the lease connections (a Kube of their own, never the status
one's). A renewal that goes through after attempts that could not reach the API server
fires the ApiAnswered signal: the watches and writes waiting out a backoff go now.

A renewal is the commonest thing a process of thousands of virtual nodes does, so it
is kept cheap: the body is the Lease the server last answered with (ours to change: no
copy), only its renewTime set again; the first attempt runs without the retry
machinery, which takes over when it fails.
"""

from __future__ import annotations

import logging
import random

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.client import ApiError, brief, is_retriable, status_of
from nodeagent.api.clock import Clock, api_microtime
from nodeagent.api.kube import LEASES, NODE_LEASE_NAMESPACE, Kube, Obj, with_shared_strings
from nodeagent.api.policy import Heartbeat
from nodeagent.node.heartbeatmetrics import NodeMetrics

log = logging.getLogger(__name__)


def renew_delay(interval: float, duration: float, jitter: float, u: float) -> float:
    """Seconds from one renewal to the next: interval scaled by 1 + jitter*u (u in
    [-1, 1]), and always leaving at least a tenth of the duration before expiry."""
    delay = interval * (1 + jitter * u)
    return max(0.1, min(delay, duration * 0.9))


def spread_before(now: float, due: float, rng: random.Random) -> float:
    """A random point between `now` and `due`: earlier than due, never later (the first
    renewal or tick of nodes started together, so that they do not stay in phase)."""
    return now + (due - now) * rng.random()


class LeaseRenewer:
    # thousands in a process: no __dict__ each
    __slots__ = ("_due", "_spread", "_stamped", "_u", "answered", "clock",
                 "failing", "heartbeat", "jitter", "kube", "last_renewed", "lease", "metrics",
                 "node", "owner_uid", "rng", "started")
    REQUEST_TIMEOUT = 10.0  # one attempt never waits longer than this

    def __init__(self, node: str, kube: Kube, clock: Clock, metrics: NodeMetrics,
                 heartbeat: Heartbeat, *, answered: ApiAnswered | None = None,
                 jitter: float = 0.04, rng: random.Random | None = None,
                 spread_first: bool = False) -> None:
        self.node = node
        self.kube = kube
        self.clock = clock
        self.metrics = metrics
        self.answered = answered or ApiAnswered(clock)
        self.heartbeat = heartbeat
        self.jitter = jitter
        self.rng = rng or random.Random()
        # the first renewal after the first write at a random point of the interval:
        # nodes that start together (a process's virtual nodes) then renew spread over
        # it, where the jitter alone would keep them within a second of each other for
        # many intervals (100 Lease writes at once every 10 s: the churn's slowest pods)
        self._spread = spread_first
        self.owner_uid: str | None = None
        self.lease: Obj | None = None  # our last view of the object (for its resourceVersion)
        # when (monotonic) the Lease the server holds was stamped: it expires from there
        self.last_renewed: float | None = None
        self._stamped = 0.0  # when the last attempt's body got its renewTime
        self.started = clock.monotonic()
        self._u = self.rng.uniform(-1, 1)
        self._due: float | None = None
        # an attempt could not reach the API server since the last renewal (when one
        # goes through again, the ApiAnswered signal fires)
        self.failing = False

    # -- timing --
    def next_due(self) -> float:
        if self.last_renewed is None:
            return self.clock.monotonic()
        hb = self.heartbeat
        return self.last_renewed + renew_delay(hb.renewIntervalSeconds,
                                               hb.leaseDurationSeconds, self.jitter, self._u)

    def deadline(self) -> float:
        """Renewals must land before this: the lease (as we last wrote it) expires."""
        base = self.last_renewed if self.last_renewed is not None else self.started
        return base + self.heartbeat.leaseDurationSeconds

    def health(self) -> str | None:
        now = self.clock.monotonic()
        if now <= self.deadline():
            return None
        if self.last_renewed is None:
            return f"lease {self.node}: never renewed"
        return (f"lease {self.node}: last renewed {now - self.last_renewed:.1f}s ago, "
                f"duration {self.heartbeat.leaseDurationSeconds}s")

    # -- one renewal, retried --
    def _retry_wait(self, rs: RetryCallState) -> float:
        exc = rs.outcome.exception() if rs.outcome else None
        if exc is not None and status_of(exc) in (404, 409) and rs.attempt_number <= 2:
            return 0.0  # re-read or recreate at once
        # short exponential backoff with jitter: 0.2, 0.4, 0.8, ... at most 2 s
        return min(2.0, 0.2 * 2 ** (rs.attempt_number - 1)) + self.rng.uniform(0, 0.2)

    async def renew(self) -> float:
        """Renew (or create) the Lease; returns when the next renewal is due."""
        due = self._due if self._due is not None else self.clock.monotonic()
        min_attempt = min(1.0, self.heartbeat.leaseDurationSeconds / 10)
        deadline = self.deadline()
        if deadline - self.clock.monotonic() < min_attempt:
            # The lease has lapsed (an outage longer than it) or has no time left for an
            # attempt: nothing to land before any more, and a late renewal still ends
            # the lapse. Give this round one full request timeout; a deadline in the
            # past would leave every attempt a timeout no server can answer within.
            deadline = self.clock.monotonic() + self.REQUEST_TIMEOUT
        try:
            try:
                result = await self._write_once(self._timeout(deadline))
            except Exception as e:
                if not (status_of(e) in (404, 409) or is_retriable(e)):
                    raise
                result = await self._retry(e, deadline, min_attempt)
        except Exception as e:
            self.metrics.renewals_by_result["failed"].inc()
            log.warning("lease %s: renewal failed, retrying soon: %s", self.node, brief(e))
            self._due = self.clock.monotonic() + min(2.0, self.heartbeat.renewIntervalSeconds)
            return self._due
        if self.failing:
            self.failing = False
            self.answered.fire()
        now = self.clock.monotonic()
        self.metrics.renewals_by_result[result].inc()
        self.metrics.lease_latency.observe(max(0.0, now - due))
        self.last_renewed = self._stamped
        self._u = self.rng.uniform(-1, 1)
        self._due = self.next_due()
        if self._spread:
            self._spread = False
            self._due = spread_before(now, self._due, self.rng)
        return self._due

    def _timeout(self, deadline: float) -> float:
        return max(0.05, min(self.REQUEST_TIMEOUT, deadline - self.clock.monotonic()))

    async def _retry(self, first: BaseException, deadline: float, min_attempt: float) -> str:
        """The attempts after a first one that failed with `first` (tenacity's attempt 1,
        so the waits and the stop rule count it): bounded so that no attempt starts too
        late to land before the lease expires."""
        def stop(rs: RetryCallState) -> bool:
            return self.clock.monotonic() + rs.upcoming_sleep + min_attempt > deadline

        def retriable(exc: BaseException) -> bool:
            if status_of(exc) in (404, 409):
                self.metrics.renewals_by_result["conflict"].inc()
                return True
            if is_retriable(exc):
                self.failing = True
                self.metrics.renewals_by_result["retried"].inc()
                return True
            return False

        failed: list[BaseException] = [first]
        retrying = AsyncRetrying(retry=retry_if_exception(retriable), wait=self._retry_wait,
                                 stop=stop, sleep=self.clock.sleep, reraise=True)
        async for attempt in retrying:
            with attempt:
                if failed:
                    raise failed.pop()  # the first attempt's outcome, as tenacity's own
                return await self._write_once(self._timeout(deadline))
        raise AssertionError("tenacity returns or raises")  # pragma: no cover

    def replan(self) -> float:
        """After a settings change: when the next renewal is due under them."""
        self._due = self.next_due()
        return self._due

    async def _write_once(self, timeout: float) -> str:
        """One attempt. Keeps the last Lease the server answered with, so a renewal is one
        PUT of it with a new renewTime."""
        if self.lease is None:
            try:
                self.lease = _kept(await self.kube.get(
                    LEASES, self.node, namespace=NODE_LEASE_NAMESPACE, timeout=timeout))
            except ApiError as e:
                if e.status != 404:
                    raise
                self.lease = _kept(await self.kube.create(LEASES, self._body(None),
                                                          timeout=timeout))
                return "created"
        try:
            self.lease = _kept(await self.kube.update(LEASES, self._body(self.lease),
                                                      timeout=timeout))
        except ApiError as e:
            if e.status in (404, 409):
                self.lease = None  # deleted or changed under us: re-read on the next try
            raise
        return "success"

    def _body(self, current: Obj | None) -> Obj:
        """`current` (the server's last answer, which nothing else holds) made ours: its
        other fields and whatever others wrote stay as the server has them."""
        lease: Obj = current if current is not None else {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": self.node, "namespace": NODE_LEASE_NAMESPACE}}
        lease.setdefault("apiVersion", "coordination.k8s.io/v1")
        lease.setdefault("kind", "Lease")
        meta = lease.setdefault("metadata", {})
        if self.owner_uid:
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node",
                                        "name": self.node, "uid": self.owner_uid}]
        spec = lease.setdefault("spec", {})
        spec["holderIdentity"] = self.node
        spec["leaseDurationSeconds"] = self.heartbeat.leaseDurationSeconds
        spec["renewTime"] = api_microtime(self.clock.now())
        self._stamped = self.clock.monotonic()
        return lease


def _kept(lease: Obj) -> Obj:
    """The server's answer as kept until the next renewal: without its managedFields
    (most of its bytes; a PUT without them leaves the server's as they are), its keys
    and short strings shared with the other nodes' Leases."""
    (lease.get("metadata") or {}).pop("managedFields", None)
    kept: Obj = with_shared_strings(lease)
    return kept
