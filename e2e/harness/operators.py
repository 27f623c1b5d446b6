"""nodepulse-operator as a process: who it runs as (OperatorCredentials), its leader
Lease, two replicas for a module; the NodeStatusPolicy CRD applied with the admin's
client; and a Lease renewer that stands in for agents (each node's own credentials).

The names of a run's objects start with op-<RUN>- (pools.py makes them), so that the
`kube` fixture deletes them afterwards.
"""

from __future__ import annotations

import dataclasses
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
from kubernetes import client

from e2e.harness.ports import free_port
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually
from nodeagent.api.client import new_api_client
from nodeagent.api.policy import GROUP, PLURAL, VERSION
from nodepulse_dev import Cluster

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "charts" / "nodepulse" / "crds"
OPERATOR = Path(sys.executable).parent / "nodepulse-operator"
AGENT = Path(sys.executable).parent / "nodepulse-agent"
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


# ---- fixtures
def apply_crds(cluster: Cluster) -> None:
    """The chart's CRDs, applied and Established."""
    kubectl = cluster.binary("kubectl")
    subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "apply", "-f",
                    str(CRDS)], check=True, capture_output=True)
    subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "wait",
                    "--for=condition=Established", "--timeout=60s",
                    f"crd/{PLURAL}.{GROUP}"], check=True, capture_output=True)


@pytest.fixture(scope="module", name="kube")
def kube_fixture(cluster: Cluster) -> Iterator[client.ApiClient]:
    """The admin's API client with the CRDs applied; afterwards the Nodes, Leases and
    policies of this run (op-<RUN>-...) are deleted."""
    apply_crds(cluster)
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


@pytest.fixture(scope="module", name="operators")
def operators_fixture(cluster: Cluster, kube: client.ApiClient,
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


@pytest.fixture(scope="module", name="renewer")
def renewer_fixture(cluster: Cluster) -> Iterator[Renewer]:
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


def kubectl(cluster: Cluster, *args: str, stdin: str | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cluster.binary("kubectl")), "--kubeconfig",
                           str(cluster.kubeconfig), *args], input=stdin, text=True,
                          capture_output=True, timeout=60)
