"""Node pools under NodeStatusPolicies, for the operator's scenarios: real agents
labelled into a pool (node credentials, killed by PID), Nodes made by the admin (kept
alive by operators.Renewer), policies, and what the tests read back (taints, the
Ready condition, the heartbeat annotation, Events, a watch on the pool's taints).

The scenarios two test modules run, e2e/test_operator.py with the admin's credentials
and e2e/test_chart_identities.py with the Helm chart's ServiceAccount:
`two_pools_grace_15_and_60` and `ha_failover`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch

from e2e.harness.operators import AGENT, RUN, Operator, OperatorCredentials, Renewer, leader
from e2e.harness.ports import free_port
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually, first_seen
from nodeagent.api.policy import GROUP, HEARTBEAT_ANNOTATION, PLURAL, VERSION
from nodepulse_dev import Cluster

UNREACHABLE = "node.kubernetes.io/unreachable"


# ---- real agents (nodepulse-agent with node credentials)
class Agent:
    def __init__(self, cluster: Cluster, name: str, pool: str, root: Path) -> None:
        self.name, self.port = name, free_port()
        self.log = cluster.log_dir / f"agent-{name}.log"
        argv = [str(AGENT), "--node-name", name,
                "--kubeconfig", str(cluster.node_kubeconfig(name)),
                "--healthz-bind-address", f"127.0.0.1:{self.port}",
                "--root-dir", str(root / name),
                "--node-labels", f"nodepulse-e2e/pool={RUN}-{pool}"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def kill(self) -> None:
        """SIGKILL by PID: the node falls silent at once, as if cut off."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Agents:
    def __init__(self, cluster: Cluster, root: Path) -> None:
        self.cluster, self.root = cluster, root
        self.started: list[Agent] = []

    def start(self, names: list[str], pool: str) -> list[Agent]:
        out = [Agent(self.cluster, n, pool, self.root) for n in names]
        self.started += out
        return out


@pytest.fixture(name="agents")
def agents_fixture(cluster: Cluster, tmp_path: Path) -> Iterator[Agents]:
    a = Agents(cluster, tmp_path)
    yield a
    for agent in a.started:
        agent.kill()


# ---- nodes and policies
def names(pool: str, count: int) -> list[str]:
    return [f"op-{RUN}-{pool}-{i}" for i in range(count)]


def make_nodes(api: client.ApiClient, pool: str, count: int) -> list[str]:
    core = client.CoreV1Api(api)
    names = [f"op-{RUN}-{pool}-{i}" for i in range(count)]
    for n in names:
        core.create_node({"metadata": {"name": n, "labels": {"nodepulse-e2e/pool":
                                                                 f"{RUN}-{pool}"}}})
    return names


def policy(api: client.ApiClient, name: str, pool: str | None, grace: int,
           lease: int = 10, priority: int = 0, heartbeat: dict[str, Any] | None = None,
           **failure: Any) -> str:
    full = f"op-{RUN}-{name}"
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "NodeStatusPolicy",
            "metadata": {"name": full},
            "spec": {"priority": priority,
                     "nodeSelector": {"matchLabels": {"nodepulse-e2e/pool": f"{RUN}-{pool}"}}
                     if pool else {"matchLabels": {"nodepulse-e2e/pool": "nowhere"}},
                     "heartbeat": {"leaseDurationSeconds": lease, **(heartbeat or {})},
                     "failure": {"gracePeriodSeconds": grace, **failure}}}
    client.CustomObjectsApi(api).create_cluster_custom_object(GROUP, VERSION, PLURAL, body)
    return full


def get_policy(api: client.ApiClient, name: str) -> dict[str, Any]:
    return dict(client.CustomObjectsApi(api).get_cluster_custom_object(
        GROUP, VERSION, PLURAL, name))


def condition(p: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (p.get("status") or {}).get("conditions") or []
                 if c["type"] == ctype), {})


def node(api: client.ApiClient, name: str) -> Any:
    return client.CoreV1Api(api).read_node(name)


def effects(api: client.ApiClient, name: str) -> set[str]:
    return {t.effect for t in node(api, name).spec.taints or [] if t.key == UNREACHABLE}


def ready_status(api: client.ApiClient, name: str) -> Any:
    return next((c for c in node(api, name).status.conditions or [] if c.type == "Ready"),
                None)


def heartbeat_or_none(api: client.ApiClient, name: str) -> dict[str, Any]:
    """The annotation, or {} while the Node does not exist yet (its agent registers it)."""
    try:
        return heartbeat(api, name)
    except client.ApiException as e:
        if e.status == 404:
            return {}
        raise


def heartbeat(api: client.ApiClient, name: str) -> dict[str, Any]:
    ann = (node(api, name).metadata.annotations or {}).get(HEARTBEAT_ANNOTATION)
    return dict(json.loads(ann)) if ann else {}


def apiserver_metrics(api: client.ApiClient) -> str:
    """The API server's /metrics (admin credentials)."""
    resp = api.call_api("GET", f"{api.configuration.host}/metrics")
    resp.read()
    return str(resp.data.decode())


