"""The external bar (issue 18): the upstream Kubernetes node e2e specs, run by e2e.test
built from the pinned k8s.io/kubernetes module, against one nodepulse agent on
containerd on a control plane of their own (with the operator), with the upstream
images built here (e2e/conformance/images.py).

`make test` runs the sample of e2e/conformance/specs.yaml, one quick spec of each group
of its ratchet, and fails when one of them does not pass, or when specs.yaml names a
spec the suite no longer has. The whole run, which checks the whole ratchet and writes
docs/conformance.md, is `python -m e2e.conformance` (docs/conformance.md).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from e2e.conformance import run

# e2e.test's first build (about 3 minutes) and the sample
pytestmark = pytest.mark.timeout(3600)


def test_upstream_node_conformance_sample() -> None:
    plan = run.load_plan()
    assert plan.sample, "specs.yaml has no sample"
    assert set(plan.sample) <= set(plan.expected_pass), \
        f"sampled but not in the ratchet: {sorted(set(plan.sample) - set(plan.expected_pass))}"
    workdir = Path(tempfile.mkdtemp(prefix="np-conformance-"))
    results, wall, plan = run.measure(workdir, plan=plan, names=plan.sample)
    ran = {r.spec: r for r in results if r.spec in plan.sample}
    print(f"conformance sample: {sum(r.status == run.PASSED for r in ran.values())} passed "
          f"of {len(ran)} in {wall / 60:.1f} min; reports in {workdir}")
    problems = [f"{r.status}: {r.spec}: {r.reason}" for r in ran.values()
                if r.status != run.PASSED]
    problems += [f"the suite does not list: {s}" for s in plan.sample if s not in ran]
    problems += [p for p in run.ratchet(results, plan) if "does not list" in p]
    assert not problems, "\n".join(problems) + f"\n(reports and logs in {workdir})"
    shutil.rmtree(workdir, ignore_errors=True)
