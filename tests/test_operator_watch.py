"""The Lease list-and-watch on the in-memory API: paginated list, bookmarks, resume
from the last resourceVersion, relist on 410 Gone (forgetting Leases deleted meanwhile),
retry with backoff on transport errors. (Events split across chunks: the transport's,
tests/test_api_kube.py.)"""

from __future__ import annotations

import asyncio
from typing import Any

from nodeoperator.leasewatch import LeaseWatch
from nodeoperator.state import Store

from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import LEASES, NODE_LEASE_NAMESPACE
from tests.fakekube import FakeKube


def lease(name: str, renew: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NODE_LEASE_NAMESPACE},
            "spec": {"renewTime": renew}}


def test_list_watch_resume_and_relist() -> None:
    async def main() -> None:
        clock = FakeClock()
        store = Store(clock)
        kube = FakeKube(now=clock.monotonic)
        for name in "abc":
            kube.put(LEASES, lease(name, "t0"))
        w = LeaseWatch(kube, store, clock, page=1)
        task = asyncio.create_task(w.run())
        await settle()
        # Pages followed; the watch resumed from the list, then from the last event.
        lists = kube.calls_of("list leases")
        assert [c.query.get("cont", "").partition(":")[2] for c in lists] == ["", "1", "2"]
        watch = kube.calls_of("watch leases")[0].query
        assert watch["resourceVersion"] == lists[-1].query["cont"].partition(":")[0]
        assert w.listed.is_set() and set(store.leases) == {"a", "b", "c"}
        kube.put(LEASES, lease("a", "t1"))
        kube.bump()
        kube.bookmark(LEASES)
        kube.remove(LEASES, "b", NODE_LEASE_NAMESPACE)
        await settle()
        held = kube.resource_version
        assert w.reflector.resource_version == held and set(store.leases) == {"a", "c"}
        kube.drop()  # the server ends the watch: resumed from the last event
        await settle()
        assert kube.calls_of("watch leases")[-1].query["resourceVersion"] == held
        assert kube.count("list leases") == 3
        # c is deleted while we are not watching, and the history is gone: 410, relist
        kube.drop(ConnectionResetError("cut"))
        kube.down = True
        await settle()
        kube.remove(LEASES, "c", NODE_LEASE_NAMESPACE)
        kube.put(LEASES, lease("d", "t0"))
        kube.compact()
        kube.down = False
        await clock.advance(1)
        assert "resourceVersion" not in kube.calls_of("list leases")[-1].query  # a list
        assert kube.calls_of("watch leases")[-1].query["resourceVersion"] == \
            kube.resource_version
        # c was deleted while we were not watching: the relist forgot it.
        assert set(store.leases) == {"a", "d"}
        assert store.leases["a"].renew_time == "t1"
        w.close()
        await asyncio.wait_for(task, 1)
    asyncio.run(main())


def test_renewal_times_are_observed_on_our_clock() -> None:
    async def main() -> None:
        clock = FakeClock()
        store = Store(clock)
        kube = FakeKube()
        kube.put(LEASES, lease("a", "t0"))
        w = LeaseWatch(kube, store, clock)
        task = asyncio.create_task(w.run())
        await settle()
        w.close()
        await asyncio.wait_for(task, 1)
        assert store.leases["a"].observed == 0
        await clock.advance(7)
        # A relist of the same renewTime is not a renewal; a new one is.
        store.lease_event("ADDED", lease("a", "t0"))
        assert store.leases["a"].observed == 0
        store.lease_event("MODIFIED", lease("a", "t1"))
        assert store.leases["a"].observed == 7
    asyncio.run(main())


def test_transport_errors_back_off_on_the_clock() -> None:
    async def main() -> None:
        clock = FakeClock()
        store = Store(clock)
        kube = FakeKube(now=clock.monotonic)
        kube.put(LEASES, lease("a", "t0"))
        kube.fail("list leases", ConnectionError("refused"), ConnectionError("refused"))
        w = LeaseWatch(kube, store, clock, backoff=1.0)
        task = asyncio.create_task(w.run())
        await settle()
        await clock.advance(1)  # first retry after 1 s
        assert kube.count("list leases") == 2
        await clock.advance(1.5)
        assert kube.count("list leases") == 2  # the second wait is 2 s
        await clock.advance(0.5)
        assert kube.count("list leases") == 3
        assert "a" in store.leases and w.listed.is_set()
        w.close()
        await asyncio.wait_for(task, 1)
    asyncio.run(main())
