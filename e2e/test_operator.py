"""The operator against the real control plane: two replicas for the whole module
(one leads), node pools under policies, Leases renewed with each node's own credentials.

Which scenario uses what:
- real agents (nodepulse-agent, node credentials, killed by PID): two pools 15 s/60 s,
  renew interval change followed by the agents (API server metrics), partition guard;
- an in-test renewer (one thread renewing Leases with node credentials): conflicts and
  deletion, API server restart, HA failover (the operator is what is under test there).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e.harness.operators import (
    RUN,
    Operator,
    OperatorCredentials,
    Renewer,
    admin_operator_credentials,  # noqa: F401 (a fixture)
    kube_fixture,  # noqa: F401 (a fixture)
    kubectl,
    operators_fixture,  # noqa: F401 (a fixture)
    renewer_fixture,  # noqa: F401 (a fixture)
)
from e2e.harness.pools import (
    Agents,
    agents_fixture,  # noqa: F401 (a fixture)
    apiserver_metrics,
    condition,
    effects,
    get_policy,
    ha_failover,
    heartbeat,
    heartbeat_or_none,
    make_nodes,
    names,
    policy,
    ready_status,
    two_pools_grace_15_and_60,
)
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually
from nodeagent.api.policy import GROUP, PLURAL, VERSION
from nodepulse_dev import Cluster


# ---- scenarios
@pytest.mark.parametrize(("spec", "message"), [
    ({"heartbeat": {"leaseDurationSeconds": 20, "renewIntervalSeconds": 20}},
     "spec.heartbeat.renewIntervalSeconds must be less than spec.heartbeat.leaseDurationSeconds"),
    ({"heartbeat": {"leaseDurationSeconds": 60}},
     "spec.failure.gracePeriodSeconds must be at least spec.heartbeat.leaseDurationSeconds"),
    ({"failure": {"maxUnreachableFraction": 2}},
     "spec.failure.maxUnreachableFraction must be between 0 and 1"),
    ({"heartbeat": {"statusUpdateFrequencySeconds": 30, "statusReportFrequencySeconds": 20}},
     "spec.heartbeat.statusReportFrequencySeconds must be at least "
     "spec.heartbeat.statusUpdateFrequencySeconds"),
])
def test_kubectl_apply_of_a_bad_policy_prints_the_cel_message(
        cluster: Cluster, kube: client.ApiClient, spec: dict[str, Any], message: str) -> None:
    doc = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "NodeStatusPolicy",
           "metadata": {"name": f"op-{RUN}-bad"}, "spec": spec}
    out = kubectl(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(doc))
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert "NotFound" in kubectl(cluster, "get", "nsp", f"op-{RUN}-bad").stderr


def test_explain_and_printer_columns(cluster: Cluster, kube: client.ApiClient) -> None:
    out = eventually(lambda: r if (r := kubectl(
        cluster, "explain", "nsp.spec.failure.maxUnreachableFraction")).returncode == 0 else None,
        "kubectl explain")
    assert "Partition guard" in out.stdout
    header = kubectl(cluster, "get", "nsp").stdout.splitlines()
    if header:  # no policies yet prints nothing on stdout
        assert header[0].split() == ["NAME", "SELECTOR", "PRIORITY", "NODES", "READY",
                                     "UNREACHABLE", "EFFECTIVE", "AGE"]


def test_two_pools_grace_15_and_60(kube: client.ApiClient, operators: list[Operator],
                                   agents: Agents) -> None:
    two_pools_grace_15_and_60(kube, operators, agents)


def test_renew_interval_follows_the_policy(cluster: Cluster, kube: client.ApiClient,
                                           operators: list[Operator],
                                           agents: Agents) -> None:
    """Real agents: the policy's renewIntervalSeconds changes and the agents' Lease
    renewals, counted by the API server, follow."""
    nodes = names("rate", 3)
    p = policy(kube, "rate", "rate", grace=30, lease=20, heartbeat={"renewIntervalSeconds": 10})
    running = agents.start(nodes, "rate")
    eventually(lambda: all(
        heartbeat_or_none(kube, n).get("renewIntervalSeconds") == 10 for n in nodes),
        "policy on the nodes", 60)
    eventually(lambda: all(
        samples(a.metrics(), "nodepulse_lease_renewals_total", result="success") >= 1
        for a in running), "every agent renewing", 30)

    def lease_puts(seconds: float) -> float:
        before = samples(apiserver_metrics(kube), "apiserver_request_total",
                         resource="leases", verb="PUT")
        time.sleep(seconds)
        return samples(apiserver_metrics(kube), "apiserver_request_total",
                       resource="leases", verb="PUT") - before

    def renewals() -> list[float]:
        return [samples(a.metrics(), "nodepulse_lease_renewals_total", result="success")
                for a in running]

    slow_puts = lease_puts(20)  # 3 agents every 10 s: about 6 (+ the API server's own)
    client.CustomObjectsApi(kube).patch_cluster_custom_object(
        GROUP, VERSION, PLURAL, p, {"spec": {"heartbeat": {"renewIntervalSeconds": 1}}})
    eventually(lambda: all(
        heartbeat(kube, n)["renewIntervalSeconds"] == 1 for n in nodes), "new interval on the nodes")
    # the agents see their Node change and reschedule: 3 renewals each within 15 s,
    # which the old 10 s interval could not give
    base = renewals()
    eventually(lambda: all(now >= b + 3 for now, b in zip(renewals(), base, strict=True)),
               "every agent renewing at the new interval", 15)
    fast_puts = lease_puts(20)  # 3 agents every second: about 60
    print(f"\nlease PUTs in 20 s: renew interval 10 s -> {slow_puts:.0f}, "
          f"1 s -> {fast_puts:.0f}")
    assert fast_puts >= 4 * slow_puts, (slow_puts, fast_puts)


def test_partition_guard_stops_noexecute(kube: client.ApiClient, operators: list[Operator],
                                         agents: Agents) -> None:
    """Real agents: 3 of a pool's 4 agents killed together with maxUnreachableFraction
    0.5: NoExecute tainting stops for the pool and its status says so."""
    nodes = names("part", 4)
    p = policy(kube, "part", "part", grace=15, maxUnreachableFraction=0.5,
               noExecuteTaintsPerMinute=60)
    running = agents.start(nodes, "part")
    eventually(lambda: (get_policy(kube, p).get("status") or {}).get(
        "readyNodes") == 4, "the pool seen ready", 60)
    for a in running[:3]:
        a.kill()
    eventually(lambda: all(
        "NoSchedule" in effects(kube, n) for n in nodes[:3]), "NoSchedule on the silent three", 40)
    guard = eventually(lambda: (
        c := condition(get_policy(kube, p), "PartitionGuard")).get("status") == "True" and c,
        "PartitionGuard condition")
    assert guard["reason"] == "TooManyUnreachable" and "3 of 4" in guard["message"]
    # The guard trips at more than half (3 of 4). The Leases go stale at their own
    # renewal phases, so the first two silent nodes may have been given their NoExecute
    # (one a second) before the third made it 3 of 4; after that, no more.
    before = sum("NoExecute" in effects(kube, n) for n in nodes[:3])
    assert before <= 2
    time.sleep(4)  # pacing (60/min) alone would have tainted another by now
    assert sum("NoExecute" in effects(kube, n) for n in nodes[:3]) == before
    assert effects(kube, nodes[3]) == set()
    status = get_policy(kube, p)["status"]
    assert (status["nodes"], status["readyNodes"], status["unreachableNodes"]) == (4, 1, 3)
    agents.start(nodes[:3], "part")
    eventually(lambda: condition(get_policy(kube, p), "PartitionGuard").get(
        "status") == "False", "guard lifted", 40)
    eventually(lambda: all(effects(kube, n) == set() for n in nodes), "taints removed", 40)


def test_no_match_conflict_and_deletion(kube: client.ApiClient, operators: list[Operator],
                                        renewer: Renewer) -> None:
    nodes = make_nodes(kube, "mix", 1)
    renewer.start_renewing(nodes)
    none = policy(kube, "none", None, grace=30)
    ready = eventually(lambda: condition(get_policy(kube, none), "Ready"), "no-match status")
    assert ready["status"] == "True" and ready["reason"] == "NoMatchingNodes"
    low = policy(kube, "low", "mix", grace=30, priority=1)
    eventually(lambda: heartbeat(kube, nodes[0]).get("policy") == low, "low applies")
    b = policy(kube, "tie-b", "mix", grace=30, priority=5)
    a = policy(kube, "tie-a", "mix", grace=30, priority=5)
    eventually(lambda: heartbeat(kube, nodes[0]).get("policy") == a, "tie goes to the first name")
    def conflict(name: str) -> dict[str, Any] | None:
        c = condition(get_policy(kube, name), "Conflict")
        return c if c.get("status") == "True" else None

    for name in (a, b):
        c = eventually(functools.partial(conflict, name), f"Conflict on {name}")
        assert nodes[0] in c["message"] and a in c["message"] and b in c["message"]
    custom = client.CustomObjectsApi(kube)
    custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, a)
    eventually(lambda: heartbeat(kube, nodes[0]).get("policy") == b, "next match after deletion")
    eventually(lambda: condition(get_policy(kube, b), "Conflict").get(
        "status") == "False", "conflict cleared")
    custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, b)
    eventually(lambda: heartbeat(kube, nodes[0]).get("policy") == low, "lower priority after deletion")
    custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, low)
    eventually(lambda: heartbeat(kube, nodes[0]) == {
        "policy": "", "leaseDurationSeconds": 40, "renewIntervalSeconds": 10,
        "statusUpdateFrequencySeconds": 10, "statusReportFrequencySeconds": 300,
        "maxImagesInStatus": 50}, "defaults when nothing matches")


def test_apiserver_restart(cluster: Cluster, kube: client.ApiClient,
                           operators: list[Operator], renewer: Renewer) -> None:
    """The API server goes away and comes back: the operator's watches and writes
    recover; a node that kept renewing is never judged stale for the renewals the
    outage swallowed, one that stopped around the outage is tainted afterwards, and
    one already unreachable before it keeps its taints throughout."""
    live, silent, dead = make_nodes(kube, "restart", 3)
    p = policy(kube, "restart", "restart", grace=15)
    renewer.start_renewing([live, silent])
    eventually(lambda: effects(kube, dead) == {
        "NoSchedule", "NoExecute"}, "dead node tainted first", 40)
    assert heartbeat(kube, live)["policy"] == p
    renewer.set([silent], False)
    cluster.restart_apiserver()
    lost: list[str] = []

    def silent_tainted() -> bool:
        if effects(kube, dead) != {"NoSchedule", "NoExecute"}:
            lost.append(dead)
        return effects(kube, silent) == {"NoSchedule", "NoExecute"}
    eventually(silent_tainted, "the node silent since the restart tainted", 60)
    assert not lost, "the already unreachable node lost its taints across the outage"
    # Never marked: `live` had no Ready condition, and Unknown would have stayed.
    assert ready_status(kube, live) is None and effects(kube, live) == set()
    renewer.errors.clear()  # renewals refused while the API server was down


def test_ha_failover(kube: client.ApiClient, operators: list[Operator],
                     renewer: Renewer, operator_credentials: OperatorCredentials) -> None:
    ha_failover(kube, operators, renewer, operator_credentials)
