"""The monitor against a fake API server: staleness arithmetic on a fake clock,
conditions and taints, pacing, the partition guard, policy status, and writing only
when something changed. No test sleeps."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from nodeoperator.monitor import Monitor, Pacer
from prometheus_client import REGISTRY

from nodeagent.api.clock import FakeClock
from nodeagent.api.policy import HEARTBEAT_ANNOTATION, Heartbeat, encode_heartbeat_annotation
from tests.fakeoperator import ALONE, Env, post_ready, run, spec, step


def test_pacer_token_bucket() -> None:
    clock = FakeClock()
    p = Pacer(clock)
    assert p.take("a", 6) and not p.take("a", 6)  # burst of one
    assert p.take("b", 6)  # buckets are per policy
    clock._t = 9.9
    assert not p.take("a", 6)
    clock._t = 10.0
    assert p.take("a", 6)
    assert not p.take("c", 0)  # rate 0: never
    # A rate above one per period may spend a period's worth at once.
    assert sum(p.take("fast", 600) for _ in range(50)) == 20
    p.refund("fast")
    assert p.take("fast", 600) and not p.take("fast", 600)


def test_stale_lease_gets_unknown_and_taints_then_renewal_removes_them() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("fast", spec(grace=15, sel={"matchLabels": {"pool": "fast"}}))
        api.add_node("n1", {"pool": "fast"})
        api.renew("n1")
        await mon.tick()
        assert api.taints("n1") == set()
        await step(clock, mon, 15)  # exactly the grace period: not yet stale
        assert api.taints("n1") == set() and api.ready("n1")["status"] == "True"
        await step(clock, mon, 0.5)
        assert api.taints("n1") == {"NoSchedule", "NoExecute"}
        ready = api.ready("n1")
        assert ready["status"] == "Unknown" and ready["reason"] == "NodeStatusUnknown"
        assert "15s" in ready["message"] and "policy fast" in ready["message"]
        assert ready["lastHeartbeatTime"] == "2026-01-01T00:00:00Z"  # kept as posted
        mem = next(c for c in api.nodes["n1"]["status"]["conditions"]
                   if c["type"] == "MemoryPressure")
        assert mem["status"] == "Unknown"
        noexec = next(t for t in api.nodes["n1"]["spec"]["taints"] if t["effect"] == "NoExecute")
        assert noexec["timeAdded"] == "2026-01-01T00:00:15Z"
        writes = len(api.writes)
        await step(clock, mon, 2)
        await step(clock, mon, 2)
        assert len(api.writes) == writes  # nothing changed, nothing written
        api.renew("n1")
        assert store.changed.is_set()  # a stale node's renewal wakes the monitor
        await mon.tick()
        assert api.taints("n1") == set()
    run(t)


def periods() -> float:
    """Monitor periods run so far, in this process (the tick histogram's count)."""
    return REGISTRY.get_sample_value("nodepulse_operator_monitor_tick_seconds_count") or 0.0


def test_the_loop_runs_when_a_grace_runs_out_not_a_period_later() -> None:
    """With a 2 s period, a node whose grace runs out at 15.7 s is judged at 15.75 s,
    not at 16 s; nodes that renew wake nothing early."""
    async def t(env: Env) -> None:
        clock, store, api, _ = env
        mon = Monitor(store, clock, api, lifecycle=ALONE, period=2)
        api.add_policy("p", spec(grace=15))
        for n in ("n1", "n2"):
            api.add_node(n)
        task = asyncio.create_task(mon.run())
        await clock.advance(0.7)
        api.renew("n1")
        api.renew("n2")
        ticks = periods()
        for _ in range(15):  # n2 keeps renewing; n1 falls silent
            await clock.advance(1)
            api.renew("n2")
        assert periods() - ticks <= 8  # the period, no more (7 or 8 by phase)
        assert mon.next_stale == pytest.approx(15.7)
        await clock.advance(15.7 - clock.monotonic())
        assert api.taints("n1") == set()
        await clock.advance(0.05)
        assert api.taints("n1") == {"NoSchedule", "NoExecute"} and api.taints("n2") == set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    run(t)


def test_two_pools_different_grace() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("fast", spec(grace=15, sel={"matchLabels": {"pool": "fast"}}))
        api.add_policy("slow", spec(grace=60, lease=40, sel={"matchLabels": {"pool": "slow"}}))
        for n, pool in [("f1", "fast"), ("s1", "slow"), ("d1", "other")]:
            api.add_node(n, {"pool": pool})
            api.renew(n)
        await step(clock, mon, 20)
        assert api.taints("f1") == {"NoSchedule", "NoExecute"}
        assert api.taints("s1") == set() and api.taints("d1") == set()
        await step(clock, mon, 31)  # 51 s: past the default 50 s grace
        assert api.taints("d1") == {"NoSchedule", "NoExecute"} and api.taints("s1") == set()
        await step(clock, mon, 10)
        assert api.taints("s1") == {"NoSchedule", "NoExecute"}
        assert "the default policy" in api.ready("d1")["message"]
    run(t)


def test_node_that_never_had_a_lease() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_node("n1", ready=None)  # never posted status either
        await step(clock, mon, 50)
        assert api.taints("n1") == set()
        await step(clock, mon, 1)
        assert api.taints("n1") == {"NoSchedule", "NoExecute"}
        ready = api.ready("n1")
        assert ready["status"] == "Unknown" and "no Lease" in ready["message"]
        assert [c["type"] for c in api.nodes["n1"]["status"]["conditions"]] == ["Ready"]
    run(t)


def test_taint_unreachable_false_only_noschedule_and_other_taints_kept() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("p", spec(grace=15, taintUnreachable=False))
        api.add_node("n1")
        api.nodes["n1"]["spec"]["taints"] = [{"key": "dedicated", "effect": "NoSchedule"}]
        api.deliver()
        await step(clock, mon, 16)
        assert api.taints("n1") == {"NoSchedule"}
        assert {"key": "dedicated", "effect": "NoSchedule"} in api.nodes["n1"]["spec"]["taints"]
        api.renew("n1")
        await mon.tick()
        assert api.nodes["n1"]["spec"]["taints"] == [{"key": "dedicated", "effect": "NoSchedule"}]
    run(t)


def test_a_marked_node_is_left_alone_until_its_policy_or_it_changes() -> None:
    """A period skips a node whose action's inputs did not change since it needed
    nothing; a policy change that keeps the annotation but not the NoExecute still
    reaches the node."""
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("p", spec(grace=15))
        api.add_node("n1")
        await step(clock, mon, 16)
        assert api.taints("n1") == {"NoSchedule", "NoExecute"}
        writes = len(api.writes)
        for _ in range(5):
            await step(clock, mon, 2)
        assert len(api.writes) == writes
        api.add_policy("p", spec(grace=15, taintUnreachable=False), generation=2)
        await step(clock, mon, 2)
        assert api.taints("n1") == {"NoSchedule"}
    run(t)


def test_noexecute_is_paced_per_policy() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("p", spec(grace=15, noExecuteTaintsPerMinute=6,
                                 maxUnreachableFraction=1))
        for i in range(3):
            api.add_node(f"n{i}")
        await step(clock, mon, 16)
        # All three are unreachable at once; one NoExecute now, then one per 10 s.
        assert all(api.taints(f"n{i}") >= {"NoSchedule"} for i in range(3))
        assert sum("NoExecute" in api.taints(f"n{i}") for i in range(3)) == 1
        await step(clock, mon, 9)
        assert sum("NoExecute" in api.taints(f"n{i}") for i in range(3)) == 1
        await step(clock, mon, 1)
        assert sum("NoExecute" in api.taints(f"n{i}") for i in range(3)) == 2
        await step(clock, mon, 10)
        assert sum("NoExecute" in api.taints(f"n{i}") for i in range(3)) == 3
    run(t)


def test_partition_guard_stops_noexecute_and_status_says_so() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("pool", spec(grace=15, maxUnreachableFraction=0.5,
                                    noExecuteTaintsPerMinute=600))
        for i in range(4):
            api.add_node(f"n{i}")
            api.renew(f"n{i}")
        await step(clock, mon, 5)
        assert api.condition("pool", "PartitionGuard")["status"] == "False"
        await step(clock, mon, 5)
        api.renew("n3")  # n3 keeps renewing; n0..n2 fall silent at once
        await step(clock, mon, 11)
        await step(clock, mon, 2)
        assert all(api.taints(f"n{i}") == {"NoSchedule"} for i in range(3))  # no NoExecute
        assert api.taints("n3") == set()
        guard = api.condition("pool", "PartitionGuard")
        assert guard["status"] == "True" and guard["reason"] == "TooManyUnreachable"
        assert "3 of 4" in guard["message"]
        status = api.policies["pool"]["status"]
        assert (status["nodes"], status["readyNodes"], status["unreachableNodes"]) == (4, 1, 3)
        assert policy_metrics("pool") == {"governed": 4, "ready": 1, "unreachable": 3,
                                          "guard": 1}
        # Two come back: 1 of 4 stale is within 0.5, NoExecute resumes for the last one.
        api.renew("n0")
        api.renew("n1")
        await step(clock, mon, 1)
        assert api.condition("pool", "PartitionGuard")["status"] == "False"
        assert api.taints("n2") == {"NoSchedule", "NoExecute"}
        assert api.taints("n0") == set()
        assert policy_metrics("pool") == {"governed": 4, "ready": 3, "unreachable": 1,
                                          "guard": 0}
        # a deleted policy's series go with it
        api.delete_policy("pool")
        await step(clock, mon, 1)
        assert policy_metrics("pool") == {}
    run(t)


def policy_metrics(policy: str) -> dict[str, float]:
    """The policy's series on /metrics: node counts by state, and its guard."""
    found = {state: REGISTRY.get_sample_value("nodepulse_operator_policy_nodes",
                                              {"policy": policy, "state": state})
             for state in ("governed", "ready", "unreachable")}
    found["guard"] = REGISTRY.get_sample_value("nodepulse_operator_policy_partition_guard",
                                               {"policy": policy})
    return {k: v for k, v in found.items() if v is not None}


def test_guard_boundary_is_strictly_more_than_the_fraction() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("pool", spec(grace=15, maxUnreachableFraction=0.5,
                                    noExecuteTaintsPerMinute=600))
        for i in range(6):
            api.add_node(f"n{i}")
        await step(clock, mon, 10)
        for i in range(3, 6):
            api.renew(f"n{i}")
        await step(clock, mon, 6)  # n0..n2 stale: 3 of 6 is not more than 0.5
        await step(clock, mon, 1)  # 600/min: the rest follow within the second
        assert all(api.taints(f"n{i}") == {"NoSchedule", "NoExecute"} for i in range(3))
        assert api.condition("pool", "PartitionGuard")["status"] == "False"
    run(t)


def test_guard_needs_three_stale_nodes() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("pool", spec(grace=15, maxUnreachableFraction=0.1))
        api.add_node("n0")
        api.add_node("n1")
        await step(clock, mon, 16)  # a whole two-node pool silent: still evicted
        assert api.condition("pool", "PartitionGuard")["status"] == "False"
        assert "NoExecute" in api.taints("n0") | api.taints("n1")
    run(t)


def test_annotation_follows_policy_changes_and_deletion() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_node("n1", {"pool": "edge"})
        await mon.tick()
        default = encode_heartbeat_annotation(None, Heartbeat())
        assert api.nodes["n1"]["metadata"]["annotations"][HEARTBEAT_ANNOTATION] == default
        api.add_policy("edge", spec(grace=60, lease=20, sel={"matchLabels": {"pool": "edge"}}))
        await mon.tick()
        ann = json.loads(api.nodes["n1"]["metadata"]["annotations"][HEARTBEAT_ANNOTATION])
        assert ann["policy"] == "edge" and ann["renewIntervalSeconds"] == 5
        # Update: renew interval changes, the annotation follows.
        new = spec(grace=60, lease=20, sel={"matchLabels": {"pool": "edge"}})
        new["heartbeat"]["renewIntervalSeconds"] = 2
        api.add_policy("edge", new, generation=2)
        await mon.tick()
        ann = json.loads(api.nodes["n1"]["metadata"]["annotations"][HEARTBEAT_ANNOTATION])
        assert ann["renewIntervalSeconds"] == 2
        assert api.policies["edge"]["status"]["observedGeneration"] == 2
        # A higher-priority policy takes the node, deleting it hands it back.
        api.add_policy("vip", spec(grace=30, lease=30, priority=5))
        await mon.tick()
        assert '"policy":"vip"' in api.nodes["n1"]["metadata"]["annotations"][HEARTBEAT_ANNOTATION]
        api.delete_policy("vip")
        await mon.tick()
        assert '"policy":"edge"' in api.nodes["n1"]["metadata"]["annotations"][HEARTBEAT_ANNOTATION]
        api.delete_policy("edge")
        await mon.tick()
        assert api.nodes["n1"]["metadata"]["annotations"][HEARTBEAT_ANNOTATION] == default
        # Label change moves the node.
        api.add_policy("core", spec(sel={"matchLabels": {"pool": "core"}}))
        api.nodes["n1"]["metadata"]["labels"] = {"pool": "core"}
        api.deliver()
        await mon.tick()
        assert '"policy":"core"' in api.nodes["n1"]["metadata"]["annotations"][HEARTBEAT_ANNOTATION]
        writes = len(api.writes)
        await mon.tick()
        assert len(api.writes) == writes
    run(t)


def test_no_rewrite_before_the_watch_shows_our_write() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.auto_deliver = False
        api.add_node("n1")
        await step(clock, mon, 51)
        assert [w[0] for w in api.writes] == ["node", "node_status"]
        await step(clock, mon, 2)  # the index still shows the old node
        assert len(api.writes) == 2
        api.deliver()
        await step(clock, mon, 2)
        assert len(api.writes) == 2
    run(t)


def test_conflict_is_retried_on_top_of_the_new_version() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_node("n1")
        await mon.tick()
        # Someone else adds a taint; our index has not seen it yet.
        api.nodes["n1"]["spec"]["taints"] = [{"key": "other", "effect": "NoSchedule"}]
        api._bump(api.nodes["n1"])
        await step(clock, mon, 51)
        assert api.taints("n1") == set()  # 409: nothing overwritten
        api.deliver()
        await mon.tick()
        assert api.taints("n1") == {"NoSchedule", "NoExecute"}
        assert {"key": "other", "effect": "NoSchedule"} in api.nodes["n1"]["spec"]["taints"]
    run(t)


def test_policy_status_counts_conflict_and_no_match() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("a", spec(sel={"matchLabels": {"pool": "x"}}, priority=3))
        api.add_policy("b", spec(sel={"matchLabels": {"pool": "x"}}, priority=3))
        api.add_policy("none", spec(sel={"matchLabels": {"pool": "nowhere"}}))
        api.add_node("n1", {"pool": "x"})
        await mon.tick()
        for name in ("a", "b"):
            c = api.condition(name, "Conflict")
            assert c["status"] == "True" and "a, b" in c["message"] and "n1" in c["message"]
        assert api.policies["a"]["status"]["nodes"] == 1
        assert api.policies["b"]["status"]["nodes"] == 0
        ready = api.condition("none", "Ready")
        assert ready["status"] == "True" and ready["reason"] == "NoMatchingNodes"
        assert api.policies["none"]["status"]["selector"] == "pool=nowhere"
        since = api.condition("none", "Ready")["lastTransitionTime"]
        writes = len(api.writes)
        await step(clock, mon, 2)
        assert len(api.writes) == writes  # unchanged status is not rewritten
        api.delete_policy("b")
        await step(clock, mon, 2)
        assert api.condition("a", "Conflict")["status"] == "False"
        assert api.condition("none", "Ready")["lastTransitionTime"] == since
    run(t)


def test_invalid_policy_status() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("bad", {"failure": {"gracePeriodSeconds": 5}})
        await mon.tick()
        ready = api.condition("bad", "Ready")
        assert ready["status"] == "False" and "gracePeriodSeconds" in ready["message"]
    run(t)


def test_not_leader_writes_nothing_and_run_loop_wakes_on_change() -> None:
    async def t(env: Env) -> None:
        clock, store, api, _ = env
        leading = False
        mon = Monitor(store, clock, api, lifecycle=ALONE, period=2, is_leader=lambda: leading)
        task = asyncio.create_task(mon.run())
        api.add_node("n1")
        await clock.advance(60)
        assert api.writes == []
        leading = True
        await clock.advance(2)
        assert api.taints("n1") == {"NoSchedule", "NoExecute"}
        await clock.advance(0.5)  # well within the 2 s period
        api.add_policy("p", spec())  # wakes the loop at once, no time passes
        from nodeagent.api.clock import settle
        await settle()
        assert "conditions" in api.policies["p"]["status"]
        # Changes that follow at once are decided together, at most one period per
        # MIN_GAP (0.2 s): a burst of Node updates costs a few periods, not one each.
        api.add_policy("q", spec())
        await settle()
        assert "q" not in {w[1] for w in api.writes}
        await clock.advance(0.2)
        assert "conditions" in api.policies["q"]["status"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    run(t)


def test_silence_during_an_api_outage_is_not_counted() -> None:
    async def t(env: Env) -> None:
        clock, store, api, _ = env
        since: list[float | None] = [0.0]
        mon = Monitor(store, clock, api, lifecycle=ALONE, period=2, api_ok_since=lambda: since[0])
        api.add_policy("p", spec(grace=15))
        api.add_node("n1")
        api.add_node("n2")
        api.add_node("dead")  # silent from the start
        await step(clock, mon, 5)
        api.renew("n1")
        api.renew("n2")
        await step(clock, mon, 11)
        assert api.taints("dead") == {"NoSchedule", "NoExecute"}
        api.renew("n1")
        api.renew("n2")
        await step(clock, mon, 10)
        since[0] = None  # the API server goes away: renewals cannot arrive
        await step(clock, mon, 10)
        assert api.taints("n1") == set()  # 20 s of silence, but we were deaf
        assert api.taints("dead") == {"NoSchedule", "NoExecute"}  # still unreachable
        since[0] = clock.monotonic()  # back
        api.renew("n2")  # n2's agent renews at once; n1's is really gone
        await step(clock, mon, 14)
        assert api.taints("n1") == set()  # a full grace period from the API's return
        assert api.taints("dead") == {"NoSchedule", "NoExecute"}  # never lifted
        api.renew("n2")
        await step(clock, mon, 2)
        assert api.taints("n1") == {"NoSchedule", "NoExecute"}
        assert api.taints("n2") == set()
    run(t)


def test_an_agent_status_post_counts_as_a_sign_of_life() -> None:
    """A restarted agent may post Ready=True before its Lease renewal reaches us: it
    must not be marked Unknown over it (it would not post again for minutes)."""
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("p", spec(grace=15))
        api.add_node("n1")
        api.renew("n1")
        await step(clock, mon, 16)
        assert api.ready("n1")["status"] == "Unknown"
        assert api.taints("n1") == {"NoSchedule", "NoExecute"}
        post_ready(api, "n1")  # the Lease renewal is still on its way
        assert store.changed.is_set()
        await mon.tick()
        assert api.ready("n1")["status"] == "True"  # not overwritten
        assert api.taints("n1") == set()
        await step(clock, mon, 10)
        assert api.ready("n1")["status"] == "True"
        await step(clock, mon, 6)  # 16 s without a post or a renewal: stale again
        assert api.ready("n1")["status"] == "Unknown"
        # Our own Unknown write (lastHeartbeatTime kept) is no sign of life.
        await step(clock, mon, 2)
        assert api.taints("n1") == {"NoSchedule", "NoExecute"}
    run(t)


def test_unknown_is_not_written_over_a_status_posted_meanwhile() -> None:
    async def t(env: Env) -> None:
        clock, store, api, mon = env
        api.add_policy("p", spec(grace=15))
        api.add_node("n1")
        api.renew("n1")
        await clock.advance(16)
        # The agent posts after the index was read but before our status write.
        real = api.patch_node

        async def agent_posts_first(name: str, patch: dict[str, Any]) -> str:
            rv = await real(name, patch)
            post_ready(api, name, deliver=False)
            return rv
        api.patch_node = agent_posts_first  # type: ignore[method-assign]
        await mon.tick()
        assert api.ready("n1")["status"] == "True"  # 409: the agent's post stands
        assert [w[0] for w in api.writes if w[0] != "policy_status"] == ["node"]
    run(t)
