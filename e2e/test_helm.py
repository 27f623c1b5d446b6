"""The Helm chart against the real API server: lint, server-side dry run, install,
upgrade with changed values, uninstall leaving nothing behind, values the schema
refuses, and the CRD as kubectl shows it.

The chart's pods do not run here: the local control plane has no kubelet for them
(e2e/kind/test_chart.py runs them, with the image the Dockerfile builds, on kind's
real kubelets). Every test pins them to a node label no node has, so they stay
Pending and never land on another test's agent node. What is proved here is that the
API server accepts every object the chart renders and that Helm manages their whole
life.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e.harness.helm import (
    CHART,
    Tools,
    sets,
    tools_fixture,  # noqa: F401 (a fixture)
    values,
)


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.fixture
def namespace(tools: Tools) -> Iterator[str]:
    name = f"np-helm-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(tools.cluster.api_client())
    # Pod Security "restricted": a pod template that breaks it is refused (enforce) and
    # warned about on apply (warn), which the dry-run test treats as a failure.
    psa = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn")}
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=psa)))
    yield name
    # a failed test may leave its release: its cluster-scoped objects outlive the namespace
    for release in tools.helm("list", "--namespace", name, "-q").stdout.split():
        tools.helm("uninstall", release, "--namespace", name, check=False)
    core.delete_namespace(name)


ALL_ON = dict(agent={"enabled": True, "replicas": 2, "nodesPerReplica": 3},
              defaultPolicy={"enabled": True, "name": "e2e-helm-default"})


# ---- lint and schema

def test_lint_strict_is_clean(tools: Tools) -> None:
    for extra in ([], values(**ALL_ON),
                  values(**ALL_ON, metrics={"serviceMonitor": {"enabled": True}},
                         dashboards={"enabled": True})):
        out = tools.helm("lint", "--strict", str(CHART), *extra)
        print(out.stdout)
        assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout
        assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout


@pytest.mark.parametrize(("bad", "message"), [
    ({"operator": {"replicas": "two"}}, "at '/operator/replicas': got string, want integer"),
    ({"operator": {"replica": 2}}, "at '/operator': additional properties 'replica' not allowed"),
    ({"agent": {"nodesPerReplica": 0}}, "at '/agent/nodesPerReplica': minimum: got 0, want 1"),
    ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy': value must be one of"),
    ({"defaultPolicy": {"heartbeat": {"leaseDurationSeconds": 2}}},
     "at '/defaultPolicy/heartbeat/leaseDurationSeconds': minimum: got 2, want 5"),
    ({"defaultPolicy": {"name": "Not_A_Name"}}, "at '/defaultPolicy/name'"),
    ({"operator": {"resources": {"requests": {"cpu": "lots", "memory": "1Gi"}}}},
     "at '/operator/resources/requests/cpu'"),
    ({"metrics": {"serviceMonitor": {"interval": "often"}}},
     "at '/metrics/serviceMonitor/interval'"),
    ({"operator": {"nodeLifecycle": {"mode": "both"}}},
     "at '/operator/nodeLifecycle/mode': value must be one of"),
])
def test_bad_values_fail_lint_and_install_naming_the_field(
        tools: Tools, namespace: str, bad: dict[str, Any], message: str) -> None:
    lint = tools.helm("lint", "--strict", str(CHART), *sets(bad), check=False)
    assert lint.returncode != 0
    assert message in lint.stdout + lint.stderr
    install = tools.helm("install", "np-bad", str(CHART), "--namespace", namespace,
                         *values(), *sets(bad), check=False)
    assert install.returncode != 0
    assert message in install.stderr
    assert tools.helm("list", "--namespace", namespace, "-q").stdout.strip() == ""


@pytest.mark.parametrize(("bad", "message"), [
    ({"operator": {"leaderElection": {"retryPeriodSeconds": 12}}},
     "operator.leaderElection.retryPeriodSeconds (12) must be less than renewDeadlineSeconds (10)"),
    ({"operator": {"leaderElection": {"renewDeadlineSeconds": 20}}},
     "operator.leaderElection.renewDeadlineSeconds (20) must be less than leaseDurationSeconds (15)"),
    ({"agent": {"enabled": True, "replicas": 100, "nodesPerReplica": 101}},
     "agent.replicas x agent.nodesPerReplica = 10100: at most 10000"),
    ({"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
     "metrics.serviceMonitor.enabled needs metrics.service.enabled"),
])
def test_cross_field_rules_fail_install(tools: Tools, namespace: str, bad: dict[str, Any],
                                        message: str) -> None:
    """Rules between two values (which JSON Schema cannot state) are checked by the
    templates; `helm lint` reports a template `fail` only as INFO, install refuses."""
    install = tools.helm("install", "np-bad", str(CHART), "--namespace", namespace,
                         *values(), *sets(bad), check=False)
    assert install.returncode != 0
    assert message in install.stderr


# ---- rendering and the API server's verdict

def test_template_is_accepted_by_the_api_server(tools: Tools, namespace: str) -> None:
    rendered = tools.template("np-dry", namespace, *values(
        agent=ALL_ON["agent"], defaultPolicy={"enabled": True, "name": f"{namespace}-default"}))
    out = tools.kubectl("apply", "--dry-run=server", "-f", "-", stdin=rendered)
    print(out.stdout)
    lines = out.stdout.strip().splitlines()
    kinds = {d["kind"] for d in docs(rendered)}
    assert kinds == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                     "RoleBinding", "Service", "Deployment", "StatefulSet",
                     "PodDisruptionBudget", "NodeStatusPolicy", "ValidatingAdmissionPolicy",
                     "ValidatingAdmissionPolicyBinding"}
    assert len(lines) == len(docs(rendered))
    assert all(line.endswith("(server dry run)") for line in lines), out.stdout
    assert out.stderr.strip() == ""  # no warnings either


def test_operator_node_lifecycle_follows_the_values(tools: Tools) -> None:
    """coexist with the controller manager's default grace unless told otherwise: the
    safe mode on a cluster whose node-lifecycle controller may run."""
    def args(*extra: str) -> list[str]:
        (deploy,) = [d for d in docs(tools.template("np-nl", "nl-test", *values(), *extra))
                     if d["kind"] == "Deployment"]
        return list(deploy["spec"]["template"]["spec"]["containers"][0]["args"])

    default = args()
    assert "--node-lifecycle=coexist" in default
    assert "--node-monitor-grace-period=50s" in default
    told = args(*sets({"operator": {"nodeLifecycle": {
        "mode": "exclusive", "nodeMonitorGracePeriodSeconds": 40}}}))
    assert "--node-lifecycle=exclusive" in told and "--node-monitor-grace-period=40s" in told


def test_service_monitor_only_when_enabled(tools: Tools) -> None:
    """Its CRD (Prometheus Operator) is not in this cluster, so it is checked rendered."""
    off = docs(tools.template("np-sm", "monitoring-test", *values()))
    assert "ServiceMonitor" not in {d["kind"] for d in off}
    on = docs(tools.template("np-sm", "monitoring-test", *values(
        agent={"enabled": True}, metrics={"serviceMonitor": {"enabled": True, "interval": "15s"}})))
    (sm,) = [d for d in on if d["kind"] == "ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["namespace"] == "monitoring-test"
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics",
                                        "interval": "15s", "scrapeTimeout": "10s"}]
    # it selects both metrics Services, each of which names its port "metrics"
    services = [d for d in on if d["kind"] == "Service"]
    assert len(services) == 2
    match = sm["spec"]["selector"]
    for svc in services:
        labels = svc["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in match["matchLabels"].items())
        (expr,) = match["matchExpressions"]
        assert labels[expr["key"]] in expr["values"]
        assert [p["name"] for p in svc["spec"]["ports"]] == ["metrics"]


def test_dashboards_only_when_enabled(tools: Tools, namespace: str) -> None:
    """Off by default; on, one ConfigMap per dashboard with the Grafana sidecar's label
    (configurable), each holding its file's JSON as is, accepted by the API server."""
    off = docs(tools.template("np-dash", namespace, *values()))
    assert not [d for d in off if d["kind"] == "ConfigMap"]
    files = {f"nodepulse-{p.stem}.json": json.loads(p.read_text())
             for p in (CHART / "dashboards").glob("*.json")}
    assert len(files) == 3
    for dashboards, label in (({"enabled": True}, ("grafana_dashboard", "1")),
                              ({"enabled": True, "label": "example.com/dashboard",
                                "labelValue": "nodepulse", "annotations": {"folder": "np"}},
                               ("example.com/dashboard", "nodepulse"))):
        rendered = tools.template("np-dash", namespace, *values(dashboards=dashboards))
        maps = [d for d in docs(rendered) if d["kind"] == "ConfigMap"]
        assert {m["metadata"]["name"] for m in maps} == {
            f"np-dash-nodepulse-dashboard-{n}" for n in ("heartbeats", "pods", "operator")}
        for m in maps:
            assert m["metadata"]["namespace"] == namespace
            assert m["metadata"]["labels"][label[0]] == label[1]
            assert m["metadata"].get("annotations") == dashboards.get("annotations")
            ((key, text),) = m["data"].items()
            assert json.loads(text) == files[key]
        out = tools.kubectl("apply", "--dry-run=server", "-f", "-",
                            stdin=yaml.safe_dump_all(maps))
        assert out.stdout.count("(server dry run)") == 3, out.stdout
    bad = tools.helm("lint", "--strict", str(CHART),
                     *sets({"dashboards": {"enabled": True, "label": "not a label"}}),
                     check=False)
    assert bad.returncode != 0 and "at '/dashboards/label'" in bad.stdout + bad.stderr


