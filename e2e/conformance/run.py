"""Runs the upstream Kubernetes node e2e specs against one nodepulse agent and writes
docs/conformance.md.

e2e.test is built from the pinned k8s.io/kubernetes module (nodepulse_dev/build.py). The
specs are those of specs.yaml's focus (the [NodeConformance] specs of
test/e2e/common/node and test/e2e/common/storage, NodeLease, and the in-place pod resize
[Conformance] specs), listed by a ginkgo dry
run; each one runs in an e2e.test process of its own (`--ginkgo.focus` naming exactly
that spec), `workers` of them at a time, so a spec
that waits out a 5-minute timeout holds one worker, not the run; the specs that need the
node to themselves ([Serial]) run afterwards, one at a time. Results come from each
process's ginkgo JSON report. No upstream test is edited; the agent is not told which
test is running.

    python -m e2e.conformance [--only REGEX] [--workers N]   # own cluster; writes the doc
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import yaml

from nodepulse_dev import build

SPECS_FILE = Path(__file__).with_name("specs.yaml")
DOC = Path(__file__).resolve().parents[2] / "docs" / "conformance.md"
PASSED, FAILED, SKIPPED, NOT_RUN = "passed", "failed", "skipped", "not run"
NOT_REACHED = "not reached: the run stopped before it"


@dataclasses.dataclass(frozen=True)
class Plan:
    """specs.yaml: what runs, what cannot run here and why, what must pass."""

    focus_file: str
    focus: str
    skip: str
    serial: str  # specs that must run alone, after the others
    cannot_run: dict[str, str]      # spec name -> why it cannot run here
    expected_pass: tuple[str, ...]  # the ratchet: each must pass
    workers: int
    spec_timeout: int   # seconds an expected pass may take
    trial_timeout: int  # seconds any other spec may take (a failing one would wait 5 min)
    sample: tuple[str, ...] = ()    # the specs `make test` runs
    name: str = "specs.yaml"        # the file, for messages

    def why_not_run(self, spec: str) -> str | None:
        if spec in self.cannot_run:
            return self.cannot_run[spec]
        m = re.search(self.skip, spec) if self.skip else None
        return f"skipped by {self.name}'s skip ({m.group(0)})" if m else None


def load_plan(path: Path = SPECS_FILE) -> Plan:
    """Read and check specs.yaml; a bad value is named with its key."""
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top")

    def field(key: str, kind: type) -> Any:
        if not isinstance(raw.get(key), kind):
            raise ValueError(f"{path}: {key} must be a {kind.__name__}, got {raw.get(key)!r}")
        return raw[key]

    raw.setdefault("focus_file", "")  # no focus file: the focus alone selects
    raw.setdefault("sample", [])
    for key in ("focus", "skip", "serial"):
        try:
            re.compile(field(key, str))
        except re.error as e:
            raise ValueError(f"{path}: {key} is not a regular expression: {e}") from None
    cannot_run = field("cannot_run", dict)
    for name, reason in cannot_run.items():
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"{path}: cannot_run[{name!r}] needs a reason")
    expected = field("expected_pass", list)
    if both := set(expected) & set(cannot_run):
        raise ValueError(f"{path}: in both expected_pass and cannot_run: {sorted(both)}")
    if len(set(expected)) != len(expected):
        raise ValueError(f"{path}: expected_pass names a spec twice")
    sample = field("sample", list)
    if both := set(sample) & set(cannot_run):
        raise ValueError(f"{path}: in both sample and cannot_run: {sorted(both)}")
    return Plan(field("focus_file", str), raw["focus"], raw["skip"], raw["serial"],
                dict(cannot_run),
                tuple(expected), field("workers", int), field("spec_timeout", int),
                field("trial_timeout", int), tuple(sample), path.name)



@dataclasses.dataclass
class Result:
    spec: str
    status: str  # PASSED | FAILED | SKIPPED | NOT_RUN
    seconds: float = 0.0
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Target:
    """What the specs run against."""

    kubeconfig: Path
    container_runtime_endpoint: str = ""  # the node's, when e2e.test runs on it


def go_regex_literal(text: str) -> str:
    """`text` as a Go (RE2) regular expression matching it literally. Python's
    re.escape also escapes spaces, which RE2 refuses."""
    return re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", text)


def e2e_args(target: Target, report_dir: Path, kubectl: Path) -> list[str]:
    endpoint = target.container_runtime_endpoint
    return [f"--kubeconfig={target.kubeconfig}", "--provider=local",
            f"--kubectl-path={kubectl}", "--allowed-not-ready-nodes=0",
            *([f"--container-runtime-endpoint={endpoint}"] if endpoint else []),
            f"--report-dir={report_dir}", f"--e2e-output-dir={report_dir}",
            "--disable-log-dump", "--ginkgo.no-color"]


def list_specs(e2e_test: Path, plan: Plan, target: Target, workdir: Path) -> list[str]:
    """The full names of the specs the focus selects (skip not applied), sorted."""
    report = workdir / "dry-run.json"
    workdir.mkdir(parents=True, exist_ok=True)
    focus_file = [f"--ginkgo.focus-file={plan.focus_file}"] if plan.focus_file else []
    res = subprocess.run([str(e2e_test), *e2e_args(target, workdir, Path("kubectl")),
                          "--ginkgo.dry-run", *focus_file,
                          f"--ginkgo.focus={plan.focus}", f"--ginkgo.json-report={report}"],
                         cwd=workdir, capture_output=True, text=True, timeout=300)
    if not report.exists():
        raise RuntimeError(f"e2e.test --ginkgo.dry-run wrote no report (exit "
                           f"{res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return sorted(name for name, state, _, _ in _spec_reports(report) if state != "skipped")


def _spec_reports(report: Path) -> list[tuple[str, str, float, str]]:
    """(full name, state, seconds, failure message) of each It in a ginkgo JSON report.
    An interrupted spec's message says at which step it was."""
    out = []
    for suite in json.loads(report.read_text()):
        for spec in suite.get("SpecReports") or []:
            if spec.get("LeafNodeType") != "It":
                continue
            name = " ".join([*(spec.get("ContainerHierarchyTexts") or []), spec["LeafNodeText"]])
            failure = spec.get("Failure") or {}
            message = failure.get("Message", "")
            step = (failure.get("ProgressReport") or {}).get("CurrentStepText")
            if step:
                message += f" (at step: {step})"
            out.append((name, spec["State"], spec.get("RunTime", 0) / 1e9, message))
    return out


