"""Eviction and garbage collection for real: one agent on a private containerd, its
root dir (nodefs) a small tmpfs, its memory given as 1Gi (the pods' working sets, as
containerd measures them, count against it), on the real control plane.

1. Three pods: one that holds 450Mi of memory, one that fills its emptyDir (on nodefs)
   with 70Mi, one that sleeps. Memory comes first: the memory hog is evicted (Failed,
   reason Evicted, the kubelet's message, a Warning Event), then, a round later, the
   disk filler (its emptyDir goes with it, and the disk recovers); the sleeper runs on,
   never restarted. The node's MemoryPressure and DiskPressure conditions are seen
   True on the way and back to False after the transition period.
2. Image garbage collection: an image no container uses is imported; the config file
   moves the high threshold below the image filesystem's use: the unused image is
   removed, the one the sleeper uses and the pinned sandbox image stay.

Everything started here (agent, containerd, shims, containers) is stopped by PID, the
tmpfs unmounted, the Node and the namespace deleted.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
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
from e2e.harness.waits import eventually, first_seen, node_registered
from nodeagent.runtime.cri.gen import api_pb2 as pb
from nodeagent.runtime.cri.gen import api_pb2_grpc as pb_grpc
from nodepulse_dev import Cluster
from nodepulse_dev.images import BUSYBOX_IMAGE, PAUSE_IMAGE, Rootfs, build_oci_tar
from nodepulse_dev.processes import stop_process

AGENT = Path(sys.executable).parent / "nodepulse-agent"
TAINT_KEY = "nodepulse.dev/e2e-eviction"
UNUSED_IMAGE = "localhost/nodepulse/unused:1"
CONFIG = """\
hostOverrides: {{memoryTotal: 1Gi}}
evictionHard: {{memory.available: 600Mi, nodefs.available: 32Mi}}
evictionPressureTransitionPeriod: 5s
imageGCHighThresholdPercent: {high}
imageGCLowThresholdPercent: {low}
imageMinimumGCAge: 0s
"""


@dataclass
class Node:
    name: str
    root: Path  # the agent's root dir: a tmpfs of its own
    config: Path
    proc: subprocess.Popen[bytes]
    core: client.CoreV1Api
    namespace: str
    ctd: Any  # nodepulse_dev.containerd.Containerd

    def pod(self, name: str) -> client.V1Pod:
        return self.core.read_namespaced_pod(name, self.namespace)

    def conditions(self) -> dict[str, str]:
        node = self.core.read_node(self.name)
        return {c.type: c.status for c in node.status.conditions or []}

    def images(self) -> set[str]:
        with self.ctd.channel() as ch:
            r = pb_grpc.ImageServiceStub(ch).ListImages(pb.ListImagesRequest(), timeout=10)
        return {t for i in r.images for t in i.repo_tags}

    def log_tail(self) -> str:
        return "\n".join((self.root.parent / "agent.log").read_text(
            errors="replace").splitlines()[-60:])


@pytest.fixture(scope="module")
def node(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    from nodepulse_dev.containerd import start_containerd  # says which package is missing
    name = f"evict-{uuid.uuid4().hex[:5]}"
    base = tmp_path_factory.mktemp(name)
    root = Path(tempfile.mkdtemp(prefix="np-evict-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(root)], check=True)
    config = base / "agent.yaml"
    config.write_text(CONFIG.format(high=100, low=99))
    kubeconfig = cluster.node_kubeconfig(name)
    ctd = proc = None
    admin = cluster.api_client()
    core = client.CoreV1Api(admin)
    try:
        ctd = start_containerd()
        unused = base / "unused.tar"
        build_oci_tar(unused, Rootfs(files={"hello": (b"unused " * 1000, 0o644)}), ref="1")
        ctd.import_image(unused, UNUSED_IMAGE)
        with open(base / "agent.log", "ab") as log:
            proc = subprocess.Popen(
                [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
                 f"--root-dir={root}", f"--config={config}", *ctd.runtime_flags,
                 f"--healthz-bind-address=127.0.0.1:{free_port()}",
                 "--node-status-update-frequency=2s",
                 f"--register-with-taints={TAINT_KEY}={name}:NoSchedule"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        create_namespace(core, name)
        node_registered(core, name, lambda: proc is not None and proc.poll() is None)
        yield Node(name, root, config, proc, core, name, ctd)
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)
        if proc is not None:
            stop_process(proc)
        if ctd is not None:
            ctd.stop()  # sandboxes, shims, containerd, by PID
        leftovers = marked(name)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        with contextlib.suppress(ApiException):
            core.delete_node(name)
        subprocess.run(["umount", str(root)], check=False)
        with contextlib.suppress(OSError):
            root.rmdir()
        admin.close()
        assert not leftovers, f"processes left running: {leftovers}"


def pod(n: Node, name: str, command: str, *, volume: bool = False) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name, "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
        "command": ["sh", "-c", command], "env": [{"name": "NP_E2E", "value": n.name}]}
    spec: dict[str, Any] = {
        "nodeSelector": {"kubernetes.io/hostname": n.name},
        "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "terminationGracePeriodSeconds": 5, "automountServiceAccountToken": False,
        "containers": [container]}
    if volume:
        container["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
        spec["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    return {"metadata": {"name": name, "namespace": n.namespace}, "spec": spec}


def evicted(n: Node, name: str) -> client.V1Pod | None:
    p = n.pod(name)
    return p if p.status.phase == "Failed" and p.status.reason == "Evicted" else None


def test_the_offenders_are_evicted_and_the_others_untouched(node: Node) -> None:
    n = node
    sleeper = "trap 'exit 0' TERM; while true; do sleep 1; done"
    # dd holds its 450Mi buffer while it waits to write it to a reader that never reads
    n.core.create_namespaced_pod(n.namespace, pod(n, "hog", "dd if=/dev/zero bs=450M "
                                                             "count=1 | sleep 3600"))
    n.core.create_namespaced_pod(n.namespace, pod(
        n, "filler", "dd if=/dev/zero of=/scratch/fill bs=1M count=70 && sleep 3600",
        volume=True))
    n.core.create_namespaced_pod(n.namespace, pod(n, "steady", sleeper))
    try:
        first_seen(["MemoryPressure", "DiskPressure"],
                   lambda c: n.conditions().get(c) == "True",
                   "memory and disk pressure on the node", 60)
        hog = eventually(lambda: evicted(n, "hog"), "the memory hog evicted", 40)
        filler = eventually(lambda: evicted(n, "filler"), "the disk filler evicted", 40)
    except AssertionError:
        print(n.log_tail())
        raise
    assert hog.status.message.startswith(
        "The node was low on resource: memory. Threshold quantity: 600Mi, available: ")
    assert "Container hog was using" in hog.status.message
    assert "request is 0, has larger consumption of memory." in hog.status.message
    assert filler.status.message.startswith(
        "The node was low on resource: ephemeral-storage. Threshold quantity: 32Mi, ")
    for p in (hog, filler):
        cond = {c.type: c for c in p.status.conditions}
        assert cond["DisruptionTarget"].reason == "TerminationByKubelet"
        events = n.core.list_namespaced_event(
            n.namespace, field_selector=f"involvedObject.name={p.metadata.name}").items
        assert any(e.reason == "Evicted" and e.type == "Warning" for e in events), events
    # the well-behaved pod runs on, never restarted
    steady = n.pod("steady")
    assert steady.status.phase == "Running"
    assert steady.status.container_statuses[0].restart_count == 0
    # the conditions go once nothing is short for the transition period (5 s)
    eventually(lambda: n.conditions().get("MemoryPressure") == "False"
               and n.conditions().get("DiskPressure") == "False",
               "the pressure conditions back to False", 40)
    assert not (n.root / "pods" / filler.metadata.uid).exists()  # its emptyDir went


def test_image_gc_removes_only_the_unused_image(node: Node) -> None:
    n = node
    eventually(lambda: n.pod("steady").status.phase == "Running", "the sleeper running", 60)
    assert {UNUSED_IMAGE, BUSYBOX_IMAGE, PAUSE_IMAGE} <= n.images()
    # the image filesystem is used more than 1%: everything unused may go
    n.config.write_text(CONFIG.format(high=1, low=0))
    try:
        eventually(lambda: UNUSED_IMAGE not in n.images(), "the unused image collected", 30)
    except AssertionError:
        print(n.log_tail())
        raise
    assert {BUSYBOX_IMAGE, PAUSE_IMAGE} <= n.images()  # in use; pinned
