"""Pod volumes (nodeagent/pods/volumes): the atomic `..data` writer, each volume type as the
volume manager sets it up, and the sync loop running pods with volumes on the fake
runtime and the in-memory API (FakeClock, no sleeps)."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import datetime as dt
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from nodeagent.api.clock import FakeClock, settle
from nodeagent.api.kube import CONFIG_MAPS, SECRETS, SERVICE_ACCOUNTS
from nodeagent.node.scheduler import Blocking
from nodeagent.pods.objects import ObjectCache
from nodeagent.pods.podupdate import Op
from nodeagent.pods.settings import NodePodSettings
from nodeagent.pods.volumes import MountFailed, TokenManager, VolumeManager, VolumeRefused, atomic
from nodeagent.pods.volumes.atomic import DATA, File
from nodeagent.runtime.base import Mount
from nodeagent.runtime.fake import FakeRuntime
from tests.conftest import FakeMounter, LoopRig, aio, mkpod, token_answers
from tests.fakekube import FakeKube

T0 = dt.datetime(2026, 11, 25, 10, 0, 0, tzinfo=dt.UTC)
ALLOC = {"cpu": "4", "memory": "8Gi", "ephemeral-storage": "100Gi"}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# -- the atomic writer --------------------------------------------------------------------

def test_atomic_layout_swap_and_unchanged_writes_nothing(tmp_path: Path) -> None:
    vol = tmp_path / "v"
    assert atomic.write(vol, {"a": File(b"1", 0o644), "d/b": File(b"2", 0o400)}, now=T0)
    first = os.readlink(vol / DATA)
    assert first.startswith("..2026_11_25_10_00_00.")
    assert os.readlink(vol / "a") == "..data/a" and os.readlink(vol / "d") == "..data/d"
    assert (vol / "d" / "b").read_bytes() == b"2" and mode(vol / "d" / "b") == 0o400
    # the same content again: nothing is written, whatever the time
    assert not atomic.write(vol, {"d/b": File(b"2", 0o400), "a": File(b"1", 0o644)},
                            now=T0 + dt.timedelta(hours=1))
    assert os.readlink(vol / DATA) == first
    # a change: a new version, the old one gone, a removed key's link gone
    assert atomic.write(vol, {"a": File(b"changed", 0o644)}, now=T0 + dt.timedelta(seconds=1))
    second = os.readlink(vol / DATA)
    assert second != first and not (vol / first).exists()
    assert (vol / "a").read_bytes() == b"changed" and not os.path.lexists(vol / "d")
    assert sorted(os.listdir(vol)) == sorted([DATA, second, "a"])
    # a mode change is a change
    assert atomic.write(vol, {"a": File(b"changed", 0o600)}, now=T0)
    assert mode(vol / "a") == 0o600


def test_atomic_refuses_escaping_paths_and_applies_fs_group(tmp_path: Path) -> None:
    for bad in ("/abs", "../up", "a/../../b", "..hidden", ""):
        with pytest.raises(atomic.PayloadError):
            atomic.write(tmp_path / "v", {bad: File(b"x", 0o644)}, now=T0)
    gid = os.getgid()
    atomic.write(tmp_path / "g", {"k": File(b"x", 0o400)}, now=T0, gid=gid)
    assert mode(tmp_path / "g" / "k") == 0o440  # made group-readable, as the kubelet does
    version = tmp_path / "g" / os.readlink(tmp_path / "g" / DATA)
    assert mode(version) & 0o2000 and os.stat(version).st_gid == gid


# -- the volume manager ---------------------------------------------------------------

class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = FakeClock(T0)
        self.kube = FakeKube()
        self.objects = ObjectCache(self.kube, self.clock)
        self.tokens = TokenManager(self.kube, self.clock)
        self.mounter = FakeMounter()
        self.root = tmp_path / "root"
        self.manager = VolumeManager(self.root, self.clock, objects=self.objects,
                                     tokens=self.tokens, mounter=self.mounter,
                                     allocatable=lambda node: ALLOC)
        self.asked = token_answers(self.kube, self.clock)
        self.kube.put(SERVICE_ACCOUNTS, {"metadata": {"name": "default", "namespace": "ns"}})

    async def setup(self, pod: dict[str, Any]) -> Any:
        self.objects.track(pod["metadata"]["uid"], self.manager.refs(pod))
        return await self.manager.setup(pod)


def vpod(*volumes: dict[str, Any], mounts: list[dict[str, Any]] | None = None,
         **spec: Any) -> dict[str, Any]:
    c = {"name": "c", "image": "i", "volumeMounts": mounts or [
        {"name": v["name"], "mountPath": f"/v/{v['name']}"} for v in volumes]}
    return mkpod("p", "u1", containers=[c], volumes=list(volumes), **spec)


KUBE_API_ACCESS = {"name": "kube-api-access-x", "projected": {"defaultMode": 420, "sources": [
    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt",
                                                          "path": "ca.crt"}]}},
    {"downwardAPI": {"items": [{"path": "namespace",
                                "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}


@aio
async def test_configmap_secret_and_projected_files(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    r.kube.put(CONFIG_MAPS, {"metadata": {"name": "cfg", "namespace": "ns"},
                             "data": {"a": "A", "b": "B"}, "binaryData": {"bin": "AAE="}})
    r.kube.put(CONFIG_MAPS, {"metadata": {"name": "kube-root-ca.crt", "namespace": "ns"},
                             "data": {"ca.crt": "PEM"}})
    r.kube.put(SECRETS, {"metadata": {"name": "sec", "namespace": "ns"},
                         "data": {"pw": base64.b64encode(b"hunter2").decode()}})
    pod = vpod({"name": "all", "configMap": {"name": "cfg"}},
               {"name": "some", "configMap": {"name": "cfg", "defaultMode": 0o400,
                                              "items": [{"key": "a", "path": "x/y"},
                                                        {"key": "b", "path": "b",
                                                         "mode": 0o600}]}},
               {"name": "s", "secret": {"secretName": "sec"}},
               {"name": "maybe", "secret": {"secretName": "absent", "optional": True}},
               KUBE_API_ACCESS)
    vols = await r.setup(pod)
    base = r.root / "pods" / "u1" / "volumes"
    cm = base / "kubernetes.io~configmap"
    assert (cm / "all" / "a").read_text() == "A" and (cm / "all" / "bin").read_bytes() == b"\0\1"
    assert mode(cm / "all" / "a") == 0o644
    assert (cm / "some" / "x" / "y").read_text() == "A" and mode(cm / "some" / "x" / "y") == 0o400
    assert mode(cm / "some" / "b") == 0o600 and not (cm / "some" / "a").exists()
    assert (base / "kubernetes.io~secret" / "s" / "pw").read_text() == "hunter2"
    assert [p for p in os.listdir(base / "kubernetes.io~secret" / "maybe")
            if not p.startswith("..")] == []
    proj = base / "kubernetes.io~projected" / "kube-api-access-x"
    assert (proj / "token").read_text() == "tok-1" and (proj / "ca.crt").read_text() == "PEM"
    assert (proj / "namespace").read_text() == "ns" and mode(proj / "token") == 0o644
    assert r.asked[0]["spec"] == {"expirationSeconds": 3607, "boundObjectRef": {
        "apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u1"}}
    assert r.kube.calls_of("create serviceaccounts/token")[0].name == "default"
    # the token is due for a refresh at 80 % of its life
    assert vols.refresh_in == pytest.approx(3607 * 0.8)
    mounts = r.manager.mounts(pod, pod["spec"]["containers"][0], vols, [])
    assert all(m.read_only for m in mounts)  # API data: always read-only
    assert Mount("/v/s", str(base / "kubernetes.io~secret" / "s"), True) in mounts
    # nothing changed: nothing rewritten, no new token
    writes = r.manager.writes
    await r.setup(pod)
    assert r.manager.writes == writes and len(r.asked) == 1
    # 80 % later: a new token, only that volume rewritten
    await r.clock.advance(3607 * 0.8 + 1)
    await r.setup(pod)
    assert len(r.asked) == 2 and (proj / "token").read_text() == "tok-2"
    assert r.manager.writes == writes + 1
    await r.objects.close()


@aio
async def test_missing_objects_fail_the_mount_with_the_kubelets_words(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    r.kube.put(CONFIG_MAPS, {"metadata": {"name": "cfg", "namespace": "ns"}, "data": {}})
    pod = vpod({"name": "a", "configMap": {"name": "nope"}},
               {"name": "b", "secret": {"secretName": "gone"}},
               {"name": "c", "configMap": {"name": "cfg", "items": [{"key": "k",
                                                                    "path": "k"}]}})
    with pytest.raises(MountFailed) as e:
        await r.setup(pod)
    assert e.value.failures == [
        ("a", 'configmap "nope" not found'), ("b", 'secret "gone" not found'),
        ("c", "configmap references non-existent config key: k")]
    await r.objects.close()


@pytest.mark.parametrize(("volume", "field"), [
    ({"persistentVolumeClaim": {"claimName": "x"}}, "persistentVolumeClaim volumes"),
    ({"csi": {"driver": "d"}}, "csi volumes"), ({"nfs": {"server": "s"}}, "nfs volumes"),
    ({"ephemeral": {}}, "ephemeral volumes"), ({"iscsi": {}}, "iscsi volumes"),
    ({"image": {"reference": "x"}}, "image volumes"),
    ({"projected": {"sources": [{"clusterTrustBundle": {"name": "b", "path": "p"}}]}},
     "projected.sources[0].clusterTrustBundle"),
    ({"emptyDir": {"medium": "HugePages"}}, "emptyDir.medium 'HugePages'"),
    ({"emptyDir": {"sizeLimit": "1Gi"}}, "emptyDir.sizeLimit on disk"),
])
def test_unsupported_volumes_are_refused_by_name(tmp_path: Path, volume: dict[str, Any],
                                                 field: str) -> None:
    manager = VolumeManager(tmp_path, FakeClock())
    with pytest.raises(VolumeRefused, match=r"spec.volumes\[0\] \('v'\): .*"
                       + field.replace("[", r"\[").replace("]", r"\]")):
        manager.check(vpod({"name": "v", **volume}))


@aio
async def test_empty_dirs_on_disk_and_in_memory(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    limited = {"name": "c", "image": "i", "resources": {"limits": {"memory": "1Gi"}},
               "volumeMounts": [{"name": "m", "mountPath": "/m"}]}
    pod = mkpod("p", "u1", containers=[limited], volumes=[
        {"name": "d", "emptyDir": {}}, {"name": "m", "emptyDir": {"medium": "Memory"}},
        {"name": "small", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}])
    vols = await r.setup(pod)
    disk = vols.dirs["d"].path
    assert disk.is_dir() and mode(disk) == 0o777
    assert r.mounter.mounted == {str(vols.dirs["m"].path): 2**30,  # the pod's limit
                                 str(vols.dirs["small"].path): 64 * 2**20}
    (disk / "kept").write_text("x")
    await r.setup(pod)  # set up once: the containers' files stay
    assert (disk / "kept").exists() and len(r.mounter.mounted) == 2
    await r.manager.teardown("u1")
    assert r.mounter.mounted == {} and not (r.root / "pods" / "u1").exists()
    r.mounter.refuse = True
    with pytest.raises(MountFailed, match="cannot mount a tmpfs: .*not permitted"):
        await r.setup(pod)
    await r.objects.close()


@aio
async def test_host_path_types(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    (tmp_path / "file").write_text("x")

    async def setup(path: Path, type_: str) -> Path:
        vols = await r.manager.setup(vpod({"name": "h", "hostPath": {"path": str(path),
                                                                     "type": type_}}))
        return vols.dirs["h"].path
    assert await setup(tmp_path / "new-dir", "DirectoryOrCreate") == tmp_path / "new-dir"
    assert (tmp_path / "new-dir").is_dir()
    assert (await setup(tmp_path / "new-file", "FileOrCreate")).is_file()
    await setup(tmp_path / "sock", "Socket")
    await setup(Path("/dev/null"), "CharDevice")
    await setup(tmp_path / "anything", "")
    for path, type_, what in [(tmp_path / "file", "Directory", "a directory"),
                              (tmp_path / "new-dir", "File", "a file"),
                              (tmp_path / "file", "Socket", "a socket file"),
                              (tmp_path / "file", "CharDevice", "a character device"),
                              (tmp_path / "file", "BlockDevice", "a block device")]:
        with pytest.raises(MountFailed, match=f"hostPath type check failed: {path} is not "
                                              f"{what}"):
            await setup(path, type_)
    sock.close()


@aio
async def test_sub_paths_read_only_and_propagation(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    r.kube.put(CONFIG_MAPS, {"metadata": {"name": "cfg", "namespace": "ns"},
                             "data": {"conf": "x"}})
    pod = vpod({"name": "d", "emptyDir": {}}, {"name": "c", "configMap": {"name": "cfg"}},
               mounts=[{"name": "d", "mountPath": "/a", "subPath": "one/two", "readOnly": True},
                       {"name": "d", "mountPath": "/b", "subPathExpr": "$(POD)/logs",
                        "mountPropagation": "HostToContainer"},
                       {"name": "c", "mountPath": "/etc/conf", "subPath": "conf"}])
    vols = await r.setup(pod)
    c = pod["spec"]["containers"][0]
    d = vols.dirs["d"].path
    real_conf = os.path.realpath(vols.dirs["c"].path / "conf")
    assert r.manager.mounts(pod, c, vols, [("POD", "p")]) == [
        Mount("/a", str(d / "one" / "two"), True),
        Mount("/b", str(d / "p" / "logs"), False, "HostToContainer"),
        Mount("/etc/conf", real_conf, True)]  # a file of one version: no updates there
    assert (d / "one" / "two").is_dir()
    with pytest.raises(VolumeRefused, match="subPathExpr: missing value for POD"):
        r.manager.mounts(pod, c, vols, [])
    os.symlink("/etc", d / "escape")
    for sub, why in [("../x", "must be a relative path"), ("escape", "leads out of the volume")]:
        bad = {"name": "c", "image": "i", "volumeMounts": [
            {"name": "d", "mountPath": "/x", "subPath": sub}]}
        with pytest.raises(VolumeRefused, match=why):
            r.manager.mounts(pod, bad, vols, [])
    await r.objects.close()


@aio
async def test_downward_api_files_follow_labels(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    c = {"name": "c", "image": "i", "resources": {"limits": {"cpu": "500m"}}}
    pod = mkpod("p", "u1", containers=[c], labels={"app": "web"}, volumes=[
        {"name": "info", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "cpu", "resourceFieldRef": {"containerName": "c",
                                                 "resource": "limits.cpu", "divisor": "1m"}},
            {"path": "mem", "resourceFieldRef": {"containerName": "c",
                                                 "resource": "limits.memory"}}]}}])
    vols = await r.setup(pod)
    d = vols.dirs["info"].path
    assert (d / "labels").read_text() == 'app="web"'
    assert (d / "cpu").read_text() == "500" and (d / "mem").read_text() == str(8 * 2**30)
    pod["metadata"]["labels"]["tier"] = "front"
    await r.setup(pod)
    assert (d / "labels").read_text() == 'app="web"\ntier="front"'
    await r.objects.close()


@aio
async def test_fs_group_and_token_owner(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    gid, uid = os.getgid(), os.getuid()
    pod = vpod({"name": "d", "emptyDir": {}}, KUBE_API_ACCESS,
               securityContext={"fsGroup": gid, "runAsUser": uid})
    r.kube.put(CONFIG_MAPS, {"metadata": {"name": "kube-root-ca.crt", "namespace": "ns"},
                             "data": {"ca.crt": "PEM"}})
    vols = await r.setup(pod)
    d = vols.dirs["d"].path
    assert os.stat(d).st_gid == gid and mode(d) & 0o2000
    token = vols.dirs["kube-api-access-x"].path / "token"
    assert mode(token) == 0o640  # 0600 for the user, made group-readable for fsGroup
    assert mode(vols.dirs["kube-api-access-x"].path / "ca.crt") == 0o644 | 0o440
    await r.objects.close()


# -- the sync loop ----------------------------------------------------------------------

def loop_rig(tmp_path: Path, clock: FakeClock) -> LoopRig:
    rig = LoopRig(FakeRuntime(clock), clock, volumes=tmp_path / "root")
    rig.kube.put(SERVICE_ACCOUNTS, {"metadata": {"name": "default", "namespace": "ns"}})
    token_answers(rig.kube, clock)
    rig.loops.start()
    return rig


@aio
async def test_pod_waits_for_its_configmap_then_starts_and_sees_updates(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    a = loop_rig(tmp_path, clock)
    await settle()
    c = {"name": "c", "image": "localhost/busybox:1", "command": ["sleep", "$(SECS)"],
         "env": [{"name": "SECS", "valueFrom": {"configMapKeyRef": {"name": "cfg",
                                                                    "key": "secs"}}}],
         "volumeMounts": [{"name": "conf", "mountPath": "/conf"},
                          {"name": "kube-api-access-x", "mountPath": "/var/run/secrets"}]}
    pod = mkpod("web", "u1", containers=[c], volumes=[
        {"name": "conf", "configMap": {"name": "cfg"}}, KUBE_API_ACCESS])
    a.kube.put(CONFIG_MAPS, {"metadata": {"name": "kube-root-ca.crt", "namespace": "ns"},
                             "data": {"ca.crt": "PEM"}})
    a.send(Op.ADD, pod)
    await a.run_for(3)
    assert a.rt.running("u1") == []
    assert a.cstatus("u1")["state"]["waiting"]["reason"] == "ContainerCreating"
    failed = [w for w in a.warnings() if w["reason"] == "FailedMount"]
    assert failed[0]["message"] == ('MountVolume.SetUp failed for volume "conf" : '
                                    'configmap "cfg" not found')
    assert a.rt.calls.get("run_sandbox", 0) == 0  # nothing runs without its volume
    # the ConfigMap appears: its watch makes the pod sync at once, not after a retry
    a.kube.put(CONFIG_MAPS, {"metadata": {"name": "cfg", "namespace": "ns"},
                             "data": {"secs": "3600", "file": "v1"}})
    await settle()
    await clock.advance(1)
    running = a.rt.running("u1")
    assert len(running) == 1
    cfg = a.rt.configs[running[0].id]
    assert cfg.command == ["sleep", "3600"] and ("SECS", "3600") in cfg.env
    conf = tmp_path / "root/pods/u1/volumes/kubernetes.io~configmap/conf"
    assert Mount("/conf", str(conf), True) in cfg.mounts
    assert (conf / "file").read_text() == "v1"
    # an update reaches the running container's files through ..data
    before = os.readlink(conf / DATA)
    a.kube.put(CONFIG_MAPS, {"metadata": {"name": "cfg", "namespace": "ns"},
                             "data": {"secs": "3600", "file": "v2"}})
    await settle()
    await clock.advance(1)
    assert (conf / "file").read_text() == "v2" and os.readlink(conf / DATA) != before
    assert a.rt.running("u1")[0].id == running[0].id  # not restarted
    # removed: the pod's folder and its watches go
    a.send(Op.REMOVE, pod)
    await a.run_for(2)
    assert not (tmp_path / "root/pods/u1").exists()
    assert a.objects is not None and a.objects.watched == 0
    await a.loops.stop()


@aio
async def test_unsupported_volume_refuses_the_pod_visibly(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    a = loop_rig(tmp_path, clock)
    pod = mkpod("db", "u2", containers=[{"name": "c", "image": "localhost/busybox:1",
                                         "volumeMounts": [{"name": "data",
                                                           "mountPath": "/data"}]}],
                volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "pvc"}}])
    a.send(Op.ADD, pod)
    await a.run_for(3)
    assert a.rt.calls.get("run_sandbox", 0) == 0
    waiting = a.cstatus("u2")["state"]["waiting"]
    assert waiting["reason"] == "CreateContainerConfigError"
    assert "spec.volumes[0] ('data'): persistentVolumeClaim volumes are not supported" in \
        waiting["message"]
    warned = [w for w in a.warnings() if w["reason"] == "Failed"]
    assert warned and "persistentVolumeClaim" in warned[0]["message"]
    assert warned[0]["involvedObject"]["fieldPath"] == "spec.containers{c}"
    await a.loops.stop()


@aio
async def test_housekeeping_removes_orphaned_pod_folders(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    a = loop_rig(tmp_path, clock)
    pod = mkpod("web", "u1", volumes=[{"name": "d", "emptyDir": {}}])
    a.send(Op.ADD, pod)
    await a.run_for(3)
    stale = tmp_path / "root/pods/gone-uid/volumes/kubernetes.io~empty-dir/x"
    stale.mkdir(parents=True)
    await a.run_for(3)
    assert not stale.parent.parent.parent.exists()
    assert (tmp_path / "root/pods/u1").exists() and len(a.rt.running("u1")) == 1
    await a.loops.stop()


@aio
async def test_running_pod_gets_its_token_refreshed_before_expiry(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    a = loop_rig(tmp_path, clock)
    a.kube.put(CONFIG_MAPS, {"metadata": {"name": "kube-root-ca.crt", "namespace": "ns"},
                             "data": {"ca.crt": "PEM"}})
    short = {"name": "kube-api-access-x", "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": {"expirationSeconds": 700, "path": "token"}}]}}
    a.send(Op.ADD, mkpod("web", "u1", volumes=[short]))
    await a.run_for(3)
    token = tmp_path / "root/pods/u1/volumes/kubernetes.io~projected/kube-api-access-x/token"
    assert token.read_text() == "tok-1" and len(a.rt.running("u1")) == 1
    await a.run_for(550)  # before 80 % of 700 s: the same token
    assert token.read_text() == "tok-1"
    await a.run_for(15)  # past 560 s: a new one (the 60 s resyncs fall before and after)
    assert token.read_text() == "tok-2"
    assert a.kube.count("create serviceaccounts/token") == 2
    await a.loops.stop()


@aio
async def test_virtual_nodes_plan_volumes_without_reading_or_making_them(tmp_path: Path) -> None:
    """A node whose containers run nothing (virtual nodes) needs none of a volume's
    content: the pod runs with its mounts recorded, and no ConfigMap, Secret or token is
    read (the chart's agent may not read them); an unsupported volume is still refused."""
    clock = FakeClock(T0)
    root = tmp_path / "root"
    a = LoopRig(FakeRuntime(clock), clock, volumes=root,
                pod_settings=NodePodSettings(runs_workloads=False))
    a.loops.start()
    await settle()
    c = {"name": "c", "image": "localhost/busybox:1",
         "volumeMounts": [{"name": "conf", "mountPath": "/conf"},
                          {"name": "kube-api-access-x", "mountPath": "/var/run/secrets"}]}
    a.send(Op.ADD, mkpod("web", "u1", containers=[c], volumes=[
        {"name": "conf", "configMap": {"name": "absent"}}, KUBE_API_ACCESS]),
        mkpod("nfs", "u2", containers=[{"name": "c", "image": "i"}],
              volumes=[{"name": "n", "nfs": {"server": "s", "path": "/"}}]))
    await a.run_for(3)
    [running] = a.rt.running("u1")
    projected = root / "pods" / "u1" / "volumes" / "kubernetes.io~projected"
    assert Mount("/var/run/secrets", str(projected / "kube-api-access-x"), True) \
        in a.rt.configs[running.id].mounts
    assert not (root / "pods").exists()  # nothing made
    assert [c.key for c in a.kube.calls if "configmaps" in c.key or "token" in c.key] == []
    waiting = a.cstatus("u2")["state"]["waiting"]
    assert waiting["reason"] == "CreateContainerConfigError" and "nfs" in waiting["message"]
    await a.loops.stop()


@aio
async def test_a_slow_disk_does_not_hold_the_event_loop(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing, making and removing a pod's volumes runs on the threads the agent hands
    the manager (Blocking), not on the event loop: a disk that takes seconds per
    operation slows that pod's sync, not the Lease renewals (bench.soak: with 267 ms per
    operation on the agent's root dir, a ConfigMap update held the loop and the Lease
    went 36 s without a renewal)."""
    gate = threading.Event()
    real = atomic.write

    def slow_write(*args: Any, **kwargs: Any) -> bool:
        gate.wait(10)  # the disk answers when the test says so (or after 10 s)
        return real(*args, **kwargs)

    monkeypatch.setattr(atomic, "write", slow_write)
    r = Rig(tmp_path)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    r.manager = VolumeManager(r.root, r.clock, objects=r.objects, tokens=r.tokens,
                              mounter=r.mounter, blocking=Blocking(pool))
    r.kube.put(CONFIG_MAPS, {"metadata": {"name": "cfg", "namespace": "ns"}, "data": {"a": "A"}})
    pod = vpod({"name": "cm", "configMap": {"name": "cfg"}})
    setup = asyncio.create_task(r.setup(pod))
    for _ in range(50):  # the loop goes on meanwhile: other work runs
        await asyncio.sleep(0)
    try:
        assert not setup.done()
    finally:
        gate.set()
    await setup
    assert (r.root / "pods" / "u1" / "volumes" / "kubernetes.io~configmap" / "cm" / "a"
            ).read_text() == "A"
    removing = asyncio.create_task(r.manager.teardown("u1"))
    await removing
    assert not (r.root / "pods" / "u1").exists()
    pool.shutdown()