def summarize(message: str, limit: int = 300) -> str:
    """A failure message on one line, short enough for a table cell, without what
    changes from run to run (pointers, UIDs, namespace suffixes, ports). When it dumps
    a pod, the pod's phase and the reason a container waits (what the agent said) stand
    in for the dump."""
    text = " ".join(message.replace("[FAILED]", "").split())
    if " got instead: <*v1.Pod" in text:
        head = text.split(" got instead: <*v1.Pod")[0].rstrip(" ,:")
        waiting = re.search(r"waiting:\n(\s+)(?:message: (.*?)\n\1)?reason: (\S+)", message, re.S)
        phase = re.search(r"^\s*phase: (\w+)", message, re.M)
        text = head + (f"; pod {phase.group(1)}" if phase else "")
        if waiting:
            said = " ".join((waiting.group(2) or "").split()).strip("'\"")
            text = f"container waiting: {waiting.group(3)}{': ' + said if said else ''} ({text})"
    text = re.sub(r"0x[0-9a-f]{6,}", "0x…", text)
    text = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<uid>", text)
    text = re.sub(r"\b([a-z][a-z0-9]*(?:-[a-z][a-z0-9]*)*)-\d{1,5}\b(?=[/\"])", r"\1-N", text)
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


# set when a run is interrupted: each running e2e.test (in a session of its own, so a
# Ctrl-C does not reach it) is killed, and no more are started
STOP = threading.Event()


