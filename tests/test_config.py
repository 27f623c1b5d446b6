"""Agent settings: precedence flag > env > file > default, and clear refusals."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from nodeagent import config
from nodeagent.api.policy import Heartbeat
from nodeagent.config import ConfigError, parse_duration


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return p


def load(argv: list[str], env: dict[str, str] | None = None) -> config.AgentConfig:
    return config.parse_args(argv, parser(), env or {})


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_follow_the_kubelet():
    cfg = load(["--node-name", "n1"])
    assert cfg.node_name == "n1" and cfg.agent_id == "n1"
    assert cfg.max_pods == 110
    assert cfg.heartbeat == Heartbeat()  # 40 s lease, 10 s renew, 10 s update, 5 min report
    assert cfg.heartbeat_mode == "efficient" and not cfg.legacy
    assert [t.text() for t in cfg.eviction_thresholds] == [
        "memory.available<100Mi", "nodefs.available<10%", "nodefs.inodesFree<5%",
        "imagefs.available<15%", "imagefs.inodesFree<5%"]
    assert all(t.hard and t.min_reclaim is None for t in cfg.eviction_thresholds)
    assert cfg.eviction_max_pod_grace_period == 0
    assert cfg.eviction_pressure_transition_period == 300
    assert (cfg.image_gc_high_threshold, cfg.image_gc_low_threshold) == (85, 80)
    assert cfg.image_minimum_gc_age == 120
    assert (cfg.minimum_container_ttl_duration, cfg.maximum_dead_containers_per_container,
            cfg.maximum_dead_containers) == (0, 1, -1)
    assert cfg.healthz_bind_address == ("127.0.0.1", 10248)


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    path = write(tmp_path, """
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
maxPods: 30
nodeStatusUpdateFrequency: 5s
nodeStatusReportFrequency: 1m
nodeLeaseDurationSeconds: 60
evictionHard:
  memory.available: 1Gi
