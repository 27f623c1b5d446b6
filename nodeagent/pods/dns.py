"""A pod's names and resolver, as the kubelet gives them: its hostname and domain, the
DNS configuration of its sandbox (`dnsPolicy`, `dnsConfig`, the agent's `--cluster-dns`,
`--cluster-domain` and `--resolv-conf`) and the content of the /etc/hosts the agent
writes for it (pod IP, hostname and FQDN, `hostAliases`).

Pure functions of the pod and the settings, apart from reading the resolv.conf and the
node's /etc/hosts; the syncer writes the hosts file and hands the rest to the runtime.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.runtime.base import DnsConfig, truncate_hostname

MAX_NAMESERVERS = 3
MAX_SEARCHES = 32
MAX_SEARCH_CHARS = 2048
MAX_DOMAIN = 253
DEFAULT_OPTIONS = ("ndots:5",)
FQDN_MAX = 64  # a kernel nodename holds 64 characters
NODE_HOSTS = "/etc/hosts"

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class PodDnsError(ValueError):
    """The pod's names or DNS settings cannot be built (the message names the field)."""


@dataclass(frozen=True)
class DnsSettings:
    cluster_dns: tuple[str, ...] = ()   # --cluster-dns
    cluster_domain: str = ""           # --cluster-domain
    resolv_conf: str = "/etc/resolv.conf"  # --resolv-conf ("": none)
    node_hosts: str = NODE_HOSTS        # the node's own hosts file (hostNetwork pods)


@dataclass(frozen=True)
class PodDns:
    """What the sandbox gets: its kernel hostname, the resolver configuration (None:
    the node's resolv.conf as it is), and Warning Events to write about the pod
    (reason, message)."""
    hostname: str
    domain: str
    config: DnsConfig | None
    warnings: tuple[tuple[str, str], ...] = ()


def check_cluster_dns(values: Sequence[str], where: str) -> tuple[str, ...]:
    out = []
    for v in values:
        v = v.strip()
        if not v:
            continue
        try:
            out.append(str(ipaddress.ip_address(v)))
        except ValueError:
            raise ValueError(f"{where}: {v!r} is not an IP address") from None
    return tuple(out)


def hostname_and_domain(pod: Mapping[str, Any], cluster_domain: str) -> tuple[str, str]:
    """The pod's hostname (spec.hostname, else its name, cut to 63 characters) and its
    domain (<subdomain>.<namespace>.svc.<cluster domain> with spec.subdomain, else "")."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    override = spec.get("hostnameOverride")
    if override:
        if len(override) > MAX_DOMAIN or not _SUBDOMAIN.match(override):
            raise PodDnsError(f"spec.hostnameOverride: {override!r} is not a valid DNS "
                              "subdomain")
        return truncate_hostname(str(override)), ""
    hostname = str(meta.get("name") or "")
    if spec.get("hostname"):
        if not _LABEL.match(spec["hostname"]) or len(spec["hostname"]) > 63:
            raise PodDnsError(f"spec.hostname: {spec['hostname']!r} is not a valid DNS label")
        hostname = str(spec["hostname"])
    hostname = truncate_hostname(hostname)
    domain = ""
    if spec.get("subdomain"):
        sub = str(spec["subdomain"])
        if not _LABEL.match(sub) or len(sub) > 63:
            raise PodDnsError(f"spec.subdomain: {sub!r} is not a valid DNS label")
        domain = f"{sub}.{meta.get('namespace') or 'default'}.svc.{cluster_domain}"
    return hostname, domain


def kernel_hostname(pod: Mapping[str, Any], hostname: str, domain: str) -> str:
    """The name the sandbox's kernel gets: the FQDN with setHostnameAsFQDN."""
    if domain and (pod.get("spec") or {}).get("setHostnameAsFQDN"):
        fqdn = f"{hostname}.{domain}"
        if len(fqdn) > FQDN_MAX:
            raise PodDnsError(f"spec.setHostnameAsFQDN: the FQDN {fqdn} is too long "
                              f"({FQDN_MAX} characters is the max, {len(fqdn)} requested)")
        return fqdn
    return hostname


def parse_resolv_conf(text: str) -> tuple[list[str], list[str], list[str]]:
    """(nameservers, searches, options) of a resolv.conf; the last search line wins."""
    servers: list[str] = []
    searches: list[str] = []
    options: list[str] = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].startswith(("#", ";")):
            continue
        if fields[0] == "nameserver" and len(fields) > 1:
            servers.append(fields[1])
        elif fields[0] == "search":
            searches = [s.rstrip(".") for s in fields[1:] if s != "."]
        elif fields[0] == "options":
            options = _merge_options(options, fields[1:])
    return servers, searches, options


def _merge_options(options: Sequence[str], more: Sequence[str]) -> list[str]:
    """Options by name, a later one replacing an earlier one of the same name."""
    by_name: dict[str, str] = {}
    for o in [*options, *more]:
        by_name[o.split(":", 1)[0]] = o
    return list(by_name.values())


