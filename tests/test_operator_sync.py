"""A new operator (restart, rolling update, failover) acts only on complete views, and
keeps its predecessor's verdicts: the initial sync against a fake API, and the monitor
started on a cluster a previous operator left settled. No test sleeps."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
from typing import Any

from nodeoperator.modes import EXCLUSIVE, Lifecycle
from nodeoperator.monitor import Monitor
from nodeoperator.state import UNREACHABLE_TAINT, Store
from nodeoperator.sync import InitialSync

from nodeagent.api.client import ApiError
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import NODE_STATUS_POLICIES, NODES
from nodeagent.api.policy import HEARTBEAT_ANNOTATION, Heartbeat, encode_heartbeat_annotation
from tests.conftest import until
from tests.fakekube import Call, FakeKube
from tests.fakeoperator import FakeApi, post_ready, spec

# the controller manager's node-lifecycle controller off: the operator does it all
ALONE = Lifecycle(EXCLUSIVE)


class ListApi:
    """The in-memory API holding a FakeApi's Nodes and policies (as they are at each
    list), for the initial sync's lists; `fail` makes the next full lists raise; `calls`
    names the lists made, as (list_node, continue) and (lookup_node, name)."""

    def __init__(self, api: FakeApi) -> None:
        self.api = api
        self.kube = FakeKube()
        self.fail: list[Exception] = []
        self.no_crd = False
        self.kube.intercept("list nodes", self._answer)
        self.kube.intercept("list nodestatuspolicies", self._answer)

    def _answer(self, call: Call) -> BaseException | None:
        for res, objs in ((NODES, self.api.nodes), (NODE_STATUS_POLICIES, self.api.policies)):
            held = self.kube.items(res)
            for name in held.keys() - objs.keys():
                self.kube.remove(res, name)
            for name, obj in objs.items():
                if held.get(name, {}).get("metadata", {}).get("resourceVersion") != \
                        obj["metadata"]["resourceVersion"]:
                    self.kube.put(res, obj)
        if call.resource == "nodestatuspolicies" and self.no_crd:
            return ApiError(status=404, reason="Not Found")
        if call.resource == "nodes" and "fieldSelector" not in call.query and self.fail:
            return self.fail.pop(0)
        return None

    @property
    def calls(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for c in self.kube.calls:
            kind = "node" if c.resource == "nodes" else "policy"
            if "fieldSelector" in c.query:
                out.append((f"lookup_{kind}", c.query["fieldSelector"].removeprefix(
                    "metadata.name=")))
            else:
                cont = c.query.get("cont")
                out.append(("list_node" if kind == "node" else "list_policies",
                            cont.partition(":")[2] if cont else None))
        return out


def kopf_delivers(store: Store, api: FakeApi, nodes: bool = True, policies: bool = True) -> None:
    """What kopf's first lists hand the event handlers (type None: from a list)."""
    if nodes:
        for body in api.nodes.values():
            store.node_event(None, copy.deepcopy(body))
    if policies:
        for body in api.policies.values():
            store.policy_event(None, copy.deepcopy(body))


def test_sync_waits_for_every_listed_name_and_not_for_deleted_ones() -> None:
    async def main() -> None:
        clock = FakeClock()
        old = Store(clock)
        api = FakeApi(old, clock)
        for n in ("n1", "n2", "n3"):
            api.add_node(n)
        api.add_policy("p", spec())
        store = Store(clock)
        lists = ListApi(api)
        lists.fail = [ConnectionError("refused")]
        sync = InitialSync(lists.kube, store, clock, page=2, poll=0.5, recheck=5)
        task = asyncio.create_task(sync.run())
        await until(lambda: clock.sleepers > 0, "the retry wait")
        await clock.advance(1)  # first retry after 1 s
        await until(lambda: bool(sync.pending), "the lists")
        # Paginated: the node list took two pages.
        assert [c for c in lists.calls if c[0] == "list_node"] == [
            ("list_node", None), ("list_node", None), ("list_node", "2")]
        assert sync.pending == {"node": {"n1", "n2", "n3"}, "policy": {"p"}}
        # kopf has handed over the nodes but not the policy yet: not synced.
        kopf_delivers(store, api, policies=False)
        await clock.advance(1)
        assert not sync.done.is_set() and sync.pending == {"node": set(), "policy": {"p"}}
        kopf_delivers(store, api)
        await clock.advance(0.5)
        assert sync.done.is_set()
        await task

        # A node deleted between our list and kopf's never arrives: once kopf makes
        # no progress for `recheck`, it is looked up, found gone, and not waited for;
        # one that exists is.
        store2 = Store(clock)
        sync2 = InitialSync(lists.kube, store2, clock, page=2, poll=0.5, recheck=5)
        task2 = asyncio.create_task(sync2.run())
        await until(lambda: bool(sync2.pending), "the lists")
        del api.nodes["n3"]
        kopf_delivers(store2, api, policies=False)
        await clock.advance(5)
        assert not sync2.done.is_set()
        assert not [c for c in lists.calls if c[0] in ("lookup_node", "lookup_policy")]  # progress
        await clock.advance(5)  # no progress since: n3 is gone (404), p exists
        await until(lambda: ("lookup_policy", "p") in lists.calls, "the lookups")
        await settle()
        assert ("lookup_node", "n3") in lists.calls
        assert sync2.pending == {"node": set(), "policy": {"p"}}
        assert not sync2.done.is_set()
        kopf_delivers(store2, api)
        await clock.advance(0.5)
        assert sync2.done.is_set()
        await task2

        # No CRD: no policies to wait for.
        lists.no_crd = True
        store3 = Store(clock)
        sync3 = InitialSync(lists.kube, store3, clock, poll=0.5)
        task3 = asyncio.create_task(sync3.run())
        await until(lambda: bool(sync3.pending), "the lists")
        kopf_delivers(store3, api, policies=False)
        await clock.advance(0.5)
        assert sync3.done.is_set()
        await task3
    asyncio.run(main())