""")
    env = {"NODEPULSE_MAX_PODS": "40", "NODEPULSE_NODE_STATUS_UPDATE_FREQUENCY": "7s"}
    cfg = load(["--config", path, "--node-name", "n1", "--max-pods", "50"], env)
    assert cfg.max_pods == 50  # flag
    assert cfg.heartbeat.statusUpdateFrequencySeconds == 7  # env
    assert cfg.heartbeat.statusReportFrequencySeconds == 60  # file
    assert cfg.heartbeat.leaseDurationSeconds == 60
    assert cfg.heartbeat.renewIntervalSeconds == 15  # derived: a quarter
    assert cfg.heartbeat.maxImagesInStatus == 50  # default
    assert cfg.eviction_hard["memory.available"].value == 2**30
    assert list(cfg.eviction_hard) == ["memory.available"]  # given: no defaults beside it
    cfg = load(["--config", path, "--node-name", "n1"], env)
    assert cfg.max_pods == 40
    cfg = load(["--node-name", "n1"], {"NODEPULSE_CONFIG": path})
    assert cfg.max_pods == 30 and cfg.config_file == Path(path)


def test_flag_forms(tmp_path):
    cfg = load(["--node-name", "n1", "--heartbeat-mode", "legacy",
                "--eviction-hard", "nodefs.available<99%", "--system-reserved",
                "cpu=250m,memory=1Gi", "--node-labels", "pool=a,tier=b",
                "--node-ip", "10.1.2.3", "--healthz-bind-address", "127.0.0.1:0",
                "--host-overrides", "{cpu: 2, memoryTotal: 4Gi, kernelVersion: k}",
                "--node-lease-renew-interval", "2s"])
    assert cfg.legacy
    assert cfg.eviction_hard["nodefs.available"].percent == 99
    assert cfg.system_reserved == {"cpu": 0.25, "memory": 2**30}
    assert cfg.node_labels == {"pool": "a", "tier": "b"}
    assert cfg.node_ips == ("10.1.2.3",)
    assert cfg.healthz_bind_address == ("127.0.0.1", 0)
    assert cfg.host_overrides == {"cpu": 2.0, "memoryTotal": 4 * 2**30, "kernelVersion": "k"}
    assert cfg.heartbeat.renewIntervalSeconds == 2
    assert load(["--node-name", "n1", "--healthz-bind-address", ""]).healthz_bind_address is None


@pytest.mark.parametrize("argv, env, words", [
    (["--max-pods", "many"], {}, "--max-pods: expected a whole number"),
    (["--max-pods", "0"], {}, "--max-pods: must be between 1"),
    ([], {"NODEPULSE_MAX_PODS": "x"}, "$NODEPULSE_MAX_PODS: expected a whole number"),
    (["--node-status-update-frequency", "soon"], {}, "--node-status-update-frequency: 'soon'"),
    (["--node-status-update-frequency", "1.5s"], {}, "whole number of seconds"),
    (["--heartbeat-mode", "fast"], {}, "--heartbeat-mode: must be one of efficient, legacy"),
    (["--eviction-hard", "memory.available>1"], {}, "--eviction-hard"),
    (["--eviction-hard", "cpu.available<1"], {}, "--eviction-hard: unknown signal 'cpu"),
    (["--eviction-hard", "memory.available<0"], {}, "must be more than zero"),
    (["--eviction-hard", "nodefs.available<120%"], {}, "0-100%"),
    (["--eviction-soft", "memory.available<1Gi"], {},
     "--eviction-soft-grace-period: grace period must be specified for the soft eviction "
     "threshold memory.available"),
    (["--eviction-soft-grace-period", "memory.available=soon"], {},
     "--eviction-soft-grace-period: memory.available: 'soon' is not a duration"),
    (["--eviction-minimum-reclaim", "imagefs.available=0%"], {}, "more than zero"),
    (["--eviction-minimum-reclaim", "imagefs.available"], {}, "signal=amount"),
    (["--image-gc-high-threshold", "101"], {}, "--image-gc-high-threshold: must be between"),
    (["--image-gc-high-threshold", "70"], {},
     "--image-gc-low-threshold (80) must be less than --image-gc-high-threshold (70)"),
    (["--minimum-image-ttl-duration=-1s"], {}, "--minimum-image-ttl-duration: '-1s' is not a duration"),
    (["--node-lease-duration-seconds", "40", "--node-lease-renew-interval", "40s"], {},
     "--node-lease-renew-interval must be less than --node-lease-duration-seconds"),
    (["--node-status-report-frequency", "5s"], {},
     "--node-status-report-frequency must be at least"),
    (["--healthz-bind-address", "localhost"], {}, "--healthz-bind-address: expected host:port"),
    (["--node-ip", "10.0.0.300"], {}, "--node-ip: '10.0.0.300' is not an IP"),
    (["--system-reserved", "gpu=1"], {}, "--system-reserved: unknown resource 'gpu'"),
    (["--host-overrides", "{cpus: 2}"], {}, "unknown key 'cpus'"),
    (["--agent-id", "not valid!"], {}, "--agent-id"),
    (["--cgroup-root", "kubelet"], {}, "--cgroup-root: 'kubelet' is not an absolute cgroup"),
    (["--cgroup-root", "/a/../b"], {}, "--cgroup-root: '/a/../b' is not an absolute"),
    (["--cgroup-driver", "cgroupv2"], {}, "--cgroup-driver: must be one of cgroupfs, systemd"),
    (["--cgroups-per-qos=false"], {},
     "--cgroups-per-qos=false: kubepods, which --enforce-node-allocatable=pods limits"),
    (["--enforce-node-allocatable", "pods,kube-reserved"], {},
     "--enforce-node-allocatable: kube-reserved: limiting the system-reserved and "
     "kube-reserved cgroups is not supported"),
    (["--enforce-node-allocatable", "pods,none"], {}, "none cannot be combined"),
    (["--enforce-node-allocatable", "everything"], {}, "'everything' is not one of pods"),
    (["--qos-reserved", "cpu=10%"], {}, "--qos-reserved: cpu: only memory can be reserved"),
    (["--qos-reserved", "memory=150%"], {}, "expected a percentage 0%-100%, got '150%'"),
    (["--pod-max-pids", "-2"], {}, "--pod-max-pids: must be between -1"),
    (["--kube-reserved", "gpu=1"], {}, "--kube-reserved: unknown resource 'gpu'"),
])
def test_bad_values_name_their_source(argv, env, words):
    with pytest.raises(ConfigError) as e:
        load(["--node-name", "n1", *argv], env)
    assert words in str(e.value)


def test_eviction_and_gc_settings_in_both_forms(tmp_path):
    cfg = load(["--node-name", "n1", "--eviction-hard", "memory.available<1Gi,nodefs.available<0%",
                "--eviction-soft", "memory.available<2Gi,imagefs.available<20%",
                "--eviction-soft-grace-period", "memory.available=1m30s,imagefs.available=10s",
                "--eviction-minimum-reclaim", "memory.available=500Mi,imagefs.available=5%",
                "--eviction-max-pod-grace-period", "-1",
                "--eviction-pressure-transition-period", "30s",
                "--image-gc-high-threshold", "90", "--image-gc-low-threshold", "50",
                "--minimum-image-ttl-duration", "1m", "--minimum-container-ttl-duration", "10s",
                "--maximum-dead-containers-per-container", "2",
                "--maximum-dead-containers", "100"])
    by = {(t.signal, t.hard): t for t in cfg.eviction_thresholds}
    assert set(by) == {("memory.available", True), ("memory.available", False),
                       ("imagefs.available", False)}  # 0% is ignored, as the kubelet does
    assert by["memory.available", True].limit(0) == 2**30
    assert by["memory.available", False].grace_period == 90
    assert by["memory.available", False].min_reclaim.of(0) == 500 * 2**20  # type: ignore[union-attr]
    assert by["imagefs.available", False].min_reclaim.of(200) == 10  # type: ignore[union-attr]
    assert cfg.eviction_max_pod_grace_period == -1
    assert cfg.eviction_pressure_transition_period == 30
    assert (cfg.image_gc_high_threshold, cfg.image_gc_low_threshold,
            cfg.image_minimum_gc_age) == (90, 50, 60)
    assert (cfg.minimum_container_ttl_duration, cfg.maximum_dead_containers_per_container,
            cfg.maximum_dead_containers) == (10, 2, 100)
    path = write(tmp_path, """
