"""`make run` as a new user meets it: the Makefile's own `run` command (nodepulse-dev up
--foreground ...) brings the system up, and every command it prints under "Try:" works
as printed, in order (read from its output, so a new suggestion is tested as soon as
it is printed). On the same cluster, a HorizontalPodAutoscaler scales a Deployment on
virtual nodes from 1 to 3 replicas on the usage its pods' annotations say, and back."""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from e2e.harness.ports import free_port
from e2e.harness.waits import eventually
from nodeagent.api.client import new_api_client

ROOT = Path(__file__).resolve().parent.parent
DONE = "Ctrl-C stops everything."


def make_run_argv() -> list[str]:
    """The command of the Makefile's `run` target."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    recipe = lines[lines.index("run: setup") + 1]
    argv = shlex.split(recipe.strip())
    assert Path(argv[0]).name == "nodepulse-dev", recipe
    return [str(ROOT / argv[0]), *argv[1:]]


@dataclass
class Running:
    text: str  # what it printed
    env: dict[str, str]
    kubeconfig: Path


@pytest.fixture(scope="module")
def make_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("make-run")
    # its fixed ports might be taken on a shared machine; its cluster pointer is its own
    argv = [*make_run_argv(), f"--healthz-bind-address=127.0.0.1:{free_port()}",
            f"--operator-metrics-port={free_port()}"]
    env = {**os.environ, "NODEPULSE_DEV_CLUSTER": str(tmp / "current-cluster")}
    log = open(tmp / "make-run.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.put(raw.decode(errors="replace"))
        lines.put(None)
    threading.Thread(target=read, daemon=True).start()
    printed: list[str] = []
    try:
        while not printed or printed[-1].strip() != DONE:
            line = lines.get(timeout=600)
            if line is None:
                raise AssertionError("make run's command exited:\n"
                                     + (tmp / "make-run.log").read_text(errors="replace")[-3000:])
            printed.append(line)
        text = "".join(printed)
        kubeconfig = Path(re.search(r"export KUBECONFIG=(\S+)", text).group(1))  # type: ignore[union-attr]
        yield Running(text, env, kubeconfig)
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        assert proc.returncode == 0, (tmp / "make-run.log").read_text(errors="replace")[-3000:]


def suggestions(text: str) -> list[str]:
    """The commands printed under "Try:", comments dropped."""
    block = text.split("Try:\n", 1)[1].split("\n\n", 1)[0]
    return [re.sub(r"\s+#.*$", "", line.strip()) for line in block.splitlines()]


def test_every_suggestion_of_make_run_works(make_run: Running) -> None:
    commands = suggestions(make_run.text)
    exports = [c for c in commands if c.startswith("export ")]
    assert len(exports) == 2 and len(commands) > 10, commands
    wanted = {"kubectl top node", "kubectl get nodes,nsp", "/proxy/stats/summary",
              "/proxy/metrics/resource", "kubectl logs demo", "scale --virtual-nodes"}
    assert all(any(w in c for c in commands) for w in wanted), commands
    for command in commands:
        if command in exports:
            continue

        def works(command: str = command) -> str | None:
            r = subprocess.run(["bash", "-c", "; ".join([*exports, command])],
                               capture_output=True, text=True, env=make_run.env, timeout=180)
            return r.stdout if r.returncode == 0 and r.stdout.strip() else None
        # metrics-server has a pod's usage a scrape or two (10 s each) after it runs
        out = eventually(works, f"`{command}` works as printed", 90, every=3)
        if "nsp" in command:
            assert "virtual-pool" in out and "default" in out, out
        if command.startswith("kubectl top node"):
            assert "vn-0" in out, out


def test_an_hpa_scales_a_deployment_on_virtual_nodes(make_run: Running) -> None:
    """Its pods say they use 300m of their 100m request: 1 -> 3 replicas; the pods then
    say 10m (a new template, so new pods): back to 1."""
    api = new_api_client(make_run.kubeconfig, component="e2e")
    apps, hpa = client.AppsV1Api(api), client.AutoscalingV2Api(api)
    deployment = yaml.safe_load("""
metadata: {name: hpa-demo}
spec:
  replicas: 1
  selector: {matchLabels: {app: hpa-demo}}
  template:
    metadata:
      labels: {app: hpa-demo}
      annotations: {fake.nodepulse.dev/cpu: 300m}
    spec:
      nodeSelector: {nodepulse.dev/virtual: "true"}
      tolerations: [{key: nodepulse.dev/virtual, operator: Exists}]
      containers: [{name: app, image: example/app:1, resources: {requests: {cpu: 100m}}}]
""")
    apps.create_namespaced_deployment("default", deployment)
    hpa.create_namespaced_horizontal_pod_autoscaler("default", {
        "metadata": {"name": "hpa-demo"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                    "name": "hpa-demo"},
                 "minReplicas": 1, "maxReplicas": 3,
                 "metrics": [{"type": "Resource", "resource": {
                     "name": "cpu", "target": {"type": "Utilization",
                                               "averageUtilization": 50}}}]}})

    def replicas() -> int:
        return int(apps.read_namespaced_deployment("hpa-demo", "default").spec.replicas)
    eventually(lambda: replicas() == 3, "the HPA scaled the Deployment to 3", 120, every=1)
    apps.patch_namespaced_deployment("hpa-demo", "default", {"spec": {"template": {
        "metadata": {"annotations": {"fake.nodepulse.dev/cpu": "10m"}}}}})
    eventually(lambda: replicas() == 1, "the HPA scaled the Deployment back to 1", 150,
               every=1)
    status = hpa.read_namespaced_horizontal_pod_autoscaler("hpa-demo", "default").status
    assert status.current_metrics[0].resource.current.average_utilization < 50, status
