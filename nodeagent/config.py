"""The agent's settings: flags, NODEPULSE_* environment variables, a YAML config file.

Precedence: flag > environment > file > default. Flag names follow the kubelet's where
the meaning is the same (--node-status-update-frequency), and so do the file's
camelCase keys (nodeStatusUpdateFrequency). Every bad value is refused with the
flag, variable or key that carried it.

--config is either the agent's own file (its keys: OPTIONS) or the kubelet's
KubeletConfiguration (told apart by apiVersion and kind); the kubelet's flags are taken
too. nodeagent/kubeletconfig.py maps both onto these settings, field by field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from nodeagent import kubeletconfig
from nodeagent.api.policy import Heartbeat, PolicyError, parse_heartbeat
from nodeagent.api.quantity import QuantityError, parse_quantity
from nodeagent.node.host import parse_overrides
from nodeagent.pods.admission import check_unsafe_sysctls
from nodeagent.pods.thresholds import (
    DEFAULT_HARD,
    Amount,
    Threshold,
    ThresholdError,
    combine,
    parse_grace_periods,
    parse_minimum_reclaims,
    parse_thresholds,
)
from nodeagent.runtime import socket_path

ENV_PREFIX = "NODEPULSE_"
VIRTUAL_LABEL = "nodepulse.dev/virtual"
VIRTUAL_TAINT = {"key": VIRTUAL_LABEL, "value": "true", "effect": "NoSchedule"}
MAX_VIRTUAL_NODES = 100000
HEALTHZ_PORT = 10248


class ConfigError(ValueError):
    """A setting is wrong; the message names where it came from."""


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    node_name: str
    kubeconfig: str | None = None
    config_file: Path | None = None
    agent_id: str = ""
    max_pods: int = 110
    heartbeat: Heartbeat = Heartbeat()
    heartbeat_mode: str = "efficient"
    # eviction (nodeagent.pods.eviction): signal -> amount; grace periods in seconds
    eviction_hard: Mapping[str, Amount] = dataclasses.field(default_factory=dict)
    eviction_soft: Mapping[str, Amount] = dataclasses.field(default_factory=dict)
    eviction_soft_grace_period: Mapping[str, float] = dataclasses.field(default_factory=dict)
    eviction_minimum_reclaim: Mapping[str, Amount] = dataclasses.field(default_factory=dict)
    eviction_max_pod_grace_period: int = 0  # negative: the pod's own grace period
    eviction_pressure_transition_period: float = 300.0
    # garbage collection (nodeagent.pods.gc)
    image_gc_high_threshold: int = 85  # percent of the image filesystem
    image_gc_low_threshold: int = 80
    image_minimum_gc_age: float = 120.0
    minimum_container_ttl_duration: float = 0.0
    maximum_dead_containers_per_container: int = 1
    maximum_dead_containers: int = -1  # negative: no limit
    system_reserved: Mapping[str, float] = dataclasses.field(default_factory=dict)
    node_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    node_ips: tuple[str, ...] = ()
    root_dir: str = "/var/lib/nodepulse"
    proc_path: str = "/proc"
    host_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    healthz_bind_address: tuple[str, int] | None = ("127.0.0.1", 10248)
    lease_concurrency: int = 16
    status_concurrency: int = 4
    log_level: str = "info"
    # pods: sources and runtime
    pod_manifest_path: str | None = None
    file_check_frequency: float = 20.0
    manifest_url: str | None = None
    manifest_url_headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    http_check_frequency: float = 20.0
    allow_privileged: bool = False  # static pods with host namespaces or privileged
    runtime: str = "auto"
    container_runtime_endpoint: str | None = None
    register_with_taints: tuple[Mapping[str, str], ...] = ()
    # virtual-node mode: these Nodes instead of node_name (empty: a host agent)
    virtual_node_names: tuple[str, ...] = ()
    virtual_node_taints: tuple[Mapping[str, str], ...] = (dict(VIRTUAL_TAINT),)
    # the fake runtime's simulated usage (nodeagent.runtime.usage): each container's
    # without fake.nodepulse.dev/cpu or memory annotations, and each node's own base
    fake_cpu: str = "0"
    fake_memory: str = "0"
    fake_node_cpu: str = "0"
    fake_node_memory: str = "0"
    # the kubelet API (nodeagent.server); None: not served (--enable-server=false; the
    # loader's default is 10250)
    port: int | None = None
    address: str = "0.0.0.0"
    tls_cert_file: str | None = None
    tls_private_key_file: str | None = None
    rotate_server_certificates: bool = False
    client_ca_file: str | None = None
    anonymous_auth: bool = False
    connection_idle_timeout: float = 90.0
    streaming_connection_idle_timeout: float = 4 * 3600.0
    container_log_max_size: int = 10 * 1024 * 1024
    container_log_max_files: int = 5
    # what the node gives pods: resolver, names, sysctls it allows
    cluster_dns: tuple[str, ...] = ()
    cluster_domain: str = ""
    resolv_conf: str = "/etc/resolv.conf"
    allowed_unsafe_sysctls: tuple[str, ...] = ()
    serialize_image_pulls: bool = True
    max_parallel_image_pulls: int = 0  # 0: no limit (with serialize_image_pulls off)
    evented_pleg_relist_period: float = 60.0  # the PLEG's relist while events flow
    # cgroups (nodeagent.pods.cgroups); --kube-reserved is added to system_reserved
    cgroup_root: str = "/"
    cgroups_per_qos: bool = True
    cgroup_driver: str = "cgroupfs"
    enforce_node_allocatable: tuple[str, ...] = ("pods",)
    pod_pids_limit: int = -1
    qos_reserved: Mapping[str, int] = dataclasses.field(default_factory=dict)  # percent
    # the kubelet's ways (docs/kubelet-dropin.md): client certificate, host checks,
    # the kubelet API's authentication and authorization
    bootstrap_kubeconfig: str | None = None
    cert_dir: str = ""  # the loader's default: <root-dir>/pki
    rotate_certificates: bool = False
    provider_id: str = ""
    sync_frequency: float = 60.0
    pod_logs_dir: str = ""  # empty: <root-dir>/logs/pods
    fail_swap_on: bool = False  # a KubeletConfiguration's default: true
    fail_cgroup_v1: bool = False  # a KubeletConfiguration's default: true
    authentication_token_webhook: bool = True
    authentication_token_webhook_cache_ttl: float = 120.0
    authorization_mode: str = "Webhook"
    authorization_webhook_cache_authorized_ttl: float = 300.0
    authorization_webhook_cache_unauthorized_ttl: float = 30.0
    tls_min_version: str = "VersionTLS12"
    enable_debugging_handlers: bool = True
    # graceful node shutdown (nodeagent.shutdown; none unless a grace period is given)
    shutdown_grace_period: float = 0.0
    shutdown_grace_period_critical_pods: float = 0.0
    shutdown_grace_period_by_pod_priority: tuple[tuple[int, int], ...] = ()  # (priority, s)
    logind_conf_dir: str = "/etc/systemd/logind.conf.d"

    @property
    def legacy(self) -> bool:
        return self.heartbeat_mode == "legacy"

    @property
    def eviction_thresholds(self) -> tuple[Threshold, ...]:
        """The hard and soft thresholds, with their grace periods and minimum reclaims
        (checked when the settings were loaded)."""
        return combine(self.eviction_hard, self.eviction_soft,
                       self.eviction_soft_grace_period, self.eviction_minimum_reclaim)

    @property
    def virtual(self) -> bool:
        return bool(self.virtual_node_names)

    @property
    def graceful_shutdown(self) -> bool:
        return self.shutdown_grace_period > 0 or bool(self.shutdown_grace_period_by_pod_priority)

    @property
    def node_names(self) -> tuple[str, ...]:
        """Every Node this process speaks for."""
        return self.virtual_node_names or (self.node_name,)


# -- value parsers: (raw value, where it came from) -> value --

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|µs|ns)")
_UNIT = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_duration(value: Any, where: str) -> float:
    """Seconds from a Go duration ('10s', '1m30s', '500ms') or a plain number of seconds."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a duration such as 10s, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ConfigError(f"{where}: {value!r} is not a duration "
                                  "(e.g. 10s, 1m30s, 500ms)") from None
            seconds = sum(float(n) * _UNIT[u] for n, u in parts)
    if not math.isfinite(seconds):
        raise ConfigError(f"{where}: {value!r} is not a duration (e.g. 10s, 1m30s, 500ms)")
    if seconds < 0:
        raise ConfigError(f"{where}: must not be negative, got {value!r}")
    return seconds


