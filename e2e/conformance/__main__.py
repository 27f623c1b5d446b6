"""python -m e2e.conformance [--only REGEX] [--workers N]: the upstream node specs
against a nodepulse agent on a control plane of its own; writes docs/conformance.md
(unless --only narrows the run) and exits 1 if an expected pass did not pass."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from e2e.conformance import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.conformance", description=__doc__)
    parser.add_argument("--only", help="run only the specs whose name matches (RE)")
    parser.add_argument("--workers", type=int, help="e2e.test processes at a time")
    parser.add_argument("--trial-timeout", type=int,
                        help="seconds for a spec not expected to pass (specs.yaml's default)")
    parser.add_argument("--workdir", type=Path, help="where reports and logs go")
    args = parser.parse_args(argv)
    plan = run.load_plan()
    if args.workers:
        plan = dataclasses.replace(plan, workers=args.workers)
    if args.trial_timeout:
        plan = dataclasses.replace(plan, trial_timeout=args.trial_timeout)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="np-conformance-"))
    results, wall, plan = run.measure(workdir, args.only, plan,
                                      log=lambda m: print(m, file=sys.stderr, flush=True))
    if not args.only:
        run.write_doc(results, plan, wall)
        print(f"wrote {run.DOC}", file=sys.stderr)
    if newly := run.newly_passing(results, plan):
        print("passing but not yet in specs.yaml's expected_pass:\n  " + "\n  ".join(newly),
              file=sys.stderr)
    problems = run.ratchet(results, plan)
    for p in problems:
        print(p, file=sys.stderr)
    print(f"reports and logs: {workdir}; wall time {wall / 60:.1f} min", file=sys.stderr)
    return 1 if problems and not args.only else 0


if __name__ == "__main__":
    sys.exit(main())
