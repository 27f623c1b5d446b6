"""The operator against the real control plane: two replicas for the whole module
(one leads), node pools under policies, Leases renewed with each node's own credentials.

Which scenario uses what:
- real agents (nodepulse-agent, node credentials, killed by PID): two pools 15 s/60 s,
  renew interval change followed by the agents (API server metrics), partition guard;
- an in-test renewer (one thread renewing Leases with node credentials): conflicts and
  deletion, API server restart, HA failover (the operator is what is under test there).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, watch

from e2e.cluster import Cluster
from e2e.harness.ports import free_port
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually, first_seen
from nodeagent.api.client import new_api_client
from nodeagent.api.policy import GROUP, HEARTBEAT_ANNOTATION, PLURAL, VERSION

ROOT = Path(__file__).resolve().parent.parent
CRDS = ROOT / "charts" / "nodepulse" / "crds"
OPERATOR = Path(sys.executable).parent / "nodepulse-operator"
AGENT = Path(sys.executable).parent / "nodepulse-agent"
UNREACHABLE = "node.kubernetes.io/unreachable"
RUN = uuid.uuid4().hex[:5]  # names of this run's objects
ELECTION = f"nodepulse-operator-e2e-{RUN}"


# ---- the operator processes
@dataclasses.dataclass(frozen=True)
class OperatorCredentials:
    """Who the operator runs as, and its leader Lease: the admin here; the chart's
    ServiceAccount token and the chart's election Lease in e2e/test_chart_identities.py."""

    kubeconfig: Path
    election_namespace: str
    election_name: str


@pytest.fixture(scope="module", name="operator_credentials")
def admin_operator_credentials(cluster: Cluster) -> OperatorCredentials:
    return OperatorCredentials(cluster.kubeconfig, "kube-system", ELECTION)


class Operator:
    def __init__(self, cluster: Cluster, identity: str, creds: OperatorCredentials) -> None:
        self.identity = identity
        self.port = free_port()
        self.log = cluster.log_dir / f"operator-{identity}.log"
        args = [str(OPERATOR), "--kubeconfig", str(creds.kubeconfig),
                "--identity", identity,
                "--leader-election-namespace", creds.election_namespace,
                "--leader-election-name", creds.election_name,
                "--metrics-port", str(self.port), "--monitor-period", "1",
                *cluster.node_lifecycle_args()]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def writes(self) -> float:
        return samples(self.metrics(), "nodepulse_operator_writes_total")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# ---- Leases renewed with each node's own credentials
