"""nodepulse-agent as a process: one node each with that node's credentials
(system:node:<name>), or many virtual nodes with any credentials; started with its
health server on a free port and its log in a file, stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.harness.ports import free_port
from nodepulse_dev import Cluster

AGENT = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "nodepulse-agent"


@dataclass
class AgentProcess:
    name: str  # its agent id (the nodepulse.dev/agent label of its Nodes)
    proc: subprocess.Popen[bytes]
    log: Path
    port: int
    nodes: tuple[str, ...] = ()  # the Nodes it speaks for (default: its name)

    def __post_init__(self) -> None:
        self.nodes = self.nodes or (self.name,)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def spawn(tmp_path: Path, name: str, kubeconfig: Path, *args: str,
          config: str | None = None, nodes: tuple[str, ...] = ()) -> AgentProcess:
    """nodepulse-agent as a process with these credentials; `args` say which node(s)."""
    port = free_port()
    argv = [str(AGENT), "--kubeconfig", str(kubeconfig),
            "--healthz-bind-address", f"127.0.0.1:{port}",
            "--root-dir", str(tmp_path / name), *args]
    if config is not None:
        path = tmp_path / f"{name}.yaml"
        path.write_text(config)
        argv += ["--config", str(path)]
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return AgentProcess(name, proc, log, port, nodes)


def kill_all(started: list[AgentProcess]) -> None:
    for a in started:  # by PID, whatever the test's outcome
        if a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait()


@pytest.fixture(name="agents")
def agents_fixture(cluster: Cluster, tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Agents with node credentials (system:node:<name>), one node each."""
    started: list[AgentProcess] = []

    def start(name: str, *args: str, config: str | None = None) -> AgentProcess:
        agent = spawn(tmp_path, name, cluster.node_kubeconfig(name), "--node-name", name,
                      *args, config=config)
        started.append(agent)
        return agent

    yield start
    kill_all(started)


def clean_slate(api: client.ApiClient, names: Any) -> None:
    """Delete the Nodes and Leases an earlier run may have left behind."""
    core, coord = client.CoreV1Api(api), client.CoordinationV1Api(api)
    for n in names:
        for delete in (lambda n=n: core.delete_node(n),
                       lambda n=n: coord.delete_namespaced_lease(n, "kube-node-lease")):
            try:
                delete()
            except client.ApiException as e:
                assert e.status == 404
