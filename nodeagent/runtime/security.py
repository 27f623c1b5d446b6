"""A pod's security settings resolved to what a runtime applies: the pod's
securityContext as the defaults, each container's own securityContext winning field by
field (as the kubelet resolves them), and the pod's namespace and sysctl settings.

Pure functions of the pod spec; the runtimes turn the records into their own calls (CRI
LinuxContainerSecurityContext and LinuxSandboxSecurityContext) or refuse what they cannot
do, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# seccomp/AppArmor profile kinds, as the API and CRI name them
RUNTIME_DEFAULT = "RuntimeDefault"
UNCONFINED = "Unconfined"
LOCALHOST = "Localhost"


@dataclass(frozen=True)
class Profile:
    """A seccomp or AppArmor profile: its kind and, for Localhost, which one (for
    seccomp the absolute path of the profile file, for AppArmor the profile's name)."""
    kind: str
    localhost_ref: str = ""


@dataclass(frozen=True)
class SELinux:
    user: str = ""
    role: str = ""
    type: str = ""
    level: str = ""


@dataclass(frozen=True)
class ContainerSecurity:
    """What one container runs as and with. None/empty: the runtime's default (the
    image's user, the runtime's capability set)."""
    run_as_user: int | None = None
    run_as_group: int | None = None
    run_as_non_root: bool = False
    supplemental_groups: tuple[int, ...] = ()
    privileged: bool = False
    readonly_rootfs: bool = False
    no_new_privs: bool = False
    capabilities_add: tuple[str, ...] = ()
    capabilities_drop: tuple[str, ...] = ()
    seccomp: Profile = Profile(UNCONFINED)
    apparmor: Profile | None = None
    selinux: SELinux | None = None


@dataclass(frozen=True)
class SandboxSecurity:
    """The pod-level part: the sandbox's own process, its namespaces, its sysctls."""
    run_as_user: int | None = None
    run_as_group: int | None = None
    supplemental_groups: tuple[int, ...] = ()
    privileged: bool = False          # any container of the pod is privileged
    selinux: SELinux | None = None
    host_pid: bool = False
    host_ipc: bool = False
    share_process_namespace: bool = False
    sysctls: tuple[tuple[str, str], ...] = ()


def normalize_sysctl(name: str) -> str:
    """`net/ipv4/conf/eth0.100/rp_filter` -> `net.ipv4.conf.eth0/100.rp_filter`: a name
    whose first separator is '/' uses '/' and '.' the other way round."""
    for ch in name:
        if ch == ".":
            return name
        if ch == "/":
            return name.translate(str.maketrans("./", "/."))
    return name


def _int(v: Any) -> int | None:
    return None if v is None else int(v)


def _selinux(sc: Mapping[str, Any]) -> SELinux | None:
    o = sc.get("seLinuxOptions")
    if not o:
        return None
    return SELinux(str(o.get("user") or ""), str(o.get("role") or ""),
                   str(o.get("type") or ""), str(o.get("level") or ""))


def _profile(p: Mapping[str, Any], where: str, localhost_root: str) -> Profile:
    kind = str(p.get("type") or "")
    if kind == LOCALHOST:
        ref = str(p.get("localhostProfile") or "")
        if not ref:
            raise ValueError(f"{where}.localhostProfile: must be set when type is Localhost")
        if localhost_root:
            ref = f"{localhost_root.rstrip('/')}/{ref}"
        return Profile(LOCALHOST, ref)
    if kind in (RUNTIME_DEFAULT, UNCONFINED):
        return Profile(kind)
    raise ValueError(f"{where}.type: {kind!r} is not RuntimeDefault, Unconfined or Localhost")


def container_security(pod: Mapping[str, Any], container: Mapping[str, Any], where: str,
                       seccomp_root: str = "") -> ContainerSecurity:
    """The container's effective security settings. `where` names the container's
    securityContext in messages (e.g. spec.containers[0].securityContext);
    `seccomp_root`: the folder Localhost seccomp profiles are relative to."""
    spec = pod.get("spec") or {}
    psc = spec.get("securityContext") or {}
    csc = container.get("securityContext") or {}

    def pick(key: str) -> Any:
        v = csc.get(key)
        return psc.get(key) if v is None else v

    groups: list[int] = []
    if psc.get("fsGroup") is not None:
        groups.append(int(psc["fsGroup"]))
    groups += [int(g) for g in psc.get("supplementalGroups") or []]
    if csc.get("seccompProfile"):
        seccomp = _profile(csc["seccompProfile"], f"{where}.seccompProfile", seccomp_root)
    elif psc.get("seccompProfile"):
        seccomp = _profile(psc["seccompProfile"], "spec.securityContext.seccompProfile",
                           seccomp_root)
    else:
        seccomp = Profile(UNCONFINED)  # the kubelet's default (--seccomp-default=false)
    apparmor = None
    if csc.get("appArmorProfile"):
        apparmor = _profile(csc["appArmorProfile"], f"{where}.appArmorProfile", "")
    elif psc.get("appArmorProfile"):
        apparmor = _profile(psc["appArmorProfile"], "spec.securityContext.appArmorProfile", "")
    caps = csc.get("capabilities") or {}
    ape = csc.get("allowPrivilegeEscalation")
    return ContainerSecurity(
        run_as_user=_int(pick("runAsUser")), run_as_group=_int(pick("runAsGroup")),
        run_as_non_root=bool(pick("runAsNonRoot")),
        supplemental_groups=tuple(groups),
        privileged=bool(csc.get("privileged")),
        readonly_rootfs=bool(csc.get("readOnlyRootFilesystem")),
        no_new_privs=ape is not None and not ape,
        capabilities_add=tuple(str(c) for c in caps.get("add") or []),
        capabilities_drop=tuple(str(c) for c in caps.get("drop") or []),
        seccomp=seccomp, apparmor=apparmor,
        selinux=_selinux(csc) or _selinux(psc))


def sandbox_security(pod: Mapping[str, Any]) -> SandboxSecurity:
    spec = pod.get("spec") or {}
    psc = spec.get("securityContext") or {}
    groups: list[int] = []
    if psc.get("fsGroup") is not None:
        groups.append(int(psc["fsGroup"]))
    groups += [int(g) for g in psc.get("supplementalGroups") or []]
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    return SandboxSecurity(
        run_as_user=_int(psc.get("runAsUser")), run_as_group=_int(psc.get("runAsGroup")),
        supplemental_groups=tuple(groups),
        privileged=any((c.get("securityContext") or {}).get("privileged")
                       for c in containers),
        selinux=_selinux(psc),
        host_pid=bool(spec.get("hostPID")), host_ipc=bool(spec.get("hostIPC")),
        share_process_namespace=bool(spec.get("shareProcessNamespace")),
        sysctls=tuple((normalize_sysctl(str(s.get("name") or "")), str(s.get("value") or ""))
                      for s in psc.get("sysctls") or []))
