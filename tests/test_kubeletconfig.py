"""The kubelet's settings read as the kubelet reads them (nodeagent/kubeletconfig.py): the
table covers every field of the pinned v1beta1 KubeletConfiguration and every flag of
the kubelet's command line; what kubeadm and kind write starts the agent; each honoured
field changes its setting; refused fields and bad values are errors naming them;
ignored ones are noted by name; flags win over the file."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent import config, kubeletconfig
from nodeagent.config import ConfigError
from nodeagent.kubeletconfig import FIELDS, FLAGS, Honoured
from nodeagent.pods.thresholds import Amount
from nodepulse_dev.build import cache_root, pinned_version

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("kubelet_surface",
                                               ROOT / "scripts" / "kubelet_surface.py")
assert _spec and _spec.loader
surface = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(surface)

# what `kubeadm init`/`join` writes to /var/lib/kubelet/config.yaml (its defaults and the
# zero values its encoder keeps), with what kind's kubeadm config patches in
KUBEADM = """
apiVersion: kubelet.config.k8s.io/v1beta1
authentication:
  anonymous:
    enabled: false
  webhook:
    cacheTTL: 0s
    enabled: true
  x509:
    clientCAFile: /etc/kubernetes/pki/ca.crt
authorization:
  mode: Webhook
  webhook:
    cacheAuthorizedTTL: 0s
    cacheUnauthorizedTTL: 0s
cgroupDriver: systemd
clusterDNS:
- 10.96.0.10
clusterDomain: cluster.local
containerRuntimeEndpoint: ""
cpuManagerReconcilePeriod: 0s
crashLoopBackOff: {}
evictionPressureTransitionPeriod: 0s
fileCheckFrequency: 0s
healthzBindAddress: 127.0.0.1
healthzPort: 10248
httpCheckFrequency: 0s
imageMaximumGCAge: 0s
imageMinimumGCAge: 0s
kind: KubeletConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
memorySwap: {}
nodeStatusReportFrequency: 0s
nodeStatusUpdateFrequency: 0s
resolvConf: /run/systemd/resolve/resolv.conf
rotateCertificates: true
runtimeRequestTimeout: 0s
shutdownGracePeriod: 0s
shutdownGracePeriodCriticalPods: 0s
staticPodPath: /etc/kubernetes/manifests
streamingConnectionIdleTimeout: 0s
syncFrequency: 0s
volumeStatsAggPeriod: 0s
"""
KIND_PATCH = """
cgroupRoot: /kubelet
failSwapOn: false
imageGCHighThresholdPercent: 100
evictionHard:
  nodefs.available: "0%"
  nodefs.inodesFree: "0%"
  imagefs.available: "0%"
