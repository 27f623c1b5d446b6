"""The agent's memory with pods that use volumes. Prints figures only; asserts nothing.

The local control plane, one nodepulse-agent with node credentials on a private
containerd (or the fake runtime), then N pods (default 110, the default max-pods) in one
namespace, each with what a typical pod carries: the API server's kube-api-access
projected volume (a TokenRequest token, kube-root-ca.crt, the namespace), a ConfigMap
and a Secret of its own as volumes, an emptyDir, env from its ConfigMap, and an exec
liveness and readiness probe every 10 s. Reported: the agent's RSS and thread count
before the pods, once all are Running and Ready, and after they are deleted (one watch
per referenced ConfigMap or Secret, read on the event loop).

    .venv/bin/python bench/volumes.py                       # containerd, 110 pods
    .venv/bin/python bench/volumes.py --runtime fake --pods 110
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


def run(runtime: str, n: int, timeout: float) -> None:
    from kubernetes import client

    from e2e.harness.ports import free_port
    from nodepulse_dev import LocalCluster
    from nodepulse_dev.containerd import Containerd, start_containerd
    from nodepulse_dev.images import BUSYBOX_IMAGE

    node = f"vols-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster().up(log=lambda m: None)
    ctd: Containerd | None = None
    agent: subprocess.Popen[bytes] | None = None
    try:
        args = [str(Path(sys.executable).parent / "nodepulse-agent"), f"--node-name={node}",
                f"--kubeconfig={cluster.node_kubeconfig(node)}",
                f"--root-dir={cluster.workdir / 'agent'}",
                f"--healthz-bind-address=127.0.0.1:{free_port()}",
                f"--runtime={'cri' if runtime == 'containerd' else 'fake'}"]
        if runtime == "containerd":
            ctd = start_containerd(cni=True)
            args.append(f"--container-runtime-endpoint={ctd.endpoint}")
        log_path = cluster.log_dir / "agent.log"
        with open(log_path, "ab") as log:
            agent = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        core = client.CoreV1Api(cluster.api_client())
        ns = "vols"
        core.create_namespace({"metadata": {"name": ns}})
        deadline = time.monotonic() + 60
        while not (core.list_namespaced_service_account(
                ns, field_selector="metadata.name=default").items and core.list_node(
                field_selector=f"metadata.name={node}").items):
            if agent.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the agent's node {node} never registered; see {log_path}")
            time.sleep(0.3)
        time.sleep(5)
        print(f"{runtime} runtime, node {node}, {n} pods (agent log {log_path})", flush=True)
        print(f"  before: RSS {_status(agent.pid, 'VmRSS') / 1024:.1f} MiB, "
              f"{_status(agent.pid, 'Threads')} threads", flush=True)
        probe = {"exec": {"command": ["true"]}, "periodSeconds": 10}
        t0 = time.monotonic()
        for i in range(n):
            core.create_namespaced_config_map(ns, {"metadata": {"name": f"cfg-{i}"},
                                                   "data": {"app.conf": f"pod {i}\n" * 20,
                                                            "MODE": "bench"}})
            core.create_namespaced_secret(ns, {"metadata": {"name": f"sec-{i}"},
                                               "stringData": {"password": f"pw-{i}"}})
            core.create_namespaced_pod(ns, {"metadata": {"name": f"p{i}"}, "spec": {
                "nodeName": node, "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": BUSYBOX_IMAGE,
                                "imagePullPolicy": "Never", "command": ["sleep", "3600"],
                                "envFrom": [{"configMapRef": {"name": f"cfg-{i}"}}],
                                "livenessProbe": probe, "readinessProbe": probe,
                                "volumeMounts": [
                                    {"name": "cfg", "mountPath": "/etc/app"},
                                    {"name": "sec", "mountPath": "/etc/secret"},
                                    {"name": "scratch", "mountPath": "/scratch"}]}],
                "volumes": [{"name": "cfg", "configMap": {"name": f"cfg-{i}"}},
                            {"name": "sec", "secret": {"secretName": f"sec-{i}"}},
                            {"name": "scratch", "emptyDir": {}}]}})
        running = 0
        while time.monotonic() - t0 < timeout:
            pods = core.list_namespaced_pod(ns).items
            running = sum(1 for p in pods if p.status and p.status.phase == "Running"
                          and any(c.type == "Ready" and c.status == "True"
                                  for c in p.status.conditions or []))
            if running == n:
                break
            time.sleep(2)
        took = time.monotonic() - t0
        time.sleep(10)  # settled: watches open, first token writes done
        print(f"  {running}/{n} Running and Ready after {took:.0f} s", flush=True)
        print(f"  after:  RSS {_status(agent.pid, 'VmRSS') / 1024:.1f} MiB, "
              f"{_status(agent.pid, 'Threads')} threads", flush=True)
        core.delete_namespace(ns)
        gone = time.monotonic() + 180
        while core.list_namespaced_pod(ns).items and time.monotonic() < gone:
            time.sleep(1)
        time.sleep(5)
        print(f"  pods deleted: RSS {_status(agent.pid, 'VmRSS') / 1024:.1f} MiB, "
              f"{_status(agent.pid, 'Threads')} threads", flush=True)
    finally:
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(30)
        if ctd is not None:
            ctd.stop()
        cluster.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", choices=("containerd", "fake"), default="containerd")
    ap.add_argument("--pods", type=int, default=110)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    run(args.runtime, args.pods, args.timeout)


if __name__ == "__main__":
    main()
