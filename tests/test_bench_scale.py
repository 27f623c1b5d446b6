"""The scale benchmark's arithmetic: counters read from Prometheus text, their deltas,
per node-minute figures, ratios and the rendered tables. No timings asserted."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from kubernetes import client

from bench import measure
from bench.scale import TTL_ANNOTATION, without_ttl

API_BEFORE = """\
# HELP apiserver_request_total [STABLE] Counter of apiserver requests.
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",resource="leases",subresource="",verb="PUT"} 100
apiserver_request_total{code="409",resource="leases",subresource="",verb="PUT"} 2
apiserver_request_total{code="200",resource="nodes",subresource="status",verb="PATCH"} 10
apiserver_request_total{code="200",resource="nodes",subresource="",verb="LIST"} 999
apiserver_request_total{code="200",resource="",subresource="/readyz",verb="GET"} 5
# HELP apiserver_request_body_size_bytes
# TYPE apiserver_request_body_size_bytes histogram
apiserver_request_body_size_bytes_bucket{resource="leases",verb="update",le="+Inf"} 102
apiserver_request_body_size_bytes_sum{resource="leases",verb="update"} 40800
apiserver_request_body_size_bytes_count{resource="leases",verb="update"} 102
apiserver_request_body_size_bytes_sum{resource="nodes",verb="patch"} 5000
apiserver_request_body_size_bytes_count{resource="nodes",verb="patch"} 10
"""

ETCD = """\
# TYPE etcd_debugging_mvcc_total_put_size_in_bytes gauge
etcd_debugging_mvcc_total_put_size_in_bytes 181968
# TYPE etcd_disk_wal_write_bytes_total gauge
etcd_disk_wal_write_bytes_total 225528
# TYPE etcd_mvcc_put_total counter
etcd_mvcc_put_total 248
"""


def test_write_counts_keep_write_verbs_by_resource_and_subresource() -> None:
    assert measure.write_counts(API_BEFORE) == {"leases PUT": 102.0,
                                                "nodes/status PATCH": 10.0}


def test_body_bytes_and_counts_by_resource_and_verb() -> None:
    assert measure.body_bytes(API_BEFORE) == {"leases update": 40800.0, "nodes patch": 5000.0}
    assert measure.body_count(API_BEFORE, "leases", "update") == 102.0
    assert measure.body_count(API_BEFORE, "nodes", "update") == 0.0


def test_etcd_counters_read_and_missing_one_named() -> None:
    assert measure.etcd_counters(ETCD) == {measure.ETCD_PUT_BYTES: 181968.0,
                                           measure.ETCD_WAL_BYTES: 225528.0,
                                           measure.ETCD_PUTS: 248.0}
    with pytest.raises(ValueError, match="etcd_disk_wal_write_bytes_total"):
        measure.etcd_counters(ETCD.replace("etcd_disk_wal", "etcd_other"))


def test_delta_counts_new_keys_from_zero_and_refuses_a_reset() -> None:
    assert measure.delta({"a": 1.0, "b": 5.0}, {"a": 4.0, "b": 5.0, "c": 2.0}) == \
        {"a": 3.0, "b": 0.0, "c": 2.0}
    with pytest.raises(ValueError, match="'a' went down"):
        measure.delta({"a": 10.0}, {"a": 3.0})


def test_per_node_minute_and_net_of_background() -> None:
    # 600 writes by 10 nodes in 120 s = 30 per node-minute
    assert measure.per_node_minute(600, 10, 120) == 30.0
    assert measure.per_node_minute(5, 1000, 300) == pytest.approx(0.001)
    with pytest.raises(ValueError, match="nodes=0"):
        measure.per_node_minute(1, 0, 60)
    with pytest.raises(ValueError, match="seconds=0"):
        measure.per_node_minute(1, 1, 0)
    assert measure.net(1000, 2.0, 300) == 400.0  # 2/s idle over 300 s
    assert measure.net(100, 2.0, 300) == 0.0  # never below zero


def test_peak_rss_of_this_process() -> None:
    import os
    assert measure.peak_rss_mb(os.getpid()) > 1.0


def result(subject: str, nodes: int, writes: float, body: float = 100.0,
           cpu: float = 0.01) -> measure.Result:
    return measure.Result(subject=subject, nodes=nodes, seconds=300.0, writes=writes,
                          body_bytes=body, etcd_put_bytes=body * 2, etcd_wal_bytes=body * 3,
                          subject_cpu=cpu, apiserver_cpu=0.002, etcd_cpu=0.0,
                          subject_rss_mb=80.0, apiserver_rss_mb=300.0, etcd_rss_mb=50.0,
                          by_resource={"leases PUT": writes})


def test_ratios_pair_subjects_at_the_same_node_count() -> None:
    rs = [result("kwok", 100, 6.0, body=300.0), result("nodepulse", 100, 6.0, body=150.0),
          result("legacy", 100, 6.0, body=1500.0), result("nodepulse", 500, 6.0)]
    to_legacy = measure.ratios(rs, "nodepulse", "legacy")
    assert list(to_legacy) == [100]  # 500 has no legacy phase
    assert to_legacy[100]["body_bytes"] == pytest.approx(0.1)
    assert to_legacy[100]["writes"] == 1.0
    assert math.isnan(to_legacy[100]["etcd_cpu"])  # 0/0 says nothing
    assert measure.ratios(rs, "nodepulse", "kwok")[100]["body_bytes"] == 0.5


def test_tables_order_rows_and_show_ratios() -> None:
    rs = [result("kwok", 10, 6.0), result("legacy", 10, 6.0, body=1000.0),
          result("nodepulse", 10, 6.0)]
    text = measure.render_text(rs)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["subject", "nodes", "min"]
    assert [ln.split()[0] for ln in lines[2:5]] == ["nodepulse", "legacy", "kwok"]
    assert "nodepulse/legacy N=10: writes 1, body_bytes 0.1" in text
    assert "etcd_cpu n/a" in text

    md = measure.render_markdown(rs)
    assert "| nodepulse | 10 | 5.0 | 1 | 6.00 | 100 |" in md
    assert "| legacy | 10 | 5.0 | 1 | 6.00 | 1,000 |" in md
    assert "**nodepulse / kwok**" in md
    assert "| kwok | 10 | 6.00 |" in md  # by-resource table


def test_markdown_without_pairs_has_no_ratio_tables() -> None:
    md = measure.render_markdown([result("kwok", 10, 6.0)])
    assert "**nodepulse /" not in md


def test_percentile_nearest_rank() -> None:
    values = [float(x) for x in range(1, 101)]  # 1..100
    assert measure.percentile(values, 50) == 50.0
    assert measure.percentile(values, 99) == 99.0
    assert measure.percentile(values, 100) == 100.0
    assert measure.percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert math.isnan(measure.percentile([], 50))
    with pytest.raises(ValueError, match="within 0..100"):
        measure.percentile(values, 101)


def test_churn_table_marks_an_unfinished_run() -> None:
    r = measure.ChurnResult(subject="nodepulse", nodes=100, pods=3000, running=2990,
                            all_running_s=math.nan, p50_s=1.234, p99_s=9.0,
                            subject_cpu_s=12.0, apiserver_cpu_s=30.0, subject_rss_mb=200.0)
    text = measure.render_churn([r, dataclasses.replace(r, round=2)])
    assert text.splitlines()[2].split() == ["nodepulse", "1", "100", "3000", "2990", "n/a",
                                            "1.23", "9.00", "n/a", "n/a", "12.0", "30.0", "200",
                                            "0", "0", "n/a"]
    assert text.splitlines()[3].split()[:2] == ["nodepulse", "2"]
    on_node = dataclasses.replace(r, node_p50_s=0.0123, node_p99_s=0.5)
    assert measure.render_churn([on_node]).splitlines()[2].split()[8:10] == ["0.012", "0.500"]
    assert "| nodepulse | 1 | 100 | 3000 | 2990 | n/a |" in measure.render_churn([r],
                                                                             markdown=True)
    job = dataclasses.replace(r, job_pods=500, job_succeeded=500, job_s=61.04)
    assert measure.render_churn([job]).splitlines()[2].split()[-3:] == ["500", "500", "61.0"]


def test_rounds_show_each_p99_and_each_rounds_ratio() -> None:
    def churn(subject: str, p99: float) -> measure.ChurnResult:
        return measure.ChurnResult(subject=subject, nodes=100, pods=3000, running=3000,
                                   all_running_s=150.0, p50_s=0.01, p99_s=p99,
                                   subject_cpu_s=12.0, apiserver_cpu_s=30.0,
                                   subject_rss_mb=200.0)

    rs = [churn("nodepulse", 0.04), churn("kwok", 0.05), churn("nodepulse", 0.06),
          churn("kwok", 0.03), churn("nodepulse", math.nan), churn("kwok", 0.05)]
    assert measure.render_rounds(rs) == [
        "nodepulse N=100: p99 s by round 0.040 0.060 n/a; median 0.050",
        "kwok N=100: p99 s by round 0.050 0.030 0.050; median 0.050",
        "nodepulse/kwok N=100: p99 ratio by round 0.8 2 n/a; at or under KWOK's in 1 of 3"]
    assert measure.render_rounds(rs[:2]) == []  # one round each: the table says it all
    assert measure.render_rounds([churn("kwok", 0.05), churn("kwok", 0.03)]) == [
        "kwok N=100: p99 s by round 0.050 0.030; median 0.040"]


def test_churn_writes_are_per_pod_and_the_median_of_the_rounds() -> None:
    def churn(subject: str, writes: dict[str, float]) -> measure.ChurnResult:
        return measure.ChurnResult(subject=subject, nodes=100, pods=1000, running=1000,
                                   all_running_s=150.0, p50_s=0.01, p99_s=0.1,
                                   subject_cpu_s=12.0, apiserver_cpu_s=30.0,
                                   subject_rss_mb=200.0, writes=writes)

    rs = [churn("nodepulse", {"pods/status PATCH": 2000.0, "pods POST": 1000.0}),
          churn("kwok", {"pods/status PATCH": 1000.0, "pods POST": 1000.0}),
          churn("nodepulse", {"pods/status PATCH": 1000.0, "pods POST": 1000.0}),
          churn("nodepulse", {"pods/status PATCH": 1500.0, "pods POST": 1000.0,
                              "events POST": 300.0})]
    lines = measure.render_churn_writes(rs).splitlines()
    assert lines[0].split() == ["subject", "nodes", "rounds", "events", "POST", "pods",
                                "POST", "pods/status", "PATCH", "all"]
    assert lines[2].split() == ["nodepulse", "100", "3", "0.00", "1.00", "1.50", "2.80"]
    assert lines[3].split() == ["kwok", "100", "1", "0.00", "1.00", "1.00", "2.00"]
    sized = [dataclasses.replace(r, body={"pods patch": 2_000_000.0 * i}) for i, r in
             enumerate(rs, start=1)]
    lines = measure.render_churn_writes(sized, field="body", fmt="{:.0f}").splitlines()
    assert [x.split() for x in lines[2:]] == [["nodepulse", "100", "3", "6000", "6000"],
                                              ["kwok", "100", "1", "4000", "4000"]]


def churn_round(subject: str, startup: list[float], pods: int = 0, nodes: int = 100,
                cpu: float = 12.0, rss: float = 200.0) -> measure.ChurnResult:
    """A round whose pods started in `startup` seconds (the node's part half of it);
    `pods` more than len(startup) were asked for and never seen Running."""
    asked = max(pods, len(startup))
    return measure.ChurnResult(subject=subject, nodes=nodes, pods=asked, running=len(startup),
                               all_running_s=math.nan, p50_s=math.nan, p99_s=math.nan,
                               subject_cpu_s=cpu, apiserver_cpu_s=cpu * 2,
                               subject_rss_mb=rss, startup_s=startup,
                               node_startup_s=[x / 2 for x in startup])


def test_percentiles_sort_once_and_agree_with_percentile() -> None:
    values = [float(x) for x in range(1000, 0, -1)]  # 1000..1
    assert measure.percentiles(values, measure.POOLED_QS) == [500.0, 900.0, 990.0, 999.0]
    assert measure.percentiles(values, [99.9]) == [measure.percentile(values, 99.9)]
    assert all(math.isnan(x) for x in measure.percentiles([], [50, 99]))


def test_pods_never_running_count_as_the_slowest_of_their_round() -> None:
    r = churn_round("kwok", [0.1, 0.2], pods=4)
    assert measure.round_sample(r) == [0.1, 0.2, math.inf, math.inf]
    assert measure.round_sample(r, node_part=True) == [0.05, 0.1, math.inf, math.inf]
    assert measure.percentile(measure.round_sample(r), 50) == 0.2
    assert measure.percentile(measure.round_sample(r), 99) == math.inf


def test_pooled_takes_every_rounds_pods_together_and_the_spread_of_their_costs() -> None:
    # 1..100 ms in round 1, 101..200 ms in round 2: pooled, 1..200 ms
    rounds = [churn_round("nodepulse", [x / 1000 for x in range(1, 101)], cpu=10.0, rss=90.0),
              churn_round("nodepulse", [x / 1000 for x in range(101, 201)], cpu=14.0,
                          rss=80.0),
              churn_round("nodepulse", [0.5], pods=100, cpu=11.0, rss=85.0),
              churn_round("kwok", [0.3])]
    ours, kwok = measure.pooled(rounds)
    assert (ours.subject, ours.nodes, ours.rounds, ours.pods, ours.not_running) == \
        ("nodepulse", 100, 3, 300, 99)
    # 300 values: 1..200 ms, 0.5 s, and 99 never Running
    assert ours.startup_s == {"p50": 0.15, "p90": math.inf, "p99": math.inf,
                              "p99.9": math.inf}
    assert ours.node_startup_s["p50"] == 0.075
    assert ours.subject_cpu_s == (10.0, 11.0, 14.0)
    assert ours.apiserver_cpu_s == (20.0, 22.0, 28.0)
    assert ours.subject_rss_mb == (80.0, 85.0, 90.0)
    assert (kwok.rounds, kwok.startup_s["p99.9"], kwok.subject_cpu_s) == (1, 0.3,
                                                                        (12.0, 12.0, 12.0))
    assert all(math.isnan(x) for x in measure.spread([]))


def spread_rounds(scale: float, rounds: int = 5, pods: int = 200) -> list[list[float]]:
    """Rounds of `pods` startups, 10-30 ms, each round's slowest 2 % a burst whose length
    moves from round to round (40-60 ms), all times `scale`."""
    out = []
    for k in range(rounds):
        burst = 0.04 + 0.005 * k
        body = [0.01 + 0.02 * i / pods for i in range(pods - pods // 50)]
        out.append([scale * x for x in body + [burst] * (pods // 50)])
    return out


def test_bootstrap_is_seeded_and_gives_the_pooled_ratio_inside_its_interval() -> None:
    ours, kwok = spread_rounds(0.9), spread_rounds(1.0)
    found = measure.bootstrap_ratio(ours, kwok, [50.0, 99.0], resamples=300, seed=7)
    assert found == measure.bootstrap_ratio(ours, kwok, [50.0, 99.0], resamples=300, seed=7)
    assert found != measure.bootstrap_ratio(ours, kwok, [50.0, 99.0], resamples=300, seed=8)
    for q in (50.0, 99.0):
        ratio, low, high = found[q]
        assert low <= ratio <= high
    assert found[50.0][0] == pytest.approx(0.9)


def test_bootstrap_resamples_whole_rounds() -> None:
    # nodepulse: one fast round and one slow; KWOK: two alike. Pods within rounds would
    # put every resample's median near 0.5x; whole rounds draw both slow 1 time in 4
    ours = [[1.0] * 100, [3.0] * 100]
    kwok = [[2.0] * 100, [2.0] * 100]
    ratio, low, high = measure.bootstrap_ratio(ours, kwok, [50.0], resamples=400)[50.0]
    assert (ratio, low, high) == (0.5, 0.5, 1.5)


@pytest.mark.parametrize(("ours", "verdict"), [(0.5, "met"), (1.0, "tie"), (2.0, "missed")])
def test_p99_verdict_by_where_the_interval_lies(ours: float, verdict: str) -> None:
    rs = [churn_round("nodepulse", x) for x in spread_rounds(ours)]
    rs += [churn_round("kwok", x) for x in spread_rounds(1.0)]
    p50, p99 = measure.intervals(rs, resamples=300)
    assert (p99.num, p99.den, p99.nodes, p99.q) == ("nodepulse", "kwok", 100, 99.0)
    assert p50.q == 50.0
    assert p99.ratio == pytest.approx(ours)
    assert p99.verdict == verdict


def test_verdict_boundaries_and_a_ratio_without_meaning() -> None:
    def interval(low: float, high: float) -> measure.Interval:
        return measure.Interval("nodepulse", "kwok", 100, 99.0, 1.0, low, high)

    assert interval(0.5, 0.99).verdict == "met"
    assert interval(0.5, 1.0).verdict == "tie"  # the interval holds 1.0
    assert interval(1.0, 1.2).verdict == "tie"
    assert interval(1.01, 1.2).verdict == "missed"
    assert interval(math.nan, math.nan).verdict == "n/a"
    # KWOK's percentiles zero in every resample: no ratio to bound
    found = measure.bootstrap_ratio([[0.1], [0.2]], [[0.0], [0.0]], [50.0], resamples=10)
    assert math.isnan(found[50.0][0]) and math.isnan(found[50.0][1])


def test_one_round_has_a_ratio_but_no_interval() -> None:
    ratio, low, high = measure.bootstrap_ratio([[0.1]], [[0.2], [0.4]], [50.0])[50.0]
    assert ratio == 0.5
    assert math.isnan(low) and math.isnan(high)


def test_bootstrap_refuses_what_it_cannot_resample() -> None:
    with pytest.raises(ValueError, match="at least one round of each"):
        measure.bootstrap_ratio([], [[1.0]], [50.0])
    with pytest.raises(ValueError, match="resamples=0"):
        measure.bootstrap_ratio([[1.0]], [[1.0]], [50.0], resamples=0)
    with pytest.raises(ValueError, match="level=1.5"):
        measure.bootstrap_ratio([[1.0]], [[1.0]], [50.0], level=1.5)


def test_intervals_only_for_pairs_that_both_ran() -> None:
    rs = [churn_round("nodepulse", [0.1]), churn_round("kwok", [0.2]),
          churn_round("nodepulse", [0.1], nodes=500)]
    assert [(i.nodes, i.q) for i in measure.intervals(rs, resamples=10)] == [(100, 50.0),
                                                                             (100, 99.0)]


def test_pooled_tables_show_percentiles_intervals_and_spreads() -> None:
    rs = [churn_round("nodepulse", x, cpu=10.0 + k) for k, x in enumerate(spread_rounds(0.5))]
    rs += [churn_round("kwok", x) for x in spread_rounds(1.0)]
    pools, found = measure.pooled(rs), measure.intervals(rs, resamples=200)
    text = measure.render_pooled(pools, found)
    lines = text.splitlines()
    assert lines[0].split() == ["subject", "nodes", "rounds", "pods", "not", "Running",
                                "p50", "s", "p90", "s", "p99", "s", "p99.9", "s", "node",
                                "p50", "s", "node", "p99", "s"]
    assert lines[2].split()[:5] == ["nodepulse", "100", "5", "1000", "0"]
    assert "nodepulse/kwok         p99           0.5" in text
    assert text.count(" met") == 2  # p50 and p99
    assert "10.0/12.0/14.0" in text  # subject CPU s min/median/max
    md = measure.render_pooled(pools, found, markdown=True)
    assert "| 100 | nodepulse/kwok | p99 | 0.5 |" in md
    assert "| kwok | 100 | 12.0/12.0/12.0 | 24.0/24.0/24.0 | 200/200/200 |" in md


def test_churn_docs_hold_the_pooled_tables_every_rounds_pods_and_a_plot(
        tmp_path: Path) -> None:
    import argparse
    import json

    from bench.scale import write_churn_docs

    rs = []
    for k, (ours, kwok) in enumerate(zip(spread_rounds(0.5), spread_rounds(1.0),
                                         strict=True)):
        rs += [dataclasses.replace(churn_round("nodepulse", ours), round=k + 1),
               dataclasses.replace(churn_round("kwok", kwok), round=k + 1)]
    args = argparse.Namespace(out=str(tmp_path), job_pods=0, churn_pods=200, rounds=5,
                              subjects="nodepulse,kwok")
    pools, found = write_churn_docs(rs, args, "python -m bench.scale --churn", "one process",
                                    ["kwok round 6 at 100 nodes: timed out"])
    assert [i.verdict for i in found] == ["met", "met"]
    md = (tmp_path / "churn.md").read_text()
    assert "| 100 | nodepulse/kwok | p99 | 0.5 |" in md
    assert "`pod-ready`, `pod-complete`, `pod-delete`" in md
    assert "Failed round: kwok round 6 at 100 nodes: timed out" in md
    doc = json.loads((tmp_path / "churn.json").read_text())
    assert [i["verdict"] for i in doc["intervals"]] == ["met", "met"]
    assert doc["pooled"][0]["startup_s"]["p99"] == pools[0].startup_s["p99"]
    assert [(r["subject"], r["round"]) for r in doc["rounds"][:3]] == [
        ("nodepulse", 1), ("kwok", 1), ("nodepulse", 2)]
    assert doc["rounds"][1]["startup_s"] == pytest.approx(rs[1].startup_s)
    assert (tmp_path / "churn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["--rounds", "2"], ["--subjects", "kwok,kwok"]])
def test_rounds_and_a_repeated_subject_are_for_the_churn(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from bench import scale

    with pytest.raises(SystemExit):
        scale.main(argv)
    assert "--rounds and a repeated subject go with --churn" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        scale.main(["--churn", "--rounds", "0"])
    assert "--rounds must be > 0" in capsys.readouterr().err


def test_split_shares_the_nodes_among_the_agent_processes(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    from bench import scale

    subject = scale.AgentSubject("efficient", True, "nod-10", 10, tmp_path, split=4)
    spawned: list[list[str]] = []
    subject._spawn = lambda args, logname: spawned.append(args)  # type: ignore[method-assign]
    subject.start(type("Cluster", (), {"kubeconfig": tmp_path / "admin"})())
    shares = [int(a[a.index("--virtual-nodes") + 1]) for a in spawned]
    prefixes = [a[a.index("--node-name-prefix") + 1] for a in spawned]
    assert shares == [3, 3, 2, 2] and sum(shares) == 10
    assert prefixes == ["nod-10-p0", "nod-10-p1", "nod-10-p2", "nod-10-p3"]
    assert all(a[a.index("--agent-id") + 1] == p for a, p in zip(spawned, prefixes, strict=True))
    assert all(f"{scale.BENCH_LABEL}=nod-10" in a for a in spawned)  # one subject's nodes
    with pytest.raises(SystemExit):
        scale.main(["--split", "0"])
    assert "--split must be > 0" in capsys.readouterr().err


def test_window_takes_out_the_identity_lease_writes_and_their_bytes() -> None:
    from bench.scale import Snapshot, Window

    a = Snapshot(t=100.0, writes={"leases PUT": 10.0}, body={"leases update": 4000.0},
                 lease_updates=10.0, etcd={"x": 5.0}, cpu={"subject": 1.0})
    # 60 s later: 70 lease PUTs of 400 bytes, 6 of them the API server's own identity
    # lease; one node status PATCH of 900 bytes
    b = Snapshot(t=160.0, writes={"leases PUT": 80.0, "nodes/status PATCH": 1.0},
                 body={"leases update": 32000.0, "nodes patch": 900.0}, lease_updates=80.0,
                 etcd={"x": 65.0}, cpu={"subject": 1.5})
    w = Window.between(a, b, own_lease_writes=6)
    assert w.seconds == 60.0
    assert w.writes == {"leases PUT": 64.0, "nodes/status PATCH": 1.0}
    assert w.body == 28000.0 + 900.0 - 6 * 400.0
    assert w.etcd == {"x": 60.0}
    assert w.cpu == {"subject": 0.5}
    assert w.rate(w.etcd["x"]) == 1.0


def test_kwok_stages_missing_from_the_module_cache_are_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.scale import KWOK_STAGES, kwok_stages

    monkeypatch.setenv("NODEPULSE_CACHE", str(tmp_path))
    monkeypatch.setattr("nodepulse_dev.build.pinned_version", lambda gomod, module: "v0.8.0")
    stages = tmp_path / "gomod" / "sigs.k8s.io" / "kwok@v0.8.0" / "kustomize" / "stage"
    for rel in KWOK_STAGES[:-1]:
        (stages / rel).parent.mkdir(parents=True, exist_ok=True)
        (stages / rel).write_text("kind: Stage\n")
    with pytest.raises(RuntimeError, match="pod-delete.yaml"):
        kwok_stages()
    (stages / KWOK_STAGES[-1]).write_text("kind: Stage\n")
    # node and pod stages both: the binary applies no default of its own since v0.8.0
    assert [p.name for p in kwok_stages()] == [
        "node-initialize.yaml", "node-heartbeat-with-lease.yaml", "pod-ready.yaml",
        "pod-complete.yaml", "pod-delete.yaml"]


def test_nodes_without_the_ttl_annotation_are_named() -> None:
    def node(name: str, annotations: dict[str, str] | None) -> client.V1Node:
        return client.V1Node(metadata=client.V1ObjectMeta(name=name, annotations=annotations))

    nodes = [node("a", {TTL_ANNOTATION: "0"}), node("b", None), node("c", {"other": "x"})]
    assert without_ttl(nodes) == ["b", "c"]
    assert without_ttl(nodes[:1]) == []
