"""The evented PLEG on CRI container events, against real containerds (issue 17).

containerd 2.x (built from the pinned Go module) streams GetContainerEvents; Debian's
1.6 does not. The agent runs with --evented-pleg-relist-period=300s, so while the
stream is up a relist is 300 s away and only an event can explain what the agent does
within a test. What the PLEG did is read from its metrics: a ContainerDied counted
while the relist count stood still came from the stream (the relist's diff and the
stream are the only sources of PLEG events; a worker's own refresh emits none).

1. A container killed behind the agent's back is restarted: on 2.x from the event
   with no relist in between; on 1.6 (no stream) from the 1 s relist.
2. containerd restarts on 2.x: the stream breaks with it, the PLEG falls back to the
   1 s relist (event_stream_up 0, relists fail every second while containerd is down),
   subscribes again when containerd is back (event_stream_up 1), the pods converge
   (one whose container died meanwhile is restarted), and the new stream carries
   events again (a kill is restarted with no relist).

Agents, containerd and pods are set up and torn down by node_env and start_agent of
e2e/harness/nodeenv.py, as in test_faults_runtime (node credentials, a tainted Node,
stopped by PID).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from kubernetes import client

from e2e.harness.nodeenv import (
    AgentProc,
    Env,
    all_running,
    node_env,
    running,
    start_agent,
    workloads,
)
from e2e.harness.processes import alive
from e2e.harness.waits import eventually
from nodepulse_dev import Cluster
from nodepulse_dev.containerd import BUILDS

LONG_RELIST = "--evented-pleg-relist-period=300s"
RELISTS = "nodepulse_pleg_relist_duration_seconds_count"
FAILURES = "nodepulse_pleg_relist_failures_total"
STREAM_UP = "nodepulse_pleg_event_stream_up"


def died(agent: AgentProc) -> float:
    return agent.sample("nodepulse_pleg_events_total", type="ContainerDied") or 0.0


def settled_relists(agent: AgentProc) -> float:
    """The relist count once it stands still for 2 s: the relist the stream's
    subscription asks for is over, the next one is the 300 s period away."""
    def same() -> float | None:
        before = agent.sample(RELISTS)
        time.sleep(2)
        after = agent.sample(RELISTS)
        return after if before is not None and before == after else None
    return eventually(same, "the relist count to stand still (the 300 s period)", 30)


def kill_workload(env: Env, name: str) -> client.V1ContainerStatus:
    """SIGKILL the pod's one workload process (containerd is not asked); the API's
    status of the container as it was."""
    pod = env.pod(name)
    assert pod is not None and running(pod), pod
    [pid] = workloads(env.name)[name]
    os.kill(pid, signal.SIGKILL)
    eventually(lambda: not alive(pid), f"{name}'s workload to die", 10)
    return pod.status.container_statuses[0]


# how the killed container ended, as containerd reports it: SIGKILL. When it died while
# containerd was down, containerd 2.4 has lost the exit by the time CRI reads it back
# (its log: "cleaning leaked shim process": at start it reaps a task that is not a
# sandbox and has no process left) and says exit 255, reason Unknown; the agent
# reports what the runtime says.
KILLED = {(137, "Error")}
KILLED_DURING_OUTAGE = {(255, "Unknown")}


def restarted(env: Env, name: str, before: client.V1ContainerStatus,
              ends: set[tuple[int, str]] = KILLED) -> client.V1ContainerStatus:
    """Wait for the pod's container to run again as a new container, one restart more,
    its last state the killed one, ended as one of `ends` (exit code, reason)."""
    def again() -> client.V1ContainerStatus | None:
        pod = env.pod(name)
        cs = pod.status.container_statuses[0] if pod and pod.status.container_statuses \
            else None
        if cs and running(pod) and cs.restart_count == before.restart_count + 1:
            return cs
        return None
    try:
        cs = eventually(again, f"{name}'s killed container restarted", 90)
    except AssertionError:
        print(env.describe())
        raise
    assert cs.container_id != before.container_id
    last = cs.last_state.terminated
    assert last is not None and last.container_id == before.container_id, cs
    assert (last.exit_code, last.reason) in ends, last
    return cs


@pytest.mark.parametrize("build", BUILDS)
def test_killed_container_restarted_from_the_event_stream(
        cluster: Cluster, tmp_path_factory: pytest.TempPathFactory, build: str) -> None:
    tag = f"ev-{build[:3]}"
    with node_env(cluster, "containerd", tag, tmp_path_factory.mktemp(tag),
                  build=build) as env:
        agent = start_agent(cluster, env, LONG_RELIST)
        env.create("k0")
        eventually(lambda: all_running(env, ["k0"]), "k0 Running", 90)
        streams = build == "built"
        eventually(lambda: agent.sample(STREAM_UP) == (1.0 if streams else 0.0),
                   f"nodepulse_pleg_event_stream_up {int(streams)}", 30)
        relists0 = settled_relists(agent) if streams else agent.sample(RELISTS)
        died0 = died(agent)
        before = kill_workload(env, "k0")
        restarted(env, "k0", before)
        relists = (agent.sample(RELISTS) or 0.0) - (relists0 or 0.0)
        print(f"\n[{build}] k0 restarted; relists meanwhile: {relists:.0f}, ContainerDied "
              f"events: {died(agent) - died0:.0f}, stream up: {agent.sample(STREAM_UP)}")
        assert died(agent) > died0, "the death was never a PLEG event"
        if streams:
            assert relists == 0, "a relist ran: the event alone did not drive the restart"
            assert agent.sample(STREAM_UP) == 1.0
        else:
            # no stream: the relist at 1 s, whatever the long period says
            assert relists >= 1
            assert agent.sample(STREAM_UP) == 0.0


def test_stream_breaks_with_containerd_and_is_subscribed_again(
        cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    with node_env(cluster, "containerd", "evrst", tmp_path_factory.mktemp("evrst"),
                  build="built") as env:
        agent = start_agent(cluster, env, LONG_RELIST)
        env.create("s0")
        env.create("s1")
        eventually(lambda: all_running(env, ["s0", "s1"]), "s0 and s1 Running", 90)
        eventually(lambda: agent.sample(STREAM_UP) == 1.0, "the event stream up", 30)
        s0 = env.pod("s0")
        assert s0 is not None
        s0_before = s0.status.container_statuses[0]
        failures0 = agent.sample(FAILURES) or 0.0

        env.ctd.kill_daemon()  # by PID; the shims keep the containers running
        try:
            eventually(lambda: agent.sample(STREAM_UP) == 0.0,
                       "the PLEG to see the stream broken (event_stream_up 0)", 30)
            # the fallback: relists every second (each failing, containerd is down);
            # at the 300 s period there would be the one the break asked for. The
            # stream is tried again meanwhile (after 1 s, 2 s, ...) and never taken for
            # up: each try fails at once, asking for no relist of its own.
            stream_seen: list[float | None] = []

            def relisting_every_second() -> bool:
                stream_seen.append(agent.sample(STREAM_UP))
                return (agent.sample(FAILURES) or 0.0) >= failures0 + 5

            eventually(relisting_every_second, "5 failed relists: the 1 s relist took over",
                       30)
            assert 1.0 not in stream_seen, "the stream looked up while containerd was down"
            # a container that dies meanwhile: its shim keeps the exit for containerd
            s1_before = kill_workload(env, "s1")
        finally:
            env.ctd.start_daemon()  # same root, state and socket
        eventually(lambda: agent.sample("nodepulse_pleg_runtime_up") == 1.0,
                   "the PLEG to see the runtime again", 60)
        eventually(lambda: agent.sample(STREAM_UP) == 1.0,
                   "the stream subscribed again (event_stream_up 1)", 60)

        # the pods converge: the one that died is restarted, the other one untouched
        restarted(env, "s1", s1_before, KILLED_DURING_OUTAGE)
        s0_now = env.pod("s0")
        assert s0_now is not None and running(s0_now)
        assert s0_now.status.container_statuses[0].container_id == s0_before.container_id
        assert s0_now.status.container_statuses[0].restart_count == 0

        # the new stream carries events: a kill now is restarted with no relist
        relists0 = settled_relists(agent)
        died0 = died(agent)
        restarted(env, "s0", kill_workload(env, "s0"))
        assert died(agent) > died0, "the death was never a PLEG event"
        assert agent.sample(RELISTS) == relists0, \
            "a relist ran: the new stream did not drive the restart"
        assert agent.sample(STREAM_UP) == 1.0
