"""A kind cluster with no kubelet (issue 39): every node, control plane included, runs
nodepulse-agent in the kubelet's place (e2e/kind/agent_node.py), and `kind create
cluster` brings it up as it would with kubelets: kubeadm init and join, the control
plane's static pods with their mirror pods, kube-proxy and the pod network as DaemonSet
pods, CoreDNS. Then a sample of the upstream [Conformance] suite runs on it: a few specs
of every SIG (e2e/conformance/conformance.yaml's `sample`), among them pods talking
across nodes, through Services and through DNS, each of which passes with the kubelet
on the same cluster shape too. The whole suite, and the kubelet's column, are
`python -m e2e.conformance --suite conformance --cluster kind` (docs/conformance.md).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from e2e.conformance import kind, run
from e2e.kind.cluster import KindCluster

# the images' and e2e.test's first builds (cached after), the cluster, the sample
pytestmark = pytest.mark.timeout(3600)

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def log(msg: str) -> None:
    print(f"[kind-conformance {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def check_no_kubelet(cluster: KindCluster) -> None:
    """Every node's agent is nodepulse: its Node says so, its `kubelet` unit runs the
    agent and no kubelet binary is there to run; the control plane runs as static pods
    with their mirror pods, kube-proxy and the pod network on every node, CoreDNS
    ready."""
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    names = sorted(n["metadata"]["name"] for n in nodes)
    assert len(names) == 3, names
    for n in nodes:
        assert n["status"]["nodeInfo"]["kubeletVersion"].endswith("-nodepulse"), n["status"]
        ready = [c for c in n["status"]["conditions"] if c["type"] == "Ready"]
        assert ready[0]["status"] == "True", ready
    for name in names:
        unit = cluster.node_exec(name, "systemctl", "show", "kubelet", "-p", "MainPID", "--value")
        cmdline = cluster.node_exec(name, "cat", f"/proc/{unit.strip()}/cmdline")
        assert "/opt/nodepulse/bin/nodepulse-agent" in cmdline.replace("\0", " "), cmdline
        kubelet = cluster.node_exec(name, "head", "-c", "2", "/usr/bin/kubelet")
        assert kubelet == "#!", "the node still holds a kubelet binary"
    pods = json.loads(cluster.kubectl("get", "pods", "-n", "kube-system", "-o", "json")
                      .stdout)["items"]
    # a static pod's mirror is named <static pod>-<node>
    mirrors = {p["metadata"]["name"].removesuffix("-" + p["spec"]["nodeName"]) for p in pods
               if "kubernetes.io/config.mirror" in p["metadata"].get("annotations", {})}
    assert set(CONTROL_PLANE) <= mirrors, mirrors
    for daemonset in ("kube-proxy", "pod-routes"):
        ds = json.loads(cluster.kubectl("get", "daemonset", "-n", "kube-system", daemonset,
                                        "-o", "json").stdout)
        assert ds["status"].get("numberReady") == 3, (daemonset, ds["status"])
    cluster.kubectl("wait", "-n", "kube-system", "--for=condition=Available",
                    "deployment/coredns", "--timeout=180s", timeout=200)
    check_pod_slices(cluster)


def check_pod_slices(cluster: KindCluster) -> None:
    """With kind's systemd cgroup driver, a pod's cgroup is a systemd slice under kind's
    cgroup root (kubelet.slice) that carries the pod's memory limit, as a unit property
    and in the cgroup, and holds its containers' scopes: checked on a CoreDNS pod
    (Burstable, a memory limit on its one container)."""
    pods = json.loads(cluster.kubectl("get", "pods", "-n", "kube-system", "-l",
                                      "k8s-app=kube-dns", "-o", "json").stdout)["items"]
    pod = pods[0]
    limit = pod["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert limit.endswith("Mi"), limit
    uid = pod["metadata"]["uid"].replace("-", "_")
    unit = f"kubelet-kubepods-burstable-pod{uid}.slice"
    where = pod["spec"]["nodeName"]
    show = cluster.node_exec(where, "systemctl", "show", unit, "-p", "ActiveState",
                             "-p", "MemoryLimit")
    assert sorted(show.split()) == ["ActiveState=active",
                                    f"MemoryLimit={int(limit[:-2]) * 2**20}"], show
    folder = ("/sys/fs/cgroup/memory/kubelet.slice/kubelet-kubepods.slice/"
              f"kubelet-kubepods-burstable.slice/{unit}")
    assert cluster.node_exec(where, "cat", f"{folder}/memory.limit_in_bytes").strip() == \
        str(int(limit[:-2]) * 2**20)
    scopes = cluster.node_exec(where, "ls", folder).split()
    assert any(s.startswith("cri-containerd-") and s.endswith(".scope") for s in scopes), \
        scopes


def test_a_kind_cluster_without_a_kubelet_passes_the_conformance_sample(
        tmp_path: Path) -> None:
    plan = run.load_plan(kind.PLAN)
    assert plan.sample, f"{kind.PLAN.name} has no sample"
    workdir = tmp_path / "kind"
    started = time.monotonic()
    with kind.kind_cluster("nodepulse", workdir, log) as cluster:
        log(f"cluster and images ready: {time.monotonic() - started:.0f} s")
        check_no_kubelet(cluster)
        results, wall = run.run_all(plan, run.Target(cluster.kubeconfig), workdir,
                                    log=log, names=plan.sample)
        ran = [r for r in results if r.spec in plan.sample]
        log(f"{len(ran)} specs in {wall:.0f} s")
        failed = [f"{r.status}: {r.spec}: {r.reason}" for r in ran if r.status != run.PASSED]
        if failed:
            cluster.save_logs()
    assert not failed, "\n".join(failed) + f"\n(reports and node logs in {workdir})"
    shutil.rmtree(workdir, ignore_errors=True)
