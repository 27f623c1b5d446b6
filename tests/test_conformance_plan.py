"""The conformance runner's own logic (e2e/conformance/run.py): reading specs.yaml,
naming a spec exactly for ginkgo, reading ginkgo's JSON report, the ratchet and the
doc. The run itself is e2e/test_conformance.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from e2e.conformance import run

SPEC = "[sig-node] Pods should get a host IP [NodeConformance] [Conformance]"


def plan_file(tmp_path: Path, **over: object) -> Path:
    raw = {"focus_file": "test/e2e/common/node/", "focus": r"\[NodeConformance\]",
           "skip": r"\[Slow\]", "serial": r"\[Serial\]", "workers": 4,
           "spec_timeout": 400, "trial_timeout": 100,
           "cannot_run": {"[sig-node] X pulls from the internet": "no internet here"},
           "expected_pass": [SPEC], **over}
    path = tmp_path / "specs.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_committed_specs_file_is_valid() -> None:
    plan = run.load_plan()
    assert plan.expected_pass and plan.workers > 0 and plan.spec_timeout > 0


def test_a_bad_specs_file_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="workers must be a int"):
        run.load_plan(plan_file(tmp_path, workers="four"))
    with pytest.raises(ValueError, match="skip is not a regular expression"):
        run.load_plan(plan_file(tmp_path, skip="[Slow"))
    with pytest.raises(ValueError, match="needs a reason"):
        run.load_plan(plan_file(tmp_path, cannot_run={SPEC: ""}))
    with pytest.raises(ValueError, match="in both expected_pass and cannot_run"):
        run.load_plan(plan_file(tmp_path, cannot_run={SPEC: "why"}))


def test_why_not_run_names_the_reason_or_the_skip_tag(tmp_path: Path) -> None:
    plan = run.load_plan(plan_file(tmp_path))
    assert plan.why_not_run("[sig-node] X pulls from the internet") == "no internet here"
    assert "[Slow]" in (plan.why_not_run("[sig-node] Pods backs off [Slow]") or "")
    assert plan.why_not_run(SPEC) is None


def test_a_spec_name_becomes_a_go_regex_that_matches_only_it() -> None:
    literal = run.go_regex_literal(SPEC + " (a|b) $x *")
    assert " " in literal and "\\ " not in literal  # RE2 refuses an escaped space
    # the escaped characters mean the same in Python's re as in RE2
    assert re.fullmatch(literal, SPEC + " (a|b) $x *")
    assert not re.fullmatch(literal, SPEC + " a $x *")


def ginkgo_report(path: Path, specs: list[tuple[list[str], str, str, str]]) -> Path:
    path.write_text(json.dumps([{"SpecReports": [
        {"LeafNodeType": "SynchronizedBeforeSuite", "State": "passed"},
        *({"LeafNodeType": "It", "ContainerHierarchyTexts": containers, "LeafNodeText": leaf,
           "State": state, "RunTime": 2_500_000_000,
           **({"Failure": {"Message": message}} if message else {})}
          for containers, leaf, state, message in specs)]}]))
    return path


def test_the_json_report_gives_full_names_states_and_failures(tmp_path: Path) -> None:
    report = ginkgo_report(tmp_path / "r.json", [
        (["[sig-node] Pods"], "should get a host IP [NodeConformance] [Conformance]",
         "passed", ""),
        (["[sig-node] Pods", "when logs"], "should print", "failed",
         "[FAILED] Timed out after 300s.\n  Expected\n  <bool>: false"),
    ])
    got = run._spec_reports(report)
    assert got[0] == (SPEC, "passed", 2.5, "")
    assert got[1][0] == "[sig-node] Pods when logs should print"
    assert run.summarize(got[1][3]) == "Timed out after 300s. Expected <bool>: false"
    assert len(run.summarize("x" * 1000)) == 300
    dump = ("expected pod success: Timed out after 300s. expected pod to be Succeeded, got "
            "instead: <*v1.Pod | 0x3f5d8639a490>: metadata: x\n  state:\n    waiting:\n"
            "      message: 'pod configmap-1430/p container c: env X:\n"
            "        valueFrom is not supported'\n      reason: CreateContainerConfigError\n"
            "  phase: Pending\n")
    assert run.summarize(dump) == ("container waiting: CreateContainerConfigError: pod "
                                   "configmap-N/p container c: env X: valueFrom is not supported "
                                   "(expected pod success: Timed out after 300s. expected pod to "
                                   "be Succeeded; pod Pending)")
    assert run.summarize('Get "wss://127.0.0.1:59533/x"') == 'Get "wss://127.0.0.1:PORT/x"'
    assert run.summarize("pod \"p-3152095a-5680-4273-9975-9cb4306e512c\" <*E | 0x3f5d8639a490>") \
        == 'pod "p-<uid>" <*E | 0x…>'


def test_the_ratchet_fails_on_an_expected_pass_that_did_not_pass(tmp_path: Path) -> None:
    plan = run.load_plan(plan_file(tmp_path))
    other = "[sig-node] Pods should be updated [NodeConformance] [Conformance]"
    not_run = run.Result("[sig-node] X pulls from the internet", run.NOT_RUN, reason="r")
    assert run.ratchet([run.Result(SPEC, run.PASSED), run.Result(other, run.FAILED),
                        not_run], plan) == []
    problems = run.ratchet([run.Result(SPEC, run.FAILED, reason="boom"), not_run], plan)
    assert problems == [f"expected to pass, failed: {SPEC}: boom"]
    assert run.ratchet([not_run], plan) == [
        f"specs.yaml names a spec the suite does not list: {SPEC}"]


def test_a_narrowed_run_is_judged_on_the_specs_it_ran(tmp_path: Path) -> None:
    """--only or --sample leaves most expected passes unrun: those are not problems
    (a page of them hid the one that failed), one it ran and failed still is."""
    plan = run.load_plan(plan_file(tmp_path))
    cannot = run.Result("[sig-node] X pulls from the internet", run.NOT_RUN, reason="r")
    unrun = run.Result(SPEC, run.NOT_RUN, reason="not in this run's focus")
    assert run.ratchet([unrun, cannot], plan, narrowed=True) == []
    assert run.ratchet([unrun, cannot], plan) == [
        f"expected to pass, not run: {SPEC}: not in this run's focus"]
    assert run.ratchet([run.Result(SPEC, run.FAILED, reason="boom"), cannot], plan,
                       narrowed=True) == [f"expected to pass, failed: {SPEC}: boom"]


def test_the_doc_lists_every_spec_with_its_reason(tmp_path: Path) -> None:
    plan = run.load_plan(plan_file(tmp_path))
    doc = tmp_path / "conformance.md"
    run.write_doc([run.Result(SPEC, run.PASSED, 3.2),
                   run.Result("[sig-node] a | b", run.FAILED, 300, "Timed out | x")],
                  plan, 660, doc)
    text = doc.read_text()
    assert "**1 passed, 1 failed, 0 skipped by the spec, 0 not run** of 2" in text
    assert f"| {SPEC} | passed (expected pass) | 3 |  |" in text
    assert "| [sig-node] a \\| b | failed | 300 | Timed out \\| x |" in text
    assert "11.0 min of wall time" in text and "each other spec 100 s" in text


def test_an_interrupted_run_kills_the_running_spec(tmp_path: Path) -> None:
    """A Ctrl-C does not reach e2e.test (a session of its own): STOP ends it."""
    import threading
    fake = tmp_path / "e2e.test"
    pidfile = tmp_path / "pid"
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 300\n")
    fake.chmod(0o755)
    target = run.Target(tmp_path / "kubeconfig", "unix:///nowhere.sock")
    got: list[run.Result] = []
    worker = threading.Thread(target=lambda: got.append(run.run_spec(
        fake, Path("kubectl"), "[sig-node] a spec", target, tmp_path / "w", 300)))
    worker.start()
    try:
        for _ in range(1000):  # bounded: until the fake has started
            if pidfile.exists() and pidfile.read_text().strip():
                break
            threading.Event().wait(0.01)
        run.STOP.set()
        worker.join(20)
    finally:
        run.STOP.clear()
    assert not worker.is_alive()
    assert got and got[0].status == run.FAILED and "reported no result" in got[0].reason
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_a_section_of_the_page_is_replaced_between_its_markers() -> None:
    page = run.replace_section("# Title\n\nhand-written\n", "a", "first")
    assert page.endswith("<!-- begin a: generated, do not edit -->\nfirst\n<!-- end a -->\n")
    page = run.replace_section(page + "\nmore hand-written\n", "b", "second")
    page = run.replace_section(page, "a", "replaced\nover two lines")
    assert "first" not in page and "replaced\nover two lines\n<!-- end a -->" in page
    assert page.index("hand-written") < page.index("replaced") < page.index(
        "more hand-written") < page.index("second")


def test_the_kind_table_puts_both_agents_side_by_side(tmp_path: Path) -> None:
    from e2e.conformance import kind

    other = "[sig-apps] Deployment should roll [Conformance]"
    np = kind.save_column("nodepulse", [run.Result(SPEC, run.PASSED, 12.4),
                                        run.Result(other, run.FAILED, 300, "timed out | x")],
                          660, "python -m e2e.conformance ...", True, tmp_path / "np.json")
    kl = kind.save_column("kubelet", [run.Result(SPEC, run.PASSED, 10),
                                      run.Result(other, run.PASSED, 40)],
                          600, "python -m e2e.conformance ...", False, tmp_path / "kl.json")
    text = kind.columns_doc({"nodepulse": kind.load_column(np),
                             "kubelet": kind.load_column(kl)})
    assert f"| {SPEC} | passed 12 s | passed 10 s |  |" in text
    assert f"| {other} | failed 300 s | passed 40 s | nodepulse: timed out \\| x |" in text
    assert "`nodepulse` (**partial**)" in text and "**1 passed, 1 failed" in text
    assert "1 specs passed in every column run; 1 passed with the kubelet and not with " \
           "nodepulse" in text
    only_one = kind.columns_doc({"nodepulse": kind.load_column(np), "kubelet": None})
    assert "- `kubelet`: not run yet." in only_one


def test_the_kind_plan_runs_everything_and_samples_every_sig() -> None:
    from e2e.conformance import kind

    plan = run.load_plan(kind.PLAN)
    assert plan.focus == r"\[Conformance\]" and not plan.skip and not plan.cannot_run
    assert re.search(plan.serial, "[sig-apps] Daemon set [Serial] should run [Conformance]")
    sigs = {spec.split("]")[0] + "]" for spec in plan.sample}
    assert sigs == {f"[sig-{s}]" for s in ("api-machinery", "apps", "architecture", "auth",
                                           "cli", "instrumentation", "network", "node",
                                           "scheduling", "storage")}
