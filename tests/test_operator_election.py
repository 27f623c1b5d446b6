"""Leader election on a fake Lease with fake clocks: one leader at a time, takeover
only after the Lease duration, the old leader stops acting before that."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from nodeoperator.election import LeaderElector, LeaseRecord

from nodeagent.api.client import ApiError
from nodeagent.api.clock import FakeClock


class FakeLease:
    def __init__(self) -> None:
        self.rec: LeaseRecord | None = None
        self.rv = 0
        self.down = False  # the API server is unreachable

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("apiserver down")

    async def get(self) -> LeaseRecord | None:
        self._check()
        return dataclasses.replace(self.rec) if self.rec else None

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        self._check()
        if self.rec is not None:
            raise ApiError(status=409)
        return self._store(record)

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        self._check()
        if self.rec is None or record.rv != self.rec.rv:
            raise ApiError(status=409)
        return self._store(record)

    def _store(self, record: LeaseRecord) -> LeaseRecord:
        self.rv += 1
        self.rec = dataclasses.replace(record, rv=str(self.rv))
        return self.rec


def test_one_leader_then_takeover_after_duration() -> None:
    async def main() -> None:
        lease, clock = FakeLease(), FakeClock()
        a = LeaderElector(lease, clock, "a", duration=15, renew_deadline=10, retry=2)
        b = LeaderElector(lease, clock, "b", duration=15, renew_deadline=10, retry=2)
        assert await a.try_once() and a.leading
        assert not await b.try_once() and not b.leading and b.holder == "a"
        for _ in range(10):  # a keeps renewing: b never takes over
            await clock.advance(2)
            assert await a.try_once()
            assert not await b.try_once()
        assert lease.rec and lease.rec.holder == "a"
        # a dies (no more renewals). a would stop acting by itself after 10 s ...
        died = clock.monotonic()
        taken_at = None
        while taken_at is None:
            await clock.advance(1)
            assert a.leading == (clock.monotonic() - died < 10)
            if await b.try_once():
                taken_at = clock.monotonic()
            assert not (a.leading and b.leading)  # never both
        assert 15 <= taken_at - died <= 17
        assert lease.rec and lease.rec.holder == "b" and lease.rec.transitions == 1
        # a comes back: it sees b holds the Lease and stays standby.
        assert not await a.try_once() and not a.leading
    asyncio.run(main())


def test_apiserver_outage_stops_leader_acting_after_deadline() -> None:
    async def main() -> None:
        lease, clock = FakeLease(), FakeClock()
        a = LeaderElector(lease, clock, "a", duration=15, renew_deadline=10, retry=2)
        task = asyncio.create_task(a.run())
        await clock.advance(0)
        assert a.leading
        assert a.api_ok_since == 0
        lease.down = True
        await clock.advance(9)
        assert a.api_ok_since is None
        assert a.leading
        await clock.advance(2)
        assert not a.leading  # could not renew for 10 s: stop acting
        lease.down = False
        await clock.advance(2)
        assert a.leading  # still the holder in the Lease: renews and resumes
        assert a.api_ok_since is not None and a.api_ok_since >= 11
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())


def test_release_hands_over_at_once() -> None:
    async def main() -> None:
        lease, clock = FakeLease(), FakeClock()
        a = LeaderElector(lease, clock, "a", duration=15, renew_deadline=10, retry=2)
        b = LeaderElector(lease, clock, "b", duration=15, renew_deadline=10, retry=2)
        assert await a.try_once()
        assert not await b.try_once()
        await a.release()
        assert not a.leading
        assert await b.try_once() and b.leading
    asyncio.run(main())


def test_lost_race_is_not_leadership() -> None:
    async def main() -> None:
        lease, clock = FakeLease(), FakeClock()
        a = LeaderElector(lease, clock, "a", duration=15, renew_deadline=10, retry=2)
        lease._store(LeaseRecord("x", 15, "t0", "t0", 0))
        await a.try_once()
        await clock.advance(16)
        # Someone else takes it between our read and our write: 409, not leader.
        orig = lease.get

        async def racing_get() -> LeaseRecord | None:
            rec = await orig()
            lease._store(LeaseRecord("c", 15, "t1", "t1", 1))
            return rec
        lease.get = racing_get  # type: ignore[method-assign]
        assert not await a.try_once() and not a.leading
    asyncio.run(main())


def test_bad_timings_refused() -> None:
    with pytest.raises(ValueError, match="retry < renew_deadline < duration"):
        LeaderElector(FakeLease(), FakeClock(), "a", duration=10, renew_deadline=10, retry=2)
