"""Probes, pod conditions and container lifecycle on the real control plane and
containerd: one agent, pods of busybox and agnhost (built here, e2e/conformance/images).

- a readiness probe that always fails: Ready False, and the Service's endpoint not ready;
- a failing liveness probe: the container restarted (restartCount 1) with the kubelet's
  Unhealthy and Killing Events; the preStop hook ran before the kill;
- httpGet, tcpSocket and grpc probes against real servers in containers;
- postStart (its failure kills the container: FailedPostStartHook);
- termination messages from the file and from the log (FallbackToLogsOnError);
- activeDeadlineSeconds: the pod Failed with DeadlineExceeded;
- readiness gates set by someone else through the API;
- a sidecar init container with a startup probe starts before the app container.

Everything started here is stopped by PID; the namespace and Node are deleted.
"""

from __future__ import annotations

import contextlib
import os
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
from e2e.harness.waits import eventually, node_registered
from nodepulse_dev import Cluster
from nodepulse_dev.images import BUSYBOX_IMAGE
from nodepulse_dev.processes import stop_process

AGENT = Path(sys.executable).parent / "nodepulse-agent"
TAINT_KEY = "nodepulse.dev/e2e-probes"
SLEEP = ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done"]


@dataclass
class Node:
    name: str
    root: Path
    proc: subprocess.Popen[bytes]
    core: client.CoreV1Api
    discovery: client.DiscoveryV1Api
    namespace: str
    agnhost: str

    def pod(self, name: str, *containers: dict[str, Any], **spec: Any) -> None:
        body = {"nodeSelector": {"kubernetes.io/hostname": self.name},
                "tolerations": [{"key": TAINT_KEY, "operator": "Exists",
                                 "effect": "NoSchedule"},
                                {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                                 "effect": "NoSchedule"}],
                "terminationGracePeriodSeconds": 5, "automountServiceAccountToken": False,
                "containers": [{"image": BUSYBOX_IMAGE, "imagePullPolicy": "Never", **c}
                               for c in containers], **spec}
        self.core.create_namespaced_pod(self.namespace, {
            "metadata": {"name": name, "labels": {"app": name}}, "spec": body})

    def read(self, name: str) -> client.V1Pod:
        return self.core.read_namespaced_pod(name, self.namespace)

    def condition(self, name: str, ctype: str) -> str | None:
        for c in self.read(name).status.conditions or []:
            if c.type == ctype:
                return str(c.status)
        return None

    def restarts(self, name: str) -> int:
        statuses = self.read(name).status.container_statuses or []
        return int(statuses[0].restart_count) if statuses else 0

    def events(self, name: str, reason: str) -> list[str]:
        evs = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name},reason={reason}")
        return [e.message for e in evs.items]

    def wait(self, what: str, pred: Any, timeout: float = 90) -> Any:
        try:
            return eventually(pred, what, timeout)
        except AssertionError:
            print("\n".join((self.root / "agent.log").read_text(errors="replace")
                            .splitlines()[-60:]))
            raise


@contextlib.contextmanager
def agent(cluster: Cluster, root: Path, name: str, runtime: list[str],
          agnhost: str = "") -> Iterator[Node]:
    """One agent with its own Node and namespace; everything stopped by PID after."""
    kubeconfig = cluster.node_kubeconfig(name)
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    argv = [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={root}", f"--healthz-bind-address=127.0.0.1:{free_port()}",
            *runtime, "--node-ip=127.0.0.1",
            f"--register-with-taints={TAINT_KEY}={name}:NoSchedule"]
    log = open(root / "agent.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    n = Node(name, root, proc, core, client.DiscoveryV1Api(admin), name, agnhost)
    try:
        create_namespace(core, name)
        node_registered(core, name, lambda: proc.poll() is None)
        yield n
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)
        with contextlib.suppress(AssertionError):  # the agent stops the pods' containers
            eventually(lambda: not core.list_namespaced_pod(name).items, "pods gone", 60)
        stop_process(proc)
        log.close()
        with contextlib.suppress(ApiException):
            core.delete_node(name)
        admin.close()


