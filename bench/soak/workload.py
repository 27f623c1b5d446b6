"""The soak's steady churn, in one namespace: two Deployments (one on the containerd
node, its pods serving a ConfigMap volume to their HTTP readiness probe and checking a
Secret volume in their liveness probe; one on the virtual nodes, ready after a while)
scaled up and down, Jobs on both nodes that complete, and the ConfigMap and Secret
updated. Every few seconds one action, picked by a seeded generator; an action the API
refuses (it may be down) is counted and the churn goes on.

Nothing here may fail on its own: no container exits unless it is a Job's and then with
0, no probe fails once a container is up. So a restart, a lost pod or a stuck Job is the
agent's doing (or a fault's), never the workload's.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from kubernetes import client

from e2e.harness.namespaces import create_namespace
from e2e.harness.nodeenv import TAINT_KEY
from e2e.harness.operators import RUN
from nodepulse_dev.images import BUSYBOX_IMAGE

NAMESPACE = f"soak-{RUN}"
KIND_LABEL = "soak"  # web-cri, web-virtual, job-cri, job-virtual
SERVE = "httpd -p 8080 -h /etc/soak/config; trap 'exit 0' TERM; sleep 86400 & wait"
REPLICAS = {"web-cri": (1, 3), "web-virtual": (20, 100)}
LIVE_JOBS = 3  # of each kind at once, at most
TIMEOUT = 10  # seconds per API request


def _tolerations(pool: str) -> list[dict[str, Any]]:
    out = [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
    if pool == "virtual":
        out.append({"key": "nodepulse.dev/virtual", "operator": "Exists"})
    return out


def _pod_spec(pool: str, pool_value: str, node: str, containers: list[dict[str, Any]],
              restart: str = "Always", volumes: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodeSelector": {"nodepulse-e2e/pool": pool_value},
        "tolerations": _tolerations(pool), "restartPolicy": restart,
        "terminationGracePeriodSeconds": 5, "automountServiceAccountToken": False,
        "containers": [{**c, "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                        "env": [{"name": "NP_E2E", "value": node}]} for c in containers]}
    if volumes:
        spec["volumes"] = [{"name": "config", "configMap": {"name": "soak-config"}},
                           {"name": "secret", "secret": {"secretName": "soak-secret"}}]
    return spec


def web_cri(pools: dict[str, str], node: str) -> dict[str, Any]:
    container = {
        "name": "web", "command": ["sh", "-c", SERVE],
        "volumeMounts": [{"name": "config", "mountPath": "/etc/soak/config"},
                         {"name": "secret", "mountPath": "/etc/soak/secret"}],
        "readinessProbe": {"httpGet": {"path": "/version", "port": 8080},
                           "periodSeconds": 5, "timeoutSeconds": 5},
        # generous: a slow disk or a busy machine is no reason to restart it
        "livenessProbe": {"exec": {"command": ["test", "-f", "/etc/soak/secret/version"]},
                          "periodSeconds": 10, "timeoutSeconds": 10,
                          "failureThreshold": 6}}
    return _deployment("web-cri", _pod_spec("cri", pools["cri"], node, [container],
                                            volumes=True), {})


def web_virtual(pools: dict[str, str]) -> dict[str, Any]:
    container = {"name": "web", "command": ["serve"],
                 "readinessProbe": {"exec": {"command": ["ready"]}, "periodSeconds": 5},
                 "livenessProbe": {"exec": {"command": ["alive"]}, "periodSeconds": 10,
                                   "initialDelaySeconds": 20}}
    return _deployment("web-virtual", _pod_spec("virtual", pools["virtual"], "", [container],
                                                volumes=True),
                       {"fake.nodepulse.dev/ready-after": "5s"})


def _deployment(name: str, spec: dict[str, Any], annotations: dict[str, str]
                ) -> dict[str, Any]:
    labels = {KIND_LABEL: name}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": REPLICAS[name][0], "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels, "annotations": annotations},
                                  "spec": spec}}}


def job(kind: str, n: int, pools: dict[str, str], node: str) -> dict[str, Any]:
    labels = {KIND_LABEL: kind}
    if kind == "job-cri":
        spec = _pod_spec("cri", pools["cri"], node,
                         [{"name": "work", "command": ["sh", "-c", "sleep 3"]}], "Never")
        annotations: dict[str, str] = {}
        completions, parallel = 2, 1
    else:
        spec = _pod_spec("virtual", pools["virtual"], "", [{"name": "work", "command": ["w"]}],
                         "Never")
        annotations = {"fake.nodepulse.dev/run-for": "8s"}
        completions, parallel = 6, 3
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{kind}-{n}", "labels": labels},
            "spec": {"completions": completions, "parallelism": parallel, "backoffLimit": 6,
                     "ttlSecondsAfterFinished": 120,
                     "template": {"metadata": {"labels": labels, "annotations": annotations},
                                  "spec": spec}}}


class Churn(threading.Thread):
    def __init__(self, api: client.ApiClient, pools: dict[str, str], cri_node: str,
                 seed: int, every: float = 4.0) -> None:
        super().__init__(daemon=True, name="soak-churn")
        self.api, self.pools, self.cri_node = api, pools, cri_node
        self.core, self.apps = client.CoreV1Api(api), client.AppsV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.rng = random.Random(f"nodepulse-soak-churn:{seed}")
        self.every = every
        self.stopping = threading.Event()
        self.done: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.version = 0
        self.jobs = 0

    def setup(self) -> None:
        create_namespace(self.core, NAMESPACE)
        self.core.create_namespaced_config_map(NAMESPACE, {
            "metadata": {"name": "soak-config"}, "data": {"version": "0"}})
        self.core.create_namespaced_secret(NAMESPACE, {
            "metadata": {"name": "soak-secret"}, "stringData": {"version": "0"}})
        self.apps.create_namespaced_deployment(NAMESPACE, web_cri(self.pools, self.cri_node))
        self.apps.create_namespaced_deployment(NAMESPACE, web_virtual(self.pools))

    def available(self) -> bool:
        """Both Deployments have every replica available (before the chaos starts)."""
        ds = self.apps.list_namespaced_deployment(NAMESPACE, _request_timeout=TIMEOUT).items
        return len(ds) == 2 and all(
            (d.status.available_replicas or 0) == d.spec.replicas for d in ds)

    def run(self) -> None:
        actions: list[tuple[str, Callable[[], None]]] = [
            ("scale web-cri", lambda: self._scale("web-cri")),
            ("scale web-virtual", lambda: self._scale("web-virtual")),
            ("job on containerd", lambda: self._job("job-cri")),
            ("job on virtual nodes", lambda: self._job("job-virtual")),
            ("update ConfigMap and Secret", self._update_volumes)]
        while not self.stopping.wait(self.every):
            name, act = self.rng.choice(actions)
            try:
                act()
                self.done[name] += 1
            except Exception:  # the API may be down or slow: counted, and on we go
                self.failed[name] += 1

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=30)

    def _scale(self, name: str) -> None:
        low, high = REPLICAS[name]
        self.apps.patch_namespaced_deployment_scale(
            name, NAMESPACE, {"spec": {"replicas": self.rng.randint(low, high)}},
            _request_timeout=TIMEOUT)

    def _job(self, kind: str) -> None:
        live = [j for j in self.batch.list_namespaced_job(
            NAMESPACE, label_selector=f"{KIND_LABEL}={kind}", _request_timeout=TIMEOUT).items
            if not any(c.type in ("Complete", "Failed") and c.status == "True"
                       for c in (j.status.conditions or []))]
        if len(live) >= LIVE_JOBS:
            return
        self.jobs += 1
        self.batch.create_namespaced_job(NAMESPACE, job(kind, self.jobs, self.pools,
                                                        self.cri_node),
                                         _request_timeout=TIMEOUT)

    def _update_volumes(self) -> None:
        self.version += 1
        v = str(self.version)
        self.core.patch_namespaced_config_map("soak-config", NAMESPACE, {"data": {"version": v}},
                                              _request_timeout=TIMEOUT)
        self.core.patch_namespaced_secret("soak-secret", NAMESPACE, {"stringData": {"version": v}},
                                          _request_timeout=TIMEOUT)
