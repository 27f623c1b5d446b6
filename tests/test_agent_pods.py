"""The agent with its pod half (nodeagent.pods.podhalf) on the fake runtime, the in-memory API
and FakeClock: pods run and report status, the runtime feeds NodeStatus (images,
containerRuntimeVersion, readiness) and /healthz shows PLEG's health."""

from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from nodeagent import config
from nodeagent.agent import Agent, Externals, build_runtime, host_ip
from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import PODS
from nodeagent.pods.sources.file import FileSource
from nodeagent.pods.sources.http import HTTPSource
from nodeagent.runtime import RelistResult, RuntimeVersion, Unavailable
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import AgentRig, agent_config, aio, mkpod, until
from tests.fakekube import FakeKube


@aio
async def test_pod_runs_and_node_status_carries_the_runtime(tmp_path: Path) -> None:
    rig = AgentRig(tmp_path, "--register-with-taints", "nodepulse.dev/pods=e2e:NoSchedule")
    await rig.start()
    node = rig.node()
    assert node["spec"]["taints"] == [{"key": "nodepulse.dev/pods", "value": "e2e",
                                       "effect": "NoSchedule"}]
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"] == "fake://0.1.0"
    assert [i["names"] for i in node["status"]["images"]] == [["localhost/busybox:1"],
                                                              ["localhost/pause:1"]]
    assert rig.ready_condition()["status"] == "True"

    rig.kube.put(PODS, mkpod(uid="u1"))  # bound to n1 (by the scheduler): the pod watch brings it
    for _ in range(3):
        await rig.clock.advance(1)
    assert len(rig.rt.running("u1")) == 1
    assert rig.status("u1")["phase"] == "Running"
    assert rig.kube.obj(PODS, "web", "ns")["status"]["phase"] == "Running"

    # a container dies: PLEG sees it on the next relist and the worker restarts it
    cid = rig.rt.running("u1")[0].id
    rig.rt.exit_container(cid, 1)
    for _ in range(2):
        await rig.clock.advance(1)
    st = rig.status("u1")
    assert st["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 1

    await rig.finish()
    # stopping the agent leaves its pods running (the next agent adopts them)
    assert rig.rt.running("u1")
    calls = sum(rig.rt.calls.values())
    await rig.clock.advance(30)
    assert sum(rig.rt.calls.values()) == calls  # no loop runs after stop


@aio
async def test_a_started_pod_is_written_once_whatever_order_the_api_keeps(
        tmp_path: Path) -> None:
    """The scheduler's PodScheduled comes first in the API's list; our status, merged
    into it, comes back by the watch with the conditions in the API's order: that is
    not a change to write again (it was: two PATCHes a pod)."""
    rig = AgentRig(tmp_path)
    await rig.start()
    pod = mkpod(uid="u1")
    pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True",
                                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    rig.kube.put(PODS, pod)
    for _ in range(5):
        await rig.clock.advance(1)
    api = rig.kube.obj(PODS, "web", "ns")["status"]
    assert api["phase"] == "Running" and api["conditions"][0]["type"] == "PodScheduled"
    assert len([c for c in rig.kube.calls_of("patch pods/status", ok=True)
                if c.name == "web"]) == 1
    await rig.finish()


@aio
async def test_runtime_down_makes_node_not_ready_and_back(tmp_path: Path) -> None:
    rig = AgentRig(tmp_path)
    await rig.start()
    assert rig.ready_condition()["status"] == "True"
    images = rig.node()["status"]["images"]
    real_version = rig.rt.version

    async def down() -> RuntimeVersion:
        raise Unavailable("socket gone")

    rig.rt.version = down  # type: ignore[method-assign]
    await rig.clock.advance(10)   # image/version refresh
    await rig.clock.advance(10)   # next status computation
    cond = rig.ready_condition()
    assert cond["status"] == "False" and "container runtime is down" in cond["message"]
    assert rig.node()["status"]["images"] == images  # last good list kept
    rig.rt.version = real_version  # type: ignore[method-assign]
    await rig.clock.advance(20)
    assert rig.ready_condition()["status"] == "True"
    await rig.finish()


@aio
async def test_stuck_pleg_fails_healthz_and_readiness(tmp_path: Path) -> None:
    rig = AgentRig(tmp_path, health="127.0.0.1:0")
    rig.pods.loops.pleg.health_threshold = 30.0
    hang = asyncio.Event()

    async def stuck() -> RelistResult:
        await hang.wait()
        raise AssertionError("unreachable")

    await rig.start()
    assert rig.agent.health is not None
    url = f"http://127.0.0.1:{rig.agent.health.port}/healthz"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    assert b"ok" in body
    rig.rt.relist = stuck  # type: ignore[method-assign]
    # events flow: relists come every minute, so the threshold is two of them
    for _ in range(130):
        await rig.clock.advance(1)
    with pytest.raises(urllib.error.HTTPError) as e:
        await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    assert e.value.code == 500 and b"PLEG is not healthy" in e.value.read()
    cond = rig.ready_condition()
    assert cond["status"] == "False" and "PLEG is not healthy" in cond["message"]
    await rig.finish()


def test_config_flags_for_pods(tmp_path: Path) -> None:
    cfg = agent_config(tmp_path, "--node-name", "n1", "--pod-manifest-path", str(tmp_path),
                       "--file-check-frequency", "5s", "--manifest-url",
                       "http://127.0.0.1:1/p.yaml", "--manifest-url-header",
                       "Authorization:Bearer x,X-Node:n1", "--http-check-frequency", "1m",
                       "--runtime", "process", "--container-runtime-endpoint",
                       "unix:///nope.sock", "--register-with-taints",
                       "a=b:NoSchedule,c:NoExecute")
    assert cfg.pod_manifest_path == str(tmp_path) and cfg.file_check_frequency == 5
    assert cfg.manifest_url_headers == {"Authorization": "Bearer x", "X-Node": "n1"}
    assert cfg.http_check_frequency == 60 and cfg.runtime == "process"
    assert cfg.register_with_taints == ({"key": "a", "value": "b", "effect": "NoSchedule"},
                                        {"key": "c", "effect": "NoExecute"})
    (tmp_path / "agent.yaml").write_text(
        "staticPodPath: /etc/pods\nregisterWithTaints: [{key: k, effect: NoSchedule}]\n"
        "staticPodURLHeader: {X-A: [one, two]}\n")
    cfg = agent_config(tmp_path, "--node-name", "n1", "--config", str(tmp_path / "agent.yaml"))
    assert cfg.pod_manifest_path == "/etc/pods"
    assert cfg.register_with_taints == ({"key": "k", "effect": "NoSchedule"},)
    assert cfg.manifest_url_headers == {"X-A": "one,two"}
    assert host_ip(agent_config(tmp_path, "--node-name", "n1", "--node-ip", "192.0.2.7"), None) == "192.0.2.7"  # type: ignore[arg-type]


@pytest.mark.parametrize("allow", [False, True])
def test_allow_privileged_reaches_the_static_sources(tmp_path: Path, allow: bool) -> None:
    cfg = agent_config(tmp_path, "--node-name", "n1", "--pod-manifest-path", str(tmp_path),
                       "--manifest-url", "http://127.0.0.1:1/p.yaml",
                       *(["--allow-privileged"] if allow else []))
    clock = FakeClock()
    agent = Agent(cfg, Externals(FakeKube(), clock, runtime=FakeRuntime(clock),
                             registry=CollectorRegistry()))
    static = [p for p in agent.pods.sources if isinstance(p, FileSource | HTTPSource)]
    assert len(static) == 2 and all(p.allow_privileged is allow for p in static)


@aio
async def test_a_static_pod_runs_and_gets_its_mirror_pod(tmp_path: Path) -> None:
    """The sources the config names, wired to one merge: the API watch always, the
    manifest folder, and the mirror pods (owned by the Node the agent registered)."""
    manifests = tmp_path / "manifests"
    manifests.mkdir(mode=0o755)
    (manifests / "a.yaml").write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n"
        "spec: {containers: [{name: c, image: localhost/busybox:1}]}\n")
    rig = AgentRig(tmp_path, "--pod-manifest-path", str(manifests))
    assert [type(p).__name__ for p in rig.pods.sources] == ["APISource", "FileSource",
                                                           "MirrorManager"]
    await rig.start()
    for _ in range(3):  # the folder is read (off the event loop), the mirror created
        await rig.clock.advance(1)
    await until(lambda: rig.kube.has(PODS, "a-n1", "default"))
    mirror = rig.kube.obj(PODS, "a-n1", "default")
    assert mirror["metadata"]["ownerReferences"][0]["uid"] == rig.node()["metadata"]["uid"]
    assert rig.kube.count("get nodes") == 1  # the registration's: the UID is not fetched again
    for _ in range(3):
        await rig.clock.advance(1)
    static_uid = mirror["metadata"]["annotations"]["kubernetes.io/config.mirror"]
    assert len(rig.rt.running(static_uid)) == 1
    assert rig.kube.obj(PODS, "a-n1", "default")["status"]["phase"] == "Running"
    await rig.finish()


