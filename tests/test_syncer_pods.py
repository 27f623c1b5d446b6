"""What the syncer does with the node's part of a pod: admission rejections, fields it
does not honour, runAsNonRoot, the security settings, names, resolver and /etc/hosts the
runtime is given, and the RuntimeClass handler (fake runtime, FakeClock)."""

from __future__ import annotations

from pathlib import Path

from nodeagent.api.clock import FakeClock
from nodeagent.api.kube import RUNTIME_CLASSES
from nodeagent.pods.admission import AdmissionSettings
from nodeagent.pods.dns import DnsSettings
from nodeagent.pods.podupdate import Op
from nodeagent.pods.settings import NodePodSettings
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import LoopRig, aio, mkpod, settle


async def rig(clock: FakeClock, tmp_path: Path | None = None,
              rt: FakeRuntime | None = None, **dns: object) -> LoopRig:
    settings = NodePodSettings(
        dns=DnsSettings(**dns),  # type: ignore[arg-type]
        admission=AdmissionSettings(kernel=(6, 1), apparmor=False),
        pods_dir=str(tmp_path / "pods") if tmp_path else "")
    a = LoopRig(rt or FakeRuntime(clock), clock, pod_settings=settings)
    a.loops.start()
    await settle()
    return a


def failed_events(a: LoopRig) -> list[dict]:
    return [e for e in a.warnings() if e["reason"] == "Failed"]


@aio
async def test_rejected_pod_fails_and_runs_nothing() -> None:
    clock = FakeClock()
    a = await rig(clock)
    a.send(Op.ADD, mkpod("win", "u1", os={"name": "windows"}))
    await a.run_for(3)
    st = a.status("u1")
    assert st == {"phase": "Failed", "reason": "PodOSNotSupported",
                  "message": "Pod was rejected: Failed to admit pod as the OS field "
                             "doesn't match node OS"}
    assert a.rt.calls["run_sandbox"] == 0
    await a.run_for(70)  # resyncs and the terminated pass keep it as it was
    assert a.status("u1") == st and a.rt.calls["run_sandbox"] == 0
    await a.events.drain()
    [ev] = [e for e in a.warnings() if e["reason"] == "PodOSNotSupported"]
    assert "fieldPath" not in ev["involvedObject"]
    await a.loops.stop()


@aio
async def test_unhonoured_container_field_blocks_that_container_only() -> None:
    clock = FakeClock()
    a = await rig(clock)
    pod = mkpod("p", "u1", containers=("good", {"name": "bad", "image": "i",
                                                "volumeDevices": [{"name": "v"}]}))
    a.send(Op.ADD, pod)
    await a.run_for(3)
    bad = a.cstatus("u1", 1)["state"]["waiting"]
    assert bad["reason"] == "CreateContainerConfigError"
    assert bad["message"].startswith("spec.containers[1].volumeDevices: ")
    assert [c.name for c in a.rt.running("u1")] == ["good"]
    await a.events.drain()
    [ev] = failed_events(a)
    assert ev["involvedObject"]["fieldPath"] == "spec.containers{bad}"
    assert ev["message"].startswith("Error: spec.containers[1].volumeDevices")
    await a.loops.stop()


@aio
async def test_unhonoured_pod_field_blocks_the_sandbox() -> None:
    clock = FakeClock()
    a = await rig(clock)
    a.send(Op.ADD, mkpod("p", "u1", containers=("a", "b"), futureField={"x": 1}))
    await a.run_for(3)
    for i in (0, 1):
        w = a.cstatus("u1", i)["state"]["waiting"]
        assert w["reason"] == "CreateContainerConfigError"
        assert w["message"].startswith("spec.futureField: unknown field")
    assert a.rt.calls["run_sandbox"] == 0 and a.status("u1")["phase"] == "Pending"
    await a.events.drain()
    assert len(failed_events(a)) == 2
    await a.loops.stop()


@aio
async def test_run_as_non_root_against_the_image_user() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    rt.image_users = {"localhost/user:1": (1000, ""), "localhost/named:1": (None, "app")}
    a = await rig(clock, rt=rt)

    def pod(name: str, image: str, **sc: object) -> dict:
        return mkpod(name, f"u-{name}", image=image,
                     securityContext={"runAsNonRoot": True, **sc})
    a.send(Op.ADD, pod("root", "localhost/busybox:1"), pod("user", "localhost/user:1"),
           pod("named", "localhost/named:1"), pod("zero", "localhost/user:1", runAsUser=0),
           pod("given", "localhost/busybox:1", runAsUser=5))
    await a.run_for(3)
    msg = a.cstatus("u-root")["state"]["waiting"]["message"]
    assert msg == ('container has runAsNonRoot and image will run as root '
                   '(pod: "root_ns(u-root)", container: c)')
    assert "non-numeric user (app)" in a.cstatus("u-named")["state"]["waiting"]["message"]
    assert a.cstatus("u-zero")["state"]["waiting"]["message"].startswith(
        "container's runAsUser breaks non-root policy")
    assert len(a.rt.running("u-user")) == 1 and len(a.rt.running("u-given")) == 1
    await a.loops.stop()


