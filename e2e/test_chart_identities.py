"""The operator and heartbeat e2e scenarios again, under the Helm chart's identities.

The chart is installed (the `release` fixture of e2e/harness/release.py, as in
e2e/test_rbac.py); tokens for its two ServiceAccounts come from the TokenRequest API;
then the scenario functions of e2e/harness/heartbeats.py, taints.py and pools.py, which
e2e/test_heartbeat.py, e2e/test_operator_taints.py and e2e/test_operator.py run, run
again with those tokens instead of the admin's or a node's credentials. Only the scenarios that
together use every permission the chart grants are re-run, so CI time is not doubled:

  agent (virtual-node mode, as the chart's StatefulSet runs it; one process, two
  Nodes): Node create (registration), Node and Node status patch, Lease create and
  renew (and re-create after a delete), the Node and pod watches; Events, pod status
  and the final pod delete are used by test_rbac.py's agent under the same identity.
  operator: the heartbeat annotation (Node patch), condition taints, Ready=Unknown
  (Node status), unreachable taints NoSchedule and NoExecute (pods evicted by the
  taint manager), policy status, the node Leases watch, Events on Nodes, and leader
  election with two replicas including the SIGKILL failover.

Every process's log is checked for refusals: a permission the chart lacks fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client

from e2e.harness.agents import clean_slate, kill_all, spawn
from e2e.harness.heartbeats import Parts, efficient_heartbeats
from e2e.harness.helm import (
    tools_fixture,  # noqa: F401 (a fixture)
)
from e2e.harness.operators import (
    Operator,
    OperatorCredentials,
    Renewer,
    kube_fixture,  # noqa: F401 (a fixture)
    operators_fixture,  # noqa: F401 (a fixture)
    renewer_fixture,  # noqa: F401 (a fixture)
)
from e2e.harness.pools import (
    Agents,
    agents_fixture,  # noqa: F401 (a fixture)
    ha_failover,
    two_pools_grace_15_and_60,
)
from e2e.harness.release import (
    REFUSED,
    Release,
    identities_fixture,  # noqa: F401 (a fixture)
    release_fixture,  # noqa: F401 (a fixture)
)
from e2e.harness.taints import (
    Agent,
    disk_pressure_taint_follows_the_condition,
    node_env_fixture,  # noqa: F401 (a fixture)
    start_operator_fixture,  # noqa: F401 (a fixture)
)
from nodepulse_dev import Cluster


# The scenarios' fixtures, imported above as test_operator(_taints) and test_rbac import
# them, pick up `operator_credentials` here: the chart's.
@pytest.fixture(scope="module")
def operator_credentials(release: Release, identities: dict[str, Path]
                         ) -> OperatorCredentials:
    """The chart's operator ServiceAccount and the one election Lease its RBAC names."""
    return OperatorCredentials(identities["operator"], release.namespace,
                               f"{release.name}-nodepulse-operator")


def _not_refused(logs: list[Path]) -> None:
    for log in logs:
        text = log.read_text(errors="replace")
        assert not REFUSED.search(text), f"{log.name}: refused something:\n{text[-4000:]}"


def test_heartbeats_under_the_agent_identity(cluster: Cluster, release: Release,
                                             identities: dict[str, Path],
                                             tmp_path: Path) -> None:
    """The efficient-heartbeat checks with one agent in virtual-node mode, as the
    chart's StatefulSet pod 0 runs it, with only the agent ServiceAccount's token."""
    nodes = (release.agent_node(0, 0), release.agent_node(0, 1))
    clean_slate(cluster.api_client(), nodes)
    agent_id = f"{release.agent_sa}-0"  # the StatefulSet's pod 0
    agent = spawn(tmp_path, agent_id, identities["agent"], "--virtual-nodes", "2",
                  "--node-name-prefix", f"{agent_id}-", "--agent-id", agent_id,
                  "--runtime", "fake", nodes=nodes)
    try:
        efficient_heartbeats(cluster, [agent], Parts(default=nodes[0], policy=nodes[1]))
    finally:
        kill_all([agent])
    node = client.CoreV1Api(cluster.api_client()).read_node(nodes[0])
    assert any(t.key == "nodepulse.dev/virtual" for t in node.spec.taints or [])
    _not_refused([agent.log])


def test_condition_taints_under_the_operator_identity(
        kube: client.ApiClient, start_operator: Callable[[], Operator],
        node_env: Callable[[str, str], tuple[Agent, Path]]) -> None:
    started: list[Operator] = []

    def start() -> Operator:
        started.append(start_operator())
        return started[-1]

    disk_pressure_taint_follows_the_condition(kube, start, node_env)
    _not_refused([o.log for o in started])


def test_two_pools_under_the_operator_identity(kube: client.ApiClient,
                                               operators: list[Operator],
                                               agents: Agents) -> None:
    two_pools_grace_15_and_60(kube, operators, agents)
    _not_refused([o.log for o in operators])


def test_ha_failover_under_the_operator_identity(
        kube: client.ApiClient, operators: list[Operator], renewer: Renewer,
        operator_credentials: OperatorCredentials) -> None:
    """Last: kills the leader of the pair."""
    ha_failover(kube, operators, renewer, operator_credentials)
    _not_refused([o.log for o in operators])
