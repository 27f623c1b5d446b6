"""The Helm chart's tools on a cluster: helm and kubectl (pinned, built by the cluster
fixture) with their own home, and the values that keep the chart's pods Pending on
the local control plane (no kubelet runs them there)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from nodepulse_dev import Cluster

CHART = Path(__file__).resolve().parents[2] / "charts" / "nodepulse"
CRDS = CHART / "crds"
# A node label no node carries: the chart's pods stay Pending (the local control plane
# has no kubelet for them).
NOWHERE = "nodepulse.dev/e2e-no-such-node"


class Tools:
    """helm and kubectl, pinned and built by the cluster fixture, on its kubeconfig."""

    def __init__(self, cluster: Cluster, home: Path) -> None:
        self.cluster = cluster
        self.helm_bin = cluster.binary("helm")
        self.kubectl_bin = cluster.binary("kubectl")
        home.mkdir(parents=True, exist_ok=True)
        # helm keeps its cache and config out of the user's home
        self.env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"),
                    "HELM_CONFIG_HOME": str(home / "config"),
                    "HELM_DATA_HOME": str(home / "data"), "KUBECONFIG": str(cluster.kubeconfig)}

    def run(self, binary: Path, *args: str, stdin: str | None = None,
            check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(binary), *args], input=stdin, capture_output=True,
                              text=True, env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{binary.name} {' '.join(args)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def helm(self, *args: str, check: bool = True,
             timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return self.run(self.helm_bin, *args, "--kubeconfig", str(self.cluster.kubeconfig),
                        check=check, timeout=timeout)

    def kubectl(self, *args: str, stdin: str | None = None,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(self.kubectl_bin, "--kubeconfig", str(self.cluster.kubeconfig), *args,
                        stdin=stdin, check=check)

    def kube_version(self) -> str:
        return str(client.VersionApi(self.cluster.api_client()).get_code().git_version)

    def template(self, release: str, namespace: str, *sets: str) -> str:
        # --kube-version: the server's, so `kubeVersion` in Chart.yaml is checked against it
        return self.helm("template", release, str(CHART), "--namespace", namespace,
                         "--kube-version", self.kube_version(), *sets).stdout

    def apply_crds(self) -> None:
        """The CRDs as users manage them: kubectl, server-side, from the chart's crds/."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                     "crd/nodestatuspolicies.nodepulse.dev")


# The values files of the tests; removed with the directory at exit.
VALUES_DIR = tempfile.TemporaryDirectory(prefix="np-values-")


def sets(values: dict[str, Any]) -> list[str]:
    """Arguments giving helm these values: a values file (keys may hold dots)."""
    fd, path = tempfile.mkstemp(suffix=".yaml", dir=VALUES_DIR.name)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(values, f)
    return ["-f", path]


PENDING = {"operator": {"nodeSelector": {NOWHERE: "true"}},
           "agent": {"nodeSelector": {NOWHERE: "true"}}}


def values(**extra: Any) -> list[str]:
    """The values that keep the chart's pods Pending, plus `extra` (merged per section)."""
    merged: dict[str, Any] = json.loads(json.dumps(PENDING))
    for key, value in extra.items():
        merged.setdefault(key, {}).update(value)
    return sets(merged)


@pytest.fixture(scope="module", name="tools")
def tools_fixture(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Tools:
    """helm and kubectl on the cluster, the CRDs applied."""
    t = Tools(cluster, tmp_path_factory.mktemp("helm-home"))
    t.apply_crds()
    return t