# ---- scenarios
def two_pools_grace_15_and_60(kube: client.ApiClient, operators: list[Operator],
                              agents: Agents) -> None:
    """Real agents: two pools under policies with grace 15 s and 60 s; all agents are
    killed; only the 15 s pool is tainted; restarted agents get the taints removed."""
    fast, slow = names("fast", 2), names("slow", 2)
    pf = policy(kube, "fast", "fast", grace=15, lease=10)
    ps = policy(kube, "slow", "slow", grace=60, lease=40)
    running = agents.start(fast, "fast") + agents.start(slow, "slow")
    eventually(lambda: all(
        heartbeat_or_none(kube, n).get("policy") == (pf if n in fast else ps)
        for n in fast + slow), "agents registered and policies written onto their nodes", 60)
    assert heartbeat(kube, fast[0])["renewIntervalSeconds"] == 2  # 10 / 4, from policy.py
    eventually(lambda: all(
        (get_policy(kube, p).get("status") or {}).get("readyNodes") == 2 for p in (pf, ps)),
        "the pools seen ready")
    assert all(effects(kube, n) == set() for n in fast + slow)

    for a in running:  # both pools' agents stop
        a.kill()
    coord = client.CoordinationV1Api(kube)
    renewed = {n: coord.read_namespaced_lease(n, "kube-node-lease").spec.renew_time.timestamp()
               for n in fast}
    tainted_at = first_seen(fast, lambda n: effects(kube, n) == {"NoSchedule", "NoExecute"},
                            "the 15 s pool tainted", 40)
    # Not before its grace period ran out after the last renewal, and not the 60 s pool.
    for n in fast:
        assert tainted_at[n] - renewed[n] >= 15 - 0.2, (n, tainted_at[n] - renewed[n])
    assert all(effects(kube, n) == set() for n in slow)
    ready = ready_status(kube, fast[0])
    assert ready.status == "Unknown" and ready.reason == "NodeStatusUnknown"
    assert pf in ready.message
    status = get_policy(kube, pf)["status"]
    assert (status["nodes"], status["unreachableNodes"]) == (2, 2)
    assert get_policy(kube, ps)["status"]["unreachableNodes"] == 0

    agents.start(fast, "fast")
    agents.start(slow, "slow")  # they come back
    eventually(lambda: all(
        effects(kube, n) == set() for n in fast), "taints removed after renewal", 40)
    eventually(lambda: all(
        ready_status(kube, n).status == "True" for n in fast), "the agents report Ready again", 40)
    assert all(effects(kube, n) == set() for n in slow)


class TaintWatch(threading.Thread):
    """Every version of the Nodes with a label, from a resourceVersion on: per node, the
    list of (monotonic time, taints as (key, effect, timeAdded)) as the watch hands
    them out, so a taint written twice (removed and added again, or rewritten with a
    new timeAdded) shows."""

    def __init__(self, api: client.ApiClient, selector: str) -> None:
        super().__init__(daemon=True, name="taint-watch")
        self.core, self.selector = client.CoreV1Api(api), selector
        self.rv = self.core.list_node(label_selector=selector).metadata.resource_version
        self.seen: dict[str, list[tuple[float, tuple[tuple[str, str, str], ...]]]] = {}
        self.errors: list[str] = []
        self.watch = watch.Watch()
        self.stopping = False

    def run(self) -> None:
        try:
            for ev in self.watch.stream(self.core.list_node, label_selector=self.selector,
                                        resource_version=self.rv, timeout_seconds=300):
                n = ev["object"]
                taints = tuple((t.key, t.effect, str(t.time_added or ""))
                               for t in n.spec.taints or [])
                self.seen.setdefault(n.metadata.name, []).append((time.monotonic(), taints))
            if not self.stopping:
                self.errors.append("the watch ended before the test was done")
        except Exception as e:  # the test reads it; closing the stream on stop() is fine
            if not self.stopping:
                self.errors.append(repr(e))

    def stop(self) -> None:
        self.stopping = True
        self.watch.stop()
        self.join(timeout=10)

    def history(self, name: str) -> list[tuple[tuple[str, str, str], ...]]:
        """The node's distinct taint lists, in order (repeats from other writes folded)."""
        out: list[tuple[tuple[str, str, str], ...]] = []
        for _, taints in self.seen.get(name, []):
            if not out or out[-1] != taints:
                out.append(taints)
        return out

    def first(self, name: str, key: str, effect: str) -> float | None:
        return next((t for t, taints in self.seen.get(name, [])
                     if any(k == key and e == effect for k, e, _ in taints)), None)


def node_events(api: client.ApiClient, name: str) -> list[Any]:
    """The Events on a Node, as `kubectl describe node` finds them; only this Node's
    (its uid): Events outlive a deleted Node of the same name, e.g. the same scenario
    run earlier in the session by e2e/test_chart_identities.py."""
    uid = node(api, name).metadata.uid
    return [e for e in client.CoreV1Api(api).list_event_for_all_namespaces(
        field_selector=f"involvedObject.kind=Node,involvedObject.name={name}").items
        if e.involved_object.uid == uid]


