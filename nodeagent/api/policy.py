"""The NodeStatusPolicy model, its defaults and rules, and the Node annotation that
carries a node's effective heartbeat settings from the operator to the agent.

The CRD schema (charts/nodepulse/crds/) states the same defaults and rules for the
API server; tests/test_policy.py checks the two agree.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

GROUP = "nodepulse.dev"
VERSION = "v1alpha1"
PLURAL = "nodestatuspolicies"
KIND = "NodeStatusPolicy"

# Written by the operator on each Node, read by the agent.
HEARTBEAT_ANNOTATION = "nodepulse.dev/heartbeat"
AGENT_LABEL = "nodepulse.dev/agent"


class PolicyError(ValueError):
    """A policy value breaks a rule; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """How a node's agent reports: Lease cadence and NodeStatus cadence."""

    leaseDurationSeconds: int = 40
    renewIntervalSeconds: int = 10  # default: leaseDurationSeconds / 4
    statusUpdateFrequencySeconds: int = 10
    statusReportFrequencySeconds: int = 300
    maxImagesInStatus: int = 50

    def validate(self, where: str = "heartbeat") -> None:
        _in_range(f"{where}.leaseDurationSeconds", self.leaseDurationSeconds, 5, 3600)
        _in_range(f"{where}.renewIntervalSeconds", self.renewIntervalSeconds, 1, 3600)
        _in_range(f"{where}.statusUpdateFrequencySeconds",
                  self.statusUpdateFrequencySeconds, 1, 3600)
        _in_range(f"{where}.statusReportFrequencySeconds",
                  self.statusReportFrequencySeconds, 1, 86400)
        _in_range(f"{where}.maxImagesInStatus", self.maxImagesInStatus, 0, 1000)
        if self.renewIntervalSeconds >= self.leaseDurationSeconds:
            raise PolicyError(f"{where}.renewIntervalSeconds must be less than "
                              f"{where}.leaseDurationSeconds")
        if self.statusReportFrequencySeconds < self.statusUpdateFrequencySeconds:
            raise PolicyError(f"{where}.statusReportFrequencySeconds must be at least "
                              f"{where}.statusUpdateFrequencySeconds")


@dataclasses.dataclass(frozen=True)
class Failure:
    """What happens to a node whose Lease goes stale."""

    gracePeriodSeconds: int = 50  # (kube-controller-manager's default since 1.32)
    taintUnreachable: bool = True  # also add the NoExecute unreachable taint
    noExecuteTaintsPerMinute: float = 6.0  # (the controller manager's 0.1/s)
    maxUnreachableFraction: float = 0.55  # (its unhealthy-zone threshold)

    def validate(self, heartbeat: Heartbeat, where: str = "failure") -> None:
        _in_range(f"{where}.gracePeriodSeconds", self.gracePeriodSeconds, 1, 86400)
        _in_range(f"{where}.noExecuteTaintsPerMinute", self.noExecuteTaintsPerMinute, 0, 10000)
        _in_range(f"{where}.maxUnreachableFraction", self.maxUnreachableFraction, 0, 1)
        if self.gracePeriodSeconds < heartbeat.leaseDurationSeconds:
            raise PolicyError(f"{where}.gracePeriodSeconds must be at least "
                              "heartbeat.leaseDurationSeconds")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    nodeSelector: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    priority: int = 0
    heartbeat: Heartbeat = Heartbeat()
    failure: Failure = Failure()


def _show(value: object) -> str:
    """repr for an error message, cut short: bad input may be huge or deeply nested."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def _in_range(field: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(f"{field} must be a number, got {_show(value)}")
    if not low <= value <= high:
        raise PolicyError(f"{field} must be between {low:g} and {high:g}, got {_show(value)}")


def _object(data: object, where: str) -> dict[str, Any]:
    """A section in its API form (a JSON object); absent means empty."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise PolicyError(f"{where} must be an object, got {_show(data)}")
    return dict(data)


def _build(cls: type, data: object, where: str) -> Any:
    """cls from its API form. Each field is checked against the type of its default
    (the CRD's integer, boolean or number); the ranges are checked by validate()."""
    data = _object(data, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise PolicyError(f"{where}: unknown field(s) {', '.join(unknown)}")
    for name, value in data.items():
        kind = type(fields[name].default)
        if kind is bool and not isinstance(value, bool):
            raise PolicyError(f"{where}.{name} must be true or false, got {_show(value)}")
        if kind is int:
            if isinstance(value, float) and value.is_integer():
                data[name] = value = int(value)  # JSON may spell a whole number 40.0
            if isinstance(value, bool) or not isinstance(value, int):
                raise PolicyError(f"{where}.{name} must be a whole number, got {_show(value)}")
    return cls(**data)


def parse_heartbeat(data: object, where: str = "heartbeat") -> Heartbeat:
    """Heartbeat settings from their API form, defaulted and validated.

    A missing renewIntervalSeconds is a quarter of leaseDurationSeconds, as in KEP-589."""
    hb: Heartbeat = _build(Heartbeat, data, where)
    if "renewIntervalSeconds" not in _object(data, where):
        hb = dataclasses.replace(hb, renewIntervalSeconds=max(1, hb.leaseDurationSeconds // 4))
    hb.validate(where)
    return hb


def parse_spec(spec: object) -> PolicySpec:
    """A NodeStatusPolicy spec, defaulted and validated (the same rules as the CRD)."""
    spec = _object(spec, "spec")
    unknown = sorted(str(k) for k in spec
                     if k not in ("nodeSelector", "priority", "heartbeat", "failure"))
    if unknown:
        raise PolicyError(f"spec: unknown field(s) {', '.join(unknown)}")
    heartbeat = parse_heartbeat(spec.get("heartbeat"), "spec.heartbeat")
    failure: Failure = _build(Failure, spec.get("failure"), "spec.failure")
    failure.validate(heartbeat, "spec.failure")
    priority = spec.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise PolicyError(f"spec.priority must be an integer, got {_show(priority)}")
    selector = spec.get("nodeSelector") or {}
    if not isinstance(selector, Mapping):
        raise PolicyError("spec.nodeSelector must be a label selector object")
    return PolicySpec(nodeSelector=selector, priority=priority,
                      heartbeat=heartbeat, failure=failure)


def encode_heartbeat_annotation(policy_name: str | None, heartbeat: Heartbeat) -> str:
    """The annotation value: compact JSON with sorted keys, so equal settings give
    byte-equal strings and the operator can skip writes that change nothing."""
    body: dict[str, Any] = {"policy": policy_name or "", **dataclasses.asdict(heartbeat)}
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def decode_heartbeat_annotation(value: str) -> tuple[str, Heartbeat]:
    """(policy name, settings) from the annotation; PolicyError says what is wrong."""
    if not isinstance(value, str):
        raise PolicyError(f"annotation {HEARTBEAT_ANNOTATION}: must be a string")
    try:
        body = json.loads(value)
    except json.JSONDecodeError as e:
        raise PolicyError(f"annotation {HEARTBEAT_ANNOTATION}: not JSON ({e})") from e
    except RecursionError:  # the decoder gives up on deep nesting with this
        raise PolicyError(f"annotation {HEARTBEAT_ANNOTATION}: nested too deeply") from None
    if not isinstance(body, dict):
        raise PolicyError(f"annotation {HEARTBEAT_ANNOTATION}: must be a JSON object")
    name = body.pop("policy", "")
    if not isinstance(name, str):
        raise PolicyError(f"annotation {HEARTBEAT_ANNOTATION}: policy must be a string")
    return name, parse_heartbeat(body, f"annotation {HEARTBEAT_ANNOTATION}")
