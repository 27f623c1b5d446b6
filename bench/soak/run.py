"""One soak: the rig started, the churn and the checks running, the seeded faults
injected lane by lane (a thread each), then the final state awaited and judged, the
report written. Used by `python -m bench.soak` and by e2e/test_soak.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.soak import rules
from bench.soak.observe import INVARIANTS, Observer, Violation, slopes
from bench.soak.rig import Rig
from bench.soak.schedule import Fault, kinds_of, schedule
from bench.soak.workload import NAMESPACE, Churn
from e2e.harness.waits import eventually
from nodepulse_dev import LocalCluster


@dataclass
class SoakConfig:
    seed: int
    minutes: float  # the chaos window (faults and churn); the final wait comes after
    virtual_nodes: int = 200
    mean_gap: float = 150.0  # seconds between two faults of one lane, on average
    bound: float = 90.0  # seconds after the last fault by which pods must be right
    settle: float = 180.0  # at most this long for the final state after the chaos
    check_every: float = 5.0
    sample_every: float = 60.0
    without: tuple[str, ...] = ()  # fault kinds left out

    def faults(self) -> list[Fault]:
        return schedule(self.seed, self.minutes * 60, mean_gap=self.mean_gap,
                        without=frozenset(self.without))


@dataclass
class Report:
    config: SoakConfig
    started: float
    chaos_started: float = 0.0  # wall clock: times in the report count from here
    chaos_seconds: float = 0.0
    settle_seconds: float = 0.0
    injected: list[rules.Injected] = field(default_factory=list)
    checks: dict[str, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    resources: list[dict[str, object]] = field(default_factory=list)
    churn_done: dict[str, int] = field(default_factory=dict)
    churn_failed: dict[str, int] = field(default_factory=dict)
    disk: str = ""
    skipped_rounds: int = 0
    errors: list[str] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)  # the machine's load average (1 min) at start, end
    leftovers: list[str] = field(default_factory=list)
    workdir: str = ""
    logs: list[str] = field(default_factory=list)  # where every program's log is

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Report:
        """A report as report.json holds it (to render it again)."""
        fields = {k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(cls)}}
        fields["config"] = SoakConfig(**{**data["config"],
                                         "without": tuple(data["config"].get("without", ()))})
        fields["injected"] = [rules.Injected(**f) for f in data["injected"]]
        fields["violations"] = [Violation(**v) for v in data["violations"]]
        fields["load"] = tuple(data["load"])
        return cls(**fields)

    @property
    def held(self) -> bool:
        return not self.violations and not self.leftovers

    def render(self, markdown: bool = False) -> str:
        return render(self, markdown)


def run_soak(cluster: LocalCluster, cfg: SoakConfig, workdir: Path,
             log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)
             ) -> Report:
    faults = cfg.faults()
    log(f"soak: seed {cfg.seed}, {cfg.minutes:g} min of chaos, {len(faults)} faults of "
        f"{len(kinds_of(faults))} kinds; work folder {workdir}")
    rig = Rig(cluster, workdir, cfg.virtual_nodes, log)
    report = Report(cfg, time.time(), workdir=str(workdir), load=(_load(), 0.0),
                    logs=[str(rig.logs), str(cluster.log_dir)])
    churn: Churn | None = None
    observer: Observer | None = None
    try:
        rig.start()
        report.disk = rig.disk_note
        churn = Churn(cluster.api_client(), rig.pools, rig.cri_name, cfg.seed)
        churn.setup()
        eventually(churn.available, "the workload available before the chaos", 300, every=2)
        timeline = rules.Timeline(time.time())
        report.chaos_started = timeline.t0
        observer = Observer(rig, timeline, bound=cfg.bound, check_every=cfg.check_every,
                            sample_every=cfg.sample_every)
        observer.start()
        churn.start()
        log(f"soak: {len(rig.nodes())} nodes up; chaos starts")
        stop = threading.Event()
        lanes = [threading.Thread(target=_lane, args=(rig, timeline, [f for f in faults
                                                                      if f.lane == lane],
                                                       stop, log),
                                  daemon=True, name=f"soak-lane-{lane}")
                 for lane in dict.fromkeys(f.lane for f in faults)]
        for t in lanes:
            t.start()
        try:
            for t in lanes:
                while t.is_alive():
                    t.join(1)
        except BaseException:
            stop.set()  # each lane undoes its fault and returns
            for t in lanes:
                t.join(120)
            raise
        report.chaos_seconds = time.time() - timeline.t0
        churn.stop()  # the final state is the one the last actions asked for
        log(f"soak: chaos over after {report.chaos_seconds:.0f}s; waiting for the final state")
        report.settle_seconds = observer.final(cfg.settle)
    finally:
        if churn is not None:
            churn.stop()
            report.churn_done, report.churn_failed = dict(churn.done), dict(churn.failed)
        if observer is not None:
            observer.stop()
            report.injected = observer.timeline.faults
            report.checks = dict(observer.checks)
            report.violations = sorted(observer.violations, key=lambda v: v.at)
            report.skipped_rounds = observer.skipped
            report.errors = observer.errors[-20:]
            report.resources = _resources(observer)
        rig.restore()
        report.leftovers = rig.stop(NAMESPACE if churn is not None else None)
        report.load = (report.load[0], _load())
    (workdir / "report.json").write_text(json.dumps(asdict(report), indent=1, default=str))
    (workdir / "report.md").write_text(report.render(markdown=True))
    return report


def _lane(rig: Rig, timeline: rules.Timeline, faults: list[Fault], stop: threading.Event,
          log: Callable[[str], None]) -> None:
    """Inject one lane's faults at their times (later, if the one before took longer)."""
    for f in faults:
        if stop.wait(max(0.0, timeline.t0 + f.at - time.time())):
            return
        rec = rules.Injected(f.kind, time.time(), math.inf)
        timeline.faults.append(rec)
        log(f"soak: +{rec.start - timeline.t0:.0f}s {f.describe()}")
        try:
            rec.note = rig.fault(f.kind)(f.hold, f.delay, stop)
        except Exception as e:  # the fault could not be carried out or undone: say so
            rec.note = f"failed: {e!r}"[:300]
            log(f"soak: {f.kind} failed: {e!r}")
            rig.restore()
        rec.end = time.time()


