"""The Helm chart on kind: its pods run the image on real kubelets.

As a user would: the CRDs applied with kubectl, the chart installed with Helm (the
image loaded with `kind load`, pull policy Never), the controller manager with its
defaults (the node-lifecycle controller on), and the chart's own default for how the
operator shares the nodes with it. Then:
- the operator's two replicas Running and Ready (startup, liveness and readiness
  probes passing) on the two kind nodes (the chart's anti-affinity), never restarted;
- the leader writes every node's effective policy (the default policy's heartbeat),
  the kind nodes' and the virtual ones';
- the virtual-node agents' StatefulSet Running and Ready, with its Nodes Ready;
- `helm upgrade` with changed values rolls both workloads (new pods, the new
  arguments), and the leader rewrites every node's policy with the new heartbeat;
- `helm uninstall` leaves nothing of the release but the CRDs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from e2e.harness.helm import CHART, Tools, sets
from e2e.harness.waits import eventually
from e2e.kind.cluster import KindCluster
from e2e.kind.images import PROJECT_IMAGE
from nodeagent.api.policy import HEARTBEAT_ANNOTATION, decode_heartbeat_annotation
from nodepulse_dev import Cluster

# The first test to use the engine or the cluster also waits for what is not cached yet
# (Go builds, debootstrap, the image builds: about 10 minutes cold, e2e/kind/conftest.py).
pytestmark = pytest.mark.timeout(1800)

RELEASE = "nodepulse"
NAMESPACE = "nodepulse-system"
POLICY = "kind-default"
SELECTOR = f"app.kubernetes.io/instance={RELEASE}"


@pytest.fixture(scope="module")
def tools(kind_cluster: KindCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tools]:
    cluster = Cluster(kind_cluster.kubeconfig, kind_cluster.workdir)
    yield Tools(cluster, tmp_path_factory.mktemp("helm-home"))


def values(lease: int, nodes_per_replica: int, **operator: Any) -> list[str]:
    repository, tag = PROJECT_IMAGE.rsplit(":", 1)
    return sets({
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        # the kind control-plane node keeps kubeadm's NoSchedule taint (it has a worker):
        # tolerating it gives the anti-affinity two hosts to spread the replicas over
        "operator": {"tolerations": [{"key": "node-role.kubernetes.io/control-plane",
                                      "operator": "Exists", "effect": "NoSchedule"}],
                     **operator},
        "agent": {"enabled": True, "replicas": 1, "nodesPerReplica": nodes_per_replica},
        "defaultPolicy": {"enabled": True, "name": POLICY,
                          "heartbeat": {"leaseDurationSeconds": lease}},
    })


def pods(core: client.CoreV1Api, component: str) -> list[client.V1Pod]:
    return list(core.list_namespaced_pod(
        NAMESPACE, label_selector=f"{SELECTOR},app.kubernetes.io/component={component}").items)


def ready(pod: client.V1Pod) -> bool:
    conditions = {c.type: c.status for c in pod.status.conditions or []}
    return (pod.status.phase == "Running" and conditions.get("Ready") == "True"
            and pod.metadata.deletion_timestamp is None)


def running_and_ready(core: client.CoreV1Api, component: str, count: int,
                      not_uids: frozenset[str] = frozenset()) -> list[client.V1Pod]:
    """`count` pods of the component Running and Ready (none of `not_uids`), waited for."""
    def check() -> list[client.V1Pod] | None:
        got = [p for p in pods(core, component) if p.metadata.deletion_timestamp is None]
        if (len(got) == count and all(ready(p) for p in got)
                and not {p.metadata.uid for p in got} & not_uids):
            return got
        return None
    return eventually(check, f"{count} {component} pods Running and Ready", timeout=240, every=1)


def node_ready(node: client.V1Node) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def policies(core: client.CoreV1Api) -> dict[str, tuple[str, int]]:
    """node -> (policy, leaseDurationSeconds) from the annotation the leader writes."""
    out = {}
    for n in core.list_node().items:
        value = (n.metadata.annotations or {}).get(HEARTBEAT_ANNOTATION)
        if value is not None:
            name, hb = decode_heartbeat_annotation(value)
            out[n.metadata.name] = (name, hb.leaseDurationSeconds)
    return out


def every_node_has(core: client.CoreV1Api, lease: int, nodes: set[str]) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        got = policies(core)
        return got if all(got.get(n) == (POLICY, lease) for n in nodes) else None
    return eventually(check, f"policy {POLICY} with a {lease} s lease on every node",
                      timeout=120, every=1)


def test_chart_on_real_kubelets(kind_cluster: KindCluster, tools: Tools) -> None:
    api = tools.cluster.api_client()
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    kind_nodes = set(kind_cluster.nodes())
    assert len(kind_nodes) == 2

    tools.apply_crds()
    out = tools.helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE,
                     "--create-namespace", *values(lease=40, nodes_per_replica=3),
                     "--wait", "--timeout", "5m", timeout=330)
    assert "STATUS: deployed" in out.stdout

    # the operator: two replicas on the two real kubelets, Ready, never restarted
    operators = running_and_ready(core, "operator", 2)
    assert {p.spec.node_name for p in operators} == kind_nodes
    for p in operators:
        (c,) = p.status.container_statuses
        assert c.image.endswith(PROJECT_IMAGE.split("/", 1)[1]) and c.restart_count == 0
        assert c.started and c.ready
    # the agents: one pod on a real kubelet, speaking for three virtual Nodes
    (agent,) = running_and_ready(core, "agent", 1)
    assert agent.spec.node_name in kind_nodes
    virtual = {f"{agent.metadata.name}-{i}" for i in range(3)}
    eventually(lambda: all(node_ready(core.read_node(n)) for n in virtual),
               f"virtual Nodes {sorted(virtual)} Ready", timeout=120,
               tolerate=(client.ApiException,))
    # the leader writes every node's effective policy
    print(every_node_has(core, 40, kind_nodes | virtual))

    # upgrade: changed values roll both workloads
    before = frozenset({p.metadata.uid for p in operators} | {agent.metadata.uid})
    out = tools.helm("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE,
                     *values(lease=20, nodes_per_replica=4, verbose=True),
                     "--wait", "--timeout", "5m", timeout=330)
    assert "has been upgraded" in out.stdout
    operators = running_and_ready(core, "operator", 2, not_uids=before)
    assert all("--verbose" in p.spec.containers[0].args for p in operators)
    (agent,) = running_and_ready(core, "agent", 1, not_uids=before)
    assert "--virtual-nodes=4" in agent.spec.containers[0].args
    virtual = {f"{agent.metadata.name}-{i}" for i in range(4)}
    eventually(lambda: all(node_ready(core.read_node(n)) for n in virtual),
               f"virtual Nodes {sorted(virtual)} Ready", timeout=120,
               tolerate=(client.ApiException,))
    print(every_node_has(core, 20, kind_nodes | virtual))
    (deployment,) = apps.list_namespaced_deployment(NAMESPACE, label_selector=SELECTOR).items
    assert deployment.status.ready_replicas == 2 and deployment.status.updated_replicas == 2

    # uninstall: nothing of the release is left but the CRDs
    out = tools.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait")
    assert f'release "{RELEASE}" uninstalled' in out.stdout

    def leftovers() -> list[str]:
        return (tools.kubectl("get", "all,pdb,sa,role,rolebinding,lease", "-A", "-l", SELECTOR,
                              "-o", "name").stdout.split()
                + tools.kubectl("get", "clusterrole,clusterrolebinding,nsp,"
                                "validatingadmissionpolicy,validatingadmissionpolicybinding",
                                "-l", SELECTOR, "-o", "name").stdout.split())
    eventually(lambda: not leftovers() or None, "the release's objects gone", timeout=120)
    eventually(lambda: not pods(core, "operator") + pods(core, "agent") or None,
               "the release's pods gone", timeout=120)
    assert tools.kubectl("get", "crd", "nodestatuspolicies.nodepulse.dev", "-o",
                         "name").stdout.strip() == "customresourcedefinition.apiextensions.k8s.io/" \
                                                   "nodestatuspolicies.nodepulse.dev"
    # Nodes outlive their kubelet, the virtual ones their agent: an admin deletes them
    for name in virtual | {f"{agent.metadata.name}-{i}" for i in range(3)}:
        tools.kubectl("delete", "node", name, "--ignore-not-found")
    core.delete_namespace(NAMESPACE)
