"""Graceful node shutdown against the real control plane and containerd, with a stand-in
logind on a private D-Bus (e2e/harness/logind.py) that the agent finds through
$DBUS_SYSTEM_BUS_ADDRESS, as it finds the system bus.

One agent, given shutdownGracePeriodByPodPriority in a KubeletConfiguration (budgets 4 s
for priority 0 and up, 3 s for 1000, 3 s for the critical classes; logind allows 5 s):

1. at start it raises logind's InhibitDelayMaxSec with a logind.conf.d drop-in (the
   stand-in reloads it on systemd's KillUnit SIGHUP) and takes a delay inhibitor lock on
   shutdown, which ListInhibitors shows with the agent's PID;
2. on PrepareForShutdown(true) the Node goes NotReady ("node is shutting down"), the pods
   are stopped in priority order (each writes its CLOCK_BOOTTIME when it gets SIGTERM;
   one ignores SIGTERM and holds its group for the group's whole budget, then is
   killed), all end Failed/Terminated with a DisruptionTarget condition, a Shutdown
   Event is on the Node, and the lock is released within the budgets' sum (the
   stand-in sees its file descriptor closed);
3. on PrepareForShutdown(false) the Node is Ready again and a new lock is held; when the
   agent stops, it is released.

Everything started here (bus, stand-in, containerd, agent) is stopped by PID.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness.logind import Logind, iter_stops, start_logind
from e2e.harness.nodeenv import TAINT_KEY, Env, all_running, node_env, start_agent
from e2e.harness.waits import eventually
from nodepulse_dev import Cluster
from nodepulse_dev.images import BUSYBOX_IMAGE

MESSAGE = "Pod was terminated in response to imminent node shutdown."
WHY = "Kubelet needs time to handle node shutdown"
MID_CLASS = "np-e2e-shutdown-mid"
BUDGETS = (4, 3, 3)  # priority 0, 1000, 2000000000
KUBELET_CONFIG = f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failSwapOn: false
failCgroupV1: false
shutdownGracePeriodByPodPriority:
- {{priority: 0, shutdownGracePeriodSeconds: {BUDGETS[0]}}}
- {{priority: 1000, shutdownGracePeriodSeconds: {BUDGETS[1]}}}
- {{priority: 2000000000, shutdownGracePeriodSeconds: {BUDGETS[2]}}}
"""


def pod(node: str, name: str, stops: Path, *, on_term: bool = True,
        priority_class: str | None = None) -> dict[str, Any]:
    """A pod whose shell writes "<name> <uptime>" to the stops log when it gets SIGTERM
    (`on_term`), else ignores SIGTERM (a shell as PID 1 does) until it is killed."""
    trap = (f"trap 'echo {name} $(cut -d\" \" -f1 /proc/uptime) >> /stops/log; exit 0' TERM; "
            if on_term else "")
    spec: dict[str, Any] = {
        "nodeName": node, "hostNetwork": True,
        "tolerations": [{"key": TAINT_KEY, "operator": "Exists"}],
        "terminationGracePeriodSeconds": 30, "automountServiceAccountToken": False,
        "volumes": [{"name": "stops", "hostPath": {"path": str(stops), "type": "Directory"}}],
        "containers": [{
            "name": "c", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
            "command": ["sh", "-c", trap + "sleep 3600 & wait"],
            "volumeMounts": [{"name": "stops", "mountPath": "/stops"}],
            "env": [{"name": "NP_E2E", "value": node}]}]}
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {"metadata": {"name": name}, "spec": spec}


def ready(env: Env) -> tuple[str, str]:
    c = env.ready_condition()
    return c["status"], c["message"]