def run_spec(e2e_test: Path, kubectl: Path, spec: str, target: Target, workdir: Path,
             timeout: int) -> Result:
    """One spec in one e2e.test process; its JSON report says how it went."""
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / "report.json"
    # ginkgo matches the focus against "<suite description> <spec name>"
    args = [str(e2e_test), *e2e_args(target, workdir, kubectl),
            f"--ginkgo.focus= {go_regex_literal(spec)}$", f"--ginkgo.timeout={timeout}s",
            f"--ginkgo.json-report={report}", "--ginkgo.v"]
    started = time.monotonic()
    with open(workdir / "e2e.log", "wb") as log:
        proc = subprocess.Popen(args, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        # ginkgo stops itself at `timeout`; the deadline is the backstop, STOP the run's end
        deadline = time.monotonic() + timeout + 120
        while proc.poll() is None:
            if STOP.wait(1.0) or time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - started
    found = [r for r in _spec_reports(report) if r[0] == spec] if report.exists() else []
    if not found:
        return Result(spec, FAILED, seconds, f"e2e.test (exit {proc.returncode}) reported no "
                      f"result for the spec; see {workdir / 'e2e.log'}")
    _, state, _, message = found[0]
    if state == "passed":
        return Result(spec, PASSED, seconds)
    if state == "skipped":  # the spec skipped itself (e.g. a provider check)
        return Result(spec, SKIPPED, seconds, summarize(message) or "skipped by the spec")
    if state == "timedout":  # ginkgo stopped it at --ginkgo.timeout
        message = message.replace("A suite timeout occurred", f"no result within {timeout} s")
    return Result(spec, FAILED, seconds, summarize(message) or state)


def run_all(plan: Plan, target: Target, workdir: Path, only: str | None = None,
            log: Callable[[str], None] = print,
            names: Collection[str] | None = None,
            progress: Callable[[list[Result], float], None] | None = None,
            ) -> tuple[list[Result], float]:
    """Every spec of the plan: run, or named with why not (`only`, a regular expression,
    and `names` narrow the run). Returns the results in the listing's order and the
    wall time of the runs in seconds. `progress` is told the results so far after each
    spec (those not run yet as not run), with the wall time so far."""
    STOP.clear()
    bins = build.ensure(["e2e.test", "kubectl"], log=log)
    specs = list_specs(bins["e2e.test"], plan, target, workdir / "list")
    results: dict[str, Result] = {}
    to_run = []
    for spec in specs:
        why = plan.why_not_run(spec)
        if why is not None:
            results[spec] = Result(spec, NOT_RUN, reason=why)
        elif only and not re.search(only, spec):
            results[spec] = Result(spec, NOT_RUN, reason=f"not in this run's --only {only!r}")
        elif names is not None and spec not in names:
            results[spec] = Result(spec, NOT_RUN, reason="not in this run's selection")
        else:
            to_run.append(spec)
    # the specs not yet passing tend to wait out their timeouts: start them first; then
    # the [Slow] ones (minutes each), so the others fill the workers around them
    expected = set(plan.expected_pass)
    to_run.sort(key=lambda s: (s in expected, "[Slow]" not in s))
    serial = [s for s in to_run if re.search(plan.serial, s)]
    log(f"{len(specs)} specs: running {len(to_run) - len(serial)}, {plan.workers} at a "
        f"time, then {len(serial)} one at a time")
    started = time.monotonic()
    done = 0
    for batch, workers in (([s for s in to_run if s not in serial], plan.workers),
                           (serial, 1)):
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(run_spec, bins["e2e.test"], bins["kubectl"], spec, target,
                                   workdir / f"spec-{to_run.index(spec):03d}",
                                   plan.spec_timeout if spec in expected else plan.trial_timeout)
                       for spec in batch]
            try:
                for future in concurrent.futures.as_completed(futures):
                    r = future.result()
                    results[r.spec] = r
                    done += 1
                    log(f"[{done}/{len(to_run)}] {r.status} {r.seconds:.0f}s {r.spec}")
                    if progress is not None:
                        progress([results.get(s) or Result(s, NOT_RUN, reason=NOT_REACHED)
                                  for s in specs], time.monotonic() - started)
            except BaseException:  # interrupted: start nothing more, end what runs
                pool.shutdown(wait=False, cancel_futures=True)
                STOP.set()
                raise
    return [results[s] for s in specs], time.monotonic() - started


