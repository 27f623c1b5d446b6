"""The kubelet's own settings, read as the kubelet reads them: a
kubelet.config.k8s.io/v1beta1 KubeletConfiguration (--config; what kubeadm writes to
/var/lib/kubelet/config.yaml) and the kubelet's flags, so nodepulse-agent can be started
in the kubelet's place with the kubelet's command line (docs/kubelet-dropin.md).

FIELDS is the one table that says, for every field of the v1beta1 type, what the agent
does with it (tests/test_kubeletconfig.py checks it against the Go type):

- Honoured(key): it becomes the agent's setting of that config-file key (config.OPTIONS),
  converted where the kubelet's form differs;
- Ignored(why): the agent has no such behaviour and going without it is harmless: a
  value other than the kubelet's default is logged once, by name, with why;
- Refused(why): going without it would be wrong: a value other than the ones the agent
  does honour is an error naming the field.

A zero value ("", 0, "0s", {}, []) is the kubelet's default, as its own defaulting has
it: kubeadm writes many. The kubelet's flags that set a field go through the same rows
(a flag wins over the file, as in the kubelet); FLAGS says what becomes of the kubelet's
flags that are not fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

API_VERSION = "kubelet.config.k8s.io/v1beta1"
KIND = "KubeletConfiguration"

# the Go type's shape of a field: how a zero value looks and how a flag's text is read
KINDS = ("str", "*str", "bool", "*bool", "int", "*int", "*float", "duration", "*duration",
         "map", "list", "struct")


class FieldError(ValueError):
    """A field or flag the agent refuses, or a value it cannot read; names it."""


@dataclasses.dataclass(frozen=True)
class Honoured:
    key: str  # the agent's config-file key (config.OPTIONS)
    convert: Callable[[Any], Any] | None = None  # the kubelet's value -> the agent's
    note: str = ""  # what the agent makes of it, where that is less than the kubelet does


@dataclasses.dataclass(frozen=True)
class Ignored:
    why: str
    same: tuple[Any, ...] = ()  # values the agent behaves as anyway: no log line


@dataclasses.dataclass(frozen=True)
class Refused:
    why: str
    allowed: tuple[Any, ...] = ()  # values that are fine: what the agent does anyway


@dataclasses.dataclass(frozen=True)
class Field:
    kind: str
    action: Honoured | Ignored | Refused
    flag: str | None = None  # the kubelet's flag for it, where config.OPTIONS has none


def H(kind: str, key: str, convert: Callable[[Any], Any] | None = None,
      note: str = "") -> Field:
    return Field(kind, Honoured(key, convert, note))


def I(kind: str, why: str, same: Any = None, flag: str | None = None) -> Field:  # noqa: E743
    """`same`: a value (or a tuple of values) the agent behaves as anyway."""
    same = () if same is None else same if isinstance(same, tuple) else (same,)
    return Field(kind, Ignored(why, same), flag)


def R(kind: str, why: str, allowed: tuple[Any, ...] = (), flag: str | None = None) -> Field:
    return Field(kind, Refused(why, allowed), flag)


# -- conversions of honoured fields --

def _node_status_max_images(value: Any) -> Any:
    return 1000 if value == -1 else value  # the kubelet's -1: no cap; the agent's most


def _pod_pids_limit(value: Any) -> Any:
    return -1 if isinstance(value, int) and value < 0 else value  # the kubelet's: any < 0


def _verbosity(value: Any) -> str:
    return "debug" if int(value) >= 4 else "info"


NO_CGROUPS = ("the agent puts no program of the node (itself, the runtime, the system) "
              "in a cgroup of its own")
NO_RESERVED_CGROUPS = ("the system-reserved and kube-reserved cgroups are not limited: "
                       "enforceNodeAllocatable limits kubepods only")
NO_LIMIT = "the agent does not rate-limit these requests"

FIELDS: dict[str, Field] = {
    # serving and reaching the API
    "enableServer": H("*bool", "enableServer"),
    "address": H("str", "address"),
    "port": H("int", "port"),
    "readOnlyPort": I("int", "the read-only, unauthenticated port is not served", 0,
                      "read-only-port"),
    "tlsCertFile": H("str", "tlsCertFile"),
    "tlsPrivateKeyFile": H("str", "tlsPrivateKeyFile"),
    "tlsCipherSuites": I("list", "the kubelet API offers OpenSSL's default TLS 1.2+ "
                                 "suites", None, "tls-cipher-suites"),
    "tlsMinVersion": H("str", "tlsMinVersion",
                       note="TLS 1.2 is the least the agent serves: VersionTLS10/11 mean 1.2"),
    "rotateCertificates": H("bool", "rotateCertificates"),
    "serverTLSBootstrap": H("bool", "serverTLSBootstrap"),
    "authentication.x509.clientCAFile": H("str", "clientCAFile"),
    "authentication.webhook.enabled": H("*bool", "authenticationTokenWebhook"),
    "authentication.webhook.cacheTTL": H("duration", "authenticationTokenWebhookCacheTTL"),
    "authentication.anonymous.enabled": H("*bool", "anonymousAuth"),
    "authorization.mode": H("str", "authorizationMode"),
    "authorization.webhook.cacheAuthorizedTTL": H("duration",
                                                   "authorizationWebhookCacheAuthorizedTTL"),
    "authorization.webhook.cacheUnauthorizedTTL": H(
        "duration", "authorizationWebhookCacheUnauthorizedTTL"),
    "enableDebuggingHandlers": H("*bool", "enableDebuggingHandlers"),
    "enableContentionProfiling": I("bool", "the agent serves no profiles", False,
                                   "contention-profiling"),
    "enableProfilingHandler": I("*bool", "the agent serves no /debug/pprof", False),
    "enableDebugFlagsHandler": I("*bool", "the agent serves no /debug/flags", False),
    "enableSystemLogHandler": I("*bool", "the agent serves no /logs/ (node logs)", False),
    "enableSystemLogQuery": I("*bool", "the agent serves no /logs/ (node logs)", False),
    "healthzPort": H("*int", "healthzPort"),
    "healthzBindAddress": H("str", "healthzBindAddress"),
    "contentType": I("str", "the agent speaks JSON to the API server", "application/json",
                     "kube-api-content-type"),
    "kubeAPIQPS": I("*int", NO_LIMIT + " (its connections bound them)", None, "kube-api-qps"),
    "kubeAPIBurst": I("int", NO_LIMIT + " (its connections bound them)", None, "kube-api-burst"),
    "eventRecordQPS": I("*int", NO_LIMIT + " (Events have two connections of their own)",
                        0, "event-qps"),
    "eventBurst": I("int", NO_LIMIT + " (Events have two connections of their own)", None,
                    "event-burst"),
    "streamingConnectionIdleTimeout": H("duration", "streamingConnectionIdleTimeout"),
    # the node and its status
    "providerID": H("str", "providerID"),
    "registerNode": R("*bool", "the agent always registers its Node", (True,),
                      "register-node"),
    "registerWithTaints": H("list", "registerWithTaints"),
    "nodeStatusUpdateFrequency": H("duration", "nodeStatusUpdateFrequency"),
    "nodeStatusReportFrequency": H("duration", "nodeStatusReportFrequency"),
    "nodeLeaseDurationSeconds": H("int", "nodeLeaseDurationSeconds"),
    "nodeStatusMaxImages": H("*int", "nodeStatusMaxImages", _node_status_max_images,
                             "-1 (no cap) means 1000"),
    "maxPods": H("int", "maxPods"),
    "podsPerCore": I("int", "maxPods alone caps the pods", None, "pods-per-core"),
    "podCIDR": I("str", "only for a kubelet without an API server", None, "pod-cidr"),
    "systemReserved": H("map", "systemReserved"),
    "kubeReserved": H("map", "kubeReserved", note="added to systemReserved"),
    "reservedSystemCPUs": I("str", "no CPUs are set apart (reserve cpu in systemReserved)",
                            None, "reserved-cpus"),
    "reservedMemory": I("list", "no memory manager", None, "reserved-memory"),
    "evictionHard": H("map", "evictionHard"),
    "mergeDefaultEvictionSettings": H("*bool", "mergeDefaultEvictionSettings"),
    "evictionSoft": H("map", "evictionSoft"),
    "evictionSoftGracePeriod": H("map", "evictionSoftGracePeriod"),
    "evictionPressureTransitionPeriod": H("duration", "evictionPressureTransitionPeriod"),
    "evictionMaxPodGracePeriod": H("int", "evictionMaxPodGracePeriod"),
    "evictionMinimumReclaim": H("map", "evictionMinimumReclaim"),
    "imageMinimumGCAge": H("duration", "imageMinimumGCAge"),
    "imageMaximumGCAge": I("duration", "unused images are removed by disk use only, not by "
                           "age", (0,)),
    "imageGCHighThresholdPercent": H("*int", "imageGCHighThresholdPercent"),
    "imageGCLowThresholdPercent": H("*int", "imageGCLowThresholdPercent"),
    "volumeStatsAggPeriod": I("duration", "the stats summary reports no volume usage", None,
                              "volume-stats-agg-period"),
    "localStorageCapacityIsolation": I("*bool", "ephemeral-storage limits are not "
                                       "enforced by eviction", None,
                                       "local-storage-capacity-isolation"),
    "failSwapOn": H("*bool", "failSwapOn"),
    "failCgroupV1": H("*bool", "failCgroupV1"),
    "memorySwap.swapBehavior": I("str", "containers get no swap limits of their own "
                                 "(failSwapOn keeps swap off)", None),
    "featureGates": I("map", "the agent has no feature gates", None, "feature-gates"),
    "logging": H("struct", "logLevel", note="verbosity 4 or more: debug; format text only"),
    "tracing": I("struct", "the agent exports no traces", None),
    "showHiddenMetricsForVersion": I("str", "the agent has no hidden metrics", None),
    "oomScoreAdj": I("*int", "set OOMScoreAdjust= in the agent's systemd unit instead",
                     None, "oom-score-adj"),
    "maxOpenFiles": I("int", "set LimitNOFILE= in the agent's systemd unit instead", None,
                      "max-open-files"),
    "protectKernelDefaults": I("bool", "the agent does not check kernel tunables", False,
                               "protect-kernel-defaults"),
    "kernelMemcgNotification": I("bool", "memory pressure is read by polling", False,
                                 "kernel-memcg-notification"),
    "makeIPTablesUtilChains": I("*bool", "the agent writes no iptables rules", False,
                                "make-iptables-util-chains"),
    "iptablesMasqueradeBit": I("*int", "the agent writes no iptables rules", None),
    "iptablesDropBit": I("*int", "the agent writes no iptables rules", None),
    "hairpinMode": I("str", "hairpin traffic is the network plugin's", "none", "hairpin-mode"),
    # cgroups and resource managers
    "cgroupDriver": H("str", "cgroupDriver"),
    "cgroupRoot": H("str", "cgroupRoot"),
    "cgroupsPerQOS": H("*bool", "cgroupsPerQOS"),
    "kubeletCgroups": I("str", NO_CGROUPS, None, "kubelet-cgroups"),
    "systemCgroups": I("str", NO_CGROUPS, None, "system-cgroups"),
    "systemReservedCgroup": I("str", NO_RESERVED_CGROUPS, None, "system-reserved-cgroup"),
    "kubeReservedCgroup": I("str", NO_RESERVED_CGROUPS, None, "kube-reserved-cgroup"),
    "enforceNodeAllocatable": H("list", "enforceNodeAllocatable",
                                note="pods or none; " + NO_RESERVED_CGROUPS),
    "cpuCFSQuota": I("*bool", "CPU limits always become CFS quotas", True, "cpu-cfs-quota"),
    "cpuCFSQuotaPeriod": I("*duration", "the CFS period is the kernel's 100ms", "100ms",
                           "cpu-cfs-quota-period"),
    "podPidsLimit": H("*int", "podPidsLimit", _pod_pids_limit),
    "qosReserved": H("map", "qosReserved"),
    "cpuManagerPolicy": I("str", "no exclusive CPUs: every pod shares the node's",
                          "none", "cpu-manager-policy"),
    "cpuManagerPolicyOptions": I("map", "no CPU manager", None, "cpu-manager-policy-options"),
    "cpuManagerReconcilePeriod": I("duration", "no CPU manager", None,
                                   "cpu-manager-reconcile-period"),
    "memoryManagerPolicy": I("str", "no memory manager", "None", "memory-manager-policy"),
    "topologyManagerPolicy": I("str", "no topology manager", "none",
                               "topology-manager-policy"),
    "topologyManagerScope": I("str", "no topology manager", "container",
                              "topology-manager-scope"),
    "topologyManagerPolicyOptions": I("map", "no topology manager", None,
                                      "topology-manager-policy-options"),
    "singleProcessOOMKill": I("*bool", "the runtime's default OOM kill applies", None),
    "memoryThrottlingFactor": I("*float", "no memory QoS", None),
    # pods
    "staticPodPath": H("str", "staticPodPath"),
    "staticPodURL": H("str", "staticPodURL"),
    "staticPodURLHeader": H("map", "staticPodURLHeader"),
    "fileCheckFrequency": H("duration", "fileCheckFrequency"),
    "httpCheckFrequency": H("duration", "httpCheckFrequency"),
    "syncFrequency": H("duration", "syncFrequency"),
    "podLogsDir": H("str", "podLogsDir"),
    "clusterDomain": H("str", "clusterDomain"),
    "clusterDNS": H("list", "clusterDNS"),
    "resolvConf": H("*str", "resolvConf"),
    "allowedUnsafeSysctls": H("list", "allowedUnsafeSysctls"),
    "serializeImagePulls": H("*bool", "serializeImagePulls"),
    "maxParallelImagePulls": H("*int", "maxParallelImagePulls"),
    "containerLogMaxSize": H("str", "containerLogMaxSize"),
    "containerLogMaxFiles": H("*int", "containerLogMaxFiles"),
    "containerLogMaxWorkers": I("*int", "logs are rotated on the agent's event loop", 1),
    "containerLogMonitorInterval": I("*duration", "logs are checked for rotation every 10s",
                                     "10s"),
    "containerRuntimeEndpoint": H("str", "containerRuntimeEndpoint"),
    "imageServiceEndpoint": H("str", "imageServiceEndpoint",
                              note="must be unset or the runtime's endpoint"),
    "runtimeRequestTimeout": I("duration", "runtime changes have the kubelet's default "
                               "deadline, 2 minutes", "2m", "runtime-request-timeout"),
    "registryPullQPS": I("*int", NO_LIMIT + " (serializeImagePulls and "
                         "maxParallelImagePulls bound pulls)", 0, "registry-qps"),
    "registryBurst": I("int", NO_LIMIT, None, "registry-burst"),
    "imagePullCredentialsVerificationPolicy": R(
        "str", "the agent does not check that a pod may use an image already on the node",
        ("", "NeverVerify")),
    "preloadedImagesVerificationAllowlist": I("list", "no image credential verification",
                                              None),
    "configMapAndSecretChangeDetectionStrategy": R(
        "str", "the agent watches ConfigMaps and Secrets", ("", "Watch")),
    "enableControllerAttachDetach": R("*bool", "the agent attaches no volumes; the "
                                      "attach-detach controller must", (True,),
                                      "enable-controller-attach-detach"),
    "volumePluginDir": I("str", "no flexvolume plugins", None, "volume-plugin-dir"),
    "seccompDefault": R("*bool", "containers without a seccompProfile run Unconfined "
                        "here; set seccompProfile in the pods instead", (False,),
                        "seccomp-default"),
    "runOnce": R("bool", "the agent runs as a service, not once", (False,), "runonce"),
    "shutdownGracePeriod": H("duration", "shutdownGracePeriod",
                             note="refused with virtual nodes"),
    "shutdownGracePeriodCriticalPods": H("duration", "shutdownGracePeriodCriticalPods"),
    "shutdownGracePeriodByPodPriority": H("list", "shutdownGracePeriodByPodPriority",
                                          note="refused with virtual nodes"),
    "crashLoopBackOff.maxContainerRestartPeriod": I("*duration", "restarts back off up to "
                                                    "5 minutes", "5m"),
    "userNamespaces.idsPerPod": I("*int", "pods with hostUsers: false are refused", None),
}

# The kubelet's flags that are not fields: (what the agent does, why). "honoured" ones
# are config.OPTIONS flags; "ignored" ones are logged by name when given; "refused" ones
# stop the agent with the reason.
FLAGS: dict[str, tuple[str, str]] = {
    "config": ("honoured", "a KubeletConfiguration or the agent's own settings"),
    "config-dir": ("honoured", "KubeletConfiguration drop-ins (*.conf) over --config"),
    "kubeconfig": ("honoured", ""),
    "bootstrap-kubeconfig": ("honoured", "TLS bootstrap (nodeagent/api/bootstrap.py)"),
    "cert-dir": ("honoured", "client and serving certificates"),
    "hostname-override": ("honoured", "the Node's name"),
    "node-ip": ("honoured", ""),
    "node-labels": ("honoured", ""),
    "root-dir": ("honoured", ""),
    "cloud-provider": ("honoured", "'external' registers the Node with the "
                                   "node.cloudprovider.kubernetes.io/uninitialized taint"),
    "v": ("honoured", "4 or more: debug logging"),
    "vmodule": ("ignored", "no per-module log levels"),
    "log-flush-frequency": ("ignored", "log lines are written at once"),
    "logging-format": ("ignored", "the agent logs text"),
    "log-text-split-stream": ("ignored", "the agent logs to stderr"),
    "log-text-info-buffer-size": ("ignored", "log lines are written at once"),
    "log-json-split-stream": ("ignored", "the agent logs text"),
    "log-json-info-buffer-size": ("ignored", "the agent logs text"),
    "runtime-cgroups": ("ignored", NO_CGROUPS),
    # flags older kubeadm versions wrote to kubeadm-flags.env, which the kubelet has
    # since dropped: taken, so such a file still starts the agent
    "pod-infra-container-image": ("ignored", "the runtime's own sandbox image is used (the "
                                             "kubelet dropped this flag in 1.35)"),
    "container-runtime": ("ignored", "every runtime is a CRI endpoint (the kubelet "
                                     "dropped this flag in 1.27)"),
    "network-plugin": ("ignored", "pod networks are the runtime's CNI setup (the kubelet "
                                  "dropped this flag in 1.24)"),
    "image-credential-provider-config": ("ignored", "no credential provider plugins: "
                                                    "private images need imagePullSecrets"),
    "image-credential-provider-bin-dir": ("ignored", "no credential provider plugins"),
    "lock-file": ("ignored", "no lock file"),
    "exit-on-lock-contention": ("ignored", "no lock file"),
    "experimental-mounter-path": ("ignored", "no mounter binary"),
    "experimental-allocatable-ignore-eviction": ("ignored", "allocatable is always less "
                                                 "the hard eviction thresholds"),
}

CLOUD_TAINT = {"key": "node.cloudprovider.kubernetes.io/uninitialized", "value": "true",
               "effect": "NoSchedule"}


# -- reading a document --

def is_kubelet_configuration(doc: Mapping[str, Any]) -> bool:
    return doc.get("kind") == KIND and str(doc.get("apiVersion", "")).startswith(
        "kubelet.config.k8s.io/")


def _get(doc: Mapping[str, Any], path: str) -> Any:
    value: Any = doc
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def leaves(doc: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths a document sets, down to the table's fields."""
    out = []
    for k, v in doc.items():
        path = f"{prefix}{k}"
        if path in FIELDS or not isinstance(v, Mapping):
            out.append(path)
        else:  # a struct of fields; an empty one sets none
            out.extend(leaves(v, path + "."))
    return out


