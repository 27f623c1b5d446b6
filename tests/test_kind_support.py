"""The kind tests' machinery that needs no Docker engine: the Debian mirror apt uses,
images made from a root filesystem's packages, the runc wrapper's capability
stripping, and the kind config checked against what the suite builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e.kind import cluster, node, rootfs
from e2e.kind.docker import ADDRESS_POOLS, RUNC_WRAPPER, free_address_pool


def test_the_mirror_comes_from_apt_deb822_or_one_line(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d/debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n")
    assert rootfs.debian_mirror(tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d/debian.sources").unlink()
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb [arch=amd64] http://old.example/debian bookworm main contrib\n")
    assert rootfs.debian_mirror(tmp_path) == "http://old.example/debian"
    (tmp_path / "sources.list").unlink()
    assert rootfs.debian_mirror(tmp_path) == rootfs.DEFAULT_MIRROR


def fake_tree(tmp_path: Path) -> Path:
    """A root filesystem with dpkg's records for a tool, its libraries and an
    update-alternatives choice, merged /usr included."""
    tree = tmp_path / "tree"
    for d in ("usr/sbin", "usr/lib/x86_64-linux-gnu", "var/lib/dpkg/info",
              "var/lib/dpkg/alternatives", "etc/alternatives"):
        (tree / d).mkdir(parents=True)
    (tree / "lib").symlink_to("usr/lib")
    (tree / "var/lib/dpkg/status").write_text(
        "Package: tool\nStatus: install ok installed\nDepends: libtool1 (>= 1), missing | libc\n\n"
        "Package: libtool1\nStatus: install ok installed\nPre-Depends: libc6:any\n\n"
        "Package: libc6\nStatus: install ok installed\nProvides: libc\n\n"
        "Package: other\nStatus: install ok installed\n\n"
        "Package: gone\nStatus: deinstall ok config-files\n")
    files = {"tool": ["/usr/sbin/tool-nft"], "libtool1": ["/lib/x86_64-linux-gnu/libtool.so.1"],
             "libc6": ["/.", "/lib/x86_64-linux-gnu/libc.so.6"], "other": ["/usr/sbin/other"]}
    for pkg, paths in files.items():
        (tree / f"var/lib/dpkg/info/{pkg}.list").write_text("\n".join(paths) + "\n")
        for p in paths[-1:]:
            (tree / p.lstrip("/")).write_bytes(pkg.encode())
    (tree / "usr/sbin/tool-nft").chmod(0o755)
    (tree / "etc/alternatives/tool").symlink_to("/usr/sbin/tool-nft")
    (tree / "etc/alternatives/tool-save").symlink_to("/usr/sbin/tool-nft")
    (tree / "usr/sbin/tool").symlink_to("/etc/alternatives/tool")
    (tree / "usr/sbin/tool-save").symlink_to("/etc/alternatives/tool-save")
    (tree / "var/lib/dpkg/alternatives/tool").write_text(
        "auto\n/usr/sbin/tool\ntool-save\n/usr/sbin/tool-save\n\n/usr/sbin/tool-nft\n20\n")
    (tree / "etc/alternatives/other").symlink_to("/usr/sbin/other")
    (tree / "var/lib/dpkg/alternatives/other").write_text("auto\n/usr/sbin/oth\n\n")
    return tree


def test_package_closure_follows_depends_alternatives_and_provides(tmp_path: Path) -> None:
    assert node.package_closure(fake_tree(tmp_path), ["tool"]) == ["libc6", "libtool1", "tool"]


def test_an_image_from_packages_holds_their_files_and_alternatives(tmp_path: Path) -> None:
    layer = node.image_from_packages(fake_tree(tmp_path), ["tool"])
    assert layer.files == {"usr/sbin/tool-nft": (b"tool", 0o755),
                           "usr/lib/x86_64-linux-gnu/libtool.so.1": (b"libtool1", 0o644),
                           "usr/lib/x86_64-linux-gnu/libc.so.6": (b"libc6", 0o644)}
    assert layer.symlinks == {"lib": "usr/lib",
                              "usr/sbin/tool": "/etc/alternatives/tool",
                              "etc/alternatives/tool": "/usr/sbin/tool-nft",
                              "usr/sbin/tool-save": "/etc/alternatives/tool-save",
                              "etc/alternatives/tool-save": "/usr/sbin/tool-nft"}


def bounding_set() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            return int(line.split()[1], 16)
    raise AssertionError("no CapBnd")


def run_wrapper(tmp_path: Path, *args: str) -> list[str]:
    runc = tmp_path / "runc"
    runc.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\n")
    runc.chmod(0o755)
    wrapper = tmp_path / "runc-np"
    wrapper.write_text(RUNC_WRAPPER.format(python=sys.executable, runc=str(runc)))
    wrapper.chmod(0o755)
    subprocess.run([str(wrapper), *args], check=True, cwd=tmp_path, timeout=30)
    return (tmp_path / "args").read_text().split()


ALL = ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_SYS_RESOURCE", "CAP_BPF"]


def kept(caps: list[str]) -> list[str]:
    numbers = {"CAP_CHOWN": 0, "CAP_SYS_ADMIN": 21, "CAP_SYS_RESOURCE": 24, "CAP_BPF": 39}
    return [c for c in caps if bounding_set() >> numbers[c] & 1]


def test_the_runc_wrapper_drops_caps_outside_its_bounding_set_on_create(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    spec = {"ociVersion": "1.0.2", "process": {"args": ["sh"], "capabilities": {
        k: list(ALL) for k in ("bounding", "effective", "permitted")}}}
    (bundle / "config.json").write_text(json.dumps(spec))
    args = ["--root", "/run/x", "--log", "create", "create", "--bundle", str(bundle), "id1"]
    assert run_wrapper(tmp_path, *args) == args  # runc gets the same arguments
    caps = json.loads((bundle / "config.json").read_text())["process"]["capabilities"]
    assert caps == {k: kept(ALL) for k in ("bounding", "effective", "permitted")}


def test_the_runc_wrapper_drops_caps_from_an_exec_process_file(tmp_path: Path) -> None:
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"args": ["ls"], "capabilities": {"bounding": ALL}}))
    run_wrapper(tmp_path, "exec", "--process", str(process), "--detach", "id1")
    assert json.loads(process.read_text())["capabilities"] == {"bounding": kept(ALL)}
    # other commands pass through untouched
    assert run_wrapper(tmp_path, "state", "id1") == ["state", "id1"]


def test_the_kind_config_names_what_the_suite_builds(tmp_path: Path) -> None:
    cfg = cluster.load_config()
    assert {n["image"] for n in cfg["nodes"]} == {node.image_name()}
    patches = [yaml.safe_load(p) for p in cfg["kubeadmConfigPatches"]]
    kubelet = next(p for p in patches if p["kind"] == "KubeletConfiguration")
    assert kubelet["failCgroupV1"] is False
    # the controller manager keeps its defaults: no controller is turned off
    assert not any("controllerManager" in p for p in patches)
    wrong = tmp_path / "kind.yaml"
    cfg["nodes"][0]["image"] = "kindest/node:v1.35.0"
    wrong.write_text(yaml.safe_dump(cfg))
    with pytest.raises(RuntimeError, match="is not the one e2e/kind/node.py builds"):
        cluster.load_config(wrong)


def test_host_sysctls_are_restored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    values = {"vm/overcommit_memory": "0\n", "kernel/panic": "1\n"}
    written: dict[str, str] = {}
    monkeypatch.setattr(cluster.HostSysctls, "read", classmethod(lambda cls: dict(values)))
    monkeypatch.setattr(Path, "write_text", lambda self, text: written.update({
        str(self.relative_to("/proc/sys")): text}))
    with cluster.HostSysctls() as sysctls:
        values["kernel/panic"] = "10\n"
    assert sysctls.changed == {"kernel/panic": ("1\n", "10\n")}
    assert written == {"kernel/panic": "1\n"}


def test_an_engine_takes_an_address_pool_no_host_route_touches() -> None:
    routes = ("default via 192.0.2.1 dev eth0\n"
              "172.29.0.0/24 dev br-0123 proto kernel scope link src 172.29.0.1\n"
              "local 127.0.0.0/8 dev lo table local proto kernel scope host src 127.0.0.1\n")
    assert free_address_pool(routes) == "172.30.0.0/16"
    assert free_address_pool("default via 192.0.2.1 dev eth0\n") == "172.29.0.0/16"
    taken = "".join(f"{p} dev br-x scope link\n" for p in ADDRESS_POOLS)
    with pytest.raises(RuntimeError, match="every address pool"):
        free_address_pool(taken)
