"""The kind tests' fixtures: a private dockerd, the images built (or taken from the
cache), one kind cluster for every test here, and a teardown that leaves nothing.
They are package-scoped: in `pytest tests e2e` the engine and the cluster are gone
before the tests on the local control plane start.

Teardown order: the cluster (`kind delete`), then dockerd with its containers,
networks and children (by PID); then the checks that nothing is left: no process of
the engine, no link of its networks, no host iptables rule added or removed, no host
kernel tunable changed (any change is restored and reported as an error).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.kind import images, node
from e2e.kind.cluster import HostSysctls, KindCluster
from e2e.kind.docker import Dockerd, host_links, host_rules, start_dockerd


def _log(msg: str) -> None:
    print(f"[kind {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@pytest.fixture(scope="package")
def engine() -> Iterator[Dockerd]:
    links_before, rules_before = host_links(), host_rules()
    with HostSysctls() as sysctls:
        eng = start_dockerd()
        try:
            yield eng
        finally:
            children = eng.child_pids()
            eng.stop()
    left = [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert not left, f"processes of the Docker engine still run: {left}"
    assert host_links() - links_before == set(), "links the Docker engine made are still there"
    assert host_rules() == rules_before, "the host's iptables rules changed while kind ran"
    assert not sysctls.changed, ("host kernel tunables changed while kind ran (restored): "
                                 f"{sysctls.changed}")


@pytest.fixture(scope="package")
def project_image(engine: Dockerd) -> str:
    """The image the Dockerfile builds, in the private engine."""
    started = time.monotonic()
    image = images.project_image(engine, log=_log)
    _log(f"{image} in the engine: {time.monotonic() - started:.0f} s")
    return image


@pytest.fixture(scope="package")
def kind_cluster(engine: Dockerd, project_image: str,
                 request: pytest.FixtureRequest) -> Iterator[KindCluster]:
    """A kind cluster (e2e/kind/kind-config.yaml) with the project image loaded."""
    started = time.monotonic()
    node.load_node_image(engine, log=_log)
    _log(f"node image in the engine: {time.monotonic() - started:.0f} s")
    workdir = Path(tempfile.mkdtemp(prefix="nodepulse-kind-"))
    cluster = KindCluster.create(engine, workdir, log=_log)
    try:
        started = time.monotonic()
        cluster.run_kind("load", "docker-image", project_image, "--name", cluster.name)
        _log(f"kind load docker-image {project_image}: {time.monotonic() - started:.0f} s")
        yield cluster
    finally:
        keep = bool(request.session.testsfailed or os.environ.get("NODEPULSE_KIND_LOGS"))
        if keep:
            cluster.save_logs()
            print(f"\nkind node logs in {cluster.workdir / 'kind-logs'}")
        cluster.delete()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
