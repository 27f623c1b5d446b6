"""python -m e2e.conformance: the upstream e2e specs against nodepulse.

    python -m e2e.conformance [--only RE]          # the node specs, local control plane
    python -m e2e.conformance --suite conformance --cluster kind --node-agent nodepulse
    python -m e2e.conformance --suite conformance --cluster kind --node-agent kubelet

The node specs (specs.yaml) run against one agent on a control plane of their own and
write their section of docs/conformance.md; the whole [Conformance] suite
(conformance.yaml) runs on a kind cluster whose every node runs the named node agent
and writes that agent's column (e2e/conformance/results/) and the page's side-by-side
table. A run narrowed by --only writes no doc. Exits 1 if an expected pass did not pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import tempfile
from pathlib import Path

from e2e.conformance import run

PLANS = {"node": run.SPECS_FILE, "conformance": Path(__file__).with_name("conformance.yaml")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.conformance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(PLANS), default="node",
                        help="the node specs (specs.yaml) or all [Conformance] specs "
                             "(conformance.yaml)")
    parser.add_argument("--cluster", choices=["local", "kind"], default="local",
                        help="one agent on the local control plane, or a kind cluster")
    parser.add_argument("--node-agent", choices=["nodepulse", "kubelet"], default="nodepulse",
                        help="what runs every kind node (the kubelet: the control column)")
    parser.add_argument("--only", help="run only the specs whose name matches (RE)")
    parser.add_argument("--sample", action="store_true",
                        help="run only the plan's sample (what make test runs)")
    parser.add_argument("--workers", type=int, help="e2e.test processes at a time")
    parser.add_argument("--trial-timeout", type=int,
                        help="seconds for a spec not expected to pass (the plan's default)")
    parser.add_argument("--workdir", type=Path, help="where reports and logs go")
    parser.add_argument("--keep-logs", action="store_true",
                        help="kind: export the nodes' logs into the workdir at the end")
    args = parser.parse_args(argv)
    if args.cluster == "local" and args.node_agent != "nodepulse":
        parser.error("--node-agent kubelet needs --cluster kind (the local control plane "
                     "runs nodepulse agents only)")
    plan = run.load_plan(PLANS[args.suite])
    if args.workers:
        plan = dataclasses.replace(plan, workers=args.workers)
    if args.trial_timeout:
        plan = dataclasses.replace(plan, trial_timeout=args.trial_timeout)
    if args.sample and not plan.sample:
        parser.error(f"{plan.name} has no sample")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="np-conformance-"))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    names = plan.sample if args.sample else None
    narrowed = bool(args.only or args.sample)
    if args.cluster == "kind":
        from e2e.conformance import kind

        command = "python -m e2e.conformance " + shlex.join(sys.argv[1:] if argv is None
                                                            else argv)
        column = not narrowed and args.suite == "conformance"

        def progress(so_far: list[run.Result], wall: float) -> None:
            # a run of hours that stops leaves its partial column and table
            kind.save_column(args.node_agent, so_far, wall, command, partial=True)
            kind.write_columns_doc()

        results, wall = kind.measure(args.node_agent, workdir, plan, args.only, names, log,
                                     args.keep_logs, progress if column else None)
        if column:
            path = kind.save_column(args.node_agent, results, wall, command, partial=False)
            kind.write_columns_doc()
            log(f"wrote {path} and {run.DOC}")
    else:
        results, wall, plan = run.measure(workdir, args.only, plan, log=log, names=names)
        if not narrowed and args.suite == "node":
            run.write_doc(results, plan, wall)
            log(f"wrote {run.DOC}")
    if newly := run.newly_passing(results, plan):
        log(f"passing but not yet in {plan.name}'s expected_pass:\n  " + "\n  ".join(newly))
    problems = run.ratchet(results, plan, narrowed)
    for p in problems:
        log(p)
    log(f"reports and logs: {workdir}; wall time {wall / 60:.1f} min")
    return 1 if problems and not narrowed else 0


if __name__ == "__main__":
    sys.exit(main())