# ---- install, upgrade, uninstall

def _manifest_objects(tools: Tools, release: str, namespace: str) -> list[tuple[str, str, str]]:
    """(kind, namespace, name) of everything Helm installed for the release."""
    manifest = tools.helm("get", "manifest", release, "--namespace", namespace).stdout
    return [(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])
            for d in docs(manifest)]


def _exists(tools: Tools, kind: str, namespace: str, name: str) -> bool:
    args = ["get", kind, name, "-o", "name", "--ignore-not-found"]
    if namespace:
        args += ["--namespace", namespace]
    return bool(tools.kubectl(*args).stdout.strip())


def test_install_upgrade_uninstall(tools: Tools, namespace: str) -> None:
    release = "np-life"
    api = tools.cluster.api_client()
    apps, rbac = client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    custom = client.CustomObjectsApi(api)

    out = tools.helm("install", release, str(CHART), "--namespace", namespace,
                     *values(**ALL_ON))
    print(out.stdout)
    assert "STATUS: deployed" in out.stdout
    assert "Node lifecycle mode: coexist (kube-controller-manager's node-lifecycle " \
        "controller runs, grace 50s:" in out.stdout  # NOTES
    installed = _manifest_objects(tools, release, namespace)
    for kind, ns, name in installed:
        assert _exists(tools, kind, ns, name), (kind, ns, name)

    dep = apps.read_namespaced_deployment(f"{release}-nodepulse-operator", namespace)
    assert dep.spec.replicas == 2
    pod = dep.spec.template.spec
    (c,) = pod.containers
    assert c.image == "nodepulse:0.1.0" and c.command == ["nodepulse-operator"]
    assert c.liveness_probe.http_get.path == "/healthz"
    assert c.readiness_probe.http_get.path == "/readyz"
    assert [(p.name, p.container_port) for p in c.ports] == [("metrics", 8080)]
    assert "--metrics-port=8080" in c.args and "--metrics-host=0.0.0.0" in c.args
    assert c.resources.requests == {"cpu": "50m", "memory": "128Mi"}
    assert c.security_context.read_only_root_filesystem is True
    assert c.security_context.allow_privilege_escalation is False
    assert c.security_context.capabilities.drop == ["ALL"]
    assert pod.security_context.run_as_non_root is True and pod.security_context.run_as_user == 10001
    assert pod.service_account_name == f"{release}-nodepulse-operator"

    sts = apps.read_namespaced_stateful_set(f"{release}-nodepulse-agent", namespace)
    assert sts.spec.replicas == 2
    assert "--virtual-nodes=3" in sts.spec.template.spec.containers[0].args
    role = rbac.read_cluster_role(f"{release}-nodepulse-agent")
    assert role.rules[1].resource_names == [f"{release}-nodepulse-agent-{o}-{i}"
                                            for o in range(2) for i in range(3)]
    policy = custom.get_cluster_custom_object("nodepulse.dev", "v1alpha1", "nodestatuspolicies",
                                              "e2e-helm-default")
    assert policy["spec"]["priority"] == -1000
    assert policy["spec"]["heartbeat"]["leaseDurationSeconds"] == 40  # the CRD's default

    # upgrade with changed values: more replicas and nodes, another priority and lease
    changed = dict(operator={"replicas": 3},
                   agent={"enabled": True, "replicas": 1, "nodesPerReplica": 4},
                   defaultPolicy={"enabled": True, "name": "e2e-helm-default", "priority": -5,
                                  "heartbeat": {"leaseDurationSeconds": 20}})
    out = tools.helm("upgrade", release, str(CHART), "--namespace", namespace, *values(**changed))
    assert "has been upgraded" in out.stdout
    assert apps.read_namespaced_deployment(f"{release}-nodepulse-operator",
                                           namespace).spec.replicas == 3
    assert apps.read_namespaced_stateful_set(f"{release}-nodepulse-agent",
                                             namespace).spec.replicas == 1
    assert rbac.read_cluster_role(f"{release}-nodepulse-agent").rules[1].resource_names == [
        f"{release}-nodepulse-agent-0-{i}" for i in range(4)]
    policy = custom.get_cluster_custom_object("nodepulse.dev", "v1alpha1", "nodestatuspolicies",
                                              "e2e-helm-default")
    assert policy["spec"]["priority"] == -5
    assert policy["spec"]["heartbeat"]["leaseDurationSeconds"] == 20

    # a second upgrade turns the agent and the policy off: Helm removes their objects
    out = tools.helm("upgrade", release, str(CHART), "--namespace", namespace, *values())
    after = _manifest_objects(tools, release, namespace)
    dropped = set(installed) - set(after)
    assert {k for k, _, _ in dropped} >= {"StatefulSet", "NodeStatusPolicy",
                                          "ValidatingAdmissionPolicy"}
    for kind, ns, name in dropped:
        _wait_gone(tools, kind, ns, name)
    assert tools.helm("history", release, "--namespace", namespace,
                      "-o", "json").stdout.count('"revision"') == 3

    out = tools.helm("uninstall", release, "--namespace", namespace)
    assert f'release "{release}" uninstalled' in out.stdout
    for kind, ns, name in set(installed) | set(after):
        _wait_gone(tools, kind, ns, name)
    # nor anything the controllers made from them (ReplicaSets, Pods)
    selector = f"app.kubernetes.io/instance={release}"
    deadline = time.monotonic() + 60
    while True:
        left = tools.kubectl("get", "all,pdb,sa,role,rolebinding", "-A", "-l", selector,
                             "-o", "name").stdout.split()
        left += tools.kubectl("get", "clusterrole,clusterrolebinding,nsp,"
                              "validatingadmissionpolicy,validatingadmissionpolicybinding",
                              "-l", selector, "-o", "name").stdout.split()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == []
    # the CRD stays, as Helm leaves CRDs
    assert _exists(tools, "crd", "", "nodestatuspolicies.nodepulse.dev")


