"""The host's cgroup filesystem, as a backend of PodCgroups (cgroups.py).

cgroup v1 (each controller mounted on its own, e.g. /sys/fs/cgroup/cpu, or a hybrid
host with cgroup2 beside them at /sys/fs/cgroup/unified): a cgroup is a folder of the
same path in every hierarchy; values go to cpu.shares, cpu.cfs_period_us,
cpu.cfs_quota_us, memory.limit_in_bytes, pids.max, hugetlb.<size>.limit_in_bytes. A new
folder in the cpuset hierarchy gets its parent's cpuset.cpus and cpuset.mems (the kernel
leaves them empty, and no process could join it). cgroup v2 (one unified hierarchy):
each parent enables its controllers for its children (cgroup.subtree_control); values go
to cpu.weight (the shares scaled to 1..10000), cpu.max, memory.max, pids.max,
hugetlb.<size>.max. Removal kills what still runs in the cgroup (SIGKILL), then removes
its folders deepest first, in every hierarchy; one the kernel still holds busy fails and
is tried again later by the caller.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from nodeagent.pods.cgroups import CgroupError, CgroupValues

V1_CONTROLLERS = frozenset({"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer",
                            "net_cls", "net_prio", "blkio", "perf_event", "hugetlb", "pids",
                            "rdma", "misc"})
# the controllers a cgroup must be in to count as there (the kubelet's check)
V1_REQUIRED = frozenset({"cpu", "cpuacct", "cpuset", "memory", "pids", "hugetlb"})
HUGEPAGES_DIR = "/sys/kernel/mm/hugepages"
_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def page_size_unit(size: int) -> str:
    """A hugepage size as cgroup file names spell it: 2097152 -> 2MB, 1073741824 -> 1GB."""
    unit = 0
    while size % 1024 == 0 and unit < len(_UNITS) - 1:
        size //= 1024
        unit += 1
    return f"{size}{_UNITS[unit]}"


def cpu_weight(shares: int) -> int:
    """cgroup v2's cpu.weight for cgroup v1's cpu.shares."""
    if shares >= 262144:
        return 10000
    return 1 + (max(2, shares) - 2) * 9999 // 262142


def parse_mountinfo(text: str) -> tuple[dict[str, str], list[str], str | None]:
    """From /proc/self/mountinfo: cgroup v1 controller -> mount point (the shortest,
    when mounted twice), every v1 mount point (named hierarchies such as name=systemd
    too), and the cgroup2 mount point (None: not mounted)."""
    controllers: dict[str, str] = {}
    v1: list[str] = []
    unified = None
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, after = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(after) < 3:
            continue
        mount = fields[4]
        if after[0] == "cgroup2":
            if unified is None or len(mount) < len(unified):
                unified = mount
        elif after[0] == "cgroup":
            v1.append(mount)
            for opt in after[2].split(","):
                known = opt in V1_CONTROLLERS or opt.startswith("name=")
                if known and (opt not in controllers or len(mount) < len(controllers[opt])):
                    controllers[opt] = mount
    return controllers, v1, unified


class CgroupFs:
    """Cgroups in the host's files. `controllers`: controller -> its mount point (for
    v2 every available one -> the unified mount); `hierarchies`: every mount point a
    cgroup has a folder in. `kill` and `rmdir` are the host's unless a test hands in
    its own (a folder of a fake tree holds files that a cgroup's folder does not)."""

    def __init__(self, version: int, controllers: Mapping[str, str],
                 hierarchies: Sequence[str], *, hugepages_dir: str = HUGEPAGES_DIR,
                 kill: Callable[[int], None] | None = None,
                 rmdir: Callable[[str], None] = os.rmdir) -> None:
        if version not in (1, 2):
            raise ValueError(f"cgroup version {version}: must be 1 or 2")
        missing = [c for c in ("cpu", "memory") if c not in controllers]
        if missing:
            raise CgroupError(f"cgroup v{version}: the {' and '.join(missing)} controller "
                              "is not available")
        self.version = version
        self.controllers = dict(controllers)
        self.hierarchies = list(dict.fromkeys(hierarchies))
        self.hugepages_dir = hugepages_dir
        self.kill = kill or (lambda pid: os.kill(pid, signal.SIGKILL))
        self.rmdir = rmdir

    @classmethod
    def detect(cls, mountinfo: str = "/proc/self/mountinfo", *,
               hugepages_dir: str = HUGEPAGES_DIR, kill: Callable[[int], None] | None = None,
               rmdir: Callable[[str], None] = os.rmdir) -> CgroupFs:
        """The host's cgroups: v1 when any v1 controller is mounted (a hybrid host
        too, as the kubelet sees it), else v2. Raises CgroupError."""
        try:
            text = Path(mountinfo).read_text()
        except OSError as e:
            raise CgroupError(f"cannot read {mountinfo}: {e.strerror}") from e
        controllers, v1, unified = parse_mountinfo(text)
        if any(c in V1_CONTROLLERS for c in controllers):
            return cls(1, controllers, v1 + ([unified] if unified else []),
                       hugepages_dir=hugepages_dir, kill=kill, rmdir=rmdir)
        if unified is None:
            raise CgroupError(f"no cgroup filesystem is mounted (per {mountinfo})")
        return cls.unified(unified, hugepages_dir=hugepages_dir, kill=kill, rmdir=rmdir)

    @classmethod
    def unified(cls, mount: str, *, hugepages_dir: str = HUGEPAGES_DIR,
                kill: Callable[[int], None] | None = None,
                rmdir: Callable[[str], None] = os.rmdir) -> CgroupFs:
        """cgroup v2 mounted at `mount`, with the controllers its root has."""
        try:
            available = (Path(mount) / "cgroup.controllers").read_text().split()
        except OSError as e:
            raise CgroupError(f"cannot read {mount}/cgroup.controllers: {e.strerror}") from e
        return cls(2, {c: mount for c in available}, [mount], hugepages_dir=hugepages_dir,
                   kill=kill, rmdir=rmdir)

    # --- paths ------------------------------------------------------------------------

    def _dir(self, mount: str, path: str) -> str:
        return os.path.join(mount, path.lstrip("/"))

    def _in(self, controller: str, path: str) -> str | None:
        mount = self.controllers.get(controller)
        return None if mount is None else self._dir(mount, path)

    # --- the backend ------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        if self.version == 2:
            return os.path.isdir(self._dir(self.hierarchies[0], path))
        mounts = {m for c, m in self.controllers.items() if c in V1_REQUIRED}
        return all(os.path.isdir(self._dir(m, path)) for m in mounts)

    def present(self, path: str) -> bool:
        return any(os.path.isdir(self._dir(m, path)) for m in self.hierarchies)

    def create(self, path: str, values: CgroupValues) -> None:
        if self.version == 2:
            self._enable_controllers(self.hierarchies[0], path)
            os.makedirs(self._dir(self.hierarchies[0], path), exist_ok=True)
        else:
            for mount in self.hierarchies:
                os.makedirs(self._dir(mount, path), exist_ok=True)
            cpuset = self.controllers.get("cpuset")
            if cpuset is not None:
                self._fill_cpuset(cpuset, path)
        self.update(path, values)

    def update(self, path: str, values: CgroupValues) -> None:
        for controller, file, value in self._files(values):
            folder = self._in(controller, path)
            if folder is None:
                continue  # not on this host: nothing can be limited there
            _write(os.path.join(folder, file), value)

    def _files(self, v: CgroupValues) -> list[tuple[str, str, str]]:
        """(controller, file, value) to write, in order."""
        out = []
        if self.version == 1:
            if v.cpu_shares is not None:
                out.append(("cpu", "cpu.shares", str(v.cpu_shares)))
            if v.cpu_period is not None:
                out.append(("cpu", "cpu.cfs_period_us", str(v.cpu_period)))
            if v.cpu_quota is not None:
                out.append(("cpu", "cpu.cfs_quota_us", str(v.cpu_quota)))
            if v.memory_limit is not None:
                out.append(("memory", "memory.limit_in_bytes", str(v.memory_limit)))
            limit_file = "limit_in_bytes"
        else:
            if v.cpu_shares is not None:
                out.append(("cpu", "cpu.weight", str(cpu_weight(v.cpu_shares))))
            if v.cpu_quota is not None or v.cpu_period is not None:
                quota = "max" if not v.cpu_quota or v.cpu_quota < 0 else str(v.cpu_quota)
                period = f" {v.cpu_period}" if v.cpu_period else ""
                out.append(("cpu", "cpu.max", quota + period))
            if v.memory_limit is not None:
                out.append(("memory", "memory.max", str(v.memory_limit)))
            limit_file = "max"
        if v.pids_limit is not None:
            out.append(("pids", "pids.max", "max" if v.pids_limit < 0 else str(v.pids_limit)))
        for size, limit in sorted(v.hugetlb.items()):
            out.append(("hugetlb", f"hugetlb.{page_size_unit(size)}.{limit_file}", str(limit)))
        return out

    def _fill_cpuset(self, mount: str, path: str) -> None:
        """Give each folder of `path` in the cpuset hierarchy its parent's CPUs and
        memory nodes where it has none."""
        parts = [p for p in path.split("/") if p]
        parent = mount
        for part in parts:
            here = os.path.join(parent, part)
            for file in ("cpuset.cpus", "cpuset.mems"):
                if not _read(os.path.join(here, file)).strip():
                    _write(os.path.join(here, file), _read(os.path.join(parent, file)).strip())
            parent = here

    def _enable_controllers(self, mount: str, path: str) -> None:
        """cgroup v2: every folder above `path` hands its controllers down."""
        parts = [p for p in path.split("/") if p]
        here = mount
        for part in parts:
            available = _read(os.path.join(here, "cgroup.controllers")).split()
            enabled = _read(os.path.join(here, "cgroup.subtree_control")).split()
            wanted = [c for c in available if c not in enabled]
            if wanted:
                _write(os.path.join(here, "cgroup.subtree_control"),
                       " ".join("+" + c for c in wanted))
            here = os.path.join(here, part)
            os.makedirs(here, exist_ok=True)

    def remove(self, path: str) -> None:
        folders = [self._dir(m, path) for m in self.hierarchies]
        for folder in folders:
            for pid in self._pids(folder):
                with contextlib.suppress(ProcessLookupError):
                    self.kill(pid)
        for folder in folders:
            if not os.path.isdir(folder):
                continue
            for here, _, _ in sorted(os.walk(folder), key=lambda w: -w[0].count(os.sep)):
                try:
                    self.rmdir(here)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno in (errno.EBUSY, errno.ENOTEMPTY):
                        raise OSError(e.errno, f"{here} is still in use (a process in it "
                                               "has not ended yet)") from e
                    raise

    @staticmethod
    def _pids(folder: str) -> list[int]:
        pids = []
        for here, _, _ in os.walk(folder):
            for line in _read(os.path.join(here, "cgroup.procs")).split():
                with contextlib.suppress(ValueError):
                    pids.append(int(line))
        return pids

    def children(self, path: str) -> list[str]:
        names: set[str] = set()
        for mount in self.hierarchies:
            with contextlib.suppress(OSError):
                names.update(e.name for e in os.scandir(self._dir(mount, path)) if e.is_dir())
        return sorted(names)

    def page_sizes(self) -> tuple[int, ...]:
        if "hugetlb" not in self.controllers:
            return ()
        sizes = []
        with contextlib.suppress(OSError):
            for e in os.scandir(self.hugepages_dir):
                kb = e.name.removeprefix("hugepages-").removesuffix("kB")
                if kb.isdigit():
                    sizes.append(int(kb) * 1024)
        return tuple(sorted(sizes))

    def memory_usage(self, path: str) -> int | None:
        folder = self._in("memory", path)
        if folder is None:
            return None
        file = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        text = _read(os.path.join(folder, file)).strip()
        return int(text) if text.isdigit() else None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _write(path: str, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as e:
        raise OSError(e.errno, f"writing {value} to {path}: {e.strerror}") from e