def test_pods_stop_by_priority_within_budget_and_the_node_comes_back(
        cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("shutdown")
    logind = start_logind(base / "bus", delay_max_sec=5)
    scheduling = client.SchedulingV1Api(cluster.api_client())
    try:
        scheduling.create_priority_class({"metadata": {"name": MID_CLASS}, "value": 1000})
        with node_env(cluster, "containerd", "shut", base) as env:
            run(cluster, env, logind, base)
    finally:
        logind.stop()
        try:
            scheduling.delete_priority_class(MID_CLASS)
        except ApiException as e:
            assert e.status == 404
        scheduling.api_client.close()


def run(cluster: Cluster, env: Env, logind: Logind, base: Path) -> None:
    config = base / "kubelet.yaml"
    config.write_text(KUBELET_CONFIG)
    stops = base / "stops"
    stops.mkdir()
    agent = start_agent(cluster, env, f"--config={config}",
                        f"--logind-conf-dir={logind.conf_dir}",
                        environ={"DBUS_SYSTEM_BUS_ADDRESS": logind.address})
    assert agent.proc is not None

    # 1. logind's delay raised to the budgets' sum, then the lock
    [first] = eventually(lambda: logind.records("inhibit"), "the agent's inhibitor lock", 30)
    assert logind.records("reload")[-1]["delay"] == sum(BUDGETS)
    assert f"InhibitDelayMaxSec={sum(BUDGETS)}" in \
        (logind.conf_dir / "99-nodepulse-agent.conf").read_text()
    assert logind.list_inhibitors() == [
        ["shutdown", "kubelet", WHY, "delay", 0, agent.proc.pid]]

    names = ["quick", "stubborn", "mid", "crit"]
    env.core.create_namespaced_pod(env.ns, pod(env.name, "quick", stops))
    env.core.create_namespaced_pod(env.ns, pod(env.name, "stubborn", stops, on_term=False))
    env.core.create_namespaced_pod(env.ns, pod(env.name, "mid", stops,
                                               priority_class=MID_CLASS))
    env.core.create_namespaced_pod(env.ns, pod(env.name, "crit", stops,
                                               priority_class="system-node-critical"))
    try:
        eventually(lambda: all_running(env, names), "the four pods Running", 90)
    except AssertionError:
        print(env.describe())
        raise
    assert ready(env)[0] == "True"

    # 2. the shutdown
    logind.prepare_for_shutdown(True)
    eventually(lambda: ready(env) == ("False", "node is shutting down"),
               "the Node NotReady, shutting down", 20)
    eventually(lambda: logind.records("released"), "the lock released", 30)
    [signal] = logind.records("signal")
    [released] = logind.records("released")
    assert released["lock"] == first["lock"]
    stopped = dict(iter_stops(stops / "log"))
    t0 = signal["t"]
    at = {name: round(t - t0, 2) for name, t in stopped.items()}
    report = f"SIGTERM after the signal, s: {at}; lock released at {released['t'] - t0:.2f}"
    print(f"\n{report}")
    try:
        assert set(stopped) == {"quick", "mid", "crit"}, report
        # the lowest group first; the next only once the stubborn pod's budget is over,
        # the critical one last; the lock released within the budgets' sum
        assert at["quick"] < BUDGETS[0] <= at["mid"] < at["crit"], report
        assert stopped["crit"] < released["t"] <= t0 + sum(BUDGETS), report
        pods = {p.metadata.name: p for p in env.pods()}
        for name in names:
            st = pods[name].status
            assert (st.phase, st.reason, st.message) == ("Failed", "Terminated", MESSAGE), st
            target = [c for c in st.conditions if c.type == "DisruptionTarget"]
            assert [(c.status, c.reason) for c in target] == [("True",
                                                                "TerminationByKubelet")], st
        killed = pods["stubborn"].status.container_statuses[0].state.terminated
        assert killed.exit_code == 137, killed  # SIGKILL at its group's budget
        events = env.core.list_namespaced_event(
            "default", field_selector=f"involvedObject.name={env.name},reason=Shutdown")
        assert "Shutdown manager detected shutdown event" in [e.message for e in events.items]
    except AssertionError:
        print(env.describe())
        raise

    # 3. cancelled: Ready again, a new lock; the agent's stop releases it
    logind.prepare_for_shutdown(False)
    eventually(lambda: ready(env)[0] == "True", "the Node Ready again", 20)
    eventually(lambda: len(logind.records("inhibit")) == 2, "a new lock", 10)
    assert len(logind.list_inhibitors()) == 1
    agent.stop()
    eventually(lambda: len(logind.records("released")) == 2, "the new lock released", 10)
    assert logind.list_inhibitors() == []
