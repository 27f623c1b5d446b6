"""A node's credentials reach only its own objects, and the agent's metrics/health
server listens where it is told (loopback unless told otherwise).

The real control plane runs the Node authorizer and the NodeRestriction admission
plugin; each node here acts with the client certificate a kubelet would have
(CN=system:node:<name>, O=system:nodes). Every refusal is paired with the same request
for the node's own object succeeding, so a refusal for an unrelated reason (a typo,
a missing object) would fail the test. e2e/test_cluster.py already shows reading and
replacing another node's Lease, patching its Node's labels and listing Secrets are
refused; this file covers the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.harness.ports import free_port, listening
from e2e.harness.waits import eventually
from nodeagent.api.client import new_api_client
from nodepulse_dev import Cluster
from nodepulse_dev.processes import stop_process

AGENT = Path(sys.executable).parent / "nodepulse-agent"
LEASES = "kube-node-lease"
MIRROR = "kubernetes.io/config.mirror"
AUDIENCE = "nodepulse-e2e"
RUN = uuid.uuid4().hex[:5]
AGENT_NUMBERS = itertools.count()  # each agent its own node name (and log file)


def refused(call: Callable[[], Any]) -> str:
    """Run call, which must be refused with 403; the API server's reason."""
    with pytest.raises(client.ApiException) as e:
        call()
    assert e.value.status == 403, (e.value.status, e.value.body)
    return str(e.value.body)


def pod_write_refused(call: Callable[[], Any], world: World, pod: str) -> str:
    """As refused(), for a write to an existing pod. NodeRestriction looks the pod up
    in the API server's informer cache, which may not hold a pod created a moment ago:
    it answers 404 then (and does nothing). Asked again until the cache has it."""
    deadline = time.monotonic() + 30
    while True:
        with pytest.raises(client.ApiException) as e:
            call()
        if e.value.status != 404 or time.monotonic() > deadline:
            break
        assert world.core.read_namespaced_pod(pod, world.ns).metadata.deletion_timestamp is None
        time.sleep(0.3)
    assert e.value.status == 403, (e.value.status, e.value.body)
    return str(e.value.body)


@dataclasses.dataclass
class Node:
    name: str
    api: client.ApiClient

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def leases(self) -> client.CoordinationV1Api:
        return client.CoordinationV1Api(self.api)


@dataclasses.dataclass
class World:
    admin: client.ApiClient
    a: Node
    b: Node
    ns: str

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.admin)


def lease_body(name: str) -> dict[str, Any]:
    t = time.time()  # MicroTime wants its fraction
    now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{max(1, int(t % 1 * 1e6)):06d}Z"
    return {"metadata": {"name": name, "namespace": LEASES},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now}}


