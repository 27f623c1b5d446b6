"""Pod and QoS cgroups: their names under both drivers, their values against the
kubelet's formulas (worked out by hand in each test), the manager on the in-memory
backend, and the cgroup filesystem backend on fake v1 and v2 trees in tmp_path."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import Message

from nodeagent import agent, systembus
from nodeagent.agent import build_pod_cgroups
from nodeagent.api.clock import FakeClock
from nodeagent.config import ConfigError
from nodeagent.pods.cgroupfs import CgroupFs, cpu_weight, page_size_unit, parse_mountinfo
from nodeagent.pods.cgroups import (
    HUGETLB_UNBOUNDED,
    CgroupError,
    CgroupSettings,
    CgroupValues,
    MemoryCgroups,
    NodeResources,
    PodCgroups,
    milli_cpu_to_quota,
    milli_cpu_to_shares,
    pod_uid_of,
    pod_values,
    to_path,
)
from nodeagent.pods.podupdate import Op
from nodeagent.pods.qos import QOSClass
from nodeagent.pods.systemdcgroups import (
    INFINITY,
    SystemdCgroups,
    UnitProperty,
    slice_of,
    unit_properties,
)
from nodeagent.runtime import make_runtime
from nodeagent.runtime.fake import FakeRuntime
from nodeagent.systembus import RECENT_JOBS, SystemdUnits
from tests.conftest import GI, READINGS, AgentRig, agent_config, aio, mkpod, started

MI = 2**20
CAPACITY = NodeResources(cpu_millis=4000, memory_bytes=8 * GI, pids=4_194_304)
# --system-reserved cpu=500m,memory=1Gi and --kube-reserved cpu=250m,memory=512Mi,pid=1000
ALLOCATABLE = CAPACITY.less({"cpu": 0.75, "memory": 1.5 * GI, "pid": 1000})
UID = "0d5a6c1e-1b2c-4d3e-8f90-123456789abc"


def ctr(name: str, requests: dict[str, str] | None = None,
        limits: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "image": "i",
            "resources": {**({"requests": requests} if requests else {}),
                          **({"limits": limits} if limits else {})}}


def guaranteed(uid: str = UID, **spec: Any) -> dict[str, Any]:
    return mkpod("g", uid, containers=[ctr("a", limits={"cpu": "250m", "memory": "64Mi"}),
                                       ctr("b", limits={"cpu": "250m", "memory": "64Mi"})],
                 **spec)


def burstable(uid: str = "u-burst", cpu: str = "300m", **spec: Any) -> dict[str, Any]:
    return mkpod("b", uid, containers=[ctr("a", {"cpu": cpu, "memory": "32Mi"},
                                           {"cpu": "1"})], **spec)


def best_effort(uid: str = "u-be") -> dict[str, Any]:
    return mkpod("e", uid, containers=[ctr("a")])


# --- arithmetic and names -------------------------------------------------------------

def test_shares_and_quota() -> None:
    assert milli_cpu_to_shares(0) == 2          # no request: the least, not 1024
    assert milli_cpu_to_shares(1) == 2
    assert milli_cpu_to_shares(250) == 256
    assert milli_cpu_to_shares(10**9) == 262144
    assert milli_cpu_to_quota(0) == 0            # no limit
    assert milli_cpu_to_quota(5) == 1000         # a millisecond at the least
    assert milli_cpu_to_quota(1500) == 150_000


def test_names_under_both_drivers() -> None:
    name = ("kubepods", "burstable", "pod" + UID)
    assert to_path(name, "cgroupfs") == f"/kubepods/burstable/pod{UID}"
    assert to_path(name, "systemd") == (
        "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        + UID.replace("-", "_") + ".slice")
    assert to_path(("kubelet", "kubepods"), "systemd") == \
        "/kubelet.slice/kubelet-kubepods.slice"
    assert to_path((), "cgroupfs") == "/"
    assert pod_uid_of("pod" + UID, "cgroupfs") == UID
    assert pod_uid_of("kubepods-burstable-pod" + UID.replace("-", "_") + ".slice",
                      "systemd") == UID
    assert pod_uid_of("burstable", "cgroupfs") is None
    assert pod_uid_of("kubepods-besteffort.slice", "systemd") is None


# --- values -------------------------------------------------------------------------

def test_guaranteed_pod_values_with_its_overhead() -> None:
    pod = guaranteed(overhead={"cpu": "100m", "memory": "16Mi"})
    # cpu 250m + 250m + 100m = 600m: shares 600 * 1024 / 1000 = 614, quota 60000 of
    # 100000; memory 64Mi + 64Mi + 16Mi
    assert pod_values(pod, pids_limit=1024) == CgroupValues(
        cpu_shares=614, cpu_quota=60_000, cpu_period=100_000, memory_limit=144 * MI,
        pids_limit=1024)


def test_burstable_pod_gets_a_quota_and_memory_limit_only_when_every_container_sets_one(
        ) -> None:
    partial = mkpod(containers=[ctr("a", {"cpu": "100m", "memory": "32Mi"}, {"cpu": "500m"}),
                                ctr("b", {"cpu": "200m"})])
    assert pod_values(partial) == CgroupValues(cpu_shares=307)  # 300 * 1024 / 1000
    full = mkpod(containers=[ctr("a", {"cpu": "100m", "memory": "32Mi"},
                                 {"cpu": "200m", "memory": "64Mi"})])
    assert pod_values(full) == CgroupValues(cpu_shares=102, cpu_quota=20_000,
                                            cpu_period=100_000, memory_limit=64 * MI)


def test_best_effort_pod_values() -> None:
    assert pod_values(best_effort(), pids_limit=-1) == CgroupValues(cpu_shares=2)


def test_init_container_larger_than_the_rest_sets_the_pod_values() -> None:
    pod = mkpod(containers=[ctr("a", limits={"cpu": "100m", "memory": "64Mi"})],
                initContainers=[ctr("i", limits={"cpu": "1", "memory": "1Gi"})])
    assert pod_values(pod) == CgroupValues(cpu_shares=1024, cpu_quota=100_000,
                                           cpu_period=100_000, memory_limit=GI)


def test_hugepage_requests_are_hugetlb_limits() -> None:
    pod = mkpod(containers=[ctr("a", limits={"cpu": "1", "memory": "1Gi",
                                             "hugepages-2Mi": "4Mi"})])
    assert pod_values(pod).hugetlb == {2 * MI: 4 * MI}


# --- the manager, in memory ---------------------------------------------------------

def manager(backend: Any = None, clock: FakeClock | None = None, **settings: Any
            ) -> PodCgroups:
    """Started on `backend` (default: in memory); a --cgroup-root is made first, as its
    owner must."""
    backend = MemoryCgroups() if backend is None else backend
    if settings.get("root", "/") != "/":
        backend.create(settings["root"], CgroupValues())
    m = PodCgroups(backend, CgroupSettings(**settings), CAPACITY, ALLOCATABLE,
                   clock or FakeClock())
    m.start()
    return m


def test_kubepods_is_limited_to_the_node_allocatable() -> None:
    m = manager()
    assert isinstance(m.backend, MemoryCgroups)
    # 4 cpu - 0.75 = 3250m: 3328 shares; 8Gi - 1.5Gi; pid_max - 1000
    assert m.backend.cgroups["/kubepods"] == CgroupValues(
        cpu_shares=3328, memory_limit=int(6.5 * GI), pids_limit=4_193_304)
    assert m.backend.cgroups["/kubepods/besteffort"].cpu_shares == 2
    assert m.backend.cgroups["/kubepods/burstable"].cpu_shares == 2
    # without enforcement: the node's capacity
    whole = manager(enforce_pods=False)
    assert isinstance(whole.backend, MemoryCgroups)
    assert whole.backend.cgroups["/kubepods"] == CgroupValues(
        cpu_shares=4096, memory_limit=8 * GI, pids_limit=4_194_304)


def test_pods_go_under_their_qos_cgroup_and_burstable_shares_follow_them() -> None:
    m = manager(root="/np-test")
    b = m.backend
    assert isinstance(b, MemoryCgroups)
    pods = [guaranteed(), burstable("u1", "300m"), burstable("u2", "100m"), best_effort()]
    for p in pods:
        m.ensure(p)
    assert [m.parent(p) for p in pods] == [
        f"/np-test/kubepods/pod{UID}", "/np-test/kubepods/burstable/podu1",
        "/np-test/kubepods/burstable/podu2", "/np-test/kubepods/besteffort/podu-be"]
    assert b.cgroups[f"/np-test/kubepods/pod{UID}"].memory_limit == 128 * MI
    assert b.cgroups["/np-test/kubepods/burstable"].cpu_shares == 409  # 400m
    m.release("u1")
    assert "/np-test/kubepods/burstable/podu1" not in b.cgroups
    assert b.cgroups["/np-test/kubepods/burstable"].cpu_shares == 102  # 100m
    m.ensure(pods[2])  # again: nothing changes
    assert b.cgroups["/np-test/kubepods/burstable"].cpu_shares == 102


def test_a_resize_sets_what_grows_first_and_what_shrinks_last_and_the_qos_follows() -> None:
    m = manager()
    b = m.backend
    assert isinstance(b, MemoryCgroups)
    pod = burstable("u1", "300m")  # cpu limit 1, no memory limit
    m.ensure(pod)
    path = "/kubepods/burstable/podu1"
    assert (b.cgroups[path].cpu_shares, b.cgroups[path].cpu_quota) == (307, 100000)
    # more shares, a smaller quota: the shares go with the growers, the quota after
    more = mkpod("b", "u1", containers=[ctr("a", {"cpu": "600m", "memory": "32Mi"},
                                            {"cpu": "800m"})])
    m.resize(more, "cpu", grow=True)
    assert (b.cgroups[path].cpu_shares, b.cgroups[path].cpu_quota) == (614, 100000)
    m.resize(more, "cpu", grow=False)
    assert (b.cgroups[path].cpu_shares, b.cgroups[path].cpu_quota) == (614, 80000)
    # no memory limit in the pod's resources: the cgroup's stays as it is
    m.resize(more, "memory", grow=True)
    m.resize(more, "memory", grow=False)
    assert b.cgroups[path].memory_limit is None and m.memory_limit_lowered(more) is None
    assert b.cgroups["/kubepods/burstable"].cpu_shares == 307
    m.recount(more)  # the QoS cgroup counts what the pod asks now
    assert b.cgroups["/kubepods/burstable"].cpu_shares == 614
    g = guaranteed("u2")  # 2 x 64Mi
    m.ensure(g)
    smaller = mkpod("g", "u2", containers=[ctr("a", limits={"cpu": "250m", "memory": "32Mi"}),
                                           ctr("b", limits={"cpu": "250m", "memory": "64Mi"})])
    assert m.memory_limit_lowered(smaller) == 96 * MI
    m.resize(smaller, "memory", grow=True)
    assert b.cgroups["/kubepods/podu2"].memory_limit == 128 * MI
    m.resize(smaller, "memory", grow=False)
    assert b.cgroups["/kubepods/podu2"].memory_limit == 96 * MI


def test_qos_reserved_memory_holds_back_the_classes_above() -> None:
    m = manager(qos_reserved_memory=50)
    big = mkpod("g", "ug", containers=[ctr("a", limits={"cpu": "1", "memory": "1Gi"})])
    m.ensure(big)
    m.ensure(mkpod("b", "ub", containers=[ctr("a", {"memory": "2Gi"})]))
    values = m.qos_values()
    # allocatable 6.5Gi; burstable: less half the Guaranteed 1Gi; besteffort: less half
    # the Burstable 2Gi as well
    assert values[QOSClass.BURSTABLE].memory_limit == int(6.5 * GI) - GI // 2
    assert values[QOSClass.BEST_EFFORT].memory_limit == int(6.5 * GI) - GI // 2 - GI


class InUse(MemoryCgroups):
    """Memory use the kernel will not set a limit below."""

    def __init__(self, usage: int) -> None:
        super().__init__()
        self.usage = usage
        self.writes: list[tuple[str, CgroupValues]] = []

    def update(self, path: str, values: CgroupValues) -> None:
        if values.memory_limit is not None and values.memory_limit < self.usage:
            raise OSError(16, "Device or resource busy")
        self.writes.append((path, values))
        super().update(path, values)

    def memory_usage(self, path: str) -> int | None:
        return self.usage


def test_a_qos_memory_limit_below_the_use_is_set_to_the_use() -> None:
    backend = InUse(usage=6 * GI)
    m = manager(backend, qos_reserved_memory=100)
    m.ensure(mkpod("g", "ug", containers=[ctr("a", limits={"cpu": "1", "memory": "1Gi"})]))
    # 6.5Gi - 1Gi would be below the 6Gi in use: the limit stops where the use is
    assert backend.cgroups["/kubepods/burstable"].memory_limit == 6 * GI
    assert backend.cgroups["/kubepods/besteffort"].memory_limit == 6 * GI


@aio
async def test_qos_cgroups_are_written_when_their_values_change() -> None:
    backend = InUse(usage=0)
    clock = FakeClock()
    m = manager(backend, clock)
    backend.writes.clear()
    m.ensure(best_effort())  # the QoS values stay as they were: nothing written
    m.ensure(burstable("u1"))  # the burstable shares change: that one cgroup
    assert [p for p, _ in backend.writes] == ["/kubepods/burstable"]
    m.housekeeping({"u-be", "u1"})  # not a minute yet
    assert len(backend.writes) == 1
    await clock.advance(60)  # a minute on: every QoS cgroup again
    m.housekeeping({"u-be", "u1"})
    assert sorted(p for p, _ in backend.writes[1:]) == [
        "/kubepods", "/kubepods/besteffort", "/kubepods/burstable"]


def test_without_cgroups_per_qos_there_is_no_parent() -> None:
    m = manager(per_qos=False, enforce_pods=False)
    m.ensure(guaranteed())
    assert not m.enabled and m.parent(guaranteed()) == ""


def test_cgroup_root_must_exist() -> None:
    with pytest.raises(CgroupError, match="--cgroup-root /missing: cgroup /missing does "
                                          "not exist"):
        PodCgroups(MemoryCgroups(), CgroupSettings(root="/missing"), CAPACITY, ALLOCATABLE,
                   FakeClock()).start()


def test_housekeeping_removes_the_cgroups_of_pods_nothing_has() -> None:
    clock = FakeClock()
    m = manager(clock=clock)
    b = m.backend
    assert isinstance(b, MemoryCgroups)
    m.ensure(burstable("keep"))
    m.ensure(burstable("gone"))
    b.create("/kubepods/besteffort/podleft-over", CgroupValues())  # an earlier agent's
    assert m.housekeeping({"keep"}) == ["gone", "left-over"]
    assert set(m.tracked()) == {"keep"}
    assert b.children("/kubepods/burstable") == ["podkeep"]
    assert b.cgroups["/kubepods/burstable"].cpu_shares == 307  # only "keep" counts


def test_release_finds_a_cgroup_made_before_the_agent_started() -> None:
    m = manager()
    b = m.backend
    assert isinstance(b, MemoryCgroups)
    b.create("/kubepods/burstable/podold", CgroupValues(cpu_shares=100))
    m.release("old")
    assert not b.exists("/kubepods/burstable/podold")


def test_releasing_a_pod_looks_up_its_cgroup_without_listing_every_pod(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a pod's worker releases its cgroup again each time it syncs the terminated pod;
    # with thousands of pods in a process, listing them all each time is quadratic
    m = manager()
    b = m.backend
    assert isinstance(b, MemoryCgroups)
    for i in range(3):
        m.ensure(burstable(f"p{i}"))
    b.create("/kubepods/besteffort/podold", CgroupValues())
    monkeypatch.setattr(b, "children", lambda path: pytest.fail(f"listed {path}"))
    m.release("p0")
    m.release("p0")  # released already: looked up, not found
    m.release("old")
    assert not b.exists("/kubepods/burstable/podp0") and not b.exists("/kubepods/besteffort/podold")
    assert b.exists("/kubepods/burstable/podp1")


# --- the cgroup filesystem, v1 ------------------------------------------------------

V1 = ("cpu", "cpuacct", "cpuset", "memory", "devices", "pids", "hugetlb")


def mountinfo(tmp_path: Path, v1: bool = True) -> Path:
    """A mountinfo like a hybrid host's (cgroup v1 controllers, name=systemd and cgroup2
    at unified), or a v2 host's, with the mount points in tmp_path."""
    root = tmp_path / "cgroup"
    lines = [f"31 23 0:28 / {root} rw,relatime - tmpfs tmpfs rw,mode=755"]
    if v1:
        for i, c in enumerate(V1):
            lines.append(f"{40 + i} 31 0:{40 + i} / {root / c} rw,relatime - cgroup cgroup "
                         f"rw,{c}")
            (root / c).mkdir(parents=True)
        (root / "cpuset" / "cpuset.cpus").write_text("0-3\n")
        (root / "cpuset" / "cpuset.mems").write_text("0\n")
        lines.append(f"50 31 0:50 / {root / 'systemd'} rw - cgroup cgroup rw,name=systemd")
        lines.append(f"51 31 0:51 / {root / 'unified'} rw - cgroup2 cgroup2 rw")
        (root / "systemd").mkdir()
        (root / "unified").mkdir()
    else:
        lines = [f"31 23 0:28 / {root} rw,relatime - cgroup2 cgroup2 rw"]
        root.mkdir()
        (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
        (root / "cgroup.subtree_control").write_text("")
    pages = tmp_path / "hugepages"
    for size in ("hugepages-2048kB", "hugepages-1048576kB"):
        (pages / size).mkdir(parents=True)
    path = tmp_path / "mountinfo"
    path.write_text("\n".join(lines) + "\n")
    return path


class FakeTree:
    """What the kernel does that a tmp folder does not: a cgroup's folder goes with its
    files; processes are killed by record."""

    def __init__(self) -> None:
        self.killed: list[int] = []

    def kill(self, pid: int) -> None:
        self.killed.append(pid)

    @staticmethod
    def rmdir(path: str) -> None:
        for e in os.scandir(path):
            if e.is_file():
                os.unlink(e.path)
        os.rmdir(path)


def fs(tmp_path: Path, v1: bool = True) -> tuple[CgroupFs, FakeTree]:
    tree = FakeTree()
    return CgroupFs.detect(str(mountinfo(tmp_path, v1)), hugepages_dir=str(
        tmp_path / "hugepages"), kill=tree.kill, rmdir=tree.rmdir), tree


def read(path: Path) -> str:
    return path.read_text().strip()


def test_mountinfo_of_a_hybrid_host() -> None:
    text = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
    controllers, v1, unified = parse_mountinfo(text)
    assert controllers == {"cpu": "/sys/fs/cgroup/cpu", "cpuacct": "/sys/fs/cgroup/cpu,cpuacct",
                           "name=systemd": "/sys/fs/cgroup/systemd"}
    assert v1 == ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/systemd"]
    assert unified == "/sys/fs/cgroup/unified"


def test_v1_hierarchy_values_as_the_kubelet_writes_them(tmp_path: Path) -> None:
    backend, _ = fs(tmp_path)
    assert backend.version == 1 and backend.page_sizes() == (2 * MI, GI)
    m = manager(backend, root="/np", pod_pids_limit=512)
    root = tmp_path / "cgroup"
    kubepods = "np/kubepods"
    assert read(root / "cpu" / kubepods / "cpu.shares") == "3328"
    assert read(root / "memory" / kubepods / "memory.limit_in_bytes") == str(int(6.5 * GI))
    assert read(root / "pids" / kubepods / "pids.max") == "4193304"
    assert read(root / "hugetlb" / kubepods / "hugetlb.2MB.limit_in_bytes") == \
        str(HUGETLB_UNBOUNDED)
    assert read(root / "cpuset" / kubepods / "cpuset.cpus") == "0-3"  # the parent's
    assert read(root / "cpuset" / kubepods / "cpuset.mems") == "0"
    for h in ("devices", "systemd", "unified"):  # every hierarchy has the folder
        assert (root / h / kubepods / "burstable").is_dir()

    m.ensure(guaranteed())
    m.ensure(burstable("u1", "300m"))
    m.ensure(best_effort())
    pod = f"{kubepods}/pod{UID}"
    assert read(root / "cpu" / pod / "cpu.shares") == "512"
    assert read(root / "cpu" / pod / "cpu.cfs_period_us") == "100000"
    assert read(root / "cpu" / pod / "cpu.cfs_quota_us") == "50000"
    assert read(root / "memory" / pod / "memory.limit_in_bytes") == str(128 * MI)
    assert read(root / "pids" / pod / "pids.max") == "512"
    assert read(root / "hugetlb" / pod / "hugetlb.2MB.limit_in_bytes") == "0"
    assert read(root / "hugetlb" / pod / "hugetlb.1GB.limit_in_bytes") == "0"
    b = f"{kubepods}/burstable/podu1"
    assert read(root / "cpu" / b / "cpu.shares") == "307"
    assert read(root / "cpu" / b / "cpu.cfs_quota_us") == "100000"  # its CPU limit: 1
    assert not (root / "memory" / b / "memory.limit_in_bytes").exists()  # none of memory
    assert read(root / "cpu" / kubepods / "burstable" / "cpu.shares") == "307"
    assert read(root / "cpu" / kubepods / "besteffort" / "podu-be" / "cpu.shares") == "2"
    assert read(root / "cpu" / kubepods / "besteffort" / "cpu.shares") == "2"


def test_v1_release_finds_what_a_halfway_removal_left(tmp_path: Path) -> None:
    backend, _ = fs(tmp_path)
    m = manager(backend)
    m.ensure(burstable("u1"))
    m.release("u1")
    root = tmp_path / "cgroup"
    left = root / "memory" / "kubepods" / "burstable" / "podu1"
    left.mkdir()  # as if its removal had failed in this hierarchy alone
    assert not backend.exists("/kubepods/burstable/podu1")
    assert backend.present("/kubepods/burstable/podu1")
    m.release("u1")
    assert not left.exists()


def test_v1_removal_kills_what_is_left_and_removes_every_folder(tmp_path: Path) -> None:
    backend, tree = fs(tmp_path)
    m = manager(backend)
    m.ensure(burstable("u1"))
    root = tmp_path / "cgroup"
    leftover = root / "memory" / "kubepods" / "burstable" / "podu1" / "ctr"
    leftover.mkdir()
    (leftover / "cgroup.procs").write_text("4242\n")
    m.release("u1")
    assert tree.killed == [4242]
    assert not any((root / h / "kubepods" / "burstable" / "podu1").exists()
                   for h in (*V1, "systemd", "unified"))
    assert read(root / "cpu" / "kubepods" / "burstable" / "cpu.shares") == "2"


def test_v1_a_busy_cgroup_is_reported_and_kept_for_later(tmp_path: Path) -> None:
    backend, _ = fs(tmp_path)

    def busy(path: str) -> None:
        raise OSError(16, "Device or resource busy")
    backend.rmdir = busy
    m = manager(backend)
    m.ensure(burstable("u1"))
    with pytest.raises(CgroupError, match="podu1 is still in use"):
        m.release("u1")
    assert m.housekeeping(set()) == []  # tried, still busy, not counted as removed


def test_systemd_names_in_a_v1_tree(tmp_path: Path) -> None:
    backend, _ = fs(tmp_path)
    m = manager(backend, driver="systemd")
    m.ensure(burstable(UID))
    slice_ = (tmp_path / "cgroup" / "cpu" / "kubepods.slice" / "kubepods-burstable.slice"
              / f"kubepods-burstable-pod{UID.replace('-', '_')}.slice")
    assert read(slice_ / "cpu.shares") == "307"
    assert m.parent(burstable(UID)) == "/" + str(slice_.relative_to(
        tmp_path / "cgroup" / "cpu"))
    assert m.housekeeping(set()) == [UID]
    assert not slice_.exists()


# --- the cgroup filesystem, v2 ------------------------------------------------------

def test_v2_values_and_controllers_handed_down(tmp_path: Path) -> None:
    backend, _ = fs(tmp_path, v1=False)
    assert backend.version == 2 and backend.page_sizes() == (2 * MI, GI)
    m = manager(backend)
    root = tmp_path / "cgroup"
    assert read(root / "cgroup.subtree_control") == "+cpuset +cpu +io +memory +hugetlb +pids"
    assert read(root / "kubepods" / "cpu.weight") == str(1 + (3328 - 2) * 9999 // 262142)
    assert read(root / "kubepods" / "memory.max") == str(int(6.5 * GI))
    assert read(root / "kubepods" / "pids.max") == "4193304"
    assert read(root / "kubepods" / "hugetlb.1GB.max") == str(HUGETLB_UNBOUNDED)
    m.ensure(guaranteed())
    pod = root / "kubepods" / f"pod{UID}"
    assert read(pod / "cpu.max") == "50000 100000"
    assert read(pod / "cpu.weight") == str(cpu_weight(512))
    assert read(pod / "memory.max") == str(128 * MI)
    assert read(pod / "hugetlb.2MB.max") == "0"
    m.release(UID)
    assert not pod.exists()


def test_cpu_weight_and_page_size_units() -> None:
    assert [cpu_weight(s) for s in (2, 1024, 262144)] == [1, 39, 10000]
    assert page_size_unit(2 * MI) == "2MB"
    assert page_size_unit(GI) == "1GB"
    assert page_size_unit(64 * 1024) == "64KB"


# --- the sync loop: made before the sandbox, removed after it -------------------------

@aio
async def test_pod_cgroup_is_the_sandbox_parent_and_goes_with_the_pod() -> None:
    clock = FakeClock()
    a = await started(clock)
    b = a.cgroups.backend
    assert isinstance(b, MemoryCgroups)
    pod = burstable("u1", "300m", terminationGracePeriodSeconds=1)
    a.send(Op.ADD, pod, guaranteed("u2"))
    await a.run_for(3)
    [sandbox] = [c for c in a.rt.sandbox_configs.values() if c.uid == "u1"]
    assert sandbox.cgroup_parent == "/kubepods/burstable/podu1"
    assert b.cgroups["/kubepods/burstable/podu1"].cpu_shares == 307
    assert b.cgroups["/kubepods/burstable"].cpu_shares == 307
    # each container's OOM score adjustment: 1000 - 1000 * 32Mi / 8Gi; Guaranteed: -997
    adj = {c.pod_uid: c.oom_score_adj for c in a.rt.configs.values()}
    assert adj == {"u1": 997, "u2": -997}
    deleted = {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "x",
                                   "deletionGracePeriodSeconds": 1}}
    a.send(Op.DELETE, deleted)
    await a.run_for(4)
    # terminated: its cgroup is gone and the QoS cgroups no longer count it
    assert not b.exists("/kubepods/burstable/podu1")
    assert b.cgroups["/kubepods/burstable"].cpu_shares == 2
    a.send(Op.REMOVE, deleted)
    await a.run_for(2)
    assert set(a.cgroups.tracked()) == {"u2"}
    await a.loops.stop()


@aio
async def test_a_cgroup_that_cannot_be_made_holds_the_sandbox_back() -> None:
    clock = FakeClock()
    a = await started(clock)
    b = a.cgroups.backend
    assert isinstance(b, MemoryCgroups)

    def refuse(path: str, values: CgroupValues) -> None:
        raise OSError(28, f"No space left on device: {path}")
    b.create = refuse  # type: ignore[method-assign]
    a.send(Op.ADD, best_effort())
    await a.run_for(3)
    assert a.rt.calls["run_sandbox"] == 0
    await a.events.drain()
    [message, *_] = a.events_of("FailedToCreatePodContainer")
    assert message.startswith("unable to ensure pod container exists: cannot make the "
                              "cgroup /kubepods/besteffort/podu-be of pod ns/e")
    await a.loops.stop()


@aio
async def test_housekeeping_removes_cgroups_no_pod_has() -> None:
    clock = FakeClock()
    a = await started(clock)
    b = a.cgroups.backend
    assert isinstance(b, MemoryCgroups)
    a.send(Op.ADD, burstable("u1"))
    await a.run_for(3)
    b.create("/kubepods/besteffort/podstale", CgroupValues(cpu_shares=2))
    await a.run_for(a.loops.config.housekeeping_period + 1)
    assert b.children("/kubepods/besteffort") == []
    assert b.exists("/kubepods/burstable/podu1")
    await a.loops.stop()


# --- the composition root's choice ----------------------------------------------------

def test_cgroups_are_kept_where_the_runtime_puts_containers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    cfg = agent_config(tmp_path, "--node-name", "n1", "--system-reserved",
                       "cpu=500m,memory=1Gi", "--kube-reserved", "cpu=250m,pid=1000")
    fake = FakeRuntime(clock)
    simulated = build_pod_cgroups(cfg, fake, lambda: READINGS, clock)
    assert isinstance(simulated.backend, MemoryCgroups)
    assert simulated.capacity == NodeResources(4000, 8 * GI, 4_194_304)
    assert simulated.allocatable == NodeResources(3250, 7 * GI, 4_193_304)
    fake.cgroups = "none"  # as the process runtime: no pod cgroups, no parent
    assert build_pod_cgroups(cfg, fake, lambda: READINGS, clock).backend is None
    cri = make_runtime("cri", str(tmp_path / "containerd.sock"))
    host, _ = fs(tmp_path)
    monkeypatch.setattr(CgroupFs, "detect", lambda: host)
    assert build_pod_cgroups(cfg, cri, lambda: READINGS, clock).backend is host
    off = agent_config(tmp_path, "--node-name", "n1", "--cgroups-per-qos=false",
                       "--enforce-node-allocatable=none")
    assert build_pod_cgroups(off, cri, lambda: READINGS, clock).backend is None
    virtual = agent_config(tmp_path, "--virtual-nodes", "2", "--runtime", "fake")
    assert isinstance(build_pod_cgroups(virtual, FakeRuntime(clock), lambda: READINGS,
                                        clock).backend, MemoryCgroups)


def test_the_systemd_driver_needs_systemd_and_its_bus(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    cfg = agent_config(tmp_path, "--node-name", "n1", "--cgroup-driver", "systemd")
    cri = make_runtime("cri", str(tmp_path / "containerd.sock"))
    host, _ = fs(tmp_path)
    monkeypatch.setattr(CgroupFs, "detect", lambda: host)
    monkeypatch.setattr(agent, "SYSTEMD_RUNNING", tmp_path / "run-systemd-system")
    with pytest.raises(ConfigError, match=r"--cgroup-driver=systemd: systemd is not running "
                                          r"on this host \(no .*run-systemd-system\); use "
                                          "--cgroup-driver=cgroupfs"):
        build_pod_cgroups(cfg, cri, lambda: READINGS, clock)
    (tmp_path / "run-systemd-system").mkdir()
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus")
    with pytest.raises(ConfigError, match=r"--cgroup-driver=systemd: cannot connect to the "
                                          r"system bus at unix:path=.*/no-bus: "):
        build_pod_cgroups(cfg, cri, lambda: READINGS, clock)
    monkeypatch.setattr(SystemdUnits, "connect", classmethod(lambda cls: FakeSystemd(host)))
    backend = build_pod_cgroups(cfg, cri, lambda: READINGS, clock).backend
    assert isinstance(backend, SystemdCgroups) and backend.files is host
    # the fake runtime's pods: the slices are only names
    m = build_pod_cgroups(cfg, FakeRuntime(clock), lambda: READINGS, clock)
    m.start()
    assert m.parent(best_effort()) == \
        "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podu_be.slice"


# --- the systemd driver ----------------------------------------------------------------

class FakeSystemd:
    """systemd's manager as the driver sees it: a started slice gets its folder in the
    hierarchies systemd manages (the controllers its accounting turns on, and its own),
    a stopped one loses them."""

    MANAGED = ("cpu", "cpuacct", "memory", "pids", "systemd")

    def __init__(self, files: CgroupFs, refuse: str = "") -> None:
        self.files = files
        self.refuse = refuse  # a unit whose start systemd fails
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.closed = False

    def _folders(self, name: str) -> list[Path]:
        parts = name.removesuffix(".slice").split("-")
        path = "/".join("-".join(parts[:i + 1]) + ".slice" for i in range(len(parts)))
        return [Path(self.files.hierarchies[0]).parent / h / path for h in self.MANAGED]

    def start_slice(self, name: str, properties: Sequence[UnitProperty]) -> None:
        self.calls.append(("start", name, {p[0]: p[2] for p in properties}))
        if name == self.refuse:
            raise CgroupError(f"starting {name}: StartTransientUnit: its job ended 'failed'")
        for folder in self._folders(name):
            folder.mkdir(parents=True, exist_ok=True)

    def set_properties(self, name: str, properties: Sequence[UnitProperty]) -> None:
        self.calls.append(("set", name, {p[0]: p[2] for p in properties}))

    def stop(self, name: str) -> None:
        self.calls.append(("stop", name, {}))
        for folder in self._folders(name):
            if folder.is_dir():
                FakeTree.rmdir(str(folder))

    def close(self) -> None:
        self.closed = True


def test_systemd_slices_carry_the_values_the_files_get(tmp_path: Path) -> None:
    files, _ = fs(tmp_path)
    units = FakeSystemd(files)
    m = manager(SystemdCgroups(files, units), driver="systemd", pod_pids_limit=512)
    base = {"DefaultDependencies": False, "CPUAccounting": True, "MemoryAccounting": True,
            "TasksAccounting": True}
    assert units.calls[:3] == [
        ("start", "kubepods.slice", {**base, "CPUShares": 3328, "MemoryLimit": int(6.5 * GI),
                                     "TasksMax": 4193304}),
        ("start", "kubepods-burstable.slice", base),
        ("start", "kubepods-besteffort.slice", base)]
    units.calls.clear()
    m.ensure(guaranteed())
    m.ensure(burstable("u1", "300m"))
    uid_ = UID.replace("-", "_")
    assert units.calls == [
        ("start", f"kubepods-pod{uid_}.slice",
         {**base, "CPUShares": 512, "CPUQuotaPerSecUSec": 500_000,
          "CPUQuotaPeriodUSec": 100_000, "MemoryLimit": 128 * MI, "TasksMax": 512}),
        ("set", "kubepods-burstable.slice", {"CPUShares": 307}),
        ("start", "kubepods-burstable-podu1.slice",
         {**base, "CPUShares": 307, "CPUQuotaPerSecUSec": 1_000_000,
          "CPUQuotaPeriodUSec": 100_000, "TasksMax": 512})]
    root = tmp_path / "cgroup"
    pod = root / "cpu" / "kubepods.slice" / f"kubepods-pod{uid_}.slice"
    assert read(pod / "cpu.cfs_quota_us") == "50000"  # and the files say the same
    # what systemd leaves alone is made beside its folders
    for h in ("cpuset", "hugetlb", "devices"):
        assert (root / h / "kubepods.slice" / f"kubepods-pod{uid_}.slice").is_dir()
    assert read(root / "hugetlb" / "kubepods.slice" / f"kubepods-pod{uid_}.slice" /
                "hugetlb.2MB.limit_in_bytes") == "0"
    units.calls.clear()
    m.release("u1")
    assert units.calls == [("set", "kubepods-burstable.slice", {"CPUShares": 2}),
                           ("stop", "kubepods-burstable-podu1.slice", {})]
    assert not any((root / h / "kubepods.slice" / "kubepods-burstable.slice" /
                    "kubepods-burstable-podu1.slice").exists() for h in V1)
    m.backend.close()  # type: ignore[union-attr]
    assert units.closed


def test_systemd_v2_properties_and_no_limit() -> None:
    values = CgroupValues(cpu_shares=1024, cpu_quota=-1, cpu_period=100_000,
                          memory_limit=GI, pids_limit=-1)
    assert unit_properties(values, 2) == [
        ("CPUWeight", "t", cpu_weight(1024)), ("CPUQuotaPerSecUSec", "t", INFINITY),
        ("CPUQuotaPeriodUSec", "t", 100_000), ("MemoryMax", "t", GI),
        ("TasksMax", "t", INFINITY)]
    assert unit_properties(CgroupValues(), 1) == []
    assert slice_of("/kubepods.slice/kubepods-pod1.slice") == "kubepods-pod1.slice"
    assert slice_of("/") == "-.slice"


def test_a_slice_systemd_does_not_start_holds_the_pod_back(tmp_path: Path) -> None:
    files, _ = fs(tmp_path)
    m = manager(SystemdCgroups(files, FakeSystemd(files, refuse="kubepods-podu9.slice")),
                driver="systemd")
    with pytest.raises(CgroupError, match=r"cannot make the cgroup /kubepods.slice/"
                                          r"kubepods-podu9.slice of pod ns/g: systemd: "
                                          r"starting kubepods-podu9.slice: .*'failed'"):
        m.ensure(guaranteed("u9"))


class ManagerOnTheBus:
    """What systemd's manager answers on the bus, and when its JobRemoved signal comes:
    before the caller has read its reply (`early`), or after it."""

    def __init__(self, units: SystemdUnits, result: str = "done", early: bool = False,
                 errors: dict[str, str] | None = None) -> None:
        self.units, self.result, self.early = units, result, early
        self.errors = errors or {}  # member -> the D-Bus error it answers with
        self.calls: list[tuple[str, list[Any]]] = []
        self.jobs = 0

    def removed(self, job: str, result: str) -> None:
        self.units._message(Message.new_signal(
            "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager", "JobRemoved",
            "uoss", [self.jobs, job, "x.slice", result]))

    connected = True

    def disconnect(self) -> None:
        self.connected = False

    async def call(self, msg: Message) -> Message:
        self.calls.append((msg.member or "", msg.body))
        msg.serial = len(self.calls)  # what the bus would number it
        if msg.member in self.errors:
            return Message.new_error(msg, self.errors[msg.member], "no")
        if msg.member not in ("StartTransientUnit", "StopUnit"):
            return Message.new_method_return(msg)
        self.jobs += 1
        job = f"/org/freedesktop/systemd1/job/{self.jobs}"
        self.removed(f"/org/freedesktop/systemd1/job/other{self.jobs}", "done")  # not ours
        if self.early:
            self.removed(job, self.result)
        else:
            asyncio.get_running_loop().call_soon(self.removed, job, self.result)
        return Message.new_method_return(msg, "o", [job])


def on_the_bus(**answers: Any) -> tuple[SystemdUnits, ManagerOnTheBus]:
    units = SystemdUnits("unix:path=/nowhere")
    manager_ = ManagerOnTheBus(units, **answers)
    units.bus = manager_  # type: ignore[assignment]
    return units, manager_


@pytest.mark.parametrize("early", [False, True])
def test_systemd_units_wait_for_their_job(early: bool) -> None:
    units, bus = on_the_bus(early=early)
    try:
        units.start_slice("kubepods.slice", [("CPUShares", "t", 2)])
        units.set_properties("kubepods.slice", [("CPUShares", "t", 4)])
        units.stop("kubepods.slice")
        assert [c[0] for c in bus.calls] == ["StartTransientUnit", "SetUnitProperties",
                                             "StopUnit"]
        name, mode, props, aux = bus.calls[0][1]
        assert (name, mode, aux) == ("kubepods.slice", "replace", [])
        assert [(p[0], p[1].signature, p[1].value) for p in props] == [("CPUShares", "t", 2)]
        assert bus.calls[1][1][:2] == ["kubepods.slice", True]  # runtime only
        # other clients' jobs are forgotten past a bound
        assert len(units._finished) <= RECENT_JOBS
    finally:
        units.close()


def test_systemd_units_connect_again_after_the_bus_went_away(
        monkeypatch: pytest.MonkeyPatch) -> None:
    units, old = on_the_bus()
    try:
        old.disconnect()
        with pytest.raises(CgroupError, match=r"^starting x.slice: cannot connect to the "
                                              r"system bus at unix:path=/nowhere: "):
            units.start_slice("x.slice", [])
        fresh = ManagerOnTheBus(units)

        class Reconnect:
            def __init__(self, **_: Any) -> None:
                pass

            async def connect(self) -> ManagerOnTheBus:
                fresh.add_message_handler = lambda handler: None  # type: ignore[attr-defined]
                return fresh
        monkeypatch.setattr(systembus, "MessageBus", Reconnect)
        units.start_slice("x.slice", [])
        assert [c[0] for c in fresh.calls] == ["AddMatch", "Subscribe", "StartTransientUnit"]
        assert units.bus is fresh
    finally:
        units.close()


def test_systemd_unit_failures_name_the_unit() -> None:
    units, bus = on_the_bus(result="failed")
    try:
        with pytest.raises(CgroupError, match=r"^starting kubepods.slice: StartTransientUnit: "
                                              r"its job ended 'failed'$"):
            units.start_slice("kubepods.slice", [])
    finally:
        units.close()
    units, bus = on_the_bus(errors={
        "StartTransientUnit": "org.freedesktop.systemd1.UnitExists",
        "StopUnit": "org.freedesktop.systemd1.NoSuchUnit"})
    try:  # a slice from before the agent's restart gets the values; a gone one is stopped
        units.start_slice("kubepods.slice", [("DefaultDependencies", "b", False),
                                             ("CPUShares", "t", 2)])
        units.stop("kubepods-podu1.slice")
        assert [c[0] for c in bus.calls] == ["StartTransientUnit", "SetUnitProperties",
                                             "StopUnit"]
        assert [p[0] for p in bus.calls[1][1][2]] == ["CPUShares"]
    finally:
        units.close()
    units, bus = on_the_bus(errors={"SetUnitProperties": "org.freedesktop.DBus.Error.Access"})
    try:
        with pytest.raises(CgroupError, match=r"^setting kubepods.slice's properties: "
                                              r"SetUnitProperties: org.freedesktop.DBus."
                                              r"Error.Access: no$"):
            units.set_properties("kubepods.slice", [("CPUShares", "t", 2)])
    finally:
        units.close()


@aio
async def test_the_agent_starts_its_cgroups_and_refuses_a_missing_root(tmp_path: Path) -> None:
    rig = AgentRig(tmp_path, "--cgroup-root", "/missing")
    with pytest.raises(ConfigError, match="--cgroup-root /missing: cgroup /missing does "
                                          "not exist"):
        await rig.agent.run(rig.stop)
