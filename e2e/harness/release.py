"""The Helm chart installed on the local control plane, and its identities: kubeconfigs
with a TokenRequest token of the chart's operator and agent ServiceAccounts, for
processes that stand in for the chart's pods (e2e/test_rbac.py,
e2e/test_chart_identities.py). What a refusal looks like in their logs: REFUSED."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as dt
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e.harness.helm import CHART, Tools, values
from nodeagent.api.client import new_api_client
from nodepulse_dev import Cluster

REFUSED = re.compile(r"[Ff]orbidden|\(403\)|status=403|\"code\": ?403")


@dataclasses.dataclass
class Release:
    name: str
    namespace: str
    policy: str  # the chart's default NodeStatusPolicy

    @property
    def operator_sa(self) -> str:
        return f"{self.name}-nodepulse-operator"

    @property
    def agent_sa(self) -> str:
        return f"{self.name}-nodepulse-agent"

    def agent_node(self, ordinal: int, i: int) -> str:
        """A Node name the chart lets its agents own."""
        return f"{self.name}-nodepulse-agent-{ordinal}-{i}"

    def user(self, sa: str) -> str:
        return f"system:serviceaccount:{self.namespace}:{sa}"


@pytest.fixture(scope="module", name="release")
def release_fixture(tools: Tools, cluster: Cluster) -> Iterator[Release]:
    """The chart installed in a namespace of its own (uninstalled afterwards, with the
    Nodes and Leases its agent registered)."""
    suffix = uuid.uuid4().hex[:5]
    rel = Release(f"np-rbac-{suffix}", f"np-rbac-{suffix}", f"e2e-rbac-{suffix}")
    core = client.CoreV1Api(cluster.api_client())
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=rel.namespace)))
    # A short lease so the agent's renewals are seen within seconds. The chart's pods
    # stay Pending (no image, no kubelet here): the tests' processes stand in for them.
    # The policy matches every node, other tests' left-over ones too, while a test's
    # operator runs: NoSchedule only, so it evicts no other test's pods.
    tools.helm("install", rel.name, str(CHART), "--namespace", rel.namespace, *values(
        agent={"enabled": True, "replicas": 1, "nodesPerReplica": 2},
        defaultPolicy={"enabled": True, "name": rel.policy,
                       "heartbeat": {"leaseDurationSeconds": 10, "renewIntervalSeconds": 2},
                       "failure": {"gracePeriodSeconds": 20, "taintUnreachable": False}}))
    try:
        yield rel
    finally:
        tools.helm("uninstall", rel.name, "--namespace", rel.namespace, check=False)
        with contextlib.suppress(client.ApiException):
            core.delete_namespace(rel.namespace)
        for i in range(2):  # what the agent registered
            name = rel.agent_node(0, i)
            with contextlib.suppress(client.ApiException):
                client.CoordinationV1Api(cluster.api_client()).delete_namespaced_lease(
                    name, "kube-node-lease")
            with contextlib.suppress(client.ApiException):
                core.delete_node(name)


def token_kubeconfig(cluster: Cluster, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig holding a TokenRequest token for the ServiceAccount, and nothing else."""
    core = client.CoreV1Api(cluster.api_client())
    req = core.create_namespaced_service_account_token(sa, namespace, client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)))
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    ctx = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])
    cl = next(c for c in admin["clusters"] if c["name"] == ctx["context"]["cluster"])["cluster"]
    ca = cl.get("certificate-authority-data") or base64.b64encode(
        Path(cl["certificate-authority"]).read_bytes()).decode()
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": sa,
        "clusters": [{"name": "c", "cluster": {"server": cl["server"],
                                               "certificate-authority-data": ca}}],
        "users": [{"name": sa, "user": {"token": req.status.token}}],
        "contexts": [{"name": sa, "context": {"cluster": "c", "user": sa}}]}))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module", name="identities")
def identities_fixture(cluster: Cluster, release: Release,
                       tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Kubeconfigs holding a token of the chart's operator and agent ServiceAccounts, by
    "operator" and "agent", once the chart's admission policies are enforced."""
    d = tmp_path_factory.mktemp("identities")
    ids = {"operator": token_kubeconfig(cluster, release.namespace, release.operator_sa,
                                        d / "operator.kubeconfig"),
           "agent": token_kubeconfig(cluster, release.namespace, release.agent_sa,
                                     d / "agent.kubeconfig")}
    _wait_for_admission_policies(ids["agent"], ids["operator"])
    return ids


def _wait_for_admission_policies(agent_kubeconfig: Path, operator_kubeconfig: Path,
                                 timeout: float = 60) -> None:
    """The API server enforces a new ValidatingAdmissionPolicy only once its admission
    plugin has synced it; until then the fences have RBAC only. A dry-run create (a Node
    under a foreign name by the agent, an Event about a Pod by the operator) goes
    through admission and writes nothing."""
    agent = client.CoreV1Api(new_api_client(agent_kubeconfig, component="e2e-agent-sa"))
    operator = client.CoreV1Api(new_api_client(operator_kubeconfig, component="e2e-op-sa"))
    deadline = time.monotonic() + timeout
    for probe in (lambda: agent.create_node(node_body(f"e2e-probe-{uuid.uuid4().hex[:6]}"),
                                            dry_run="All"),
                  lambda: operator.create_namespaced_event(
                      "default", event_body("probe", kind="Pod"), dry_run="All")):
        _refused_eventually(probe, deadline, timeout)


def _refused_eventually(probe: Callable[[], Any], deadline: float, timeout: float) -> None:
    while True:
        try:
            probe()
        except client.ApiException as e:
            if e.status == 403:
                return
            raise
        if time.monotonic() > deadline:
            raise AssertionError(f"the chart's admission policies were not enforced "
                                 f"within {timeout:.0f} s")
        time.sleep(0.5)


# ---- bodies the identities are tried with

def node_body(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def event_body(node: str, namespace: str = "default", *, kind: str = "Node",
               source: str | None = None, host: str | None = None,
               api_version: str = "v1") -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{node}.{uuid.uuid4().hex[:8]}", "namespace": namespace},
            "involvedObject": {"apiVersion": api_version, "kind": kind, "name": node,
                               **({"namespace": namespace} if kind == "Pod" else {})},
            "reason": "E2E", "message": "made up", "type": "Warning",
            "firstTimestamp": now, "lastTimestamp": now, "count": 1}
    if source or host:
        body["source"] = {"component": source or "e2e", **({"host": host} if host else {})}
    return body
