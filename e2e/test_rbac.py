"""The chart's RBAC is enough and no more, proved with the chart's own identities.

The chart is installed; tokens for its two ServiceAccounts come from the TokenRequest
API; the operator and an agent then run as processes with only those tokens and do
their work (the agent registers its Node and keeps its Lease renewed, the operator
writes the effective policy onto the Node), while the things neither should do are
refused with 403.

A ServiceAccount is not a node identity: the Node authorizer and NodeRestriction, which
hold a kubelet's credentials to its own Node and Lease, do not apply to it. The chart
builds the same fence itself (RBAC resourceNames for every write but create, and a
ValidatingAdmissionPolicy for create), and the tests below check each side of it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client

from e2e.harness.helm import (
    Tools,
    tools_fixture,  # noqa: F401 (a fixture)
)
from e2e.harness.ports import free_port
from e2e.harness.release import (
    REFUSED,
    Release,
    event_body,
    identities_fixture,  # noqa: F401 (a fixture)
    node_body,
    release_fixture,  # noqa: F401 (a fixture)
)
from nodeagent.api.client import new_api_client
from nodeagent.api.policy import AGENT_LABEL, HEARTBEAT_ANNOTATION, decode_heartbeat_annotation
from nodepulse_dev import Cluster

T = TypeVar("T")
BIN = Path(sys.executable).parent


# ---- the rules, verb by verb, as the API server's authorizer judges them

def _allowed(cluster: Cluster, user: str, namespace: str, verb: str, resource: str,
             name: str = "", group: str = "", subresource: str = "") -> bool:
    auth = client.AuthorizationV1Api(cluster.api_client())
    ns = namespace.split(":", 1)[0]
    review = auth.create_subject_access_review(client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=user, groups=["system:serviceaccounts", f"system:serviceaccounts:{ns}",
                               "system:authenticated"],
            resource_attributes=client.V1ResourceAttributes(
                verb=verb, group=group, resource=resource, subresource=subresource or None,
                name=name or None, namespace=namespace.split(":", 1)[1] or None))))
    return bool(review.status.allowed)


def _matrix(rel: Release, foreign: str) -> dict[str, list[tuple[str, str, str, str, str, bool]]]:
    """(verb, group, resource[/subresource], namespace, name) -> allowed, per identity."""
    own, lease_ns, ns = rel.agent_node(0, 1), "kube-node-lease", rel.namespace
    election = f"{rel.name}-nodepulse-operator"
    np, co = "nodepulse.dev", "coordination.k8s.io"
    return {
        "operator": [
            ("list", "", "nodes", "", "", True), ("watch", "", "nodes", "", "", True),
            ("patch", "", "nodes", "", foreign, True),
            ("patch", "", "nodes/status", "", foreign, True),
            ("create", "", "nodes", "", "", False), ("delete", "", "nodes", "", foreign, False),
            ("update", "", "nodes", "", foreign, False),
            ("list", np, "nodestatuspolicies", "", "", True),
            ("watch", np, "nodestatuspolicies", "", "", True),
            ("patch", np, "nodestatuspolicies/status", "", rel.policy, True),
            ("patch", np, "nodestatuspolicies", "", rel.policy, False),
            ("create", np, "nodestatuspolicies", "", "", False),
            ("delete", np, "nodestatuspolicies", "", rel.policy, False),
            ("list", co, "leases", lease_ns, "", True), ("watch", co, "leases", lease_ns, "", True),
            ("update", co, "leases", lease_ns, own, False),
            ("delete", co, "leases", lease_ns, own, False),
            ("list", co, "leases", "kube-system", "", False),
            ("get", co, "leases", ns, election, True), ("patch", co, "leases", ns, election, True),
            ("update", co, "leases", ns, election, False),
            ("create", co, "leases", ns, "", True),
            ("update", co, "leases", ns, "someone-else", False),
            ("create", co, "leases", "kube-system", "", False),
            ("get", "", "secrets", ns, "any", False), ("list", "", "secrets", "", "", False),
            ("list", "", "pods", "", "", False), ("delete", "", "pods", ns, "any", False),
            # Events on Nodes: created, and patched to count a repeat; in "default" only
            ("create", "", "events", "default", "", True),
            ("patch", "", "events", "default", "any", True),
            ("update", "", "events", "default", "any", False),
            ("delete", "", "events", "default", "any", False),
            ("list", "", "events", "default", "", False),
            ("create", "", "events", ns, "", False), ("create", "", "events", "kube-system", "", False),
            ("create", "events.k8s.io", "events", "default", "", False),
            # kopf runs clusterwide: no Namespaces at all
            ("list", "", "namespaces", "", "", False), ("watch", "", "namespaces", "", "", False),
            ("get", "", "namespaces", "", ns, False), ("delete", "", "namespaces", "", ns, False),
            # kopf's resource observation: CRDs, read only
            ("list", "apiextensions.k8s.io", "customresourcedefinitions", "", "", True),
            ("watch", "apiextensions.k8s.io", "customresourcedefinitions", "", "", True),
            ("update", "apiextensions.k8s.io", "customresourcedefinitions", "",
             "nodestatuspolicies.nodepulse.dev", False),
        ],
        "agent": [
            ("get", "", "nodes", "", own, True), ("list", "", "nodes", "", "", True),
            ("watch", "", "nodes", "", "", True), ("create", "", "nodes", "", "", True),
            ("patch", "", "nodes", "", own, True), ("patch", "", "nodes/status", "", own, True),
            ("patch", "", "nodes", "", foreign, False),
            ("patch", "", "nodes/status", "", foreign, False),
            ("update", "", "nodes", "", own, False), ("delete", "", "nodes", "", own, False),
            ("patch", "", "nodes", "", rel.agent_node(0, 2), False),  # past nodesPerReplica
            ("patch", "", "nodes", "", rel.agent_node(1, 0), False),  # past replicas
            ("get", co, "leases", lease_ns, own, True), ("update", co, "leases", lease_ns, own, True),
            ("create", co, "leases", lease_ns, "", True),
            ("get", co, "leases", lease_ns, foreign, False),
            ("update", co, "leases", lease_ns, foreign, False),
            ("list", co, "leases", lease_ns, "", False),
            ("delete", co, "leases", lease_ns, own, False),
            ("create", co, "leases", ns, "", False),
            ("get", "", "secrets", ns, "any", False), ("list", "", "secrets", "", "", False),
            ("list", np, "nodestatuspolicies", "", "", False),
            ("patch", np, "nodestatuspolicies/status", "", rel.policy, False),
            # pods: read all, write only a pod's status and its final delete (admission
            # then holds both to pods bound to the agents' own nodes)
            ("list", "", "pods", "", "", True), ("watch", "", "pods", "", "", True),
            ("patch", "", "pods/status", ns, "any", True), ("delete", "", "pods", ns, "any", True),
            ("create", "", "pods", ns, "", False), ("patch", "", "pods", ns, "any", False),
            ("update", "", "pods", ns, "any", False), ("get", "", "configmaps", ns, "any", False),
            # Events: on its Nodes (in "default") and on pods (in the pods' namespaces)
            ("create", "", "events", "default", "", True), ("create", "", "events", ns, "", True),
            ("patch", "", "events", "default", "any", False),
            ("delete", "", "events", "default", "any", False),
        ],
    }


def test_rbac_rules_verb_by_verb(cluster: Cluster, release: Release) -> None:
    foreign = "some-other-node"
    wrong = []
    for who, rows in _matrix(release, foreign).items():
        sa = release.operator_sa if who == "operator" else release.agent_sa
        for verb, group, res, ns, name, expected in rows:
            resource, _, sub = res.partition("/")
            got = _allowed(cluster, release.user(sa), f"{release.namespace}:{ns}", verb,
                           resource, name, group, sub)
            print(f"{who:8} {verb:6} {group + '/' if group else ''}{res:28} "
                  f"{ns + '/' if ns else ''}{name:30} {'allowed' if got else 'denied'}")
            if got != expected:
                wrong.append((who, verb, group, res, ns, name, got))
    assert wrong == []


# ---- forbidden things, tried for real with the tokens

def _status(fn: Callable[[], Any]) -> tuple[int, str]:
    """The refusal's HTTP status and the API server's message."""
    with pytest.raises(client.ApiException) as refused:
        fn()
    try:
        message = str(json.loads(refused.value.body)["message"])
    except (TypeError, ValueError, KeyError):
        message = str(refused.value.body)
    return refused.value.status, message


def _lease(name: str) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now}}


@pytest.fixture
def foreign_node(cluster: Cluster) -> Iterator[str]:
    """A Node (and its Lease) the chart's agents do not own."""
    name = f"e2e-foreign-{uuid.uuid4().hex[:6]}"
    api = cluster.api_client()
    client.CoreV1Api(api).create_node(node_body(name))
    client.CoordinationV1Api(api).create_namespaced_lease("kube-node-lease", _lease(name))
    yield name
    with contextlib.suppress(client.ApiException):
        client.CoordinationV1Api(api).delete_namespaced_lease(name, "kube-node-lease")
    with contextlib.suppress(client.ApiException):
        client.CoreV1Api(api).delete_node(name)


