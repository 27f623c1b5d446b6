"""The decision of a pod sync (nodeagent.pods.decide), table by table: a pod spec, the
runtime's state of it, the status last written and the node's answers in; the actions
out. No runtime, no clock, no event loop."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from nodeagent.pods.admission import AdmissionSettings, Rejection
from nodeagent.pods.backoff import crash_key
from nodeagent.pods.decide import (
    RETRY,
    KillContainer,
    NodeAbilities,
    PodActions,
    StartContainer,
    Verdict,
    Verdicts,
    compute_pod_actions,
    grace_of,
)
from nodeagent.pods.probes import Kind
from nodeagent.runtime.base import (
    ANNOTATION_RESOURCES,
    Container,
    ContainerState,
    PodRuntimeStatus,
    Resources,
    Sandbox,
    SandboxState,
    container_spec_hash,
)
from tests.conftest import mkpod

NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
NODE = NodeAbilities(admission=AdmissionSettings(kernel=(6, 1), apparmor=False),
                     runtime="fake")
RUNNING, EXITED, CREATED = ContainerState.RUNNING, ContainerState.EXITED, ContainerState.CREATED
UNKNOWN = ContainerState.UNKNOWN


def c(name: str, state: ContainerState, attempt: int = 0, *, sandbox: str = "s0",
      code: int | None = None, spec: Mapping[str, Any] | None = None) -> Container:
    """A container of pod uid-p in the runtime; `spec`: the definition it was made from
    (its hash), else the one mkpod gives a container of that name."""
    made = spec or {"name": name, "image": "localhost/busybox:1", "command": ["sleep", "3600"]}
    return Container(id=f"{name}-{attempt}", sandbox_id=sandbox, pod_uid="uid-p", name=name,
                     image="localhost/busybox:1", state=state, attempt=attempt,
                     restart_count=attempt, exit_code=code if state == EXITED else None,
                     spec_hash=container_spec_hash(made))


def sb(attempt: int = 0, ready: bool = True) -> Sandbox:
    return Sandbox(id=f"s{attempt}", pod_uid="uid-p", name="p", namespace="ns",
                   attempt=attempt, state=SandboxState.READY if ready else SandboxState.NOTREADY,
                   ip="10.0.0.9")


def box(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "image": "localhost/busybox:1", "command": ["sleep", "3600"], **kw}


@dataclass
class Case:
    pod: dict[str, Any]
    sandboxes: Sequence[Sandbox] = ()
    containers: Sequence[Container] = ()
    previous: Mapping[str, Any] = field(default_factory=dict)
    verdicts: Verdicts = Verdicts()
    node: NodeAbilities = NODE

    def decide(self) -> PodActions:
        rs = PodRuntimeStatus("uid-p", list(self.sandboxes), list(self.containers))
        return compute_pod_actions(self.pod, rs, self.previous, now=NOW, node=self.node,
                                   verdicts=self.verdicts)


def starts(act: PodActions) -> list[tuple[str, int, bool]]:
    """(name, attempt, in place of one created before) of each start, in order."""
    return [(str(s.spec["name"]), s.attempt, s.replaces is not None) for s in act.start]


def kills(act: PodActions) -> list[tuple[str, str, float | None]]:
    return [(k.container.name, k.message, k.grace) for k in act.kill]


# --- the pod as a whole ----------------------------------------------------------------

@pytest.mark.parametrize("case,verdict", [
    (Case(mkpod("p"), previous={"phase": "Succeeded"}), Verdict.FINISHED),
    (Case(mkpod("p"), previous={"phase": "Failed"}), Verdict.FINISHED),
    (Case(mkpod("p", labels={"kubernetes.io/os": "windows"})), Verdict.REJECTED),
    (Case(mkpod("p", activeDeadlineSeconds=30),
          previous={"startTime": "2026-11-29T11:59:00Z"}), Verdict.DEADLINE),
    # the sandbox died after a Never pod's container ran: it will not run again
    (Case(mkpod("p", policy="Never"), sandboxes=[sb(0, ready=False)],
          containers=[c("c", EXITED, code=0)]), Verdict.ENDED),
    (Case(mkpod("p", hostUsers=False)), Verdict.REFUSED),
    (Case(mkpod("p"), verdicts=Verdicts(rejection=Rejection("OutOfcpu", "short"))),
     Verdict.REJECTED),
    (Case(mkpod("p"), verdicts=Verdicts(admission_waits=True)), Verdict.WAITING),
    # a pod that ended stays ended, whatever admission says of it now
    (Case(mkpod("p"), previous={"phase": "Failed"},
          verdicts=Verdicts(rejection=Rejection("OutOfcpu", "short"))), Verdict.FINISHED),
    (Case(mkpod("p")), Verdict.RUN),
], ids=["succeeded", "failed", "other-os", "deadline", "never-sandbox-died", "pod-field",
        "node-rejects", "node-undecided", "ended-then-rejected", "runs"])
def test_what_becomes_of_the_pod(case: Case, verdict: Verdict) -> None:
    assert case.decide().verdict == verdict


def test_a_rejection_carries_the_kubelets_reason() -> None:
    act = Case(mkpod("p", labels={"kubernetes.io/os": "windows"})).decide()
    assert act.rejection is not None
    assert act.rejection.reason == "PodOSSelectorNodeLabelDoesNotMatch"
    assert not act.start and act.new_sandbox is None
    # the pod alone decides first; the node's verdict when the pod itself is fine
    act = Case(mkpod("p", labels={"kubernetes.io/os": "windows"}),
               verdicts=Verdicts(rejection=Rejection("OutOfcpu", "short"))).decide()
    assert act.rejection is not None and act.rejection.reason.startswith("PodOS")
    act = Case(mkpod("p"), verdicts=Verdicts(rejection=Rejection("OutOfcpu", "short"))).decide()
    assert act.rejection == Rejection("OutOfcpu", "short")
    assert not act.start and act.new_sandbox is None


def test_a_deadline_to_come_is_the_next_sync_at_the_latest() -> None:
    act = Case(mkpod("p", activeDeadlineSeconds=300),
               previous={"startTime": "2026-11-29T11:59:00Z"}).decide()
    assert act.verdict == Verdict.RUN and act.requeue_after == pytest.approx(240)


def test_a_pod_level_field_refuses_every_container_and_makes_no_sandbox() -> None:
    act = Case(mkpod("p", containers=("a", "b"), hostUsers=False)).decide()
    assert set(act.refuse) == {"a", "b"}
    assert all("hostUsers" in m for m in act.refuse.values())
    assert act.new_sandbox is None and not act.start


# --- the sandbox -----------------------------------------------------------------------

SANDBOX_CASES = [
    # (sandboxes, containers, new sandbox attempt, stopped first, stopped duplicates)
    ([], [], 0, [], []),
    ([sb(0, ready=False)], [c("c", RUNNING)], 1, ["c"], []),
    ([sb(0, ready=False), sb(1, ready=False)], [c("c", EXITED, code=1)], 2, [], []),
    ([sb(0), sb(1)], [c("c", RUNNING, sandbox="s1")], None, [], ["s0"]),
]


@pytest.mark.parametrize("sandboxes,containers,attempt,first,dupes", SANDBOX_CASES,
                         ids=["none", "old-one-stopped", "several-old", "duplicates"])
def test_the_sandbox(sandboxes: list[Sandbox], containers: list[Container],
                     attempt: int | None, first: list[str], dupes: list[str]) -> None:
    act = Case(mkpod("p"), sandboxes=sandboxes, containers=containers).decide()
    assert act.new_sandbox == attempt
    assert [x.name for x in act.stop_first] == first
    assert list(act.stop_sandboxes) == dupes
    if attempt is None:
        assert act.sandbox is not None and act.sandbox.id == "s1"  # the newest ready one


def test_a_new_sandbox_gets_every_container_at_its_next_attempt() -> None:
    act = Case(mkpod("p", containers=("a", "b")), sandboxes=[sb(0, ready=False)],
               containers=[c("a", EXITED, 3, code=0)]).decide()
    assert starts(act) == [("a", 4, False), ("b", 0, False)]
    assert [s.restarts for s in act.start] == [4, 0]


# --- regular containers ----------------------------------------------------------------

def test_a_changed_definition_is_killed_and_started_again_without_back_off() -> None:
    old = box("c", image="localhost/busybox:0")
    act = Case(mkpod("p"), sandboxes=[sb()], containers=[c("c", RUNNING, 2, spec=old)],
               verdicts=Verdicts(backoff={crash_key("uid-p", box("c")): (50.0, 80.0)})
               ).decide()
    assert kills(act) == [("c", "Container c definition changed, will be restarted", None)]
    assert starts(act) == [("c", 3, False)] and act.start[0].backoff_key is None


def test_a_container_made_before_in_place_resize_keeps_its_whole_spec_hash() -> None:
    """An agent before in-place resize hashed the resources too and recorded none: its
    containers are not restarted by an upgrade; a changed image still restarts them."""
    spec = box("c", resources={"requests": {"cpu": "100m"}})
    old = c("c", RUNNING)
    old.spec_hash = container_spec_hash(spec, whole=True)
    act = Case(mkpod("p", containers=[spec]), sandboxes=[sb()], containers=[old]).decide()
    assert not act.kill and not act.start
    newer = {**spec, "image": "localhost/busybox:2"}
    act = Case(mkpod("p", containers=[newer]), sandboxes=[sb()], containers=[old]).decide()
    assert kills(act) == [("c", "Container c definition changed, will be restarted", None)]


@pytest.mark.parametrize("policy,message", [
    ("Always", "Container c failed liveness probe, will be restarted"),
    ("Never", "Container c failed liveness probe"),
])
def test_a_failed_liveness_probe_kills_with_the_probes_grace(policy: str, message: str) -> None:
    spec = box("c", livenessProbe={"exec": {"command": ["true"]},
                                   "terminationGracePeriodSeconds": 3})
    running = c("c", RUNNING, spec=spec)
    act = Case(mkpod("p", policy=policy, containers=[spec]), sandboxes=[sb()],
               containers=[running],
               verdicts=Verdicts(probe_kills={running.id: Kind.LIVENESS})).decide()
    assert kills(act) == [("c", message, 3.0)] and not act.start


def test_a_delete_grace_comes_before_the_probes() -> None:
    spec = box("c", livenessProbe={"exec": {"command": ["true"]},
                                   "terminationGracePeriodSeconds": 3})
    pod = mkpod("p", containers=[spec])
    pod["metadata"]["deletionGracePeriodSeconds"] = 20
    running = c("c", RUNNING, spec=spec)
    act = Case(pod, sandboxes=[sb()], containers=[running],
               verdicts=Verdicts(probe_kills={running.id: Kind.LIVENESS})).decide()
    assert [k.grace for k in act.kill] == [None]
    assert grace_of(pod) == 20


RESTART_CASES = [
    # (restartPolicy, exit code, back-off left, starts, waiting reason, terminal)
    ("Always", 0, None, [("c", 1, False)], None, False),
    ("Always", 1, (25.0, 40.0), [], "CrashLoopBackOff", False),
    ("OnFailure", 1, None, [("c", 1, False)], None, False),
    ("OnFailure", 0, None, [], None, True),
    ("Never", 1, None, [], None, True),
]


@pytest.mark.parametrize("policy,code,left,started,reason,terminal", RESTART_CASES,
                         ids=["always", "always-backing-off", "onfailure-failed",
                              "onfailure-succeeded", "never"])
def test_an_exited_container(policy: str, code: int, left: tuple[float, float] | None,
                             started: list[tuple[str, int, bool]], reason: str | None,
                             terminal: bool) -> None:
    key = crash_key("uid-p", box("c"))
    act = Case(mkpod("p", policy=policy), sandboxes=[sb()],
               containers=[c("c", EXITED, code=code)],
               verdicts=Verdicts(backoff={key: left} if left else {})).decide()
    assert starts(act) == started
    assert (act.waiting["c"].reason if act.waiting else None) == reason
    assert act.terminal == terminal
    if started:
        assert act.start[0].backoff_key == key  # the back-off counts this restart
    if left:
        assert act.requeue_after == 25.0
        assert act.waiting["c"].message.startswith("back-off 40s restarting failed "
                                                   "container=c pod=p_ns(uid-p)")


def test_a_created_container_is_replaced_and_a_running_one_left_alone() -> None:
    """A start cut short leaves a container created and never started, which containerd
    may refuse to start again (it then marks it exited, StartError): a new attempt
    takes its place, as the kubelet makes one; it never ran, so no restart is counted,
    whatever the restart policy."""
    for policy in ("Always", "Never"):
        act = Case(mkpod("p", containers=("a", "b"), policy=policy), sandboxes=[sb()],
                   containers=[c("a", CREATED), c("b", RUNNING)]).decide()
        assert starts(act) == [("a", 1, True)] and not act.kill and not act.waiting
        [start] = act.start
        assert start.replaces is not None and start.replaces.id == "a-0"
        assert start.restarts == 0 and start.backoff_key is None


def test_a_container_in_an_unknown_state_is_stopped_then_started_again() -> None:
    """It may still run: stopped first, so two never run at once; then a new attempt,
    whatever the restart policy (the kubelet's rule)."""
    for policy in ("Always", "Never"):
        act = Case(mkpod("p", policy=policy), sandboxes=[sb()],
                   containers=[c("c", UNKNOWN)]).decide()
        assert kills(act) == [("c", "Container c is in an unknown state and may still run: "
                                    "stopped", None)]
        assert starts(act) == [("c", 1, False)] and act.start[0].restarts == 1


def test_an_unknown_init_container_of_a_never_pod_is_stopped_not_run_again() -> None:
    pod = mkpod("p", policy="Never", initContainers=[box("i1")])
    act = Case(pod, sandboxes=[sb()], containers=[c("i1", UNKNOWN)]).decide()
    assert [k[0] for k in kills(act)] == ["i1"] and not act.start and act.init_blocked


def test_a_refused_container_is_reported_and_the_others_start() -> None:
    bad = box("bad", volumeDevices=[{"name": "v"}])
    act = Case(mkpod("p", containers=("good", bad)), sandboxes=[sb()]).decide()
    assert starts(act) == [("good", 0, False)]
    assert act.refuse["bad"].startswith("spec.containers[1].volumeDevices: ")


def test_probes_not_run_refuse_the_containers_that_have_one() -> None:
    probed = box("p1", readinessProbe={"exec": {"command": ["true"]}})
    act = Case(mkpod("p", containers=("plain", probed)), sandboxes=[sb()],
               node=NodeAbilities(admission=NODE.admission, probes=False)).decide()
    assert starts(act) == [("plain", 0, False)] and "readinessProbe" in act.refuse["p1"]


def test_host_aliases_need_a_runtime_that_mounts() -> None:
    pod = mkpod("p", hostAliases=[{"ip": "10.1.1.1", "hostnames": ["a"]}])
    act = Case(pod, node=NodeAbilities(admission=NODE.admission, can_mount=False,
                                       runtime="process")).decide()
    assert act.verdict == Verdict.REFUSED
    assert "the process runtime runs containers in the node's filesystem" in act.refuse["c"]


# --- init containers and sidecars -------------------------------------------------------

INIT_CASES = [
    # (init containers in the runtime, regular ones, starts, blocked)
    ([], [], [("i1", 0, False)], True),
    ([c("i1", RUNNING)], [], [], True),
    ([c("i1", EXITED, code=0)], [], [("i2", 0, False)], True),
    ([c("i1", EXITED, code=0), c("i2", EXITED, code=0)], [], [("c", 0, False)], False),
    ([c("i1", EXITED, code=1)], [], [("i1", 1, False)], True),
    ([c("i1", CREATED)], [], [("i1", 1, True)], True),
    ([c("i1", UNKNOWN)], [], [("i1", 1, False)], True),
    # once a regular container exists, the pod is initialized: init containers that
    # were removed since are not run again
    ([], [c("c", RUNNING)], [], False),
]


@pytest.mark.parametrize("inits,regular,started,blocked", INIT_CASES,
                         ids=["first", "first-running", "second", "all-done", "failed",
                              "created", "unknown", "initialized"])
def test_init_containers_one_at_a_time(inits: list[Container], regular: list[Container],
                                       started: list[tuple[str, int, bool]],
                                       blocked: bool) -> None:
    pod = mkpod("p", initContainers=[box("i1"), box("i2")])
    act = Case(pod, sandboxes=[sb()], containers=[*inits, *regular]).decide()
    assert starts(act) == started and act.init_blocked == blocked


def test_a_failed_init_container_of_a_never_pod_ends_it() -> None:
    pod = mkpod("p", policy="Never", initContainers=[box("i1")])
    act = Case(pod, sandboxes=[sb()], containers=[c("i1", EXITED, code=1)]).decide()
    assert act.verdict == Verdict.ENDED


@pytest.mark.parametrize("started,regular", [(False, []), (True, [("c", 0, False)])])
def test_a_sidecar_holds_the_containers_back_until_it_has_started(
        started: bool, regular: list[tuple[str, int, bool]]) -> None:
    side = box("side", restartPolicy="Always", startupProbe={"exec": {"command": ["true"]}})
    running = c("side", RUNNING, spec=side)
    act = Case(mkpod("p", initContainers=[side]), sandboxes=[sb()], containers=[running],
               verdicts=Verdicts(started=frozenset({running.id} if started else ()))
               ).decide()
    assert starts(act) == regular and act.init_blocked != started


def test_a_sidecar_that_exited_is_restarted_whatever_the_pods_policy() -> None:
    side = box("side", restartPolicy="Always")
    act = Case(mkpod("p", policy="Never", initContainers=[side]), sandboxes=[sb()],
               containers=[c("side", EXITED, code=0, spec=side), c("c", RUNNING)]).decide()
    assert starts(act) == [("side", 1, False)]


def test_a_sidecars_failed_startup_probe_kills_it() -> None:
    side = box("side", restartPolicy="Always", startupProbe={"exec": {"command": ["true"]}})
    running = c("side", RUNNING, spec=side)
    act = Case(mkpod("p", initContainers=[side]), sandboxes=[sb()], containers=[running],
               verdicts=Verdicts(probe_kills={running.id: Kind.STARTUP})).decide()
    assert kills(act) == [("side", "Init container side failed startup probe", None)]
    assert act.init_blocked


# --- in-place resize -------------------------------------------------------------------

MI = 1024 * 1024
GIVEN = Resources(100, 100, 64 * MI, 64 * MI)  # what the running container was made with


def sized(name: str = "c", cpu: str = "100m", memory: str = "64Mi",
          policy: dict[str, str] | None = None) -> dict[str, Any]:
    """A Guaranteed container of these resources, with a resizePolicy per resource."""
    res = {"cpu": cpu, "memory": memory}
    return box(name, resources={"requests": res, "limits": dict(res)},
               resizePolicy=[{"resourceName": k, "restartPolicy": v}
                             for k, v in (policy or {}).items()])


def made(spec: dict[str, Any], given: Resources | None = GIVEN, attempt: int = 0,
         state: ContainerState = RUNNING) -> Container:
    """The container running `spec`, made with `given` (None: no record of it)."""
    out = c(str(spec["name"]), state, attempt, spec=spec)
    if given is not None:
        out.annotations[ANNOTATION_RESOURCES] = given.encode()
    return out


RESTART, NOT_REQUIRED = "RestartContainer", "NotRequired"
RESIZE_CASES = [
    # (allocated spec, applied, recorded updates) -> (in place: resources, restarted)
    (sized(), GIVEN, {}, [], False),
    (sized(cpu="200m"), GIVEN, {}, [("cpu",)], False),
    (sized(memory="128Mi"), GIVEN, {}, [("memory",)], False),
    (sized(cpu="200m", memory="32Mi"), GIVEN, {}, [("memory", "cpu")], False),
    # "1" is 1000m: a value, not a string, is compared
    (sized(cpu="1"), Resources(1000, 1000, 64 * MI, 64 * MI), {}, [], False),
    # the policy of the resource that changes decides
    (sized(cpu="200m", policy={"memory": RESTART}), GIVEN, {}, [("cpu",)], False),
    (sized(memory="128Mi", policy={"memory": RESTART}), GIVEN, {}, [], True),
    (sized(cpu="300m", memory="128Mi", policy={"cpu": RESTART, "memory": NOT_REQUIRED}),
     GIVEN, {}, [], True),
    # its last in-place update counts, not what it was made with
    (sized(cpu="200m"), GIVEN, {"c-0": Resources(200, 200, 64 * MI, 64 * MI)}, [], False),
    # made by an agent that kept no record: from nothing, as the kubelet without its own
    (sized(), None, {}, [("memory", "cpu")], False),
]


@pytest.mark.parametrize("spec,given,updated,in_place,restarted", RESIZE_CASES,
                         ids=["same", "cpu", "memory", "both", "equivalent",
                              "other-policy", "memory-restart", "cpu-restart", "recorded",
                              "no-record"])
def test_a_running_container_follows_its_allocated_resources(
        spec: dict[str, Any], given: Resources | None, updated: dict[str, Resources],
        in_place: list[tuple[str, ...]], restarted: bool) -> None:
    cur = made(spec, given)
    act = Case(mkpod("p", containers=[spec]), sandboxes=[sb()], containers=[cur],
               verdicts=Verdicts(resized=updated)).decide()
    assert [r.resources for r in act.resize] == in_place
    assert act.resize_restarts == restarted
    if restarted:
        assert kills(act) == [("c", "Container c resize requires restart", None)]
        assert starts(act) == [("c", 1, False)] and act.start[0].backoff_key is None
    else:
        assert not act.kill and not act.start
    for r in act.resize:  # from what it has now to what is allocated
        assert r.container is cur and r.have == (given or Resources())
        limits = spec["resources"]["limits"]
        assert (r.want.cpu_limit_millis, r.want.memory_limit_bytes) == (
            {"100m": 100, "200m": 200}[limits["cpu"]],
            {"64Mi": 64 * MI, "32Mi": 32 * MI, "128Mi": 128 * MI}[limits["memory"]])


def test_only_a_running_container_is_resized() -> None:
    """One that exited starts again with what is allocated; a static pod's containers
    are never resized in place."""
    spec = sized(cpu="200m")
    act = Case(mkpod("p", containers=[spec]), sandboxes=[sb()],
               containers=[made(spec, state=EXITED)]).decide()
    assert not act.resize and starts(act) == [("c", 1, False)]
    static = mkpod("p", containers=[spec])
    static["metadata"]["annotations"] = {"kubernetes.io/config.source": "file"}
    act = Case(static, sandboxes=[sb()], containers=[made(spec)]).decide()
    assert not act.resize and not act.kill


def test_a_sidecar_is_resized_and_an_init_container_is_not() -> None:
    side = {**sized("side", cpu="200m"), "restartPolicy": "Always"}
    act = Case(mkpod("p", initContainers=[side], containers=[sized()]), sandboxes=[sb()],
               containers=[made(side), made(sized())],
               verdicts=Verdicts(started=frozenset({"side-0"}))).decide()
    assert [(r.container.name, r.resources) for r in act.resize] == [("side", ("cpu",))]
    side = {**side, "resizePolicy": [{"resourceName": "cpu", "restartPolicy": RESTART}]}
    act = Case(mkpod("p", initContainers=[side], containers=[sized()]), sandboxes=[sb()],
               containers=[made(side), made(sized())]).decide()
    assert kills(act) == [("side", "Container side resize requires restart", None)]
    assert starts(act) == [("side", 1, False)] and act.start[0].init


# --- ephemeral containers --------------------------------------------------------------

def debug(name: str = "dbg", **kw: Any) -> dict[str, Any]:
    return {"name": name, "image": "localhost/busybox:1", **kw}


def test_an_ephemeral_container_starts_once_in_the_running_pod() -> None:
    pod = mkpod("p", ephemeralContainers=[debug(targetContainerName="c")])
    act = Case(pod, sandboxes=[sb()], containers=[c("c", RUNNING)]).decide()
    assert starts(act) == [("dbg", 0, False)] and act.start[0].target_id == "c-0"
    # not again: the runtime has it, or its status says it ran
    assert not Case(pod, sandboxes=[sb()],
                    containers=[c("c", RUNNING), c("dbg", EXITED, code=0)]).decide().start
    ran = {"ephemeralContainerStatuses": [{"name": "dbg", "containerID": "fake://x"}]}
    assert not Case(pod, sandboxes=[sb()], containers=[c("c", RUNNING)],
                    previous=ran).decide().start


def test_an_ephemeral_container_waits_for_its_target_and_not_for_a_new_sandbox() -> None:
    pod = mkpod("p", ephemeralContainers=[debug(targetContainerName="c")])
    act = Case(pod, sandboxes=[sb()], containers=[c("c", EXITED, code=1)],
               verdicts=Verdicts(backoff={crash_key("uid-p", box("c")): (9.0, 10.0)})
               ).decide()
    assert "container 'c' is not running" in act.refuse["dbg"] and not act.start
    assert act.requeue_after == min(9.0, RETRY)
    fresh = Case(pod).decide()  # a sandbox made by this sync gets none
    assert starts(fresh) == [("c", 0, False)]


def test_the_decision_is_a_value() -> None:
    """The same inputs, the same decision: nothing is read but the arguments."""
    case = Case(mkpod("p", containers=("a", "b")), sandboxes=[sb()],
                containers=[c("a", EXITED, code=1)])
    assert case.decide() == case.decide()
    assert isinstance(case.decide().start[0], StartContainer)
    assert all(isinstance(k, KillContainer) for k in case.decide().kill)


# --- a runtime that lost the pod (its containers gone without a trace) ---------------

def _ran(state: Mapping[str, Any]) -> dict[str, Any]:
    """A previous status whose container c ran as the fake runtime's fake://c-0."""
    return {"phase": "Running", "containerStatuses": [
        {"name": "c", "containerID": "fake://c-0", "state": state}]}


RUNNING_BEFORE = _ran({"running": {"startedAt": "2026-11-29T11:59:00Z"}})
SUCCEEDED_BEFORE = _ran({"terminated": {"exitCode": 0, "reason": "Completed"}})


@pytest.mark.parametrize("policy,previous,verdict,started", [
    ("Never", RUNNING_BEFORE, Verdict.ENDED, []),
    ("Never", SUCCEEDED_BEFORE, Verdict.ENDED, []),
    ("OnFailure", SUCCEEDED_BEFORE, Verdict.ENDED, []),
    # lost while running: a failure, which OnFailure and Always restart
    ("OnFailure", RUNNING_BEFORE, Verdict.RUN, [("c", 0, False)]),
    ("Always", SUCCEEDED_BEFORE, Verdict.RUN, [("c", 0, False)]),
    # never ran (no container id yet): started, whatever the policy
    ("Never", {"phase": "Pending", "containerStatuses": [
        {"name": "c", "state": {"waiting": {"reason": "ContainerCreating"}}}]},
     Verdict.RUN, [("c", 0, False)]),
    # created and never started (its id reported, waiting), then lost: it never ran
    ("Never", _ran({"waiting": {"reason": "ContainerCreating"}}),
     Verdict.RUN, [("c", 0, False)]),
], ids=["never-was-running", "never-succeeded", "onfailure-succeeded", "onfailure-running",
        "always", "never-not-yet-run", "never-created-only"])
def test_a_container_the_runtime_lost_runs_again_only_as_its_restart_policy_says(
        policy: str, previous: Mapping[str, Any], verdict: Verdict,
        started: list[tuple[str, int, bool]]) -> None:
    """The agent restarted on a runtime that lost the pod (the fake runtime after the
    agent's SIGKILL, a reboot): the status says the container ran, the runtime knows
    nothing of it. A run-once container does not run twice (bench.soak: a Job's pod
    that had completed ran again, and the API server refused its status: terminated to
    running); the status reports it as it was (ContainerStatusUnknown if it was
    running) and the pod ends."""
    act = Case(mkpod("p", policy=policy), previous=previous).decide()
    assert act.verdict == verdict and starts(act) == started
