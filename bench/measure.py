"""What the scale benchmark measures, as plain functions of metric texts and /proc:
counter readings from the API server's and etcd's own Prometheus metrics, their
deltas, per node-minute arithmetic, and the tables. No I/O here except /proc reads,
so the arithmetic is unit-tested (tests/test_bench_scale.py).

CPU seconds and the identity-lease watcher come from bench/heartbeat.py (cpu_seconds,
OtherLeaseWrites); they, with its rss_mb, could move here, and heartbeat.py could read
its writes and body bytes through write_counts/body_bytes."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# etcd 3.6: bytes of key-values put (what the API server stores), and bytes appended
# to the write-ahead log (puts plus raft overhead).
ETCD_PUT_BYTES = "etcd_debugging_mvcc_total_put_size_in_bytes"
ETCD_WAL_BYTES = "etcd_disk_wal_write_bytes_total"
ETCD_PUTS = "etcd_mvcc_put_total"


def _samples(text: str, name: str) -> Iterable[tuple[dict[str, str], float]]:
    # The API server exposes megabytes of metrics; parse only the lines of `name`.
    lines = [ln for ln in text.splitlines() if ln.startswith((name + "{", name + " "))]
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for s in family.samples:
            if s.name == name:
                yield s.labels, s.value


def write_counts(apiserver_text: str) -> dict[str, float]:
    """apiserver_request_total for write verbs, keyed "resource[/subresource] VERB"."""
    out: dict[str, float] = {}
    for labels, value in _samples(apiserver_text, "apiserver_request_total"):
        if labels.get("verb") not in WRITE_VERBS or not labels.get("resource"):
            continue
        res = labels["resource"] + (f"/{labels['subresource']}" if labels.get("subresource") else "")
        key = f"{res} {labels['verb']}"
        out[key] = out.get(key, 0.0) + value
    return out


def body_bytes(apiserver_text: str) -> dict[str, float]:
    """Request body bytes (apiserver_request_body_size_bytes_sum), keyed "resource verb"
    (v1.35 labels it by resource and lower-case verb, without subresource)."""
    out: dict[str, float] = {}
    for labels, value in _samples(apiserver_text, "apiserver_request_body_size_bytes_sum"):
        key = f"{labels.get('resource', '')} {labels.get('verb', '')}"
        out[key] = out.get(key, 0.0) + value
    return out


def body_count(apiserver_text: str, resource: str, verb: str) -> float:
    return sum(v for labels, v in _samples(apiserver_text, "apiserver_request_body_size_bytes_count")
               if labels.get("resource") == resource and labels.get("verb") == verb)


def etcd_counters(etcd_text: str) -> dict[str, float]:
    out = {}
    for name in (ETCD_PUT_BYTES, ETCD_WAL_BYTES, ETCD_PUTS):
        values = [v for _, v in _samples(etcd_text, name)]
        if not values:
            raise ValueError(f"etcd metrics: {name} is missing (is this etcd 3.5+?)")
        out[name] = sum(values)
    return out


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """after - before per key (a key first seen after counts from 0). A counter that
    went down was reset (its process restarted): the window is void, so say so."""
    out = {}
    for key in set(before) | set(after):
        d = after.get(key, 0.0) - before.get(key, 0.0)
        if d < 0:
            raise ValueError(f"counter {key!r} went down ({before.get(key)} -> "
                             f"{after.get(key)}): its process restarted during the window")
        out[key] = d
    return out


def per_node_minute(value: float, nodes: int, seconds: float) -> float:
    if nodes <= 0 or seconds <= 0:
        raise ValueError(f"per node-minute needs nodes > 0 and seconds > 0 "
                         f"(nodes={nodes}, seconds={seconds})")
    return value / (nodes * seconds / 60.0)


def net(value: float, background_rate: float, seconds: float) -> float:
    """`value` over a window of `seconds` less the idle cluster's own rate; never
    below zero (the idle rate is an estimate)."""
    return max(0.0, value - background_rate * seconds)


# ---- /proc
def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"/proc/{pid}/status has no VmHWM line")


# ---- results and tables
# "before": nodepulse's settings on another build of the agent (--before-agent)
SUBJECT_ORDER = ("nodepulse", "before", "legacy", "kwok")
RATIO_PAIRS = (("nodepulse", "before"), ("nodepulse", "legacy"), ("nodepulse", "kwok"),
               ("before", "kwok"))


@dataclass
class Result:
    subject: str  # one of SUBJECT_ORDER
    nodes: int
    seconds: float  # measured window
    writes: float  # API write requests per node-minute
    body_bytes: float  # request body bytes per node-minute
    etcd_put_bytes: float  # per node-minute
    etcd_wal_bytes: float  # per node-minute
    subject_cpu: float  # CPU seconds per node-minute of the agent (or kwok)
    apiserver_cpu: float  # per node-minute, idle cluster's own use taken out
    etcd_cpu: float  # per node-minute, idle use taken out
    subject_rss_mb: float  # peak, all its processes
    apiserver_rss_mb: float
    etcd_rss_mb: float
    processes: int = 1  # processes the subject ran
    stale_max: int = 0  # most nodes seen at once without a fresh heartbeat
    by_resource: dict[str, float] = field(default_factory=dict)  # writes per node-minute


COLUMNS: list[tuple[str, str, str]] = [
    # (header, attribute, format)
    ("writes", "writes", "{:.2f}"),
    ("req bytes", "body_bytes", "{:,.0f}"),
    ("etcd put B", "etcd_put_bytes", "{:,.0f}"),
    ("etcd WAL B", "etcd_wal_bytes", "{:,.0f}"),
    ("subj CPU s", "subject_cpu", "{:.4f}"),
    ("apisrv CPU s", "apiserver_cpu", "{:.4f}"),
    ("etcd CPU s", "etcd_cpu", "{:.4f}"),
    ("subj RSS MB", "subject_rss_mb", "{:.0f}"),
    ("apisrv RSS MB", "apiserver_rss_mb", "{:.0f}"),
    ("etcd RSS MB", "etcd_rss_mb", "{:.0f}"),
]
RATIO_ATTRS = ("writes", "body_bytes", "etcd_put_bytes", "etcd_wal_bytes", "subject_cpu",
               "apiserver_cpu", "etcd_cpu", "subject_rss_mb")


def ordered(results: Iterable[Result]) -> list[Result]:
    def key(r: Result) -> tuple[int, int]:
        rank = SUBJECT_ORDER.index(r.subject) if r.subject in SUBJECT_ORDER else len(SUBJECT_ORDER)
        return r.nodes, rank
    return sorted(results, key=key)


def ratio(a: float, b: float) -> float:
    """a/b; nan when b is zero (a ratio to nothing says nothing)."""
    return a / b if b else math.nan


def ratios(results: Iterable[Result], num: str, den: str) -> dict[int, dict[str, float]]:
    """For every node count where both subjects ran: attribute -> num/den."""
    by = {(r.subject, r.nodes): r for r in results}
    out: dict[int, dict[str, float]] = {}
    for (subject, n), a in sorted(by.items(), key=lambda kv: kv[0][1]):
        b = by.get((den, n))
        if subject == num and b is not None:
            out[n] = {attr: ratio(getattr(a, attr), getattr(b, attr)) for attr in RATIO_ATTRS}
    return out


def _fmt_ratio(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.3g}"


def render_text(results: Iterable[Result]) -> str:
    rows = ordered(results)
    head = ["subject", "nodes", "min", *(h for h, _, _ in COLUMNS), "stale"]
    body = [[r.subject, str(r.nodes), f"{r.seconds / 60:.1f}",
             *(fmt.format(getattr(r, attr)) for _, attr, fmt in COLUMNS), str(r.stale_max)]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
             for row in [head, *body]]
    lines.insert(1, "-" * len(lines[0]))
    for num, den in RATIO_PAIRS:
        for n, rs in ratios(rows, num, den).items():
            lines.append(f"{num}/{den} N={n}: " + ", ".join(
                f"{attr} {_fmt_ratio(x)}" for attr, x in rs.items()))
    return "\n".join(lines)


def render_markdown(results: Iterable[Result]) -> str:
    rows = ordered(results)
    head = ["subject", "nodes", "window min", "processes", *(h for h, _, _ in COLUMNS),
            "stale max"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join([r.subject, str(r.nodes), f"{r.seconds / 60:.1f}",
                                      str(r.processes),
                                      *(fmt.format(getattr(r, a)) for _, a, fmt in COLUMNS),
                                      str(r.stale_max)]) + " |")
    for num, den in RATIO_PAIRS:
        rs = ratios(rows, num, den)
        if not rs:
            continue
        out += ["", f"**{num} / {den}** (below 1: {num} costs less)", "",
                "| nodes | " + " | ".join(RATIO_ATTRS) + " |",
                "|" + "---|" * (len(RATIO_ATTRS) + 1)]
        for n, by_attr in rs.items():
            out.append(f"| {n} | " + " | ".join(_fmt_ratio(by_attr[a]) for a in RATIO_ATTRS)
                       + " |")
    keys = sorted({k for r in rows for k in r.by_resource})
    if keys:
        out += ["", "**Write requests per node-minute by resource and verb** "
                "(API server's identity lease taken out)", "",
                "| subject | nodes | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 2)]
        for r in rows:
            out.append(f"| {r.subject} | {r.nodes} | "
                       + " | ".join(f"{r.by_resource.get(k, 0.0):.2f}" for k in keys) + " |")
    return "\n".join(out)


# ---- pod churn
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by the nearest-rank method; nan for no values."""
    return _nearest_rank(sorted(values), q)


