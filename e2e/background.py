"""What the tests that run last need and the cache lacks, made ahead while the tests
before them run (e2e/conftest.py starts this as `python -m e2e.background NAME...` when
they are in the run; docs/development.md): the Go programs, busybox, and the kind
tests' root filesystems and node images.

One thing at a time, in the order of steps() (the order in which the reordered suite
first needs each), at the idle CPU scheduling class (SCHED_IDLE, which compilers,
debootstrap and tar inherit), so it takes only what the tests leave of the CPU. Each is
made under a lock (Go programs and busybox: the build lock, let go of between two; each
image tar: its own), so a test that needs one now either makes it itself or waits for
this one to finish it, never both at once. The first failure ends it (its log says
which); the test that needs that thing then makes it itself and shows the error.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from e2e.kind import agent_node, node
from e2e.kind import images as kind_images
from nodepulse_dev import build, images

# the Go programs in the order the suite first needs each, busybox (the first containerd
# test's image) ahead of all but the control plane's
GO_PROGRAMS = [
    "helm", "metrics-server", "registry", "crane",
    "containerd", "containerd-shim-runc-v2",
    "e2e.test", "agnhost", "nonewprivs", "sample-apiserver", "coredns",
    "kind", "kubelet", "kubeadm", "kube-proxy", "crictl"]


def steps() -> list[tuple[str, Path, Callable[[], object]]]:
    """(name, the cached file it makes, how to make it), in the order they are made."""
    def go(name: str) -> tuple[str, Path, Callable[[], object]]:
        return name, build.TOOLS[name].path, lambda: build.ensure([name])
    return [*(go(n) for n in build.SETUP),
            ("busybox", images.busybox_path(), images.upstream_busybox),
            *(go(n) for n in GO_PROGRAMS),
            ("kind python base", kind_images.python_base_path(), kind_images.python_base_tar),
            ("kind node image", node.node_tar_path(), node.node_tar),
            ("kind nodepulse node image", agent_node.agent_node_tar_path(),
             agent_node.agent_node_tar)]


def missing() -> list[str]:
    return [name for name, out, _ in steps() if not out.exists()]


def main(names: list[str]) -> int:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    for name, out, make in steps():
        if name in names and not out.exists():
            started = time.monotonic()
            print(f"making {name}", flush=True)
            make()
            print(f"made {name} in {time.monotonic() - started:.0f} s", flush=True)
            time.sleep(1)  # the lock free for a moment: a test waiting for it goes first
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
