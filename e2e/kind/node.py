"""The kind node image for the pinned Kubernetes version, assembled here.

kind's own node images come from a registry, which is not reachable here. This one is:
- Debian bookworm (debootstrap, e2e/kind/rootfs.py) with systemd, containerd, runc,
  the CNI plugins and iptables from Debian's packages;
- kubelet, kubeadm and kubectl built from the k8s.io/kubernetes module, crictl from
  sigs.k8s.io/cri-tools (`kind load` runs it), at the versions nodepulse_dev/gomod pins;
- the images kubeadm runs, preloaded into the node's containerd: kube-apiserver,
  kube-controller-manager, kube-scheduler, etcd and CoreDNS each an image holding its
  static binary; kube-proxy its binary plus Debian's iptables and the libraries it
  needs, taken from the node's own root filesystem; pause the suite's own
  (nodepulse_dev/images.py);
- the pod network kind installs (/kind/manifests/default-cni.yaml, a DaemonSet of our
  own, e2e/kind/podnet.py) and its image, preloaded like the others;
- the few files that make it a node kind can drive: an entrypoint, a kubelet unit for
  kubeadm, a containerd configuration, /kind/version.

The images are imported by a throwaway host containerd whose root is the node's
/var/lib/containerd, so nothing has to run inside a container to build the node. The
whole tree is one tar under ~/.cache/nodepulse/kind, named by a hash of everything
that goes into it (this file's text included); a run imports it with `docker import`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from e2e.kind import podnet, rootfs
from e2e.kind.docker import Dockerd
from nodepulse_dev import build
from nodepulse_dev import images as cluster_images
from nodepulse_dev.containerd import _unmount_under
from nodepulse_dev.processes import stop_process

NODE_PACKAGES = ["systemd", "systemd-sysv", "dbus", "containerd", "runc",
                 "containernetworking-plugins", "iptables", "iproute2", "kmod", "conntrack",
                 "procps", "ca-certificates",
                 # the nodepulse variant's agent runs on the node's own Python; the kubelet
                 # variant carries it too, so the two differ in their node agent only
                 "python3", "python3-venv"]
# Built from Go modules (nodepulse_dev/build.py) for the node: on its PATH, or in images.
NODE_TOOLS = ["kubelet", "kubeadm", "kubectl", "crictl"]
IMAGE_TOOLS = {"kube-apiserver": "kube-apiserver", "kube-controller-manager":
               "kube-controller-manager", "kube-scheduler": "kube-scheduler",
               "kube-proxy": "kube-proxy", "etcd": "etcd", "coredns": "coredns"}
# kubeadm v1.35 names etcd 3.6.6; the suite's etcd is the one nodepulse_dev/gomod/etcd
# pins, so the cluster's kubeadm configuration names its real version as the tag.
ETCD_IMAGE_TAG = build.TOOLS["etcd"].version

# Host-wide kernel tunables the node would write: the kubelet's when it starts (its
# setupKernelTunables), systemd's as PID 1 (it raises the open-file limits at boot).
# They are not namespaced: from a privileged node they would change the host's. The
# entrypoint gives the node private copies to write instead.
PRIVATE_SYSCTLS = ["vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic",
                   "kernel/panic_on_oops", "kernel/keys/root_maxkeys",
                   "kernel/keys/root_maxbytes", "fs/file-max", "fs/nr_open"]

ENTRYPOINT = """\
#!/bin/sh
# The node's PID 1 until systemd takes over: what a container needs to be a node.
set -eu
# volumes the kubelet mounts propagate to the containers
mount --make-rshared /
# private copies of the host-wide tunables the node writes (see e2e/kind/node.py)
mkdir -p /run/node-sysctl
for key in {sysctls}; do
    copy=/run/node-sysctl/$(echo "$key" | tr / .)
    cat "/proc/sys/$key" > "$copy"
    mount --bind "$copy" "/proc/sys/$key"