def test_agent_identity_cannot_touch_what_it_does_not_own(
        cluster: Cluster, release: Release, identities: dict[str, Path], foreign_node: str) -> None:
    api = new_api_client(identities["agent"], component="e2e-agent-sa")
    core, coord = client.CoreV1Api(api), client.CoordinationV1Api(api)

    # RBAC: writes to a Node or Lease by name, when the name is not the agents'
    status, body = _status(lambda: core.patch_node(
        foreign_node, {"metadata": {"labels": {"stolen": "yes"}}}))
    assert status == 403 and "cannot patch resource \"nodes\"" in body
    status, _ = _status(lambda: core.patch_node_status(
        foreign_node, {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}))
    assert status == 403
    lease = client.CoordinationV1Api(cluster.api_client()).read_namespaced_lease(
        foreign_node, "kube-node-lease")
    lease.spec.holder_identity = release.agent_node(0, 0)
    status, _ = _status(lambda: coord.replace_namespaced_lease(foreign_node, "kube-node-lease",
                                                               lease))
    assert status == 403
    admin_core = client.CoreV1Api(cluster.api_client())
    assert "stolen" not in (admin_core.read_node(foreign_node).metadata.labels or {})

    # admission (what NodeRestriction would do for a kubelet): create under another name
    fence = f"may only act on its own nodes, named {release.agent_sa}-<ordinal>-<i>"
    squatter = f"e2e-squatter-{uuid.uuid4().hex[:6]}"
    status, body = _status(lambda: core.create_node(node_body(squatter)))
    assert status == 403
    assert fence in body and f'create nodes concerns node "{squatter}"' in body
    status, body = _status(lambda: core.create_node(node_body(release.agent_node(0, 2))))
    assert status == 403 and "i < 2" in body  # a name past nodesPerReplica
    status, body = _status(lambda: coord.create_namespaced_lease("kube-node-lease",
                                                                 _lease(squatter)))
    assert status == 403 and fence in body and "create leases" in body

    # pods: only those bound to its own nodes, and only their status and final delete
    pod = _pod(cluster, release.namespace, foreign_node)
    status, body = _status(lambda: core.patch_namespaced_pod_status(
        pod, release.namespace, {"status": {"phase": "Failed"}}))
    assert status == 403 and fence in body
    assert f'update pods/status concerns node "{foreign_node}"' in body
    status, body = _status(lambda: core.delete_namespaced_pod(pod, release.namespace))
    assert status == 403 and f'delete pods concerns node "{foreign_node}"' in body
    status, body = _status(lambda: core.patch_namespaced_pod(
        pod, release.namespace, {"metadata": {"labels": {"stolen": "yes"}}}))
    assert status == 403 and 'cannot patch resource "pods"' in body
    status, body = _status(lambda: core.create_namespaced_pod(release.namespace, _pod_body(
        "e2e-agent-made", release.agent_node(0, 0))))
    assert status == 403 and 'cannot create resource "pods"' in body
    admin_core.read_namespaced_pod(pod, release.namespace)  # still there
    # (no agent speaks for the foreign node, so nothing would finish a graceful delete)
    admin_core.delete_namespaced_pod(pod, release.namespace, grace_period_seconds=0)

    # Events: only about its own Nodes, or about pods whose source host is one of them
    # (the agent names the pod's node there, as the kubelet does)
    status, body = _status(lambda: core.create_namespaced_event("default", event_body(foreign_node)))
    assert status == 403 and f'create events concerns node "{foreign_node}"' in body
    own = release.agent_node(0, 0)
    status, body = _status(lambda: core.create_namespaced_event(
        release.namespace, event_body("p", release.namespace, kind="Pod", host=foreign_node)))
    assert status == 403 and f'create events concerns node "{foreign_node}"' in body
    status, body = _status(lambda: core.create_namespaced_event(
        release.namespace, event_body("p", release.namespace, kind="Pod")))
    assert status == 403 and 'create events concerns node ""' in body
    core.create_namespaced_event(release.namespace,
                                 event_body("p", release.namespace, kind="Pod", host=own))

    # nothing else at all
    status, _ = _status(lambda: core.list_namespaced_secret(release.namespace))
    assert status == 403
    status, _ = _status(lambda: core.list_namespaced_config_map(release.namespace))
    assert status == 403
    status, _ = _status(lambda: core.delete_node(foreign_node))
    assert status == 403


