"""Volumes and env on the real control plane and containerd: one `nodepulse-agent` with
node credentials (system:node:<name>, under the Node authorizer and NodeRestriction, as
the API server here runs them).

What a container sees is read from its own output: each test pod's container prints what
it finds (file contents, modes, mounts, its environment) to its log, which containerd
writes under the agent's --root-dir; the test reads that file on the host.

- configMap, secret, emptyDir (disk and Memory) and the API server's kube-api-access
  projected volume (TokenRequest token, kube-root-ca.crt, namespace) exist inside the
  container with the modes asked for; the token is one the API server accepts, bound to
  the pod;
- a ConfigMap update reaches the running container through `..data`, without a restart;
- env from a ConfigMap and a Secret, `$(VAR)` in command, the service variables;
- a pod whose ConfigMap is missing waits (FailedMount, ContainerCreating), then starts
  when it is created;
- a pod with a volume type the agent does not implement is refused, naming the field;
- the Node authorizer: with the agent's own credentials, a ConfigMap or Secret that a
  pod bound to the node references can be read and watched one object at a time, the
  namespace cannot be listed, and an object no pod of the node references is refused.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness.namespaces import create_namespace
from e2e.harness.ports import free_port
from e2e.harness.processes import marked
from e2e.harness.waits import eventually, node_registered
from nodeagent.api.client import new_api_client
from nodepulse_dev import Cluster
from nodepulse_dev.images import BUSYBOX_IMAGE
from nodepulse_dev.processes import stop_process

AGENT = Path(sys.executable).parent / "nodepulse-agent"
TAINT_KEY = "nodepulse.dev/e2e-volumes"


@dataclass
class Node:
    name: str
    root: Path
    core: client.CoreV1Api  # the admin's
    own: client.CoreV1Api   # the node's own credentials
    namespace: str
    proc: subprocess.Popen[bytes]

    def pod(self, name: str, containers: list[dict[str, Any]], **spec: Any) -> client.V1Pod:
        body = {"metadata": {"name": name}, "spec": {
            "nodeName": self.name, "terminationGracePeriodSeconds": 1,
            "tolerations": [{"key": TAINT_KEY, "operator": "Exists"}],
            "containers": [{"image": BUSYBOX_IMAGE, "imagePullPolicy": "Never", **c}
                           for c in containers], **spec}}
        return self.core.create_namespaced_pod(self.namespace, body)

    def log(self, pod: str, container: str = "c") -> str:
        p = self.core.read_namespaced_pod(pod, self.namespace)
        path = (self.root / "logs" / "pods" / f"{self.namespace}_{pod}_{p.metadata.uid}"
                / container / "0.log")
        if not path.exists():
            return ""
        # CRI format: "<time> <stream> <P|F> <text>"
        return "\n".join(line.split(" ", 3)[3] for line in path.read_text().splitlines()
                         if line.count(" ") >= 3)

    def running(self, pod: str) -> bool:
        p = self.core.read_namespaced_pod(pod, self.namespace)
        return bool(p.status.container_statuses
                    and all(c.state.running for c in p.status.container_statuses))

    def waiting(self, pod: str) -> tuple[str, str] | None:
        p = self.core.read_namespaced_pod(pod, self.namespace)
        for c in p.status.container_statuses or []:
            if c.state.waiting:
                return c.state.waiting.reason, c.state.waiting.message or ""
        return None

    def events(self, pod: str) -> list[client.CoreV1Event]:
        return list(self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={pod}").items)

    def log_tail(self) -> str:
        return "\n".join((self.root / "agent.log").read_text(errors="replace")
                         .splitlines()[-40:])


def _unmount_under(base: Path) -> None:
    """A safety net: tmpfs mounts the agent made, should it not have removed them."""
    prefix = str(base.resolve()) + "/"
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if line.split()[4].startswith(prefix)]
    libc = ctypes.CDLL(None, use_errno=True)
    for point in sorted(points, key=len, reverse=True):
        libc.umount2(point.encode(), 2)


@pytest.fixture(scope="module")
def node(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    from nodepulse_dev.containerd import start_containerd
    name = f"vol-{uuid.uuid4().hex[:6]}"
    root = tmp_path_factory.mktemp(name)
    kubeconfig = cluster.node_kubeconfig(name)
    admin = cluster.api_client()
    own_api = new_api_client(kubeconfig)
    core = client.CoreV1Api(admin)
    ctd = start_containerd()
    argv = [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={root}", f"--healthz-bind-address=127.0.0.1:{free_port()}",
            f"--register-with-taints={TAINT_KEY}={name}:NoSchedule", *ctd.agent_flags]
    log = open(root / "agent.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    n = Node(name, root, core, client.CoreV1Api(own_api), name, proc)
    try:
        create_namespace(core, name)
        eventually(lambda: core.list_namespaced_config_map(
            name, field_selector="metadata.name=kube-root-ca.crt").items, "kube-root-ca.crt")
        node_registered(core, name, lambda: proc.poll() is None)
        yield n
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)
        with contextlib.suppress(AssertionError):
            eventually(lambda: not marked(name), "the agent's cleanup", 40)
        stop_process(proc)
        ctd.stop()
        _unmount_under(root)
        with contextlib.suppress(ApiException):
            core.delete_node(name)
        log.close()
        own_api.close()
        admin.close()


def configmap(n: Node, name: str, data: dict[str, str]) -> None:
    body = {"metadata": {"name": name}, "data": data}
    try:
        n.core.create_namespaced_config_map(n.namespace, body)
    except ApiException as e:
        if e.status != 409:
            raise
        n.core.replace_namespaced_config_map(name, n.namespace, body)


def secret(n: Node, name: str, data: dict[str, str]) -> None:
    n.core.create_namespaced_secret(n.namespace, {"metadata": {"name": name},
                                                  "stringData": data})


REPORT = """
stat -L -c 'mode %a %n' /cfg/greeting /sec/password /items/renamed /empty /mem \
  /var/run/secrets/kubernetes.io/serviceaccount/token
