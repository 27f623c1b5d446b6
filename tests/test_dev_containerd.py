"""The flags an agent on a private containerd is started with (nodepulse_dev/containerd.py)."""

from __future__ import annotations

from pathlib import Path

from nodepulse_dev.containerd import Containerd
from tests.conftest import agent_config

GIB = 1024 ** 3


def _ctd(tmp_path: Path) -> Containerd:
    return Containerd(base=tmp_path / "np-ctd-x", proc=None, bridge="npbr0", build="debian",
                      program="containerd", shim="containerd-shim-runc-v2")


def test_a_node_sharing_the_host_disk_guards_sizes_not_percentages(tmp_path: Path) -> None:
    """A host full of other things must not put the node under DiskPressure or have its
    images collected: every threshold is an absolute size, image GC is off."""
    cfg = agent_config(tmp_path, "--node-name", "n1", *_ctd(tmp_path).agent_flags)
    assert cfg.runtime == "cri"
    assert {signal: (a.value, a.percent) for signal, a in cfg.eviction_hard.items()} == {
        "memory.available": (100 * 1024 ** 2, None), "nodefs.available": (GIB, None),
        "imagefs.available": (GIB, None)}
    assert cfg.image_gc_high_threshold == 100


def test_the_runtime_flags_leave_the_thresholds_to_the_test(tmp_path: Path) -> None:
    ctd = _ctd(tmp_path)
    assert not any(f.startswith(("--eviction", "--image-gc")) for f in ctd.runtime_flags)
    cfg = agent_config(tmp_path, "--node-name", "n1", *ctd.runtime_flags)
    assert cfg.image_gc_high_threshold == 85
    assert cfg.eviction_hard["imagefs.available"].percent == 15