def _pod_body(name: str, node: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "c", "image": "busybox",
                                     "command": ["sleep", "3600"]}]}}


def _pod(cluster: Cluster, namespace: str, node: str) -> str:
    """A pod bound to `node`, made by the admin."""
    name = f"e2e-pod-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(cluster.api_client()).create_namespaced_pod(namespace, _pod_body(name, node))
    return name


def test_operator_identity_cannot_read_secrets_or_make_nodes(
        cluster: Cluster, release: Release, identities: dict[str, Path], foreign_node: str) -> None:
    api = new_api_client(identities["operator"], component="e2e-operator-sa")
    core = client.CoreV1Api(api)
    secret = client.V1Secret(metadata=client.V1ObjectMeta(name="e2e-secret"),
                             string_data={"password": "hunter2"})
    client.CoreV1Api(cluster.api_client()).create_namespaced_secret(release.namespace, secret)

    status, body = _status(lambda: core.read_namespaced_secret("e2e-secret", release.namespace))
    assert status == 403 and "cannot get resource \"secrets\"" in body
    status, _ = _status(lambda: core.list_secret_for_all_namespaces())
    assert status == 403
    status, _ = _status(lambda: core.create_node(node_body(f"e2e-op-{uuid.uuid4().hex[:6]}")))
    assert status == 403
    status, _ = _status(lambda: core.delete_node(foreign_node))
    assert status == 403
    status, _ = _status(lambda: client.CoordinationV1Api(api).delete_namespaced_lease(
        foreign_node, "kube-node-lease"))
    assert status == 403
    status, _ = _status(lambda: client.CustomObjectsApi(api).patch_cluster_custom_object(
        "nodepulse.dev", "v1alpha1", "nodestatuspolicies", release.policy,
        {"spec": {"priority": 5}}))
    assert status == 403
    # kopf runs clusterwide: the operator needs no Namespaces, and gets none
    status, body = _status(lambda: core.list_namespace())
    assert status == 403 and 'cannot list resource "namespaces"' in body
    # Events: its own about Nodes, in "default"; nowhere else, none deleted, and no
    # other component's Event written or rewritten (RBAC, then the admission policy)
    op = "nodepulse-operator"
    status, body = _status(lambda: core.create_namespaced_event(
        release.namespace, event_body(foreign_node, release.namespace, source=op)))
    assert status == 403 and 'cannot create resource "events"' in body
    fence = "the nodepulse operator may only write its own Events about Nodes"
    status, body = _status(lambda: core.create_namespaced_event(
        "default", event_body("some-pod", kind="Pod", source=op)))
    assert status == 403 and fence in body and "create events refused" in body
    status, body = _status(lambda: core.create_namespaced_event(
        "default", event_body(foreign_node, source="kubelet")))
    assert status == 403 and fence in body
    admin_core = client.CoreV1Api(cluster.api_client())
    theirs = admin_core.create_namespaced_event("default", event_body(foreign_node,
                                                                  source="kubelet"))
    status, body = _status(lambda: core.patch_namespaced_event(
        theirs.metadata.name, "default", {"count": 7, "source": {"component": op}}))
    assert status == 403 and fence in body and "update events refused" in body
    assert admin_core.read_namespaced_event(theirs.metadata.name, "default").count == 1
    made = core.create_namespaced_event("default", event_body(foreign_node, source=op))
    assert core.patch_namespaced_event(made.metadata.name, "default", {"count": 2}).count == 2
    status, _ = _status(lambda: core.patch_namespaced_event(
        made.metadata.name, "default", {"involvedObject": {"name": "elsewhere"}}))
    assert status == 403
    status, _ = _status(lambda: core.delete_namespaced_event(made.metadata.name, "default"))
    assert status == 403
    # ...and about a policy the controller manager overrides (coexist mode), which an
    # Event about a Node cannot be turned into
    about_policy = core.create_namespaced_event("default", event_body(
        release.policy, kind="NodeStatusPolicy", source=op, api_version="nodepulse.dev/v1alpha1"))
    status, body = _status(lambda: core.patch_namespaced_event(
        made.metadata.name, "default", {"involvedObject": {"kind": "NodeStatusPolicy"}}))
    assert status == 403 and fence in body
    for ev in (made, theirs, about_policy):
        admin_core.delete_namespaced_event(ev.metadata.name, "default")


