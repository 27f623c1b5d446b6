"""The soak's schedule (a pure function of seed and duration) and its rules (bench/soak/)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

import pytest
from kubernetes import client

from bench.soak import observe, rules
from bench.soak.__main__ import build_parser, rerun_command
from bench.soak.schedule import KINDS, LANES, kinds_of, schedule
from e2e.harness.nodeenv import RtContainer, RtView

# the e2e short run's parameters (e2e/test_soak.py)
SHORT_SEED, SHORT_SECONDS, SHORT_GAP = 1, 150.0, 15.0


def test_the_schedule_is_a_pure_function_of_seed_and_duration():
    a = schedule(7, 3600)
    assert a == schedule(7, 3600)
    assert a != schedule(8, 3600)
    assert a != schedule(7, 3000)
    assert [f.at for f in a] == sorted(f.at for f in a)


def test_faults_of_one_lane_follow_each_other_and_lanes_overlap():
    faults = schedule(3, 3600)
    for lane in LANES:
        mine = [f for f in faults if f.lane == lane]
        assert mine, lane
        for before, after in zip(mine, mine[1:], strict=False):
            assert after.at >= before.end + 5  # min_gap
    assert all(f.at >= 0 and f.end <= 3600 for f in faults)
    overlapping = [f for f in faults
                   if any(g is not f and g.at < f.end and f.at < g.end for g in faults)]
    assert len(overlapping) > len(faults) / 2


def test_holds_within_each_kinds_range_and_slow_disk_has_a_delay():
    for f in schedule(11, 3600):
        _, low, high = KINDS[f.kind]
        assert low <= f.hold <= high, f
        assert (f.delay > 0) == (f.kind == "slow-disk"), f


def test_the_short_run_injects_every_kind():
    faults = schedule(SHORT_SEED, SHORT_SECONDS, mean_gap=SHORT_GAP)
    assert kinds_of(faults) == set(KINDS)


def test_a_window_too_short_for_a_fault_gets_none_of_it():
    assert kinds_of(schedule(1, 1)) == {"etcd-compact"}  # the one fault without a hold
    with pytest.raises(ValueError, match="duration must be positive"):
        schedule(1, 0)


def test_uncovered_seconds_of_a_window():
    assert rules.uncovered((0, 10), []) == 10
    assert rules.uncovered((0, 10), [(2, 4), (3, 6)]) == 6
    assert rules.uncovered((0, 10), [(-5, 20)]) == 0
    assert rules.uncovered((0, 10), [(8, float("inf"))]) == 8
    assert rules.uncovered((5, 5), [(0, 1)]) == 0


def test_stale_periods_from_renewals_seen():
    assert rules.stale_periods([0, 5, 10, 40, 45], 20, 50) == [(10, 40)]
    assert rules.stale_periods([0, 5], 20, 30) == [(5, 30)]
    assert rules.stale_periods([], 20, 30) == []


def test_a_silence_is_excused_only_when_faults_cover_it():
    agent_killed = [(100, 130)]  # already extended by the recovery
    assert rules.excused((95, 140), agent_killed, 20)       # 15 s uncovered
    assert not rules.excused((60, 140), agent_killed, 20)   # 50 s of a live agent


def test_quiet_skips_the_faults_of_the_other_node():
    tl = rules.Timeline(0, [rules.Injected("virtual-agent-kill", 100, 110),
                            rules.Injected("agent-kill", 200, float("inf"))])
    assert tl.quiet("cri", 150, 90)
    assert not tl.quiet("virtual", 150, 90)
    assert not tl.quiet("cri", 300, 90)  # still under way
    assert tl.quiet("virtual", 300, 90)
    assert tl.last_before(150) == ["virtual-agent-kill 100s-110s"]
    assert tl.last_before(300, pool="cri") == ["agent-kill 200s-infs"]
    assert tl.last_before(300, pool="virtual") == ["virtual-agent-kill 100s-110s"]


def test_slope_per_hour():
    pts = [rules.Sample(t, 100 + t / 60) for t in range(0, 3600, 60)]
    assert rules.slope_per_hour(pts) == pytest.approx(60)
    assert rules.slope_per_hour(pts[:2]) is None
    flat = [rules.Sample(t, 5) for t in range(3)]
    assert rules.slope_per_hour(flat) == 0


# ---- what a round finds wrong with a pod (observe.py)
def _pod(kind: str, phase: str, *containers: tuple[str, str, bool, str]) -> Any:
    """containers: (name, container id, ready, state) with state running/terminated/waiting."""
    statuses = [client.V1ContainerStatus(
        name=name, container_id=f"containerd://{cid}" if cid else None, ready=ready,
        image="i", image_id="", restart_count=0,
        state=client.V1ContainerState(**{state: {"running": client.V1ContainerStateRunning(),
                                                 "terminated": client.V1ContainerStateTerminated(
                                                     exit_code=0),
                                                 "waiting": client.V1ContainerStateWaiting(
                                                     reason="ContainerCreating")}[state]}))
        for name, cid, ready, state in containers]
    return client.V1Pod(metadata=client.V1ObjectMeta(name="p", uid="u1", labels={"soak": kind}),
                        status=client.V1PodStatus(phase=phase, container_statuses=statuses))


def test_a_web_pod_must_run_ready_and_a_jobs_pod_must_succeed_by_the_end():
    assert observe.pod_problem(_pod("web-cri", "Running", ("web", "c1", True, "running"))) is None
    assert "not ready" in str(observe.pod_problem(
        _pod("web-cri", "Running", ("web", "c1", False, "running"))))
    assert "phase Pending" in str(observe.pod_problem(
        _pod("web-virtual", "Pending", ("web", "", False, "waiting"))))
    running_job = _pod("job-cri", "Running", ("work", "c2", True, "running"))
    assert observe.pod_problem(running_job) is None
    assert "phase Running" in str(observe.pod_problem(running_job, final=True))
    assert observe.pod_problem(_pod("job-virtual", "Succeeded",
                                    ("work", "c3", False, "terminated")), final=True) is None
    assert "phase Failed" in str(observe.pod_problem(_pod("job-cri", "Failed")))


def _ended(code: int, reason: str, at: float) -> Any:
    pod = _pod("job-cri", "Failed", ("work", "c4", False, "terminated"))
    pod.status.container_statuses[0].state.terminated = client.V1ContainerStateTerminated(
        exit_code=code, reason=reason, message="context canceled",
        finished_at=dt.datetime.fromtimestamp(at, dt.UTC))
    return pod


def test_a_failed_pod_says_how_its_containers_ended():
    assert "work exited 128 StartError: context canceled" in str(observe.pod_problem(
        _ended(128, "StartError", 1000)))


def test_a_start_cut_short_by_containerd_is_its_verdict_not_a_lost_pod():
    """containerd marks a container whose start its restart cut short exited (128,
    StartError): the kubelet's pod fails the same way. Only then is it excused."""
    tl = rules.Timeline(0, [rules.Injected("containerd-restart", 1000, 1005),
                            rules.Injected("agent-kill", 2000, 2010)])
    assert observe.start_cut_short(_ended(128, "StartError", 1003), tl)
    assert observe.start_cut_short(_ended(128, "StartError", 1006), tl)  # whole seconds
    assert not observe.start_cut_short(_ended(128, "StartError", 2005), tl)  # not containerd
    assert not observe.start_cut_short(_ended(1, "Error", 1003), tl)
    assert not observe.start_cut_short(_pod("job-cri", "Failed"), tl)  # no container at all
    # a restarted container's last state, judged alike
    assert observe.cut_short(_ended(128, "StartError", 1003).status.container_statuses[0]
                             .state.terminated, tl)
    assert not observe.cut_short(None, tl)


