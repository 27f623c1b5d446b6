"""The e2e suite's control plane: the local one (built and started once per session),
or an existing cluster when NODEPULSE_E2E_KUBECONFIG names its admin kubeconfig."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from e2e import background
from nodepulse_dev import Cluster, build
from nodepulse_dev.devcluster import DevCluster, Options
from nodepulse_dev.processes import stop_process
from nodepulse_dev.registry import Registry, start_registry

_clusters: list[Cluster] = []
REPO = Path(__file__).resolve().parent.parent

# Every agent the suite starts serves the kubelet API; many run at once, so each takes
# a free port (and says which in its Node's daemonEndpoints) unless a test says --port.
os.environ.setdefault("NODEPULSE_PORT", "0")


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    external = os.environ.get("NODEPULSE_E2E_KUBECONFIG")
    if external:
        c = Cluster(Path(external), Path(tempfile.mkdtemp(prefix="nodepulse-e2e-")))
        _clusters.append(c)
        try:
            yield c
        finally:
            # the agents' logs and kubeconfigs the tests wrote: kept only to look into
            if request.session.testsfailed:
                print(f"\nagent logs kept in {c.workdir}")
            else:
                shutil.rmtree(c.workdir, ignore_errors=True)
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


# The tests that wait for the longest builds (the upstream e2e suite and its images'
# programs, the kind node's) run last, in this order. On a cold cache what the suite
# needs is made in the background, at idle CPU priority, while the tests before them
# run (e2e/background.py, docs/development.md). A test that needs something not made
# yet waits for its lock and makes it itself.
RUN_LAST = ("e2e/test_conformance.py", "e2e/kind/", "e2e/test_conformance_kind.py")
_builder: subprocess.Popen[bytes] | None = None


def _run_last_rank(item: pytest.Item) -> int:
    return next((i + 1 for i, prefix in enumerate(RUN_LAST) if item.nodeid.startswith(prefix)),
                0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_run_last_rank)  # stable: each group keeps its order


def pytest_collection_finish(session: pytest.Session) -> None:
    global _builder
    if (session.config.option.collectonly or not shutil.which("go")
            or not any(_run_last_rank(item) for item in session.items)):
        return
    missing = background.missing()
    if not missing:
        return
    log = _builder_log()
    log.parent.mkdir(parents=True, exist_ok=True)
    _say(session, f"building {', '.join(missing)} in the background while the tests run "
                  f"(log: {log})")
    with open(log, "ab") as out:
        _builder = subprocess.Popen([sys.executable, "-u", "-m", "e2e.background", *missing],
                                    cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)


def _say(session: pytest.Session, line: str) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


def _builder_log() -> Path:
    return build.cache_root() / "background-build.log"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A background build still running is stopped with its compilers (its process
    group); what it was building is left as a partial file, never as cached."""
    if _builder is None:
        return
    if _builder.poll() is None:
        os.killpg(_builder.pid, signal.SIGTERM)
        stop_process(_builder)
    elif _builder.returncode:
        _say(session, f"the background build failed (exit {_builder.returncode}): "
                      f"{_builder_log()}")


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
