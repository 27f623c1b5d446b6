"""Virtual-node mode against the real control plane: one `nodepulse-agent` process runs
50 Nodes with the fake runtime, using the admin kubeconfig (a virtual-node agent writes
for many Nodes, which no single node's client certificate may do under
NodeRestriction; the Helm chart gives it a ServiceAccount with RBAC instead).

- all 50 Nodes register Ready, labelled and tainted nodepulse.dev/virtual=true;
- over a 60 s window every Lease is renewed 6±1 times (placed by the renewTime the
  agent wrote), the API server's own count of Lease PUTs is those renewals and others'
  (seen by a watch), and the total is 50 x 60 s / (10 s + the agent's mean lateness)
  ± 10 % (each renewal is planned from when the last went through, as the kubelet's);
- no Lease is ever older than its duration;
- a pod that tolerates the virtual taint is scheduled by kube-scheduler onto one
  virtual node and reaches Running on the fake runtime; a pod that does not tolerate
  it stays unschedulable.

Everything started here is stopped by PID; the Nodes, Leases and pods are deleted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.harness.agents import AGENT, AgentProcess
from e2e.harness.heartbeats import Recorder
from e2e.harness.ports import free_port
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually
from nodepulse_dev import Cluster

N = 50
PREFIX = "e2e-vn"
WINDOW = 60.0
NS = "default"


def _delete_all(core: client.CoreV1Api, coord: client.CoordinationV1Api) -> None:
    for pod in core.list_namespaced_pod(NS, label_selector="e2e=virtual-nodes").items:
        with contextlib.suppress(client.ApiException):
            core.delete_namespaced_pod(pod.metadata.name, NS, grace_period_seconds=0)
    for node in core.list_node(label_selector=f"nodepulse.dev/agent={PREFIX}").items:
        with contextlib.suppress(client.ApiException):
            core.delete_node(node.metadata.name)
    for lease in coord.list_namespaced_lease("kube-node-lease").items:
        if lease.metadata.name.startswith(f"{PREFIX}-"):
            with contextlib.suppress(client.ApiException):
                coord.delete_namespaced_lease(lease.metadata.name, "kube-node-lease")


@pytest.fixture
def vagent(cluster: Cluster, tmp_path: Path) -> Iterator[AgentProcess]:
    api = cluster.api_client()
    core, coord = client.CoreV1Api(api), client.CoordinationV1Api(api)
    _delete_all(core, coord)  # a clean slate if an earlier run left objects behind
    port = free_port()
    log = tmp_path / "agent.log"
    argv = [str(AGENT), "--virtual-nodes", str(N), "--node-name-prefix", PREFIX,
            "--kubeconfig", str(cluster.kubeconfig), "--runtime", "fake",
            "--healthz-bind-address", f"127.0.0.1:{port}", "--root-dir", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    agent = AgentProcess(PREFIX, proc, log, port)
    try:
        yield agent
    finally:
        if proc.poll() is None:  # by PID, whatever the test's outcome
            proc.kill()
            proc.wait()
        _delete_all(core, coord)


def _pod(name: str, node: str, tolerate: bool) -> dict[str, Any]:
    tolerations = [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                    "effect": "NoSchedule"}]  # no node-lifecycle controller lifts it here
    if tolerate:
        tolerations.append({"key": "nodepulse.dev/virtual", "operator": "Equal",
                            "value": "true", "effect": "NoSchedule"})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"e2e": "virtual-nodes"}},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "tolerations": tolerations, "automountServiceAccountToken": False,
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": "localhost/busybox:1",
                                     "command": ["sleep", "3600"]}]}}


def _ready(node: client.V1Node) -> bool:
    return any(c.type == "Ready" and c.status == "True"
               for c in (node.status.conditions or []))


def test_one_process_runs_50_virtual_nodes(cluster: Cluster, vagent: AgentProcess) -> None:
    api = cluster.api_client()
    core, coord = client.CoreV1Api(api), client.CoordinationV1Api(api)
    names = [f"{PREFIX}-{i}" for i in range(N)]
    rec = Recorder()
    rec.start(api)
    try:
        def registered() -> bool:
            if vagent.proc.poll() is not None:
                raise AssertionError(f"agent exited: {vagent.log.read_text()[-3000:]}")
            nodes = core.list_node(label_selector=f"nodepulse.dev/agent={PREFIX}").items
            leases = [le for le in coord.list_namespaced_lease("kube-node-lease").items
                      if le.metadata.name.startswith(f"{PREFIX}-")]
            return len(nodes) == N and all(_ready(n) for n in nodes) and len(leases) == N
        eventually(registered, f"{N} virtual nodes Ready with Leases", 90)
        assert vagent.get("/readyz")[0] == 200
        nodes = {n.metadata.name: n for n in
                 core.list_node(label_selector=f"nodepulse.dev/agent={PREFIX}").items}
        assert sorted(nodes) == sorted(names)
        for n in nodes.values():
            assert n.metadata.labels["nodepulse.dev/virtual"] == "true"
            taints = {(t.key, t.value, t.effect) for t in n.spec.taints or []}
            assert ("nodepulse.dev/virtual", "true", "NoSchedule") in taints

        _, text0 = vagent.get("/metrics")
        relists0 = samples(text0, "nodepulse_pleg_relist_duration_seconds_count")
        # The API server's counters are read at some instant of each /metrics fetch:
        # renewals during a fetch may be on either side of the window. Renewals are
        # placed by the renewTime the agent wrote (wall clock), not by when the watch
        # delivered them: a busy test process delivers them seconds late.
        fetch0 = time.time()
        m0 = cluster.apiserver_metrics()
        t0 = time.time()
        # pods while the window runs: one tolerates the virtual taint, one does not
        target = names[7]
        core.create_namespaced_pod(NS, _pod("vn-runs", target, tolerate=True))
        core.create_namespaced_pod(NS, _pod("vn-refused", names[8], tolerate=False))

        def running() -> bool:
            p = core.read_namespaced_pod("vn-runs", NS)
            return bool(p.status.phase == "Running" and p.status.container_statuses
                        and all(c.ready for c in p.status.container_statuses))
        try:
            eventually(running, "the pod Running on a virtual node", 45)
        except AssertionError:  # scheduled or not, and what the agent reported
            p = core.read_namespaced_pod("vn-runs", NS)
            print(f"vn-runs: node {p.spec.node_name!r}, status {p.status}\n"
                  f"{vagent.log.read_text()[-3000:]}")
            raise
        pod = core.read_namespaced_pod("vn-runs", NS)
        assert pod.spec.node_name == target
        refused = core.read_namespaced_pod("vn-refused", NS)
        assert refused.spec.node_name is None
        sched = [c for c in refused.status.conditions or [] if c.type == "PodScheduled"]
        assert sched and sched[0].status == "False" and sched[0].reason == "Unschedulable"

        time.sleep(max(0.0, t0 + WINDOW - time.time()))
        fetch1 = time.time()
        m1 = cluster.apiserver_metrics()
        t1 = time.time()
        _, text1 = vagent.get("/metrics")
        def caught_up() -> bool:
            after = {key for _, when, key in rec.renewals() if when >= t1}
            return all(f"kube-node-lease/{n}" in after for n in names)
        eventually(caught_up,
                   "the watch to deliver every Lease's renewals up to the window's end", 30)
        assert rec.errors == []
        renewed = [(when, key) for _, when, key in rec.renewals()]

        def count(start: float, end: float, ours: bool = True) -> int:
            return sum(1 for when, key in renewed if start <= when < end
                       and key.startswith(f"kube-node-lease/{PREFIX}-") == ours)
        per_node = {n: sum(1 for when, key in renewed if key == f"kube-node-lease/{n}"
                           and t0 <= when < fetch1) for n in names}
        assert all(5 <= c <= 7 for c in per_node.values()), per_node
        # certainly inside the API server's count, and maybe inside it (a fetch's edge,
        # with 0.5 s for a PUT's own time)
        sure, others = count(t0, fetch1), count(t0, fetch1, ours=False)
        edges = sum(count(fetch0 - 0.5, t0, ours) + count(fetch1, t1 + 0.5, ours)
                    for ours in (True, False))
        puts = (samples(m1, "apiserver_request_total", resource="leases", verb="PUT")
                - samples(m0, "apiserver_request_total", resource="leases", verb="PUT"))
        assert sure + others <= puts <= sure + others + edges, (puts, sure, others, edges)
        # about one renewal per 10 s interval: the next one is planned from when the
        # last went through, so each interval is also as long as the agent's lateness
        late = [samples(text1, f"nodepulse_lease_renewal_duration_seconds_{k}")
                - samples(text0, f"nodepulse_lease_renewal_duration_seconds_{k}")
                for k in ("sum", "count")]
        lateness = late[0] / max(1.0, late[1])
        expected = N * (fetch1 - t0) / (10 + lateness)
        print(f"\n{sure} renewals of {N} Leases in {fetch1 - t0:.0f}s, {expected:.0f} "
              f"expected; each {lateness:.2f}s after its due time on average")
        assert abs(sure - expected) <= expected * 0.1, (sure, expected, lateness)

        # no Lease lapsed: each renewal came within its duration of the one before
        for n in names:
            times = [t for t, kind, key, _ in rec.leases if key == f"kube-node-lease/{n}"]
            gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
            assert gaps and max(gaps) < 40, (n, gaps)
        now = dt.datetime.now(dt.UTC)
        for lease in coord.list_namespaced_lease("kube-node-lease").items:
            if lease.metadata.name.startswith(f"{PREFIX}-"):
                age = (now - lease.spec.renew_time).total_seconds()
                assert age < lease.spec.lease_duration_seconds, (lease.metadata.name, age)

        # one pod list (then its watch) and one PLEG for all 50 nodes: the agent's metrics
        code, text = vagent.get("/metrics")
        assert code == 200
        assert samples(text, "nodepulse_nodes") == N
        assert samples(text, "nodepulse_source_api_lists_total") == 1
        pleg = [ln for ln in text.splitlines()
                if ln.startswith("nodepulse_pleg_last_seen_seconds{")]
        assert len(pleg) == 1 and f'node="{PREFIX}"' in pleg[0], pleg
        relists = samples(text, "nodepulse_pleg_relist_duration_seconds_count") - relists0
        assert relists <= time.time() - t0 + 3, relists  # one relist a second, not N
    finally:
        rec.stop()
    assert vagent.stop() == 0, vagent.log.read_text()[-3000:]
    log = vagent.log.read_text()
    assert "Forbidden" not in log and " 403 " not in log, log[-3000:]
