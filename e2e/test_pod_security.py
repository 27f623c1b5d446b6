"""Pods run as the kubelet runs them on containerd: their security context, the node's
admission, their names and their resolver, on the real control plane.

One `nodepulse-agent` with node credentials on a private containerd (with
--cluster-dns and --cluster-domain, so ClusterFirst has something to give) runs:

- runAsUser/runAsGroup/supplementalGroups: the process really has those ids;
- runAsNonRoot on an image that runs as root: refused with the kubelet's message;
- a 70-character pod name: the sandbox's hostname is the name cut to 63 characters;
- spec.os windows: rejected, phase Failed, reason PodOSNotSupported;
- an unsafe sysctl: rejected (SysctlForbidden); a safe one is set inside the pod;
- a field the agent does not honour (hostUsers: false): CreateContainerConfigError
  naming the field, and a Warning Event;
- dnsPolicy ClusterFirst with dnsConfig, and hostAliases: the container's
  /etc/resolv.conf and /etc/hosts say so.

What a container prints is read from its CRI log file under the agent's root dir.
Placement, cleanup and sweeping as in e2e/test_pods.py.
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
from nodepulse_dev import Cluster
from nodepulse_dev.images import BUSYBOX_IMAGE
from nodepulse_dev.processes import stop_process

AGENT = Path(sys.executable).parent / "nodepulse-agent"
TAINT_KEY = "nodepulse.dev/e2e-security"
CLUSTER_DNS = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"


@dataclass
class Agent:
    name: str
    root: Path
    proc: subprocess.Popen[bytes]
    core: client.CoreV1Api
    namespace: str
    ctd: Any

    def run(self, name: str, script: str, **spec: Any) -> client.V1Pod:
        """Create a pod whose one container runs `script` (sh -c) once."""
        container = {"name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                     "command": ["sh", "-c", script],
                     "env": [{"name": "NP_E2E", "value": self.name}]}
        container.update(spec.pop("container", {}))
        body = {"metadata": {"name": name, **spec.pop("metadata", {})},
                "spec": {"nodeName": self.name, "restartPolicy": "Never",
                         "automountServiceAccountToken": False,
                         "terminationGracePeriodSeconds": 2,
                         "containers": [container], **spec}}
        return self.core.create_namespaced_pod(self.namespace, body)

    def pod(self, name: str) -> client.V1Pod:
        return self.core.read_namespaced_pod(name, self.namespace)

    def finished(self, name: str) -> client.V1Pod:
        return eventually(lambda: (p := self.pod(name)).status.phase in
                          ("Succeeded", "Failed") and p, f"pod {name} finished", 90)

    def output(self, pod: client.V1Pod) -> str:
        """What the pod's container wrote, from its CRI log file."""
        meta = pod.metadata
        folder = self.root / "logs" / "pods" / f"{meta.namespace}_{meta.name}_{meta.uid}"
        lines = (folder / "main" / "0.log").read_text().splitlines()
        return "\n".join(line.split(" ", 3)[3] for line in lines) + "\n"

    def waiting(self, name: str) -> Any:
        def get() -> Any:
            st = self.pod(name).status
            for c in st.container_statuses or []:
                if c.state.waiting and c.state.waiting.reason not in (
                        "ContainerCreating", None):
                    return c.state.waiting
            return None
        return eventually(get, f"pod {name} waiting with a reason", 60)

    def events(self, name: str) -> list[client.CoreV1Event]:
        return list(self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name}").items)


