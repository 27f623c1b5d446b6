"""The e2e scenarios that mean something more on a cluster with real kubelets, run
again against the kind cluster (the suite's NODEPULSE_E2E_KUBECONFIG), each in a pytest
of its own. The rest of the suite already runs on the local control plane; a scenario
is repeated here only when kind's cluster differs in a way it depends on:

IN
- test_cluster.py: a node's credentials reach only its own Lease and Node, and node
  credentials come from a CertificateSigningRequest: on kind that is kubeadm's API
  server (Node authorizer, NodeRestriction) and its CSR signer, which every agent
  with node credentials relies on.
- test_operator.py, the two pools: real agents die and come back while the controller
  manager's node-lifecycle controller is on (kind keeps the defaults) and real kubelets
  renew their own Leases next to them: the operator, with its default way of sharing
  the nodes, still taints only the pool whose grace ran out and untaints it after.

OUT (what kind would add nothing to, or cannot give)
- the chart's pods: e2e/kind/test_chart.py runs them for real (test_helm.py keeps the
  API-level checks on the local control plane; test_rbac.py and
  test_chart_identities.py run the chart's identities as processes, which the chart's
  pods on kind now do too);
- faults that stop or compact the control plane (test_faults_*, the API server restart
  of test_operator.py): kind's control plane is not ours to stop;
- the partition guard (test_operator.py): on kind the node-lifecycle controller's own
  zone rules also taint unreachable nodes, which is what that test must not see;
- heartbeat and virtual-node rates (test_heartbeat.py, test_virtual_nodes.py): they
  count every Lease and Node write of an otherwise idle API server;
- the agent's own runtime, input and identity (test_pods.py, test_runtime_*,
  test_bad_input.py, test_sources.py, test_node_identity.py, test_operator_taints.py):
  they run on this host whatever the API server is.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.kind.cluster import KindCluster
from e2e.kind.images import REPO

# The first test to use the engine or the cluster also waits for what is not cached yet
# (Go builds, debootstrap, the image builds: about 10 minutes cold, e2e/kind/conftest.py).
pytestmark = pytest.mark.timeout(1800)

SCENARIOS = [
    "e2e/test_cluster.py::test_a_node_may_renew_only_its_own_lease_and_node",
    "e2e/test_cluster.py::test_node_identity_through_a_certificate_signing_request",
    "e2e/test_operator.py::test_two_pools_grace_15_and_60",
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_on_kind(kind_cluster: KindCluster, scenario: str, tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "NODEPULSE_E2E_KUBECONFIG": str(kind_cluster.kubeconfig),
           "TMPDIR": str(temp)}
    proc = subprocess.run([sys.executable, "-m", "pytest", scenario, "-q", "-p",
                           "no:cacheprovider", "-o", "console_output_style=classic"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-6000:], proc.stderr[-2000:])
    assert proc.returncode == 0, f"{scenario} failed on kind:\n{proc.stdout[-6000:]}"
    assert re.fullmatch(r"1 passed in [0-9.]+s( \(.*\))?", proc.stdout.splitlines()[-1])
    # a scenario that passed leaves no folder of its own behind
    assert [p.name for p in temp.glob("nodepulse-*")] == []
