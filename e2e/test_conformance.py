"""The external bar (issue 18): the upstream Kubernetes node e2e specs, run by e2e.test
built from the pinned k8s.io/kubernetes module, against one nodepulse agent on
containerd on a control plane of their own (with the operator), with the upstream
images built here (e2e/conformance/images.py).

Writes docs/conformance.md: every spec, passed or failed or not run, and why not
passed. Fails when a spec that e2e/conformance/specs.yaml expects to pass did not (the
ratchet: the list grows as the agent learns), or when specs.yaml names a spec the
suite no longer has.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from e2e.conformance import run

# e2e.test's first build (about 3 minutes) and the runs (see docs/conformance.md)
pytestmark = pytest.mark.timeout(3600)


def test_upstream_node_conformance() -> None:
    plan = run.load_plan()
    assert plan.expected_pass, "specs.yaml expects no spec to pass: the ratchet is empty"
    workdir = Path(tempfile.mkdtemp(prefix="np-conformance-"))
    results, wall, plan = run.measure(workdir, plan=plan)
    run.write_doc(results, plan, wall)
    counts = {s: sum(r.status == s for r in results) for s in (run.PASSED, run.FAILED)}
    print(f"conformance: {counts[run.PASSED]} passed, {counts[run.FAILED]} failed of "
          f"{len(results)} in {wall / 60:.1f} min; reports in {workdir}")
    if newly := run.newly_passing(results, plan):
        print("passing but not yet in specs.yaml's expected_pass:\n  " + "\n  ".join(newly))
    problems = run.ratchet(results, plan)
    assert not problems, "\n".join(problems) + f"\n(reports and logs in {workdir})"
    shutil.rmtree(workdir, ignore_errors=True)
