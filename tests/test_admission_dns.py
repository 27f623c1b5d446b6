"""Node admission (the kubelet's reasons), pod names and resolver configuration, the
managed /etc/hosts, and the security settings resolved from a pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nodeagent.config import ConfigError
from nodeagent.pods.admission import AdmissionSettings, admit, check_unsafe_sysctls
from nodeagent.pods.dns import DnsSettings, PodDnsError, hosts_file, parse_resolv_conf, pod_dns
from nodeagent.runtime.base import ContainerConfig, SandboxConfig, truncate_hostname
from nodeagent.runtime.security import LOCALHOST, RUNTIME_DEFAULT, UNCONFINED, Profile
from tests.conftest import agent_config, mkpod

SETTINGS = AdmissionSettings(kernel=(6, 1), apparmor=False)


def test_ordinary_pod_is_admitted() -> None:
    assert admit(mkpod("p"), SETTINGS) is None


def test_os_field_and_label() -> None:
    r = admit(mkpod("p", os={"name": "windows"}), SETTINGS)
    assert r is not None and r.reason == "PodOSNotSupported"
    assert r.message == "Failed to admit pod as the OS field doesn't match node OS"
    assert admit(mkpod("p", os={"name": "linux"}), SETTINGS) is None
    r = admit(mkpod("p", labels={"kubernetes.io/os": "windows"}), SETTINGS)
    assert r is not None and r.reason == "PodOSSelectorNodeLabelDoesNotMatch"


def sysctl_pod(name: str, **spec: Any) -> dict[str, Any]:
    return mkpod("p", securityContext={"sysctls": [{"name": name, "value": "1"}]}, **spec)


def test_sysctls_safe_unsafe_allowed_and_host_namespaces() -> None:
    assert admit(sysctl_pod("kernel.shm_rmid_forced"), SETTINGS) is None
    assert admit(sysctl_pod("net/ipv4/ip_local_port_range"), SETTINGS) is None  # slashes
    r = admit(sysctl_pod("kernel.msgmax"), SETTINGS)
    assert r is not None and r.reason == "SysctlForbidden"
    assert r.message == 'forbidden sysctl: "kernel.msgmax" not allowlisted'
    allowed = AdmissionSettings(allowed_unsafe_sysctls=("kernel.msg*",), kernel=(6, 1),
                                apparmor=False)
    assert admit(sysctl_pod("kernel.msgmax"), allowed) is None
    r = admit(sysctl_pod("net.ipv4.tcp_syncookies", hostNetwork=True), SETTINGS)
    assert r is not None
    assert r.message == ('forbidden sysctl: "net.ipv4.tcp_syncookies" not allowed with '
                         "host Net enabled")
    old_kernel = AdmissionSettings(kernel=(4, 4), apparmor=False)
    assert admit(sysctl_pod("net.ipv4.tcp_keepalive_time"), old_kernel) is not None


def test_unsafe_sysctl_flag_is_checked() -> None:
    assert check_unsafe_sysctls(["kernel.msg*", "net/core/somaxconn"], "x") == (
        "kernel.msg*", "net.core.somaxconn")
    with pytest.raises(ValueError, match="not known to be namespaced"):
        check_unsafe_sysctls(["vm.swappiness"], "--allowed-unsafe-sysctls")


def test_unsafe_sysctl_flag_in_config(tmp_path: Path) -> None:
    cfg = agent_config(tmp_path, "--allowed-unsafe-sysctls", "kernel.msg*",
                       "--cluster-dns", "10.0.0.10", "--cluster-domain", "cluster.local")
    assert cfg.allowed_unsafe_sysctls == ("kernel.msg*",)
    assert cfg.cluster_dns == ("10.0.0.10",) and cfg.cluster_domain == "cluster.local"
    with pytest.raises(ConfigError, match="--allowed-unsafe-sysctls: 'kernel.panic'"):
        agent_config(tmp_path, "--allowed-unsafe-sysctls", "kernel.panic")
    with pytest.raises(ConfigError, match="--cluster-dns"):
        agent_config(tmp_path, "--cluster-dns", "dns.local")


def test_strict_groups_apparmor_pod_resources() -> None:
    r = admit(mkpod("p", securityContext={"supplementalGroupsPolicy": "Strict"}), SETTINGS)
    assert r is not None and r.reason == "SupplementalGroupsPolicyNotSupported"
    assert r.message == "SupplementalGroupsPolicy=Strict is not supported in this node"
    aa = mkpod("p", securityContext={"appArmorProfile": {"type": "RuntimeDefault"}})
    r = admit(aa, SETTINGS)
    assert r is not None and r.reason == "AppArmor"
    assert admit(aa, AdmissionSettings(kernel=(6, 1), apparmor=True)) is None
    unconfined = mkpod("p", securityContext={"appArmorProfile": {"type": "Unconfined"}})
    assert admit(unconfined, SETTINGS) is None
    r = admit(mkpod("p", resources={"limits": {"cpu": "1"}}), SETTINGS)
    assert r is not None and r.reason == "PodLevelResourcesNotSupported"


# --- names and resolver ----------------------------------------------------------------

def test_hostname_truncation() -> None:
    assert truncate_hostname("a" * 63) == "a" * 63
    assert truncate_hostname("a" * 62 + "-bcd") == "a" * 62
    assert truncate_hostname("a" * 61 + ".-x") == "a" * 61
    sc = SandboxConfig.from_pod(mkpod("x" * 70))
    assert sc.hostname == "x" * 63


def resolv(tmp_path: Path, text: str) -> str:
    f = tmp_path / "resolv.conf"
    f.write_text(text)
    return str(f)


def test_cluster_first(tmp_path: Path) -> None:
    conf = resolv(tmp_path, "nameserver 1.1.1.1\nsearch corp.example\noptions timeout:2\n")
    s = DnsSettings(cluster_dns=("10.0.0.10",), cluster_domain="cluster.local",
                    resolv_conf=conf)
    d = pod_dns(mkpod("p", ns="team"), s)
    assert d.config is not None
    assert d.config.servers == ("10.0.0.10",)
    assert d.config.searches == ("team.svc.cluster.local", "svc.cluster.local",
                                 "cluster.local", "corp.example")
    assert d.config.options == ("ndots:5",)
    assert d.hostname == "p" and d.warnings == ()


def test_cluster_first_without_cluster_dns_falls_back(tmp_path: Path) -> None:
    d = pod_dns(mkpod("p"), DnsSettings())
    assert d.config is None  # the node's own /etc/resolv.conf
    assert [r for r, _ in d.warnings] == ["MissingClusterDNS"]


def test_host_network_default_none_and_dns_config(tmp_path: Path) -> None:
    conf = resolv(tmp_path, "nameserver 1.1.1.1\nsearch a.example\n")
    s = DnsSettings(cluster_dns=("10.0.0.10",), cluster_domain="cluster.local",
                    resolv_conf=conf)
    host = pod_dns(mkpod("p", hostNetwork=True), s)  # ClusterFirst + hostNetwork: Default
    assert host.config is not None and host.config.servers == ("1.1.1.1",)
    with_net = pod_dns(mkpod("p", hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet"), s)
    assert with_net.config is not None and with_net.config.servers == ("10.0.0.10",)
    none = pod_dns(mkpod("p", dnsPolicy="None", dnsConfig={
        "nameservers": ["9.9.9.9"], "searches": ["x.example"],
        "options": [{"name": "ndots", "value": "1"}, {"name": "rotate"}]}), s)
    assert none.config is not None
    assert (none.config.servers, none.config.searches, none.config.options) == (
        ("9.9.9.9",), ("x.example",), ("ndots:1", "rotate"))
    merged = pod_dns(mkpod("p", dnsConfig={"nameservers": ["10.0.0.10", "8.8.8.8"],
                                           "options": [{"name": "ndots", "value": "2"}]}), s)
    assert merged.config is not None
    assert merged.config.servers == ("10.0.0.10", "8.8.8.8")  # duplicates dropped
    assert merged.config.options == ("ndots:2",)


def test_limits_are_applied_with_a_warning(tmp_path: Path) -> None:
    s = DnsSettings(cluster_dns=("10.0.0.10",), cluster_domain="c.local",
                    resolv_conf=resolv(tmp_path, ""))
    d = pod_dns(mkpod("p", dnsConfig={"nameservers": ["1.1.1.1", "2.2.2.2", "3.3.3.3"],
                                      "searches": [f"s{i}.example" for i in range(40)]}), s)
    assert d.config is not None
    assert len(d.config.servers) == 3 and len(d.config.searches) == 32
    assert [r for r, _ in d.warnings] == ["DNSConfigForming", "DNSConfigForming"]


def test_resolv_conf_parsing() -> None:
    servers, searches, options = parse_resolv_conf(
        "# c\nnameserver 1.1.1.1\nnameserver 2.2.2.2\nsearch a b.\nsearch c. .\n"
        "options ndots:2 rotate\noptions ndots:3\n")
    assert servers == ["1.1.1.1", "2.2.2.2"] and searches == ["c"]
    assert options == ["ndots:3", "rotate"]


def test_hostname_subdomain_fqdn_and_bad_names() -> None:
    s = DnsSettings(cluster_domain="cluster.local")
    pod = mkpod("p", ns="team", hostname="web", subdomain="svc1", setHostnameAsFQDN=True)
    assert pod_dns(pod, s).hostname == "web.svc1.team.svc.cluster.local"
    long = mkpod("p", ns="team", hostname="w" * 40, subdomain="svc1", setHostnameAsFQDN=True)
    with pytest.raises(PodDnsError, match="setHostnameAsFQDN.*too long"):
        pod_dns(long, s)
    with pytest.raises(PodDnsError, match="spec.hostname"):
        pod_dns(mkpod("p", hostname="Not_A_Label"), s)


def test_hosts_file(tmp_path: Path) -> None:
    pod = mkpod("p", hostAliases=[{"ip": "10.1.2.3", "hostnames": ["a", "b"]}])
    text = hosts_file(pod, ["10.88.0.5"], "web", "svc1.ns.svc.cluster.local")
    assert text.startswith("# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n")
    assert "10.88.0.5\tweb.svc1.ns.svc.cluster.local\tweb\n" in text
    assert text.endswith("\n# Entries added by HostAliases.\n10.1.2.3\ta\tb\n")
    node = tmp_path / "hosts"
    node.write_text("127.0.0.1 localhost\n192.0.2.1 node1\n")
    host = hosts_file(mkpod("p", hostNetwork=True), ["192.0.2.1"], "p", "", str(node))
    assert host == "# Kubernetes-managed hosts file (host network).\n" \
                   "127.0.0.1 localhost\n192.0.2.1 node1\n"


# --- security settings -------------------------------------------------------------------

def test_container_wins_over_pod_security_context() -> None:
    pod = mkpod("p", containers=[{"name": "c", "image": "i", "securityContext": {
        "runAsUser": 2000, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"add": ["NET_ADMIN"], "drop": ["ALL"]},
        "seccompProfile": {"type": "Localhost", "localhostProfile": "prof.json"}}}],
        securityContext={"runAsUser": 1000, "runAsGroup": 3000, "runAsNonRoot": True,
                         "fsGroup": 4000, "supplementalGroups": [5000],
                         "seccompProfile": {"type": "RuntimeDefault"}})
    sec = ContainerConfig.from_pod(pod, pod["spec"]["containers"][0],
                                   seccomp_root="/var/lib/np/seccomp").security
    assert (sec.run_as_user, sec.run_as_group, sec.run_as_non_root) == (2000, 3000, True)
    assert sec.supplemental_groups == (4000, 5000)
    assert sec.no_new_privs and sec.readonly_rootfs and not sec.privileged
    assert (sec.capabilities_add, sec.capabilities_drop) == (("NET_ADMIN",), ("ALL",))
    assert sec.seccomp == Profile(LOCALHOST, "/var/lib/np/seccomp/prof.json")
    plain = mkpod("q", securityContext={"seccompProfile": {"type": "RuntimeDefault"}})
    assert ContainerConfig.from_pod(plain, plain["spec"]["containers"][0]).security.seccomp \
        == Profile(RUNTIME_DEFAULT)
    bare = mkpod("r")
    sec = ContainerConfig.from_pod(bare, bare["spec"]["containers"][0]).security
    assert sec.seccomp == Profile(UNCONFINED) and sec.run_as_user is None
    assert not sec.no_new_privs  # allowPrivilegeEscalation unset: escalation allowed


def test_sandbox_security_namespaces_sysctls_privileged() -> None:
    pod = mkpod("p", containers=["a", {"name": "b", "image": "i",
                                       "securityContext": {"privileged": True}}],
                hostPID=True, hostIPC=True, shareProcessNamespace=True,
                securityContext={"runAsUser": 7, "sysctls": [
                    {"name": "net/ipv4/conf/eth0.100/rp_filter", "value": "1"}]})
    sec = SandboxConfig.from_pod(pod).security
    assert sec.privileged and sec.host_pid and sec.host_ipc and sec.share_process_namespace
    assert sec.run_as_user == 7
    assert sec.sysctls == (("net.ipv4.conf.eth0/100.rp_filter", "1"),)


def test_hostname_override() -> None:
    s = DnsSettings(cluster_domain="cluster.local")
    pod = mkpod("p", hostnameOverride="my.host.example", subdomain="svc1")
    assert pod_dns(pod, s).hostname == "my.host.example"
    assert pod_dns(pod, s).domain == ""  # the override is the whole name
    with pytest.raises(PodDnsError, match="spec.hostnameOverride"):
        pod_dns(mkpod("p", hostnameOverride="Bad_Name"), s)
