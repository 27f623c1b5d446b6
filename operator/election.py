"""Leader election on a coordination.k8s.io Lease, so of two replicas only one acts.

Both replicas watch and keep their indexes warm; only the holder writes. The holder
renews every `retry` seconds and stops acting once `renew_deadline` passes without a
successful renewal; a standby takes the Lease only after seeing it unchanged for
`duration` seconds on its own clock. renew_deadline + one write's timeout < duration,
so the old leader has stopped before the new one starts.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from typing import Any, Protocol

from prometheus_client import Gauge

from nodeagent.api.client import status_of
from nodeagent.api.clock import Clock
from nodeagent.api.kube import LEASES, MERGE, Kube

log = logging.getLogger("nodeoperator.election")

LEADER = Gauge("nodepulse_operator_leader", "1 while this replica holds the leader Lease")


@dataclasses.dataclass
class LeaseRecord:
    holder: str
    duration: int
    renew_time: str | None
    acquire_time: str | None
    transitions: int
    rv: str = ""


class LeaseBackend(Protocol):
    """Reads and writes the election Lease; update/create raise ApiError on 409."""

    async def get(self) -> LeaseRecord | None: ...

    async def create(self, record: LeaseRecord) -> LeaseRecord: ...

    async def update(self, record: LeaseRecord) -> LeaseRecord: ...


class LeaderElector:
    def __init__(self, backend: LeaseBackend, clock: Clock, identity: str, *,
                 duration: float = 15.0, renew_deadline: float = 10.0,
                 retry: float = 2.0) -> None:
        if not retry < renew_deadline < duration:
            raise ValueError("leader election needs retry < renew_deadline < duration")
        self.backend, self.clock, self.identity = backend, clock, identity
        self.duration, self.renew_deadline, self.retry = duration, renew_deadline, retry
        self._renewed: float | None = None  # monotonic time of our last good renewal
        self._seen: tuple[str, str | None] | None = None  # (holder, renewTime) seen
        self._seen_at = 0.0
        self.holder: str | None = None
        # Since when our calls to the API server have succeeded without a break
        # (None while they fail): the monitor does not count a node's silence
        # while it could not have heard it.
        self.api_ok_since: float | None = None

    @property
    def leading(self) -> bool:
        ok = (self._renewed is not None
              and self.clock.monotonic() - self._renewed < self.renew_deadline)
        LEADER.set(1 if ok else 0)
        return ok

    async def run(self) -> None:
        while True:
            started = self.clock.monotonic()
            try:
                await self.try_once()
                if self.api_ok_since is None:
                    self.api_ok_since = started
            except Exception as e:  # the API is down: keep trying, the deadline decides
                self.api_ok_since = None
                log.warning("leader election: %s", e)
            self.leading  # noqa: B018 (updates the gauge)
            await self.clock.sleep(self.retry)

    async def try_once(self) -> bool:
        """One acquire-or-renew attempt; True while we hold the Lease."""
        now = self.clock.now()
        mono = self.clock.monotonic()
        rec = await self.backend.get()
        if rec is None:
            mine = LeaseRecord(self.identity, int(self.duration), _ts(now), _ts(now), 0)
            return await self._write(self.backend.create, mine, mono)
        self.holder = rec.holder or None
        if rec.holder == self.identity:
            rec.renew_time = _ts(now)
            return await self._write(self.backend.update, rec, mono)
        self._renewed = None  # someone else holds it: we are not acting
        seen = (rec.holder, rec.renew_time)
        if seen != self._seen:
            self._seen, self._seen_at = seen, mono
        if rec.holder and mono - self._seen_at < max(self.duration, rec.duration):
            return False
        log.info("leader Lease %s by %r; taking it", "expired" if rec.holder else "released",
                 rec.holder)
        taken = LeaseRecord(self.identity, int(self.duration), _ts(now), _ts(now),
                            rec.transitions + 1, rec.rv)
        return await self._write(self.backend.update, taken, mono)

    async def _write(self, op: Any, rec: LeaseRecord, mono: float) -> bool:
        try:
            await op(rec)
        except Exception as e:
            if status_of(e) == 409:  # someone else wrote first; look again next time
                return False
            raise
        if self._renewed is None:
            log.info("became leader as %s", self.identity)
        self._renewed = mono
        self.holder = self.identity
        return True

    async def release(self) -> None:
        """On a clean shutdown: hand over at once instead of after `duration`."""
        if not self.leading:
            return
        self._renewed = None
        LEADER.set(0)
        try:
            rec = await self.backend.get()
            if rec is not None and rec.holder == self.identity:
                rec.holder, rec.duration = "", 1
                await self.backend.update(rec)
        except Exception as e:
            log.warning("releasing the leader Lease: %s", e)


def _ts(t: dt.datetime) -> str:
    # A Lease's times are MicroTime: the fraction is required. (The kubernetes client
    # turns a created object's times into datetimes and back, and drops a zero
    # fraction; a microsecond's nudge keeps it.)
    t = t.replace(microsecond=t.microsecond or 1)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubeLeaseBackend:
    """The Lease through the one API layer (nodeagent.api.kube)."""

    TIMEOUT = 5  # seconds per request; see the module docstring for why it is short

    def __init__(self, kube: Kube, namespace: str, name: str) -> None:
        self.kube = kube
        self.namespace, self.name = namespace, name

    async def get(self) -> LeaseRecord | None:
        try:
            body = await self.kube.get(LEASES, self.name, namespace=self.namespace,
                                       timeout=self.TIMEOUT)
        except Exception as e:
            if status_of(e) == 404:
                return None
            raise
        spec = body.get("spec") or {}
        return LeaseRecord(spec.get("holderIdentity") or "",
                           int(spec.get("leaseDurationSeconds") or 0),
                           spec.get("renewTime"), spec.get("acquireTime"),
                           int(spec.get("leaseTransitions") or 0),
                           body["metadata"]["resourceVersion"])

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        await self.kube.create(LEASES, self._body(record), timeout=self.TIMEOUT)
        return record

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        # A merge patch carrying the resourceVersion we read: refused (409) if the
        # Lease changed since, like a replace, and the body is sent as we wrote it.
        await self.kube.patch(LEASES, self.name, self._body(record), namespace=self.namespace,
                              content_type=MERGE, timeout=self.TIMEOUT)
        return record

    def _body(self, r: LeaseRecord) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if r.rv:
            meta["resourceVersion"] = r.rv  # replace only the version we read
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": {"holderIdentity": r.holder, "leaseDurationSeconds": r.duration,
                         "renewTime": r.renew_time, "acquireTime": r.acquire_time,
                         "leaseTransitions": r.transitions}}