def _whole_seconds(value: Any, where: str) -> int:
    seconds = parse_duration(value, where)
    if seconds != int(seconds) or seconds < 1:
        raise ConfigError(f"{where}: must be a whole number of seconds, at least 1; "
                          f"got {value!r}")
    return int(seconds)


def _int(low: int, high: int) -> Callable[[Any, str], int]:
    def parse(value: Any, where: str) -> int:
        try:
            n = int(str(value).strip()) if not isinstance(value, bool) else None
        except ValueError:
            n = None
        if n is None:
            raise ConfigError(f"{where}: expected a whole number, got {value!r}")
        if not low <= n <= high:
            raise ConfigError(f"{where}: must be between {low} and {high}, got {n}")
        return n
    return parse


def _str(value: Any, where: str) -> str:
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return str(value)


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def _choice(*choices: str) -> Callable[[Any, str], str]:
    def parse(value: Any, where: str) -> str:
        if value not in choices:
            raise ConfigError(f"{where}: must be one of {', '.join(choices)}, got {value!r}")
        return str(value)
    return parse


def _pairs(value: Any, where: str) -> dict[str, str]:
    """'a=1,b=2' or a mapping."""
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected key=value pairs, got {value!r}")
    out = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        if "=" not in part:
            raise ConfigError(f"{where}: {part!r} is not key=value")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def _labels(value: Any, where: str) -> dict[str, str]:
    labels = _pairs(value, where)
    for k, v in labels.items():
        if not k or not _LABEL_VALUE.match(v):
            raise ConfigError(f"{where}: label {k}={v!r} is not a valid label")
    return labels


def _reserved(value: Any, where: str) -> dict[str, float]:
    out = {}
    for k, v in _pairs(value, where).items():
        if k not in ("cpu", "memory", "ephemeral-storage", "pods", "pid"):
            raise ConfigError(f"{where}: unknown resource {k!r}")
        try:
            out[k] = parse_quantity(v, f"{where}: {k}")
        except QuantityError as e:
            raise ConfigError(str(e)) from None
    return out


def _thresholds(value: Any, where: str) -> dict[str, Amount]:
    try:
        return parse_thresholds(value, where)
    except QuantityError as e:
        raise ConfigError(str(e)) from None


def _reclaims(value: Any, where: str) -> dict[str, Amount]:
    try:
        return parse_minimum_reclaims(value, where)
    except QuantityError as e:
        raise ConfigError(str(e)) from None


def _grace_periods(value: Any, where: str) -> dict[str, float]:
    try:
        return parse_grace_periods(value, parse_duration, where)
    except QuantityError as e:
        raise ConfigError(str(e)) from None


def _ips(value: Any, where: str) -> tuple[str, ...]:
    items = value if isinstance(value, list) else str(value).split(",")
    ips = tuple(str(i).strip() for i in items if str(i).strip())
    for ip in ips:
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)
        except (OSError, ValueError):  # ValueError: a NUL in it
            raise ConfigError(f"{where}: {ip!r} is not an IP address") from None
    return ips


def _is_ip(text: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)
    except (OSError, ValueError):
        return False
    return True