def _unique(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _policy(pod: Mapping[str, Any]) -> str:
    spec = pod.get("spec") or {}
    policy = spec.get("dnsPolicy") or "ClusterFirst"
    if policy == "ClusterFirst" and spec.get("hostNetwork"):
        return "Default"  # a host-network pod resolves as its node does
    if policy == "ClusterFirstWithHostNet":
        return "ClusterFirst"
    if policy not in ("ClusterFirst", "Default", "None"):
        raise PodDnsError(f"spec.dnsPolicy: {policy!r} is not ClusterFirst, "
                          "ClusterFirstWithHostNet, Default or None")
    return str(policy)


def pod_dns(pod: Mapping[str, Any], settings: DnsSettings) -> PodDns:
    """The sandbox's names and resolver configuration. Raises PodDnsError naming the
    field when they cannot be built."""
    spec = pod.get("spec") or {}
    hostname, domain = hostname_and_domain(pod, settings.cluster_domain)
    kernel = kernel_hostname(pod, hostname, domain)
    policy = _policy(pod)
    dns_config = spec.get("dnsConfig") or {}
    warnings: list[tuple[str, str]] = []
    if policy == "ClusterFirst" and not settings.cluster_dns:
        meta = pod.get("metadata") or {}
        warnings.append(("MissingClusterDNS", (
            f'pod: "{meta.get("name")}_{meta.get("namespace")}({meta.get("uid")})". '
            "this node agent has no cluster DNS IP configured (--cluster-dns) and cannot "
            'create Pod using "ClusterFirst" policy. Falling back to "Default" policy.')))
        policy = "Default"
    if policy == "Default" and not dns_config and settings.resolv_conf == "/etc/resolv.conf":
        return PodDns(kernel, domain, None, tuple(warnings))  # the node's file as it is
    servers: list[str] = []
    searches: list[str] = []
    options: list[str] = []
    if policy in ("ClusterFirst", "Default") and settings.resolv_conf:
        try:
            text = Path(settings.resolv_conf).read_text()
        except OSError as e:
            raise PodDnsError(f"--resolv-conf {settings.resolv_conf}: {e.strerror}") from None
        servers, searches, options = parse_resolv_conf(text)
    if policy == "ClusterFirst":
        servers = list(settings.cluster_dns)
        if settings.cluster_domain:
            d = settings.cluster_domain
            namespace = (pod.get("metadata") or {}).get("namespace") or "default"
            searches = _unique([f"{namespace}.svc.{d}", f"svc.{d}", d, *searches])
        options = list(DEFAULT_OPTIONS)
    elif policy == "Default" and not settings.resolv_conf:
        servers, searches = ["127.0.0.1"], ["."]  # no resolver file: the local one
    elif policy == "None":
        servers, searches, options = [], [], []
    if dns_config:
        servers = _unique([*servers, *(str(s) for s in dns_config.get("nameservers") or [])])
        searches = _unique([*searches, *(str(s) for s in dns_config.get("searches") or [])])
        options = _merge_options(options, [
            str(o.get("name")) + ("" if o.get("value") is None else f":{o['value']}")
            for o in dns_config.get("options") or []])
    if len(servers) > MAX_NAMESERVERS:
        servers = servers[:MAX_NAMESERVERS]
        warnings.append(("DNSConfigForming", "Nameserver limits were exceeded, some "
                         "nameservers have been omitted, the applied nameserver line is: "
                         + " ".join(servers)))
    searches, cut = _fit_searches(searches)
    if cut:
        warnings.append(("DNSConfigForming", "Search Line limits were exceeded, some search "
                         "paths have been omitted, the applied search line is: "
                         + " ".join(searches)))
    return PodDns(kernel, domain, DnsConfig(tuple(servers), tuple(searches), tuple(options)),
                  tuple(warnings))


def _fit_searches(searches: list[str]) -> tuple[list[str], bool]:
    cut = len(searches) > MAX_SEARCHES
    out = [s for s in searches[:MAX_SEARCHES] if len(s) <= MAX_DOMAIN]
    cut = cut or len(out) < min(len(searches), MAX_SEARCHES)
    while out and len(" ".join(out)) > MAX_SEARCH_CHARS:
        out.pop()
        cut = True
    return out, cut


# --- the managed /etc/hosts -----------------------------------------------------------

HOSTS_HEADER = "# Kubernetes-managed hosts file.\n"
HOSTS_HEADER_HOST_NETWORK = "# Kubernetes-managed hosts file (host network).\n"


def _aliases(pod: Mapping[str, Any]) -> str:
    aliases = (pod.get("spec") or {}).get("hostAliases") or []
    if not aliases:
        return ""
    lines = "".join(f"{a.get('ip')}\t" + "\t".join(str(h) for h in a.get("hostnames") or [])
                    + "\n" for a in aliases)
    return "\n# Entries added by HostAliases.\n" + lines


def hosts_file(pod: Mapping[str, Any], pod_ips: Sequence[str], hostname: str, domain: str,
               node_hosts: str = NODE_HOSTS) -> str:
    """The /etc/hosts of the pod's containers: for a pod of its own network, localhost,
    the pod's IPs with its FQDN and hostname, then hostAliases; for a host-network pod,
    the node's own file, then hostAliases."""
    if (pod.get("spec") or {}).get("hostNetwork"):
        try:
            node = Path(node_hosts).read_text()
        except OSError as e:
            raise PodDnsError(f"the node's hosts file {node_hosts}: {e.strerror}") from None
        return HOSTS_HEADER_HOST_NETWORK + node + _aliases(pod)
    lines = [HOSTS_HEADER, "127.0.0.1\tlocalhost\n",
             "::1\tlocalhost ip6-localhost ip6-loopback\n", "fe00::0\tip6-localnet\n",
             "fe00::0\tip6-mcastprefix\n", "fe00::1\tip6-allnodes\n",
             "fe00::2\tip6-allrouters\n"]
    for ip in pod_ips:
        lines.append(f"{ip}\t{hostname}.{domain}\t{hostname}\n" if domain
                     else f"{ip}\t{hostname}\n")
    return "".join(lines) + _aliases(pod)