def test_a_container_counts_as_run_once_it_started():
    assert observe.ran(_pod("web-cri", "Running", ("w", "c1", True, "running"))
                       .status.container_statuses[0])
    assert observe.ran(_ended(0, "Completed", 0).status.container_statuses[0])
    assert not observe.ran(_pod("web-cri", "Pending", ("w", "c1", False, "waiting"))
                           .status.container_statuses[0])


def test_the_apis_status_against_the_runtimes_records():
    view = RtView([RtContainer("c1", "u1", "web", "RUNNING"),
                   RtContainer("c0", "u1", "web", "EXITED")], {"u1": [("s1", True)]})
    assert observe.status_mismatch(_pod("web-cri", "Running", ("web", "c1", True, "running")),
                                   view) is None
    wrong = observe.status_mismatch(_pod("web-cri", "Running", ("web", "c0", True, "running")),
                                    view)
    assert wrong and "API says running c0, runtime runs c1" in wrong
    wrong = observe.status_mismatch(_pod("web-cri", "Running", ("web", "c1", False, "waiting")),
                                    view)
    assert wrong and "runtime runs c1" in wrong
    wrong = observe.status_mismatch(_pod("job-cri", "Succeeded",
                                         ("web", "c1", False, "terminated")), view)
    assert wrong and "phase Succeeded but the runtime runs ['web']" in wrong


