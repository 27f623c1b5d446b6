"""The kind node image with nodepulse-agent as its node agent: e2e/kind/node.py's image,
plus a virtual environment of nodepulse for the node's own python3, and `kubelet`
replaced by a wrapper that execs the agent with the kubelet's arguments.

Why a wrapper and not a systemd drop-in: with the kubelet binary gone nothing on the
node can start a kubelet (not the unit, not kubeadm's `systemctl restart kubelet`, not a
drop-in someone adds later): every start of `kubelet` is one of the agent. kind skips
kubeadm's preflight phase, so kubeadm never asks the binary for its version (its
KubeletVersion check would refuse the agent's answer; docs/kubelet-dropin.md). The
wrapper passes first the three settings docs/kubelet-dropin.md asks for; the
kubelet's own flags come after and win.

The venv is made by the node's python3 (a chroot of the node's tree) from a wheel of
this checkout; pip fetches the dependencies from the package index. The image is one
tar under ~/.cache/nodepulse/kind named by a hash of the node image's tar and this
checkout's sources (what the Dockerfile's build context holds).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from e2e.kind import images, node, rootfs
from e2e.kind.docker import Dockerd
from nodepulse_dev import build

VENV = "/opt/nodepulse"
KUBELET_WRAPPER = f"""\
#!/bin/sh
# This node's agent is nodepulse-agent (e2e/kind/agent_node.py): every start of the
# kubelet is one of the agent, with the kubelet's arguments after its own settings.
exec {VENV}/bin/nodepulse-agent --root-dir=/var/lib/kubelet --pod-logs-dir=/var/log/pods \\
    --allow-privileged=true "$@"
"""


def image_name() -> str:
    return f"{node.image_name()}-nodepulse"


def source_hash(repo: Path = images.REPO) -> str:
    """A hash of the sources a wheel of this checkout is built from."""
    h = hashlib.sha256()
    for path in images.build_context(repo):
        h.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def build_wheel(out_dir: Path, repo: Path = images.REPO) -> Path:
    """A wheel of this checkout (no dependencies) in `out_dir`."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                           "-w", str(out_dir), str(repo)],
                          capture_output=True, text=True, timeout=600)
    wheels = sorted(out_dir.glob("nodepulse-*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(f"pip wheel {repo} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return wheels[0]


def install_agent(tree: Path, wheel: Path) -> None:
    """The venv at VENV in `tree`, made by the tree's python3 in a chroot (its /dev and
    /proc mounted in a mount namespace of its own, gone when it exits), with the host's
    DNS and CA certificates for pip while it runs."""
    resolv = tree / "etc/resolv.conf"
    saved = resolv.read_bytes() if resolv.is_file() and not resolv.is_symlink() else None
    stage = tree / "tmp/agent-install"
    stage.mkdir(parents=True)
    try:
        resolv.unlink(missing_ok=True)
        shutil.copy2("/etc/resolv.conf", resolv)
        shutil.copy2(wheel, stage / wheel.name)
        shutil.copy2(images.HOST_CA_BUNDLE, stage / "ca.crt")
        # pip's cache is kept between builds (the dependencies change far less often
        # than the agent): a folder of the host's cache, mounted for the build only
        pip_cache = rootfs.cache_dir() / "pip"
        pip_cache.mkdir(parents=True, exist_ok=True)
        (stage / "pip-cache").mkdir()
        script = (f"mount --rbind /dev {tree}/dev && mount -t proc proc {tree}/proc && "
                  f"mount --bind {pip_cache} {stage}/pip-cache && "
                  f"exec chroot {tree} /bin/sh -ec '"
                  f"python3 -m venv {VENV}; "
                  f"PIP_CERT=/tmp/agent-install/ca.crt PIP_CACHE_DIR=/tmp/agent-install/pip-cache "
                  f"{VENV}/bin/pip install -q --disable-pip-version-check "
                  f"/tmp/agent-install/{wheel.name}; "
                  f"{VENV}/bin/nodepulse-agent --version'")
        # a clean environment: the host's pip and TLS settings name host paths
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-ec",
                               script], capture_output=True, text=True, timeout=1200, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"installing nodepulse in the node image exited "
                               f"{proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        resolv.unlink(missing_ok=True)
        if saved is not None:
            resolv.write_bytes(saved)
    kubelet = tree / "usr/bin/kubelet"
    kubelet.unlink()
    kubelet.write_text(KUBELET_WRAPPER)
    kubelet.chmod(0o755)


def agent_node_tar_path() -> Path:
    """Where the variant's tar is cached (named by its base and this checkout)."""
    key = hashlib.sha256(Path(__file__).read_bytes() + node.node_tar_path().name.encode()
                         + source_hash().encode()).hexdigest()[:12]
    return rootfs.cache_dir() / f"node-nodepulse-{key}.tar"


def agent_node_tar(log: Callable[[str], None] = print) -> Path:
    """The variant's root filesystem as one tar: from the cache, or built."""
    out = agent_node_tar_path()
    if out.exists():
        return out
    base = node.node_tar(log)
    with build.lock_for(out):
        if not out.exists():
            _assemble(out, base, log)
    return out


def _assemble(out: Path, base: Path, log: Callable[[str], None]) -> None:
    started = time.monotonic()
    log(f"assembling the nodepulse kind node image (once per checkout; cached as {out})")
    with tempfile.TemporaryDirectory(prefix="node-nodepulse-", dir=out.parent) as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        subprocess.run(["tar", "-C", str(tree), "--numeric-owner", "-xf", str(base)],
                       check=True, timeout=600)
        install_agent(tree, build_wheel(Path(tmp)))
        partial = out.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(tree), "--numeric-owner", "-cf", str(partial), "."],
                       check=True, timeout=900)
        rootfs.keep_only(out, partial)
    log(f"assembled the nodepulse node image in {time.monotonic() - started:.0f} s")


def load_agent_node_image(engine: Dockerd, log: Callable[[str], None] = print) -> str:
    """The variant in `engine` (imported from the cached tar)."""
    return node.import_node_image(engine, agent_node_tar(log), image_name())