def _wait_gone(tools: Tools, kind: str, namespace: str, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _exists(tools, kind, namespace, name):
        assert time.monotonic() < deadline, f"{kind} {namespace}/{name} still there"
        time.sleep(0.5)


# ---- the CRD as kubectl shows it

def test_kubectl_explain_nodestatuspolicy_failure(tools: Tools) -> None:
    out = tools.kubectl("explain", "nodestatuspolicy.spec.failure").stdout
    print(out)
    assert "GROUP:      nodepulse.dev" in out and "KIND:       NodeStatusPolicy" in out
    for field in ("gracePeriodSeconds", "taintUnreachable", "noExecuteTaintsPerMinute",
                  "maxUnreachableFraction"):
        assert field in out
    # each field says what it does, not only its type
    described: dict[str, str] = {}
    field = ""
    for line in out.split("FIELDS:", 1)[1].splitlines():
        if line.startswith("  ") and not line.startswith("    ") and "<" in line:
            field = line.split()[0]
            described[field] = ""
        elif field and line.strip():
            described[field] += line.strip() + " "
    assert set(described) == {"gracePeriodSeconds", "taintUnreachable",
                              "noExecuteTaintsPerMinute", "maxUnreachableFraction"}
    assert all(len(text) > 40 for text in described.values()), described


def test_kubectl_get_nsp_shows_the_printer_columns(tools: Tools) -> None:
    name = f"e2e-columns-{uuid.uuid4().hex[:6]}"
    body = {"apiVersion": "nodepulse.dev/v1alpha1", "kind": "NodeStatusPolicy",
            "metadata": {"name": name},
            "spec": {"nodeSelector": {"matchLabels": {"pool": name}}, "priority": 7}}
    tools.kubectl("apply", "-f", "-", stdin=json.dumps(body))
    try:
        out = tools.kubectl("get", "nsp", name).stdout
        print(out)
        header, row = out.strip().splitlines()
        assert header.split() == ["NAME", "SELECTOR", "PRIORITY", "NODES", "READY",
                                  "UNREACHABLE", "EFFECTIVE", "AGE"]
        assert row.split()[0] == name and "7" in row.split()
    finally:
        tools.kubectl("delete", "nsp", name, "--ignore-not-found")