evictionSoft: {nodefs.available: 15%}
evictionSoftGracePeriod: {nodefs.available: 2m}
evictionMinimumReclaim: {nodefs.available: 1Gi}
evictionPressureTransitionPeriod: 1s
imageGCHighThresholdPercent: 100
imageMinimumGCAge: 0s
""")
    cfg = load(["--config", path, "--node-name", "n1"])
    soft = [t for t in cfg.eviction_thresholds if not t.hard]
    assert [(t.text(), t.grace_period) for t in soft] == [("nodefs.available<15%", 120)]
    assert cfg.eviction_pressure_transition_period == 1
    assert (cfg.image_gc_high_threshold, cfg.image_minimum_gc_age) == (100, 0)


def test_bad_file_names_path_and_key(tmp_path):
    path = write(tmp_path, "maxPods: 10\nnodeStatusUpdateFreqency: 5s\n")
    with pytest.raises(ConfigError, match="unknown key.*nodeStatusUpdateFreqency"):
        load(["--config", path])
    path = write(tmp_path, "nodeStatusReportFrequency: often\n")
    with pytest.raises(ConfigError, match=f"{path}: nodeStatusReportFrequency"):
        load(["--config", path])
    path = write(tmp_path, "- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load(["--config", path])
    with pytest.raises(ConfigError, match="no such file|No such file"):
        load(["--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("text, seconds", [
    ("10s", 10), ("1m30s", 90), ("500ms", 0.5), ("2h", 7200), ("15", 15), (20, 20),
])
def test_durations(text, seconds):
    assert parse_duration(text, "x") == seconds


def test_duration_refusals():
    for bad in ("10 s", "s", "-5s", "1m-", True):
        with pytest.raises(ConfigError):
            parse_duration(bad, "x")


def test_allow_privileged_is_off_unless_set(tmp_path):
    assert load(["--node-name", "n1"]).allow_privileged is False
    assert load(["--node-name", "n1", "--allow-privileged"]).allow_privileged is True
    assert load(["--node-name", "n1", "--allow-privileged=false"]).allow_privileged is False
    assert load(["--node-name", "n1"], {"NODEPULSE_ALLOW_PRIVILEGED": "yes"}).allow_privileged
    assert load(["--config", write(tmp_path, "allowPrivileged: true\n")]).allow_privileged
    with pytest.raises(ConfigError, match=r"agent.yaml: allowPrivileged: expected true or "
                                          r"false, got 'maybe'"):
        load(["--config", write(tmp_path, "allowPrivileged: maybe\n")])
    with pytest.raises(ConfigError, match=r"--allow-privileged: expected true or false"):
        load(["--node-name", "n1", "--allow-privileged=2"])


def test_unknown_keys_of_any_type_are_named(tmp_path):
    path = write(tmp_path, "1: a\nnull: b\nmaxPods: 5\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 1, None"):
        load(["--config", path])


def test_the_kubelet_api_is_served_unless_enable_server_is_false(tmp_path):
    assert load(["--node-name", "n1"]).port == 10250
    assert load(["--node-name", "n1", "--enable-server=false"]).port is None
    assert load(["--node-name", "n1"], {"NODEPULSE_ENABLE_SERVER": "false"}).port is None
    conf = tmp_path / "agent.yaml"
    conf.write_text("enableServer: false\nport: 11250\n")
    assert load(["--node-name", "n1", "--config", str(conf)]).port is None
    assert load(["--node-name", "n1", "--config", str(conf), "--enable-server"]).port == 11250


def test_cgroup_settings_keep_the_kubelets_names_and_defaults(tmp_path):
    cfg = load(["--node-name", "n1"])
    assert (cfg.cgroup_root, cfg.cgroups_per_qos, cfg.cgroup_driver) == ("/", True, "cgroupfs")
    assert cfg.enforce_node_allocatable == ("pods",) and cfg.pod_pids_limit == -1
    cfg = load(["--node-name", "n1", "--cgroup-root", "/np-e2e/", "--cgroups-per-qos=false",
                "--enforce-node-allocatable=", "--cgroup-driver", "systemd",
                "--kube-reserved", "cpu=250m,memory=512Mi,pid=1000", "--pod-max-pids", "4096",
                "--qos-reserved", "memory=50%"])
    assert cfg.cgroup_root == "/np-e2e" and not cfg.cgroups_per_qos
    assert cfg.enforce_node_allocatable == () and cfg.cgroup_driver == "systemd"
    # added to --system-reserved (none here); pid: held back from kubepods' pids.max
    assert cfg.system_reserved == {"cpu": 0.25, "memory": 512 * 2**20, "pid": 1000}
    assert cfg.pod_pids_limit == 4096 and cfg.qos_reserved == {"memory": 50}
    assert load(["--node-name", "n1", "--enforce-node-allocatable", "none",
                 "--cgroups-per-qos=false"]).enforce_node_allocatable == ()
    file = write(tmp_path, "cgroupRoot: /x\ncgroupsPerQOS: true\ncgroupDriver: cgroupfs\n"
                           "enforceNodeAllocatable: [pods]\npodPidsLimit: 100\n"
                           "qosReserved: {memory: 10%}\nkubeReserved: {memory: 1Gi}\n")
    cfg = load(["--node-name", "n1", "--config", file])
    assert (cfg.cgroup_root, cfg.pod_pids_limit, cfg.qos_reserved) == ("/x", 100,
                                                                       {"memory": 10})
    assert cfg.system_reserved == {"memory": 2**30}