@pytest.mark.parametrize("argv, message", [
    (["--register-with-taints", "a=b:Sometimes"], "--register-with-taints: taint a: effect"),
    (["--register-with-taints", "novalue"], "--register-with-taints: 'novalue' is not"),
    (["--manifest-url-header", "nocolon"], "--manifest-url-header: 'nocolon' is not Name:value"),
    (["--file-check-frequency", "0s"], "--file-check-frequency: must be more than zero"),
    (["--runtime", "docker"], "--runtime: must be one of auto, cri, process, fake"),
])
def test_bad_pod_settings_are_refused(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(config.ConfigError, match=message.replace("(", r"\(")):
        agent_config(tmp_path, "--node-name", "n1", *argv)


@aio
async def test_runtime_choice(tmp_path: Path) -> None:
    rt = build_runtime(agent_config(tmp_path, "--node-name", "n1", "--runtime", "auto",
                                    "--container-runtime-endpoint",
                                    f"unix://{tmp_path}/missing.sock"), "192.0.2.1")
    try:
        assert rt.scheme == "process"
        assert (tmp_path / "process" / "lock").exists()  # state under --root-dir
    finally:
        await rt.close()
    fake = agent_config(tmp_path, "--node-name", "n1", "--runtime", "fake")
    assert isinstance(build_runtime(fake), FakeRuntime)


@aio
async def test_lease_through_again_ends_the_watch_backoffs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Lease renewal that goes through after attempts that could not reach the API
    server tells the node watch and the pod sources (each then ends its backoff)."""
    rig = AgentRig(tmp_path)
    await rig.start()
    assert rig.agent.watch is not None
    assert rig.agent.watch.reflector.answered is rig.agent.answered  # the node watch's
    await rig.clock.advance(12)  # a renewal that went through the first time
    assert rig.agent.answered.delivered == 0
    rig.kube.fail("update leases", ConnectionError("refused"), ConnectionError("refused"))
    await rig.clock.advance(12)
    assert rig.kube.count("update leases") >= 4
    assert rig.agent.answered.delivered == 1
    await rig.finish()


@aio
async def test_a_step_that_hangs_does_not_hold_the_stop(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nodeagent.agent")
    rig = AgentRig(tmp_path)
    await rig.start()
    hung = asyncio.Event()  # never set

    async def stop_hangs() -> None:
        await asyncio.shield(hung.wait())  # and ignores cancellation

    rig.pods.stop = stop_hangs  # type: ignore[method-assign]
    rig.stop.set()
    assert rig.task is not None
    await until(lambda: "stopping" in caplog.text, "the stop begun")
    await settle()  # the stop's timer is set
    assert not rig.task.done()
    await rig.clock.advance(Agent.STOP_BUDGET - 1)
    assert not rig.task.done()  # the stop waits for the step within its budget
    await rig.clock.advance(1)
    await until(rig.task.done, "the stop ended")
    assert ("stopping: the pod workers did not finish within the 15 s a stop may take"
            in caplog.text)
    assert "stopped" in caplog.text
    # the renewals and ticks were stopped after it
    assert rig.agent.renewals._stopping and rig.agent.ticker._stopping
