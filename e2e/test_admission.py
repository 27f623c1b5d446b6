"""Node admission on the real control plane and containerd: pods bound to the agent's node
with `spec.nodeName` (no scheduler between them and the node) that the node cannot run
are refused as the kubelet refuses them: phase Failed, the kubelet's reason, "Pod was
rejected: ...", a Warning Event, nothing started; the pods already running are left
alone.

One `nodepulse-agent` with `--max-pods=3` on a private containerd serves every case, in
order: a pod with a host port runs; then a pod asking 900Gi of memory, one asking 500
CPUs, one asking the same host port and one whose nodeSelector the Node does not match
are refused; two more pods run (three in all) and a fourth is refused for want of room.

Everything started here (agent, containerd, shims, containers) is stopped by PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
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
from nodeagent.api.quantity import parse_quantity
from nodepulse_dev import Cluster
from nodepulse_dev.images import BUSYBOX_IMAGE
from nodepulse_dev.processes import stop_process

AGENT = Path(sys.executable).parent / "nodepulse-agent"
TAINT_KEY = "nodepulse.dev/e2e-admission"
WORKLOAD = ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done"]
GI = 2**30


@dataclass
class Node:
    name: str
    root: Path
    proc: subprocess.Popen[bytes]
    core: client.CoreV1Api
    namespace: str
    host_port: int
    ctd: Any  # nodepulse_dev.containerd.Containerd

    def pod(self, name: str) -> client.V1Pod:
        return self.core.read_namespaced_pod(name, self.namespace)

    def create(self, name: str, requests: dict[str, str] | None = None,
               host_port: int = 0, **spec: Any) -> None:
        """A pod bound to the node by spec.nodeName."""
        container: dict[str, Any] = {
            "name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
            "command": WORKLOAD, "env": [{"name": "NP_E2E", "value": self.name}]}
        if requests:
            container["resources"] = {"requests": requests}
        if host_port:
            container["ports"] = [{"containerPort": 8080, "hostPort": host_port}]
        self.core.create_namespaced_pod(self.namespace, {
            "metadata": {"name": name},
            "spec": {"nodeName": self.name, "terminationGracePeriodSeconds": 5,
                     "automountServiceAccountToken": False, "containers": [container],
                     **spec}})

    def log_tail(self, n: int = 40) -> str:
        return "\n".join((self.root / "agent.log").read_text(errors="replace")
                         .splitlines()[-n:])


@pytest.fixture(scope="module")
def node(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    from nodepulse_dev.containerd import start_containerd  # says which package is missing
    name = f"admit-{os.getpid() % 10000}"
    root = tmp_path_factory.mktemp(name)
    kubeconfig = cluster.node_kubeconfig(name)
    ctd = start_containerd()
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    argv = [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={root}", "--healthz-bind-address=", "--max-pods=3",
            # keeps the scheduler's pods off; the kubelet's admission does not look at it
            f"--register-with-taints={TAINT_KEY}={name}:NoSchedule",
            *ctd.agent_flags]
    log = open(root / "agent.log", "ab")  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        log.close()
        ctd.stop()
        raise
    n = Node(name, root, proc, core, name, free_port(), ctd)
    try:
        create_namespace(core, name)
        node_registered(core, name, lambda: proc.poll() is None)
        yield n
    finally:
        try:
            with contextlib.suppress(ApiException):
                core.delete_namespace(name)
            if proc.poll() is None:
                with contextlib.suppress(AssertionError):
                    eventually(lambda: not marked(name), "the agent's cleanup", 30)
            stop_process(proc)
            ctd.stop()  # sandboxes, shims, containerd, by PID
            leftovers = marked(name)
            for pid in leftovers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ApiException):
                core.delete_node(name)
            assert not leftovers, f"processes left running: {leftovers}"
        finally:
            log.close()
            admin.close()


def running(p: client.V1Pod) -> bool:
    cs = p.status.container_statuses or []
    return p.status.phase == "Running" and bool(cs) and all(c.state.running for c in cs)


def refused(n: Node, name: str, reason: str, message: str) -> None:
    """Failed with the kubelet's reason and message, a Warning Event of that reason, and
    no container of it ever made."""
    def failed() -> client.V1Pod | None:
        p = n.pod(name)
        return p if p.status.phase == "Failed" else None
    try:
        p = eventually(failed, f"pod {name} Failed", 30)
    except AssertionError:
        print(n.log_tail())
        raise
    print(f"pod {name}: {p.status.phase} {p.status.reason}: {p.status.message}")
    assert (p.status.reason, p.status.message) == (reason, f"Pod was rejected: {message}")
    assert not p.status.container_statuses or all(
        c.container_id is None for c in p.status.container_statuses)

    def event() -> client.CoreV1Event | None:
        events = n.core.list_namespaced_event(
            n.namespace, field_selector=f"involvedObject.name={name}").items
        return next((e for e in events if e.reason == reason and e.type == "Warning"), None)
    assert eventually(event, f"a Warning Event {reason} for pod {name}", 15).message == message


def test_pods_the_node_cannot_run_are_refused_and_running_ones_untouched(node: Node) -> None:
    n = node
    n.create("web", host_port=n.host_port)
    try:
        web = eventually(lambda: running(p := n.pod("web")) and p, "pod web Running", 60)
    except AssertionError:
        print(n.log_tail())
        raise
    container = web.status.container_statuses[0].container_id

    n.create("huge", {"memory": "900Gi"})
    n.create("cpus", {"cpu": "500"})
    n.create("clash", host_port=n.host_port)
    n.create("ssd", nodeSelector={"disk": "ssd"})
    allocatable = n.core.read_node(n.name).status.allocatable
    memory = round(parse_quantity(allocatable["memory"]))
    millicores = round(parse_quantity(allocatable["cpu"]) * 1000)
    refused(n, "huge", "OutOfmemory", f"Node didn't have enough resource: memory, requested: "
            f"{900 * GI}, used: 0, capacity: {memory}")
    refused(n, "cpus", "OutOfcpu", f"Node didn't have enough resource: cpu, requested: "
            f"500000, used: 0, capacity: {millicores}")
    refused(n, "clash", "NodePorts", "Predicate NodePorts failed: node(s) didn't have free "
            "ports for the requested pod ports")
    refused(n, "ssd", "NodeAffinity", "Predicate NodeAffinity failed: node(s) didn't match "
            "Pod's node affinity/selector")

    # refused pods hold no place: two more run, three in all, and a fourth has no room
    n.create("second")
    n.create("third")
    eventually(lambda: running(n.pod("second")) and running(n.pod("third")),
               "pods second and third Running", 60)
    n.create("fourth")
    refused(n, "fourth", "OutOfpods", "Node didn't have enough resource: pods, requested: 1, "
            "used: 3, capacity: 3")

    web = n.pod("web")
    assert running(web)
    st = web.status.container_statuses[0]
    assert (st.container_id, st.restart_count) == (container, 0)