def _nearest_rank(ordered_values: list[float], q: float) -> float:
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, not {q}")
    if not ordered_values:
        return math.nan
    # rounded first: 99.9 / 100 * 1000 is a hair over 999 in floating point
    rank = max(1, math.ceil(round(q * len(ordered_values) / 100, 9)))
    return ordered_values[rank - 1]


@dataclass
class ChurnResult:
    subject: str
    nodes: int
    pods: int  # replicas asked for
    running: int  # pods seen Running before the timeout
    all_running_s: float  # Deployment created -> last pod Running (nan if not all)
    p50_s: float  # per pod: first seen by the watch -> seen Running
    p99_s: float
    subject_cpu_s: float  # over the churn, all its processes
    apiserver_cpu_s: float
    subject_rss_mb: float
    # the Job phase (after the Deployment): completions asked for, done, seconds from
    # the Job's creation to its last completion (nan: not run, or not all done)
    job_pods: int = 0
    job_succeeded: int = 0
    job_s: float = math.nan
    node_p50_s: float = math.nan  # per pod: first seen bound to a node -> seen Running
    node_p99_s: float = math.nan
    round: int = 1  # the subject's n-th phase in this run
    # per pod seen Running, in seconds: first seen -> Running, bound -> Running
    startup_s: list[float] = field(default_factory=list)
    node_startup_s: list[float] = field(default_factory=list)
    # the API server's write requests over the Deployment's churn, every client's,
    # keyed as write_counts keys them
    writes: dict[str, float] = field(default_factory=dict)
    body: dict[str, float] = field(default_factory=dict)  # request bytes, as body_bytes keys


