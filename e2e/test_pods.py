"""Pods really run: issue 5's end-to-end scenarios on the real control plane, once with
containerd (CRI) and once with the process runtime.

One `nodepulse-agent` per runtime runs as a real process with node credentials
(system:node:<name>) and serves all four scenarios in order:

1. a Deployment of 3 pods is scheduled by the real kube-scheduler onto the agent's
   node and reaches Running;
2. SIGKILL to one container's process (PID from the runtime's own records: CRI
   ContainerStatus for containerd, the state file for the process runtime): PLEG
   reports ContainerDied within 2 relists (the agent's relist counter) and the
   container comes back with restartCount 1;
3. deleting a pod stops its containers before its deletionTimestamp (the grace
   period) and the agent completes the deletion;
4. a static pod (manifest in --pod-manifest-path) runs via the runtime and its mirror
   pod in the API reports it Running.

Placement: the node registers with a NoSchedule taint that only these pods tolerate
(no other test's pod lands on it), and the pods carry a nodeSelector for the node's
hostname label (they never land on the other nodes other tests leave registered,
which no node-lifecycle controller taints here).

Everything started here (agent, containerd, shims, containers) is stopped by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness.namespaces import create_namespace
from e2e.harness.ports import free_port
from e2e.harness.processes import alive, marked
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually, node_registered
from nodeagent.runtime.cri.gen import api_pb2 as pb
from nodeagent.runtime.cri.gen import api_pb2_grpc as pb_grpc
from nodepulse_dev import Cluster
from nodepulse_dev.images import BUSYBOX_IMAGE
from nodepulse_dev.processes import stop_process

AGENT = Path(sys.executable).parent / "nodepulse-agent"
TAINT_KEY = "nodepulse.dev/e2e-pods"
GRACE = 10
# exits at once on SIGTERM (a shell PID 1 ignores signals it does not trap)
WORKLOAD = ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done"]
T = TypeVar("T")


@dataclass
class Node:
    """One agent on one runtime, and the runtime under it."""
    name: str
    kind: str                      # "containerd" | "process"
    root: Path
    proc: subprocess.Popen[bytes]
    metrics_url: str
    manifests: Path
    core: client.CoreV1Api
    apps: client.AppsV1Api
    namespace: str
    ctd: Any = None                # nodepulse_dev.containerd.Containerd

    # -- the runtime's own records --
    def container_pid(self, container_id: str) -> int:
        """The PID of the container's workload, from the runtime's records."""
        scheme, _, cid = container_id.partition("://")
        if self.kind == "containerd":
            assert scheme == "containerd", container_id
            with self.ctd.channel() as ch:
                st = pb_grpc.RuntimeServiceStub(ch).ContainerStatus(
                    pb.ContainerStatusRequest(container_id=cid, verbose=True), timeout=10)
            return int(json.loads(st.info["info"])["pid"])
        assert scheme == "process", container_id
        rec = json.loads((self.root / "process" / "containers" / f"{cid}.json").read_text())
        wrapper = int(rec["pid"])  # the wrapper records the exit; its child is the workload
        children = Path(f"/proc/{wrapper}/task/{wrapper}/children").read_text().split()
        assert len(children) == 1, (wrapper, children)
        return int(children[0])

    def exited(self, container_id: str) -> bool:
        """The runtime itself has recorded the container's exit."""
        cid = container_id.partition("://")[2]
        if self.kind == "containerd":
            with self.ctd.channel() as ch:
                st = pb_grpc.RuntimeServiceStub(ch).ContainerStatus(
                    pb.ContainerStatusRequest(container_id=cid), timeout=10)
            return bool(st.status.state == pb.CONTAINER_EXITED)
        return (self.root / "process" / "containers" / f"{cid}.exit").exists()

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return str(r.read().decode())

    def pleg(self) -> tuple[float, float]:
        """(relists completed, ContainerDied events) from the agent's /metrics."""
        text = self.metrics()
        return (samples(text, "nodepulse_pleg_relist_duration_seconds_count", node=self.name),
                samples(text, "nodepulse_pleg_events_total", node=self.name,
                        type="ContainerDied"))

    def pods(self, **sel: str) -> list[client.V1Pod]:
        return list(self.core.list_namespaced_pod(self.namespace, **sel).items)

    def log_tail(self, n: int = 60) -> str:
        text = (self.root / "agent.log").read_text(errors="replace").splitlines()
        pods = [f"{p.metadata.name} node={p.spec.node_name} phase={p.status.phase} "
                f"conditions={[(c.type, c.status, c.message) for c in p.status.conditions or []]} "
                f"containers={p.status.container_statuses}"
                for p in self.pods()]
        return "\n".join(text[-n:] + pods)