echo "cfg $(cat /cfg/greeting)"; echo "sec $(cat /sec/password)"
echo "renamed $(cat /items/renamed)"
echo "ns $(cat /var/run/secrets/kubernetes.io/serviceaccount/namespace)"
echo "token $(cat /var/run/secrets/kubernetes.io/serviceaccount/token)"
grep -q 'BEGIN CERTIFICATE' /var/run/secrets/kubernetes.io/serviceaccount/ca.crt && echo ca ok
mount | grep ' /mem ' | sed 's/^/mount /'
echo hi > /empty/x && echo empty writable
echo no > /cfg/x 2>/dev/null || echo cfg read-only
echo done
while true; do echo "now $(cat /cfg/greeting)"; sleep 1; done
"""


def test_volumes_inside_the_container(node: Node) -> None:
    n = node
    configmap(n, "cfg", {"greeting": "hello", "other": "x"})
    secret(n, "sec", {"password": "hunter2"})
    n.pod("vols", [{"name": "c", "command": ["sh", "-c", REPORT], "volumeMounts": [
        {"name": "cfg", "mountPath": "/cfg"}, {"name": "sec", "mountPath": "/sec"},
        {"name": "items", "mountPath": "/items"}, {"name": "empty", "mountPath": "/empty"},
        {"name": "mem", "mountPath": "/mem"}]}], volumes=[
        {"name": "cfg", "configMap": {"name": "cfg"}},
        {"name": "sec", "secret": {"secretName": "sec", "defaultMode": 0o400}},
        {"name": "items", "configMap": {"name": "cfg", "items": [
            {"key": "other", "path": "renamed", "mode": 0o600}]}},
        {"name": "empty", "emptyDir": {}},
        {"name": "mem", "emptyDir": {"medium": "Memory", "sizeLimit": "32Mi"}}])
    try:
        out = eventually(lambda: (lambda t: t if "done" in t else None)(n.log("vols")),
                         "the container's report", 90)
    except AssertionError:
        print(n.log_tail())
        raise
    lines = set(out.splitlines())
    assert {"mode 644 /cfg/greeting", "mode 400 /sec/password", "mode 600 /items/renamed",
            "mode 777 /empty", "mode 777 /mem",
            "mode 644 /var/run/secrets/kubernetes.io/serviceaccount/token"} <= lines, out
    assert {"cfg hello", "sec hunter2", "renamed x", f"ns {n.namespace}", "ca ok",
            "empty writable", "cfg read-only"} <= lines, out
    assert any(x.startswith("mount tmpfs on /mem type tmpfs") and "size=32768k" in x
               for x in lines), out
    # the token is the API server's, for the pod's service account, bound to the pod
    token = next(x for x in lines if x.startswith("token "))[6:]
    review = client.AuthenticationV1Api(n.core.api_client).create_token_review(
        {"spec": {"token": token}})
    assert review.status.authenticated, review.status
    assert review.status.user.username == f"system:serviceaccount:{n.namespace}:default"
    assert review.status.user.extra["authentication.kubernetes.io/pod-name"] == ["vols"]

    # an update reaches the running container through ..data, without a restart
    configmap(n, "cfg", {"greeting": "updated", "other": "x"})
    eventually(lambda: "now updated" in n.log("vols"), "the update inside the container", 60)
    p = n.core.read_namespaced_pod("vols", n.namespace)
    assert p.status.container_statuses[0].restart_count == 0


def test_env_from_objects_and_services(node: Node) -> None:
    n = node
    configmap(n, "env-cfg", {"COLOR": "blue", "SIZE": "10", "dashed-key": "kept"})
    secret(n, "env-sec", {"TOKEN": "s3cret"})
    n.core.create_namespaced_service(n.namespace, {"metadata": {"name": "backend"}, "spec": {
        "ports": [{"name": "http", "port": 8080}]}})
    # the shell's own /proc/<pid>/environ: what the runtime was given (this busybox's sh
    # does not pass a name that is not a shell identifier, such as dashed-key, on to
    # `env`); $$$$ is the shell's $$ once the agent has expanded the command ($$ -> $)
    script = ('echo "cmd $1"; env | sort; tr "\\0" "\\n" < /proc/$$$$/environ '
              '| sed "s/^/environ /"; echo done; sleep 3600')
    n.pod("env", [{"name": "c", "command": ["sh", "-c", script, "sh", "$(COLOR)-$(SIZE)"],
                   "envFrom": [{"configMapRef": {"name": "env-cfg"}},
                               {"prefix": "S_", "secretRef": {"name": "env-sec"}}],
                   "env": [{"name": "KEY", "valueFrom": {"secretKeyRef": {
                       "name": "env-sec", "key": "TOKEN"}}},
                       {"name": "MIX", "value": "$(COLOR)/$$(COLOR)/$(UNSET)"},
                       {"name": "MEM", "valueFrom": {"resourceFieldRef": {
                           "resource": "limits.memory", "divisor": "1Mi"}}}],
                   "resources": {"limits": {"memory": "64Mi"}}}])
    out = eventually(lambda: (lambda t: t if "done" in t else None)(n.log("env")),
                     "the container's environment", 90)
    lines = set(out.splitlines())
    assert {"cmd blue-10", "COLOR=blue", "SIZE=10", "S_TOKEN=s3cret", "KEY=s3cret",
            "MIX=blue/$(COLOR)/$(UNSET)", "MEM=64", "environ dashed-key=kept"} <= lines, out
    svc = n.core.read_namespaced_service("backend", n.namespace)
    ip = svc.spec.cluster_ip
    assert {f"BACKEND_SERVICE_HOST={ip}", "BACKEND_SERVICE_PORT=8080",
            "BACKEND_SERVICE_PORT_HTTP=8080", f"BACKEND_PORT=tcp://{ip}:8080",
            f"BACKEND_PORT_8080_TCP_ADDR={ip}"} <= lines, out
    assert any(x.startswith("KUBERNETES_SERVICE_HOST=") for x in lines), out


def test_missing_configmap_blocks_then_starts(node: Node) -> None:
    n = node
    n.pod("late", [{"name": "c", "command": ["sh", "-c", "cat /cfg/k; echo; sleep 3600"],
                    "volumeMounts": [{"name": "cfg", "mountPath": "/cfg"}]}],
          volumes=[{"name": "cfg", "configMap": {"name": "late-cfg"}}],
          automountServiceAccountToken=False)
    eventually(lambda: any(e.reason == "FailedMount" and 'configmap "late-cfg" not found'
                           in e.message for e in n.events("late")), "a FailedMount Event", 60)
    # the Event and the status are separate writes (the Event over connections of its
    # own), so the status may land a moment after the Event
    assert eventually(lambda: n.waiting("late"), "a waiting reason", 30) == \
        ("ContainerCreating", "")
    assert not n.running("late")
    configmap(n, "late-cfg", {"k": "arrived"})
    eventually(lambda: "arrived" in n.log("late"), "the pod started with its ConfigMap", 60)


def test_unsupported_volume_is_refused_by_name(node: Node) -> None:
    n = node
    n.pod("pvc", [{"name": "c", "command": ["sleep", "3600"],
                   "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
          volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "nope"}}],
          automountServiceAccountToken=False)
    reason, message = eventually(lambda: n.waiting("pvc"), "a waiting reason", 60)
    assert reason == "CreateContainerConfigError"
    assert "spec.volumes[0] ('data'): persistentVolumeClaim volumes are not supported" \
        in message
    eventually(lambda: any(e.reason == "Failed" and e.type == "Warning"
                           and "persistentVolumeClaim" in e.message
                           for e in n.events("pvc")), "a Warning Failed Event", 30)


def test_node_authorizer_allows_only_referenced_objects(node: Node) -> None:
    """The agent's own credentials: what its pods reference, one object at a time."""
    n = node
    configmap(n, "mine", {"k": "v"})
    configmap(n, "not-mine", {"k": "v"})
    secret(n, "mine-s", {"k": "v"})
    secret(n, "not-mine-s", {"k": "v"})
    n.pod("refs", [{"name": "c", "command": ["sleep", "3600"], "envFrom": [
        {"secretRef": {"name": "mine-s"}}],
        "volumeMounts": [{"name": "m", "mountPath": "/m"}]}],
        volumes=[{"name": "m", "configMap": {"name": "mine"}}],
        automountServiceAccountToken=False)
    own, ns = n.own, n.namespace
    # the graph learns of the pod a moment after it is created
    eventually(lambda: _allowed(lambda: own.read_namespaced_config_map("mine", ns)),
               "the node reading its pod's ConfigMap", 30)
    assert own.read_namespaced_secret("mine-s", ns).data["k"] == base64.b64encode(b"v").decode()
    listed = own.list_namespaced_config_map(ns, field_selector="metadata.name=mine")
    assert [c.metadata.name for c in listed.items] == ["mine"]
    w = own.list_namespaced_secret(ns, field_selector="metadata.name=mine-s", watch=True,
                                   timeout_seconds=1, _preload_content=False)
    assert w.status == 200
    w.release_conn()
    for call in (lambda: own.read_namespaced_config_map("not-mine", ns),
                 lambda: own.read_namespaced_secret("not-mine-s", ns),
                 lambda: own.list_namespaced_config_map(ns),
                 lambda: own.list_namespaced_secret(ns),
                 lambda: own.list_namespaced_config_map(
                     ns, field_selector="metadata.name=not-mine")):
        with pytest.raises(ApiException) as e:
            call()
        assert e.value.status == 403, e.value.body
    # and the agent itself read what the pod references with those credentials
    eventually(lambda: n.running("refs"), "the pod running", 60)


def _allowed(call: Any) -> bool:
    try:
        call()
    except ApiException as e:
        if e.status == 403:
            return False
        raise
    return True


def test_pod_folders_removed_with_the_pods(node: Node) -> None:
    n = node
    pods = {p.metadata.name: p.metadata.uid for p in n.core.list_namespaced_pod(n.namespace).items}
    uids = [uid for uid in pods.values() if (n.root / "pods" / uid).exists()]
    assert "vols" in pods and pods["vols"] in uids, (pods, uids)
    for p in n.core.list_namespaced_pod(n.namespace).items:
        n.core.delete_namespaced_pod(p.metadata.name, n.namespace)
    eventually(lambda: not any((n.root / "pods" / uid).exists() for uid in uids),
               "the pods' folders removed", 60)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(n.root.resolve()) + "/pods/" not in mounts