def pod_body(name: str, node: str, secret: str | None = None,
             configmap: str | None = None, account: str | None = None) -> dict[str, Any]:
    volumes = []
    if secret:
        volumes.append({"name": "s", "secret": {"secretName": secret}})
    if configmap:
        volumes.append({"name": "c", "configMap": {"name": configmap}})
    spec = {"nodeName": node, "automountServiceAccountToken": False,
            "containers": [{"name": "c", "image": "nodepulse.test/pause:1"}],
            "volumes": volumes}
    if account:
        spec["serviceAccountName"] = account
        # what the kubelet requests a token for, and all a node may request one for
        volumes.append({"name": "t", "projected": {"sources": [{"serviceAccountToken": {
            "audience": AUDIENCE, "expirationSeconds": 600, "path": "token"}}]}})
    return {"metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="module")
def world(cluster: Cluster) -> Iterator[World]:
    """Nodes a and b (each registered with its own credentials, with its Lease), a
    namespace with a Secret, a ConfigMap and a ServiceAccount for each, and a pod on
    each using its own."""
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    a, b = (Node(f"ident-{RUN}-{x}", new_api_client(cluster.node_kubeconfig(f"ident-{RUN}-{x}")))
            for x in "ab")
    ns = f"ident-{RUN}"
    try:
        for n in (a, b):
            n.core.create_node({"metadata": {"name": n.name}})
            n.leases.create_namespaced_lease(LEASES, lease_body(n.name))
        core.create_namespace({"metadata": {"name": ns}})
        eventually(lambda: core.list_namespaced_service_account(ns).items,
                   "the namespace's default ServiceAccount", 60)
        for n in (a, b):
            core.create_namespaced_secret(ns, {"metadata": {"name": f"secret-{n.name}"},
                                               "stringData": {"k": n.name}})
            core.create_namespaced_config_map(ns, {"metadata": {"name": f"cm-{n.name}"},
                                                   "data": {"k": n.name}})
            core.create_namespaced_service_account(ns, {"metadata": {"name": f"sa-{n.name}"}})
            core.create_namespaced_pod(ns, pod_body(f"pod-{n.name}", n.name, f"secret-{n.name}",
                                                    f"cm-{n.name}", f"sa-{n.name}"))
        core.create_namespaced_secret(ns, {"metadata": {"name": "unused"},
                                           "stringData": {"k": "nobody's"}})
        yield World(admin, a, b, ns)
    finally:
        # pods bound to a node with no kubelet would wait for it forever: force them
        for p in core.list_namespaced_pod(ns).items if _exists(core, ns) else []:
            core.delete_namespaced_pod(p.metadata.name, ns, grace_period_seconds=0)
        if _exists(core, ns):
            core.delete_namespace(ns)
        coord = client.CoordinationV1Api(admin)
        for n in (a, b):
            _delete(functools.partial(coord.delete_namespaced_lease, n.name, LEASES))
            _delete(functools.partial(core.delete_node, n.name))


def _delete(call: Callable[[], Any]) -> None:
    try:
        call()
    except client.ApiException as e:
        if e.status != 404:
            raise


def _exists(core: client.CoreV1Api, ns: str) -> bool:
    try:
        core.read_namespace(ns)
        return True
    except client.ApiException as e:
        if e.status == 404:
            return False
        raise


# ---- Node objects
def test_a_node_cannot_update_delete_or_create_another_node(world: World) -> None:
    a, b = world.a, world.b
    before = world.core.read_node(b.name)
    refused(lambda: a.core.read_node(b.name))  # only its own Node, since 1.34
    node_b = world.core.read_node(b.name)
    node_b.metadata.labels = {**(node_b.metadata.labels or {}), "taken-by": a.name}
    refused(lambda: a.core.replace_node(b.name, node_b))
    status = {"status": {"conditions": [{"type": "Ready", "status": "False",
                                         "reason": "Spoofed", "message": f"by {a.name}"}]}}
    refused(lambda: a.core.patch_node_status(b.name, status))
    refused(lambda: a.core.replace_node_status(b.name, node_b))
    refused(lambda: a.core.delete_node(b.name))
    other = f"ident-{RUN}-c"
    refused(lambda: a.core.create_node({"metadata": {"name": other}}))
    after = world.core.read_node(b.name)
    assert after.metadata.resource_version == before.metadata.resource_version
    assert after.metadata.deletion_timestamp is None
    with pytest.raises(client.ApiException) as gone:
        world.core.read_node(other)
    assert gone.value.status == 404
    # the same requests for its own Node go through
    assert a.core.patch_node_status(a.name, status).status.conditions[0].reason == "Spoofed"
    own = a.core.read_node(a.name)
    own.metadata.labels = {**(own.metadata.labels or {}), "checked": "yes"}
    assert a.core.replace_node(a.name, own).metadata.labels["checked"] == "yes"


# ---- Leases
def test_a_node_cannot_patch_delete_or_create_another_nodes_lease(world: World) -> None:
    a, b = world.a, world.b
    coord = client.CoordinationV1Api(world.admin)
    before = coord.read_namespaced_lease(b.name, LEASES)
    merge = "application/merge-patch+json"
    refused(lambda: a.leases.patch_namespaced_lease(b.name, LEASES, lease_body(a.name),
                                                    _content_type=merge))
    refused(lambda: a.leases.delete_namespaced_lease(b.name, LEASES))
    refused(lambda: a.leases.create_namespaced_lease(LEASES, lease_body(f"ident-{RUN}-c")))
    # nor any Lease elsewhere under its own name
    body = {**lease_body(a.name), "metadata": {"name": a.name, "namespace": "default"}}
    refused(lambda: a.leases.create_namespaced_lease("default", body))
    assert coord.read_namespaced_lease(b.name, LEASES).metadata.resource_version == \
        before.metadata.resource_version
    renewed = a.leases.patch_namespaced_lease(a.name, LEASES, lease_body(a.name),
                                              _content_type=merge)
    assert renewed.spec.holder_identity == a.name


# ---- pods
def test_a_node_cannot_touch_pods_bound_to_another_node(world: World) -> None:
    a, b, ns = world.a, world.b, world.ns
    pod_b = f"pod-{b.name}"
    before = world.core.read_namespaced_pod(pod_b, ns)
    status = {"status": {"phase": "Failed", "message": f"spoofed by {a.name}"}}
    refused(lambda: a.core.patch_namespaced_pod_status(pod_b, ns, status))
    refused(lambda: a.core.replace_namespaced_pod_status(pod_b, ns, before))
    pod_write_refused(lambda: a.core.delete_namespaced_pod(pod_b, ns), world, pod_b)
    refused(lambda: a.core.patch_namespaced_pod(pod_b, ns, {"metadata": {"labels": {"x": "y"}}}))
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": pod_b, "namespace": ns}}
    pod_write_refused(lambda: a.core.create_namespaced_pod_eviction(pod_b, ns, eviction),
                      world, pod_b)
    after = world.core.read_namespaced_pod(pod_b, ns)
    assert after.metadata.resource_version == before.metadata.resource_version
    assert after.metadata.deletion_timestamp is None
    # b itself may write its pod's status
    mine = {"status": {"phase": "Running", "message": "by its own node"}}
    assert b.core.patch_namespaced_pod_status(pod_b, ns, mine).status.phase == "Running"


# ---- Secrets, ConfigMaps and ServiceAccount tokens follow the pods bound to the node
def allowed(call: Callable[[], Any]) -> Any:
    """call's result, or None while it is refused (403): the Node authorizer's graph
    follows pods through a watch, so a new pod's objects become readable a moment later."""
    try:
        return call()
    except client.ApiException as e:
        if e.status != 403:
            raise
        return None


def test_a_node_reads_only_secrets_of_its_own_pods(world: World) -> None:
    a, b, ns = world.a, world.b, world.ns

    def reads(name: str) -> Any:
        return allowed(functools.partial(a.core.read_namespaced_secret, name, ns))
    mine = eventually(lambda: reads(f"secret-{a.name}"), "node a may read its pod's Secret")
    assert mine.data["k"]
    assert a.core.read_namespaced_config_map(f"cm-{a.name}", ns).data == {"k": a.name}
    refused(lambda: a.core.read_namespaced_secret(f"secret-{b.name}", ns))
    refused(lambda: a.core.read_namespaced_config_map(f"cm-{b.name}", ns))
    refused(lambda: a.core.read_namespaced_secret("unused", ns))
    refused(lambda: a.core.list_namespaced_config_map(ns))
    # the access comes and goes with the pod
    world.core.create_namespaced_secret(ns, {"metadata": {"name": "passing"},
                                             "stringData": {"k": "v"}})
    refused(lambda: a.core.read_namespaced_secret("passing", ns))
    world.core.create_namespaced_pod(ns, pod_body("passing", a.name, "passing"))
    eventually(lambda: reads("passing"), "node a may read the new pod's Secret")
    world.core.delete_namespaced_pod("passing", ns, grace_period_seconds=0)
    eventually(lambda: reads("passing") is None, "node a loses its former pod's Secret")


def token_request(pod: Any | None, audience: str = AUDIENCE) -> dict[str, Any]:
    spec: dict[str, Any] = {"audiences": [audience], "expirationSeconds": 600}
    if pod is not None:
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod",
                                  "name": pod.metadata.name, "uid": pod.metadata.uid}
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}