def test_the_report_names_each_violation_and_says_the_run_failed():
    from bench.soak.run import Report, SoakConfig
    v = [observe.Violation("lease", f"lease n{i}", 100.0 + i, "not renewed for 50s",
                           ["agent-kill 10s-20s"]) for i in range(10)]
    r = Report(SoakConfig(seed=5, minutes=1), started=0.0,
               injected=[rules.Injected("agent-kill", 10, 20)], violations=v,
               checks={"lease": 3}, resources=[{
                   "process": "agent-cri", "incarnations": 2, "samples": 4, "minutes": 3.0,
                   "first": {"rss_mb": 70.0, "threads": 14, "fds": 30, "tasks": None},
                   "last": {"rss_mb": 71.0, "threads": 14, "fds": 30, "tasks": None},
                   "slope_per_hour": {"rss_mb": 20.0, "threads": 0.0, "fds": 0.0,
                                      "tasks": None}}])
    text = r.render(markdown=True)
    assert not r.held and "VIOLATED" in text
    assert "- [lease] lease n0 at +100s: not renewed for 50s; last faults before: " \
           "agent-kill 10s-20s" in text
    assert "... and 2 more" in text
    assert "| agent-cri | 2 | 3 min, 4 samples | 70.0 -> 71.0 (+20.0/h; n/a/h) |" in text
    assert "| agent-kill | 1 | 10 | 0 |" in text
    # report.json renders again to the same text (python -m bench.soak --render)
    again = Report.from_json(json.loads(json.dumps(dataclasses.asdict(r), default=str)))
    assert again.render(markdown=True) == text


def test_kinds_left_out_are_never_injected():
    spared = frozenset({"agent-kill", "virtual-agent-kill", "operator-leader-kill"})
    faults = schedule(2, 3600, without=spared)
    assert faults and not kinds_of(faults) & spared
    assert faults == schedule(2, 3600, without=spared)
    with pytest.raises(ValueError, match="unknown fault kind.*agent-kil\\b"):
        schedule(2, 3600, without=frozenset({"agent-kil"}))


def test_the_printed_command_injects_the_same_faults():
    """A run is reproduced from what it printed: every option the schedule depends on
    that is not its default is in it."""
    parser = build_parser()
    plain = parser.parse_args([])
    assert rerun_command(parser, plain, 7) == "python -m bench.soak --minutes 60 --seed 7"
    leaks = parser.parse_args(["--minutes", "60", "--without", "agent-kill,operator-leader-kill",
                               "--mean-gap", "90", "--virtual-nodes", "50"])
    assert rerun_command(parser, leaks, 44) == (
        "python -m bench.soak --minutes 60 --seed 44 --virtual-nodes 50 --mean-gap 90 "
        "--without agent-kill,operator-leader-kill")
