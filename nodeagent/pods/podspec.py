"""Which fields of a pod spec this agent handles: the one table that says so.

Every PodSpec and Container field is in a table below, with who acts on it: a module of
the agent, the node admission (admission.py), or nobody on the node because the field is
the scheduler's or the API server's (the kubelet ignores those too). A field that is set
but that the agent cannot honour is refused: `unhandled(pod)` names it by its API path
(`spec.containers[0].volumeDevices`), and the syncer keeps the container waiting with
reason CreateContainerConfigError and writes a Warning `Failed` Event, as the kubelet
does when it cannot build a container's config. A field the tables do not know (a newer
API than this agent) is refused the same way: never a container that runs without it.

Fields other modules implement are listed with that module; that module refuses what it
does not support of them (e.g. the volume types it does not mount).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# A rule: None (accepted: the comment says who acts on it) or a function of the field's
# value giving why it is refused ("" or None: accepted).
Rule = Callable[[Any], str | None] | None


def refused(why: str) -> Callable[[Any], str]:
    """Any value that is set is refused."""
    return lambda _value: why


POD_FIELDS: dict[str, Rule] = {
    "volumes": None,                 # nodeagent/pods/volumes (each volume type it mounts)
    "initContainers": None,          # syncer.py; each checked against CONTAINER_FIELDS
    "containers": None,              # syncer.py; each checked against CONTAINER_FIELDS
    "ephemeralContainers": None,     # syncer.py; each checked against EPHEMERAL_FIELDS
    "restartPolicy": None,           # syncer.py
    "terminationGracePeriodSeconds": None,  # syncer.py (grace_of)
    "activeDeadlineSeconds": None,   # the lifecycle code (probes.py and its neighbours)
    "dnsPolicy": None,               # dns.py
    "dnsConfig": None,               # dns.py
    "nodeSelector": None,            # the scheduler's; admission.py checks it against the
                                     # Node's labels (NodeAffinity)
    "affinity": None,                # the scheduler's; admission.py checks the required node
                                     # affinity (NodeAffinity); pod (anti-)affinity and
                                     # what is preferred are the scheduler's alone
    "tolerations": None,             # the scheduler's and the taint-eviction controller's;
                                     # admission.py checks the Node's NoExecute taints
    "topologySpreadConstraints": None,  # the scheduler's
    "schedulerName": None,           # the scheduler's
    "schedulingGates": None,         # the scheduler's
    "priorityClassName": None,       # the API server's (priority admission)
    "priority": None,                # the scheduler's (preemption); admission.py: a
                                     # critical pod may preempt lower ones on the node
    "preemptionPolicy": None,        # the scheduler's
    "workloadRef": None,             # the scheduler's (gang scheduling)
    "serviceAccountName": None,      # the API server's (its token volume is a volume)
    "serviceAccount": None,          # the same, deprecated spelling
    "automountServiceAccountToken": None,  # the API server's (it adds or omits the volume)
    "nodeName": None,                # the binding: which pods are this node's (sources)
    "hostNetwork": None,             # runtime SandboxConfig (CRI namespace NODE)
    "hostPID": None,                 # runtime/security.py (CRI namespace NODE)
    "hostIPC": None,                 # runtime/security.py (CRI namespace NODE)
    "shareProcessNamespace": None,   # runtime/security.py (CRI namespace POD)
    "securityContext": None,         # runtime/security.py; fields in POD_SECURITY_FIELDS
    "imagePullSecrets": None,        # the image code (registry auth)
    "hostname": None,                # dns.py
    "subdomain": None,               # dns.py
    "setHostnameAsFQDN": None,       # dns.py
    "hostnameOverride": None,        # dns.py
    "hostAliases": None,             # dns.py (the managed /etc/hosts)
    "readinessGates": None,          # podstatus.py (the Ready condition)
    "runtimeClassName": None,        # syncer.py (the RuntimeClass's handler to CRI)
    "overhead": None,                # runtime SandboxConfig.overhead (CRI sandbox overhead);
                                     # counted in the requests admission fits (resources.py)
    "enableServiceLinks": None,      # the env code (service environment variables)
    "os": None,                      # admission.py (PodOSNotSupported)
    "resources": None,               # admission.py (PodLevelResourcesNotSupported)
    "hostUsers": lambda v: None if v in (None, True) else (
        "user namespaces (hostUsers: false) are not supported by this agent"),
    "resourceClaims": refused("dynamic resource allocation (resourceClaims) is not "
                              "supported by this agent"),
}

CONTAINER_FIELDS: dict[str, Rule] = {
    "name": None,                    # syncer.py
    "image": None,                   # syncer.py and the image code
    "command": None,                 # runtime ContainerConfig
    "args": None,                    # runtime ContainerConfig
    "workingDir": None,              # runtime ContainerConfig
    "ports": None,                   # hostPort: the sandbox's port mappings, and admission
                                     # (NodePorts); the rest is informational, as for
                                     # the kubelet
    "env": None,                     # the env code (runtime ContainerConfig.from_pod)
    "envFrom": None,                 # the env code
    # requests: what admission fits (resources.py); cpu and memory also the runtime's,
    # and resizable in place (resize.py)
    "resources": lambda v: "dynamic resource allocation (resources.claims) is not " \
        "supported by this agent" if (v or {}).get("claims") else None,
    "resizePolicy": None,            # resize.py: per resource, an in-place resize restarts
                                     # the container (RestartContainer) or not
    "restartPolicy": None,           # sidecar init containers (Always): the lifecycle
                                     # code; refused on the others (REGULAR_CONTAINER_FIELDS)
    "restartPolicyRules": refused("container restart rules are not supported by this "
                                  "agent"),
    "volumeMounts": None,            # nodeagent/pods/volumes
    "volumeDevices": refused("raw block devices (volumeDevices) are not supported by "
                             "this agent"),
    "livenessProbe": None,           # probes.py
    "readinessProbe": None,          # probes.py
    "startupProbe": None,            # probes.py
    "lifecycle": None,               # fields in LIFECYCLE_FIELDS
    "terminationMessagePath": None,  # the lifecycle code (termination messages)
    "terminationMessagePolicy": None,  # the lifecycle code
    "imagePullPolicy": None,         # the image code
    "securityContext": None,         # runtime/security.py; fields in SECURITY_FIELDS
    "stdin": None,                   # runtime ContainerConfig (CRI stdin)
    "stdinOnce": None,               # runtime ContainerConfig
    "tty": None,                     # runtime ContainerConfig
}

# Of the regular containers: a restart policy of their own is an alpha feature
# (per-container restart rules) this agent does not implement.
REGULAR_CONTAINER_FIELDS: dict[str, Rule] = {
    **CONTAINER_FIELDS,
    "restartPolicy": lambda v: f"restartPolicy {v}: only an init container's "
        "restartPolicy Always (a sidecar) is supported by this agent",
}

# Of the ephemeral containers (kubectl debug): a regular container's fields (the API
# server refuses the ones an ephemeral container may not have: ports, probes, lifecycle,
# resources, resizePolicy, restartPolicy) and the process namespace it debugs.
EPHEMERAL_FIELDS: dict[str, Rule] = {
    **REGULAR_CONTAINER_FIELDS,
    "targetContainerName": None,     # syncer.py: CRI pid namespace TARGET of that container
}

LIFECYCLE_FIELDS: dict[str, Rule] = {
    "postStart": None,               # lifecycle.py
    "preStop": None,                 # lifecycle.py
    "stopSignal": refused("a container's own stop signal is not supported by this agent"),
}

SECURITY_FIELDS: dict[str, Rule] = {
    "capabilities": None,            # runtime/security.py
    "privileged": None,              # runtime/security.py (static pods: --allow-privileged)
    "seLinuxOptions": None,          # runtime/security.py
    "windowsOptions": None,          # Windows only: ignored on Linux, as by the kubelet
    "runAsUser": None,               # runtime/security.py
    "runAsGroup": None,              # runtime/security.py
    "runAsNonRoot": None,            # syncer.py, against the image's user
    "readOnlyRootFilesystem": None,  # runtime/security.py
    "allowPrivilegeEscalation": None,  # runtime/security.py (no_new_privs)
    "procMount": lambda v: None if v in (None, "Default") else (
        f"procMount {v}: an unmasked /proc needs user namespaces, which this agent does "
        "not support"),
    "seccompProfile": None,          # runtime/security.py
    "appArmorProfile": None,         # runtime/security.py; admission.py checks the host
}

POD_SECURITY_FIELDS: dict[str, Rule] = {
    "seLinuxOptions": None,          # runtime/security.py
    "windowsOptions": None,          # Windows only: ignored on Linux, as by the kubelet
    "runAsUser": None,               # runtime/security.py
    "runAsGroup": None,              # runtime/security.py
    "runAsNonRoot": None,            # syncer.py, against the image's user
    "supplementalGroups": None,      # runtime/security.py
    "supplementalGroupsPolicy": None,  # admission.py (Strict is refused there)
    "fsGroup": None,                 # runtime/security.py (groups); volume ownership:
                                     # nodeagent/pods/volumes
    "fsGroupChangePolicy": None,     # nodeagent/pods/volumes
    "seLinuxChangePolicy": None,     # nodeagent/pods/volumes (how volumes are relabelled)
    "sysctls": None,                 # admission.py (allowed?) and the sandbox (CRI)
    "seccompProfile": None,          # runtime/security.py
    "appArmorProfile": None,         # runtime/security.py; admission.py checks the host
}

UNKNOWN = "unknown field: this agent does not know it (an API newer than the agent?)"


@dataclass(frozen=True)
class Unhandled:
    """A field that is set and that this agent does not honour."""
    path: str       # API field path, e.g. spec.containers[0].volumeDevices
    why: str
    container: str | None = None  # the container it concerns (None: the whole pod)

    @property
    def message(self) -> str:
        return f"{self.path}: {self.why}"


def _is_set(value: Any) -> bool:
    return value is not None and value != [] and value != {} and value != ""


def _check(obj: Mapping[str, Any], table: Mapping[str, Rule], path: str,
           container: str | None) -> list[Unhandled]:
    out = []
    for key, value in obj.items():
        if not _is_set(value):
            continue
        if key not in table:
            out.append(Unhandled(f"{path}.{key}", UNKNOWN, container))
            continue
        rule = table[key]
        why = rule(value) if rule is not None else None
        if why:
            out.append(Unhandled(f"{path}.{key}", why, container))
    return out


def unhandled(pod: Mapping[str, Any]) -> list[Unhandled]:
    """Every field of the pod's spec that is set and not honoured by this agent."""
    spec = pod.get("spec") or {}
    out = _check(spec, POD_FIELDS, "spec", None)
    psc = spec.get("securityContext")
    if isinstance(psc, Mapping):
        out += _check(psc, POD_SECURITY_FIELDS, "spec.securityContext", None)
    for kind, table in (("initContainers", CONTAINER_FIELDS),
                        ("containers", REGULAR_CONTAINER_FIELDS),
                        ("ephemeralContainers", EPHEMERAL_FIELDS)):
        for i, c in enumerate(spec.get(kind) or []):
            if not isinstance(c, Mapping):
                continue
            name = str(c.get("name") or "")
            path = f"spec.{kind}[{i}]"
            out += _check(c, table, path, name)
            for field, fields in (("securityContext", SECURITY_FIELDS),
                                  ("lifecycle", LIFECYCLE_FIELDS)):
                if isinstance(c.get(field), Mapping):
                    out += _check(c[field], fields, f"{path}.{field}", name)
    return out
