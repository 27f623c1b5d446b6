"""The merge state machine: ops, order, sources ready, name conflicts, mirror pods."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from nodeagent.pods.podupdate import (
    ANN_CONFIG_MIRROR,
    ANN_CONFIG_SEEN,
    Op,
    PodUpdate,
    Source,
)
from nodeagent.pods.sources.merge import Merge, classify
from nodeagent.pods.sources.problems import Problems
from tests.conftest import Sink, mkpod


def pod(name: str, uid: str | None = None, ns: str = "ns", **spec: Any) -> dict:
    """As the API server holds it, at resourceVersion 1."""
    p = mkpod(name, uid, ns=ns, policy=None, image=spec.pop("image", "img"), **spec)
    p["metadata"]["resourceVersion"] = "1"
    return p


def drain(m: Merge) -> list[PodUpdate]:
    out = []
    while not m.updates.empty():
        out.append(m.updates.get_nowait())
    return out


def ops(m: Merge) -> list[tuple[Op, Source, list[str]]]:
    return [(u.op, u.source, sorted(p["metadata"]["name"] for p in u.pods)) for u in drain(m)]


def test_classify() -> None:
    a = pod("a")
    assert classify(a, a) is None
    b = copy.deepcopy(a)
    b["metadata"]["resourceVersion"] = "2"
    assert classify(a, b) is None  # nothing the node cares about
    b["status"] = {"phase": "Running"}
    assert classify(a, b) is Op.RECONCILE
    c = copy.deepcopy(a)
    c["spec"]["containers"][0]["image"] = "img2"
    assert classify(a, c) is Op.UPDATE
    d = copy.deepcopy(a)
    d["metadata"]["labels"] = {"x": "y"}
    assert classify(a, d) is Op.UPDATE
    e = copy.deepcopy(a)
    e["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    e["metadata"]["deletionGracePeriodSeconds"] = 30
    assert classify(a, e) is Op.DELETE
    f = copy.deepcopy(a)
    f["metadata"]["annotations"] = {ANN_CONFIG_SEEN: "2026-01-01T00:00:00Z"}
    assert classify(a, f) is None  # config.seen is not a change


def test_set_emits_only_differences() -> None:
    async def main() -> None:
        m = Merge([Source.API])
        a, b, c = pod("a"), pod("b"), pod("c")
        m.set(Source.API, [a, b])
        assert ops(m) == [(Op.ADD, Source.API, ["a", "b"])]
        m.set(Source.API, [copy.deepcopy(a), copy.deepcopy(b)])  # a relist, same content
        assert ops(m) == []
        b2 = copy.deepcopy(b)
        b2["spec"]["containers"][0]["image"] = "new"
        a2 = copy.deepcopy(a)
        a2["status"] = {"phase": "Running"}
        m.set(Source.API, [a2, b2, c])
        assert ops(m) == [(Op.ADD, Source.API, ["c"]), (Op.UPDATE, Source.API, ["b"]),
                          (Op.RECONCILE, Source.API, ["a"])]
        m.set(Source.API, [a2, c])
        assert ops(m) == [(Op.REMOVE, Source.API, ["b"])]
        assert sorted(p["metadata"]["name"] for p in m.pods()) == ["a", "c"]
        assert m.pod("uid-c") is c and m.pod("uid-b") is None
    asyncio.run(main())


def test_incremental_and_graceful_delete() -> None:
    async def main() -> None:
        m = Merge([Source.API])
        a = pod("a")
        m.upsert(Source.API, a)
        assert ops(m) == [(Op.ADD, Source.API, ["a"])]
        m.upsert(Source.API, a)
        assert ops(m) == []
        d = copy.deepcopy(a)
        d["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:30Z"
        d["metadata"]["deletionGracePeriodSeconds"] = 30
        m.upsert(Source.API, d)
        assert ops(m) == [(Op.DELETE, Source.API, ["a"])]
        d2 = copy.deepcopy(d)
        d2["status"] = {"phase": "Succeeded"}
        m.upsert(Source.API, d2)
        assert ops(m) == [(Op.RECONCILE, Source.API, ["a"])]
        stale = pod("a", uid="other-uid")
        m.remove(Source.API, stale)  # a DELETED for another incarnation is ignored
        assert ops(m) == []
        m.remove(Source.API, d2)
        assert ops(m) == [(Op.REMOVE, Source.API, ["a"])]
        assert m.pods() == []
    asyncio.run(main())


def test_same_name_new_uid_is_remove_then_add() -> None:
    async def main() -> None:
        m = Merge([Source.FILE])
        m.set(Source.FILE, [pod("s", uid="u1")])
        drain(m)
        m.set(Source.FILE, [pod("s", uid="u2", image="edited")])
        ups = drain(m)
        assert [(u.op, u.pods[0]["metadata"]["uid"]) for u in ups] == [
            (Op.REMOVE, "u1"), (Op.ADD, "u2")]
    asyncio.run(main())


def test_sources_ready_only_after_each_first_set() -> None:
    async def main() -> None:
        m = Merge([Source.API, Source.FILE, Source.HTTP])
        assert not m.ready.all_ready()
        m.upsert(Source.API, pod("a"))  # a watch event is not a full set
        m.set(Source.FILE, [])
        assert m.ready.seen(Source.FILE) and not m.ready.seen(Source.API)
        m.set(Source.API, [pod("a")])
        assert not m.ready.all_ready()
        waiter = asyncio.ensure_future(m.ready.wait())
        await asyncio.sleep(0)
        assert not waiter.done()
        m.set(Source.HTTP, [])
        await asyncio.wait_for(waiter, 1)
        assert m.ready.all_ready()
        with pytest.raises(ValueError, match="not configured"):
            Merge([Source.FILE]).set(Source.API, [])
    asyncio.run(main())


def test_name_conflict_is_resolved_by_precedence_and_reported() -> None:
    async def main() -> None:
        sink = Sink()
        m = Merge([Source.API, Source.FILE, Source.HTTP], Problems(sink))
        api_pod = pod("x", uid="api-uid")
        m.set(Source.API, [api_pod])
        assert ops(m) == [(Op.ADD, Source.API, ["x"])]
        file_pod = pod("x", uid="file-uid")
        m.set(Source.FILE, [file_pod])
        # the file pod wins: the API pod is taken away, the file pod added
        assert ops(m) == [(Op.REMOVE, Source.API, ["x"]), (Op.ADD, Source.FILE, ["x"])]
        assert [r for r, _ in sink.events] == ["StaticPodNameConflict"]
        assert "ns/x from the api source" in sink.events[0][1]
        http_pod = pod("x", uid="http-uid")
        m.set(Source.HTTP, [http_pod])
        assert ops(m) == []  # file still wins over http
        changed = copy.deepcopy(api_pod)
        changed["spec"]["containers"][0]["image"] = "other"
        m.upsert(Source.API, changed)  # a hidden pod's changes are not delivered
        assert ops(m) == []
        assert len(sink.events) == 2  # api and http losers each reported once
        m.set(Source.FILE, [])
        assert ops(m) == [(Op.REMOVE, Source.FILE, ["x"]), (Op.ADD, Source.HTTP, ["x"])]
        m.set(Source.HTTP, [])
        assert ops(m) == [(Op.REMOVE, Source.HTTP, ["x"]), (Op.ADD, Source.API, ["x"])]
        assert m.pods() == [changed]
    asyncio.run(main())


def test_mirror_pods_are_kept_apart() -> None:
    async def main() -> None:
        m = Merge([Source.API, Source.FILE])
        ev = m.listen()
        static = pod("s-n1", uid="static-uid")
        m.set(Source.FILE, [static])
        assert ev.is_set() and list(m.static_pods()) == ["ns/s-n1"]
        ev.clear()
        mirror = pod("s-n1", uid="mirror-uid")
        mirror["metadata"]["annotations"] = {ANN_CONFIG_MIRROR: "static-uid"}
        mirror["status"] = {"phase": "Running"}
        drain(m)
        m.set(Source.API, [mirror, pod("a")])
        # the mirror is not a pod to run; the status it holds is its static pod's as the
        # API has it (a RECONCILE, as for an API pod)
        updates = drain(m)
        assert [(u.op, u.source) for u in updates] == [(Op.RECONCILE, Source.FILE),
                                                      (Op.ADD, Source.API)]
        reconciled = updates[0].pods[0]
        assert reconciled["metadata"]["uid"] == "static-uid"
        assert reconciled["status"] == {"phase": "Running"}
        assert m.mirrors == {"ns/s-n1": mirror} and ev.is_set()
        ev.clear()
        m.upsert(Source.API, mirror)
        assert not ev.is_set() and drain(m) == []
        # a mirror replaced by a new one (Pending, nothing of ours): the status is
        # written again, even if the last write landed on the old mirror
        fresh = pod("s-n1", uid="mirror-uid-2")
        fresh["metadata"]["annotations"] = {ANN_CONFIG_MIRROR: "static-uid"}
        m.upsert(Source.API, fresh)
        assert [(u.op, u.pods[0]["status"]) for u in drain(m)] == [
            (Op.RECONCILE, fresh["status"])]
        # a mirror of another version of the static pod says nothing about this one
        other = pod("s-n1", uid="mirror-uid-3")
        other["metadata"]["annotations"] = {ANN_CONFIG_MIRROR: "older-static-uid"}
        m.upsert(Source.API, other)
        assert drain(m) == []
        m.remove(Source.API, other)
        assert m.mirrors == {} and ev.is_set()
        assert m.pod("static-uid") is static
    asyncio.run(main())