def seconds(value: Any, where: str) -> float:
    """A Go duration ("1m0s", "500ms") in seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) / 1e9  # a bare number is nanoseconds, as in Go's JSON
    text = str(value).strip()
    parts = re.findall(r"(-?\d+(?:\.\d+)?)(h|ms|m|s|us|µs|ns)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        if text == "0":
            return 0.0
        raise FieldError(f"{where}: {value!r} is not a duration (e.g. 10s, 1m0s)")
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    return sum(float(n) * unit[u] for n, u in parts)


def is_zero(kind: str, value: Any, where: str) -> bool:
    """The Go zero value: the kubelet defaults it. Pointers are unset only when null."""
    if value is None:
        return True
    if kind.startswith("*"):
        return False
    if kind == "duration":
        return seconds(value, where) == 0
    return value in ("", 0, False) or (isinstance(value, (Mapping, list)) and not value)


def _same(kind: str, value: Any, other: Any, where: str) -> bool:
    if kind in ("duration", "*duration"):
        return math.isclose(seconds(value, where), seconds(other, where))
    return bool(value == other)


_TYPES: dict[str, type | tuple[type, ...]] = {
    "str": str, "*str": str, "bool": bool, "*bool": bool, "int": int, "*int": int,
    "*float": (int, float), "map": Mapping, "list": list}


def _check_type(kind: str, value: Any, where: str) -> None:
    want = _TYPES.get(kind)
    ok = want is None or (isinstance(value, want) and not (
        kind in ("int", "*int", "*float") and isinstance(value, bool)))
    if not ok:
        raise FieldError(f"{where}: expected {kind.lstrip('*')}, got {value!r}")
    if kind in ("duration", "*duration"):
        seconds(value, where)


@dataclasses.dataclass
class Translated:
    """A KubeletConfiguration (and the kubelet's flags) as the agent's settings."""

    values: dict[str, tuple[Any, str]]  # agent config-file key -> (value, where it came from)
    notes: list[str]  # what is set but not done, one line each, by name


def translate(doc: Mapping[str, Any], where: str,
              flag_values: Mapping[str, Any] | None = None) -> Translated:
    """Map `doc` (a KubeletConfiguration, or {} when only flags are given) and the
    kubelet's flags for fields (`flag_values`: field path -> value in the file's form,
    already read from the flag's text) onto the agent's settings. Refused fields and
    unreadable values raise FieldError naming the field."""
    given: dict[str, tuple[Any, str]] = {}
    notes: list[str] = []
    for path in leaves({k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}):
        if any(f.startswith(path + ".") for f in FIELDS):
            raise FieldError(f"{where}: {path}: expected a mapping of fields, got "
                             f"{_get(doc, path)!r}")
        if path not in FIELDS:
            notes.append(f"{where}: {path}: not a field of {API_VERSION} {KIND}; ignored")
            continue
        given[path] = (_get(doc, path), f"{where}: {path}")
    for path, value in (flag_values or {}).items():
        given[path] = (value, f"--{flag_of(path)}")
    out: dict[str, tuple[Any, str]] = {}
    for path, (value, at) in given.items():
        field = FIELDS[path]
        if path == "logging":
            _logging(value, at, out, notes)
            continue
        if is_zero(field.kind, value, at):
            continue
        _check_type(field.kind, value, at)
        action = field.action
        if isinstance(action, Refused):
            if not any(_same(field.kind, value, a, at) for a in action.allowed):
                raise FieldError(f"{at}: {value!r} is not supported: {action.why}")
        elif isinstance(action, Ignored):
            if not any(_same(field.kind, value, v, at) for v in action.same):
                notes.append(f"{at}: {value!r} is not supported, ignored: {action.why}")
        else:
            out[action.key] = (action.convert(value) if action.convert else value, at)
    return Translated(out, notes)


def _logging(value: Any, at: str, out: dict[str, tuple[Any, str]], notes: list[str]) -> None:
    """logging: verbosity sets the log level; a format other than text and the other
    knobs are noted."""
    if not isinstance(value, Mapping):
        raise FieldError(f"{at}: expected a mapping, got {value!r}")
    for k, v in value.items():
        if k == "verbosity":
            if not isinstance(v, int) or isinstance(v, bool):
                raise FieldError(f"{at}.verbosity: expected a whole number, got {v!r}")
            if v:
                out["logLevel"] = (_verbosity(v), f"{at}.verbosity")
        elif k == "format":
            if v not in ("", "text"):
                notes.append(f"{at}.format: {v!r} is not supported, ignored: the agent "
                             "logs text")
        elif v not in (None, 0, "", "0", {}, []) and not _zero_tree(v):
            notes.append(f"{at}.{k}: {v!r} is not supported, ignored")


def _zero_tree(value: Any) -> bool:
    if isinstance(value, Mapping):
        return all(_zero_tree(v) for v in value.values())
    return value in (None, 0, "", "0", False, [])


def flag_of(path: str) -> str:
    """The kubelet's flag for a field (as this table and config.OPTIONS name it)."""
    return FIELDS[path].flag or path


# -- the kubelet's flags for fields --

def read_flag(path: str, text: str) -> Any:
    """A flag's text in the file's form of field `path` (pflag's forms: key=value
    lists, comma lists, signal<value maps for eviction thresholds)."""
    kind, flag = FIELDS[path].kind, f"--{flag_of(path)}"
    text = text.strip()
    if kind in ("bool", "*bool"):
        low = text.lower()
        if low not in ("true", "false", "1", "0", "t", "f"):
            raise FieldError(f"{flag}: expected true or false, got {text!r}")
        return low in ("true", "1", "t")
    if kind in ("int", "*int"):
        try:
            return int(text)
        except ValueError:
            raise FieldError(f"{flag}: expected a whole number, got {text!r}") from None
    if kind == "*float":
        try:
            return float(text)
        except ValueError:
            raise FieldError(f"{flag}: expected a number, got {text!r}") from None
    if kind == "list":
        return [p.strip() for p in text.split(",") if p.strip()]
    if kind == "map":
        sep = "<" if path.startswith("eviction") and path != "evictionSoftGracePeriod" \
            and path != "evictionMinimumReclaim" else "="
        out: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            k, found, v = part.partition(sep)
            if not found:
                raise FieldError(f"{flag}: {part!r} is not key{sep}value")
            out[k.strip()] = v.strip() if path != "featureGates" else \
                v.strip().lower() == "true"
        return out
    return text


def _shown(value: Any) -> str:
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def table_markdown(flags_of_keys: Mapping[str, str]) -> str:
    """FIELDS and FLAGS as the Markdown tables of docs/kubelet-dropin.md;
    `flags_of_keys`: the agent's flag of each of its config-file keys."""
    lines = ["| field | flag | what the agent does |", "|---|---|---|"]
    for path, field in sorted(FIELDS.items()):
        a = field.action
        flag = field.flag
        if isinstance(a, Honoured):
            flag = flags_of_keys.get(a.key)
            what = f"honoured (`{a.key}`)" + (f"; {a.note}" if a.note else "")
        elif isinstance(a, Refused):
            ok = " or ".join(_shown(v) for v in a.allowed if v != "")
            what = f"**refused** unless {ok}: {a.why}"
        else:
            same = " or ".join(_shown(v) for v in a.same)
            what = f"ignored, logged when set{f' (except {same})' if same else ''}: {a.why}"
        lines.append(f"| `{path}` | {f'`--{flag}`' if flag else ''} | {what} |")
    lines += ["", "| other kubelet flag | what the agent does |", "|---|---|"]
    for name, (action, why) in sorted(FLAGS.items()):
        lines.append(f"| `--{name}` | {action}{': ' + why if why else ''} |")
    return "\n".join(lines) + "\n"