def _s(x: float, fmt: str = "{:.2f}") -> str:
    return "n/a" if math.isnan(x) else fmt.format(x)


def render_rounds(results: Iterable[ChurnResult]) -> list[str]:
    """For a subject run more than once: its p99s, and each round's nodepulse/KWOK ratio.

    One round's p99 of a few thousand pods is about its 30 slowest, and for any subject
    those are the first burst's, whose length moves from run to run with the control
    plane; rounds show that spread next to the difference between the subjects."""
    by: dict[tuple[str, int], list[float]] = {}
    for r in results:
        by.setdefault((r.subject, r.nodes), []).append(r.p99_s)
    lines = []
    for (subject, nodes), p99s in by.items():
        if len(p99s) > 1:
            known = [x for x in p99s if not math.isnan(x)]
            median = statistics.median(known) if known else math.nan
            lines.append(f"{subject} N={nodes}: p99 s by round "
                         + " ".join(_s(x, "{:.3f}") for x in p99s)
                         + f"; median {_s(median, '{:.3f}')}")
    for nodes in sorted({n for _, n in by}):
        ours, kwok = by.get(("nodepulse", nodes), []), by.get(("kwok", nodes), [])
        if len(ours) < 2 or len(kwok) < 2:
            continue
        pairs = [ratio(a, b) for a, b in zip(ours, kwok, strict=False)]
        under = sum(1 for x in pairs if x <= 1.0)
        lines.append(f"nodepulse/kwok N={nodes}: p99 ratio by round "
                     + " ".join(_fmt_ratio(x) for x in pairs)
                     + f"; at or under KWOK's in {under} of {len(pairs)}")
    return lines


