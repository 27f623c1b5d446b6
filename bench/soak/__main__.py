"""An hour of chaos on the local control plane: steady churn, seeded random faults that
overlap, and the invariants checked all the way (bench/soak/).

    python -m bench.soak [--minutes 60] [--seed N] [--virtual-nodes 200]
    python -m bench.soak --render WORKDIR/report.json

The seed is printed (a random one unless given); the same seed and minutes inject the
same faults at the same times. The control plane and the logs of every program are kept
in the work folder printed at the end; the report is written there too (report.md,
report.json) and, with --write-docs, to docs/benchmarks/soak.md. Exits 1 when an
invariant was violated.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.soak.run import Report, SoakConfig, run_soak
from nodepulse_dev import LocalCluster

ROOT = Path(__file__).resolve().parents[2]


def rerun_command(parser: argparse.ArgumentParser, args: argparse.Namespace, seed: int) -> str:
    """The command that injects the same faults at the same times: the seed, the minutes
    and every option the schedule or its targets depend on that is not its default."""
    words = [f"--minutes {args.minutes:g}", f"--seed {seed}"]
    for name in ("virtual_nodes", "mean_gap", "without"):
        value = getattr(args, name)
        if value != parser.get_default(name):
            shown = f"{value:g}" if isinstance(value, float) else value
            words.append(f"--{name.replace('_', '-')} {shown}")
    return f"{parser.prog} {' '.join(words)}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0,
                        help="minutes of chaos (faults and churn); the final wait follows")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one")
    parser.add_argument("--virtual-nodes", type=int, default=200)
    parser.add_argument("--mean-gap", type=float, default=150.0,
                        help="seconds between two faults on one target, on average")
    parser.add_argument("--sample-every", type=float, default=60.0,
                        help="seconds between two samples of each program's resources")
    parser.add_argument("--without", default="", metavar="KIND,...",
                        help="fault kinds to leave out, e.g. agent-kill,virtual-agent-kill,"
                             "operator-leader-kill for a run that measures leaks")
    parser.add_argument("--write-docs", action="store_true",
                        help="write the report to docs/benchmarks/soak.md")
    parser.add_argument("--render", type=Path, metavar="REPORT_JSON",
                        help="only print the report a run wrote (report.json) again")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.render is not None:
        report = Report.from_json(json.loads(args.render.read_text()))
        print(report.render(markdown=True))
        return 0 if report.held else 1
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    print(f"soak seed: {seed} ({rerun_command(parser, args, seed)})", flush=True)
    cfg = SoakConfig(seed=seed, minutes=args.minutes, virtual_nodes=args.virtual_nodes,
                     mean_gap=args.mean_gap, sample_every=args.sample_every,
                     without=tuple(k for k in args.without.split(",") if k))
    try:
        cfg.faults()
    except ValueError as e:
        parser.error(f"--without: {e}")
    workdir = Path(tempfile.mkdtemp(prefix="nodepulse-soak-"))
    cluster = LocalCluster(workdir / "cluster")
    try:
        cluster.up(log=lambda m: print(m, file=sys.stderr))
        report = run_soak(cluster, cfg, workdir / "soak")
    finally:
        cluster.down()  # by PID; its state and logs stay in the work folder
    text = report.render()
    print(text)
    if args.write_docs:
        command = (f"python -m bench.soak --minutes {args.minutes:g} --seed {seed}"
                   + (f" --virtual-nodes {args.virtual_nodes}" if args.virtual_nodes != 200
                      else "") + (f" --without {args.without}" if args.without else ""))
        (ROOT / "docs" / "benchmarks" / "soak.md").write_text(
            f"# Soak: {args.minutes:g} minutes of chaos\n\n"
            f"`{command}`, run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(report.started))}"
            f" (see [../soak.md](../soak.md) for what it does).\n\n"
            + report.render(markdown=True) + "\n")
    return 0 if report.held else 1


if __name__ == "__main__":
    sys.exit(main())
