"""A kind cluster on the private Docker engine, made from e2e/kind/kind-config.yaml.

    with HostSysctls(), start_dockerd() as engine:
        cluster = KindCluster.create(engine, workdir)   # nodes Ready, pods networked
        ...
        cluster.delete()

The pod network is the one kind installs from the node image
(/kind/manifests/default-cni.yaml: e2e/kind/podnet.py, in kindnet's place).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from e2e.kind import node
from e2e.kind.docker import Dockerd
from nodepulse_dev import build

CONFIG = Path(__file__).parent / "kind-config.yaml"


def load_config(path: Path = CONFIG, image: str | tuple[str, ...] | None = None
                ) -> dict[str, Any]:
    """The kind config, checked against what the suite builds: every node runs a
    node image made here (`image`: node.py's, unless variants are named), and etcd's
    tag is the version of the suite's etcd."""
    allowed = (image,) if isinstance(image, str) else image or (node.image_name(),)
    cfg: dict[str, Any] = yaml.safe_load(path.read_text())
    for n in cfg["nodes"]:
        if n.get("image") not in allowed:
            raise RuntimeError(f"{path}: node image {n.get('image')!r} is not the one "
                               f"the suite builds ({' or '.join(allowed)})")
    patches = "\n".join(cfg.get("kubeadmConfigPatches", []))
    if f"imageTag: {node.ETCD_IMAGE_TAG}" not in patches:
        raise RuntimeError(f"{path}: the ClusterConfiguration patch must set etcd's "
                           f"imageTag to {node.ETCD_IMAGE_TAG} (nodepulse_dev/gomod/etcd)")
    if cfg.get("networking", {}).get("disableDefaultCNI"):
        raise RuntimeError(f"{path}: networking.disableDefaultCNI would leave the pods "
                           "without the node image's pod network (e2e/kind/podnet.py)")
    return cfg


class HostSysctls:
    """The host's kernel tunables, restored if a privileged node changed any.

    The node image keeps the kubelet's writes private (e2e/kind/node.py); this is the
    check that it worked and the net if something else writes: every writable entry
    under /proc/sys/{kernel,vm,fs} is read before and after. `changed` says what
    differed at exit (it is restored)."""

    ROOTS = ("kernel", "vm", "fs")
    VOLATILE = ("kernel/ns_last_pid", "kernel/random/", "fs/dentry-state", "fs/file-nr",
                "fs/inode-", "kernel/sched_domain/")

    def __init__(self) -> None:
        self.before: dict[str, str] = {}
        self.changed: dict[str, tuple[str, str]] = {}

    @classmethod
    def read(cls) -> dict[str, str]:
        values = {}
        base = Path("/proc/sys")
        for root in cls.ROOTS:
            for path in (base / root).rglob("*"):
                key = str(path.relative_to(base))
                if key.startswith(cls.VOLATILE):
                    continue
                try:
                    if not path.is_file() or not path.stat().st_mode & 0o200:
                        continue
                    values[key] = path.read_text()
                except OSError:
                    continue
        return values

    def __enter__(self) -> HostSysctls:
        self.before = self.read()
        return self

    def restore(self) -> dict[str, tuple[str, str]]:
        after = self.read()
        changed = {k: (v, after[k]) for k, v in self.before.items()
                   if k in after and after[k] != v}
        for key, (value, _) in changed.items():
            with contextlib.suppress(OSError):
                (Path("/proc/sys") / key).write_text(value)
        self.changed.update(changed)
        return changed

    def __exit__(self, *exc: object) -> None:
        self.restore()


class KindCluster:
    """A kind cluster of the private engine, reached through its own kubeconfig."""

    def __init__(self, engine: Dockerd, workdir: Path, name: str) -> None:
        self.engine = engine
        self.workdir = workdir
        self.name = name
        self.kubeconfig = workdir / f"{name}.kubeconfig"
        self.kind = build.ensure(["kind"], log=lambda _: None)["kind"]
        self.kubectl_bin = build.ensure(["kubectl"], log=lambda _: None)["kubectl"]

    def run_kind(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(self.kind), *args], capture_output=True, text=True,
                              timeout=timeout, env=self.engine.env())
        if proc.returncode != 0:
            raise RuntimeError(f"kind {' '.join(args)} exited {proc.returncode}:\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return proc

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True,
                timeout: float = 180) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(self.kubectl_bin), "--kubeconfig", str(self.kubeconfig),
                               *args], input=stdin, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} exited {proc.returncode}:\n"
                               f"{proc.stdout}\n{proc.stderr}")
        return proc

    @classmethod
    def create(cls, engine: Dockerd, workdir: Path, log: Callable[[str], None] = print,
               config: Path = CONFIG, image: str | tuple[str, ...] | None = None
               ) -> KindCluster:
        cfg = load_config(config, image)
        cluster = cls(engine, workdir, cfg["name"])
        started = time.monotonic()
        try:
            cluster.run_kind("create", "cluster", "--config", str(config),
                             "--kubeconfig", str(cluster.kubeconfig), "--retain")
            log(f"kind create cluster: {time.monotonic() - started:.0f} s")
            cluster.kubectl("wait", "--for=condition=Ready", "node", "--all", "--timeout=180s",
                            timeout=200)
            log(f"kind cluster {cluster.name} Ready: {time.monotonic() - started:.0f} s")
        except BaseException:
            cluster.save_logs()
            cluster.delete()
            raise
        return cluster

    def nodes(self) -> list[str]:
        return self.run_kind("get", "nodes", "--name", self.name).stdout.split()

    def node_exec(self, node_name: str, *cmd: str, stdin: str | None = None) -> str:
        proc = subprocess.run(["docker", "exec", "-i", node_name, *cmd], input=stdin,
                              capture_output=True, text=True, timeout=60,
                              env=self.engine.env())
        if proc.returncode != 0:
            raise RuntimeError(f"{node_name}: {' '.join(cmd)} exited {proc.returncode}: "
                               f"{proc.stderr.strip()}")
        return proc.stdout

    def save_logs(self) -> None:
        """kind's export of every node's logs (journal, containers), for a failure."""
        with contextlib.suppress(Exception):
            self.run_kind("export", "logs", str(self.workdir / "kind-logs"), "--name",
                          self.name, timeout=300)

    def delete(self) -> None:
        self.run_kind("delete", "cluster", "--name", self.name,
                      "--kubeconfig", str(self.kubeconfig))
