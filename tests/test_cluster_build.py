"""The binary cache: pinned versions come from the go.mod files, and a cached binary
is never rebuilt."""

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.cluster import build


@pytest.fixture(autouse=True)
def own_build_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Builds here are fakes: they must not wait for a real build holding the shared lock."""
    lock = tmp_path / "build.lock"
    monkeypatch.setattr(build, "BUILD_LOCK", lock)
    return lock


def test_versions_come_from_the_go_modules() -> None:
    assert build.kubernetes_version().startswith("v1.")
    assert build.TOOLS["kube-apiserver"].version == build.kubernetes_version()
    assert build.TOOLS["etcd"].version.startswith("v3.")
    assert build.TOOLS["helm"].version.startswith("v3.")
    assert build.TOOLS["kwok"].version.startswith("v0.")
    assert build.TOOLS["e2e.test"].version == build.kubernetes_version()
    assert build.TOOLS["registry"].version.startswith("v3.")
    assert build.TOOLS["crane"].version.startswith("v0.")


def test_cached_binaries_are_not_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODEPULSE_CACHE", str(tmp_path))
    for tool in build.TOOLS.values():
        tool.path.parent.mkdir(parents=True, exist_ok=True)
        tool.path.write_text("cached")

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a cached binary was rebuilt: {args}")

    monkeypatch.setattr(subprocess, "run", no_build)
    paths = build.ensure()
    assert paths["kube-apiserver"] == tmp_path / "bin" / build.kubernetes_version() / "kube-apiserver"


def test_a_missing_binary_is_built_under_its_version(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODEPULSE_CACHE", str(tmp_path))
    calls: list[list[str]] = []

    def fake_go(cmd: list[str], **kwargs: object) -> None:
        calls.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_text("built")

    monkeypatch.setattr(subprocess, "run", fake_go)
    path = build.ensure(["kubectl"], log=lambda _: None)["kubectl"]
    assert path.read_text() == "built"
    assert calls[0][-1] == "k8s.io/kubernetes/cmd/kubectl"
    assert f"gitVersion={build.kubernetes_version()}" in calls[0][calls[0].index("-ldflags") + 1]


def test_a_test_binary_is_built_with_go_test_c(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODEPULSE_CACHE", str(tmp_path))
    calls: list[list[str]] = []

    def fake_go(cmd: list[str], **kwargs: object) -> None:
        calls.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_text("built")

    monkeypatch.setattr(subprocess, "run", fake_go)
    build.ensure(["e2e.test"], log=lambda _: None)
    assert calls[0][:3] == ["go", "test", "-c"]
    assert calls[0][-1] == "k8s.io/kubernetes/test/e2e"


def test_the_build_lock_is_taken_unless_a_parent_holds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_build_lock: Path) -> None:
    # held by another process (a child here): not ours, so a build would wait for it
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()",
         str(own_build_lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        assert not build._held_by_ancestor(own_build_lock)
    finally:
        holder.communicate()  # closes its stdin: it exits
    # held by this process (as `flock LOCK make setup` holds it for its children): a
    # build goes ahead instead of waiting for itself forever
    monkeypatch.setenv("NODEPULSE_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: Path(
        cmd[cmd.index("-o") + 1]).write_text("built"))
    with open(own_build_lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert build._held_by_ancestor(own_build_lock)
        path = build.ensure(["kubectl"], log=lambda _: None)["kubectl"]
    assert path.read_text() == "built"
