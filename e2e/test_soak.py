"""The soak's short run (issue 43): bench.soak's machinery for 150 s of chaos on the
session's local control plane, with the seed whose schedule injects every kind of fault
at least once (tests/test_bench_soak.py checks that it does): API server SIGKILL and
SIGSTOP, etcd restart and compaction, containerd restart, agent SIGKILL (the containerd
node's and the virtual nodes'), operator leader SIGKILL, a network cut and a slow disk,
often overlapping, under churn. Every invariant must hold (bench/soak/observe.py says
which); the report is printed. `python -m bench.soak` is the hour-long run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak.run import SoakConfig, run_soak
from bench.soak.schedule import KINDS, kinds_of
from nodepulse_dev import Cluster, LocalCluster

SHORT = SoakConfig(seed=1, minutes=2.5, mean_gap=15, sample_every=20, settle=120)


@pytest.mark.timeout(900)  # start-up, 150 s of chaos, up to 120 s to settle, teardown
def test_short_soak_every_invariant_holds(cluster: Cluster, tmp_path: Path) -> None:
    assert isinstance(cluster, LocalCluster), \
        "the soak kills and pauses the control plane's processes: it needs the local one"
    assert kinds_of(SHORT.faults()) == set(KINDS)
    try:
        report = run_soak(cluster, SHORT, tmp_path / "soak")
    finally:
        cluster.ensure_running()  # later modules share this control plane
    text = report.render()
    print("\n" + text)
    assert not report.disk.startswith("not injected"), f"the slow disk: {report.disk}"
    assert report.held, text
