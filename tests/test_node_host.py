"""Host readings from a fake /proc folder, and config overrides."""

from __future__ import annotations

import pytest

from nodeagent.node.host import HostProbe, HostReadError, filesystem, parse_overrides
from tests.conftest import fake_proc


def test_reads_proc_statvfs_and_uname(tmp_path):
    probe = HostProbe(root_dir=tmp_path / "state" / "missing", proc=fake_proc(tmp_path),
                      node_ips=("10.9.8.7",))
    r = probe.read()
    assert r.memoryTotal == 8_000_000 * 1024 and r.memoryAvailable == 4_000_000 * 1024
    assert r.pidMax == 32768 and r.pidsRunning == 345
    assert r.fsTotal > 0 and 0 <= r.fsAvailable <= r.fsTotal  # the nearest existing parent
    assert r.cpu >= 1 and r.kernelVersion and r.architecture
    assert r.bootID == "boot-1"
    assert r.addresses[0] == ("InternalIP", "10.9.8.7") and r.addresses[-1][0] == "Hostname"


def test_readings_follow_the_files(tmp_path):
    proc = fake_proc(tmp_path)
    probe = HostProbe(root_dir=tmp_path, proc=proc)
    assert probe.read().memoryAvailable == 4_000_000 * 1024
    fake_proc(tmp_path / "again", mem_avail_kb=1000)
    (proc / "meminfo").write_text((tmp_path / "again/proc/meminfo").read_text())
    assert probe.read().memoryAvailable == 1000 * 1024


def _mount(tmp_path, lines):
    proc = fake_proc(tmp_path)
    (proc / "self").mkdir()
    (proc / "self/mountinfo").write_text("".join(f"{line}\n" for line in lines))
    return proc


def test_memory_available_is_capacity_less_the_root_cgroups_working_set(tmp_path):
    """As the kubelet measures it: cgroup v1 usage less total_inactive_file; v2 anon and
    file less inactive_file. A mount of a subtree (a container's view) is not the root:
    the kernel's MemAvailable stands in."""
    v1 = tmp_path / "cg1"
    v1.mkdir()
    (v1 / "memory.usage_in_bytes").write_text(f"{3 * 2**30}\n")
    (v1 / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {2**30}\n")
    proc = _mount(tmp_path / "a", [
        "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw",
        f"35 31 0:32 / {v1} rw,relatime - cgroup cgroup rw,memory",
        f"41 31 0:38 / {tmp_path}/unified rw - cgroup2 cgroup2 rw"])
    r = HostProbe(root_dir=tmp_path, proc=proc).read()
    assert r.memoryAvailable == 8_000_000 * 1024 - 2 * 2**30

    v2 = tmp_path / "cg2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu io memory pids\n")
    (v2 / "memory.stat").write_text(f"anon {2**30}\nfile {2**30}\ninactive_file {2**29}\n")
    proc = _mount(tmp_path / "b", [f"29 23 0:26 / {v2} rw - cgroup2 cgroup2 rw"])
    r = HostProbe(root_dir=tmp_path, proc=proc).read()
    assert r.memoryAvailable == 8_000_000 * 1024 - (2 * 2**30 - 2**29)

    proc = _mount(tmp_path / "c", [
        f"35 31 0:32 /pod/abc {v1} rw - cgroup cgroup rw,memory"])
    assert HostProbe(root_dir=tmp_path, proc=proc).read().memoryAvailable == 4_000_000 * 1024


def test_filesystem_of_a_path_not_made_yet_is_its_parents(tmp_path):
    fs = filesystem(tmp_path / "not" / "yet")
    assert fs.total > 0 and 0 <= fs.available <= fs.total and fs.inodes >= fs.inodes_free
    assert fs.device == filesystem(tmp_path).device


def test_overrides_win(tmp_path):
    overrides = parse_overrides({"cpu": "2500m", "memoryTotal": "4Gi", "memoryAvailable": "1Gi",
                                 "kernelVersion": "5.10.0", "addresses": [
                                     {"type": "InternalIP", "address": "192.168.1.2"}]})
    r = HostProbe(root_dir=tmp_path, proc=fake_proc(tmp_path), overrides=overrides).read()
    assert r.cpu == 2.5 and r.memoryTotal == 4 * 2**30 and r.memoryAvailable == 2**30
    assert r.kernelVersion == "5.10.0"
    assert r.addresses == (("InternalIP", "192.168.1.2"),)


def test_missing_or_broken_files_name_the_file(tmp_path):
    proc = fake_proc(tmp_path)
    (proc / "meminfo").unlink()
    with pytest.raises(HostReadError, match="meminfo"):
        HostProbe(root_dir=tmp_path, proc=proc).read()
    proc = fake_proc(tmp_path / "b")
    (proc / "loadavg").write_text("garbage\n")
    with pytest.raises(HostReadError, match="loadavg: unexpected format"):
        HostProbe(root_dir=tmp_path, proc=proc).read()


@pytest.mark.parametrize("bad, words", [
    ({"cpus": 1}, "unknown key 'cpus'"),
    ({"memoryTotal": "lots"}, "memoryTotal"),
    ({"cpu": -1}, "must not be negative"),
    ({"kernelVersion": ""}, "kernelVersion must be a non-empty string"),
    ({"addresses": ["10.0.0.1"]}, "addresses must be a list"),
])
def test_bad_overrides_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        parse_overrides(bad)
