"""An agent serving the kubelet API on the local control plane, with containerd, for
the modules that talk to that API straight (e2e/test_kubelet_api.py, and the attacks
in e2e/test_kubelet_api_hostile.py).

The agent runs with node credentials, a serving certificate from the cluster CA (the
API server verifies it: --kubelet-certificate-authority), the cluster CA as its client
CA, and --node-ip=127.0.0.1, the address the API server dials.

    with kubelet_node(cluster, root, name) as node:
        node.pod("web", ["sleep", "3600"]); node.wait_running("web")
        status, body = node.get("/containerLogs/...", cert=admin_cert(cluster))
"""

from __future__ import annotations

import contextlib
import http.client
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness.namespaces import create_namespace
from e2e.harness.ports import free_port
from e2e.harness.waits import eventually
from nodepulse_dev import Cluster
from nodepulse_dev.images import BUSYBOX_IMAGE
from nodepulse_dev.processes import stop_process

AGENT = Path(sys.executable).parent / "nodepulse-agent"
TAINT_KEY = "nodepulse.dev/e2e-kubelet-api"


@dataclass
class Node:
    name: str
    root: Path
    proc: subprocess.Popen[bytes]
    core: client.CoreV1Api
    namespace: str
    cluster: Cluster
    kubectl: str
    ctd: Any

    @property
    def port(self) -> int:
        node = self.core.read_node(self.name)
        return int(node.status.daemon_endpoints.kubelet_endpoint.port)

    def run_kubectl(self, *args: str, input: bytes | None = None, timeout: float = 60
                    ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([self.kubectl, f"--kubeconfig={self.cluster.kubeconfig}",
                               "-n", self.namespace, *args], input=input, capture_output=True,
                              timeout=timeout)

    def pod(self, name: str, command: list[str], **container: Any) -> None:
        spec = {"nodeSelector": {"kubernetes.io/hostname": self.name},
                "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
                                {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                                 "effect": "NoSchedule"}],
                "terminationGracePeriodSeconds": 1, "automountServiceAccountToken": False,
                "restartPolicy": container.pop("restartPolicy", "Always"),
                "containers": [{"name": "main", "image": BUSYBOX_IMAGE,
                                "imagePullPolicy": "Never", "command": command, **container}]}
        self.core.create_namespaced_pod(self.namespace, {
            "metadata": {"name": name}, "spec": spec})

    def wait_running(self, name: str, restarts: int = 0) -> client.V1Pod:
        def ok() -> client.V1Pod | None:
            p = self.core.read_namespaced_pod(name, self.namespace)
            cs = (p.status.container_statuses or [None])[0]
            return p if (cs is not None and cs.state.running and cs.restart_count >= restarts) \
                else None
        try:
            return eventually(ok, f"pod {name} running (restarts >= {restarts})", 120)
        except AssertionError:
            print(self.log_tail())
            raise

    def log_tail(self, n: int = 40) -> str:
        return "\n".join((self.root / "agent.log").read_text(errors="replace").splitlines()[-n:])

    # -- straight to the agent's port --
    def tls(self, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.cluster.ca_file()))
        if cert:
            ctx.load_cert_chain(*cert)
        return ctx

    def get(self, path: str, *, cert: tuple[Path, Path] | None = None, token: str = "",
            timeout: float = 30) -> tuple[int, bytes]:
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.tls(cert),
                                           timeout=timeout)
        try:
            conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token
                         else {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def rss_and_cpu(self) -> tuple[int, int, float]:
        """(RSS, peak RSS) in bytes and CPU seconds of the agent process."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        kb = {k: int(v.split()[0]) * 1024 for k, v in
              (line.split(":", 1) for line in status.splitlines() if line.startswith("Vm"))}
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return kb["VmRSS"], kb["VmHWM"], cpu


@contextlib.contextmanager
def kubelet_node(cluster: Cluster, root: Path, name: str,
                 extra_args: Sequence[str] = ()) -> Iterator[Node]:
    """An agent for Node `name` on its own containerd, state under `root`, its pods in
    namespace `name`; everything stopped and deleted at the end."""
    kubeconfig = cluster.node_kubeconfig(name)
    crt, key = cluster.node_serving_cert(name)
    from nodepulse_dev.containerd import start_containerd
    ctd = start_containerd()
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    argv = [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={root}", f"--healthz-bind-address=127.0.0.1:{free_port()}",
            *ctd.agent_flags, "--node-ip=127.0.0.1", "--port=0", f"--tls-cert-file={crt}",
            f"--tls-private-key-file={key}", f"--client-ca-file={cluster.ca_file()}",
            "--container-log-max-size=16Mi", "--container-log-max-files=3",
            f"--register-with-taints={TAINT_KEY}={name}:NoSchedule", *extra_args]
    log = open(root / "agent.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    n = Node(name, root, proc, core, name, cluster, str(cluster.binary("kubectl")), ctd)
    try:
        create_namespace(core, name)

        def advertised() -> bool:
            nodes = core.list_node(field_selector=f"metadata.name={name}").items
            return bool(nodes and nodes[0].status.daemon_endpoints
                        and nodes[0].status.daemon_endpoints.kubelet_endpoint.port)
        eventually(lambda: proc.poll() is None and advertised(),
                   f"node {name} registered with its kubelet port")
        yield n
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)
        stop_process(proc)
        log.close()
        ctd.stop()
        with contextlib.suppress(ApiException):
            core.delete_node(name)
        admin.close()


def admin_cert(cluster: Cluster) -> tuple[Path, Path]:
    """The local control plane's admin client certificate (system:masters)."""
    pki_dir = getattr(cluster, "pki_dir", None)
    if pki_dir is None:
        pytest.skip("needs the local control plane's admin client certificate")
    return pki_dir / "admin.crt", pki_dir / "admin.key"