done
# Docker's DNS server for the node answers on 127.0.0.11, which a pod's own network
# namespace cannot reach (CoreDNS, dnsPolicy Default, would forward to itself): the
# node and its pods ask the node's gateway address instead, which this node's NAT
# table sends on to Docker's server (pods' packets come in from their bridge: hence
# PREROUTING, and route_localnet to let them go to a loopback address)
gateway=$(ip -4 route show default | cut -d" " -f3)
for proto in udp tcp; do
    to=$(iptables -t nat -S DOCKER_OUTPUT 2>/dev/null | grep -- "-p $proto " |
         grep -o "127.0.0.11:[0-9]*" || true)
    [ -n "$to" ] || continue
    for chain in OUTPUT PREROUTING; do
        iptables -t nat -A "$chain" -d "$gateway" -p "$proto" --dport 53 -j DNAT --to-destination "$to"
    done
done
echo 1 > /proc/sys/net/ipv4/conf/all/route_localnet
sed "s/^nameserver 127.0.0.11$/nameserver $gateway/" /etc/resolv.conf > /run/resolv.conf
cat /run/resolv.conf > /etc/resolv.conf  # Docker's bind mount: written in place
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    # cgroup v2 (not these machines): systemd enables controllers for its children,
    # which the root of the container's cgroup namespace allows only while it holds
    # no process, so PID 1 moves to a child first
    mkdir -p /sys/fs/cgroup/init.scope
    echo $$ > /sys/fs/cgroup/init.scope/cgroup.procs
else
    # (kind waits for this line, or for systemd's multi-user target, before it goes on)
    echo "detected cgroup v1"
fi
exec "$@"
"""

# The kubelet under systemd, as kubeadm drives it: `kubeadm init/join` writes the
# config and flags and restarts the unit; until then it exits and is started again.
KUBELET_UNIT = """\
[Unit]
Description=kubelet, started by kubeadm
After=containerd.service
Wants=containerd.service
StartLimitIntervalSec=0

[Service]
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
ExecStartPre=/usr/local/bin/kubelet-cgroups
ExecStart=/usr/bin/kubelet --bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf \\
    --kubeconfig=/etc/kubernetes/kubelet.conf --config=/var/lib/kubelet/config.yaml \\
    $KUBELET_KUBEADM_ARGS
Restart=always
RestartSec=1s