def test_a_node_gets_tokens_only_for_its_own_pods(world: World) -> None:
    a, b, ns = world.a, world.b, world.ns
    pod_a = world.core.read_namespaced_pod(f"pod-{a.name}", ns)
    pod_b = world.core.read_namespaced_pod(f"pod-{b.name}", ns)
    token = eventually(lambda: allowed(functools.partial(
        a.core.create_namespaced_service_account_token, f"sa-{a.name}", ns,
        token_request(pod_a))), "a token for a's pod")
    assert token.status.token
    # another node's pod's account; its own account bound to another node's pod;
    # unbound; for an audience its pod does not use
    refused(lambda: a.core.create_namespaced_service_account_token(
        f"sa-{b.name}", ns, token_request(pod_b)))
    refused(lambda: a.core.create_namespaced_service_account_token(
        f"sa-{a.name}", ns, token_request(pod_b)))
    refused(lambda: a.core.create_namespaced_service_account_token(
        f"sa-{a.name}", ns, token_request(None)))
    refused(lambda: a.core.create_namespaced_service_account_token(
        f"sa-{a.name}", ns, token_request(pod_a, "https://elsewhere.example")))


# ---- mirror pods (the API's copy of a static pod)
def mirror_body(world: World, name: str, node: str, owner: str | None,
                annotate: bool = True, secret: str | None = None) -> dict[str, Any]:
    body = pod_body(name, node, secret)
    body["spec"].pop("automountServiceAccountToken")
    if annotate:
        body["metadata"]["annotations"] = {MIRROR: "e2e"}
    if owner:
        uid = world.core.read_node(owner).metadata.uid
        body["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node",
                                                "name": owner, "uid": uid, "controller": True}]
    return body