"""
# kind's kubelet unit: 10-kubeadm.conf's arguments, kubeadm-flags.env (kubeadm's own
# flags and kind's kubeletExtraArgs) and /etc/default/kubelet
KIND_ARGV = ["--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf",
             "--kubeconfig=/etc/kubernetes/kubelet.conf",
             "--container-runtime-endpoint=unix:///run/containerd/containerd.sock",
             "--node-ip=172.18.0.3", "--node-labels=",
             "--provider-id=kind://docker/kind/kind-worker",
             "--hostname-override=kind-worker",
             "--pod-infra-container-image=registry.k8s.io/pause:3.10",
             "--runtime-cgroups=/system.slice/containerd.service"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return p


def load(argv: list[str], env: dict[str, str] | None = None
         ) -> tuple[config.AgentConfig, list[str]]:
    return config.load_with_notes(vars(parser().parse_args(argv)), env or {})


def kubelet_file(tmp_path: Path, body: str = "", base: str = "") -> str:
    doc = yaml.safe_load(base) if base else {"apiVersion": kubeletconfig.API_VERSION,
                                               "kind": kubeletconfig.KIND}
    doc.update(yaml.safe_load(body) or {})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def with_file(tmp_path: Path, body: str, *argv: str) -> tuple[config.AgentConfig, list[str]]:
    return load(["--config", kubelet_file(tmp_path, body), "--node-name", "n1", *argv])


# -- the table against the Go type and the kubelet's command line --

def go_surface() -> tuple[dict[str, str], set[str]] | None:
    try:
        versions = {m: pinned_version("kubernetes", m) for m in
                    ("k8s.io/kubelet", "k8s.io/kubernetes", "k8s.io/component-base")}
        types_go, options_go, logs_go = surface.sources(cache_root() / "gomod", versions)
    except OSError:
        return None
    return surface.config_fields(types_go), surface.kubelet_flags(options_go, logs_go)


def test_every_field_of_the_v1beta1_type_has_a_row() -> None:
    listed = surface.read_list()
    found = go_surface()
    if found is not None:  # the module cache is here: the committed list is current too
        assert found == listed, "run scripts/kubelet_surface.py"
    fields, _ = found or listed
    assert len(fields) > 100
    assert set(FIELDS) - set(fields) == set(), "rows for fields the type does not have"
    assert set(fields) - set(FIELDS) == set(), "fields without a row"
    kinds = {p: f.kind for p, f in FIELDS.items()}
    assert {p: k for p, k in fields.items() if kinds[p] != k} == {}


def test_every_kubelet_flag_is_taken() -> None:
    _, flags = go_surface() or surface.read_list()
    option_flags = {o.flag for o in config.OPTIONS if o.flag}
    field_flags = {f.flag for f in FIELDS.values() if f.flag}
    taken = option_flags | field_flags | set(FLAGS)
    assert flags - taken == set()
    assert option_flags & field_flags == set(), "a field's flag shadows the agent's"
    p = parser()
    for flag in sorted(flags):  # each is a flag the parser knows
        p.parse_args([f"--{flag}=1"] if flag != "v" else ["-v=1"])


def test_the_docs_table_is_the_table() -> None:
    doc = surface.doc_table(surface.DOC.read_text())
    assert doc == config.kubelet_table(), "run scripts/kubelet_surface.py --docs"


def test_honoured_fields_name_settings_of_the_agent() -> None:
    keys = {o.key for o in config.OPTIONS if o.key}
    honoured = {f.action.key for f in FIELDS.values() if isinstance(f.action, Honoured)}
    assert honoured - keys == set()
    for name, (action, why) in FLAGS.items():
        assert action in ("honoured", "ignored", "refused") and (why or action ==
                                                                 "honoured"), name


# -- what kubeadm and kind write --

def test_kubeadm_and_kinds_kubelet_command_line_starts_the_agent(tmp_path: Path) -> None:
    path = kubelet_file(tmp_path, KIND_PATCH, KUBEADM)
    cfg, notes = load([*KIND_ARGV, f"--config={path}"])
    assert cfg.node_name == "kind-worker" and cfg.node_ips == ("172.18.0.3",)
    assert cfg.kubeconfig == "/etc/kubernetes/kubelet.conf"
    assert cfg.bootstrap_kubeconfig == "/etc/kubernetes/bootstrap-kubelet.conf"
    assert cfg.rotate_certificates and cfg.provider_id == "kind://docker/kind/kind-worker"
    assert cfg.client_ca_file == "/etc/kubernetes/pki/ca.crt" and not cfg.anonymous_auth
    assert cfg.authentication_token_webhook and cfg.authorization_mode == "Webhook"
    assert cfg.cluster_dns == ("10.96.0.10",) and cfg.cluster_domain == "cluster.local"
    assert cfg.resolv_conf == "/run/systemd/resolve/resolv.conf"
    assert cfg.pod_manifest_path == "/etc/kubernetes/manifests"
    assert cfg.healthz_bind_address == ("127.0.0.1", 10248)
    assert cfg.heartbeat.statusUpdateFrequencySeconds == 10  # 0s: the default
    assert cfg.heartbeat.statusReportFrequencySeconds == 300
    assert cfg.sync_frequency == 60 and cfg.file_check_frequency == 20
    # kind's evictionHard: all 0%, which the kubelet ignores; given, it replaces the
    # defaults: no hard threshold at all
    assert cfg.eviction_hard == {}
    assert not cfg.fail_swap_on and cfg.fail_cgroup_v1  # kind's, the kubelet's default
    assert cfg.container_runtime_endpoint == "unix:///run/containerd/containerd.sock"
    assert cfg.node_labels == {}
    named = sorted(n.split(":")[1].strip() if n.startswith(path) else n.split(":")[0]
                   for n in notes)
    # kind's cgroups, by the kubelet's names (the systemd driver is refused when the
    # agent starts its pods' cgroups, not here)
    assert (cfg.cgroup_driver, cfg.cgroup_root) == ("systemd", "/kubelet")
    assert named == ["--pod-infra-container-image", "--runtime-cgroups"], notes


# -- each honoured field changes its setting --

HONOURED: list[tuple[str, str, Any]] = [
    ("enableServer: false", "port", None),
    ("address: 127.0.0.2", "address", "127.0.0.2"),
    ("port: 10251", "port", 10251),
    ("tlsCertFile: /c.pem\ntlsPrivateKeyFile: /k.pem", "tls_cert_file", "/c.pem"),
    ("tlsMinVersion: VersionTLS13", "tls_min_version", "VersionTLS13"),
    ("tlsMinVersion: VersionTLS10", "tls_min_version", "VersionTLS12"),
    ("rotateCertificates: true", "rotate_certificates", True),
    ("serverTLSBootstrap: true", "rotate_server_certificates", True),
    ("authentication: {x509: {clientCAFile: /ca.pem}}", "client_ca_file", "/ca.pem"),
    ("authentication: {webhook: {enabled: false}}", "authentication_token_webhook", False),
    ("authentication: {webhook: {cacheTTL: 10s}}",
     "authentication_token_webhook_cache_ttl", 10.0),
    ("authentication: {anonymous: {enabled: true}}", "anonymous_auth", True),
    ("authorization: {mode: AlwaysAllow}", "authorization_mode", "AlwaysAllow"),
    ("authorization: {webhook: {cacheAuthorizedTTL: 1m}}",
     "authorization_webhook_cache_authorized_ttl", 60.0),
    ("authorization: {webhook: {cacheUnauthorizedTTL: 5s}}",
     "authorization_webhook_cache_unauthorized_ttl", 5.0),
    ("enableDebuggingHandlers: false", "enable_debugging_handlers", False),
    ("streamingConnectionIdleTimeout: 30m", "streaming_connection_idle_timeout", 1800.0),
    ("healthzPort: 10300", "healthz_bind_address", ("127.0.0.1", 10300)),
    ("healthzBindAddress: 0.0.0.0", "healthz_bind_address", ("0.0.0.0", 10248)),
    ("healthzPort: 0", "healthz_bind_address", None),
    ("providerID: aws:///z/i-1", "provider_id", "aws:///z/i-1"),
    ("registerWithTaints: [{key: a, value: b, effect: NoSchedule}]",
     "register_with_taints", ({"key": "a", "value": "b", "effect": "NoSchedule"},)),
    ("nodeStatusMaxImages: -1", "heartbeat", ("maxImagesInStatus", 1000)),
    ("nodeStatusMaxImages: 7", "heartbeat", ("maxImagesInStatus", 7)),
    ("nodeLeaseDurationSeconds: 60", "heartbeat", ("leaseDurationSeconds", 60)),
    ("nodeStatusReportFrequency: 1m", "heartbeat", ("statusReportFrequencySeconds", 60)),
    ("nodeStatusUpdateFrequency: 4s", "heartbeat", ("statusReportFrequencySeconds", 4)),
    ("nodeStatusUpdateFrequency: 4s", "heartbeat", ("statusUpdateFrequencySeconds", 4)),
    ("maxPods: 250", "max_pods", 250),
    ("systemReserved: {cpu: 500m}\nkubeReserved: {cpu: 250m, memory: 1Gi}",
     "system_reserved", {"cpu": 0.75, "memory": 2**30}),
    ("evictionHard: {memory.available: 1Gi}", "eviction_hard", ("memory.available<1Gi",)),
    ("evictionHard: {memory.available: 1Gi}\nmergeDefaultEvictionSettings: true",
     "eviction_hard", ("imagefs.available<15%", "imagefs.inodesFree<5%", "memory.available<1Gi",
                       "nodefs.available<10%", "nodefs.inodesFree<5%")),
    ("evictionSoft: {memory.available: 2Gi}\nevictionSoftGracePeriod: {memory.available: 90s}",
     "eviction_soft_grace_period", {"memory.available": 90.0}),
    ("evictionPressureTransitionPeriod: 1m", "eviction_pressure_transition_period", 60.0),
    ("evictionMaxPodGracePeriod: 20", "eviction_max_pod_grace_period", 20),
    ("evictionMinimumReclaim: {memory.available: 500Mi}", "eviction_minimum_reclaim",
     {"memory.available": Amount(value=500 * 2**20)}),
    ("imageMinimumGCAge: 5m", "image_minimum_gc_age", 300.0),
    ("imageGCHighThresholdPercent: 90\nimageGCLowThresholdPercent: 70",
     "image_gc_low_threshold", 70),
    ("imageGCHighThresholdPercent: 90", "image_gc_high_threshold", 90),
    ("cgroupDriver: systemd", "cgroup_driver", "systemd"),
    ("cgroupRoot: /kubelet", "cgroup_root", "/kubelet"),
    ("cgroupsPerQOS: false\nenforceNodeAllocatable: [none]", "cgroups_per_qos", False),
    ("enforceNodeAllocatable: [none]", "enforce_node_allocatable", ()),
    ("enforceNodeAllocatable: []", "enforce_node_allocatable", ("pods",)),  # the default
    ("podPidsLimit: 4096", "pod_pids_limit", 4096),
    ("podPidsLimit: -5", "pod_pids_limit", -1),
    ("qosReserved: {memory: 50%}", "qos_reserved", {"memory": 50}),
    ("systemReserved: {pid: '100'}\nkubeReserved: {pid: '50'}", "system_reserved",
     {"pid": 150}),
    ("failSwapOn: false", "fail_swap_on", False),
    ("{}", "fail_swap_on", True),
    ("failCgroupV1: false", "fail_cgroup_v1", False),
    ("logging: {verbosity: 4}", "log_level", "debug"),
    ("staticPodPath: /etc/m", "pod_manifest_path", "/etc/m"),
    ("staticPodURL: http://h/p", "manifest_url", "http://h/p"),
    ("staticPodURLHeader: {X-A: [b, c]}", "manifest_url_headers", {"X-A": "b,c"}),
    ("fileCheckFrequency: 7s", "file_check_frequency", 7.0),
    ("httpCheckFrequency: 1m0s", "http_check_frequency", 60.0),
    ("syncFrequency: 2m", "sync_frequency", 120.0),
    ("podLogsDir: /var/log/pods", "pod_logs_dir", "/var/log/pods"),
    ("clusterDomain: example.org", "cluster_domain", "example.org"),
    ("clusterDNS: [10.0.0.10, fd00::a]", "cluster_dns", ("10.0.0.10", "fd00::a")),
    ("resolvConf: ''", "resolv_conf", ""),
    ("allowedUnsafeSysctls: [net.core.somaxconn]", "allowed_unsafe_sysctls",
     ("net.core.somaxconn",)),
    ("serializeImagePulls: false", "serialize_image_pulls", False),
    ("maxParallelImagePulls: 3", "serialize_image_pulls", False),
    ("maxParallelImagePulls: 3", "max_parallel_image_pulls", 3),
    ("containerLogMaxSize: 5Mi", "container_log_max_size", 5 * 2**20),
    ("containerLogMaxFiles: 3", "container_log_max_files", 3),
    ("containerRuntimeEndpoint: unix:///run/crio/crio.sock", "container_runtime_endpoint",
     "unix:///run/crio/crio.sock"),
    ("imageServiceEndpoint: unix:///run/containerd/containerd.sock\n"
     "containerRuntimeEndpoint: unix:///run/containerd/containerd.sock",
     "container_runtime_endpoint", "unix:///run/containerd/containerd.sock"),
    ("shutdownGracePeriod: 30s", "shutdown_grace_period", 30.0),
    ("shutdownGracePeriod: 30s\nshutdownGracePeriodCriticalPods: 10s",
     "shutdown_grace_period_critical_pods", 10.0),
    ("shutdownGracePeriodByPodPriority: [{priority: 1000, shutdownGracePeriodSeconds: 5}, "
     "{priority: 0, shutdownGracePeriodSeconds: 20}]",
     "shutdown_grace_period_by_pod_priority", ((0, 20), (1000, 5))),
]


@pytest.mark.parametrize("body, setting, expected", HONOURED)
def test_each_honoured_field_sets_its_setting(tmp_path: Path, body: str, setting: str,
                                              expected: Any) -> None:
    cfg, notes = with_file(tmp_path, body)
    got = getattr(cfg, setting)
    if setting == "heartbeat":
        got, expected = getattr(got, expected[0]), expected[1]
    elif setting == "eviction_hard":
        got = tuple(sorted(f"{signal}<{a.text(signal)}" for signal, a in got.items()))
    assert got == expected
    assert notes == []


def test_honoured_fields_are_all_shown_changing_a_setting() -> None:
    shown = set()
    for body, _, _ in HONOURED:
        shown.update(kubeletconfig.leaves(yaml.safe_load(body) or {}))
    honoured = {p for p, f in FIELDS.items() if isinstance(f.action, Honoured)}
    assert honoured - shown == set()


# -- refusals, notes, bad values --

@pytest.mark.parametrize("body, words", [
    ("registerNode: false", "registerNode: False is not supported: the agent always "
                            "registers its Node"),
    ("runOnce: true", "runOnce: True is not supported"),
    ("seccompDefault: true", "seccompDefault: True is not supported: containers without "
                             "a seccompProfile run Unconfined"),
    ("enableControllerAttachDetach: false", "enableControllerAttachDetach"),
    ("configMapAndSecretChangeDetectionStrategy: Get",
     "configMapAndSecretChangeDetectionStrategy: 'Get' is not supported"),
    ("imagePullCredentialsVerificationPolicy: AlwaysVerify",
     "imagePullCredentialsVerificationPolicy"),
    ("imageServiceEndpoint: unix:///other.sock", "imageServiceEndpoint "
                                                 "(--image-service-endpoint) "
                                                 "'unix:///other.sock' differs from the "
                                                 "container runtime's endpoint "
                                                 "'/run/containerd/containerd.sock'"),
    ("syncFrequency: soon", "syncFrequency: 'soon' is not a duration"),
    ("maxPods: lots", "maxPods: expected int, got 'lots'"),
    ("clusterDNS: 10.0.0.1", "clusterDNS: expected list"),
    ("authorization: {mode: Node}", "authorization.mode: must be one of Webhook, "
                                    "AlwaysAllow"),
    ("logging: {verbosity: loud}", "logging.verbosity: expected a whole number"),
    ("evictionHard: {memory.free: 1Gi}", "evictionHard: unknown signal 'memory.free'"),
    ("shutdownGracePeriod: 500ms", "shutdownGracePeriod: must be 0 or at least 1s"),
    ("shutdownGracePeriod: 10s\nshutdownGracePeriodCriticalPods: 20s",
     "shutdownGracePeriodCriticalPods (20s) must not be more than shutdownGracePeriod (10s)"),
    ("shutdownGracePeriod: 10s\nshutdownGracePeriodByPodPriority: "
     "[{priority: 0, shutdownGracePeriodSeconds: 5}]",
     "shutdownGracePeriodByPodPriority and shutdownGracePeriod(CriticalPods) cannot both"),
    ("shutdownGracePeriodByPodPriority: [{priority: 0, shutdownGracePeriodSeconds: -1}]",
     "shutdownGracePeriodByPodPriority[0].shutdownGracePeriodSeconds: must be between 0"),
    ("shutdownGracePeriodByPodPriority: [{priority: 0, shutdownGracePeriodSeconds: 1}, "
     "{priority: 0, shutdownGracePeriodSeconds: 2}]",
     "shutdownGracePeriodByPodPriority[1].priority: 0 is listed twice"),
    ("shutdownGracePeriodByPodPriority: [{priority: 0, graceSeconds: 1}]",
     "shutdownGracePeriodByPodPriority[0]: expected {priority, shutdownGracePeriodSeconds}"),
])
def test_refused_fields_and_bad_values_are_named(tmp_path: Path, body: str,
                                                 words: str) -> None:
    with pytest.raises(ConfigError) as e:
        with_file(tmp_path, body)
    assert words in str(e.value)


def test_ignored_fields_are_noted_by_name_unless_the_agent_does_that_anyway(
        tmp_path: Path) -> None:
    _, notes = with_file(tmp_path, "cpuManagerPolicy: static\nimageMaximumGCAge: "
                                   "1h\nfeatureGates: {SomeGate: true}\nfooBar: 1\n"
                                   "podsPerCore: 10\n"
                                   "authentication: {x509: {clientCAFile: /ca}, extra: 1}")
    text = "\n".join(notes)
    assert "cpuManagerPolicy: 'static' is not supported, ignored: no exclusive CPUs" in text
    assert "imageMaximumGCAge: '1h' is not supported, ignored: unused images are removed " \
           "by disk use only" in text
    assert "featureGates: {'SomeGate': True} is not supported" in text
    assert "podsPerCore: 10 is not supported, ignored: maxPods alone caps the pods" in text
    assert "fooBar: not a field of kubelet.config.k8s.io/v1beta1" in text
    assert "authentication.extra: not a field" in text
    assert len(notes) == 6
    _, notes = with_file(tmp_path, "cpuManagerPolicy: none\nimageMaximumGCAge: 0s\n"
                                   "cpuCFSQuota: true\nhairpinMode: none")
    assert notes == []


def test_the_agents_own_file_still_works_and_still_refuses_unknown_keys(
        tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("heartbeatMode: legacy\nmaxPods: 12\nsyncFrequency: 30s\n")
    cfg, _ = load(["--config", str(path), "--node-name", "n1"])
    assert cfg.legacy and cfg.max_pods == 12 and cfg.sync_frequency == 30
    assert not cfg.fail_swap_on and not cfg.fail_cgroup_v1  # the agent's own defaults
    path.write_text("cpuManagerPolicy: static\n")
    with pytest.raises(ConfigError, match="unknown key.*cpuManagerPolicy"):
        load(["--config", str(path), "--node-name", "n1"])


# -- flags --

def test_flags_win_over_the_file(tmp_path: Path) -> None:
    cfg, notes = with_file(tmp_path, "maxPods: 30\nfailSwapOn: true\ncgroupDriver: systemd",
                           "--max-pods=50", "--fail-swap-on=false", "--cgroup-driver=cgroupfs",
                           "--cpu-manager-policy=static", "--feature-gates=A=true,B=false",
                           "--register-node=true")
    assert cfg.max_pods == 50 and not cfg.fail_swap_on
    assert cfg.cgroup_driver == "cgroupfs"  # the flag replaced the file's value
    text = "\n".join(notes)
    assert "--cpu-manager-policy: 'static' is not supported" in text
    assert "--feature-gates: {'A': True, 'B': False} is not supported" in text
    with pytest.raises(ConfigError, match="--register-node: False is not supported"):
        load(["--node-name", "n1", "--register-node=false"])
    with pytest.raises(ConfigError, match="--pods-per-core: expected a whole number"):
        load(["--node-name", "n1", "--pods-per-core=many"])


def test_the_kubelets_other_flags(tmp_path: Path) -> None:
    cfg, notes = load(["--hostname-override=Node-A", "--cloud-provider=external", "-v=4",
                       "--node-ip=::", "--lock-file=/run/l", "--kube-reserved=pid=100"])
    assert cfg.node_name == "node-a" and cfg.log_level == "debug" and cfg.node_ips == ()
    assert cfg.register_with_taints == (kubeletconfig.CLOUD_TAINT,)
    assert any(n.startswith("--lock-file: not supported, ignored") for n in notes)
    assert cfg.system_reserved == {"pid": 100}  # held back from kubepods' pids.max
    assert load(["--node-name=n1", "--v=2"])[0].log_level == "info"
    with pytest.raises(ConfigError, match="--hostname-override 'a' and --node-name 'b'"):
        load(["--hostname-override=a", "--node-name=b"])
    with pytest.raises(ConfigError, match="--cloud-provider: must be one of"):
        load(["--node-name=n1", "--cloud-provider=aws"])
    cfg, _ = load(["--node-name=n1", "--root-dir", str(tmp_path)])
    assert cfg.cert_dir == str(tmp_path / "pki")
    assert load(["--node-name=n1", "--cert-dir=/pki"])[0].cert_dir == "/pki"


def test_config_dir_drop_ins_go_over_the_file(tmp_path: Path) -> None:
    drop = tmp_path / "conf.d"
    drop.mkdir()
    (drop / "20-b.conf").write_text(
        f"apiVersion: {kubeletconfig.API_VERSION}\nkind: KubeletConfiguration\n"
        "maxPods: 40\nauthentication: {webhook: {cacheTTL: 5s}}\n")
    (drop / "10-a.conf").write_text(
        f"apiVersion: {kubeletconfig.API_VERSION}\nkind: KubeletConfiguration\n"
        "maxPods: 20\nclusterDomain: a.local\n")
    (drop / "ignored.yaml").write_text("not: read")
    path = kubelet_file(tmp_path, "maxPods: 10\nauthentication: {x509: {clientCAFile: /ca}}")
    cfg, _ = load(["--config", path, "--config-dir", str(drop), "--node-name", "n1"])
    assert cfg.max_pods == 40 and cfg.cluster_domain == "a.local"
    assert cfg.client_ca_file == "/ca" and cfg.authentication_token_webhook_cache_ttl == 5
    (drop / "30-c.conf").write_text("maxPods: 1\n")
    with pytest.raises(ConfigError, match="30-c.conf is not a kubelet.config.k8s.io"):
        load(["--config", path, "--config-dir", str(drop), "--node-name", "n1"])


def test_a_struct_given_as_a_value_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="authentication: expected a mapping of fields"):
        with_file(tmp_path, "authentication: Webhook")
