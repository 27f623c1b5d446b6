"""A private containerd for e2e tests, with its own root, state, sockets and CNI
config under one temp folder, so nothing touches /var/lib/containerd or a system
containerd. Two builds, both on Debian's runc:

- "debian": Debian's containerd 1.6 (config version 2). Its CRI has no container
  events (GetContainerEvents answers UNIMPLEMENTED): the agent relists only.
- "built": containerd 2.x built from the Go module pinned in
  nodepulse_dev/gomod/containerd (config version 3, where the CRI settings are split
  over the plugins io.containerd.grpc.v1.cri (streaming), io.containerd.cri.v1.runtime
  and io.containerd.cri.v1.images). Its CRI streams container events. Its own runc
  shim is named by absolute path in the config, so Debian's shim is never used with it.
  Images go in through Debian's `ctr` for both (the containerd API it uses is the same).

    from nodepulse_dev.containerd import start_containerd
    ctd = start_containerd()            # returns when CRI answers; images imported
    ctd = start_containerd(build="built")
    ctd.endpoint                         # "unix:///tmp/np-ctd-.../containerd.sock"
    ctd.agent_flags                      # what an agent on it is started with
    ctd.runtime_flags                    # the same without the shared host's thresholds
    ...
    ctd.stop()                           # sandboxes, shims, containerd, bridge, files,
                                         # the cgroup root

Each containerd comes with a cgroup root of its own (ctd.cgroup_root, made in every
cgroup hierarchy): an agent started with ctd.agent_flags makes its kubepods there, so
the host's cgroups are left alone and two agents of concurrent runs never take each
other's pod cgroups for orphans.

Config keys follow /work/shared/notes/containerd-cri.md (measured here):
restrict_oom_score_adj is required (root lacks CAP_SYS_RESOURCE), apparmor off,
netns mounts under the state dir, cgroupfs driver.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from nodeagent.pods.cgroupfs import CgroupFs
from nodeagent.pods.cgroups import CgroupError, CgroupValues
from nodeagent.runtime.cri.gen import api_pb2 as pb
from nodeagent.runtime.cri.gen import api_pb2_grpc as pb_grpc
from nodepulse_dev import build as gobuild
from nodepulse_dev import images
from nodepulse_dev.processes import stop_process

CNI_BIN_DIR = Path("/usr/lib/cni")

BUILDS = ("debian", "built")

# A node here shares the host's disks with everything else on the host. The kubelet's
# default thresholds are percentages of those disks, so a host full of other things
# would put this node under DiskPressure (its pods evicted or refused) and its image GC
# would delete the images its pods run. These guard what the node itself needs; image
# GC is off (a high threshold of 100), as kind sets its nodes. A test of eviction or GC
# sets its own, with runtime_flags.
SHARED_HOST_THRESHOLDS = (
    "--eviction-hard=memory.available<100Mi,nodefs.available<1Gi,imagefs.available<1Gi",
    "--image-gc-high-threshold=100")

CONFIG_DEBIAN = """\
version = 2
root = "{root}"
state = "{state}"
plugin_dir = ""

[grpc]
  address = "{sock}"

[ttrpc]
  address = "{ttrpc}"

[debug]
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = "{base}/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false

  # one folder per registry host (hosts.toml: its CA, ...), read at each pull
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{base}/certs.d"

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{runc_root}"
        SystemdCgroup = false
"""

# The same settings in containerd 2.x's layout (keys from its internal/cri/config and
# plugins/cri sources). NRI is off: it would listen on /var/run/nri.
CONFIG_BUILT = """\
version = 3
root = "{root}"
state = "{state}"

[grpc]
  address = "{sock}"

[ttrpc]
  address = "{ttrpc}"

[debug]
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = "{base}/opt"