def settled_cluster() -> tuple[FakeClock, FakeApi]:
    """A cluster a first operator has settled: policies resolved and written, their
    statuses written, a silent node marked unreachable, a healthy node renewing."""
    async def first() -> tuple[FakeClock, FakeApi]:
        clock = FakeClock()
        store = Store(clock)
        store.lease_sync(set())
        api = FakeApi(store, clock)
        api.add_policy("pool-a", spec(grace=15, sel={"matchLabels": {"pool": "a"}}))
        api.add_policy("pool-b", spec(grace=30, lease=20, sel={"matchLabels": {"pool": "b"}}))
        api.add_node("a1", {"pool": "a"})
        api.add_node("b1", {"pool": "b"})
        api.add_node("silent", {"pool": "a"})
        api.add_node("other")  # the default policy
        mon = Monitor(store, clock, api, lifecycle=ALONE, period=2)
        for _ in range(10):
            for n in ("a1", "b1", "other"):
                api.renew(n)
            await clock.advance(2)
            await mon.tick()
        assert api.taints("silent") == {"NoSchedule", "NoExecute"}
        assert api.ready("silent")["status"] == "Unknown"
        assert api.taints("a1") == set()
        return clock, api
    return asyncio.run(first())


def leases_of(api: FakeApi, clock: FakeClock, names: list[str], age: float
              ) -> list[dict[str, Any]]:
    when = clock.now().timestamp() - age
    stamp = dt.datetime.fromtimestamp(when, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return [{"metadata": {"name": n, "namespace": "kube-node-lease"},
             "spec": {"renewTime": stamp}} for n in names]


def test_a_new_operator_on_a_settled_cluster_writes_nothing() -> None:
    """Leading at once, while kopf still hands over the Nodes before the policies: no
    node flips to the default policy and back, no status is rewritten, and the node its
    predecessor marked unreachable keeps its taints and Ready=Unknown."""
    clock, api = settled_cluster()

    async def second() -> None:
        store = Store(clock)
        api.store = store
        api.writes.clear()
        lists = ListApi(api)
        sync = InitialSync(lists.kube, store, clock, poll=0.5)
        # The Lease watch's first list: the silent node's Lease is a minute old.
        for body in leases_of(api, clock, ["a1", "b1", "other"], 1) + leases_of(
                api, clock, ["silent"], 60):
            store.lease_event("ADDED", body)
        store.lease_sync({"a1", "b1", "other", "silent"})
        listed = asyncio.Event()
        listed.set()
        mon = Monitor(store, clock, api, lifecycle=ALONE, period=2, synced=(sync.done, listed))
        tasks = [asyncio.create_task(sync.run()), asyncio.create_task(mon.run())]
        await until(lambda: bool(sync.pending), "the lists")
        kopf_delivers(store, api, policies=False)  # Nodes first, policies later
        for _ in range(3):
            await clock.advance(1)
        assert api.writes == []
        kopf_delivers(store, api)
        for _ in range(5):  # ten seconds of periods, the healthy nodes renewing
            for n in ("a1", "b1", "other"):
                api.renew(n)
            await clock.advance(2)
        assert sync.done.is_set() and mon.was_leader
        assert api.writes == []
        assert api.taints("silent") == {"NoSchedule", "NoExecute"}
        assert "silent" in store.stale and api.policies["pool-a"]["status"][
            "unreachableNodes"] == 1
        # Heard from again: a renewal lifts the verdict.
        api.renew("silent")
        await settle()
        await clock.advance(2)
        assert api.taints("silent") == set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(second())


def test_without_the_sync_the_new_operator_would_write_defaults() -> None:
    """The same start without the gate shows what it prevents (so the gate is what
    makes the test above pass): the default policy written over pool-a's node."""
    clock, api = settled_cluster()

    async def second() -> None:
        store = Store(clock)
        api.store = store
        api.writes.clear()
        store.lease_sync(set())
        mon = Monitor(store, clock, api, lifecycle=ALONE, period=2)
        kopf_delivers(store, api, policies=False)
        await mon.tick()
        default = encode_heartbeat_annotation(None, Heartbeat())
        assert api.nodes["a1"]["metadata"]["annotations"][HEARTBEAT_ANNOTATION] == default
    asyncio.run(second())


def marked_node(api: FakeApi, name: str) -> None:
    """A node a predecessor marked: both unreachable taints, Ready=Unknown."""
    body = api.nodes[name]
    body["spec"]["taints"] = [
        {"key": UNREACHABLE_TAINT, "effect": "NoSchedule"},
        {"key": UNREACHABLE_TAINT, "effect": "NoExecute", "timeAdded": "2026-01-01T00:00:00Z"}]
    for c in body["status"]["conditions"]:
        c["status"] = "Unknown"
    api._bump(body)
    api.store.node_event("MODIFIED", copy.deepcopy(body))


def test_a_marked_node_stays_marked_until_heard_from() -> None:
    """A new process first sees a node its predecessor marked unreachable. Its Lease
    renewTime looks recent by our clock (a node clock ahead of ours, or a renewal
    just before it went silent), so by the clock alone it is not stale: it still
    keeps its taints until it is really heard from, by a Lease renewal or by a status
    post, whichever comes first."""
    async def main() -> None:
        for how in ("lease", "status"):
            clock = FakeClock()
            store = Store(clock)
            api = FakeApi(store, clock)
            api.add_policy("p", spec(grace=15))
            api.add_node("n1")
            marked_node(api, "n1")
            for body in leases_of(api, clock, ["n1"], -30):  # 30 s ahead of us
                store.lease_event("ADDED", body)
            store.lease_sync({"n1"})
            mon = Monitor(store, clock, api, lifecycle=ALONE, period=2)
            for _ in range(20):
                await clock.advance(2)
                await mon.tick()
            assert api.taints("n1") == {"NoSchedule", "NoExecute"}, how
            # no taint or condition written (the annotation is, this fake node had none)
            assert [w for w in api.writes if w[0] == "node_status" or "spec" in w[2]] == [], how
            if how == "lease":
                api.renew("n1")
            else:
                post_ready(api, "n1")
            await mon.tick()
            assert api.taints("n1") == set(), how
    asyncio.run(main())


def test_a_long_silent_lease_is_judged_by_its_renew_time_not_a_full_grace() -> None:
    """First seen with a renewTime ten minutes old: once we have watched it for a lease
    duration without a renewal, it is stale (not a whole grace period after our start).
    A live node whose clock is ten minutes behind ours looks just as old, but renews
    within the lease duration, so it is never judged stale."""
    async def main() -> None:
        clock = FakeClock()
        store = Store(clock)
        api = FakeApi(store, clock)
        api.add_policy("p", spec(grace=60, lease=10))
        api.add_node("dead")
        api.add_node("skewed")
        for body in leases_of(api, clock, ["dead", "skewed"], 600):
            store.lease_event("ADDED", body)
        store.lease_sync({"dead", "skewed"})
        mon = Monitor(store, clock, api, lifecycle=ALONE, period=2)
        await mon.tick()
        assert api.taints("dead") == set()  # watched for less than a lease duration
        assert mon.next_stale == 10  # when the loop runs next: a lease duration watched
        for _ in range(4):
            await clock.advance(2)
            await mon.tick()
            # the skewed node renews with its own (late) clock
            store.lease_event("MODIFIED", {
                "metadata": {"name": "skewed", "namespace": "kube-node-lease"},
                "spec": {"renewTime": f"late-{clock.monotonic()}"}})
        assert api.taints("dead") == set()
        await clock.advance(2)  # 10 s watched: a lease duration
        await mon.tick()
        assert api.taints("dead") == {"NoSchedule", "NoExecute"}
        assert api.taints("skewed") == set()
        for _ in range(40):  # and the skewed one never, as long as it renews
            await clock.advance(2)
            store.lease_event("MODIFIED", {
                "metadata": {"name": "skewed", "namespace": "kube-node-lease"},
                "spec": {"renewTime": f"late-{clock.monotonic()}"}})
            await mon.tick()
        assert api.taints("skewed") == set()
    asyncio.run(main())
