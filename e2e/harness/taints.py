"""NoSchedule taints by condition, for e2e/test_operator_taints.py (with the admin's
credentials) and e2e/test_chart_identities.py (with the Helm chart's operator
ServiceAccount): operators started one at a time and awaited as leader, agents on the
fake runtime each with a config file, a watch on one Node's taints and conditions,
and the disk-pressure scenario both run.

The fixtures ask for `kube` (the admin's client, CRDs applied) and
`operator_credentials`, which the test module provides.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch

from e2e.harness.operators import AGENT, Operator, OperatorCredentials
from e2e.harness.ports import free_port
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually
from nodepulse_dev import Cluster

RUN = uuid.uuid4().hex[:5]
NOT_READY = "node.kubernetes.io/not-ready"
DISK = "node.kubernetes.io/disk-pressure"


class Agent:
    def __init__(self, cluster: Cluster, name: str, root: Path, config: Path) -> None:
        self.name = name
        self.log = cluster.log_dir / f"agent-{name}.log"
        argv = [str(AGENT), "--node-name", name,
                "--kubeconfig", str(cluster.node_kubeconfig(name)),
                "--healthz-bind-address", f"127.0.0.1:{free_port()}",
                "--root-dir", str(root / name), "--runtime", "fake",
                "--config", str(config)]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class NodeWatch(threading.Thread):
    """Every version of one Node as the API server hands them out, from before it
    exists: (event type, NoSchedule taint keys, Ready status, DiskPressure status,
    monotonic time received)."""

    def __init__(self, api: client.ApiClient, name: str) -> None:
        super().__init__(daemon=True, name=f"watch-{name}")
        self.core, self.name = client.CoreV1Api(api), name
        self.events: list[tuple[str, set[str], str | None, str | None, float]] = []
        self.rv = self.core.list_node(field_selector=f"metadata.name={name}").metadata \
            .resource_version
        self.watch = watch.Watch()
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            for ev in self.watch.stream(self.core.list_node, resource_version=self.rv,
                                        field_selector=f"metadata.name={self.name}",
                                        timeout_seconds=300):
                node = ev["object"]
                status = {c.type: c.status for c in node.status.conditions or []}
                self.events.append((ev["type"], noschedule(node), status.get("Ready"),
                                    status.get("DiskPressure"), time.monotonic()))
        except Exception as e:  # the test reads it
            self.errors.append(repr(e))

    def stop(self) -> None:
        self.watch.stop()


def noschedule(node: Any) -> set[str]:
    return {t.key for t in node.spec.taints or [] if t.effect == "NoSchedule"}


@pytest.fixture(name="start_operator")
def start_operator_fixture(cluster: Cluster, kube: client.ApiClient,
                           operator_credentials: OperatorCredentials
                           ) -> Iterator[Callable[[], Operator]]:
    started: list[Operator] = []

    def start() -> Operator:
        op = Operator(cluster, f"taints-{RUN}-{len(started)}", operator_credentials)
        started.append(op)
        eventually(op.ready, "operator ready", 60)
        eventually(lambda: samples(
            op.metrics(), "nodepulse_operator_leader") == 1, "operator leading", 40)
        return op

    yield start
    for op in started:
        op.kill(signal.SIGTERM)


@pytest.fixture(name="node_env")
def node_env_fixture(cluster: Cluster, kube: client.ApiClient, tmp_path: Path
                     ) -> Iterator[Callable[[str, str], tuple[Agent, Path]]]:
    """Starts agents (each with a config file), and afterwards kills them and deletes
    their Nodes and Leases."""
    agents: list[Agent] = []

    def start(name: str, config: str) -> tuple[Agent, Path]:
        path = tmp_path / f"{name}.yaml"
        path.write_text(config)
        agent = Agent(cluster, name, tmp_path, path)
        agents.append(agent)
        return agent, path

    yield start
    core, coord = client.CoreV1Api(kube), client.CoordinationV1Api(kube)
    for a in agents:
        a.kill()
        for delete, args in ((core.delete_node, (a.name,)),
                             (coord.delete_namespaced_lease, (a.name, "kube-node-lease"))):
            try:
                delete(*args)
            except client.ApiException as e:
                if e.status != 404:
                    raise


def read(kube: client.ApiClient, name: str) -> Any:
    try:
        return client.CoreV1Api(kube).read_node(name)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def ready(node: Any) -> str | None:
    return next((c.status for c in node.status.conditions or [] if c.type == "Ready"), None)


def disk_pressure_taint_follows_the_condition(
        kube: client.ApiClient, start_operator: Callable[[], Operator],
        node_env: Callable[[str, str], tuple[Agent, Path]]) -> None:
    """The agent's config file moves the nodefs threshold so that DiskPressure is True:
    the operator adds the disk-pressure taint and takes it off when the threshold moves
    back; a watch on the Node shows admission's not-ready taint at creation, removed
    only once Ready was True, and each taint change written once."""
    name = f"taints-{RUN}-disk"
    op = start_operator()
    nw = NodeWatch(kube, name)
    nw.start()
    try:
        _, config = node_env(name, "evictionHard:\n  nodefs.available: '0%'\n")
        eventually(lambda: (n := read(kube, name)) is not None
                   and ready(n) == "True" and not noschedule(n) & {NOT_READY, DISK},
                   "Ready, without not-ready", 60)
        eventually(lambda: nw.events and nw.events[-1][1] == set(), "the watch caught up", 10)
        # Created with admission's taint, which went only once Ready was True.
        kind, first, *_ = nw.events[0]
        assert kind == "ADDED" and NOT_READY in first, nw.events
        assert all(r == "True" for _, ts, r, *_ in nw.events if NOT_READY not in ts), nw.events
        writes = op.writes()

        # The threshold moves: every filesystem is under pressure.
        config.write_text("evictionHard:\n  nodefs.available: 1Pi\n")  # any fs is below
        node = eventually(lambda: DISK in noschedule(
            n := read(kube, name)) and n, "disk-pressure taint", 40)
        assert next(c.status for c in node.status.conditions
                    if c.type == "DiskPressure") == "True"
        assert NOT_READY not in noschedule(node)
        assert op.writes() > writes

        config.write_text("evictionHard:\n  nodefs.available: '0%'\n")
        node = eventually(lambda: DISK not in noschedule(
            n := read(kube, name)) and n, "disk-pressure taint removed", 40)
        assert next(c.status for c in node.status.conditions
                    if c.type == "DiskPressure") == "False"
        # The GET reads etcd; the watch may deliver that write a moment later.
        eventually(lambda: DISK not in nw.events[-1][1] and nw.events[-1][3] == "False",
                   "the watch caught up", 10)
        # Each taint change was a write of its own; none was repeated.
        changes = [ts for _, ts, *_ in nw.events]
        transitions = sum(1 for a, b in zip(changes, changes[1:], strict=False) if a != b)
        assert transitions == 3, nw.events  # not-ready off, disk-pressure on, off
        assert not nw.errors, nw.errors

        def lag(cond: Callable[[Any], bool], taint: Callable[[Any], bool]) -> float:
            """From the first event showing `cond` to the first showing `taint`."""
            t0 = next(e[4] for e in nw.events if cond(e))
            return next(e[4] for e in nw.events if e[4] >= t0 and taint(e)) - t0
        print(f"\ncondition -> taint, as the watch saw them: Ready=True -> not-ready off "
              f"{lag(lambda e: e[2] == 'True', lambda e: NOT_READY not in e[1]):.2f} s; "
              f"DiskPressure=True -> taint "
              f"{lag(lambda e: e[3] == 'True', lambda e: DISK in e[1]):.2f} s")
    finally:
        nw.stop()