def render_churn(results: Iterable[ChurnResult], markdown: bool = False) -> str:
    head = ["subject", "round", "nodes", "pods", "running", "all Running s", "p50 s", "p99 s",
            "node p50 s", "node p99 s", "subject CPU s", "apiserver CPU s", "subject RSS MB",
            "job pods", "succeeded", "job s"]
    rows = [[r.subject, str(r.round), str(r.nodes), str(r.pods), str(r.running),
             _s(r.all_running_s, "{:.1f}"), _s(r.p50_s), _s(r.p99_s),
             _s(r.node_p50_s, "{:.3f}"), _s(r.node_p99_s, "{:.3f}"),
             f"{r.subject_cpu_s:.1f}", f"{r.apiserver_cpu_s:.1f}", f"{r.subject_rss_mb:.0f}",
             str(r.job_pods), str(r.job_succeeded), _s(r.job_s, "{:.1f}")]
            for r in results]
    return "\n".join(table(head, rows, markdown))


def render_churn_writes(results: Iterable[ChurnResult], markdown: bool = False,
                        field: str = "writes", fmt: str = "{:.2f}") -> str:
    """A ChurnResult's counts `field` ("writes": requests, "body": request bytes) per pod
    asked for, by resource and verb, the median of each subject's rounds: what the
    subject's part of the API server's CPU is made of."""
    groups = by_subject(results)
    counts = {key: [getattr(r, field) for r in rs] for key, rs in groups.items()}
    keys = sorted({k for cs in counts.values() for c in cs for k in c})
    head = ["subject", "nodes", "rounds", *keys, "all"]
    rows = []
    for (subject, nodes), rs in groups.items():
        per_pod = [{k: v / r.pods for k, v in c.items()}
                   for c, r in zip(counts[subject, nodes], rs, strict=True)]
        for p in per_pod:
            p["all"] = sum(p.values())
        rows.append([subject, str(nodes), str(len(rs)),
                     *(fmt.format(statistics.median(p.get(k, 0.0) for p in per_pod))
                       for k in [*keys, "all"])])
    return "\n".join(table(head, rows, markdown))


# ---- rounds pooled: the startup distribution over all rounds and a bootstrap interval
POOLED_QS = (50.0, 90.0, 99.0, 99.9)
INTERVAL_QS = (50.0, 99.0)
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 41
BOOTSTRAP_LEVEL = 0.95


def percentiles(values: list[float], qs: Iterable[float]) -> list[float]:
    """percentile() of `values` at each of `qs`, sorting once."""
    ordered_values = sorted(values)
    return [_nearest_rank(ordered_values, q) for q in qs]


def round_sample(r: ChurnResult, node_part: bool = False) -> list[float]:
    """One round's per-pod startup seconds, a pod never seen Running counted as slower
    than any (inf): leaving it out would make a round that did not finish look fast."""
    seen = r.node_startup_s if node_part else r.startup_s
    return [*seen, *[math.inf] * max(0, r.pods - r.running)]


