"""Pod and QoS cgroups on a real containerd (this host: cgroup v1, hybrid; the cgroupfs
driver), as the kubelet makes them.

One `nodepulse-agent` on a private containerd (host-network pods: no CNI needed), under
the containerd's own cgroup root (--cgroup-root=/nodepulse-e2e-..., removed with it: the
host's cgroups are untouched), with --system-reserved, --kube-reserved and
--pod-max-pids, runs a Guaranteed, a Burstable and a BestEffort pod:

- kubepods holds the node allocatable: memory less both reservations, CPU shares of
  the CPUs less the reserved CPU, pids.max less the reserved pids;
- each pod's cgroup is under kubepods, kubepods/burstable, kubepods/besteffort, with
  the cpu.shares, CFS quota and memory limit the kubelet's formulas give, and its
  container's process is in it (the container's cgroup is a child of the pod's);
- the burstable QoS cgroup's shares are the Burstable pods' CPU requests;
- each container's process has its QoS class's oom_score_adj (containerd here runs with
  restrict_oom_score_adj: a value below containerd's own is raised to it);
- a deleted pod's cgroup is gone, in every hierarchy, and the QoS cgroups follow.
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
from nodeagent.pods.cgroupfs import CgroupFs
from nodepulse_dev import Cluster
from nodepulse_dev.images import BUSYBOX_IMAGE
from nodepulse_dev.processes import stop_process

AGENT = Path(sys.executable).parent / "nodepulse-agent"
TAINT_KEY = "nodepulse.dev/e2e-cgroups"
MI = 2**20
PAGE = 4096


@dataclass
class Node:
    name: str
    root: Path
    proc: subprocess.Popen[bytes]
    core: client.CoreV1Api
    ctd: Any
    fs: CgroupFs

    def pod(self, name: str, resources: dict[str, Any]) -> client.V1Pod:
        body = {"metadata": {"name": name},
                "spec": {"nodeName": self.name, "restartPolicy": "Never",
                         "automountServiceAccountToken": False, "hostNetwork": True,
                         "terminationGracePeriodSeconds": 1,
                         "tolerations": [{"key": TAINT_KEY, "operator": "Exists"}],
                         "containers": [{"name": "main", "image": BUSYBOX_IMAGE,
                                         "imagePullPolicy": "Never",
                                         "command": ["sleep", "3600"],
                                         "env": [{"name": "NP_E2E", "value": self.name}],
                                         "resources": resources}]}}
        return self.core.create_namespaced_pod(self.name, body)

    def running(self, name: str) -> client.V1Pod:
        def get() -> client.V1Pod | None:
            p = self.core.read_namespaced_pod(name, self.name)
            cs = p.status.container_statuses or []
            return p if cs and cs[0].state.running else None
        return eventually(get, f"pod {name} running", 60)

    def cgroup(self, controller: str, path: str) -> Path:
        return Path(self.fs.controllers[controller]) / path.lstrip("/")


def value(folder: Path, file: str) -> int:
    return int((folder / file).read_text().strip())


@pytest.fixture(scope="module")
def node(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    from nodepulse_dev.containerd import start_containerd
    name = f"cg-{os.getpid() % 10000}"
    root = tmp_path_factory.mktemp(name)
    ctd = start_containerd(cni=False)
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    argv = [str(AGENT), f"--node-name={name}", f"--kubeconfig={cluster.node_kubeconfig(name)}",
            f"--root-dir={root}", f"--healthz-bind-address=127.0.0.1:{free_port()}",
            "--port=0", *ctd.agent_flags, f"--register-with-taints={TAINT_KEY}=x:NoSchedule",
            "--system-reserved=cpu=100m,memory=256Mi", "--kube-reserved=memory=128Mi,pid=1000",
            "--pod-max-pids=1024"]
    log = open(root / "agent.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    n = Node(name, root, proc, core, ctd, CgroupFs.detect())
    try:
        create_namespace(core, name)
        node_registered(core, name, lambda: proc.poll() is None)
        yield n
    finally:
        try:
            with contextlib.suppress(ApiException):
                core.delete_namespace(name)
            stop_process(proc)
            ctd.stop()  # its sandboxes, then the cgroup root
            for pid in marked(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ApiException):
                core.delete_node(name)
            left = [m for m in n.fs.hierarchies if (Path(m) / ctd.cgroup_root[1:]).exists()]
            assert not left, f"the cgroup root is left in {left}"
        finally:
            log.close()
            admin.close()


def test_pods_land_in_their_qos_cgroups_with_the_kubelets_values(node: Node) -> None:
    n = node
    kubepods = f"{n.ctd.cgroup_root}/kubepods"
    # node allocatable on kubepods
    mem_total = next(int(line.split()[1]) * 1024 for line in
                     Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemTotal:"))
    cpus = len(os.sched_getaffinity(0))
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    memory = n.cgroup("memory", kubepods)
    assert value(memory, "memory.limit_in_bytes") == (mem_total - 384 * MI) // PAGE * PAGE
    assert value(n.cgroup("cpu", kubepods), "cpu.shares") == (cpus * 1000 - 100) * 1024 // 1000
    assert value(n.cgroup("pids", kubepods), "pids.max") == pid_max - 1000

    pods = {"g": n.pod("g", {"limits": {"cpu": "200m", "memory": "64Mi"}}),
            "b": n.pod("b", {"requests": {"cpu": "100m", "memory": "32Mi"},
                             "limits": {"cpu": "300m"}}),
            "e": n.pod("e", {})}
    parents = {"g": kubepods, "b": f"{kubepods}/burstable", "e": f"{kubepods}/besteffort"}
    ctd_adj = int(Path(f"/proc/{n.ctd.pid}/oom_score_adj").read_text())
    # the kubelet's oom_score_adj, raised to containerd's own where lower
    expected_adj = {"g": max(-997, ctd_adj),
                    "b": max(1000 - 1000 * 32 * MI // mem_total, ctd_adj), "e": 1000}
    expected = {  # (cpu.shares, cfs_quota_us, memory limit or None: unlimited)
        "g": (204, 20_000, 64 * MI), "b": (102, 30_000, None), "e": (2, -1, None)}
    pod_cgroups = {}
    for key, created in pods.items():
        pod = n.running(created.metadata.name)
        path = f"{parents[key]}/pod{pod.metadata.uid}"
        pod_cgroups[key] = path
        cpu = n.cgroup("cpu", path)
        shares, quota, limit = expected[key]
        assert value(cpu, "cpu.shares") == shares, key
        assert value(cpu, "cpu.cfs_quota_us") == quota, key
        assert value(cpu, "cpu.cfs_period_us") == 100_000, key
        mem = value(n.cgroup("memory", path), "memory.limit_in_bytes")
        assert mem == limit if limit else mem >= 2**62, key
        assert value(n.cgroup("pids", path), "pids.max") == 1024, key
        # the container is a child of the pod's cgroup, and its process is in it
        cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
        [pid] = (cpu / cid / "cgroup.procs").read_text().split()
        assert int(Path(f"/proc/{pid}/oom_score_adj").read_text()) == expected_adj[key], key
    burstable = n.cgroup("cpu", f"{kubepods}/burstable")
    assert value(burstable, "cpu.shares") == 102  # the one Burstable pod's 100m
    assert value(n.cgroup("cpu", f"{kubepods}/besteffort"), "cpu.shares") == 2

    n.core.delete_namespaced_pod("b", n.name, grace_period_seconds=0)
    eventually(lambda: not any(Path(m, pod_cgroups["b"].lstrip("/")).exists()
                               for m in n.fs.hierarchies),
               "the deleted pod's cgroup gone from every hierarchy", 30)
    assert value(burstable, "cpu.shares") == 2
    assert n.cgroup("cpu", pod_cgroups["g"]).exists()  # the others stay


def test_a_running_pod_is_resized_in_place(node: Node) -> None:
    """In-place resize on containerd: the container's and the pod's cgroup values follow
    a resize of CPU and memory without a restart, and the status says so; a resize
    beyond the whole node is PodResizePending, Infeasible, and changes nothing."""
    n = node
    n.pod("r", {"requests": {"cpu": "100m", "memory": "32Mi"},
                "limits": {"cpu": "200m", "memory": "64Mi"}})
    before = n.running("r")
    cid = before.status.container_statuses[0].container_id
    parent = f"{n.ctd.cgroup_root}/kubepods/burstable/pod{before.metadata.uid}"
    cpu, mem = n.cgroup("cpu", parent), n.cgroup("memory", parent)
    assert value(cpu / cid.split("://")[1], "cpu.cfs_quota_us") == 20_000
    n.core.patch_namespaced_pod_resize("r", n.name, {"spec": {"containers": [{
        "name": "main", "resources": {"requests": {"cpu": "150m", "memory": "48Mi"},
                                      "limits": {"cpu": "400m", "memory": "96Mi"}}}]}})

    def resized() -> client.V1Pod | None:
        p = n.core.read_namespaced_pod("r", n.name)
        cs = p.status.container_statuses[0]
        done = cs.resources.limits == {"cpu": "400m", "memory": "96Mi"} and not [
            c for c in p.status.conditions if c.type.startswith("PodResize")]
        return p if done else None
    after = eventually(resized, "the resize applied and reported", 30)
    cs = after.status.container_statuses[0]
    assert (cs.container_id, cs.restart_count) == (cid, 0)  # the same container, running
    assert cs.allocated_resources == {"cpu": "150m", "memory": "48Mi"}
    assert cs.resources.requests == {"cpu": "150m", "memory": "48Mi"}
    own = cid.split("://")[1]
    assert (value(cpu / own, "cpu.cfs_quota_us"), value(cpu / own, "cpu.shares")) == \
        (40_000, 153)
    assert value(mem / own, "memory.limit_in_bytes") == 96 * MI
    assert (value(cpu, "cpu.cfs_quota_us"), value(cpu, "cpu.shares")) == (40_000, 153)
    assert value(mem, "memory.limit_in_bytes") == 96 * MI

    n.core.patch_namespaced_pod_resize("r", n.name, {"spec": {"containers": [{
        "name": "main", "resources": {"requests": {"cpu": "1000"},
                                      "limits": {"cpu": "1000"}}}]}})

    def pending() -> Any:
        p = n.core.read_namespaced_pod("r", n.name)
        return next((c for c in p.status.conditions or [] if c.type == "PodResizePending"),
                    None)
    cond = eventually(pending, "the infeasible resize reported", 30)
    assert cond.reason == "Infeasible"
    assert cond.message.startswith("Node didn't have enough capacity: cpu, requested: "
                                   "1000000, capacity: ")
    assert value(cpu / own, "cpu.cfs_quota_us") == 40_000  # nothing changed
    n.core.delete_namespaced_pod("r", n.name, grace_period_seconds=0)