def ratchet(results: list[Result], plan: Plan, narrowed: bool = False) -> list[str]:
    """What makes the run fail: an expected pass that did not pass, or a name in
    specs.yaml that the listing no longer has. A narrowed run (--only, --sample) is
    judged on the specs it ran."""
    by_name = {r.spec: r for r in results}
    problems = [f"expected to pass, {by_name[s].status}: {s}: {by_name[s].reason}"
                for s in plan.expected_pass if s in by_name and by_name[s].status != PASSED
                and not (narrowed and by_name[s].status == NOT_RUN)]
    problems += [f"specs.yaml names a spec the suite does not list: {s}"
                 for s in [*plan.expected_pass, *plan.cannot_run] if s not in by_name]
    return problems


def newly_passing(results: list[Result], plan: Plan) -> list[str]:
    """Specs that passed but are not yet in the ratchet (add them to specs.yaml)."""
    return [r.spec for r in results if r.status == PASSED and r.spec not in plan.expected_pass]


# What the page says of the run besides its results (the page is the project's
# conformance document, not only a report).
HOW_IT_RUNS = [
    "### How the run works",
    "",
    "The specs of `test/e2e/common/storage` are the kubelet's own volume specs (ConfigMap, "
    "Secrets, Projected, Downward API, EmptyDir and HostPath volumes). The control plane, "
    "the operator and the agent are the ones `make run` starts (`nodepulse-dev up`), on a "
    "control plane of their own. The specs' images are built here and tagged with the "
    "names the specs use (`e2e/conformance/images.py`: agnhost and nonewprivs from the "
    "pinned Kubernetes module, nginx from Debian's packages (downloaded with "
    "`apt-get download`, not installed), busybox and pause as the e2e suite builds them, "
    "see [development.md](development.md#pinned-versions)). What a spec pulls from "
    "registry.k8s.io (agnhost, with imagePullPolicy Always) comes from the e2e suite's "
    "loopback registry ([development.md](development.md#an-image-registry-for-tests)), "
    "which the test containerd uses as that host's mirror (test setup only; the agent "
    "pulls as it would from the internet). `e2e/conformance/specs.yaml` is the one file "
    "that says which specs run, which cannot run here and why, and which must pass (the "
    "ratchet: the test fails when one of those does not). Each spec runs in an `e2e.test` "
    "process of its own, several at a time.",
    "",
    "`python -m e2e.conformance` runs it outside pytest; `--only RE` runs the specs whose "
    "names match, and a longer `--trial-timeout` (seconds; 420, say) finds specs that pass "
    "now but are not yet in the ratchet.",
]


def replace_section(page: str, name: str, body: str) -> str:
    """`page` with the text between its markers for section `name` replaced by `body`
    (the markers and the section appended when the page has none): a page holds the
    generated tables of several runs between hand-written text."""
    begin, end = f"<!-- begin {name}: generated, do not edit -->", f"<!-- end {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return page.rstrip() + "\n\n" + block + "\n"


def write_section(name: str, body: str, path: Path = DOC) -> None:
    page = path.read_text() if path.exists() else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(replace_section(page, name, body))