@pytest.fixture(scope="module")
def node(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    name = f"probes-{os.getpid() % 10000}"
    from e2e.conformance.images import import_all
    from nodepulse_dev.containerd import start_containerd
    ctd = start_containerd()
    try:
        agnhost = import_all(ctd)["Agnhost"]
        with agent(cluster, tmp_path_factory.mktemp(name), name, ctd.agent_flags,
                   agnhost) as n:
            yield n
    finally:
        ctd.stop()


def exec_probe(*cmd: str, **kw: Any) -> dict[str, Any]:
    return {"exec": {"command": list(cmd)}, "periodSeconds": 1, **kw}


def test_failing_readiness_probe_is_not_ready_and_gets_no_traffic(node: Node) -> None:
    n = node
    n.core.create_namespaced_service(n.namespace, {
        "metadata": {"name": "unready"},
        "spec": {"selector": {"app": "unready"}, "ports": [{"port": 80}]}})
    n.pod("unready", {"name": "c", "command": SLEEP, "readinessProbe": exec_probe("false")})
    n.wait("unready running", lambda: n.read("unready").status.phase == "Running")
    n.wait("an Unhealthy Event", lambda: n.events("unready", "Unhealthy"))
    pod = n.read("unready")
    assert n.condition("unready", "Ready") == "False"
    assert n.condition("unready", "ContainersReady") == "False"
    assert n.condition("unready", "PodReadyToStartContainers") == "True"
    cs = pod.status.container_statuses[0]
    assert cs.ready is False and cs.started is True and cs.restart_count == 0
    assert any(m.startswith("Readiness probe failed") for m in n.events("unready", "Unhealthy"))

    def endpoint() -> Any:
        slices = n.discovery.list_namespaced_endpoint_slice(
            n.namespace, label_selector="kubernetes.io/service-name=unready").items
        eps = [e for s in slices for e in s.endpoints or []]
        return eps[0] if eps else None
    ep = n.wait("the Service's endpoint", endpoint, 60)
    assert ep.conditions.ready is False  # a Service sends it no traffic


def test_liveness_failure_restarts_with_events_and_prestop(node: Node) -> None:
    n = node
    n.pod("live", {"name": "c", "command": SLEEP,
                   "livenessProbe": exec_probe("cat", "/tmp/health", failureThreshold=2),
                   "terminationMessagePath": "/dev/termination-log",
                   "lifecycle": {"preStop": {"exec": {"command": [
                       "sh", "-c", "printf prestop-ran > /dev/termination-log"]}}}})

    def restarted() -> Any:
        cs = (n.read("live").status.container_statuses or [None])[0]
        return cs if cs and cs.restart_count >= 1 and cs.state.running else None
    cs = n.wait("the container restarted by its liveness probe", restarted, 60)
    assert cs.restart_count == 1 or cs.last_state.terminated is not None
    # Events are written apart from the status, so they may land after it
    n.wait("the Killing Event", lambda: "Container c failed liveness probe, will be restarted"
           in n.events("live", "Killing"))
    n.wait("the Unhealthy Event", lambda: any(
        m.startswith("Liveness probe failed: cat: can't open '/tmp/health'")
        for m in n.events("live", "Unhealthy")))
    # the preStop hook ran before the kill: it left the killed container's message
    assert cs.last_state.terminated.message == "prestop-ran"
    assert n.events("live", "FailedPreStopHook") == []


def test_http_tcp_and_grpc_probes(node: Node) -> None:
    n = node
    agn = {"image": n.agnhost, "imagePullPolicy": "Never"}
    n.pod("net", {"name": "web", **agn, "args": ["netexec", "--http-port=8080"],
                  "ports": [{"name": "http", "containerPort": 8080}],
                  "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"},
                                     "periodSeconds": 1},
                  "livenessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}},
          {"name": "grpc", **agn, "args": ["grpc-health-checking", "--http-port=8081"],
           "readinessProbe": {"grpc": {"port": 5000}, "periodSeconds": 1}})
    n.wait("net Ready", lambda: n.condition("net", "Ready") == "True", 60)
    # agnhost's liveness server answers /healthz with 200 for 10 s, then 500
    n.pod("http-live", {"name": "c", **agn, "args": ["liveness"],
                        "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080},
                                          "initialDelaySeconds": 3, "periodSeconds": 1,
                                          "failureThreshold": 1}})
    n.wait("restarted by its http liveness probe", lambda: n.restarts("http-live") >= 1, 60)
    n.wait("the Unhealthy Event", lambda: any(
        "HTTP probe failed with statuscode: 500" in m for m in n.events("http-live", "Unhealthy")))
    assert n.read("net").status.container_statuses[0].restart_count == 0


def test_post_start_hook_and_its_failure(node: Node) -> None:
    n = node
    n.pod("hooked", {"name": "c", "command": SLEEP,
                     "lifecycle": {"postStart": {"exec": {"command": [
                         "sh", "-c", "echo ok > /tmp/started"]}}},
                     "readinessProbe": exec_probe("cat", "/tmp/started")})
    n.wait("hooked Ready (its postStart hook ran)",
           lambda: n.condition("hooked", "Ready") == "True")
    n.pod("badhook", {"name": "c", "command": SLEEP,
                      "lifecycle": {"postStart": {"exec": {"command": ["false"]}}}})
    n.wait("a FailedPostStartHook Event", lambda: n.events("badhook", "FailedPostStartHook"))
    assert n.events("badhook", "FailedPostStartHook")[0] == "PostStartHook failed"
    n.wait("the Killing Event", lambda: "FailedPostStartHook" in n.events("badhook", "Killing"))


