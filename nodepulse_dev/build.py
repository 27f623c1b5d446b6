"""Builds the pinned control-plane programs (and the test programs: the upstream e2e
suite, its agnhost, an image registry) from their Go modules, once per version.

The pins are the `require` of each gomod/<folder>/go.mod; binaries land in
~/.cache/nodepulse/bin/<version>/, so a second run builds nothing. Builds run one at a
time on the machine (the build lock), since a Go build takes every core.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

GOMOD = Path(__file__).parent / "gomod"


def cache_root() -> Path:
    return Path(os.environ.get("NODEPULSE_CACHE", Path.home() / ".cache" / "nodepulse"))


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str  # the binary's name
    gomod: str  # folder under gomod/
    package: str  # Go package path of its main
    module: str  # the Go module whose pinned version names the cache folder
    test: bool = False  # a test binary of `package` (`go test -c`), not a main
    tags: str = ""  # Go build tags, comma-separated

    @property
    def version(self) -> str:
        return pinned_version(self.gomod, self.module)

    @property
    def path(self) -> Path:
        return cache_root() / "bin" / self.version / self.name


K8S_TOOLS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl",
             # the kind node image's (e2e/kind/node.py)
             "kubelet", "kubeadm", "kube-proxy")
TOOLS = {t.name: t for t in [
    Tool("etcd", "etcd", "go.etcd.io/etcd/server/v3", "go.etcd.io/etcd/server/v3"),
    *(Tool(n, "kubernetes", f"k8s.io/kubernetes/cmd/{n}", "k8s.io/kubernetes") for n in K8S_TOOLS),
    Tool("helm", "helm", "helm.sh/helm/v3/cmd/helm", "helm.sh/helm/v3"),
    # only the scale benchmark needs KWOK, so tests and setup do not build it
    Tool("kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok", "sigs.k8s.io/kwok"),
    # the kind tests (e2e/kind) build these when they first run
    Tool("kind", "kind", "sigs.k8s.io/kind", "sigs.k8s.io/kind"),
    Tool("crictl", "cri-tools", "sigs.k8s.io/cri-tools/cmd/crictl", "sigs.k8s.io/cri-tools"),
    Tool("coredns", "coredns", "github.com/coredns/coredns", "github.com/coredns/coredns"),
    # `kubectl top` on nodepulse nodes (e2e/test_kubelet_api.py)
    Tool("metrics-server", "metrics-server", "sigs.k8s.io/metrics-server/cmd/metrics-server",
         "sigs.k8s.io/metrics-server"),
    # the upstream e2e suite and the programs of the images its node tests run
    # (e2e/conformance); built when those tests first run, not by setup
    Tool("e2e.test", "kubernetes", "k8s.io/kubernetes/test/e2e", "k8s.io/kubernetes",
         test=True),
    Tool("agnhost", "kubernetes", "k8s.io/kubernetes/test/images/agnhost", "k8s.io/kubernetes"),
    Tool("nonewprivs", "kubernetes", "k8s.io/kubernetes/test/images/nonewprivs",
         "k8s.io/kubernetes"),
    # the Aggregator spec's API server (the module the Kubernetes module pins)
    Tool("sample-apiserver", "kubernetes", "k8s.io/sample-apiserver", "k8s.io/kubernetes"),
    # an image registry and a client that pushes to it (nodepulse_dev/registry.py)
    Tool("registry", "registry", "github.com/distribution/distribution/v3/cmd/registry",
         "github.com/distribution/distribution/v3"),
    Tool("crane", "registry", "github.com/google/go-containerregistry/cmd/crane",
         "github.com/google/go-containerregistry"),
    # containerd 2.x, the CRI runtime with container events (nodepulse_dev/containerd.py);
    # without cgo, so without the btrfs snapshotter (the only cgo plugin), and without the
    # zfs and devmapper snapshotters nobody here uses. The shim has no gRPC server (ttrpc
    # only), as containerd's own release build makes it.
    Tool("containerd", "containerd", "github.com/containerd/containerd/v2/cmd/containerd",
         "github.com/containerd/containerd/v2",
         tags="urfave_cli_no_docs,no_btrfs,no_zfs,no_devmapper"),
    Tool("containerd-shim-runc-v2", "containerd",
         "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
         "github.com/containerd/containerd/v2", tags="urfave_cli_no_docs,no_grpc"),
]}
# What `make setup` builds: the control plane and kubectl, which every e2e test and
# `make run` start with. The others are built when first needed (`nodepulse-dev up`
# builds metrics-server before it starts; the e2e suite builds its own in the background
# while its earlier tests run, e2e/conftest.py).
SETUP = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"]


def pinned_version(gomod: str, module: str) -> str:
    text = (GOMOD / gomod / "go.mod").read_text()
    m = re.search(rf"^(?:require)?\s*{re.escape(module)} (v\S+)", text, re.M)
    if not m:
        raise RuntimeError(f"gomod/{gomod}/go.mod: {module} is not required")
    return m.group(1)


def kubernetes_version() -> str:
    return pinned_version("kubernetes", "k8s.io/kubernetes")


def _ldflags(tool: Tool) -> str:
    flags = "-s -w"
    if tool.gomod == "kubernetes":
        # Without these the binaries report v0.0.0, which kubectl's skew check and
        # the API server's compatibility version both reject or warn about.
        v = tool.version
        major, minor = v.lstrip("v").split(".")[:2]
        pkg = "k8s.io/component-base/version"
        flags += (f" -X {pkg}.gitVersion={v} -X {pkg}.gitMajor={major}"
                  f" -X {pkg}.gitMinor={minor} -X {pkg}.gitTreeState=clean")
    elif tool.gomod == "containerd":
        pkg = "github.com/containerd/containerd/v2/version"
        flags += f" -X {pkg}.Version={tool.version}"
    elif tool.name == "helm":
        flags += f" -X helm.sh/helm/v3/internal/version.version={tool.version}"
        # As helm's own release build does: the Kubernetes version helm assumes when it
        # has no cluster to ask (`helm template`, `helm lint`) is the one of the
        # client-go it was built with (v0.X.Y -> 1.X), not its source default of 1.20.
        minor = pinned_version("helm", "k8s.io/client-go").split(".")[1]
        for pkg in ("helm.sh/helm/v3/pkg/chartutil", "helm.sh/helm/v3/pkg/lint/rules"):
            flags += f" -X {pkg}.k8sVersionMajor=1 -X {pkg}.k8sVersionMinor={minor}"
    return flags


# The Go compiler's own garbage collector target while building: a cold build is mostly
# compiling, and collecting a quarter as often makes it faster for more memory
# (docs/development.md); a GOGC already set is kept
BUILD_GOGC = "400"


def go_env() -> dict[str, str]:
    root = cache_root()
    return {"GOGC": BUILD_GOGC, **os.environ,
            "GOMODCACHE": str(root / "gomod"), "GOCACHE": str(root / "go-build"),
            "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local", "CGO_ENABLED": "0"}


def ensure(names: list[str] | None = None, log=print) -> dict[str, Path]:
    """Paths of the named binaries (by default SETUP's), building those not cached yet,
    one build at a time."""
    tools = [TOOLS[n] for n in (names or SETUP)]
    missing = [t for t in tools if not t.path.is_file()]
    if missing and not shutil.which("go"):
        raise RuntimeError("the Go toolchain is needed to build "
                           + ", ".join(t.name for t in missing) + " (`go` not on PATH)")
    with _build_lock() if missing else contextlib.nullcontext():
        for tool in missing:
            if not tool.path.is_file():  # built by another process while we waited
                _build(tool, log)
    return {t.name: t.path for t in tools}


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    """One Go build at a time on this machine: two `make setup`s (or test runs) at once
    would each build the same binaries, on the same few cores, twice as slowly."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def lock_for(out: Path) -> Iterator[None]:
    """Held while one process makes the cached file `out` (an image's root filesystem):
    another that wants it too waits, then finds it made (the caller looks again)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def build_at_idle_priority(names: list[str], log=print) -> None:
    """Builds `names` one at a time, in that order, on what other work leaves of the CPU:
    at the idle scheduling class (SCHED_IDLE, which the compilers inherit). Between two
    builds it lets go of the build lock for a moment, so a process that needs a program
    now takes the lock first and builds it at its own priority."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    for name in names:
        ensure([name], log=log)
        time.sleep(1)


def _build(tool: Tool, log) -> None:
    tool.path.parent.mkdir(parents=True, exist_ok=True)
    partial = tool.path.with_suffix(".partial")
    log(f"building {tool.name} {tool.version} (once; cached in {tool.path.parent})")
    started = time.monotonic()
    verb = ["test", "-c"] if tool.test else ["build"]
    if tool.tags:
        verb += ["-tags", tool.tags]
    subprocess.run(["go", *verb, "-ldflags", _ldflags(tool), "-o", str(partial),
                    tool.package], cwd=GOMOD / tool.gomod, env=go_env(), check=True)
    partial.rename(tool.path)  # only a finished build is ever seen as cached
    log(f"built {tool.name} in {time.monotonic() - started:.0f} s")
