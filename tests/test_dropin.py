"""The kubelet's settings reach the parts that act on them: the Node's providerID and
taints, the pods' resync period and log folder, the host checks the kubelet makes at
start (swap, cgroup v1), and the start-up log lines naming what is not done."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from nodeagent import cli, kubeletconfig
from nodeagent.api.kube import NODES
from nodeagent.node.host import startup_refusal
from tests.conftest import AgentRig, aio, fake_proc


def kubelet_config(tmp_path: Path, **fields: object) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": kubeletconfig.API_VERSION,
                                    "kind": kubeletconfig.KIND, **fields}))
    return str(path)


@aio
async def test_node_and_pod_settings_reach_their_parts(tmp_path: Path) -> None:
    path = kubelet_config(tmp_path, syncFrequency="2m", podLogsDir=str(tmp_path / "logs"),
                          providerID="kind://docker/c/n1", failSwapOn=False,
                          registerWithTaints=[{"key": "k", "effect": "NoSchedule"}])
    rig = AgentRig(tmp_path, "--config", path, "--cloud-provider=external")
    loop = rig.pods.loops.loop("n1")
    assert loop.workers.timing.sync_frequency == 120
    assert loop.syncer.settings.log_root == str(tmp_path / "logs")
    await rig.start()
    node = rig.node()
    assert node["spec"]["providerID"] == "kind://docker/c/n1"
    assert [t["key"] for t in node["spec"]["taints"]] == [
        "k", "node.cloudprovider.kubernetes.io/uninitialized"]
    await rig.finish()


@aio
async def test_an_existing_node_without_a_provider_id_gets_it(tmp_path: Path) -> None:
    rig = AgentRig(tmp_path, "--provider-id=aws:///z/i-1")
    rig.kube.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    await rig.start()
    assert rig.node()["spec"]["providerID"] == "aws:///z/i-1"
    await rig.finish()


def test_swap_and_cgroup_v1_refusals(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    (proc / "swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n")
    v2, v1 = tmp_path / "cg2", tmp_path / "cg1"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    v1.mkdir()
    assert startup_refusal(fail_swap_on=True, fail_cgroup_v1=True, proc=str(proc),
                           cgroup_root=str(v2)) is None
    (proc / "swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n"
                                "/swapfile\tfile\t1048572\t0\t-2\n")
    refusal = startup_refusal(fail_swap_on=True, fail_cgroup_v1=False, proc=str(proc))
    assert refusal and "failSwapOn: swap is on (/swapfile)" in refusal
    assert startup_refusal(fail_swap_on=False, fail_cgroup_v1=False, proc=str(proc)) is None
    refusal = startup_refusal(fail_swap_on=False, fail_cgroup_v1=True, cgroup_root=str(v1))
    assert refusal and refusal.startswith("failCgroupV1: this host uses cgroup v1")


def test_the_agent_names_what_it_does_not_do_and_refuses_swap(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    proc = fake_proc(tmp_path)
    (proc / "swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n/dev/sdb\tpartition"
                                "\t1\t0\t-2\n")
    path = kubelet_config(tmp_path, cpuManagerPolicy="static", failCgroupV1=False)
    with caplog.at_level(logging.WARNING, "nodeagent"):
        code = cli.main(["--config", path, "--node-name", "n1", "--proc-path", str(proc),
                         "--runtime-cgroups=/system.slice/containerd.service"])
    assert code == 2
    assert "failSwapOn: swap is on (/dev/sdb)" in capsys.readouterr().err
    assert f"{path}: cpuManagerPolicy: 'static' is not supported, ignored" in caplog.text
    assert "--runtime-cgroups: not supported, ignored" in caplog.text