@pytest.mark.parametrize(("case", "node", "owner", "annotate", "secret", "why"), [
    ("bound to another node", "b", "b", True, False, "spec.nodeName set to itself"),
    ("owned by another node", "a", "b", True, False, "owner reference set to itself"),
    ("with no owner", "a", None, True, False, "owner reference set to itself"),
    ("not a mirror pod", "a", "a", False, False, "can only create mirror pods"),
    ("referencing a Secret", "a", "a", True, True, "mirror pod may not reference secrets"),
])
def test_a_node_cannot_create_mirror_pods_for_another_node(
        world: World, case: str, node: str, owner: str | None, annotate: bool,
        secret: bool, why: str) -> None:
    a = world.a
    names = {"a": world.a.name, "b": world.b.name}
    name = f"mirror-{case.replace(' ', '-')}"
    body = mirror_body(world, name, names[node], owner and names[owner], annotate,
                       f"secret-{a.name}" if secret else None)
    reason = refused(lambda: a.core.create_namespaced_pod(world.ns, body))
    assert why in reason, reason  # refused by NodeRestriction, for this reason
    with pytest.raises(client.ApiException) as gone:
        world.core.read_namespaced_pod(name, world.ns)
    assert gone.value.status == 404


def test_a_node_creates_its_own_mirror_pod(world: World) -> None:
    a = world.a
    body = mirror_body(world, "mirror-own", a.name, a.name)
    created = a.core.create_namespaced_pod(world.ns, body)
    assert created.spec.node_name == a.name
    assert created.metadata.annotations[MIRROR] == "e2e"
    # ...and b cannot delete it
    pod_write_refused(lambda: world.b.core.delete_namespaced_pod("mirror-own", world.ns),
                      world, "mirror-own")
    a.core.delete_namespaced_pod("mirror-own", world.ns, grace_period_seconds=0)


