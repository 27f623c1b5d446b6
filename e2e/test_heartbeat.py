"""Efficient heartbeats against the real control plane, witnessed by the API server.

Four agents run at once as real processes with node credentials (system:node:<name>),
each on its own node name, so the whole file costs about two minutes:

  hb-default   defaults: over 60 s, Lease updates 6±1 and no NodeStatus patches
  hb-report20  nodeStatusReportFrequency 20s: 3±1 status patches in 60 s
  hb-cond      its config file moves the disk-pressure threshold: reported within
               one update period
  hb-policy    the admin writes the heartbeat annotation (renew every 2 s): followed
               within one old interval

Per-node counts come from a watch on Leases and Nodes (each write is one event); the
API server's own apiserver_request_total must agree with their sum.

The checks are `efficient_heartbeats` (e2e/harness/heartbeats.py), which takes the
agent processes and which node plays which part, so e2e/test_chart_identities.py runs
the same checks on one agent in virtual-node mode under the Helm chart's
ServiceAccount (hb-default's and hb-policy's parts; the other two need a config file
per node).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from kubernetes import client

from e2e.harness.agents import (
    AgentProcess,
    agents_fixture,  # noqa: F401 (a fixture)
    clean_slate,
)
from e2e.harness.heartbeats import Parts, efficient_heartbeats, lease_exists, reachable
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually
from nodeagent.api.policy import HEARTBEAT_ANNOTATION, Heartbeat, encode_heartbeat_annotation
from nodepulse_dev import Cluster


def test_efficient_heartbeats(cluster: Cluster, agents: Callable[..., AgentProcess],
                              tmp_path: Path) -> None:
    names = ("hb-default", "hb-report20", "hb-cond", "hb-policy")
    clean_slate(cluster.api_client(), names)
    procs = [agents("hb-default"),
             agents("hb-report20", config="nodeStatusReportFrequency: 20s\n"),
             agents("hb-cond", config="evictionHard:\n  nodefs.available: '0%'\n"),
             agents("hb-policy")]
    efficient_heartbeats(cluster, procs, Parts(default="hb-default", policy="hb-policy",
                                               report20="hb-report20", cond="hb-cond",
                                               cond_config=tmp_path / "hb-cond.yaml"))


def test_survives_an_apiserver_restart(cluster: Cluster, agents: Callable[..., AgentProcess]
                                       ) -> None:
    """Lease renewals and the node watch come back by themselves after the API server
    restarts: a policy written afterwards is still followed."""
    api = cluster.api_client()
    core, coord = client.CoreV1Api(api), client.CoordinationV1Api(api)
    name = "hb-restart"
    with contextlib.suppress(client.ApiException):
        core.delete_node(name)
    a = agents(name)
    eventually(lambda: reachable(lambda: a.get("/readyz")[0] == 200)
               and lease_exists(coord, name), "registered", 60)
    cluster.restart_apiserver()
    api = cluster.api_client()
    core, coord = client.CoreV1Api(api), client.CoordinationV1Api(api)
    core.patch_node(name, {"metadata": {"annotations": {
        HEARTBEAT_ANNOTATION: encode_heartbeat_annotation(
            "fast", Heartbeat(leaseDurationSeconds=40, renewIntervalSeconds=2))}}})
    seen: set[str] = set()

    def renewed_often() -> bool:
        seen.add(str(coord.read_namespaced_lease(name, "kube-node-lease").spec.renew_time))
        return len(seen) >= 5
    # watch back-off (at most 8 s) + one old interval (10 s) + four 2 s renewals
    eventually(renewed_often, "renewals every 2 s after the restart", 35)
    assert a.get("/healthz")[0] == 200
    _, text = a.get("/metrics")
    assert samples(text, "nodepulse_heartbeat_policy_updates_total", result="applied") == 1
    assert a.stop() == 0