def _bind(value: Any, where: str) -> tuple[str, int] | None:
    """host:port, or an IP alone (the kubelet's form: the port is --healthz-port's)."""
    text = str(value).strip()
    if text in ("", "0", "off"):
        return None
    if _is_ip(text.strip("[]")):
        return text.strip("[]"), HEALTHZ_PORT
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{where}: expected host:port (port 0 picks one), got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _yaml(text: str, where: str) -> Any:
    """yaml.safe_load, with every failure (PyYAML's constructors also raise ValueError
    and friends on odd tags) as a ConfigError naming `where`."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    except (ValueError, TypeError, IndexError, KeyError, OverflowError, RecursionError) as e:
        raise ConfigError(f"{where}: not valid YAML: {type(e).__name__}: {e}") from None


def _overrides(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        value = _yaml(value, where)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    try:
        return parse_overrides(value, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None


_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _taints(value: Any, where: str) -> tuple[dict[str, str], ...]:
    """'key=value:Effect,key:Effect' (the kubelet's flag) or a list of
    {key, value, effect} (its config file)."""
    items: list[Any]
    if isinstance(value, str):
        items = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            kv, sep, effect = part.rpartition(":")
            if not sep:
                raise ConfigError(f"{where}: {part!r} is not key[=value]:Effect")
            k, _, v = kv.partition("=")
            items.append({"key": k, "value": v, "effect": effect})
    elif isinstance(value, list):
        items = value
    else:
        raise ConfigError(f"{where}: expected key=value:Effect,... or a list of taints")
    out = []
    for t in items:
        if not isinstance(t, Mapping) or not t.get("key"):
            raise ConfigError(f"{where}: taint {t!r} has no key")
        if t.get("effect") not in _EFFECTS:
            raise ConfigError(f"{where}: taint {t.get('key')}: effect must be one of "
                              f"{', '.join(_EFFECTS)}, got {t.get('effect')!r}")
        if not _LABEL_VALUE.match(str(t.get("value") or "")):
            raise ConfigError(f"{where}: taint {t['key']}: {t.get('value')!r} is not a "
                              "valid value")
        taint = {"key": str(t["key"]), "effect": str(t["effect"])}
        if t.get("value"):
            taint["value"] = str(t["value"])
        out.append(taint)
    return tuple(out)


def _headers(value: Any, where: str) -> dict[str, str]:
    """'Name:value,Other:value' (the kubelet's flag) or a mapping of name to a value or
    a list of values (its config file)."""
    if isinstance(value, Mapping):
        return {str(k): ",".join(map(str, v)) if isinstance(v, list) else str(v)
                for k, v in value.items()}
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected Name:value,... or a mapping")
    out = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        k, sep, v = part.partition(":")
        if not sep or not k.strip():
            raise ConfigError(f"{where}: {part!r} is not Name:value")
        out[k.strip()] = v.strip()
    return out


def _period(value: Any, where: str) -> float:
    seconds = parse_duration(value, where)
    if seconds <= 0:
        raise ConfigError(f"{where}: must be more than zero, got {value!r}")
    return seconds


def _domain(value: Any, where: str) -> str:
    text = _str(value, where).strip().rstrip(".")
    if text and (len(text) > 253 or not _NODE_NAME.match(text)):
        raise ConfigError(f"{where}: {text!r} is not a DNS domain (e.g. cluster.local)")
    return text


def _sysctls(value: Any, where: str) -> tuple[str, ...]:
    items = value if isinstance(value, list) else str(value).split(",")
    try:
        return check_unsafe_sysctls([str(i) for i in items], where)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _cgroup_root(value: Any, where: str) -> str:
    text = _str(value, where).strip() or "/"
    if not text.startswith("/") or "//" in text or any(p in (".", "..") for p in text.split("/")):
        raise ConfigError(f"{where}: {value!r} is not an absolute cgroup path (e.g. / or "
                          "/kubelet)")
    return text.rstrip("/") or "/"


ENFORCEMENTS = ("pods", "system-reserved", "kube-reserved", "system-reserved-compressible",
                "kube-reserved-compressible", "none")


def _enforcements(value: Any, where: str) -> tuple[str, ...]:
    """'pods' (the kubelet's default), 'none' or empty; the reserved cgroups' own
    enforcement is refused by name: this agent does not limit those cgroups."""
    items = value if isinstance(value, list) else str(value).split(",")
    names = [str(i).strip() for i in items if str(i).strip()]
    for n in names:
        if n not in ENFORCEMENTS:
            raise ConfigError(f"{where}: {n!r} is not one of {', '.join(ENFORCEMENTS)}")
        if n not in ("pods", "none"):
            raise ConfigError(f"{where}: {n}: limiting the system-reserved and "
                              "kube-reserved cgroups is not supported by this agent; use "
                              "pods, or none")
        if names.count(n) > 1:
            raise ConfigError(f"{where}: {n!r} is listed twice")
    if "none" in names and len(names) > 1:
        raise ConfigError(f"{where}: none cannot be combined with {names}")
    return tuple(n for n in names if n != "none")


def _qos_reserved(value: Any, where: str) -> dict[str, int]:
    """'memory=50%': how much of the memory requests of each QoS class the classes
    below it may not use."""
    out = {}
    for k, v in _pairs(value, where).items():
        if k != "memory":
            raise ConfigError(f"{where}: {k}: only memory can be reserved per QoS class")
        text = v.strip()
        if not text.endswith("%") or not text[:-1].isdigit() or int(text[:-1]) > 100:
            raise ConfigError(f"{where}: memory: expected a percentage 0%-100%, got {v!r}")
        out[k] = int(text[:-1])
    return out


def _opt_str(value: Any, where: str) -> str | None:
    return _str(value, where) or None


_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _node_name(name: str, where: str) -> str:
    if len(name) > 253 or not _NODE_NAME.match(name):
        raise ConfigError(f"{where}: {name!r} is not a valid Node name (lower-case letters, "
                          "digits, '-' and '.', at most 253 characters)")
    return name


def _virtual_nodes(value: Any, where: str) -> int | tuple[str, ...]:
    """A count (names come from the prefix) or a list of names."""
    if isinstance(value, list):
        names = tuple(_node_name(_str(v, where), where) for v in value)
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"{where}: node name(s) listed twice: {', '.join(dup)}")
        return names
    return _int(0, MAX_VIRTUAL_NODES)(value, where)


def _address(value: Any, where: str) -> str:
    text = _str(value, where).strip().strip("[]")
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)
    except (OSError, ValueError):
        raise ConfigError(f"{where}: {value!r} is not an IP address to listen on") from None
    return text


def _ttl(value: Any, where: str) -> float:
    return parse_duration(value, where)


def _tls_version(value: Any, where: str) -> str:
    """VersionTLS12 or VersionTLS13; the kubelet's 1.0 and 1.1 mean 1.2 here (the least
    the agent serves)."""
    versions = ("VersionTLS10", "VersionTLS11", "VersionTLS12", "VersionTLS13")
    text = _choice(*versions)(value, where)
    return "VersionTLS13" if text == "VersionTLS13" else "VersionTLS12"


def _log_size(value: Any, where: str) -> int:
    try:
        size = int(parse_quantity(str(value), where))
    except QuantityError as e:
        raise ConfigError(str(e)) from None
    if size < 1024:
        raise ConfigError(f"{where}: must be at least 1Ki, got {value!r}")
    return size


def _shutdown_period(value: Any, where: str) -> float:
    """The kubelet's rule: zero (off), or a second or more."""
    seconds = parse_duration(value, where)
    if 0 < seconds < 1:
        raise ConfigError(f"{where}: must be 0 or at least 1s, got {value!r}")
    return seconds


INT32 = 2**31


def _priority_periods(value: Any, where: str) -> tuple[tuple[int, int], ...]:
    """shutdownGracePeriodByPodPriority: [{priority, shutdownGracePeriodSeconds}, ...]."""
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list of {{priority, "
                          f"shutdownGracePeriodSeconds}}, got {value!r}")
    out: dict[int, int] = {}
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping) or set(item) - {"priority",
                                                         "shutdownGracePeriodSeconds"}:
            raise ConfigError(f"{at}: expected {{priority, shutdownGracePeriodSeconds}}, "
                              f"got {item!r}")
        priority = _int(-INT32, INT32 - 1)(item.get("priority", 0), f"{at}.priority")
        seconds = _int(0, 10**9)(item.get("shutdownGracePeriodSeconds", 0),
                                 f"{at}.shutdownGracePeriodSeconds")
        if priority in out:
            raise ConfigError(f"{at}.priority: {priority} is listed twice")
        out[priority] = seconds
    return tuple(sorted(out.items()))


def _taints_or_none(value: Any, where: str) -> tuple[dict[str, str], ...]:
    if value is None or (isinstance(value, str) and value.strip() in ("", "none")):
        return ()
    return _taints(value, where)


def _usage(value: Any, where: str) -> str:
    from nodeagent.runtime.usage import UsageError, parse_usage
    text = _str(value, where)
    try:
        parse_usage(text, where)
    except UsageError as e:
        raise ConfigError(str(e)) from None
    return text


@dataclasses.dataclass(frozen=True)
class Option:
    field: str  # AgentConfig field, or heartbeat.<name>
    flag: str | None
    key: str | None  # config-file key
    parse: Callable[[Any, str], Any]
    help: str


OPTIONS: tuple[Option, ...] = (
    Option("kubeconfig", "kubeconfig", None, _str, "kubeconfig with this node's credentials"),
    Option("node_name", "node-name", "nodeName", _str, "Node name (default: hostname)"),
    Option("agent_id", "agent-id", "agentID", _str,
           "value of the nodepulse.dev/agent label (default: the node name)"),
    Option("max_pods", "max-pods", "maxPods", _int(1, 100000), "pods capacity (110)"),
    Option("heartbeat.statusUpdateFrequencySeconds", "node-status-update-frequency",
           "nodeStatusUpdateFrequency", _whole_seconds, "how often NodeStatus is computed (10s)"),
    Option("heartbeat.statusReportFrequencySeconds", "node-status-report-frequency",
           "nodeStatusReportFrequency", _whole_seconds,
           "NodeStatus is written at least this often, even without change (5m)"),
    Option("heartbeat.leaseDurationSeconds", "node-lease-duration-seconds",
           "nodeLeaseDurationSeconds", _int(5, 3600), "Lease duration (40)"),
    Option("heartbeat.renewIntervalSeconds", "node-lease-renew-interval",
           "nodeLeaseRenewInterval", _whole_seconds,
           "Lease renew interval (a quarter of the duration)"),
    Option("heartbeat.maxImagesInStatus", "node-status-max-images", "nodeStatusMaxImages",
           _int(0, 1000), "at most this many images in NodeStatus (50)"),
    Option("heartbeat_mode", "heartbeat-mode", "heartbeatMode",
           _choice("efficient", "legacy"),
           "efficient (Lease + status on change) or legacy (full status every period, "
           "no Lease; for comparison only)"),
    Option("eviction_hard", "eviction-hard", "evictionHard", _thresholds,
           f"thresholds that, once met, evict pods at once ({DEFAULT_HARD}); 0%% and "
           "100%% are ignored"),
    Option("eviction_soft", "eviction-soft", "evictionSoft", _thresholds,
           "thresholds that evict pods once met for their grace period, e.g. "
           "memory.available<1.5Gi"),
    Option("eviction_soft_grace_period", "eviction-soft-grace-period",
           "evictionSoftGracePeriod", _grace_periods,
           "how long each soft threshold must hold, e.g. memory.available=1m30s"),
    Option("eviction_minimum_reclaim", "eviction-minimum-reclaim", "evictionMinimumReclaim",
           _reclaims, "what is reclaimed beyond a threshold once it is met, e.g. "
                      "imagefs.available=2Gi"),
    Option("eviction_max_pod_grace_period", "eviction-max-pod-grace-period",
           "evictionMaxPodGracePeriod", _int(-(2**31), 2**31 - 1),
           "most seconds a pod evicted for a soft threshold is given to stop (0; "
           "negative: its own terminationGracePeriodSeconds)"),
    Option("eviction_pressure_transition_period", "eviction-pressure-transition-period",
           "evictionPressureTransitionPeriod", parse_duration,
           "how long a pressure condition stays True after its threshold was last met (5m)"),
    Option("image_gc_high_threshold", "image-gc-high-threshold", "imageGCHighThresholdPercent",
           _int(0, 100), "image filesystem usage (percent) at which unused images are "
                         "removed (85; 100 turns image garbage collection off)"),
    Option("image_gc_low_threshold", "image-gc-low-threshold", "imageGCLowThresholdPercent",
           _int(0, 100), "... down to this usage (80)"),
    Option("image_minimum_gc_age", "minimum-image-ttl-duration", "imageMinimumGCAge",
           parse_duration, "an unused image younger than this is kept (2m)"),
    Option("minimum_container_ttl_duration", "minimum-container-ttl-duration", None,
           parse_duration, "a dead container younger than this is kept (0s)"),
    Option("maximum_dead_containers_per_container", "maximum-dead-containers-per-container",
           None, _int(-(2**31), 2**31 - 1),
           "dead instances kept of each container (1: the one `kubectl logs --previous` "
           "reads; negative: no limit)"),
    Option("maximum_dead_containers", "maximum-dead-containers", None,
           _int(-(2**31), 2**31 - 1),
           "dead containers kept on the node in all (-1: no limit)"),
    Option("system_reserved", "system-reserved", "systemReserved", _reserved,
           "resources held back from allocatable for the system, e.g. "
           "cpu=100m,memory=256Mi,pid=1000"),
    Option("node_labels", "node-labels", "nodeLabels", _labels, "extra labels, k=v,..."),
    Option("node_ips", "node-ip", "nodeIP", _ips, "node addresses (default: detected)"),
    Option("root_dir", "root-dir", "rootDir", _str,
           "agent state folder; its filesystem is nodefs (/var/lib/nodepulse)"),
    Option("proc_path", "proc-path", "procPath", _str, "where procfs is mounted (/proc)"),
    Option("host_overrides", "host-overrides", "hostOverrides", _overrides,
           "host readings to use instead of measuring (YAML/JSON mapping), e.g. "
           "{cpu: 4, memoryTotal: 8Gi, kernelVersion: x}"),
    Option("healthz_bind_address", "healthz-bind-address", "healthzBindAddress", _bind,
           "host:port for /healthz and /metrics (127.0.0.1:10248; empty disables)"),
    Option("lease_concurrency", "lease-concurrency", "leaseConcurrency", _int(1, 256),
           "Lease writes at once, never waiting behind other writes; more wait in the "
           "order their Leases expire (16)"),
    Option("status_concurrency", "status-concurrency", "statusConcurrency", _int(1, 256),
           "NodeStatus writes at once, and threads for host readings (4)"),
    Option("log_level", "log-level", "logLevel", _choice("debug", "info", "warning", "error"),
           "log level (info)"),
    Option("pod_manifest_path", "pod-manifest-path", "staticPodPath", _opt_str,
           "folder of static pod manifests"),
    Option("file_check_frequency", "file-check-frequency", "fileCheckFrequency",
           _period, "full rescan of the manifest folder (20s)"),
    Option("manifest_url", "manifest-url", "staticPodURL", _opt_str,
           "URL of static pod manifests"),
    Option("manifest_url_headers", "manifest-url-header", "staticPodURLHeader", _headers,
           "headers for --manifest-url, Name:value,..."),
    Option("http_check_frequency", "http-check-frequency", "httpCheckFrequency",
           _period, "how often --manifest-url is polled (20s)"),
    Option("allow_privileged", "allow-privileged", "allowPrivileged", _bool,
           "run static pods (--pod-manifest-path, --manifest-url) that use a host "
           "namespace (hostNetwork, hostPID, hostIPC) or a privileged container; "
           "without it (the default, false) such a static pod is refused with a "
           "Warning Event naming the file and the field. Pods from the API server are "
           "not affected: admission (PodSecurity) governs those"),
    Option("runtime", "runtime", "runtime", _choice("auto", "cri", "process", "fake"),
           "container runtime: cri, process, fake, or auto (cri when the endpoint's "
           "socket exists, else process; with --virtual-nodes: fake)"),
    Option("fake_cpu", "fake-cpu", "fakeCpu", _usage,
           "the fake runtime: CPU a container uses when its pod has no "
           "fake.nodepulse.dev/cpu annotation (cores: 0, 250m; or ramp(from, to, duration), "
           "sine(mean, amplitude, period); default 0)"),
    Option("fake_memory", "fake-memory", "fakeMemory", _usage,
           "the fake runtime: memory a container uses without a fake.nodepulse.dev/memory "
           "annotation (64Mi, or an expression as for --fake-cpu; default 0)"),
    Option("fake_node_cpu", "fake-node-cpu", "fakeNodeCpu", _usage,
           "the fake runtime: CPU each node uses besides its pods (its own daemons; "
           "default 0)"),
    Option("fake_node_memory", "fake-node-memory", "fakeNodeMemory", _usage,
           "the fake runtime: memory each node uses besides its pods (default 0)"),
    Option("container_runtime_endpoint", "container-runtime-endpoint",
           "containerRuntimeEndpoint", _opt_str,
           "CRI socket (unix:///run/containerd/containerd.sock)"),
    Option("register_with_taints", "register-with-taints", "registerWithTaints", _taints,
           "taints the Node is registered with, key=value:Effect,..."),
    Option("virtual_nodes", "virtual-nodes", "virtualNodes", _virtual_nodes,
           "virtual-node mode: run N Nodes named <prefix>-0..<prefix>-(N-1) in this one "
           "process (0: off, a host agent); in --config also a list of names, "
           "virtualNodes: [a, b]. Each Node has its own Lease, status and policy; all share "
           "one pod watch, one runtime (fake or process; cri is refused) and one PLEG. "
           "Static pods are refused. One agent writes for many Nodes, so it cannot use a "
           "node client certificate (NodeRestriction lets a node write only its own "
           "objects): give it a ServiceAccount or admin kubeconfig with the RBAC of the "
           "Helm chart's agent identity"),
    Option("node_name_prefix", "node-name-prefix", "nodeNamePrefix", _str,
           "virtual-node names' prefix: P gives P-0, P-1, ...; a prefix that ends in "
           "'-' or '.' is used as is (default: the agent id, else the node name)"),
    Option("virtual_node_taints", "virtual-node-taint", "virtualNodeTaint", _taints_or_none,
           "taints of virtual Nodes, key=value:Effect,... "
           "(nodepulse.dev/virtual=true:NoSchedule; 'none' or empty: no taint). Virtual "
           "Nodes are also labelled nodepulse.dev/virtual=true and nodepulse.dev/agent=<id>"),
    Option("port", "port", "port", _int(0, 65535),
           "port of the kubelet API (logs, exec, attach, port-forward, stats) over TLS "
           "(10250; 0 picks a free one; the Node's daemonEndpoints say which)"),
    Option("enable_server", "enable-server", "enableServer", _bool,
           "serve the kubelet API (true; false: no kubectl logs, exec, attach, "
           "port-forward or top for this agent's nodes, and no TLS certificate made)"),
    Option("address", "address", "address", _address,
           "IP address the kubelet API listens on (0.0.0.0: all)"),
    Option("tls_cert_file", "tls-cert-file", "tlsCertFile", _opt_str,
           "serving certificate of the kubelet API (PEM); without it and without "
           "--rotate-server-certificates a self-signed one is made under --root-dir/pki"),
    Option("tls_private_key_file", "tls-private-key-file", "tlsPrivateKeyFile", _opt_str,
           "private key of --tls-cert-file"),
    Option("rotate_server_certificates", "rotate-server-certificates", "serverTLSBootstrap",
           _bool, "get the serving certificate through a CertificateSigningRequest (signer "
           "kubernetes.io/kubelet-serving; someone must approve it) and renew it before it "
           "expires"),
    Option("client_ca_file", "client-ca-file", "clientCAFile", _opt_str,
           "CA bundle that client certificates of kubelet API callers must chain to"),
    Option("anonymous_auth", "anonymous-auth", "anonymousAuth", _bool,
           "let requests without credentials through as system:anonymous (still "
           "authorized through SubjectAccessReview; default false: 401)"),
    Option("connection_idle_timeout", "connection-idle-timeout", "connectionIdleTimeout",
           _period, "a kubelet API connection is closed when it has not finished its TLS "
           "handshake, or sent a whole request head, this long after connecting or after "
           "its last response (90s, the kubelet's idle timeout)"),
    Option("streaming_connection_idle_timeout", "streaming-connection-idle-timeout",
           "streamingConnectionIdleTimeout", _period,
           "an exec, attach or port-forward connection that carries no byte either way "
           "this long is closed (4h)"),
    Option("container_log_max_size", "container-log-max-size", "containerLogMaxSize",
           _log_size, "a container's log file is rotated once it is this big (10Mi)"),
    Option("container_log_max_files", "container-log-max-files", "containerLogMaxFiles",
           _int(2, 1000), "log files kept per container, the current one included (5)"),
    Option("cluster_dns", "cluster-dns", "clusterDNS", _ips,
           "DNS server IPs of the cluster, for pods with dnsPolicy ClusterFirst (none: "
           "such pods fall back to the node's resolver, with a MissingClusterDNS Event)"),
    Option("cluster_domain", "cluster-domain", "clusterDomain", _domain,
           "the cluster's DNS domain (e.g. cluster.local): pods' search list and FQDN"),
    Option("resolv_conf", "resolv-conf", "resolvConf", _str,
           "resolver file pods with dnsPolicy Default use, and whose search list "
           "ClusterFirst pods extend (/etc/resolv.conf; empty: none)"),
    Option("allowed_unsafe_sysctls", "allowed-unsafe-sysctls", "allowedUnsafeSysctls",
           _sysctls, "namespaced sysctls pods may set besides the safe ones, names or "
                     "prefixes ending in '*' (e.g. kernel.msg*,net.core.somaxconn)"),
    Option("serialize_image_pulls", "serialize-image-pulls", "serializeImagePulls", _bool,
           "pull one image at a time (default true)"),
    Option("max_parallel_image_pulls", "max-parallel-image-pulls", "maxParallelImagePulls",
           _int(1, 1000), "with --serialize-image-pulls=false: at most this many pulls at "
           "once (default: no limit)"),
    Option("cgroup_root", "cgroup-root", "cgroupRoot", _cgroup_root,
           "the cgroup pods' cgroups go under (kubepods is made in it); it must exist "
           "(default /)"),
    Option("cgroups_per_qos", "cgroups-per-qos", "cgroupsPerQOS", _bool,
           "make the kubepods, QoS and pod cgroups (default true; false needs "
           "--enforce-node-allocatable=none)"),
    Option("cgroup_driver", "cgroup-driver", "cgroupDriver", _choice("cgroupfs", "systemd"),
           "how cgroups are named and made: cgroupfs (default) or systemd (slices); the "
           "container runtime must use the same"),
    Option("enforce_node_allocatable", "enforce-node-allocatable", "enforceNodeAllocatable",
           _enforcements, "pods (default): kubepods is limited to the node's allocatable "
           "resources; none: to its capacity"),
    Option("pod_pids_limit", "pod-max-pids", "podPidsLimit", _int(-1, 2**31 - 1),
           "process ids a pod may use (-1, the default: no limit of its own)"),
    Option("qos_reserved", "qos-reserved", "qosReserved", _qos_reserved,
           "memory=N%: the Burstable and BestEffort cgroups may not use N% of the memory "
           "requested by the classes above them"),
    Option("evented_pleg_relist_period", "evented-pleg-relist-period",
           "eventedPlegRelistPeriod", _period,
           "while the runtime streams container events, the PLEG relists this often, as "
           "the check for events lost (default 60s; at 1s when there is no stream)"),
    # the kubelet's settings that have a meaning here (docs/kubelet-dropin.md)
    Option("bootstrap_kubeconfig", "bootstrap-kubeconfig", None, _opt_str,
           "kubeconfig with bootstrap credentials (a bootstrap token): when --kubeconfig "
           "is missing or its client certificate expired, the agent asks for a node "
           "client certificate with it (a CSR) and writes --kubeconfig"),
    Option("cert_dir", "cert-dir", None, _str,
           "folder of the client and serving certificates (<root-dir>/pki)"),
    Option("rotate_certificates", "rotate-certificates", "rotateCertificates", _bool,
           "renew the node's client certificate through a CSR before it expires"),
    Option("hostname_override", "hostname-override", None, _str,
           "the kubelet's name for --node-name"),
    Option("cloud_provider", "cloud-provider", None, _choice("", "external"),
           "'external': the Node is registered with the "
           "node.cloudprovider.kubernetes.io/uninitialized taint, for the cloud "
           "controller manager to remove"),
    Option("provider_id", "provider-id", "providerID", _str,
           "the Node's spec.providerID"),
    Option("sync_frequency", "sync-frequency", "syncFrequency", _period,
           "each pod is synced at least this often, 1-1.5x it (1m)"),
    Option("pod_logs_dir", "pod-logs-dir", "podLogsDir", _str,
           "where containers' logs are written (<root-dir>/logs/pods; the kubelet's "
           "is /var/log/pods)"),
    Option("kube_reserved", "kube-reserved", "kubeReserved", _reserved,
           "more resources held back from allocatable, for Kubernetes' own programs, "
           "added to --system-reserved, e.g. cpu=100m,memory=256Mi,pid=1000"),
    Option("merge_default_eviction_settings", None, "mergeDefaultEvictionSettings", _bool,
           "the default thresholds of signals evictionHard does not name are kept"),
    Option("fail_swap_on", "fail-swap-on", "failSwapOn", _bool,
           "refuse to start while swap is on (false; a KubeletConfiguration's default: "
           "true)"),
    Option("fail_cgroup_v1", "fail-cgroupv1", "failCgroupV1", _bool,
           "refuse to start on a cgroup v1 host (false; a KubeletConfiguration's "
           "default: true)"),
    Option("healthz_port", "healthz-port", "healthzPort", _int(0, 65535),
           "port of /healthz when --healthz-bind-address names only an IP (10248; 0: "
           "not served)"),
    Option("authentication_token_webhook", "authentication-token-webhook",
           "authenticationTokenWebhook", _bool,
           "kubelet API: bearer tokens are checked with a TokenReview (true)"),
    Option("authentication_token_webhook_cache_ttl", "authentication-token-webhook-cache-ttl",
           "authenticationTokenWebhookCacheTTL", _ttl,
           "kubelet API: how long a TokenReview's answer is kept (2m)"),
    Option("authorization_mode", "authorization-mode", "authorizationMode",
           _choice("Webhook", "AlwaysAllow"),
           "kubelet API: Webhook (a SubjectAccessReview per request) or AlwaysAllow"),
    Option("authorization_webhook_cache_authorized_ttl",
           "authorization-webhook-cache-authorized-ttl",
           "authorizationWebhookCacheAuthorizedTTL", _ttl,
           "kubelet API: how long an allowed SubjectAccessReview is kept (5m)"),
    Option("authorization_webhook_cache_unauthorized_ttl",
           "authorization-webhook-cache-unauthorized-ttl",
           "authorizationWebhookCacheUnauthorizedTTL", _ttl,
           "kubelet API: how long a refused SubjectAccessReview is kept (30s)"),
    Option("tls_min_version", "tls-min-version", "tlsMinVersion", _tls_version,
           "kubelet API: least TLS version, VersionTLS12 or VersionTLS13"),
    Option("enable_debugging_handlers", "enable-debugging-handlers",
           "enableDebuggingHandlers", _bool,
           "kubelet API: serve containerLogs, exec, attach and portForward (true)"),
    Option("image_service_endpoint", "image-service-endpoint", "imageServiceEndpoint",
           _opt_str, "must be unset or --container-runtime-endpoint: images are pulled "
                     "through the runtime's endpoint"),
    Option("shutdown_grace_period", None, "shutdownGracePeriod", _shutdown_period,
           "graceful node shutdown: how long the host's shutdown waits for the pods, "
           "regular pods first (0: no graceful shutdown)"),
    Option("shutdown_grace_period_critical_pods", None, "shutdownGracePeriodCriticalPods",
           _shutdown_period, "the part of shutdownGracePeriod kept for critical pods, "
           "stopped last"),
    Option("shutdown_grace_period_by_pod_priority", None, "shutdownGracePeriodByPodPriority",
           _priority_periods, "graceful node shutdown by pod priority: a list of "
           "{priority, shutdownGracePeriodSeconds}, stopped from the lowest priority"),
    Option("logind_conf_dir", "logind-conf-dir", "logindConfDir", _str,
           "where the drop-in that raises logind's InhibitDelayMaxSec for graceful node "
           "shutdown is written (/etc/systemd/logind.conf.d)"),
    Option("log_verbosity", "v", None, _int(0, 10),
           "the kubelet's log verbosity: 4 or more logs at debug (unless --log-level)"),
)
_IGNORED_KEYS = {"apiVersion", "kind"}  # a header the agent's own file may carry


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=argparse.SUPPRESS,
                        help="YAML config file: the agent's own camelCase keys, or a "
                             "kubelet.config.k8s.io/v1beta1 KubeletConfiguration")
    parser.add_argument("--config-dir", dest="config-dir", default=argparse.SUPPRESS,
                        help="folder of KubeletConfiguration drop-ins (*.conf), applied "
                             "over --config in name order, as the kubelet's")
    for opt in OPTIONS:
        if opt.flag:
            # a boolean flag alone means true; --flag=false turns it off
            extra: dict[str, Any] = {"nargs": "?", "const": "true"} if opt.parse is _bool \
                else {}
            names = ["-v", "--v"] if opt.flag == "v" else [f"--{opt.flag}"]
            parser.add_argument(*names, dest=opt.flag, default=argparse.SUPPRESS,
                                help=opt.help.replace("%", "%%"), **extra)
    # the kubelet's flags for fields the agent does not do, and its other flags the
    # agent does not do: taken, so the kubelet's command line starts the agent, and
    # logged or refused by name (nodeagent/kubeletconfig.py)
    for path, field in kubeletconfig.FIELDS.items():
        if field.flag:
            bool_flag = field.kind in ("bool", "*bool")
            parser.add_argument(f"--{field.flag}", dest=field.flag,
                                default=argparse.SUPPRESS,
                                nargs="?" if bool_flag else None,
                                const="true" if bool_flag else None,
                                help=f"the kubelet's flag for {path}: {_what(field)}")
    for flag, (action, why) in kubeletconfig.FLAGS.items():
        if action != "honoured":
            parser.add_argument(f"--{flag}", dest=flag, default=argparse.SUPPRESS,
                                help=f"the kubelet's flag; {action}: {why}")


def _what(field: kubeletconfig.Field) -> str:
    a = field.action
    if isinstance(a, kubeletconfig.Refused):
        return f"refused unless {' or '.join(map(str, a.allowed))} ({a.why})"
    if isinstance(a, kubeletconfig.Ignored):
        return f"not supported, logged when set ({a.why})".replace("%", "%%")
    return f"as --config's {a.key}"


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.upper().replace("-", "_")


def load(flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> AgentConfig:
    """Settings from parsed flags (dest = flag name, only those given), the environment
    and the config file they name."""
    return load_with_notes(flags, env)[0]


def load_with_notes(flags: Mapping[str, Any], env: Mapping[str, str] | None = None
                    ) -> tuple[AgentConfig, list[str]]:
    """The settings, and what was asked for that the agent does not do (the kubelet's
    fields and flags it ignores), one line each naming it: to be logged once."""
    env = os.environ if env is None else env
    config_path = flags.get("config") or env.get(env_name("config"))
    file: dict[str, Any] = {}
    kubelet_doc: dict[str, Any] | None = None
    if config_path:
        file = read_file(Path(config_path))
        if kubeletconfig.is_kubelet_configuration(file):
            kubelet_doc, file = file, {}
    config_dir = flags.get("config-dir")
    if config_dir:
        kubelet_doc = merge_drop_ins(kubelet_doc, Path(config_dir), config_path)
    field_flags: dict[str, Any] = {}
    try:
        for path, field in kubeletconfig.FIELDS.items():
            if field.flag and field.flag in flags:
                field_flags[path] = kubeletconfig.read_flag(path, str(flags[field.flag]))
        translated = kubeletconfig.translate(kubelet_doc or {}, str(config_path),
                                             field_flags)
    except kubeletconfig.FieldError as e:
        raise ConfigError(str(e)) from None
    notes = translated.notes + [
        f"--{flag}: not supported, ignored: {why}"
        for flag, (action, why) in kubeletconfig.FLAGS.items()
        if action == "ignored" and flag in flags]
    by_flag = {k: v for k, v in translated.values.items() if v[1].startswith("--")}
    by_file = {k: v for k, v in translated.values.items() if not v[1].startswith("--")}
    if kubelet_doc is not None:
        _kubelet_defaults(kubelet_doc, by_file, str(config_path))
    values: dict[str, Any] = {}
    heartbeat: dict[str, Any] = {}
    where_of: dict[str, str] = {}
    for opt in OPTIONS:
        raw, where = _pick(opt, flags, env, file, config_path, by_flag, by_file)
        if where is None:
            continue
        value = opt.parse(raw, where)
        if opt.field.startswith("heartbeat."):
            name = opt.field.split(".", 1)[1]
            heartbeat[name] = value
            where_of[name] = where
        else:
            values[opt.field] = value
    try:
        values["heartbeat"] = parse_heartbeat(heartbeat, "heartbeat")
    except PolicyError as e:
        msg = str(e)
        for name, where in where_of.items():
            msg = msg.replace(f"heartbeat.{name}", where)
        raise ConfigError(msg.replace("heartbeat.", "setting ")) from None
    if "eviction_hard" not in values:
        values["eviction_hard"] = parse_thresholds(DEFAULT_HARD)
    elif values.pop("merge_default_eviction_settings", False):
        values["eviction_hard"] = {**parse_thresholds(DEFAULT_HARD), **values["eviction_hard"]}
    values.pop("merge_default_eviction_settings", None)
    _check_eviction(values)
    _kubelet_settings(values, notes)
    count = values.pop("virtual_nodes", 0)
    prefix = values.pop("node_name_prefix", None)
    if isinstance(count, tuple):
        values["virtual_node_names"] = count
    elif count:
        base = prefix or values.get("agent_id") or values.get("node_name") \
            or socket.gethostname().lower()
        where = "--node-name-prefix" if prefix else "the node name prefix"
        # "vn" -> vn-0, vn-1; "pod-" (the Helm chart's $(POD_NAME)-) -> pod-0, pod-1
        sep = "" if base.endswith(("-", ".")) else "-"
        _node_name(f"{base}{sep}{count - 1}", where)
        values["virtual_node_names"] = tuple(f"{base}{sep}{i}" for i in range(count))
    elif prefix is not None:
        raise ConfigError("--node-name-prefix: only used with --virtual-nodes N")
    node_name = values.get("node_name") or socket.gethostname().lower()
    values["node_name"] = node_name
    if values.get("virtual_node_names"):
        _check_virtual(values)
        values["node_name"] = values["virtual_node_names"][0]
        values.setdefault("agent_id", (prefix or node_name).rstrip("-."))
    values.setdefault("agent_id", node_name)
    if not _LABEL_VALUE.match(values["agent_id"]) or not values["agent_id"]:
        raise ConfigError(f"agent id {values['agent_id']!r} is not a valid label value "
                          "(set --agent-id)")
    values["config_file"] = Path(config_path) if config_path else None
    values.setdefault("port", 10250)
    if not values.pop("enable_server", True):
        values["port"] = None
    _check_serving(values)
    if not values.get("cgroups_per_qos", True) and "pods" in values.get(
            "enforce_node_allocatable", ("pods",)):
        raise ConfigError("--cgroups-per-qos=false: kubepods, which "
                          "--enforce-node-allocatable=pods limits, is then not made; set "
                          "--enforce-node-allocatable=none too")
    _check_shutdown(values)
    if values.get("serialize_image_pulls", True) and values.get("max_parallel_image_pulls",
                                                                 1) > 1:
        raise ConfigError(f"--max-parallel-image-pulls "
                          f"({values['max_parallel_image_pulls']}) must be 1 or unset while "
                          "--serialize-image-pulls is true; set --serialize-image-pulls=false")
    return AgentConfig(**values), notes


def _kubelet_defaults(doc: Mapping[str, Any], by_file: dict[str, tuple[Any, str]],
                      where: str) -> None:
    """The kubelet's defaults where they differ from the agent's, for a
    KubeletConfiguration: it refuses swap and cgroup v1 unless told not to; its report
    period follows a given update period; a parallel pull limit of 2 or more turns
    serialized pulls off."""
    for key in ("failSwapOn", "failCgroupV1"):
        by_file.setdefault(key, (True, f"{where}: {key} (the kubelet's default)"))
    if "nodeStatusUpdateFrequency" in by_file and "nodeStatusReportFrequency" not in by_file:
        value, _ = by_file["nodeStatusUpdateFrequency"]
        by_file["nodeStatusReportFrequency"] = (
            value, f"{where}: nodeStatusReportFrequency (the kubelet's default: "
                   "nodeStatusUpdateFrequency)")
    parallel = doc.get("maxParallelImagePulls")
    if "serializeImagePulls" not in by_file and isinstance(parallel, int) and parallel >= 2:
        by_file["serializeImagePulls"] = (False, f"{where}: serializeImagePulls (the "
                                                 "kubelet's default with "
                                                 "maxParallelImagePulls)")


def _kubelet_settings(values: dict[str, Any], notes: list[str]) -> None:
    """The kubelet's settings that fold into the agent's: its name for the node,
    kubeReserved, pids held back, 'external' cloud provider, its log verbosity."""
    override = values.pop("hostname_override", None)
    if override is not None:
        override = override.strip().lower()
        _node_name(override, "--hostname-override")
        if values.get("node_name") and values["node_name"] != override:
            raise ConfigError(f"--hostname-override {override!r} and --node-name "
                              f"{values['node_name']!r} differ: give one of them")
        values["node_name"] = override
    reserved = dict(values.get("system_reserved", {}))
    for resource, amount in values.pop("kube_reserved", {}).items():
        reserved[resource] = reserved.get(resource, 0.0) + amount
    if reserved or "system_reserved" in values:
        values["system_reserved"] = reserved
    if values.pop("cloud_provider", "") == "external":
        taints = list(values.get("register_with_taints", ()))
        if not any(t["key"] == kubeletconfig.CLOUD_TAINT["key"] for t in taints):
            taints.append(dict(kubeletconfig.CLOUD_TAINT))
        values["register_with_taints"] = tuple(taints)
    verbosity = values.pop("log_verbosity", None)
    if verbosity is not None and "log_level" not in values:
        values["log_level"] = "debug" if verbosity >= 4 else "info"
    healthz_port = values.pop("healthz_port", None)
    bind = values.get("healthz_bind_address", ("127.0.0.1", HEALTHZ_PORT))
    if healthz_port is not None and bind is not None:
        values["healthz_bind_address"] = None if healthz_port == 0 else (bind[0],
                                                                          healthz_port)
    image = values.pop("image_service_endpoint", None)
    runtime = values.get("container_runtime_endpoint")
    if image and socket_path(image) != socket_path(runtime):
        raise ConfigError(f"imageServiceEndpoint (--image-service-endpoint) {image!r} "
                          f"differs from the container runtime's endpoint "
                          f"{socket_path(runtime)!r}: images are pulled through the "
                          "runtime's endpoint; leave it unset")
    values["node_ips"] = tuple(ip for ip in values.get("node_ips", ())
                               if ip not in ("0.0.0.0", "::"))  # the kubelet's: detect
    values.setdefault("cert_dir", str(Path(values.get("root_dir") or
                                           AgentConfig.root_dir) / "pki"))


def _check_eviction(values: Mapping[str, Any]) -> None:
    try:
        combine(values["eviction_hard"], values.get("eviction_soft", {}),
                values.get("eviction_soft_grace_period", {}),
                values.get("eviction_minimum_reclaim", {}))
    except ThresholdError as e:
        raise ConfigError(str(e)) from None
    high = values.get("image_gc_high_threshold", 85)
    low = values.get("image_gc_low_threshold", 80)
    if low >= high:
        raise ConfigError(f"--image-gc-low-threshold ({low}) must be less than "
                          f"--image-gc-high-threshold ({high})")


def _check_serving(values: Mapping[str, Any]) -> None:
    cert, key = values.get("tls_cert_file"), values.get("tls_private_key_file")
    if bool(cert) != bool(key):
        given, missing = (("--tls-cert-file", "--tls-private-key-file") if cert
                          else ("--tls-private-key-file", "--tls-cert-file"))
        raise ConfigError(f"{given} is set but {missing} is not: both or neither")
    if cert and values.get("rotate_server_certificates"):
        raise ConfigError("--rotate-server-certificates: cannot be used with "
                          "--tls-cert-file (choose where the certificate comes from)")
    if values.get("rotate_server_certificates") and values.get("virtual_node_names"):
        raise ConfigError("--rotate-server-certificates: not supported with "
                          "--virtual-nodes (a kubelet-serving certificate names one node); "
                          "use --tls-cert-file")


def _check_shutdown(values: Mapping[str, Any]) -> None:
    """The kubelet's rules for the graceful shutdown settings; none for virtual nodes."""
    grace = values.get("shutdown_grace_period", 0.0)
    critical = values.get("shutdown_grace_period_critical_pods", 0.0)
    by_priority = values.get("shutdown_grace_period_by_pod_priority", ())
    if by_priority and (grace or critical):
        raise ConfigError("shutdownGracePeriodByPodPriority and shutdownGracePeriod"
                          "(CriticalPods) cannot both be given: give the budgets of every "
                          "priority in shutdownGracePeriodByPodPriority")
    if critical > grace:
        raise ConfigError(f"shutdownGracePeriodCriticalPods ({critical:g}s) must not be "
                          f"more than shutdownGracePeriod ({grace:g}s), which includes it")
    if values.get("virtual_node_names") and (grace or by_priority):
        which = "shutdownGracePeriod" if grace else "shutdownGracePeriodByPodPriority"
        raise ConfigError(f"{which}: not supported with --virtual-nodes: virtual nodes "
                          "have no host whose shutdown could wait for their pods (no "
                          "logind); leave it unset")


def _check_virtual(values: Mapping[str, Any]) -> None:
    """What one process cannot do for many Nodes is refused at start, by name."""
    if values.get("pod_manifest_path") or values.get("manifest_url"):
        which = "--pod-manifest-path" if values.get("pod_manifest_path") else "--manifest-url"
        raise ConfigError(f"{which}: static pods are not supported with --virtual-nodes "
                          "(a static pod is named and bound per node); remove one of them")
    if values.get("bootstrap_kubeconfig"):
        raise ConfigError("--bootstrap-kubeconfig: not supported with --virtual-nodes (a "
                          "node client certificate names one Node); give --kubeconfig "
                          "with the Helm chart's agent identity")
    if values.get("runtime") == "cri":
        raise ConfigError("--runtime cri: not supported with --virtual-nodes: every "
                          "virtual Node would advertise this host's capacity while all "
                          "their pods share one containerd and one pod network; use "
                          "--runtime fake or process")


def _pick(opt: Option, flags: Mapping[str, Any], env: Mapping[str, str],
          file: Mapping[str, Any], config_path: str | None,
          by_flag: Mapping[str, tuple[Any, str]],
          by_file: Mapping[str, tuple[Any, str]]) -> tuple[Any, str | None]:
    """The value of one setting and where it came from: a flag (the agent's, then the
    kubelet's for the field), the environment, the file (the agent's keys or a
    KubeletConfiguration's fields)."""
    if opt.flag and opt.flag in flags:
        return flags[opt.flag], f"--{opt.flag}"
    if opt.key and opt.key in by_flag:
        return by_flag[opt.key]
    if opt.flag and env_name(opt.flag) in env:
        return env[env_name(opt.flag)], f"${env_name(opt.flag)}"
    if opt.key and opt.key in file:
        return file[opt.key], f"{config_path}: {opt.key}"
    if opt.key and opt.key in by_file:
        return by_file[opt.key]
    return None, None


def read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {e.start})") from None
    data = _yaml(text, f"--config {path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: must be a mapping of settings")
    if kubeletconfig.is_kubelet_configuration(data):
        return data  # its fields: nodeagent/kubeletconfig.py
    known = {o.key for o in OPTIONS if o.key} | _IGNORED_KEYS
    unknown = sorted(map(str, set(data) - known))
    if unknown:
        raise ConfigError(f"--config {path}: unknown key(s) {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(known - _IGNORED_KEYS))})")
    return data


def merge_drop_ins(doc: dict[str, Any] | None, folder: Path,
                   config_path: str | None) -> dict[str, Any]:
    """The KubeletConfiguration drop-ins of --config-dir (*.conf, in name order) over
    --config's, as the kubelet merges them: a mapping field by field, anything else
    replaced."""
    if config_path and doc is None:
        raise ConfigError(f"--config-dir: --config {config_path} is not a "
                          "KubeletConfiguration; drop-ins go over one")
    merged: dict[str, Any] = dict(doc or {})
    try:
        names = sorted(p for p in folder.iterdir() if p.suffix == ".conf")
    except OSError as e:
        raise ConfigError(f"--config-dir {folder}: {e.strerror or e}") from None
    for path in names:
        data = read_file(path)
        if data and not kubeletconfig.is_kubelet_configuration(data):
            raise ConfigError(f"--config-dir: {path} is not a {kubeletconfig.API_VERSION} "
                              f"{kubeletconfig.KIND}")
        merged = _merged(merged, data)
    return merged


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, Mapping) and isinstance(
            out.get(k), Mapping) else v
    return out


def kubelet_table() -> str:
    """The table of docs/kubelet-dropin.md: what the agent does with each of the
    kubelet's fields and flags."""
    return kubeletconfig.table_markdown({o.key: o.flag for o in OPTIONS if o.key and o.flag})


def parse_args(argv: Sequence[str] | None, parser: argparse.ArgumentParser,
               env: Mapping[str, str] | None = None) -> AgentConfig:
    ns = parser.parse_args(argv)
    return load(vars(ns), env)