@aio
async def test_runtime_gets_security_names_dns_and_hosts(tmp_path: Path) -> None:
    clock = FakeClock()
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 1.1.1.1\nsearch corp.example\n")
    a = await rig(clock, tmp_path, cluster_dns=("10.0.0.10",),
                  cluster_domain="cluster.local", resolv_conf=str(resolv))
    name = "n" * 70
    a.send(Op.ADD, mkpod(name, "u1", subdomain="sub", securityContext={
        "runAsUser": 1000, "sysctls": [{"name": "kernel.shm_rmid_forced", "value": "1"}]},
        hostAliases=[{"ip": "10.9.9.9", "hostnames": ["alias"]}]))
    await a.run_for(3)
    [sid] = a.rt.sandbox_configs
    sc = a.rt.sandbox_configs[sid]
    assert sc.hostname == "n" * 63
    assert sc.dns is not None and sc.dns.servers == ("10.0.0.10",)
    assert sc.dns.searches[:3] == ("ns.svc.cluster.local", "svc.cluster.local",
                                   "cluster.local")
    assert sc.security.sysctls == (("kernel.shm_rmid_forced", "1"),)
    [c] = a.rt.running("u1")
    cfg = a.rt.configs[c.id]
    assert cfg.security.run_as_user == 1000
    [mount] = cfg.mounts
    assert mount.container_path == "/etc/hosts"
    hosts = Path(mount.host_path).read_text()
    ip = a.rt.sandboxes[sid].ip
    assert f"{ip}\t{'n' * 63}.sub.ns.svc.cluster.local\t{'n' * 63}\n" in hosts
    assert hosts.endswith("10.9.9.9\talias\n")
    assert Path(mount.host_path) == tmp_path / "pods" / "u1" / "etc-hosts"
    a.send(Op.REMOVE, mkpod(name, "u1"))
    await a.run_for(5)
    assert not (tmp_path / "pods" / "u1").exists()  # cleaned up with the pod
    await a.loops.stop()


@aio
async def test_container_mounting_etc_hosts_keeps_its_own(tmp_path: Path) -> None:
    clock = FakeClock()
    a = await rig(clock, tmp_path)
    a.send(Op.ADD, mkpod("p", "u1", containers=[{
        "name": "c", "image": "i", "volumeMounts": [{"name": "h", "mountPath": "/etc/hosts"}]}]))
    await a.run_for(3)
    [c] = a.rt.running("u1")
    assert all(m.container_path != "/etc/hosts" for m in a.rt.configs[c.id].mounts)
    await a.loops.stop()


@aio
async def test_runtime_class_handler_and_missing_class() -> None:
    clock = FakeClock()
    rt = FakeRuntime(clock)
    rt.runtime_handlers = {"", "kata"}
    a = await rig(clock, rt=rt)
    a.kube.put(RUNTIME_CLASSES, {"metadata": {"name": "sandboxed"}, "handler": "kata"})
    a.kube.put(RUNTIME_CLASSES, {"metadata": {"name": "odd"}, "handler": "gvisor"})
    a.send(Op.ADD, mkpod("a", "ua", runtimeClassName="sandboxed"),
           mkpod("b", "ub", runtimeClassName="missing"),
           mkpod("c", "uc", runtimeClassName="odd"))
    await a.run_for(3)
    [sc] = [s for s in rt.sandbox_configs.values() if s.uid == "ua"]
    assert sc.runtime_handler == "kata" and len(rt.running("ua")) == 1
    assert not rt.running("ub") and not rt.running("uc")
    await a.events.drain()
    sandbox_events = {e["involvedObject"]["name"]: e["message"] for e in a.warnings()
                      if e["reason"] == "FailedCreatePodSandBox"}
    assert "RuntimeClass 'missing'" in sandbox_events["b"]
    assert "no runtime for 'gvisor'" in sandbox_events["c"]
    assert a.cstatus("ub")["state"]["waiting"]["reason"] == "ContainerCreating"
    await a.loops.stop()


@aio
async def test_missing_cluster_dns_is_a_warning_and_falls_back() -> None:
    clock = FakeClock()
    a = await rig(clock)
    a.send(Op.ADD, mkpod("p", "u1"))
    await a.run_for(3)
    [sc] = a.rt.sandbox_configs.values()
    assert sc.dns is None and len(a.rt.running("u1")) == 1
    await a.events.drain()
    assert [e["reason"] for e in a.warnings()] == ["MissingClusterDNS"]
    await a.loops.stop()


@aio
async def test_created_and_started_events() -> None:
    clock = FakeClock()
    a = await rig(clock)
    a.send(Op.ADD, mkpod("p", "u1"))
    await a.run_for(3)
    await a.events.drain()
    normal = [(c.body["reason"], c.body["message"], c.body["involvedObject"]["fieldPath"])
              for c in a.kube.calls_of("create events") if c.body and c.body["type"] == "Normal"
              and c.body["reason"] in ("Created", "Started")]
    assert normal == [("Created", "Container created", "spec.containers{c}"),
                      ("Started", "Container started", "spec.containers{c}")]
    await a.loops.stop()


@aio
async def test_a_run_once_pod_the_runtime_lost_ends_instead_of_running_again() -> None:
    """The agent starts again on a runtime that lost everything (the fake runtime after
    a SIGKILL, a reboot) and gets a Never pod whose status says its container was
    running: it is reported lost (ContainerStatusUnknown) and the pod Failed, and
    nothing runs a second time (bench.soak: a Job's pod ran twice)."""
    clock = FakeClock()
    a = await rig(clock)
    pod = mkpod("job", "u1", policy="Never")
    pod["status"] = {"phase": "Running", "containerStatuses": [{
        "name": "c", "containerID": "fake://c-old", "ready": True, "restartCount": 0,
        "image": "localhost/busybox:1", "imageID": "",
        "state": {"running": {"startedAt": "2026-11-29T11:59:00Z"}}}]}
    a.send(Op.ADD, pod)
    await a.run_for(5)
    st = a.status("u1")
    assert st["phase"] == "Failed", st
    [c] = st["containerStatuses"]
    assert c["state"]["terminated"]["reason"] == "ContainerStatusUnknown", st
    assert a.rt.calls["run_sandbox"] == 0 and a.rt.calls["create_container"] == 0
    await a.loops.stop()