def _resources(observer: Observer) -> list[dict[str, object]]:
    """Per program: its incarnations, and the slopes over the longest one."""
    by_role: dict[str, list[list]] = {}
    for (role, _pid), ss in sorted(observer.proc_samples.items()):
        by_role.setdefault(role, []).append(ss)
    out: list[dict[str, object]] = []
    for role, lives in sorted(by_role.items()):
        longest = max(lives, key=lambda ss: (ss[-1].t - ss[0].t, len(ss)))
        half = longest[0].t + (longest[-1].t - longest[0].t) / 2
        out.append({"process": role, "incarnations": len(lives), "samples": len(longest),
                    "minutes": (longest[-1].t - longest[0].t) / 60,
                    "first": asdict(longest[0]), "last": asdict(longest[-1]),
                    "slope_per_hour": slopes(longest),
                    # past the warm-up (the start's allocations, the first pods): a leak
                    # still climbs there, a warm-up has levelled off
                    "second_half_slope_per_hour": slopes([x for x in longest if x.t >= half]),
                    "series": [asdict(x) for x in longest]})
    return out


def _load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return math.nan


# ---- the report
SHOWN = 8  # violations listed per invariant


def render(r: Report, markdown: bool = False) -> str:
    t0 = r.chaos_started or r.started
    lines: list[str] = []

    def table(head: list[str], rows: list[list[str]]) -> None:
        if markdown:
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "---|" * len(head))
            lines.extend("| " + " | ".join(row) + " |" for row in rows)
        else:
            widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
            for row in [head, *rows]:
                lines.append("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)))
        lines.append("")

    cfg = r.config
    lines.append(f"seed {cfg.seed}, {cfg.minutes:g} min of chaos ({r.chaos_seconds:.0f}s), "
                 f"final state after {r.settle_seconds:.0f}s; {cfg.virtual_nodes} virtual "
                 f"nodes + 1 containerd node; load average {r.load[0]:.1f} at the start, "
                 f"{r.load[1]:.1f} at the end (2 cores); slow disk: {r.disk}")
    lines.append("")
    kinds = Counter(f.kind for f in r.injected)
    held: dict[str, float] = {}
    failed = Counter(f.kind for f in r.injected if f.note.startswith("failed"))
    for f in r.injected:
        held[f.kind] = held.get(f.kind, 0.0) + f.end - f.start
    table(["fault", "injected", "seconds held (total)", "failed to inject"],
          [[k, str(n), f"{held[k]:.0f}", str(failed[k])] for k, n in sorted(kinds.items())])
    overlapping = sum(1 for f in r.injected
                      if any(g is not f and g.start < f.end and f.start < g.end
                             for g in r.injected))
    lines.append(f"{len(r.injected)} faults, {overlapping} of them overlapping another; "
                 f"churn actions done {sum(r.churn_done.values())}, refused or failed "
                 f"(API down) {sum(r.churn_failed.values())}")
    lines.append("")
    by_inv = Counter(v.invariant for v in r.violations)
    rows = []
    for key, text in INVARIANTS.items():
        v = next((v for v in r.violations if v.invariant == key), None)
        rows.append([text, str(r.checks.get(key, 0)), str(by_inv[key]),
                     f"first: {v.obj} at +{v.at - t0:.0f}s" if v else "held"])
    table(["invariant", "checks", "violations", "result"], rows)
    if r.violations:
        lines.append(f"violations (the first {SHOWN} of each invariant; all of them in "
                     "report.json):")
        for key in INVARIANTS:
            mine = [v for v in r.violations if v.invariant == key]
            for v in mine[:SHOWN]:
                lines.append(f"- [{v.invariant}] {v.obj} at +{v.at - t0:.0f}s: {v.detail}; "
                             f"last faults before: {'; '.join(v.faults_before) or 'none'}")
            if len(mine) > SHOWN:
                lines.append(f"- [{key}] ... and {len(mine) - SHOWN} more")
        lines.append("")
    rows = []
    for res in r.resources:
        first, last, sl = res["first"], res["last"], res["slope_per_hour"]
        late = res.get("second_half_slope_per_hour") or {}
        assert isinstance(first, dict) and isinstance(last, dict) and isinstance(sl, dict)
        assert isinstance(late, dict)
        rows.append([str(res["process"]), str(res["incarnations"]),
                     f"{res['minutes']:.0f} min, {res['samples']} samples",
                     *(_change(first.get(n), last.get(n), sl.get(n), late.get(n), fmt)
                       for n, fmt in (("rss_mb", "{:.1f}"), ("threads", "{:.0f}"),
                                      ("fds", "{:.0f}"), ("tasks", "{:.0f}")))])
    table(["process", "incarnations", "longest", "RSS MB (slope; second half)", "threads",
           "open files", "asyncio tasks"], rows)
    if r.leftovers:
        lines.append(f"left running after the stop (killed): {', '.join(r.leftovers)}")
    if r.skipped_rounds:
        lines.append(f"{r.skipped_rounds} check rounds could not run (API or runtime down); "
                     f"last reasons: {'; '.join(r.errors[-3:])}")
    lines.append(f"result: {'every invariant held' if r.held else 'VIOLATED'}; logs in "
                 f"{' and '.join(r.logs)}")
    return "\n".join(lines)


def _change(a: float | None, b: float | None, slope: float | None, late: float | None,
            fmt: str) -> str:
    """first -> last (slope per hour; over the second half)."""
    if a is None or b is None:
        return "n/a"

    def per_hour(x: float | None) -> str:
        return "n/a" if x is None else f"{x:+.1f}"
    return f"{fmt.format(a)} -> {fmt.format(b)} ({per_hour(slope)}/h; {per_hour(late)}/h)"
