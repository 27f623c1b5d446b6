"""The Lease list-and-watch against a scripted fake API: paginated list, events split
across chunks, bookmarks, resume from the last resourceVersion, relist on 410 Gone
(forgetting Leases deleted meanwhile), retry with backoff on transport errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from nodeoperator.state import Store
from nodeoperator.watch import LeaseWatch

from nodeagent.api.clock import FakeClock


class Done(BaseException):
    """Ends the test: the script has run out."""


class Resp:
    def __init__(self, data: bytes = b"", chunks: list[bytes] | None = None) -> None:
        self.data, self.chunks = data, chunks or []
        self.released = False

    def stream(self, n: int) -> Any:
        yield from self.chunks

    def release_conn(self) -> None:
        self.released = True


def lease(name: str, renew: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "kube-node-lease", "resourceVersion": rv},
            "spec": {"renewTime": renew}}


def lines(*events: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in events)


class FakeCoord:
    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.calls: list[dict[str, Any]] = []

    def list_namespaced_lease(self, namespace: str, **kw: Any) -> Resp:
        assert namespace == "kube-node-lease" and kw["_preload_content"] is False
        self.calls.append(kw)
        if not self.script:
            raise Done()
        step = self.script.pop(0)
        assert ("watch" in kw) == (step[0] == "watch"), (step[0], kw)
        if isinstance(step[1], Exception):
            raise step[1]
        return step[1]


def page(items: list[dict[str, Any]], rv: str, cont: str | None = None) -> Resp:
    meta: dict[str, Any] = {"resourceVersion": rv}
    if cont:
        meta["continue"] = cont
    return Resp(json.dumps({"items": items, "metadata": meta}).encode())


def test_list_watch_resume_and_relist() -> None:
    async def main() -> None:
        clock = FakeClock()
        store = Store(clock)
        events = lines(
            {"type": "MODIFIED", "object": lease("a", "t1", "11")},
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}},
            {"type": "DELETED", "object": lease("b", "t0", "16")})
        first_watch = Resp(chunks=[events[:25], events[25:90], events[90:]])
        gone = Resp(chunks=[lines({"type": "ERROR", "object": {
            "kind": "Status", "code": 410, "message": "too old resource version"}})])
        api = FakeCoord([
            ("list", page([lease("a", "t0", "5")], "10", cont="next")),
            ("list", page([lease("b", "t0", "6"), lease("c", "t0", "7")], "10")),
            ("watch", first_watch),
            ("watch", gone),
            ("list", page([lease("a", "t1", "11"), lease("d", "t0", "20")], "21")),
        ])
        w = LeaseWatch(api, store, clock, page=1)
        with pytest.raises(Done):
            await w.run()
        await asyncio.sleep(0)  # the last batch handed over by the thread
        # Pages followed; the watch resumed from the list, then from the last event.
        assert api.calls[1]["_continue"] == "next"
        assert api.calls[2]["resource_version"] == "10"
        assert api.calls[3]["resource_version"] == "16"  # the last event, after the bookmark
        assert "watch" not in api.calls[4]  # 410: listed again
        assert api.calls[5]["resource_version"] == "21"
        # c was deleted while we were not watching: the relist forgot it.
        assert set(store.leases) == {"a", "d"}
        assert store.leases["a"].renew_time == "t1"
        assert first_watch.released and gone.released and w.listed.is_set()
    asyncio.run(main())


def test_renewal_times_are_observed_on_our_clock() -> None:
    async def main() -> None:
        clock = FakeClock()
        store = Store(clock)
        api = FakeCoord([("list", page([lease("a", "t0", "5")], "10"))])
        w = LeaseWatch(api, store, clock)
        with pytest.raises(Done):
            await w.run()
        assert store.leases["a"].observed == 0
        await clock.advance(7)
        # A relist of the same renewTime is not a renewal; a new one is.
        store.lease_event("ADDED", lease("a", "t0", "5"))
        assert store.leases["a"].observed == 0
        store.lease_event("MODIFIED", lease("a", "t1", "6"))
        assert store.leases["a"].observed == 7
    asyncio.run(main())


def test_transport_errors_back_off_on_the_clock() -> None:
    async def main() -> None:
        clock = FakeClock()
        store = Store(clock)
        api = FakeCoord([("list", ConnectionError("refused")),
                         ("list", ConnectionError("refused")),
                         ("list", page([lease("a", "t0", "5")], "10"))])
        w = LeaseWatch(api, store, clock, backoff=1.0)
        task = asyncio.create_task(w.run())
        while len(api.calls) < 1 or clock.sleepers == 0:
            await asyncio.sleep(0)
        await clock.advance(1)  # first retry after 1 s
        while len(api.calls) < 2 or clock.sleepers == 0:
            await asyncio.sleep(0)
        await clock.advance(1.5)
        assert len(api.calls) == 2  # the second wait is 2 s
        await clock.advance(0.5)
        with pytest.raises(Done):
            await task
        assert "a" in store.leases
    asyncio.run(main())