[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"

  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{sandbox_image}"

  # one folder per registry host (hosts.toml: its CA, ...), read at each pull
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "{base}/certs.d"

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  enable_selinux = false

  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"

  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"

    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "{shim}"

      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        Root = "{runc_root}"
        SystemdCgroup = false
"""


def _cni_conflist(bridge: str, subnet: str, data_dir: Path) -> dict:
    return {
        "cniVersion": "0.4.0",
        "name": "nodepulse",
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge,
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(data_dir),
                    "ranges": [[{"subnet": subnet}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


@dataclass
class Containerd:
    """A running private containerd. Stop it with stop(); it is idempotent."""

    base: Path
    proc: subprocess.Popen[bytes] | None
    bridge: str
    build: str  # one of BUILDS
    program: str  # the containerd executable
    shim: str  # the runc shim executable it starts
    subnet: str = ""  # the pods' addresses (CNI host-local), when networked
    images: dict[str, str] = field(default_factory=dict)  # role -> image name
    keep_files: bool = False

    @property
    def cgroup_root(self) -> str:
        """The cgroup its agents' pods go under (--cgroup-root), made at start."""
        return f"/nodepulse-e2e-{self.base.name}"

    @property
    def runtime_flags(self) -> list[str]:
        """An agent's flags to run its pods here, under cgroup_root."""
        return ["--runtime=cri", f"--container-runtime-endpoint={self.endpoint}",
                f"--cgroup-root={self.cgroup_root}"]

    @property
    def agent_flags(self) -> list[str]:
        """runtime_flags, and the thresholds of a node that shares the host's disk."""
        return [*self.runtime_flags, *SHARED_HOST_THRESHOLDS]

    @property
    def socket(self) -> Path:
        return self.base / "containerd.sock"

    @property
    def endpoint(self) -> str:
        """What --container-runtime-endpoint takes."""
        return f"unix://{self.socket}"

    @property
    def log_path(self) -> Path:
        return self.base / "containerd.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.endpoint)

    def shim_pids(self) -> list[int]:
        """PIDs of the shims this containerd started (they name our socket)."""
        needle = str(self.socket).encode()
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                cmdline = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmdline and needle in cmdline:
                pids.append(int(d.name))
        return pids

    def import_image(self, tar: Path, image: str) -> None:
        images.import_image(tar, image, address=str(self.socket))

    def tag_image(self, image: str, *names: str) -> None:
        """Give an imported image more names (as the upstream tests expect them)."""
        images.tag_image(image, *names, address=str(self.socket))

    def trust_registry(self, host: str, ca: Path) -> None:
        """Pulls from https://`host` (as "127.0.0.1:5000") trust the CA certificate `ca`.
        containerd reads this at each pull: no restart."""
        folder = self.base / "certs.d" / host
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts.toml").write_text(
            f'server = "https://{host}"\n\n[host."https://{host}"]\n'
            f'  capabilities = ["pull", "resolve"]\n  ca = "{ca}"\n')

    def mirror_registry(self, upstream: str, mirror: str, ca: Path,
                        auth: tuple[str, str] | None = None) -> None:
        """Pulls of `upstream`'s images (as "registry.k8s.io") are served by https://`mirror`
        (a local registry holding the same repositories and tags), whose CA is `ca`; with
        `auth`, every request to the mirror carries it as basic auth. Test setup only:
        the names the upstream tests pull resolve here without the internet."""
        folder = self.base / "certs.d" / upstream
        folder.mkdir(parents=True, exist_ok=True)
        text = (f'server = "https://{upstream}"\n\n[host."https://{mirror}"]\n'
                f'  capabilities = ["pull", "resolve"]\n  ca = "{ca}"\n')
        if auth is not None:
            token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
            text += (f'  [host."https://{mirror}".header]\n'
                     f'    Authorization = "Basic {token}"\n')
        (folder / "hosts.toml").write_text(text)

    def remove_all_sandboxes(self, timeout: float = 30.0) -> None:
        """Stop and remove every sandbox (this stops their containers and shims)."""
        with self.channel() as ch:
            rt = pb_grpc.RuntimeServiceStub(ch)
            for sb in rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=timeout).items:
                with contextlib.suppress(grpc.RpcError):
                    rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sb.id),
                                      timeout=timeout)
                with contextlib.suppress(grpc.RpcError):
                    rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sb.id),
                                        timeout=timeout)

    def stop(self, timeout: float = 20.0) -> None:
        """Teardown in the order that leaves nothing behind: sandboxes first (shims
        outlive containerd), containerd by PID, stray shims by PID, the bridge link,
        leftover mounts, then the folder."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(grpc.RpcError):
                self.remove_all_sandboxes()
            shims = self.shim_pids()
            stop_process(self.proc, timeout)
            for pid in shims + self.shim_pids():
                _kill_pid(pid, timeout)
        self.proc = None
        with contextlib.suppress(OSError, CgroupError):  # by now nothing runs in it
            host_cgroups().remove(self.cgroup_root)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, timeout=30)
        _unmount_under(self.base)
        if not self.keep_files:
            shutil.rmtree(self.base, ignore_errors=True)

    def kill_daemon(self, timeout: float = 20.0) -> None:
        """Stop only the containerd process (by PID): shims and containers keep
        running, as when containerd crashes or is upgraded."""
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc, timeout)

    def start_daemon(self, ready_timeout: float = 30.0) -> None:
        """Start containerd again on the same root, state and socket; it recovers
        the sandboxes and containers whose shims still run."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"containerd already runs as pid {self.proc.pid}")
        self.proc = _spawn(self.base, self.program)
        _wait_ready(self, ready_timeout)

    def restart(self, timeout: float = 20.0) -> None:
        self.kill_daemon(timeout)
        self.start_daemon()

    def __enter__(self) -> Containerd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_pid(pid: int, timeout: float) -> None:
    """SIGTERM a process we did not fork (a shim), SIGKILL after `timeout`."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


def _unmount_under(base: Path) -> None:
    """Detach any mount containerd left under `base` (deepest first)."""
    prefix = str(base.resolve()) + "/"
    mounts = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                mounts.append(point)
    libc = ctypes.CDLL(None, use_errno=True)
    for point in sorted(mounts, key=len, reverse=True):
        libc.umount2(point.encode(), 2)  # MNT_DETACH


def free_subnet() -> str:
    """A /24 in 10.88.0.0/16 that no route of the host covers yet. Each containerd gets a
    bridge of its own; two on one subnet (concurrent runs, or a bridge a killed run left
    behind) would route one's pod addresses to the other's bridge. Random, so two
    starting at once rarely pick the same one."""
    routes = subprocess.run(["ip", "-4", "-o", "route", "show"], capture_output=True,
                            text=True, timeout=30).stdout.splitlines()
    taken = [ipaddress.ip_network(r.split()[0], strict=False) for r in routes
             if r.split() and r.split()[0][0].isdigit()]
    candidates = [ipaddress.ip_network(f"10.88.{n}.0/24") for n in range(256)]
    free = [c for c in candidates if not any(c.overlaps(t) for t in taken)]
    if not free:
        raise RuntimeError("no free /24 left in 10.88.0.0/16 for a containerd bridge: "
                           "delete stale np* bridges (ip link delete npXXXXXXXX)")
    return str(random.choice(free))


def programs(build: str) -> tuple[str, str]:
    """Paths of the containerd and runc shim executables of `build` (one of BUILDS);
    the pinned 2.x is built (once, cached) when first asked for."""
    if build not in BUILDS:
        raise ValueError(f"containerd build {build!r}: not one of {', '.join(BUILDS)}")
    found = {tool: shutil.which(tool) for tool in
             ("runc", "ctr", "containerd", "containerd-shim-runc-v2")}
    needed = ["runc", "ctr"] + (["containerd", "containerd-shim-runc-v2"]
                                if build == "debian" else [])
    for tool in needed:
        if found[tool] is None:
            raise RuntimeError(f"{tool} not found: install the apt packages containerd and runc")
    if build == "debian":
        return str(found["containerd"]), str(found["containerd-shim-runc-v2"])
    built = gobuild.ensure(["containerd", "containerd-shim-runc-v2"])
    return str(built["containerd"]), str(built["containerd-shim-runc-v2"])


def start_containerd(*, build: str = "debian", cni: bool = True, subnet: str | None = None,
                     import_images: bool = True, base_dir: Path | None = None,
                     keep_files: bool = False, ready_timeout: float = 30.0) -> Containerd:
    """Start a private containerd and wait until its CRI service answers.

    build: "debian" (1.6, no CRI container events) or "built" (the pinned 2.x).
    cni: write a bridge+portmap conflist (pod networking); without it only
      hostNetwork pods run (NetworkReady=False).
    subnet: the pods' addresses; by default a free one (free_subnet).
    import_images: build (cached) and import PAUSE_IMAGE and BUSYBOX_IMAGE.
    Raises RuntimeError naming the log file if containerd exits or never answers.
    """
    program, shim = programs(build)
    # short path: unix socket paths are limited to 107 bytes
    base = Path(base_dir) if base_dir else Path(tempfile.mkdtemp(prefix="np-ctd-", dir="/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    bridge = "np" + secrets.token_hex(4)
    cni_conf = base / "net.d"
    cni_conf.mkdir(exist_ok=True)
    if cni:
        if not (CNI_BIN_DIR / "bridge").exists():
            raise RuntimeError(f"{CNI_BIN_DIR}/bridge missing: install containernetworking-plugins")
        subnet = subnet or free_subnet()
        conflist = _cni_conflist(bridge, subnet, base / "cni-ipam")
        (cni_conf / "10-nodepulse.conflist").write_text(json.dumps(conflist, indent=2))
    config = base / "config.toml"
    template = CONFIG_DEBIAN if build == "debian" else CONFIG_BUILT
    config.write_text(template.format(
        root=base / "root", state=base / "state", sock=base / "containerd.sock",
        ttrpc=base / "containerd.ttrpc.sock", base=base, sandbox_image=images.PAUSE_IMAGE,
        cni_bin=CNI_BIN_DIR, cni_conf=cni_conf, runc_root=base / "runc", shim=shim))
    ctd = Containerd(base=base, proc=_spawn(base, program), bridge=bridge, build=build,
                     program=program, shim=shim, subnet=subnet or "", keep_files=keep_files)
    try:
        host_cgroups().create(ctd.cgroup_root, CgroupValues())
        _wait_ready(ctd, ready_timeout)
        if import_images:
            for name, tar in images.build_all().items():
                ctd.import_image(tar, name)
            ctd.images = {"pause": images.PAUSE_IMAGE, "busybox": images.BUSYBOX_IMAGE}
    except BaseException:
        ctd.keep_files = True  # keep the log for the failure message
        ctd.stop()
        raise
    return ctd


def host_cgroups() -> CgroupFs:
    return CgroupFs.detect()


def _spawn(base: Path, program: str) -> subprocess.Popen[bytes]:
    with open(base / "containerd.log", "ab") as log:
        return subprocess.Popen([program, "--config", str(base / "config.toml")],
                                stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _wait_ready(ctd: Containerd, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        assert ctd.proc is not None
        if ctd.proc.poll() is not None:
            raise RuntimeError(f"containerd exited with {ctd.proc.returncode}; see {ctd.log_path}")
        if ctd.socket.exists():
            try:
                with ctd.channel() as ch:
                    pb_grpc.RuntimeServiceStub(ch).Version(pb.VersionRequest(), timeout=2)
                return
            except grpc.RpcError as e:
                last = e
        time.sleep(0.1)
    raise RuntimeError(f"containerd CRI not ready after {timeout}s ({last}); see {ctd.log_path}")


def main() -> None:
    """python -m nodepulse_dev.containerd [--no-cni] [--build built]: a private
    containerd in the foreground with the images imported; Ctrl-C (or SIGTERM) tears
    it all down."""
    import argparse
    import threading

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--no-cni", action="store_true", help="hostNetwork pods only")
    ap.add_argument("--build", choices=BUILDS, default="debian",
                    help="Debian's containerd 1.6 or the pinned 2.x built from source")
    args = ap.parse_args()
    ctd = start_containerd(build=args.build, cni=not args.no_cni)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        print(f"containerd pid {ctd.pid}\n  --container-runtime-endpoint={ctd.endpoint}\n"
              f"  images: {', '.join(ctd.images.values())}\n  log: {ctd.log_path}",
              flush=True)
        done.wait()
    finally:
        ctd.stop()


if __name__ == "__main__":
    main()
