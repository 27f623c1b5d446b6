"""The binary cache: pinned versions come from the go.mod files, and a cached binary
is never rebuilt."""

import fcntl
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from nodepulse_dev import build


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


def test_builds_collect_garbage_less_often_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOGC", raising=False)
    assert build.go_env()["GOGC"] == build.BUILD_GOGC
    monkeypatch.setenv("GOGC", "150")
    assert build.go_env()["GOGC"] == "150"


def test_background_builds_go_one_at_a_time_at_idle_priority_and_let_others_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODEPULSE_CACHE", str(tmp_path))
    build.TOOLS["crane"].path.parent.mkdir(parents=True)
    build.TOOLS["crane"].path.write_text("cached")
    events: list[tuple[str, object]] = []

    def fake_go(cmd: list[str], **kwargs: object) -> None:
        events.append(("go", cmd[-1]))
        Path(cmd[cmd.index("-o") + 1]).write_text("built")

    def pause(seconds: float) -> None:
        # between two builds the lock is free: a test that needs a program now gets it
        with open(tmp_path / "build.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        events.append(("pause", seconds))

    monkeypatch.setattr(subprocess, "run", fake_go)
    monkeypatch.setattr(os, "sched_setscheduler",
                        lambda pid, policy, param: events.append(("policy", policy)))
    monkeypatch.setattr(build.time, "sleep", pause)
    build.build_at_idle_priority(["kubectl", "crane", "registry"], log=lambda _: None)
    assert events == [("policy", os.SCHED_IDLE),
                      ("go", "k8s.io/kubernetes/cmd/kubectl"), ("pause", 1),
                      ("pause", 1),  # crane was cached
                      ("go", build.TOOLS["registry"].package), ("pause", 1)]


def test_the_e2e_suite_runs_its_longest_builds_tests_last_and_builds_ahead_of_them() -> None:
    from e2e import background
    from e2e import conftest as e2e_conftest

    ids = ["e2e/kind/test_chart.py::a", "e2e/test_admission.py::b", "e2e/test_conformance.py::c",
           "e2e/test_conformance_kind.py::d", "tests/test_x.py::e", "e2e/kind/test_image.py::f",
           "e2e/test_volumes.py::g"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    e2e_conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.nodeid.split("::")[1] for i in items] == ["b", "e", "g", "c", "a", "f", "d"]
    # every program the tests use is made ahead (KWOK only the benchmark builds), once:
    # the control plane's first, then busybox, the kind images last
    names = [name for name, _, _ in background.steps()]
    go = [n for n in names if n in build.TOOLS]
    assert sorted(go) == sorted(set(build.TOOLS) - {"kwok"}) and len(set(names)) == len(names)
    assert names[:len(build.SETUP)] == build.SETUP and names[len(build.SETUP)] == "busybox"
    assert names[-3:] == ["kind python base", "kind node image", "kind nodepulse node image"]


def test_the_background_makes_what_is_named_and_missing_in_order_at_idle_priority(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2e import background

    events: list[tuple[str, object]] = []
    cached = tmp_path / "c"
    cached.write_text("made before")

    def step(name: str, out: Path):
        def make() -> None:
            events.append(("make", name))
            out.write_text("made")
        return name, out, make
    monkeypatch.setattr(background, "steps", lambda: [
        step("a", tmp_path / "a"), step("c", cached), step("b", tmp_path / "b"),
        step("d", tmp_path / "d")])
    monkeypatch.setattr(os, "sched_setscheduler",
                        lambda pid, policy, param: events.append(("policy", policy)))
    monkeypatch.setattr(background.time, "sleep", lambda s: events.append(("pause", s)))
    assert background.missing() == ["a", "b", "d"]
    assert background.main(["b", "a", "c"]) == 0
    assert events == [("policy", os.SCHED_IDLE), ("make", "a"), ("pause", 1),
                      ("make", "b"), ("pause", 1)]


def test_a_root_filesystem_made_while_waiting_for_its_lock_is_not_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2e.kind import rootfs

    monkeypatch.setenv("NODEPULSE_CACHE", str(tmp_path))
    out = rootfs.tar_path("x", ["pkg"])
    # held: another process cannot take it
    with build.lock_for(out), open(out.with_name(out.name + ".lock"), "w") as f, \
            pytest.raises(BlockingIOError):
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    taken = build.lock_for

    def another_made_it(path: Path):
        out.write_text("made by the process that held the lock")
        return taken(path)
    monkeypatch.setattr(build, "lock_for", another_made_it)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("made twice"))
    assert rootfs.debootstrap("x", ["pkg"]) == out
