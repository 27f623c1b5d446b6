"""Node admission: whether this node may run a pod at all, as the kubelet decides it
before starting anything. A refused pod goes to phase Failed with the kubelet's reason
and the message "Pod was rejected: ..." and a Warning Event of that reason; none of its
containers is started.

Checked here: the pod's OS (spec.os.name and its kubernetes.io/os label), its sysctls
against the safe set and `--allowed-unsafe-sysctls`, a Strict supplementalGroupsPolicy
(the runtime cannot do it), AppArmor profiles on a host without AppArmor, and pod-level
resources (this agent makes no pod cgroup).
"""

from __future__ import annotations

import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent.runtime.security import UNCONFINED, normalize_sysctl

NODE_OS = "linux"
OS_LABEL = "kubernetes.io/os"

# Sysctls that are namespaced and touch nothing outside the pod (the kubelet's safe set),
# with the kernel version each needs to be namespaced.
SAFE_SYSCTLS: tuple[tuple[str, tuple[int, int]], ...] = (
    ("kernel.shm_rmid_forced", (0, 0)),
    ("net.ipv4.ip_local_port_range", (0, 0)),
    ("net.ipv4.tcp_syncookies", (0, 0)),
    ("net.ipv4.ping_group_range", (0, 0)),
    ("net.ipv4.ip_unprivileged_port_start", (0, 0)),
    ("net.ipv4.ip_local_reserved_ports", (3, 16)),
    ("net.ipv4.tcp_keepalive_time", (4, 5)),
    ("net.ipv4.tcp_fin_timeout", (4, 6)),
    ("net.ipv4.tcp_keepalive_intvl", (4, 5)),
    ("net.ipv4.tcp_keepalive_probes", (4, 5)),
    ("net.ipv4.tcp_rmem", (4, 15)),
    ("net.ipv4.tcp_wmem", (4, 15)),
)

# Which namespace a sysctl lives in; one outside these is not namespaced at all.
_IPC_NAMES = ("kernel.sem", "kernel.shmall", "kernel.shmmax", "kernel.shmmni",
              "kernel.shm_rmid_forced")
_IPC_PREFIXES = ("kernel.shm", "kernel.msg", "fs.mqueue.")


def sysctl_namespace(name: str) -> str:
    """"Net", "IPC", or "" when the sysctl is not namespaced (node-wide)."""
    if name.startswith("net."):
        return "Net"
    if name in _IPC_NAMES or name.startswith(_IPC_PREFIXES):
        return "IPC"
    return ""


def kernel_version() -> tuple[int, int]:
    parts = platform.release().split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0


def apparmor_enabled() -> bool:
    try:
        return Path("/sys/module/apparmor/parameters/enabled").read_text().strip() == "Y"
    except OSError:
        return False


def check_unsafe_sysctls(patterns: Sequence[str], where: str) -> tuple[str, ...]:
    """Validate `--allowed-unsafe-sysctls` patterns (a name, or a prefix ending in '*'):
    each must be namespaced, else allowing it would let a pod change the node."""
    out = []
    for p in patterns:
        name = normalize_sysctl(p.strip())
        if not name:
            continue
        if "*" in name[:-1]:
            raise ValueError(f"{where}: {p!r}: '*' may only end a pattern")
        if not sysctl_namespace(name.rstrip("*")):
            raise ValueError(f"{where}: {p!r}: the sysctls {name.rstrip('*')!r} are not "
                             "known to be namespaced")
        out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class AdmissionSettings:
    allowed_unsafe_sysctls: tuple[str, ...] = ()  # names or prefixes ending in '*'
    kernel: tuple[int, int] = field(default_factory=kernel_version)
    apparmor: bool = field(default_factory=apparmor_enabled)

    def allowed_sysctls(self) -> tuple[str, ...]:
        safe = tuple(n for n, needs in SAFE_SYSCTLS if self.kernel >= needs)
        return safe + self.allowed_unsafe_sysctls


@dataclass(frozen=True)
class Rejection:
    reason: str
    message: str


# a pod that has not started yet while the node shuts down (nodeagent.shutdown)
NODE_SHUTDOWN = Rejection("NodeShutdown", "Pod was rejected as the node is shutting down.")


def _sysctl_refusal(name: str, allowed: Sequence[str], host_net: bool,
                    host_ipc: bool) -> str:
    name = normalize_sysctl(name)
    for pattern in allowed:
        if pattern == name or (pattern.endswith("*") and name.startswith(pattern[:-1])):
            ns = sysctl_namespace(name)
            if (ns == "Net" and host_net) or (ns == "IPC" and host_ipc):
                return f'"{name}" not allowed with host {ns} enabled'
            return ""
    return f'"{name}" not allowlisted'


def _apparmor_wanted(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    scs = [spec.get("securityContext") or {}] + [
        c.get("securityContext") or {}
        for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]]
    if any((sc.get("appArmorProfile") or {}).get("type") not in (None, UNCONFINED)
           for sc in scs):
        return True
    prefix = "container.apparmor.security.beta.kubernetes.io/"
    return any(k.startswith(prefix) and v != "unconfined"
               for k, v in ((pod.get("metadata") or {}).get("annotations") or {}).items())


def admit(pod: Mapping[str, Any], settings: AdmissionSettings) -> Rejection | None:
    """None when this node may run the pod, else why not (the kubelet's reasons)."""
    spec = pod.get("spec") or {}
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if OS_LABEL in labels and labels[OS_LABEL] != NODE_OS:
        return Rejection("PodOSSelectorNodeLabelDoesNotMatch",
                         "Failed to admit pod as the `kubernetes.io/os` label doesn't match "
                         "node label")
    os_name = (spec.get("os") or {}).get("name")
    if os_name is not None and os_name != NODE_OS:
        return Rejection("PodOSNotSupported",
                         "Failed to admit pod as the OS field doesn't match node OS")
    psc = spec.get("securityContext") or {}
    if psc.get("supplementalGroupsPolicy") not in (None, "Merge"):
        return Rejection("SupplementalGroupsPolicyNotSupported",
                         f"SupplementalGroupsPolicy={psc['supplementalGroupsPolicy']} is not "
                         "supported in this node")
    if spec.get("resources"):
        return Rejection("PodLevelResourcesNotSupported",
                         "Pod-level resources (spec.resources) are not supported by this "
                         "node agent: it makes no pod cgroup")
    if psc.get("sysctls"):
        allowed = settings.allowed_sysctls()
        for s in psc["sysctls"]:
            why = _sysctl_refusal(str(s.get("name") or ""), allowed,
                                  bool(spec.get("hostNetwork")), bool(spec.get("hostIPC")))
            if why:
                return Rejection("SysctlForbidden", f"forbidden sysctl: {why}")
    if not settings.apparmor and _apparmor_wanted(pod):
        return Rejection("AppArmor", "Cannot enforce AppArmor: AppArmor is not enabled on "
                                     "the host")
    return None