# ---- the agent's metrics/health server
def local_addresses() -> set[str]:
    """Every IPv4 address of this machine (the kernel's local routing table)."""
    out, prev = set(), ""
    for line in Path("/proc/net/fib_trie").read_text().splitlines():
        if "/32 host LOCAL" in line:
            out.add(prev.split()[-1])
        prev = line
    return out


def get(host: str, port: int, path: str = "/metrics") -> int:
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def refuses(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


class Agent:
    def __init__(self, cluster: Cluster, root: Path, name: str, *flags: str) -> None:
        self.cluster, self.name = cluster, name
        self.log = cluster.log_dir / f"agent-{name}.log"
        argv = [str(AGENT), "--node-name", name, "--kubeconfig",
                str(cluster.node_kubeconfig(name)), "--root-dir", str(root / name),
                "--runtime", "fake", *flags]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def listening(self) -> set[tuple[str, int]]:
        """Where the agent's health server listens: every socket but the kubelet API's,
        which listens on every address (--address 0.0.0.0, like the kubelet's)."""
        assert self.proc.poll() is None, \
            f"agent exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
        return {(host, port) for host, port in listening(self.proc.pid)
                if host not in ("0.0.0.0", "::")}

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def agents(cluster: Cluster, tmp_path: Path) -> Iterator[Callable[..., Agent]]:
    started: list[Agent] = []

    def start(*flags: str) -> Agent:
        agent = Agent(cluster, tmp_path, f"ident-{RUN}-agent-{next(AGENT_NUMBERS)}", *flags)
        started.append(agent)
        return agent
    yield start
    core = client.CoreV1Api(cluster.api_client())
    for agent in started:
        agent.stop()
        try:
            core.delete_node(agent.name)
        except client.ApiException as e:
            if e.status != 404:
                raise


def test_health_server_listens_on_loopback_only_by_default(
        agents: Callable[..., Agent]) -> None:
    """No --healthz-bind-address: 127.0.0.1:10248, as the kubelet's healthz."""
    eventually(lambda: not any(port == 10248 for _, port in listening()),
               "port 10248 free (another agent with the default may be running)", 60)
    agent = agents()
    assert eventually(agent.listening, "the agent listening", 60) == {("127.0.0.1", 10248)}
    assert get("127.0.0.1", 10248) == 200
    others = local_addresses() - {"127.0.0.1"}
    assert any(not ip.startswith("127.") for ip in others), others  # something to try
    for ip in sorted(others):
        assert refuses(ip, 10248), ip


def test_health_server_port_only_stays_on_loopback(agents: Callable[..., Agent]) -> None:
    agent = agents("--healthz-bind-address", ":0")
    [(host, port)] = eventually(agent.listening, "the agent listening", 60)
    assert host == "127.0.0.1" and port > 0
    assert get(host, port, "/healthz") in (200, 500)  # served (500 until the first renewal)
    for ip in sorted(local_addresses() - {"127.0.0.1"}):
        assert refuses(ip, port), ip


@pytest.mark.parametrize("host", ["127.0.0.2", "::1"])
def test_health_server_listens_on_the_configured_address(
        agents: Callable[..., Agent], host: str) -> None:
    port = free_port()
    agent = agents("--healthz-bind-address", f"[{host}]:{port}" if ":" in host
                   else f"{host}:{port}")
    assert eventually(agent.listening, "the agent listening", 60) == {(host, port)}
    assert get(host, port) == 200
    assert refuses("127.0.0.1", port)


def test_health_server_can_be_turned_off(agents: Callable[..., Agent], cluster: Cluster) -> None:
    agent = agents("--healthz-bind-address", "")
    core = client.CoreV1Api(cluster.api_client())
    eventually(lambda: _node_exists(core, agent.name), "the agent registered its Node", 60)
    assert agent.listening() == set()


def _node_exists(core: client.CoreV1Api, name: str) -> bool:
    try:
        core.read_node(name)
        return True
    except client.ApiException as e:
        if e.status == 404:
            return False
        raise
