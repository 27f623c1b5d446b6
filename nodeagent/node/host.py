"""Host readings behind capacity, nodeInfo and addresses, and the signals the eviction
manager watches (nodeagent.pods.eviction).

Each reading comes from the host (/proc, the root cgroup, statvfs, uname) unless the
config overrides it; tests hand in a HostReadings directly instead of a HostProbe.

Memory available is the kubelet's measure: the memory capacity less the working set of
the root cgroup (its usage less its inactive page cache: cgroup v1 `memory.usage_in_bytes`
less `total_inactive_file`; cgroup v2 `anon` + `file` less `inactive_file`), found
through /proc/self/mountinfo. Without a memory cgroup mounted at its root, the kernel's
MemAvailable stands in.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nodeagent.api.quantity import QuantityError, parse_quantity

_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le",
         "s390x": "s390x", "riscv64": "riscv64", "i686": "386"}


class HostReadError(Exception):
    """A host reading failed; the message names the source."""


@dataclasses.dataclass(frozen=True)
class HostReadings:
    cpu: float
    memoryTotal: int
    memoryAvailable: int
    fsTotal: int
    fsAvailable: int
    inodesTotal: int
    inodesFree: int
    pidMax: int
    pidsRunning: int
    kernelVersion: str = ""
    osImage: str = ""
    operatingSystem: str = "linux"
    architecture: str = "amd64"
    hostname: str = ""
    addresses: tuple[tuple[str, str], ...] = ()  # (type, address)
    machineID: str = ""
    bootID: str = ""
    systemUUID: str = ""


_NUMERIC = {"cpu": float, "memoryTotal": int, "memoryAvailable": int, "fsTotal": int,
            "fsAvailable": int, "inodesTotal": int, "inodesFree": int, "pidMax": int,
            "pidsRunning": int}
_TEXT = {"kernelVersion", "osImage", "operatingSystem", "architecture", "hostname",
         "machineID", "bootID", "systemUUID"}


def parse_overrides(data: Mapping[str, Any] | None, what: str = "hostOverrides") -> dict[str, Any]:
    """Validated overrides: quantities for the numbers, strings, and addresses as a list
    of {type, address}. Unknown keys are refused by name."""
    out: dict[str, Any] = {}
    for key, value in (data or {}).items():
        if key in _NUMERIC:
            try:
                number = parse_quantity(value, f"{what}.{key}")
            except QuantityError as e:
                raise ValueError(str(e)) from None
            if number < 0:
                raise ValueError(f"{what}.{key} must not be negative, got {value!r}")
            out[key] = _NUMERIC[key](number)
        elif key in _TEXT:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{what}.{key} must be a non-empty string, got {value!r}")
            out[key] = value
        elif key == "addresses":
            if not isinstance(value, list) or not all(
                    isinstance(a, Mapping) and isinstance(a.get("type"), str)
                    and isinstance(a.get("address"), str) for a in value):
                raise ValueError(f"{what}.addresses must be a list of {{type, address}}")
            out[key] = tuple((a["type"], a["address"]) for a in value)
        else:
            known = ", ".join(sorted([*_NUMERIC, *_TEXT, "addresses"]))
            raise ValueError(f"{what}: unknown key {key!r} (known: {known})")
    return out


@dataclasses.dataclass(frozen=True)
class FsUsage:
    """A filesystem's size, free space (for unprivileged users, as df shows it) and
    inodes."""
    total: int
    available: int
    inodes: int
    inodes_free: int
    device: int  # st_dev: two paths on one filesystem have the same


def filesystem(path: str | os.PathLike[str]) -> FsUsage:
    """The filesystem `path` is on (or would be: the nearest existing parent's)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        fs = os.statvfs(p)
        dev = os.stat(p).st_dev
    except OSError as e:
        raise HostReadError(f"statvfs {p}: {e.strerror}") from e
    return FsUsage(total=fs.f_blocks * fs.f_frsize, available=fs.f_bavail * fs.f_frsize,
                   inodes=fs.f_files, inodes_free=fs.f_favail, device=dev)


class HostProbe:
    """Reads the host. `root_dir` is the filesystem whose space is nodefs; `proc` is
    where /proc is (a folder of fake files in tests)."""

    def __init__(self, root_dir: str | os.PathLike[str] = "/", proc: str | os.PathLike[str] = "/proc",
                 node_ips: tuple[str, ...] = (), overrides: Mapping[str, Any] | None = None,
                 etc: str | os.PathLike[str] = "/etc") -> None:
        self.root_dir = Path(root_dir)
        self.proc = Path(proc)
        self.etc = Path(etc)
        self.node_ips = node_ips
        self.overrides = dict(overrides or {})
        self._memory_cgroup: tuple[str, Path] | None = None
        self._looked_for_cgroup = False

    def read(self) -> HostReadings:
        o = self.overrides
        mem_total, mem_avail = self._meminfo() if not {"memoryTotal", "memoryAvailable"} <= o.keys() \
            else (0, 0)
        fs = filesystem(self.root_dir)
        hostname = o.get("hostname") or socket.gethostname()
        readings = HostReadings(
            cpu=float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1),
            memoryTotal=mem_total, memoryAvailable=mem_avail,
            fsTotal=fs.total, fsAvailable=fs.available,
            inodesTotal=fs.inodes, inodesFree=fs.inodes_free,
            pidMax=int(self._text(self.proc / "sys/kernel/pid_max")),
            pidsRunning=self._tasks(),
            kernelVersion=platform.release(),
            osImage=self._os_image(),
            operatingSystem=platform.system().lower() or "linux",
            architecture=_ARCH.get(platform.machine(), platform.machine()),
            hostname=hostname,
            addresses=self._addresses(hostname),
            machineID=self._optional(self.etc / "machine-id"),
            bootID=self._optional(self.proc / "sys/kernel/random/boot_id"),
        )
        return dataclasses.replace(readings, **o)

    def _text(self, path: Path) -> str:
        try:
            return path.read_text().strip()
        except OSError as e:
            raise HostReadError(f"cannot read {path}: {e.strerror}") from e

    def _optional(self, path: Path) -> str:
        try:
            return path.read_text().strip()
        except OSError:
            return ""

    def _meminfo(self) -> tuple[int, int]:
        path = self.proc / "meminfo"
        fields: dict[str, int] = {}
        for line in self._text(path).splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        if "MemTotal" not in fields or "MemAvailable" not in fields:
            raise HostReadError(f"{path}: no MemTotal/MemAvailable line")
        total = fields["MemTotal"]
        working_set = self._root_working_set()
        if working_set is None:
            return total, fields["MemAvailable"]
        return total, max(0, total - working_set)

    def _root_working_set(self) -> int | None:
        """The root memory cgroup's working set (the module docstring), None when no
        memory cgroup is mounted at its root."""
        if not self._looked_for_cgroup:
            self._memory_cgroup = _memory_cgroup(self.proc / "self/mountinfo")
            self._looked_for_cgroup = True
        if self._memory_cgroup is None:
            return None
        version, path = self._memory_cgroup
        stat: dict[str, int] = {}
        for line in self._text(path / "memory.stat").splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                stat[key] = int(value)
        if version == "v1":
            usage = int(self._text(path / "memory.usage_in_bytes"))
            inactive = stat.get("total_inactive_file", 0)
        else:
            usage = stat.get("anon", 0) + stat.get("file", 0)
            inactive = stat.get("inactive_file", 0)
        return max(0, usage - inactive)

    def _tasks(self) -> int:
        # /proc/loadavg's fourth field is running/total scheduling entities, the
        # number pid_max bounds.
        path = self.proc / "loadavg"
        fields = self._text(path).split()
        try:
            return int(fields[3].split("/")[1])
        except (IndexError, ValueError):
            raise HostReadError(f"{path}: unexpected format") from None

    def _os_image(self) -> str:
        for line in self._optional(self.etc / "os-release").splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
        return platform.platform()

    def _addresses(self, hostname: str) -> tuple[tuple[str, str], ...]:
        ips = list(self.node_ips) or [_primary_ip()]
        return (*(("InternalIP", ip) for ip in ips), ("Hostname", hostname))


