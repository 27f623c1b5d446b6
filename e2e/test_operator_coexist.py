"""The operator in coexist mode, beside the controller manager's node-lifecycle
controller, on the real control plane.

This module starts the second configuration of nodepulse_dev for itself (and stops it
at the end): every default controller of kube-controller-manager runs, the
node-lifecycle one with --node-monitor-grace-period=20s (50 s by default) so that the
scenarios stay short, and the API server's audit log has every Node write with the
Node as written. Two operator replicas run with --node-lifecycle=coexist and the same
20 s; the nodes are made here and kept alive by an in-test kubelet (each node's own
credentials: it renews its Lease every second and posts Ready=True when it comes back).

Policies: `strict` (grace 8 s, shorter than the cluster's) and `lax` (grace 40 s).
Over a three-minute window strict, lax and healthy nodes fall silent and come back on
a fixed schedule, and the leading operator is SIGKILLed halfway. The audit log then
shows, per Node, every write with who made it and the taints and Ready it left:
- no unreachable taint is added while Ready is not Unknown, none is removed while Ready
  is not True, and within one silence each is added once and never removed: nothing
  is removed and put back;
- each silence of a strict node is marked (Ready=Unknown) by the operator, and the
  controller manager, whose grace runs out later, never writes its status: it agrees;
- each silence of a lax node is marked by the controller manager and the operator
  writes nothing to a lax node at all;
- the operator that takes over knows the NoExecute taint its predecessor added (the
  record on the Node) and only that one: it clears it when that node is back and
  writes nothing to the lax nodes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e import conftest
from e2e.harness import operators as op
from e2e.harness import pools as nodepools
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually
from nodeagent.api.policy import GROUP, HEARTBEAT_ANNOTATION, PLURAL
from nodepulse_dev import LocalCluster

GRACE = 20  # the controller manager's --node-monitor-grace-period here
UNREACHABLE = nodepools.UNREACHABLE
OWNED = "nodepulse.dev/owned-taints"
CM_USER = "system:serviceaccount:kube-system:node-controller"
# Each node's silences, (from, to) in seconds of the window: at most 3 of the 7 nodes
# at once, so the controller manager's zone stays Normal (it stops evicting above
# 55 %, and takes every NoExecute off when all nodes are down), and at most 2 of the 4
# strict ones marked at once (their partition guard stays off). No strict silence
# starts while there is no leader (KILL_AT up to about 17 s later).
WINDOW = 180
KILL_AT = 60
SILENCES = {
    "strict-0": [(5, 25), (40, 55), (100, 125), (150, 170)],
    "strict-1": [(15, 45), (110, 135)],
    "strict-2": [(40, 110)],  # marked before the kill, back after the takeover
    "lax-0": [(0, 40), (70, 105), (130, 165)],
    "strict-3": [], "lax-1": [], "lax-2": [],  # healthy throughout
}


@pytest.fixture(scope="module")
def coexist_cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """The second configuration of the local control plane, for this module only."""
    c = LocalCluster(node_grace=GRACE)
    conftest._clusters.append(c)  # a failing test shows its components' logs
    failed = request.session.testsfailed
    try:
        c.up()
        yield c
    finally:
        c.down()
        conftest._clusters.remove(c)
        if request.session.testsfailed > failed:
            print(f"\nthe coexist control plane's state and logs are kept in {c.workdir}")
        else:
            c.remove()


@pytest.fixture(scope="module")
def kube(coexist_cluster: LocalCluster) -> client.ApiClient:
    kubectl = str(coexist_cluster.binary("kubectl"))
    cfg = ["--kubeconfig", str(coexist_cluster.kubeconfig)]
    subprocess.run([kubectl, *cfg, "apply", "-f", str(op.CRDS)], check=True, capture_output=True)
    subprocess.run([kubectl, *cfg, "wait", "--for=condition=Established", "--timeout=60s",
                    f"crd/{PLURAL}.{GROUP}"], check=True, capture_output=True)
    return coexist_cluster.api_client()


@pytest.fixture(scope="module")
def creds(coexist_cluster: LocalCluster) -> op.OperatorCredentials:
    return op.OperatorCredentials(coexist_cluster.kubeconfig, "kube-system", op.ELECTION)


@pytest.fixture(scope="module")
def operators(coexist_cluster: LocalCluster, kube: client.ApiClient,
              creds: op.OperatorCredentials) -> Iterator[list[op.Operator]]:
    ops = [op.Operator(coexist_cluster, f"co-{op.RUN}-{x}", creds) for x in "ab"]
    try:
        eventually(lambda: all(o.ready() for o in ops), "both operators ready", 60)
        eventually(lambda: op.leader(kube, creds) in {o.identity for o in ops}, "a leader", 30)
        yield ops
    finally:
        for o in ops:
            o.kill(signal.SIGTERM)


class Kubelets(op.Renewer):
    """Renews the Lease of every node in `active` once a second with that node's
    credentials and, when a node becomes active (first, and after a silence), posts
    Ready=True for it, as a kubelet does on its next status update."""

    def __init__(self, cluster: LocalCluster) -> None:
        super().__init__(cluster)
        self.back: set[str] = set()  # to post Ready=True for after their next renewal

    def set(self, nodes: Any, on: bool) -> None:
        with self.lock:
            if on:
                self.back.update(set(nodes) - self.active)
        super().set(nodes, on)

    def post_ready(self, node: str) -> None:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        client.CoreV1Api(self._api(node).api_client).patch_node_status(node, {"status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "e2e kubelet", "lastHeartbeatTime": now,
                            "lastTransitionTime": now}]}})

    def run(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                nodes, back = sorted(self.active), set(self.back) & self.active
                self.back -= back
            for n in nodes:
                try:
                    self.renew(n)
                    if n in back:
                        self.post_ready(n)
                except Exception as e:  # noted, and the test that needs it fails
                    self.errors.append(f"{n}: {e}")
            self.stopping.wait(1.0)


@pytest.fixture(scope="module")
def kubelets(coexist_cluster: LocalCluster) -> Iterator[Kubelets]:
    k = Kubelets(coexist_cluster)
    k.start()
    yield k
    k.stopping.set()
    k.join(timeout=10)


@pytest.fixture(scope="module")
def pools(kube: client.ApiClient, operators: list[op.Operator],
          kubelets: Kubelets) -> dict[str, str]:
    """The two policies and seven nodes, all Ready, with their heartbeat annotation
    and no taint; policy name by pool."""
    names = {pool: nodepools.policy(kube, pool, pool, grace=grace, lease=lease,
                             noExecuteTaintsPerMinute=60)
             for pool, grace, lease in (("strict", 8, 5), ("lax", 40, 10))}
    nodes = [n for pool in names for n in nodepools.make_nodes(kube, pool, 3 if pool == "lax" else 4)]
    assert sorted(short(n) for n in nodes) == sorted(SILENCES)
    kubelets.start_renewing(nodes)

    def settled(n: str) -> bool:
        node = nodepools.node(kube, n)
        ready = nodepools.ready_status(kube, n)
        policy = json.loads((node.metadata.annotations or {}).get(
            HEARTBEAT_ANNOTATION, "{}")).get("policy")
        return (ready is not None and ready.status == "True" and not node.spec.taints
                and policy == names[short(n).split("-")[0]])
    eventually(lambda: all(settled(n) for n in nodes),
               "every node Ready, untainted (admission's not-ready taken off by the "
               "controller manager) and given its policy by the operator", 60)
    return names


def short(node: str) -> str:
    """op-<run>-strict-0 -> strict-0"""
    return node.split("-", 2)[2]


def full(name: str) -> str:
    return f"op-{op.RUN}-{name}"


def effective(kube: client.ApiClient, policy: str) -> dict[str, Any]:
    return nodepools.condition(nodepools.get_policy(kube, policy), "Effective")


def test_a_policy_says_what_the_controller_manager_overrides(
        coexist_cluster: LocalCluster, kube: client.ApiClient, operators: list[op.Operator],
        pools: dict[str, str]) -> None:
    strict, lax = pools["strict"], pools["lax"]
    got = eventually(lambda: (c := effective(kube, lax)).get("status") == "False" and c,
                     "Effective=False on the lax policy")
    assert got["reason"] == "OverriddenByControllerManager"
    assert "spec.failure.gracePeriodSeconds is 40s" in got["message"]
    assert f"({GRACE}s)" in got["message"]
    ok = effective(kube, strict)
    assert (ok["status"], ok["reason"]) == ("True", "StricterThanCluster")
    assert nodepools.get_policy(kube, strict)["status"]["nodeLifecycle"] == "coexist"
    # kubectl describe nsp: the Warning, once
    def warnings() -> list[Any]:
        return [e for e in client.CoreV1Api(kube).list_namespaced_event(
            "default", field_selector=f"involvedObject.name={lax}").items
            if e.involved_object.kind == "NodeStatusPolicy"]
    [warning] = eventually(warnings, "the Warning Event on the lax policy", 20)
    assert (warning.type, warning.reason, warning.count) == (
        "Warning", "OverriddenByControllerManager", 1)
    assert warning.message == got["message"]
    assert warning.source.component == "nodepulse-operator"
    # kubectl get nsp: the column
    out = op.kubectl(coexist_cluster, "get", "nsp", strict, lax)
    header, *rows = out.stdout.strip().splitlines()
    col = header.split().index("EFFECTIVE")
    assert {r.split()[0]: r.split()[col] for r in rows} == {strict: "True", lax: "False"}
    # the mode on /metrics and in the log
    for o in operators:
        assert samples(o.metrics(), "nodepulse_operator_node_lifecycle_info", mode="coexist") == 1
        assert samples(o.metrics(), "nodepulse_operator_cluster_grace_period_seconds") == GRACE
        assert (f"node lifecycle coexist (the controller manager's grace {GRACE}s)"
                in Path(o.log).read_text(errors="replace"))


@dataclasses.dataclass(frozen=True)
class Write:
    """One write to a Node, from the audit log, and the Node it left."""

    rv: int
    at: float  # epoch seconds the API server received it
    who: str  # operator | controller-manager | kubelet | admin
    status: bool  # nodes/status
    effects: frozenset[str]  # of the unreachable taints
    ready: str | None
    message: str  # of Ready
    owned: str | None  # the operator's record


def node_writes(cluster: LocalCluster, names: list[str]) -> dict[str, list[Write]]:
    out: dict[str, list[Write]] = {n: [] for n in names}
    for e in cluster.audit_events():
        ref = e.get("objectRef") or {}
        if (ref.get("resource") != "nodes" or ref.get("name") not in out
                or e.get("stage") != "ResponseComplete"
                or (e.get("responseStatus") or {}).get("code", 500) >= 300
                or e.get("verb") not in ("create", "update", "patch")):
            continue
        body = e.get("responseObject") or {}
        user = e["user"]["username"]
        who = ("operator" if "/operator" in e.get("userAgent", "") else
               "controller-manager" if user == CM_USER else
               "kubelet" if user.startswith("system:node:") else "admin")
        ready: dict[str, Any] = next((c for c in (body.get("status") or {}).get(
            "conditions") or [] if c["type"] == "Ready"), {})
        out[ref["name"]].append(Write(
            rv=int(body["metadata"]["resourceVersion"]),
            at=dt.datetime.fromisoformat(e["requestReceivedTimestamp"]).timestamp(),
            who=who, status=ref.get("subresource") == "status",
            effects=frozenset(t["effect"] for t in (body.get("spec") or {}).get("taints") or []
                              if t["key"] == UNREACHABLE),
            ready=ready.get("status"), message=ready.get("message", ""),
            owned=(body["metadata"].get("annotations") or {}).get(OWNED)))
    for writes in out.values():
        writes.sort(key=lambda w: w.rv)
    return out


def silences(writes: list[Write]) -> list[list[Write]]:
    """The node's writes split into its silences: each run of writes that left Ready
    Unknown, with the write before it (which marked it)."""
    runs: list[list[Write]] = []
    for prev, w in zip(writes, writes[1:], strict=False):
        if w.ready == "Unknown":
            if prev.ready != "Unknown":
                runs.append([prev])
            runs[-1].append(w)
    return runs


def show(writes: list[Write], since: float) -> str:
    return "\n".join(f"  {w.at - since:7.1f}s rv {w.rv} {w.who}{' status' if w.status else ''}: "
                     f"Ready {w.ready}, unreachable {sorted(w.effects)}, owned {w.owned}"
                     for w in writes)


def test_three_minutes_beside_the_node_lifecycle_controller(
        coexist_cluster: LocalCluster, kube: client.ApiClient, operators: list[op.Operator],
        kubelets: Kubelets, creds: op.OperatorCredentials, pools: dict[str, str]) -> None:
    nodes = {name: full(name) for name in SILENCES}
    by_id = {o.identity: o for o in operators}
    leader = by_id[eventually(lambda: op.leader(kube, creds), "a leader")]
    [standby] = [o for o in operators if o is not leader]
    start = time.time()
    killed = took = 0.0
    for sec in range(WINDOW):
        time.sleep(max(0.0, start + sec - time.time()))
        for name, spans in SILENCES.items():
            kubelets.set([nodes[name]], not any(a <= sec < b for a, b in spans))
        if sec == KILL_AT:
            leader.kill(signal.SIGKILL)
            killed = time.time()
        if killed and not took and op.leader(kube, creds) == standby.identity:
            took = time.time()
    assert not kubelets.errors, kubelets.errors[:5]
    kubelets.set(nodes.values(), True)
    eventually(lambda: all(nodepools.effects(kube, n) == set() and not (
        nodepools.node(kube, n).metadata.annotations or {}).get(OWNED) for n in nodes.values()),
        "every node untainted once back, and no taint recorded as the operator's", 40)
    assert took, "the standby never took the leader Lease"
    writes = node_writes(coexist_cluster, list(nodes.values()))

    tally: dict[str, int] = {}
    for name, n in nodes.items():
        hist = [w for w in writes[n] if w.at >= start]  # the window and after
        where = f"{name}, writes since the window began:\n{show(hist, start)}"
        for w in hist:
            tally[w.who] = tally.get(w.who, 0) + 1
        # Nothing removed and put back: taints come only with Unknown, go only with True.
        for prev, w in zip(writes[n], writes[n][1:], strict=False):
            assert not (w.effects - prev.effects) or w.ready == "Unknown", where
            assert not (prev.effects - w.effects) or w.ready == "True", where
        # the write that marks a silence may follow one from before the window began
        runs = [run for run in silences(writes[n]) if run[1].at >= start]
        expected = sum(1 for a, b in SILENCES[name] if b - a > (8 if "strict" in name else GRACE))
        assert len(runs) == expected, where
        for run in runs:
            marker = run[1]
            if name.startswith("strict"):
                # the operator first; the controller manager (grace 20 s) agrees: it adds
                # its taints but never writes the status of a node already Unknown
                assert marker.who == "operator" and marker.message.startswith(
                    "nodepulse-operator"), where
                assert run[-1].message == marker.message, where
                assert not [w for w in run if w.status and w.who == "controller-manager"], where
                assert "NoExecute" in run[-1].effects and "NoSchedule" in run[-1].effects, where
            else:
                assert marker.who == "controller-manager", where
        if name.startswith("lax"):
            assert not [w for w in hist if w.who == "operator"], where
        if not SILENCES[name]:
            assert not [w for w in hist if w.who == "operator" or w.effects], where

    # The failover: the new leader knew strict-2's NoExecute was its predecessor's (the
    # record), cleared it when the node was back, and wrote nothing else.
    s2 = writes[nodes["strict-2"]]
    before = [w for w in s2 if w.who == "operator" and w.at < killed]
    after = [w for w in s2 if w.who == "operator" and w.at >= killed]
    where = f"strict-2:\n{show(s2, start)}"
    assert before and before[-1].owned == f"{UNREACHABLE}:NoExecute", where
    assert len(after) == 1 and after[0].owned is None and after[0].ready == "True", where
    assert after[0].at - start >= 110 - 1, where
    print(f"\n{WINDOW} s beside the node-lifecycle controller (grace {GRACE} s): Node writes "
          f"by {json.dumps(dict(sorted(tally.items())))}; the standby led "
          f"{took - killed:.1f} s after the leader's SIGKILL")