class Renewer(threading.Thread):
    """Renews the Lease of every node in `active` once a second, as an agent would
    (create, then update renewTime), each with that node's kubeconfig."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(daemon=True, name="lease-renewer")
        self.cluster = cluster
        self.active: set[str] = set()
        self.apis: dict[str, client.CoordinationV1Api] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self.renewed: set[str] = set()  # nodes renewed at least once

    def set(self, nodes: Any, on: bool) -> None:
        with self.lock:
            if on:
                self.active.update(nodes)
            else:
                self.active.difference_update(nodes)

    def _api(self, node: str) -> client.CoordinationV1Api:
        if node not in self.apis:
            self.apis[node] = client.CoordinationV1Api(
                new_api_client(self.cluster.node_kubeconfig(node), component="e2e-renewer"))
        return self.apis[node]

    def renew(self, node: str) -> None:
        # MicroTime needs its fraction (and the client drops a zero one on create).
        t = time.time()
        now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + \
            f".{max(1, int(t % 1 * 1e6)):06d}Z"
        api = self._api(node)
        body = {"metadata": {"name": node, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": node, "leaseDurationSeconds": 10,
                         "renewTime": now}}
        try:
            api.patch_namespaced_lease(node, "kube-node-lease", body,
                                       _content_type="application/merge-patch+json")
        except client.ApiException as e:
            if e.status != 404:
                raise
            api.create_namespaced_lease("kube-node-lease", body)
        self.renewed.add(node)

    def start_renewing(self, nodes: list[str]) -> None:
        self.set(nodes, True)
        eventually(lambda: not self.errors and
                   self.renewed >= set(nodes), f"Leases of {', '.join(nodes)}", 30)
        assert not self.errors, self.errors

    def run(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                nodes = sorted(self.active)
            for n in nodes:
                try:
                    self.renew(n)
                except Exception as e:  # noted, and the test that needs it fails
                    self.errors.append(f"{n}: {e}")
            self.stopping.wait(1.0)


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


@pytest.fixture
def agents(cluster: Cluster, tmp_path: Path) -> Iterator[Agents]:
    a = Agents(cluster, tmp_path)
    yield a
    for agent in a.started:
        agent.kill()


# ---- fixtures
@pytest.fixture(scope="module")
def kube(cluster: Cluster) -> Iterator[client.ApiClient]:
    kubectl = cluster.binary("kubectl")
    subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "apply", "-f",
                    str(CRDS)], check=True, capture_output=True)
    subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "wait",
                    "--for=condition=Established", "--timeout=60s",
                    f"crd/{PLURAL}.{GROUP}"], check=True, capture_output=True)
    api = cluster.api_client()
    yield api
    core = client.CoreV1Api(api)
    for n in core.list_node().items:
        if n.metadata.name.startswith(f"op-{RUN}-"):
            core.delete_node(n.metadata.name)
    coord = client.CoordinationV1Api(api)
    for lease in coord.list_namespaced_lease("kube-node-lease").items:
        if lease.metadata.name.startswith(f"op-{RUN}-"):
            try:
                coord.delete_namespaced_lease(lease.metadata.name, "kube-node-lease")
            except client.ApiException as e:
                if e.status != 404:  # gone with its Node (owner reference)
                    raise
    custom = client.CustomObjectsApi(api)
    for p in custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]:
        if p["metadata"]["name"].startswith(f"op-{RUN}-"):
            custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, p["metadata"]["name"])


@pytest.fixture(scope="module")
def operators(cluster: Cluster, kube: client.ApiClient,
              operator_credentials: OperatorCredentials) -> Iterator[list[Operator]]:
    """Two replicas for the whole module; the HA test (last) kills the leader."""
    ops = [Operator(cluster, f"op-{RUN}-a", operator_credentials),
           Operator(cluster, f"op-{RUN}-b", operator_credentials)]
    try:
        eventually(lambda: all(o.ready() for o in ops), "both operators ready", 60)
        eventually(lambda: leader(kube, operator_credentials)
                   in {o.identity for o in ops}, "a leader", 30)
        yield ops
    finally:
        for o in ops:
            o.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def renewer(cluster: Cluster) -> Iterator[Renewer]:
    r = Renewer(cluster)
    r.start()
    yield r
    r.stopping.set()
    r.join(timeout=10)


# ---- helpers
def leader(api: client.ApiClient, creds: OperatorCredentials) -> str | None:
    try:
        lease = client.CoordinationV1Api(api).read_namespaced_lease(
            creds.election_name, creds.election_namespace)
    except client.ApiException:
        return None
    return lease.spec.holder_identity or None


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


def kubectl(cluster: Cluster, *args: str, stdin: str | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cluster.binary("kubectl")), "--kubeconfig",
                           str(cluster.kubeconfig), *args], input=stdin, text=True,
                          capture_output=True, timeout=60)


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


def test_ha_failover(kube: client.ApiClient, operators: list[Operator],
                     renewer: Renewer, operator_credentials: OperatorCredentials) -> None:
    """Runs last (issue 9, fault 6): the module's two replicas; the standby writes
    nothing while the leader works; the leader is SIGKILLed (by PID) and a node falls
    silent at the same moment. The standby takes the leader Lease and taints the
    silent node within 60 s. Through the failover a watch on the pool's Nodes shows
    that no node is tainted twice or wrongly: the silent node's unreachable taints are
    added once each and never rewritten; a node the old leader had already tainted
    keeps its taints untouched (same timeAdded, not re-added); the nodes that keep
    renewing never get a taint written at all. (The API server restart above may
    have moved the leadership, so the standby may have written earlier, as leader:
    only its writes as standby count.)"""
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