def _memory_cgroup(mountinfo: Path) -> tuple[str, Path] | None:
    """("v1" or "v2", where) of the memory cgroup mounted at its root: the v1 memory
    hierarchy where there is one (a hybrid host keeps memory there), else a v2
    hierarchy whose root has the memory controller."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    v2 = None
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5 or fields[3] != "/":
            continue  # a mount of a subtree does not show the root
        fstype, _, options = line.split(" - ", 1)[1].partition(" ")
        where = Path(fields[4])
        if fstype == "cgroup" and "memory" in options.split()[-1].split(","):
            return "v1", where
        if fstype == "cgroup2" and "memory" in _optional_text(
                where / "cgroup.controllers").split():
            v2 = ("v2", where)
    return v2


def _optional_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _primary_ip() -> str:
    """The address the host would use for outbound traffic (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def startup_refusal(*, fail_swap_on: bool, fail_cgroup_v1: bool, proc: str = "/proc",
                    cgroup_root: str = "/sys/fs/cgroup") -> str | None:
    """Why the agent must not start on this host, as the kubelet refuses to (failSwapOn,
    failCgroupV1), or None."""
    if fail_swap_on:
        try:
            lines = Path(proc, "swaps").read_text().splitlines()
        except OSError as e:
            return f"failSwapOn: cannot tell whether swap is on ({e.strerror or e}); " \
                   "set failSwapOn: false (--fail-swap-on=false) to start anyway"
        devices = [line.split()[0] for line in lines[1:] if line.strip()]
        if devices:
            return f"failSwapOn: swap is on ({', '.join(devices)}): turn it off (swapoff " \
                   "-a) or set failSwapOn: false (--fail-swap-on=false)"
    if fail_cgroup_v1 and not Path(cgroup_root, "cgroup.controllers").exists():
        return f"failCgroupV1: this host uses cgroup v1 ({cgroup_root} has no unified " \
               "hierarchy): set failCgroupV1: false (--fail-cgroupv1=false) to start anyway"
    return None