[Install]
WantedBy=multi-user.target
"""

# kind's kubelet configuration: cgroupRoot /kubelet (the slice, with the systemd driver).
KUBELET_SLICE = """\
[Unit]
Description=the kubelet's pods
Before=slices.target
"""

# On cgroup v1 the kubelet checks its root cgroup in every hierarchy; systemd makes
# the slice only in those it manages (and mounts the host's unused ones late). The
# cgroupfs driver's root (/kubelet) and the systemd driver's (kubelet.slice) both.
KUBELET_CGROUPS = """\
#!/bin/sh
for dir in /sys/fs/cgroup/*/; do
    mountpoint -q "$dir" || continue
    [ -f "$dir/cgroup.controllers" ] && continue  # cgroup v2: systemd's own
    mkdir -p "$dir/kubelet" "$dir/kubelet.slice"
done
"""

CONTAINERD_CONFIG = """\
version = 2

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # root here lacks CAP_SYS_RESOURCE: a lower oom_score_adj than containerd's fails
  restrict_oom_score_adj = true
  disable_apparmor = true

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      # the systemd driver, as kind's node image has it and the kind configs tell the
      # node agent
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = true

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
"""

# systemd units that would reach past the container into the host (kernel tunables,
# modules, consoles) or wait for hardware a container has not.
MASKED_UNITS = ["systemd-sysctl.service", "systemd-modules-load.service",
                "getty@.service", "console-getty.service", "systemd-remount-fs.service",
                "systemd-firstboot.service", "systemd-udevd.service",
                "systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount",
                "systemd-logind.service"]


def image_name() -> str:
    return f"localhost/nodepulse/kind-node:{build.kubernetes_version()}"


def kubeadm_images(kubeadm: Path) -> list[str]:
    """The images kubeadm of this version deploys (with the suite's etcd tag)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as cfg:
        cfg.write("apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\n"
                  f"kubernetesVersion: {build.kubernetes_version()}\n"
                  f"etcd:\n  local:\n    imageTag: {ETCD_IMAGE_TAG}\n")
        cfg.flush()
        out = subprocess.run([str(kubeadm), "config", "images", "list", "--config", cfg.name],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    return out.split()


def _dpkg_status(tree: Path) -> dict[str, dict[str, str]]:
    installed = {}
    for stanza in (tree / "var/lib/dpkg/status").read_text().split("\n\n"):
        fields = dict(re.findall(r"^(\S+?):\s?(.*)$", stanza, re.M))
        if fields.get("Status", "").endswith(" installed"):
            installed[fields["Package"]] = fields
    return installed


def package_closure(tree: Path, packages: list[str]) -> list[str]:
    """`packages` and everything they depend on, as installed in `tree`."""
    installed = _dpkg_status(tree)
    provided = {p.strip().split()[0]: name for name, f in installed.items()
                for p in f.get("Provides", "").split(",") if p.strip()}
    todo, seen = list(packages), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        deps = installed[name].get("Pre-Depends", "") + "," + installed[name].get("Depends", "")
        for dep in filter(None, (d.strip() for d in deps.split(","))):
            # the first alternative that is installed ("a | b", "c (>= 1)", "d:any")
            for alt in dep.split("|"):
                cand = alt.split()[0].split(":")[0]
                cand = cand if cand in installed else provided.get(cand, "")
                if cand:
                    todo.append(cand)
                    break
    return sorted(seen)


def image_from_packages(tree: Path, packages: list[str]) -> cluster_images.Rootfs:
    """The files of `packages` (and what they depend on) from the root filesystem
    `tree`, with the merged-/usr links and the update-alternatives links they use."""
    layer = cluster_images.Rootfs()
    for top in tree.iterdir():
        if top.is_symlink():  # bin -> usr/bin, lib -> usr/lib, ...
            layer.symlinks[top.name] = os.readlink(top)

    def add(rel: str) -> None:
        path = tree / rel
        parent = Path(os.path.realpath(path.parent)).relative_to(tree.resolve())
        name = str(parent / path.name)
        if path.is_symlink():
            target = os.readlink(path)
            layer.symlinks[name] = target
            if target.startswith("/etc/alternatives/"):
                add(target.lstrip("/"))
        elif path.is_file():
            layer.files[name] = (path.read_bytes(), path.stat().st_mode & 0o7777)

    info = tree / "var/lib/dpkg/info"
    for pkg in package_closure(tree, packages):
        lists = [info / f"{pkg}.list", info / f"{pkg}:amd64.list"]
        for rel in next(p for p in lists if p.exists()).read_text().splitlines():
            if rel not in ("", "/.") and not (tree / rel.lstrip("/")).is_dir():
                add(rel.lstrip("/"))
    # update-alternatives links (/usr/sbin/iptables -> /etc/alternatives/iptables ->
    # /usr/sbin/iptables-nft) belong to no package: those whose choice is in the image
    for state in sorted((tree / "var/lib/dpkg/alternatives").glob("*")):
        # mode, master link, then (slave name, slave link) pairs up to an empty line
        lines = state.read_text().splitlines()
        slaves = lines[2:lines.index("", 2)]
        links = [(state.name, lines[1]), *zip(slaves[::2], slaves[1::2], strict=True)]
        for name, link in links:
            choice = tree / "etc/alternatives" / name
            if choice.is_symlink() and os.readlink(choice).lstrip("/") in layer.files.keys() \
                    | layer.symlinks.keys():
                add(link.lstrip("/"))
    add("etc/ld.so.cache")
    layer.dirs |= {"tmp", "run", "proc", "sys", "dev"}
    return layer


def _component_images(tree: Path, bins: dict[str, Path], names: list[str],
                      out_dir: Path) -> dict[str, Path]:
    """OCI tars for kubeadm's images: name -> tar."""
    tars = {}
    for name in names:
        repo, tag = name.rsplit(":", 1)
        component = repo.rsplit("/", 1)[1]
        out = out_dir / f"{component}.tar"
        if component == "pause":
            tars[name] = cluster_images.build_pause_tar()
            continue
        binary = bins[IMAGE_TOOLS[component]]
        if component == "kube-proxy":
            layer = image_from_packages(tree, ["iptables"])
        else:
            layer = cluster_images.Rootfs(dirs={"tmp", "etc"})
        path = "coredns" if component == "coredns" else f"usr/local/bin/{component}"
        layer.files[path] = (binary.read_bytes(), 0o755)
        entrypoint = ["/coredns"] if component == "coredns" else None
        cluster_images.build_oci_tar(out, layer, ref=tag, entrypoint=entrypoint)
        tars[name] = out
    return tars


def _pod_routes_image(tree: Path, kubectl: Path, out_dir: Path) -> Path:
    """The pod network's image (e2e/kind/podnet.py): the node's own packages it needs,
    kubectl and its script."""
    layer = image_from_packages(tree, podnet.PACKAGES)
    layer.files["usr/local/bin/kubectl"] = (kubectl.read_bytes(), 0o755)
    layer.files["usr/local/bin/pod-routes"] = (podnet.SCRIPT.encode(), 0o755)
    out = out_dir / "pod-routes.tar"
    cluster_images.build_oci_tar(out, layer, ref=podnet.IMAGE.rsplit(":", 1)[1])
    return out


def _preload(tree: Path, tars: dict[str, Path], work: Path) -> None:
    """Import the images into the node's /var/lib/containerd with a throwaway host
    containerd (same Debian release as the node's) rooted there."""
    state = Path(tempfile.mkdtemp(prefix="np-preload-", dir="/tmp"))
    config = work / "preload.toml"
    config.write_text(f'version = 2\nroot = "{tree}/var/lib/containerd"\n'
                      f'state = "{state}/state"\n'
                      f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                      f'[grpc]\n  address = "{state}/c.sock"\n'
                      f'[ttrpc]\n  address = "{state}/c.ttrpc.sock"\n')
    with open(work / "preload.log", "ab") as log:
        proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        sock = state / "c.sock"
        deadline = time.monotonic() + 30
        while subprocess.run(["ctr", "--address", str(sock), "version"],
                             capture_output=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the preload containerd did not start; see {work}/preload.log")
            time.sleep(0.2)
        for name, tar in tars.items():
            repo, tag = name.rsplit(":", 1)
            if tar == cluster_images.build_pause_tar():  # its tar names tag "1"
                cluster_images.import_image(tar, cluster_images.PAUSE_IMAGE, address=str(sock))
                for args in (["tag", cluster_images.PAUSE_IMAGE, name],
                             ["rm", cluster_images.PAUSE_IMAGE]):
                    subprocess.run(["ctr", "--address", str(sock), "-n", "k8s.io", "images",
                                    *args], check=True, capture_output=True, timeout=60)
            else:
                cluster_images.import_image(tar, name, address=str(sock))
    finally:
        stop_process(proc, 20)
        _unmount_under(state)
        shutil.rmtree(state, ignore_errors=True)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _node_files(tree: Path, bins: dict[str, Path], pause: str) -> None:
    for tool in ("kubelet", "kubeadm", "kubectl", "crictl"):
        shutil.copy2(bins[tool], tree / "usr/bin" / tool)
    _write(tree / "kind/version", build.kubernetes_version())
    # what `kind create cluster` installs as the pod network (e2e/kind/podnet.py)
    _write(tree / "kind/manifests/default-cni.yaml", podnet.MANIFEST)
    _write(tree / "usr/local/bin/entrypoint",
           ENTRYPOINT.format(sysctls=" ".join(PRIVATE_SYSCTLS)), 0o755)
    _write(tree / "usr/local/bin/kubelet-cgroups", KUBELET_CGROUPS, 0o755)
    systemd = tree / "etc/systemd/system"
    _write(systemd / "kubelet.service", KUBELET_UNIT)
    _write(systemd / "kubelet.slice", KUBELET_SLICE)
    wants = systemd / "multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for unit in ("kubelet.service", "containerd.service"):
        link = wants / unit
        if not link.is_symlink():
            link.symlink_to(f"/etc/systemd/system/{unit}" if unit == "kubelet.service"
                            else f"/lib/systemd/system/{unit}")
    for unit in MASKED_UNITS:
        link = systemd / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    _write(tree / "etc/containerd/config.toml", CONTAINERD_CONFIG.format(pause=pause))
    _write(tree / "etc/crictl.yaml", "runtime-endpoint: unix:///run/containerd/containerd.sock\n")
    # each node gets its own machine id at boot (systemd writes it when empty)
    _write(tree / "etc/machine-id", "")
    (tree / "etc/cni/net.d").mkdir(parents=True, exist_ok=True)


def node_tar_path() -> Path:
    """Where the node image's tar is cached (named by everything that goes into it)."""
    base = rootfs.tar_path("node", NODE_PACKAGES)
    key = hashlib.sha256(Path(__file__).read_bytes() + Path(podnet.__file__).read_bytes()
                         + base.name.encode())
    for name in sorted(set(NODE_TOOLS) | set(IMAGE_TOOLS.values())):
        key.update(f"{name}={build.TOOLS[name].path}".encode())  # the path names the version
    key.update(cluster_images.pause_tar_path().name.encode())
    return rootfs.cache_dir() / f"node-{key.hexdigest()[:12]}.tar"


def node_tar(log: Callable[[str], None] = print) -> Path:
    """The node image's root filesystem as one tar: from the cache, or built."""
    out = node_tar_path()
    if out.exists():
        return out
    base = rootfs.debootstrap("node", NODE_PACKAGES, log=log)
    bins = build.ensure(sorted(set(NODE_TOOLS) | set(IMAGE_TOOLS.values())), log=log)
    cluster_images.build_pause_tar()
    with build.lock_for(out):
        if not out.exists():
            _assemble(out, base, bins, log)
    return out


def _assemble(out: Path, base: Path, bins: dict[str, Path], log: Callable[[str], None]) -> None:
    started = time.monotonic()
    log(f"assembling the kind node image (once; cached as {out})")
    with tempfile.TemporaryDirectory(prefix="node-", dir=out.parent) as tmp:
        work = Path(tmp)
        tree = work / "tree"
        tree.mkdir()
        subprocess.run(["tar", "-C", str(tree), "--numeric-owner", "-xf", str(base)],
                       check=True, timeout=600)
        names = kubeadm_images(bins["kubeadm"])
        pause = next(n for n in names if "/pause:" in n)
        tars = _component_images(tree, bins, names, work)
        tars[podnet.IMAGE] = _pod_routes_image(tree, bins["kubectl"], work)
        _preload(tree, tars, work)
        _node_files(tree, bins, pause)
        partial = out.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(tree), "--numeric-owner", "-cf", str(partial), "."],
                       check=True, timeout=900)
        rootfs.keep_only(out, partial)
    log(f"assembled the node image in {time.monotonic() - started:.0f} s")


def import_node_image(engine: Dockerd, tar: Path, name: str) -> str:
    """A node image's root filesystem tar imported into `engine` as `name`."""
    engine.docker("import", "-c", 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]',
                  "-c", "ENV container=docker", str(tar), name)
    return name


def load_node_image(engine: Dockerd, log: Callable[[str], None] = print) -> str:
    """The node image in `engine` (imported from the cached tar)."""
    return import_node_image(engine, node_tar(log), image_name())