# ---- the programs themselves, under those identities

@contextlib.contextmanager
def _process(args: list[str], log: Path, cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        # cwd elsewhere: the repository's operator/ folder would shadow the stdlib module
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _eventually(what: str, fn: Callable[[], T | None], procs: dict[str, tuple[Any, Path]],
                timeout: float = 90, describe: Callable[[], Any] | None = None) -> T:
    deadline = time.monotonic() + timeout
    while True:
        for name, (proc, log) in procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode} while waiting for "
                                     f"{what}:\n{log.read_text()[-4000:]}")
        value = fn()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n}\n{lg.read_text()[-3000:]}" for n, (_, lg) in procs.items())
            seen = f"last seen: {describe()}\n" if describe else ""
            raise AssertionError(f"timed out waiting for {what}\n{seen}{logs}")
        time.sleep(0.5)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _columns(table: str) -> dict[str, str]:
    """kubectl's one-row table as {column: cell}, cut at the header's positions (a cell
    may hold spaces, like "<all nodes>")."""
    header, row = table.rstrip("\n").splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    ends = starts[1:] + [None]
    return {header[s:e].strip(): row[s:e].strip() for s, e in zip(starts, ends, strict=True)}


def test_operator_and_agent_work_under_the_chart_identities(
        cluster: Cluster, tools: Tools, release: Release, identities: dict[str, Path],
        tmp_path: Path) -> None:
    """The agent registers, renews and follows its policy; the operator leads, writes
    the effective policy and the policy's status, marks the node unreachable when the
    agent stops and clears it when the agent is back: every write path of both,
    under the chart's ServiceAccounts, and not one request refused."""
    admin = cluster.api_client()
    core, coord = client.CoreV1Api(admin), client.CoordinationV1Api(admin)
    custom = client.CustomObjectsApi(admin)
    node = release.agent_node(0, 0)
    identity = f"e2e-operator-{uuid.uuid4().hex[:4]}"
    op_port, agent_port = free_port(), free_port()
    op_log = tmp_path / "operator.log"
    agent_logs: list[Path] = []

    # A malformed static manifest: the agent reports it with a Warning Event on its
    # Node, which its ServiceAccount may write (about its own nodes, in "default").
    manifests = tmp_path / "manifests"
    manifests.mkdir(mode=0o755)
    (manifests / "broken.yaml").write_text("apiVersion: v1\nkind: Pod\nmetadata: [unclosed\n")

    def agent_process(stack: contextlib.ExitStack) -> subprocess.Popen[bytes]:
        log = tmp_path / f"agent-{len(agent_logs)}.log"
        agent_logs.append(log)
        return stack.enter_context(_process(
            [str(BIN / "nodepulse-agent"), "--kubeconfig", str(identities["agent"]),
             "--node-name", node, "--root-dir", str(tmp_path / "agent-root"), "--runtime", "fake",
             "--pod-manifest-path", str(manifests),
             "--healthz-bind-address", f"127.0.0.1:{agent_port}"], log, tmp_path))

    def events_from(component: str) -> list[Any]:
        return [e for e in core.list_event_for_all_namespaces(
            field_selector=f"involvedObject.kind=Node,involvedObject.name={node}").items
            if e.source and e.source.component == component]

    def node_or_none() -> Any:
        try:
            return core.read_node(node)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def lease_spec() -> Any:
        try:
            return coord.read_namespaced_lease(node, "kube-node-lease").spec
        except client.ApiException:
            return None

    def holder() -> str | None:
        try:
            return str(coord.read_namespaced_lease(f"{release.name}-nodepulse-operator",
                                                   release.namespace).spec.holder_identity)
        except client.ApiException:
            return None

    def effective() -> Any:
        value = (node_or_none().metadata.annotations or {}).get(HEARTBEAT_ANNOTATION)
        return decode_heartbeat_annotation(value) if value else None

    def unreachable() -> tuple[bool, str | None]:
        n = node_or_none()
        tainted = any(t.key == "node.kubernetes.io/unreachable" and t.effect == "NoSchedule"
                      for t in n.spec.taints or [])
        ready = next((c.status for c in n.status.conditions or [] if c.type == "Ready"), None)
        return tainted, ready

    with contextlib.ExitStack() as op_stack:
        operator = op_stack.enter_context(_process(
            [str(BIN / "nodepulse-operator"), "--kubeconfig", str(identities["operator"]),
             "--leader-election-namespace", release.namespace,
             "--leader-election-name", f"{release.name}-nodepulse-operator",
             "--identity", identity, "--monitor-period", "1", "--metrics-port", str(op_port),
             *cluster.node_lifecycle_args()],
            op_log, tmp_path))
        with contextlib.ExitStack() as agent_stack:
            agent = agent_process(agent_stack)
            procs = {"agent": (agent, agent_logs[-1]), "operator": (operator, op_log)}

            registered = _eventually("the agent to register its Node", node_or_none, procs)
            assert registered.metadata.labels[AGENT_LABEL] == node
            assert _eventually("the operator to lead", lambda: holder() == identity, procs)

            policy, heartbeat = _eventually("the operator to write the effective policy",
                                            effective, procs)
            assert policy == release.policy
            assert (heartbeat.leaseDurationSeconds, heartbeat.renewIntervalSeconds) == (10, 2)

            # the agent follows the policy (duration 10 s) and keeps renewing its Lease
            _eventually("the agent to take the policy's lease duration",
                        lambda: (s := lease_spec()) is not None and s.lease_duration_seconds == 10,
                        procs)
            renewed: set[Any] = {lease_spec().renew_time}

            def renewals() -> bool:
                renewed.add(lease_spec().renew_time)
                return len(renewed) >= 3

            _eventually("two more Lease renewals", renewals, procs)
            assert lease_spec().holder_identity == node

            # the policy's status counts the node (the printer columns show real values)
            def status() -> Any:
                st = custom.get_cluster_custom_object(
                    "nodepulse.dev", "v1alpha1", "nodestatuspolicies", release.policy).get("status")
                return st if st and st.get("nodes", 0) >= 1 and st.get("readyNodes", 0) >= 1 else None

            st = _eventually("the policy status", status, procs)
            table = tools.kubectl("get", "nsp", release.policy).stdout
            print(table)
            row = _columns(table)
            assert list(row) == ["NAME", "SELECTOR", "PRIORITY", "NODES", "READY", "UNREACHABLE",
                                 "EFFECTIVE", "AGE"]
            assert row["EFFECTIVE"] == "True"  # exclusive mode: all of the policy applies
            assert row["NAME"] == release.policy and row["SELECTOR"] == "<all nodes>"
            assert row["PRIORITY"] == "-1000"
            assert (row["NODES"], row["READY"]) == (str(st["nodes"]), str(st["readyNodes"]))
            assert row["UNREACHABLE"] == str(st["unreachableNodes"])
            assert HEARTBEAT_ANNOTATION in tools.kubectl("describe", "node", node).stdout

            # a pod bound to the node: the agent runs it (fake runtime), writes its status
            # and, once it is deleted, finishes the deletion: all under its ServiceAccount
            pod = _pod(cluster, release.namespace, node)

            def phase() -> str | None:
                try:
                    return str(core.read_namespaced_pod(pod, release.namespace).status.phase)
                except client.ApiException as e:
                    if e.status == 404:
                        return "Gone"
                    raise

            assert _eventually("the agent to report the pod Running",
                               lambda: phase() == "Running", procs)
            core.delete_namespaced_pod(pod, release.namespace)  # graceful: the agent ends it
            assert _eventually("the agent to finish the pod's deletion",
                               lambda: phase() == "Gone", procs)

            assert _get(f"http://127.0.0.1:{agent_port}/healthz")[0] == 200
            code, metrics = _get(f"http://127.0.0.1:{op_port}/metrics")
            assert code == 200 and "nodepulse_operator_leader 1.0" in metrics
        # the agent is stopped: past the policy's 20 s grace the operator marks the node
        procs = {"operator": (operator, op_log)}
        assert _eventually("the unreachable taint and Ready=Unknown",
                           lambda: unreachable() == (True, "Unknown"), procs,
                           describe=lambda: (unreachable(), lease_spec()))
        # the operator's Events are posted after its writes: wait for them
        _eventually("the operator's Events on the node", lambda: {"TaintAdded", "NodeStatusUnknown"}
                    <= {e.reason for e in events_from("nodepulse-operator")}, procs)
        described = tools.kubectl("describe", "node", node).stdout
        print(described)
        assert "node.kubernetes.io/unreachable:NoSchedule" in described
        # the effective-policy annotation
        assert f"{HEARTBEAT_ANNOTATION}:" in described
        assert f'"policy":"{release.policy}"' in described
        # the operator's Ready=Unknown condition: its reason and its message
        ready_line = next(line for line in described.splitlines()
                          if line.strip().startswith("Ready ") and "Unknown" in line)
        assert "NodeStatusUnknown" in ready_line
        assert ("nodepulse-operator: the node's Lease has not been renewed for more than 20s "
                f"(grace period of policy {release.policy})") in ready_line
        # the Events: the operator's (Ready=Unknown, the taint) and the agent's (manifest)
        # (rows: Type Reason Age From Message; From is "component, instance")
        events = described.split("\nEvents:", 1)[1]
        rows = {line.split()[1]: line for line in events.splitlines()[3:]
                if len(line.split()) > 4}
        assert rows["NodeStatusUnknown"].split()[0] == "Warning"
        assert "nodepulse-operator" in rows["NodeStatusUnknown"]
        assert "Set Ready to Unknown" in rows["NodeStatusUnknown"]
        assert "nodepulse-operator" in rows["TaintAdded"]
        assert "node.kubernetes.io/unreachable:NoSchedule" in rows["TaintAdded"]
        uid = core.read_node(node).metadata.uid
        assert all(e.involved_object.uid == uid for e in events_from("nodepulse-operator"))

        with contextlib.ExitStack() as agent_stack:
            agent = agent_process(agent_stack)
            procs = {"agent": (agent, agent_logs[-1]), "operator": (operator, op_log)}
            assert _eventually("the taint gone and Ready=True once the Lease is renewed",
                               lambda: unreachable() == (False, "True"), procs,
                               describe=lambda: (unreachable(), lease_spec(),
                                                 _get(f"http://127.0.0.1:{op_port}/metrics")[1]))
            # the agent's own Event (the broken manifest), under its ServiceAccount
            _eventually("the agent's Event about the broken manifest", lambda: any(
                e.reason.startswith("StaticPod") for e in events_from("nodepulse-agent")), procs)
            _eventually("the operator's Event about the taint removed", lambda: "TaintRemoved"
                        in {e.reason for e in events_from("nodepulse-operator")}, procs)
            events = tools.kubectl("describe", "node", node).stdout.split("\nEvents:", 1)[1]
            print(events)
            assert any(line.split()[1].startswith("StaticPod") and "nodepulse-agent" in line
                       and "broken.yaml" in line for line in events.splitlines()[3:]
                       if len(line.split()) > 4), events
            assert any(line.split()[1] == "TaintRemoved" and "unreachable:NoSchedule" in line
                       for line in events.splitlines()[3:] if len(line.split()) > 4), events

    for log in [*agent_logs, op_log]:
        text = log.read_text()
        print(f"--- {log.name}\n{text[-2000:]}")
        # every call each made was allowed: nothing refused, nothing retried for it
        assert not REFUSED.search(text), f"{log.name}: refused something:\n{text[-4000:]}"
