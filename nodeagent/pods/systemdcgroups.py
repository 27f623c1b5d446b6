"""The systemd cgroup driver, as a backend of PodCgroups (cgroups.py).

systemd owns the cgroup tree of a host it runs: a folder it did not make may be pruned,
and a unit's cgroup is rewritten from the unit's properties whenever systemd realizes it
again (a daemon-reload, a sibling started). So, as the kubelet does with this driver,
each cgroup is a transient slice unit (kubepods.slice, kubepods-burstable.slice,
kubepods-burstable-pod<uid>.slice) started through systemd's manager, carrying its
limits as unit properties; systemd makes its folders in the hierarchies it manages. The
same values then go to the cgroup files (cgroupfs.py), which also makes the folders of
the hierarchies systemd leaves alone (cpuset and hugetlb on cgroup v1). A slice is
stopped through systemd, and what is left of it in the other hierarchies is removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from nodeagent.pods.cgroupfs import CgroupFs, cpu_weight
from nodeagent.pods.cgroups import CPU_PERIOD_US, CgroupError, CgroupValues

# a unit property as systemd's D-Bus API takes it: name, D-Bus signature, value
UnitProperty = tuple[str, str, Any]
INFINITY = (1 << 64) - 1  # systemd's "no limit" for a uint64 property
ROOT_SLICE = "-.slice"
# every slice's own: no default dependencies, so it neither waits for nor stops with
# the host's targets; accounting on, so systemd puts it in those controllers' hierarchies
SLICE_BASE: tuple[UnitProperty, ...] = (
    ("DefaultDependencies", "b", False), ("CPUAccounting", "b", True),
    ("MemoryAccounting", "b", True), ("TasksAccounting", "b", True))


class SliceManager(Protocol):
    """systemd's manager, as this driver uses it; each call waits for its job. A failure
    raises CgroupError, its message saying what was being done to which unit."""

    def start_slice(self, name: str, properties: Sequence[UnitProperty]) -> None:
        """Start a transient slice; one already there gets `properties` set instead."""

    def set_properties(self, name: str, properties: Sequence[UnitProperty]) -> None: ...

    def stop(self, name: str) -> None:
        """Stop the unit; one that is not there counts as stopped."""

    def close(self) -> None: ...


def slice_of(path: str) -> str:
    """The unit a driver path names: its last part (systemd nests slices by name)."""
    return path.rstrip("/").rsplit("/", 1)[-1] or ROOT_SLICE


def unit_properties(values: CgroupValues, version: int) -> list[UnitProperty]:
    """The resource properties systemd keeps for a slice with `values` (hugetlb has
    none: its files are written directly)."""
    props: list[UnitProperty] = []
    if values.cpu_shares is not None:
        props.append(("CPUShares", "t", values.cpu_shares) if version == 1 else
                     ("CPUWeight", "t", cpu_weight(values.cpu_shares)))
    if values.cpu_quota is not None:
        period = values.cpu_period or CPU_PERIOD_US
        per_sec = INFINITY if values.cpu_quota <= 0 else values.cpu_quota * 1_000_000 // period
        props.append(("CPUQuotaPerSecUSec", "t", per_sec))
    if values.cpu_period is not None:
        props.append(("CPUQuotaPeriodUSec", "t", values.cpu_period))
    if values.memory_limit is not None:
        props.append(("MemoryLimit" if version == 1 else "MemoryMax", "t",
                      values.memory_limit))
    if values.pids_limit is not None:
        props.append(("TasksMax", "t", INFINITY if values.pids_limit < 0
                      else values.pids_limit))
    return props


class SystemdCgroups:
    """Cgroups as systemd slices: `units` starts and stops them, `files` writes their
    values and keeps the folders systemd does not."""

    def __init__(self, files: CgroupFs, units: SliceManager) -> None:
        self.files = files
        self.units = units

    def exists(self, path: str) -> bool:
        return self.files.exists(path)

    def present(self, path: str) -> bool:
        return self.files.present(path)

    def create(self, path: str, values: CgroupValues) -> None:
        try:
            self.units.start_slice(slice_of(path), [*SLICE_BASE, *unit_properties(
                values, self.files.version)])
        except CgroupError as e:
            raise OSError(f"systemd: {e}") from None
        self.files.create(path, values)

    def update(self, path: str, values: CgroupValues) -> None:
        props = unit_properties(values, self.files.version)
        if props:
            try:
                self.units.set_properties(slice_of(path), props)
            except CgroupError as e:
                raise OSError(f"systemd: {e}") from None
        self.files.update(path, values)

    def remove(self, path: str) -> None:
        try:
            self.units.stop(slice_of(path))
        except CgroupError as e:
            raise OSError(f"systemd: {e}") from None
        self.files.remove(path)  # what systemd does not manage, and anything left

    def children(self, path: str) -> list[str]:
        return self.files.children(path)

    def page_sizes(self) -> tuple[int, ...]:
        return self.files.page_sizes()

    def memory_usage(self, path: str) -> int | None:
        return self.files.memory_usage(path)

    def close(self) -> None:
        self.units.close()