def write_doc(results: list[Result], plan: Plan, wall: float, path: Path = DOC,
              note: str = "") -> None:
    """The node suite's section of the page."""
    counts = {s: sum(r.status == s for r in results) for s in (PASSED, FAILED, SKIPPED, NOT_RUN)}
    version = build.kubernetes_version()
    expected = set(plan.expected_pass)
    lines = [
        "## The node specs on the local control plane",
        "",
        f"The `[NodeConformance]` specs of `test/e2e/common/node` and "
        "`test/e2e/common/storage` (the kubelet's volume specs), the NodeLease specs and "
        f"the in-place pod resize `[Conformance]` specs of Kubernetes {version}, run by "
        "`e2e.test` (built from the pinned module) against one nodepulse agent on "
        "containerd, on the local control plane with the nodepulse operator. Written by "
        "`python -m e2e.conformance`; `make test` runs the sample of "
        "`e2e/conformance/specs.yaml` (`e2e/test_conformance.py`), which also says what runs, "
        "what cannot run here and why, and which specs must pass.",
        "",
        f"**{counts[PASSED]} passed, {counts[FAILED]} failed, {counts[SKIPPED]} skipped by "
        f"the spec, {counts[NOT_RUN]} not run** of {len(results)}; "
        f"{len(expected)} are expected to pass (specs.yaml). The runs took "
        f"{wall / 60:.1f} min of wall time, {plan.workers} e2e.test processes at a time "
        "(those specs.yaml names serial alone, after the others); "
        f"each expected pass was given {plan.spec_timeout} s, each other spec "
        f"{plan.trial_timeout} s.",
        *(["", note] if note else []),
        "",
        *HOW_IT_RUNS,
        "",
        "| spec | result | s | why not passed |",
        "|---|---|---|---|",
    ]
    for r in results:
        mark = f"{r.status}{' (expected pass)' if r.spec in expected else ''}"
        spec, reason = (text.replace("|", "\\|") for text in (r.spec, r.reason))
        lines.append(f"| {spec} | {mark} | {r.seconds:.0f} | {reason} |")
    write_section("node-suite", "\n".join(lines), path)


NODE_NAME = "np-conformance"


def measure(workdir: Path, only: str | None = None, plan: Plan | None = None,
            log: Callable[[str], None] = print, names: Collection[str] | None = None
            ) -> tuple[list[Result], float, Plan]:
    """Bring up the control plane, the operator and one agent on containerd with the
    upstream images, run the plan's specs against them, stop everything by PID.
    Logs of the run (each spec's e2e.log and report, the components' logs) stay in
    `workdir`."""
    from e2e.conformance.images import import_all, serve_upstream_pulls
    from nodepulse_dev.devcluster import DevCluster, Options
    from nodepulse_dev.ports import free_port

    plan = plan or load_plan()
    build.ensure(["e2e.test", "kubectl"], log=log)  # before anything runs
    # `make run`'s system without its extras: one node on containerd, at 127.0.0.1
    stack = DevCluster(Options(node_name=NODE_NAME, runtime="cri", node_ip="127.0.0.1",
                               metrics_server=False, require_containerd=True,
                               health_address=f"127.0.0.1:{free_port()}",
                               operator_metrics_port=free_port()))
    mirror = None
    try:
        stack.start()
        log(f"images: {', '.join(import_all(stack.ctd).values())}")
        mirror = serve_upstream_pulls(stack.ctd, workdir / "registry")
        log(f"registry.k8s.io served by the local registry at {mirror.host}")
        wait_schedulable(stack.cluster.kubeconfig, NODE_NAME)
        return (*run_all(plan, Target(stack.cluster.kubeconfig, stack.ctd.endpoint),
                         workdir, only, log, names), plan)
    finally:
        subprocess.run(["cp", "-r", str(stack.cluster.log_dir), str(workdir / "logs")],
                       check=False)
        stack.stop()
        if mirror is not None:
            mirror.stop()


def wait_schedulable(kubeconfig: Path, node: str, timeout: float = 120) -> None:
    """The node is Ready and has no NoSchedule/NoExecute taint (the operator lifts
    admission's not-ready taint). e2e.test would otherwise wait 30 min for it."""
    from kubernetes import client

    from nodeagent.api.client import new_api_client

    core = client.CoreV1Api(new_api_client(kubeconfig, component="e2e"))
    deadline = time.monotonic() + timeout
    state = "not registered"
    while time.monotonic() < deadline:
        try:
            n = core.read_node(node)
        except client.ApiException as e:
            if e.status != 404:
                raise
        else:
            ready = [c.status for c in n.status.conditions or [] if c.type == "Ready"]
            taints = [f"{t.key}:{t.effect}" for t in n.spec.taints or []
                      if t.effect in ("NoSchedule", "NoExecute")]
            if ready == ["True"] and not taints:
                return
            state = f"Ready={ready}, taints={taints}"
        time.sleep(1)
    raise TimeoutError(f"node {node} not Ready and untainted within {timeout:.0f} s ({state})")
