"""NoSchedule taints by condition on the real control plane (its controller manager runs
without the node-lifecycle controller, so only the operator can take them off).

- A real agent registers its Node, which the API server's TaintNodesByCondition
  admission creates with `node.kubernetes.io/not-ready:NoSchedule`. Without the operator
  the taint stays although the node is Ready, and a Pod without a toleration for it is
  left Pending by the real kube-scheduler; with the operator running the taint goes and
  the same Pod is scheduled onto the node (spec.nodeName; a nodeSelector on the node's
  hostname label keeps it off other tests' nodes).
- The agent's config file moves the nodefs threshold so that DiskPressure is True: the
  operator adds `node.kubernetes.io/disk-pressure:NoSchedule`, and takes it off when the
  threshold moves back. A watch on the Node checks that the admission's not-ready taint
  was there at creation and was only removed once Ready was True.

The agents run the fake runtime (a scheduled pod is "run" without containers). Every
process is stopped by PID; the test's Nodes, Leases and namespace are deleted.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.harness.namespaces import create_namespace
from e2e.harness.operators import (
    CRDS,
    Operator,
    admin_operator_credentials,  # noqa: F401 (a fixture)
)
from e2e.harness.taints import (
    NOT_READY,
    RUN,
    Agent,
    disk_pressure_taint_follows_the_condition,
    node_env_fixture,  # noqa: F401 (a fixture)
    noschedule,
    read,
    ready,
    start_operator_fixture,  # noqa: F401 (a fixture)
)
from e2e.harness.waits import eventually
from nodeagent.api.policy import GROUP, PLURAL
from nodepulse_dev import Cluster


@pytest.fixture(scope="module")
def kube(cluster: Cluster) -> client.ApiClient:
    kubectl = str(cluster.binary("kubectl"))
    subprocess.run([kubectl, "--kubeconfig", str(cluster.kubeconfig), "apply", "-f",
                    str(CRDS)], check=True, capture_output=True)
    subprocess.run([kubectl, "--kubeconfig", str(cluster.kubeconfig), "wait",
                    "--for=condition=Established", "--timeout=60s",
                    f"crd/{PLURAL}.{GROUP}"], check=True, capture_output=True)
    return cluster.api_client()


@pytest.fixture
def namespace(kube: client.ApiClient) -> Iterator[str]:
    core = client.CoreV1Api(kube)
    ns = f"taints-{RUN}"
    create_namespace(core, ns)
    yield ns
    for pod in core.list_namespaced_pod(ns).items:
        core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)
    core.delete_namespace(ns)


def test_not_ready_taint_removed_and_an_untolerating_pod_scheduled(
        kube: client.ApiClient, start_operator: Callable[[], Operator],
        node_env: Callable[[str, str], tuple[Agent, Path]], namespace: str) -> None:
    core = client.CoreV1Api(kube)
    name = f"taints-{RUN}-sched"
    node_env(name, "{}\n")
    node = eventually(lambda: (n := read(kube, name))
                      and ready(n) == "True" and n, "the agent's Node Ready", 60)
    # Nothing but the operator removes admission's taint here; it is the only one.
    assert noschedule(node) == {NOT_READY}

    pod = {"metadata": {"name": "plain"},
           "spec": {"nodeSelector": {"kubernetes.io/hostname": name},
                    "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}
    created = core.create_namespaced_pod(namespace, pod)
    # No toleration covers a NoSchedule taint (admission adds NoExecute ones only).
    assert all(t.effect == "NoExecute" for t in created.spec.tolerations or [])

    def unschedulable() -> Any:
        p = core.read_namespaced_pod("plain", namespace)
        c = next((c for c in p.status.conditions or [] if c.type == "PodScheduled"), None)
        return c if c is not None and c.status == "False" else None
    cond = eventually(unschedulable, "the scheduler's verdict", 30)
    assert cond.reason == "Unschedulable" and "untolerated taint" in cond.message, cond.message
    assert core.read_namespaced_pod("plain", namespace).spec.node_name is None

    start_operator()
    node = eventually(lambda: NOT_READY not in noschedule(
        n := read(kube, name)) and n, "not-ready taint removed", 30)
    assert ready(node) == "True"
    bound = eventually(lambda: (
        p := core.read_namespaced_pod("plain", namespace)).spec.node_name and p,
        "the pod scheduled onto the node", 60)
    assert bound.spec.node_name == name


def test_disk_pressure_taint_follows_the_condition(
        kube: client.ApiClient, start_operator: Callable[[], Operator],
        node_env: Callable[[str, str], tuple[Agent, Path]]) -> None:
    disk_pressure_taint_follows_the_condition(kube, start_operator, node_env)