def ha_failover(kube: client.ApiClient, operators: list[Operator],
                renewer: Renewer, operator_credentials: OperatorCredentials) -> None:
    """Run last in a module (issue 9, fault 6): the module's two replicas; the standby
    writes nothing while the leader works; the leader is SIGKILLed (by PID) and a node
    falls silent at the same moment. The standby takes the leader Lease and taints the
    silent node within 60 s. Through the failover a watch on the pool's Nodes shows
    that no node is tainted twice or wrongly: the silent node's unreachable taints are
    added once each and never rewritten; a node the old leader had already tainted
    keeps its taints untouched (same timeAdded, not re-added); the nodes that keep
    renewing never get a taint written at all. (An earlier API server restart, as in
    test_operator.py, may have moved the leadership, so the standby may have written
    earlier, as leader: only its writes as standby count.)"""
    by_id = {o.identity: o for o in operators}
    active = by_id[eventually(lambda: leader(kube, operator_credentials), "a leader")]
    [standby] = [o for o in operators if o is not active]
    eventually(lambda: samples(
        standby.metrics(), "nodepulse_operator_leader") == 0, "the standby knows it")
    assert active.writes() > 0  # every scenario above was a leader's work
    standby_writes = standby.writes()

    silent, healthy1, healthy2, dead = make_nodes(kube, "ha", 4)
    p = policy(kube, "ha", "ha", grace=15, noExecuteTaintsPerMinute=60)
    renewer.start_renewing([silent, healthy1, healthy2])  # `dead` never renews
    eventually(lambda: all(
        heartbeat(kube, n).get("policy") == p for n in (silent, healthy1, healthy2, dead)),
        "leader applies the policy")
    eventually(lambda: effects(kube, dead) == {"NoSchedule", "NoExecute"},
               "the old leader taints the node that never renewed", 40)
    assert all(effects(kube, n) == set() for n in (silent, healthy1, healthy2))
    assert standby.writes() == standby_writes  # none of it the standby's
    assert leader(kube, operator_credentials) == active.identity

    tw = TaintWatch(kube, f"nodepulse-e2e/pool={RUN}-ha")
    tw.start()
    try:
        before = {n: tuple((t.key, t.effect, str(t.time_added or ""))
                           for t in node(kube, n).spec.taints or []) for n in (healthy1,
                                                                            healthy2, dead)}
        active.kill(signal.SIGKILL)
        renewer.set([silent], False)  # and the node falls silent during the failover
        killed = time.monotonic()
        eventually(lambda: leader(kube, operator_credentials) == standby.identity,
                   "standby takes the leader Lease", 60)
        took = time.monotonic() - killed
        assert took < 60
        assert samples(standby.metrics(), "nodepulse_operator_leader") == 1
        eventually(lambda: effects(kube, silent) == {"NoSchedule", "NoExecute"},
                   "the new leader taints the silent node", 60)
        time.sleep(6)  # a few more monitor periods: nothing may be written again
    finally:
        tw.stop()
    assert not tw.errors, tw.errors
    assert standby.writes() > standby_writes
    tainted = tw.first(silent, UNREACHABLE, "NoSchedule")
    assert tainted is not None and tainted - killed < 60

    # The silent node: each unreachable taint appears once, then stays as written.
    hist = tw.history(silent)
    for effect in ("NoSchedule", "NoExecute"):
        having = [i for i, ts in enumerate(hist)
                  if any(k == UNREACHABLE and e == effect for k, e, _ in ts)]
        assert having and having == list(range(having[0], len(hist))), hist
        added = {ta for ts in hist[having[0]:] for k, e, ta in ts
                 if k == UNREACHABLE and e == effect}
        assert len(added) == 1, hist  # never rewritten with a new timeAdded
    # The node tainted before the failover, and the healthy ones: never written.
    for n in (dead, healthy1, healthy2):
        assert tw.history(n) in ([], [before[n]]), (n, tw.history(n))
    assert all(effects(kube, n) == set() for n in (healthy1, healthy2))
    assert effects(kube, dead) == {"NoSchedule", "NoExecute"}

    # The new leader said so on the silent node, once each (kubectl describe node).
    def reasons() -> list[str]:
        return sorted(e.reason for e in node_events(kube, silent)
                      if e.reporting_component == "nodepulse-operator")
    got = eventually(lambda: r if "EvictionStarted" in (r := reasons()) else None,
                     "the new leader's Events on the silent node", 20)
    events = [e for e in node_events(kube, silent)
              if e.reporting_component == "nodepulse-operator"]
    assert all(e.count == 1 and e.reporting_instance == standby.identity for e in events), [
        (e.reason, e.count, e.reporting_instance) for e in events]
    assert got.count("EvictionStarted") == 1 and got.count("NodeStatusUnknown") == 1
    assert got.count("TaintAdded") == 1
    assert all(e.metadata.namespace == "default" for e in events)
    assert not any(e.reporting_component == "nodepulse-operator"
                   for n in (healthy1, healthy2) for e in node_events(kube, n))
    print(f"\nfailover: standby took the leader Lease {took:.1f} s after SIGKILL, "
          f"tainted the silent node {tainted - killed:.1f} s after it")
