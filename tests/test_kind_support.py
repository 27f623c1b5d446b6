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

from e2e.kind import agent_node, cluster, node, podnet, rootfs
from e2e.kind.docker import ADDRESS_POOLS, RUNC_WRAPPER, engine_links, free_address_pool


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
    with pytest.raises(RuntimeError, match="is not the one the suite builds"):
        cluster.load_config(wrong)
    # a variant's config names the variant
    cfg["nodes"] = [{**n, "image": agent_node.image_name()} for n in cfg["nodes"]]
    wrong.write_text(yaml.safe_dump(cfg))
    assert cluster.load_config(wrong, agent_node.image_name())["nodes"] == cfg["nodes"]
    cfg["networking"] = {"disableDefaultCNI": True}
    wrong.write_text(yaml.safe_dump(cfg))
    with pytest.raises(RuntimeError, match="without the node image's pod network"):
        cluster.load_config(wrong, agent_node.image_name())


def test_the_pod_network_script_writes_the_node_conflist_and_routes(tmp_path: Path) -> None:
    """podnet.SCRIPT run by dash with stand-ins for kubectl, ip and sleep: the node's own
    pod CIDR becomes its conflist, every other node's a route through its address."""
    bin_dir, net_d = tmp_path / "bin", tmp_path / "net.d"
    bin_dir.mkdir()
    net_d.mkdir()
    (bin_dir / "kubectl").write_text(
        "#!/bin/sh\nprintf 'cp 10.244.0.0/24 172.30.0.2\\nw1 10.244.1.0/24 172.30.0.3\\n"
        "w2  172.30.0.4\\n'\n")
    (bin_dir / "ip").write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path}/ip.log\n")
    # the loop's first sleep ends the run
    (bin_dir / "sleep").write_text("#!/bin/sh\nkill $PPID\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    script = podnet.SCRIPT.replace("/tmp/", f"{tmp_path}/")
    script = script.replace(podnet.CONFLIST, str(net_d / "10.conflist"))
    proc = subprocess.run(["dash", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin",
                   "NODE_NAME": "cp", "CONTROL_PLANE_ENDPOINT": "cp:6443"},
                   capture_output=True, text=True, timeout=30)
    assert (net_d / "10.conflist").exists(), proc.stderr
    written = json.loads((net_d / "10.conflist").read_text())
    assert written == json.loads(podnet.conflist("10.244.0.0/24"))
    assert written["plugins"][0]["ipMasq"] is False
    ip_calls = (tmp_path / "ip.log").read_text().splitlines()
    assert "route replace 10.244.1.0/24 via 172.30.0.3" in ip_calls
    assert not any("10.244.0.0" in c or "172.30.0.4" in c for c in ip_calls)  # self; no CIDR


def test_the_pod_network_manifest_asks_kind_for_the_api_server_address() -> None:
    docs = list(yaml.safe_load_all(podnet.MANIFEST))
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    assert "would you kindly patch this file" in podnet.MANIFEST
    assert spec["hostNetwork"] and spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["containers"][0]["image"] == podnet.IMAGE


def test_the_agent_node_kubelet_is_a_wrapper_of_the_agent(tmp_path: Path) -> None:
    """The wrapper execs the agent with its three settings first and the kubelet's
    arguments after, unchanged."""
    wrapper = tmp_path / "kubelet"
    agent = tmp_path / "nodepulse-agent"
    agent.write_text("#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done\n")
    agent.chmod(0o755)
    wrapper.write_text(agent_node.KUBELET_WRAPPER.replace(
        f"{agent_node.VENV}/bin/nodepulse-agent", str(agent)))
    wrapper.chmod(0o755)
    out = subprocess.run([str(wrapper), "--config=/var/lib/kubelet/config.yaml",
                          "--node-labels=a=b c"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["--root-dir=/var/lib/kubelet", "--pod-logs-dir=/var/log/pods",
                   "--allow-privileged=true", "--config=/var/lib/kubelet/config.yaml",
                   "--node-labels=a=b c"]


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


def test_a_new_cache_entry_replaces_only_older_entries_of_its_own_kind(tmp_path: Path) -> None:
    for name in ("node-aaa.tar", "node-nodepulse-bbb.tar", "rootfs-node-ccc.tar"):
        (tmp_path / name).write_text("old")
    (tmp_path / "node-ddd.partial").write_text("new")
    rootfs.keep_only(tmp_path / "node-ddd.tar", tmp_path / "node-ddd.partial")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "node-ddd.tar", "node-nodepulse-bbb.tar", "rootfs-node-ccc.tar"]


def test_the_links_checked_after_an_engine_are_docker_s_own() -> None:
    """A Docker network's bridge and a container's veth are the engine's; a CNI
    plugin's veth (8 hex digits), which other tests make meanwhile, is not."""
    assert engine_links(["lo", "eth0", "br-0123456789ab", "veth1a2b3c4", "veth1a2b3c4d",
                         "cni0", "np3c5c30f4"]) == {"br-0123456789ab", "veth1a2b3c4"}