def test_termination_messages(node: Node) -> None:
    n = node
    n.pod("msg", {"name": "c", "command": ["sh", "-c", "printf DONE > /dev/termination-log"],
                  "terminationMessagePath": "/dev/termination-log"}, restartPolicy="Never")
    n.pod("msglog", {"name": "c", "command": ["sh", "-c", "echo from-the-log; exit 3"],
                     "terminationMessagePolicy": "FallbackToLogsOnError"},
          restartPolicy="Never")
    n.pod("msgpath", {"name": "c", "command": ["sh", "-c", "printf custom > /tmp/msg"],
                      "terminationMessagePath": "/tmp/msg"}, restartPolicy="Never")

    def terminated(name: str) -> Any:
        cs = (n.read(name).status.container_statuses or [None])[0]
        return cs.state.terminated if cs and cs.state.terminated else None
    assert n.wait("msg terminated", lambda: terminated("msg")).message == "DONE"
    got = n.wait("msglog terminated", lambda: terminated("msglog"))
    assert got.exit_code == 3 and got.message == "from-the-log\n"
    assert n.wait("msgpath terminated", lambda: terminated("msgpath")).message == "custom"


def test_active_deadline_fails_the_pod(node: Node) -> None:
    n = node
    n.pod("deadline", {"name": "c", "command": SLEEP})
    n.wait("deadline running", lambda: n.read("deadline").status.phase == "Running")
    n.core.patch_namespaced_pod("deadline", n.namespace,
                                {"spec": {"activeDeadlineSeconds": 5}})
    pod = n.wait("the pod Failed by its deadline",
                 lambda: (p := n.read("deadline")).status.phase == "Failed" and p, 60)
    assert pod.status.reason == "DeadlineExceeded"
    assert pod.status.message == "Pod was active on the node longer than the specified " \
                                 "deadline"


def test_readiness_gate_set_through_the_api(node: Node) -> None:
    n = node
    n.pod("gated", {"name": "c", "command": SLEEP},
          readinessGates=[{"conditionType": "example.com/ready"}])
    n.wait("gated containers ready", lambda: n.condition("gated", "ContainersReady") == "True")
    assert n.condition("gated", "Ready") == "False"
    n.core.patch_namespaced_pod_status("gated", n.namespace, {"status": {"conditions": [
        {"type": "example.com/ready", "status": "True"}]}})
    n.wait("gated Ready once the gate is True", lambda: n.condition("gated", "Ready") == "True",
           30)
    assert n.condition("gated", "example.com/ready") == "True"  # the agent kept it


def test_sidecar_starts_before_the_app_and_keeps_running(node: Node) -> None:
    n = node
    n.pod("sidecar", {"name": "app", "command": SLEEP},
          initContainers=[{"name": "side", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                           "restartPolicy": "Always",
                           "command": ["sh", "-c", "sleep 2; touch /tmp/up; "
                                       "trap 'exit 0' TERM; while true; do sleep 1; done"],
                           "startupProbe": exec_probe("cat", "/tmp/up")}])
    pod = n.wait("sidecar pod Ready", lambda: (p := n.read("sidecar")).status.phase ==
                 "Running" and n.condition("sidecar", "Ready") == "True" and p)
    side = pod.status.init_container_statuses[0]
    app = pod.status.container_statuses[0]
    assert side.started and side.ready and side.state.running
    assert app.state.running.started_at >= side.state.running.started_at


def test_process_runtime_probes(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
                                ) -> None:
    """The process runtime runs exec probes beside the process and the network probes
    against the host (its pods share the host network)."""
    name = f"probes-proc-{os.getpid() % 10000}"
    port = free_port()
    with agent(cluster, tmp_path_factory.mktemp(name), name, ["--runtime=process"]) as n:
        n.pod("served", {"name": "c", "command": [sys.executable, "-m", "http.server",
                                                  str(port), "--bind", "127.0.0.1"],
                         "readinessProbe": {"httpGet": {"path": "/", "port": port},
                                            "periodSeconds": 1},
                         "livenessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 1}})
        n.pod("failing", {"name": "c", "command": SLEEP,
                          "readinessProbe": exec_probe("false"),
                          "livenessProbe": exec_probe("sh", "-c", "exit 1",
                                                      failureThreshold=2)})
        n.wait("served Ready", lambda: n.condition("served", "Ready") == "True", 60)
        n.wait("failing restarted by its liveness probe", lambda: n.restarts("failing") >= 1,
               60)
        assert n.condition("failing", "Ready") == "False"
        assert "Container c failed liveness probe, will be restarted" in \
            n.events("failing", "Killing")
        assert n.read("served").status.container_statuses[0].restart_count == 0
