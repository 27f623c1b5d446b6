"""Scripted behaviour of the fake runtime's containers, from pod annotations.

Nothing runs in a fake container, so what a program would do is written on the pod
(KWOK users script their pods with stages; these are nodepulse's):

    fake.nodepulse.dev/run-for: 30s          # each container exits after running 30 s
    fake.nodepulse.dev/exit-code: "1"        # ... with this code (default 0)
    fake.nodepulse.dev/fail-start: "no such file"   # StartContainer fails with this
    fake.nodepulse.dev/ready-after: 20s      # its probes fail for its first 20 s
    fake.nodepulse.dev/cpu: 250m             # the usage it reports (runtime/usage.py:
    fake.nodepulse.dev/memory: 300Mi         # a quantity, ramp(...) or sine(...)): CPU
                                             # and working set, as its stats report them
    fake.nodepulse.dev/disk: 1Gi             # what its writable layer holds
    fake.nodepulse.dev/processes: "40"       # processes it runs (default 1)
    fake.nodepulse.dev/run-for.<container>: 5s      # one container only (wins over the
                                                    # pod-wide key)

What follows is the agent's own doing, as for any runtime: the restart policy restarts
an exited container (with the kubelet's back-off: `run-for` with a non-zero `exit-code`
and `restartPolicy: Always` is a crash loop), a Job's pod completes or fails, a start
that fails is RunContainerError, and the probes decide readiness (`ready-after`: every
probe of the container, of any kind and action, is answered as failed until it has run
that long, as a program that takes that long to come up; give liveness probes an
initialDelaySeconds or a startupProbe beyond it, as for such a program). Durations are
Go's ('30s', '1m30s', '500ms'), amounts are quantities ('300Mi'). The usage lets a
virtual node come under memory, disk or PID pressure, and its eviction manager rank
and evict pods as it would on a real node. A value that cannot be read, or an unknown key under the
prefix, fails the container's creation with the annotation named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from nodeagent.api.quantity import QuantityError, parse_quantity
from nodeagent.config import ConfigError, parse_duration
from nodeagent.runtime.usage import Usage, UsageError, parse_usage

PREFIX = "fake.nodepulse.dev/"
RUN_FOR, EXIT_CODE, FAIL_START, READY_AFTER = "run-for", "exit-code", "fail-start", \
    "ready-after"
CPU, MEMORY, DISK, PROCESSES = "cpu", "memory", "disk", "processes"
KEYS = (RUN_FOR, EXIT_CODE, FAIL_START, READY_AFTER, CPU, MEMORY, DISK, PROCESSES)


class ScriptError(ValueError):
    """An annotation the fake runtime cannot follow; the message names it."""


@dataclasses.dataclass(frozen=True)
class Script:
    run_for: float | None = None  # seconds from start to exit; None: runs until stopped
    exit_code: int = 0
    fail_start: str | None = None  # StartContainer fails with this message
    ready_after: float = 0.0  # probes fail until the container has run this long
    cpu: Usage | None = None  # cores over time; None: the runtime's default
    memory: Usage | None = None  # bytes over time (working set); None: the default
    disk: int = 0         # bytes its writable layer holds
    processes: int = 1    # processes it runs


def script_for(annotations: Mapping[str, str], container: str) -> Script:
    """The script of `container` from its pod's annotations (container-specific keys
    win over pod-wide ones). Raises ScriptError naming the annotation."""
    values: dict[str, tuple[str, str]] = {}  # key -> (annotation, value)
    for name, value in annotations.items():
        if not name.startswith(PREFIX):
            continue
        key, _, target = name[len(PREFIX):].partition(".")
        if key not in KEYS:
            raise ScriptError(f"annotation {name}: unknown (known: "
                              f"{', '.join(PREFIX + k for k in KEYS)}, each optionally "
                              f"with .<container>)")
        if target == container or (not target and key not in values):
            values[key] = (name, value)
    run_for = _duration(values, RUN_FOR)
    exit_code = None
    if EXIT_CODE in values:
        name, value = values[EXIT_CODE]
        try:
            exit_code = int(value)
        except ValueError:
            raise ScriptError(f"annotation {name}: {value!r} is not an exit code") from None
        if not 0 <= exit_code <= 255:
            raise ScriptError(f"annotation {name}: {value!r} is not within 0..255")
    fail_start = values[FAIL_START][1] if FAIL_START in values else None
    return Script(run_for=run_for, exit_code=exit_code or 0,
                  fail_start=(fail_start or "fake: start failed") if fail_start is not None
                  else None, ready_after=_duration(values, READY_AFTER) or 0.0,
                  cpu=_usage(values, CPU), memory=_usage(values, MEMORY),
                  disk=_amount(values, DISK, 0), processes=_amount(values, PROCESSES, 1))


def _usage(values: Mapping[str, tuple[str, str]], key: str) -> Usage | None:
    if key not in values:
        return None
    name, value = values[key]
    try:
        return parse_usage(value, f"annotation {name}")
    except UsageError as e:
        raise ScriptError(str(e)) from None


def _duration(values: Mapping[str, tuple[str, str]], key: str) -> float | None:
    if key not in values:
        return None
    name, value = values[key]
    try:
        return parse_duration(value, f"annotation {name}")
    except ConfigError as e:  # names the annotation; negative ones too
        raise ScriptError(str(e)) from None


def _amount(values: Mapping[str, tuple[str, str]], key: str, default: int) -> int:
    if key not in values:
        return default
    name, value = values[key]
    try:
        return int(parse_quantity(value, f"annotation {name}"))
    except QuantityError as e:  # names the annotation; negative ones too
        raise ScriptError(str(e)) from None