@pytest.fixture(scope="module")
def agent(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    from nodepulse_dev.containerd import start_containerd
    name = f"sec-{os.getpid() % 10000}"
    root = tmp_path_factory.mktemp(name)
    kubeconfig = cluster.node_kubeconfig(name)
    ctd = start_containerd()
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    argv = [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={root}", f"--healthz-bind-address=127.0.0.1:{free_port()}",
            "--port=0", *ctd.agent_flags,
            f"--register-with-taints={TAINT_KEY}={name}:NoSchedule",
            f"--cluster-dns={CLUSTER_DNS}", f"--cluster-domain={CLUSTER_DOMAIN}"]
    log = open(root / "agent.log", "ab")  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        log.close()
        ctd.stop()
        raise
    a = Agent(name, root, proc, core, name, ctd)
    try:
        create_namespace(core, name)
        node_registered(core, name, lambda: proc.poll() is None)
        yield a
    finally:
        try:
            with contextlib.suppress(ApiException):
                core.delete_namespace(name)
            if proc.poll() is None:
                with contextlib.suppress(AssertionError):
                    eventually(lambda: not marked(name), "the agent's cleanup", 40)
            stop_process(proc)
            ctd.stop()
            for pid in marked(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ApiException):
                core.delete_node(name)
        finally:
            log.close()
            admin.close()


def test_run_as_user_group_and_supplemental_groups(agent: Agent) -> None:
    agent.run("ids", "id -u; id -g; id -G",
              securityContext={"runAsUser": 65534, "runAsGroup": 1234,
                               "supplementalGroups": [5555]})
    pod = agent.finished("ids")
    assert pod.status.phase == "Succeeded"
    uid, gid, groups = agent.output(pod).split("\n")[:3]
    assert (uid, gid) == ("65534", "1234")
    assert set(groups.split()) == {"1234", "5555"}


def test_container_security_context_wins_over_the_pod(agent: Agent) -> None:
    agent.run("ids2", "id -u", securityContext={"runAsUser": 1000},
              container={"securityContext": {"runAsUser": 2000}})
    pod = agent.finished("ids2")
    assert agent.output(pod).strip() == "2000"


def test_run_as_non_root_refuses_a_root_image(agent: Agent) -> None:
    agent.run("nonroot", "true", container={"securityContext": {"runAsNonRoot": True}})
    w = agent.waiting("nonroot")
    assert w.reason == "CreateContainerConfigError"
    assert w.message.startswith("container has runAsNonRoot and image will run as root "
                                f'(pod: "nonroot_{agent.namespace}(')
    assert agent.pod("nonroot").status.phase == "Pending"


def test_long_pod_name_is_cut_to_a_hostname(agent: Agent) -> None:
    name = "a" * 62 + "-bcdefgh"  # 70 characters; cut at 63 leaves a trailing '-'
    agent.run(name, "hostname")
    pod = agent.finished(name)
    assert pod.status.phase == "Succeeded", pod.status
    assert agent.output(pod).strip() == "a" * 62


def test_windows_pod_is_rejected(agent: Agent) -> None:
    agent.run("win", "true", os={"name": "windows"})
    pod = agent.finished("win")
    assert (pod.status.phase, pod.status.reason) == ("Failed", "PodOSNotSupported")
    assert pod.status.message == ("Pod was rejected: Failed to admit pod as the OS field "
                                  "doesn't match node OS")
    assert not pod.status.container_statuses  # nothing was started
    # The Event is written apart from the status, so it may land after it.
    eventually(lambda: any(e.reason == "PodOSNotSupported" for e in agent.events("win")),
               "the PodOSNotSupported Event")


def test_sysctls_safe_set_unsafe_rejected(agent: Agent) -> None:
    agent.run("sysctl-ok", "cat /proc/sys/kernel/shm_rmid_forced",
              securityContext={"sysctls": [{"name": "kernel.shm_rmid_forced",
                                            "value": "1"}]})
    pod = agent.finished("sysctl-ok")
    assert pod.status.phase == "Succeeded" and agent.output(pod).strip() == "1"
    agent.run("sysctl-no", "true",
              securityContext={"sysctls": [{"name": "kernel.msgmax", "value": "10000"}]})
    pod = agent.finished("sysctl-no")
    assert (pod.status.phase, pod.status.reason) == ("Failed", "SysctlForbidden")
    assert pod.status.message == ('Pod was rejected: forbidden sysctl: "kernel.msgmax" '
                                  "not allowlisted")


def test_unhonoured_field_is_refused_with_an_event(agent: Agent) -> None:
    agent.run("userns", "true", hostUsers=False)
    w = agent.waiting("userns")
    assert w.reason == "CreateContainerConfigError"
    assert w.message.startswith("spec.hostUsers: ")

    def failed() -> list[client.CoreV1Event]:
        return [e for e in agent.events("userns")
                if e.type == "Warning" and e.reason == "Failed"
                and "spec.hostUsers" in e.message]
    [event] = eventually(failed, "the Failed Event")
    assert event.involved_object.field_path == "spec.containers{main}"


def test_dns_and_hosts_inside_the_container(agent: Agent) -> None:
    agent.run("dns", "cat /etc/resolv.conf; echo ---; cat /etc/hosts; echo ---; hostname",
              hostname="web", subdomain="svc1",
              hostAliases=[{"ip": "10.1.2.3", "hostnames": ["foo.local", "bar.local"]}],
              dnsConfig={"searches": ["example.test"],
                         "options": [{"name": "ndots", "value": "2"},
                                     {"name": "edns0"}]})
    pod = agent.finished("dns")
    assert pod.status.phase == "Succeeded", pod.status
    resolv, hosts, hostname = agent.output(pod).split("---\n")
    ns = agent.namespace
    assert f"nameserver {CLUSTER_DNS}" in resolv
    search = next(line for line in resolv.splitlines() if line.startswith("search"))
    assert search.split()[1:4] == [f"{ns}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}",
                                   CLUSTER_DOMAIN]
    assert search.split()[-1] == "example.test"
    options = next(line for line in resolv.splitlines() if line.startswith("options"))
    assert set(options.split()[1:]) == {"ndots:2", "edns0"}
    assert hosts.startswith("# Kubernetes-managed hosts file.\n")
    ip = pod.status.pod_ip
    assert f"{ip}\tweb.svc1.{ns}.svc.{CLUSTER_DOMAIN}\tweb\n" in hosts
    assert "# Entries added by HostAliases.\n10.1.2.3\tfoo.local\tbar.local\n" in hosts
    assert hostname.strip() == "web"
