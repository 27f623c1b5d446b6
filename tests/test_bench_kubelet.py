"""bench.kubelet's arithmetic and its cluster's config, without a cluster."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from bench import kubelet
from e2e.kind import agent_node, cluster, node


def test_cpu_seconds_reads_user_and_system_time_past_a_name_with_parentheses() -> None:
    stat = "42 (python3 (x) y) S 1 42 42 0 -1 4194560 9 0 0 0 250 70 0 0 20 0 9 0 100"
    assert kubelet.cpu_seconds(stat, 100) == pytest.approx(3.2)


def test_rss_mb_reads_vmrss_and_refuses_a_process_without_one() -> None:
    assert kubelet.rss_mb("Name:\tkubelet\nVmRSS:\t   51200 kB\nThreads: 9\n") == \
        pytest.approx(52.4288)
    with pytest.raises(ValueError, match="VmRSS"):
        kubelet.rss_mb("Name:\tkubelet\nState:\tZ (zombie)\n")


def event(audit_id: str, user: str, at: str, verb: str, resource: str,
          subresource: str | None = None, stage: str = "ResponseComplete") -> str:
    ref = {"resource": resource, **({"subresource": subresource} if subresource else {})}
    return json.dumps({"auditID": audit_id, "stage": stage, "verb": verb,
                       "user": {"username": user}, "objectRef": ref,
                       "requestReceivedTimestamp": at})


def test_audit_requests_counts_each_request_of_the_user_once_within_the_window() -> None:
    me, other = "system:node:w1", "system:node:w2"
    lines = [
        event("a", me, "2026-11-30T00:00:10.000000Z", "watch", "pods", stage="ResponseStarted"),
        event("a", me, "2026-11-30T00:00:10.000000Z", "watch", "pods"),  # same request
        event("b", me, "2026-11-30T00:00:11.500000Z", "patch", "pods", "status"),
        event("c", other, "2026-11-30T00:00:12.000000Z", "patch", "pods", "status"),
        event("d", me, "2026-11-30T00:00:20.000000Z", "update", "leases"),  # after the end
        event("e", me, "2026-11-30T00:00:09.999000Z", "get", "nodes"),      # before the start
    ]
    start = 1_795_996_810.0  # 2026-11-30T00:00:10Z
    got = kubelet.audit_requests(lines, me, start, start + 10)
    assert got == {"watch pods": 1, "patch pods/status": 1}


def test_per_pod_takes_the_idle_rate_off_and_never_goes_below_zero() -> None:
    assert kubelet.per_pod(1000, idle_rate=2.0, seconds=100, pods=100) == 8.0
    assert kubelet.per_pod(10, idle_rate=2.0, seconds=100, pods=100) == 0.0


def a_round(agent: str, number: int, scale: float) -> kubelet.Round:
    return kubelet.Round(agent, number, idle_cpu_pct=1.0 * scale, idle_rss_mb=50 * scale,
                         busy_cpu_pct=5 * scale, busy_rss_mb=80 * scale,
                         startup_s=[scale * (i + number) for i in range(100)],
                         burst_cpu_s=20 * scale, requests_per_pod=4 * scale,
                         requests={"patch pods/status": 2 * scale})


def test_summary_gives_each_agents_spread_and_pools_the_startup_of_its_rounds() -> None:
    rounds = [a_round("kubelet", 1, 1.0), a_round("kubelet", 2, 1.0),
              a_round("nodepulse", 1, 2.0), a_round("nodepulse", 2, 2.0)]
    s = kubelet.summary(rounds)
    assert s["idle_rss"] == {"kubelet": (50, 50, 50), "nodepulse": (100, 100, 100)}
    # the rounds' p99s are 99 and 100; pooled (1..100 and 2..101), the 198th of 200
    assert s["p99"]["kubelet"] == (99, 100, 100)
    text = kubelet.render(rounds)
    assert "API requests per pod" in text and "2.00x" in text
    assert "patch pods/status" in text


def test_the_cluster_has_one_worker_per_agent_and_audits_only_the_workers(tmp_path: Path
                                                                          ) -> None:
    config = kubelet.cluster_config(tmp_path)
    cfg = cluster.load_config(config, (node.image_name(), agent_node.image_name()))
    workers = [n for n in cfg["nodes"] if n["role"] == "worker"]
    assert {n["labels"][kubelet.LABEL]: n["image"] for n in workers} == {
        "kubelet": node.image_name(), "nodepulse": agent_node.image_name()}
    policy = yaml.safe_load((tmp_path / "audit" / "policy.yaml").read_text())
    assert policy["rules"][0]["users"] == [f"system:node:{kubelet.CLUSTER_NAME}-worker",
                                           f"system:node:{kubelet.CLUSTER_NAME}-worker2"]
    assert policy["rules"][-1] == {"level": "None"}
    patches = [yaml.safe_load(p) for p in cfg["kubeadmConfigPatches"]]
    assert {"kind": "KubeletConfiguration", "maxPods": kubelet.STEADY + 10} in patches
    api = next(p["apiServer"] for p in patches if "apiServer" in p)
    assert api["extraArgs"]["audit-log-path"] == kubelet.AUDIT_LOG
    with pytest.raises(RuntimeError, match="is not the one the suite builds"):
        cluster.load_config(config)  # the kubelet's image only: the variant is refused


def test_the_verdict_needs_every_round_on_one_side() -> None:
    assert kubelet.verdict((10, 12, 14), (5, 6, 9.9)) == "lower"
    assert kubelet.verdict((10, 12, 14), (14.1, 15, 16)) == "higher"
    assert kubelet.verdict((10, 12, 14), (5, 6, 10)) == "ranges overlap"


def test_a_saved_run_is_rendered_again_without_a_cluster(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    rounds = [a_round("kubelet", 1, 1.0), a_round("nodepulse", 1, 0.5)]
    saved = tmp_path / "kubelet.json"
    saved.write_text(json.dumps({"command": "python -m bench.kubelet", "started": "then",
                                 "rounds": [dataclasses.asdict(r) for r in rounds]}))
    kubelet.main(["--from-json", str(saved)])
    out = capsys.readouterr().out
    assert "0.50x" in out and "lower" in out