def pool(samples: Iterable[list[float]]) -> list[float]:
    """All rounds' pods in one sample."""
    return [x for sample in samples for x in sample]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(min, median, max); nans for no values."""
    if not values:
        return math.nan, math.nan, math.nan
    return min(values), statistics.median(values), max(values)


@dataclass
class Interval:
    """num/den of a percentile of the pooled startup, and its bootstrap interval."""
    num: str
    den: str
    nodes: int
    q: float
    ratio: float
    low: float
    high: float

    @property
    def verdict(self) -> str:
        """"met": num's percentile is under den's (the whole interval below 1);
        "missed": over it (the whole interval above 1); "tie": the interval holds 1."""
        if math.isnan(self.low) or math.isnan(self.high):
            return "n/a"
        if self.high < 1.0:
            return "met"
        if self.low > 1.0:
            return "missed"
        return "tie"


def bootstrap_ratio(num: list[list[float]], den: list[list[float]], qs: Iterable[float],
                    resamples: int = BOOTSTRAP_RESAMPLES, level: float = BOOTSTRAP_LEVEL,
                    seed: int = BOOTSTRAP_SEED) -> dict[float, tuple[float, float, float]]:
    """For each q: (ratio, low, high), the ratio of num's pooled q-th percentile to den's,
    and its two-sided `level` percentile interval.

    Each argument is one subject's rounds, each a list of per-pod seconds. A resample
    draws whole rounds with replacement, each subject's independently, and pools the
    drawn rounds' pods: a round's pods share one control plane and its first burst, so
    they are not independent draws, and the round is what varies from run to run (its
    burst sets the slowest pods). Resampling pods within rounds would treat a round's
    30 slowest pods as 30 chances and give an interval too narrow for that. With few
    rounds the interval is still somewhat narrow (a resample of k rounds varies about
    (k-1)/k as much as new rounds would), and a subject with one round has no spread
    to draw from: its interval is nan. So is one that a resample cannot give a ratio
    (a zero percentile, or an infinite one on both sides)."""
    qs = list(qs)
    if not num or not den:
        raise ValueError("bootstrap_ratio needs at least one round of each subject")
    if resamples <= 0 or not 0 < level < 1:
        raise ValueError(f"bootstrap_ratio: resamples={resamples} must be > 0 and "
                         f"level={level} within (0, 1)")
    rng = random.Random(seed)
    # pre-sorted rounds: a pool of sorted runs sorts in little more than one merge
    num_sorted, den_sorted = [sorted(r) for r in num], [sorted(r) for r in den]

    def ratios_of(a: list[list[float]], b: list[list[float]]) -> list[float]:
        return [ratio(x, y) for x, y in
                zip(percentiles(pool(a), qs), percentiles(pool(b), qs), strict=True)]

    point = ratios_of(num_sorted, den_sorted)
    if len(num) < 2 or len(den) < 2:
        return {q: (x, math.nan, math.nan) for q, x in zip(qs, point, strict=True)}
    drawn: list[list[float]] = [[] for _ in qs]
    for _ in range(resamples):
        a = [num_sorted[i] for i in rng.choices(range(len(num)), k=len(num))]
        b = [den_sorted[i] for i in rng.choices(range(len(den)), k=len(den))]
        for column, x in zip(drawn, ratios_of(a, b), strict=True):
            column.append(x)
    tail = (1 - level) / 2 * 100
    out = {}
    for q, x, column in zip(qs, point, drawn, strict=True):
        if any(math.isnan(v) for v in column):
            out[q] = (x, math.nan, math.nan)
        else:
            out[q] = (x, percentile(column, tail), percentile(column, 100 - tail))
    return out


@dataclass
class Pooled:
    """One subject at one node count over all its rounds."""
    subject: str
    nodes: int
    rounds: int
    pods: int  # asked for, all rounds
    not_running: int  # never seen Running (counted as the slowest)
    startup_s: dict[str, float]  # "p50" -> seconds, of all rounds' pods together
    node_startup_s: dict[str, float]
    # (min, median, max) over the rounds
    subject_cpu_s: tuple[float, float, float]
    apiserver_cpu_s: tuple[float, float, float]
    subject_rss_mb: tuple[float, float, float]


def _label(q: float) -> str:
    return f"p{q:g}"


def by_subject(results: Iterable[ChurnResult]) -> dict[tuple[str, int], list[ChurnResult]]:
    """Rounds grouped by (subject, nodes), each group in the order it ran."""
    out: dict[tuple[str, int], list[ChurnResult]] = {}
    for r in results:
        out.setdefault((r.subject, r.nodes), []).append(r)
    return out


def pooled(results: Iterable[ChurnResult]) -> list[Pooled]:
    out = []
    for (subject, nodes), rs in by_subject(results).items():
        startup = percentiles(pool(round_sample(r) for r in rs), POOLED_QS)
        node = percentiles(pool(round_sample(r, node_part=True) for r in rs), POOLED_QS)
        out.append(Pooled(
            subject=subject, nodes=nodes, rounds=len(rs), pods=sum(r.pods for r in rs),
            not_running=sum(max(0, r.pods - r.running) for r in rs),
            startup_s={_label(q): x for q, x in zip(POOLED_QS, startup, strict=True)},
            node_startup_s={_label(q): x for q, x in zip(POOLED_QS, node, strict=True)},
            subject_cpu_s=spread([r.subject_cpu_s for r in rs]),
            apiserver_cpu_s=spread([r.apiserver_cpu_s for r in rs]),
            subject_rss_mb=spread([r.subject_rss_mb for r in rs])))
    return out


def intervals(results: Iterable[ChurnResult], resamples: int = BOOTSTRAP_RESAMPLES,
              level: float = BOOTSTRAP_LEVEL, seed: int = BOOTSTRAP_SEED) -> list[Interval]:
    """The bootstrap interval of each RATIO_PAIRS ratio of the pooled startup p50 and
    p99, at every node count where both subjects ran."""
    groups = by_subject(results)
    out = []
    for nodes in sorted({n for _, n in groups}):
        for num, den in RATIO_PAIRS:
            a, b = groups.get((num, nodes)), groups.get((den, nodes))
            if not a or not b:
                continue
            found = bootstrap_ratio([round_sample(r) for r in a], [round_sample(r) for r in b],
                                    INTERVAL_QS, resamples, level, seed)
            out += [Interval(num, den, nodes, q, *found[q]) for q in INTERVAL_QS]
    return out


def table(head: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                *("| " + " | ".join(r) + " |" for r in rows)]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
             for row in [head, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def _spread(x: tuple[float, float, float], fmt: str) -> str:
    return "/".join(_s(v, fmt) for v in x)


def render_pooled(pools: list[Pooled], found: list[Interval], markdown: bool = False,
                  level: float = BOOTSTRAP_LEVEL) -> str:
    """Three tables: the pooled startup percentiles, each ratio's interval and verdict,
    and the spread of each round's CPU and memory."""
    labels = [_label(q) for q in POOLED_QS]
    head = ["subject", "nodes", "rounds", "pods", "not Running",
            *(f"{x} s" for x in labels), "node p50 s", "node p99 s"]
    rows = [[p.subject, str(p.nodes), str(p.rounds), str(p.pods), str(p.not_running),
             *(_s(p.startup_s[x], "{:.3f}") for x in labels),
             _s(p.node_startup_s["p50"], "{:.3f}"), _s(p.node_startup_s["p99"], "{:.3f}")]
            for p in pools]
    lines = table(head, rows, markdown)
    if found:
        head = ["nodes", "ratio", "percentile", "pooled ratio", f"{level:.0%} interval",
                "verdict"]
        rows = [[str(i.nodes), f"{i.num}/{i.den}", _label(i.q), _fmt_ratio(i.ratio),
                 f"[{_fmt_ratio(i.low)}, {_fmt_ratio(i.high)}]", i.verdict] for i in found]
        lines += ["", *table(head, rows, markdown)]
    head = ["subject", "nodes", "subject CPU s min/med/max", "apiserver CPU s min/med/max",
            "subject RSS MB min/med/max"]
    rows = [[p.subject, str(p.nodes), _spread(p.subject_cpu_s, "{:.1f}"),
             _spread(p.apiserver_cpu_s, "{:.1f}"), _spread(p.subject_rss_mb, "{:.0f}")]
            for p in pools]
    return "\n".join([*lines, "", *table(head, rows, markdown)])