def running(p: client.V1Pod) -> bool:
    st = p.status
    return bool(st and st.phase == "Running" and st.container_statuses
                and all(c.ready and c.state.running for c in st.container_statuses))


def pod_spec(node: str) -> dict[str, Any]:
    return {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "tolerations": [{"key": TAINT_KEY, "operator": "Equal", "value": node,
                         "effect": "NoSchedule"},
                        # added to every new Node by the TaintNodesByCondition admission
                        # plugin; what lifts it once the node is Ready (the operator, as
                        # the node-lifecycle controller is disabled) does not run here
                        {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "terminationGracePeriodSeconds": GRACE,
        "automountServiceAccountToken": False,
        "containers": [{
            "name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
            "command": WORKLOAD,
            "env": [{"name": "NP_E2E", "value": node},
                    {"name": "POD_NAME",
                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}]}


def start_runtime(kind: str, base: Path) -> tuple[Any, list[str]]:
    if kind == "process":
        return None, ["--runtime=process"]
    from nodepulse_dev.containerd import start_containerd  # says which package is missing
    ctd = start_containerd()
    return ctd, ctd.agent_flags


@pytest.fixture(scope="module", params=["containerd", "process"])
def node(request: pytest.FixtureRequest, cluster: Cluster,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    kind = str(request.param)
    name = f"pods-{'ctd' if kind == 'containerd' else 'proc'}-{os.getpid() % 10000}"
    root = tmp_path_factory.mktemp(name)
    manifests = root / "manifests"
    manifests.mkdir()
    kubeconfig = cluster.node_kubeconfig(name)  # before anything runs that needs stopping
    ctd, runtime_args = start_runtime(kind, root)
    admin = cluster.api_client()
    core, apps = client.CoreV1Api(admin), client.AppsV1Api(admin)
    ns = name
    port = free_port()
    argv = [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={root}", f"--healthz-bind-address=127.0.0.1:{port}",
            f"--pod-manifest-path={manifests}",
            f"--register-with-taints={TAINT_KEY}={name}:NoSchedule", *runtime_args]
    log = open(root / "agent.log", "ab")  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        log.close()
        if ctd is not None:
            ctd.stop()
        raise
    n = Node(name, kind, root, proc, f"http://127.0.0.1:{port}/metrics", manifests, core,
             apps, ns, ctd)
    try:
        create_namespace(core, ns)
        node_registered(core, name, lambda: proc.poll() is None)
        yield n
    finally:
        try:
            teardown(n)
        finally:
            log.close()
            admin.close()


def teardown(n: Node) -> None:
    """Remove the workloads through the agent (it must stop every container), then stop
    the agent and the runtime by PID, and sweep: no container process may be left."""
    with contextlib.suppress(ApiException):
        n.core.delete_namespace(n.namespace)
    for f in n.manifests.iterdir():
        f.unlink()
    cleaned = False
    if n.proc.poll() is None:
        with contextlib.suppress(AssertionError):
            cleaned = eventually(lambda: not marked(n.name), "the agent's cleanup", 40)
    stop_process(n.proc)
    if n.ctd is not None:
        n.ctd.stop()  # sandboxes, shims, containerd, by PID
    leftovers = marked(n.name)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ApiException):
        n.core.delete_node(n.name)
    assert not leftovers, f"processes left running: {leftovers}"
    assert cleaned, "the agent did not stop the containers of deleted pods"


def deployment(n: Node) -> dict[str, Any]:
    labels = {"app": "web"}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": n.namespace},
            "spec": {"replicas": 3, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": pod_spec(n.name)}}}


def web_running(n: Node) -> list[client.V1Pod] | None:
    pods = [p for p in n.pods(label_selector="app=web") if not p.metadata.deletion_timestamp]
    ok = len(pods) == 3 and all(running(p) and p.spec.node_name == n.name for p in pods)
    return pods if ok else None


def test_deployment_scheduled_and_running(node: Node) -> None:
    n = node
    n.apps.create_namespaced_deployment(n.namespace, deployment(n))
    try:
        pods = eventually(lambda: web_running(n), "3 pods Running on the agent's node", 90)
    except AssertionError:
        print(n.log_tail())
        raise
    for p in pods:
        assert p.status.host_ip and p.status.pod_ip and p.status.start_time
        cond = {c.type: c.status for c in p.status.conditions}
        assert cond["Ready"] == cond["ContainersReady"] == cond["PodScheduled"] == "True"
        assert n.container_pid(p.status.container_statuses[0].container_id) in marked(n.name)
    node_obj = n.core.read_node(n.name)
    assert {c.type: c.status for c in node_obj.status.conditions}["Ready"] == "True"
    runtime = node_obj.status.node_info.container_runtime_version
    assert runtime.startswith("containerd://" if n.kind == "containerd" else "process://")
    if n.kind == "containerd":  # images in NodeStatus come from the runtime
        assert any(BUSYBOX_IMAGE in (i.names or []) for i in node_obj.status.images or [])


def test_killed_container_restarts(node: Node) -> None:
    n = node
    pods = eventually(lambda: web_running(n), "3 pods Running")
    pod = pods[0]
    cs = pod.status.container_statuses[0]
    assert cs.restart_count == 0
    pid = n.container_pid(cs.container_id)
    died0 = n.pleg()[1]
    os.kill(pid, signal.SIGKILL)
    # counted from when the runtime knows (containerd takes a moment to handle the exit)
    eventually(lambda: n.exited(cs.container_id), "the runtime recording the exit", 10,
               every=0.02)
    relists0 = n.pleg()[0]

    def died() -> float | None:
        relists, events = n.pleg()
        return relists - relists0 + 0.5 if events > died0 else None  # 0.5: truthy at 0

    relists = eventually(died, "PLEG ContainerDied", 10, every=0.02) - 0.5
    print(f"[{n.kind}] ContainerDied reported {relists:.0f} relist(s) after the runtime "
          "recorded the exit")
    assert relists <= 2, f"ContainerDied reported after {relists:.0f} relists"

    def restarted() -> client.V1ContainerStatus | None:
        p = n.core.read_namespaced_pod(pod.metadata.name, n.namespace)
        c = p.status.container_statuses[0]
        return c if c.restart_count == 1 and c.state.running and c.ready else None

    c = eventually(restarted, "the container restarted with restartCount 1", 60)
    assert c.last_state.terminated is not None
    assert c.last_state.terminated.exit_code == 137  # SIGKILL
    assert c.container_id != cs.container_id
    new_pid = n.container_pid(c.container_id)
    assert new_pid != pid and alive(new_pid) and not alive(pid)


def test_deleted_pod_stops_within_grace(node: Node) -> None:
    n = node
    pod = eventually(lambda: web_running(n), "3 pods Running")[0]
    name = pod.metadata.name
    pid = n.container_pid(pod.status.container_statuses[0].container_id)
    # deletionTimestamp has whole seconds only: measure from the request instead
    deadline = time.time() + GRACE
    n.core.delete_namespaced_pod(name, n.namespace)
    deleting = n.core.read_namespaced_pod(name, n.namespace)
    assert deleting.metadata.deletion_grace_period_seconds == GRACE
    eventually(lambda: not alive(pid), "the container process to stop", GRACE + 5, every=0.05)
    stopped_at = time.time()
    print(f"[{n.kind}] container stopped {deadline - stopped_at:.1f}s before the "
          f"{GRACE}s grace period ended")
    assert stopped_at < deadline, f"stopped {stopped_at - deadline:.1f}s after the grace period"

    def gone() -> bool:
        try:
            n.core.read_namespaced_pod(name, n.namespace)
        except ApiException as e:
            return e.status == 404
        return False

    eventually(gone, "the agent to finish the deletion", 30)
    eventually(lambda: web_running(n), "the Deployment's replacement Running", 60)


def test_stubborn_pod_is_killed_when_grace_ends(node: Node) -> None:
    """A container that ignores SIGTERM is SIGKILLed when its grace period ends (the
    period starts when the agent begins the stop, just after the delete)."""
    n = node
    spec = pod_spec(n.name)
    spec["terminationGracePeriodSeconds"] = 3
    spec["containers"][0]["command"] = ["sh", "-c", "trap '' TERM; while true; do sleep 1; done"]
    n.core.create_namespaced_pod(n.namespace, {"metadata": {"name": "stubborn"}, "spec": spec})
    p = eventually(lambda: running(x := n.core.read_namespaced_pod("stubborn", n.namespace))
                   and x, "the stubborn pod Running")
    pid = n.container_pid(p.status.container_statuses[0].container_id)
    deadline = time.time() + 3
    n.core.delete_namespaced_pod("stubborn", n.namespace)
    time.sleep(2)
    assert alive(pid), "it ignores SIGTERM: it must still run before its grace ends"
    eventually(lambda: not alive(pid), "the stubborn container killed", 10, every=0.05)
    late = time.time() - deadline
    print(f"[{n.kind}] SIGTERM-ignoring container killed {late:+.2f}s after its 3s grace "
          "(counted from the delete request)")
    # The agent's grace period starts when the watch delivers the delete, normally ms
    # later, up to about a second on a loaded machine: a kill that waited for a relist
    # or a resync would be seconds late, one that did not wait for the grace early.
    assert -0.2 < late < 1.5, f"killed {late:+.1f}s from the end of its grace period"


def test_static_pod_with_mirror(node: Node) -> None:
    n = node
    manifest = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "static-web", "namespace": "default",
                             "labels": {"app": "static-web"}},
                "spec": {k: v for k, v in pod_spec(n.name).items()
                         if k not in ("nodeSelector", "tolerations")}}
    tmp = n.manifests / ".static-web.json.tmp"
    tmp.write_text(json.dumps(manifest))
    tmp.rename(n.manifests / "static-web.json")
    mirror_name = f"static-web-{n.name}"

    def mirror() -> client.V1Pod | None:
        try:
            p = n.core.read_namespaced_pod(mirror_name, "default")
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return p if running(p) else None

    try:
        p = eventually(mirror, "the mirror pod Running", 60)
    except AssertionError:
        print(n.log_tail())
        raise
    assert "kubernetes.io/config.mirror" in p.metadata.annotations
    assert p.spec.node_name == n.name
    pid = n.container_pid(p.status.container_statuses[0].container_id)
    assert pid in marked(n.name)
    (n.manifests / "static-web.json").unlink()
    eventually(lambda: not alive(pid), "the static pod to stop", GRACE + 10)

    def mirror_gone() -> bool:
        try:
            n.core.read_namespaced_pod(mirror_name, "default")
        except ApiException as e:
            return e.status == 404
        return False

    eventually(mirror_gone, "the mirror pod deleted", 30)
