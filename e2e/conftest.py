"""The e2e suite's control plane: the local one (built and started once per session),
or an existing cluster when NODEPULSE_E2E_KUBECONFIG names its admin kubeconfig."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from nodepulse_dev import Cluster
from nodepulse_dev.devcluster import DevCluster, Options
from nodepulse_dev.registry import Registry, start_registry

_clusters: list[Cluster] = []

# Every agent the suite starts serves the kubelet API; many run at once, so each takes
# a free port (and says which in its Node's daemonEndpoints) unless a test says --port.
os.environ.setdefault("NODEPULSE_PORT", "0")


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    external = os.environ.get("NODEPULSE_E2E_KUBECONFIG")
    if external:
        c = Cluster(Path(external), Path(tempfile.mkdtemp(prefix="nodepulse-e2e-")))
        _clusters.append(c)
        yield c
        return
    # `nodepulse-dev up --control-plane-only`: the tests start their own agents
    dev = DevCluster(Options(control_plane_only=True), log=print)
    _clusters.append(dev.cluster)
    try:
        yield dev.start().cluster
    finally:
        failed = bool(request.session.testsfailed)
        dev.stop(remove=not failed)  # every process, by PID
        if failed:
            print(f"\ncontrol plane state and logs kept in {dev.workdir}")


@pytest.fixture(scope="session")
def registry() -> Iterator[Registry]:
    """An image registry on loopback (TLS with its own CA, basic auth), shared by the
    tests that pull images: push with `registry.push(tar, "repo:tag")`, let a
    containerd trust it with `ctd.trust_registry(registry.host, registry.ca)`, pull
    with `registry.auth`. Stopped by PID at the end of the session."""
    reg = start_registry()
    try:
        yield reg
    finally:
        reg.stop()
        shutil.rmtree(reg.workdir, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing e2e test shows the end of each control-plane component's log, and of
    the log of each of its fixtures that has one (an agent it started elsewhere)."""
    report = yield
    if not report.failed:
        return report
    logs = dict(_clusters[-1].component_logs()) if _clusters else {}
    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(getattr(value, "log", None), Path):
            logs.setdefault(f"{name} fixture's", value.log)
    for name, path in logs.items():
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-40:]
            report.sections.append((f"{name} log (last 40 lines)", "\n".join(tail)))
    return report
