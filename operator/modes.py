"""Who else handles node lifecycle: the two modes of the operator.

- exclusive: the controller manager's node-lifecycle controller is off
  (`--controllers=*,-node-lifecycle-controller`); the operator alone marks silent nodes
  Unknown and manages their unreachable and condition taints.
- coexist: that controller runs (every managed cluster; kind and kubeadm by default).
  It marks any node silent for its `--node-monitor-grace-period` Unknown, keeps the
  NoSchedule condition taints (unreachable:NoSchedule among them) in step with the
  conditions, adds `unreachable:NoExecute` to every node whose Ready is Unknown
  (whoever wrote it) at its own rate and zone rules, and removes it once Ready is
  True. So the operator only does what is stricter than that: a policy whose grace is
  shorter has its silent nodes marked Unknown, and given the NoExecute taint (paced,
  partition-guarded), before the controller manager would. It removes only the taints
  it added, recorded on the Node (OWNED_ANNOTATION) so a new leader knows them too,
  and never writes over what the controller manager wrote.

What a policy asks that the controller manager overrides is said in its status
(`Effective=False`, reason OVERRIDDEN) and a Warning Event.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from nodeagent.api.policy import Failure, PolicySpec

EXCLUSIVE = "exclusive"
COEXIST = "coexist"
MODES = (EXCLUSIVE, COEXIST)
# kube-controller-manager's --node-monitor-grace-period default since Kubernetes 1.32
# (pkg/controller/nodelifecycle/config/v1alpha1/defaults.go).
CLUSTER_GRACE_DEFAULT = 50.0
# The taints the operator added to a Node in coexist mode, "key:effect" comma-separated.
OWNED_ANNOTATION = "nodepulse.dev/owned-taints"
OVERRIDDEN = "OverriddenByControllerManager"


@dataclasses.dataclass(frozen=True)
class Lifecycle:
    mode: str = COEXIST
    cluster_grace: float = CLUSTER_GRACE_DEFAULT  # the controller manager's, seconds

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"node lifecycle mode must be one of {', '.join(MODES)}, "
                             f"got {self.mode!r}")
        if not self.cluster_grace > 0:
            raise ValueError(f"the cluster's node grace period must be positive, got "
                             f"{self.cluster_grace!r}")

    @property
    def exclusive(self) -> bool:
        return self.mode == EXCLUSIVE

    def acts(self, failure: Failure) -> bool:
        """Whether the operator marks this policy's silent nodes itself. In coexist mode
        only when it is stricter than the controller manager and lets nodes be evicted:
        with taintUnreachable false, Ready=Unknown would make the controller manager add
        its NoExecute at once, earlier than it otherwise would."""
        return self.exclusive or (failure.gracePeriodSeconds < self.cluster_grace
                                  and failure.taintUnreachable)

    def grace(self, failure: Failure) -> float:
        """After how much silence a node under this policy is in fact marked."""
        return failure.gracePeriodSeconds if self.acts(failure) else self.cluster_grace

    def overridden(self, spec: PolicySpec) -> list[str]:
        """What the controller manager overrides of this policy: one sentence per field,
        naming it and the cluster's value. Empty in exclusive mode."""
        if self.exclusive:
            return []
        c = _secs(self.cluster_grace)
        out = []
        grace = spec.failure.gracePeriodSeconds
        if grace > self.cluster_grace:
            out.append(f"spec.failure.gracePeriodSeconds is {grace}s, longer than the "
                       f"controller manager's node grace period ({c}): it marks the silent "
                       f"nodes Unknown and taints them after {c}")
        if not spec.failure.taintUnreachable:
            sooner = (f"; the shorter spec.failure.gracePeriodSeconds ({grace}s) is not "
                      "applied either: nodes marked Unknown sooner would be evicted sooner"
                      if grace < self.cluster_grace else "")
            out.append("spec.failure.taintUnreachable is false, but the controller "
                       "manager adds node.kubernetes.io/unreachable:NoExecute to every "
                       f"node whose Ready is Unknown (after {c} of silence), so their pods "
                       "are evicted" + sooner)
        renew = spec.heartbeat.renewIntervalSeconds
        if renew >= self.cluster_grace:
            out.append(f"spec.heartbeat.renewIntervalSeconds is {renew}s, not shorter than "
                       f"the controller manager's node grace period ({c}): it marks live "
                       "nodes Unknown between two renewals")
        return out

    def effective(self, spec: PolicySpec) -> tuple[str, str, str]:
        """(status, reason, message) of the policy's Effective condition."""
        if self.exclusive:
            return ("True", "Exclusive", "node lifecycle mode exclusive: the operator alone "
                    "marks this policy's silent nodes and manages their taints")
        overridden = self.overridden(spec)
        if overridden:
            return ("False", OVERRIDDEN, "node lifecycle mode coexist: "
                    + "; ".join(overridden))
        c, grace = _secs(self.cluster_grace), spec.failure.gracePeriodSeconds
        if self.acts(spec.failure):
            return ("True", "StricterThanCluster",
                    f"node lifecycle mode coexist: the operator marks this policy's silent "
                    f"nodes Unknown and taints them after {grace}s, before the controller "
                    f"manager would ({c}); the controller manager then adds its own "
                    "NoExecute taint too, at its own rate")
        return ("True", "SameAsCluster",
                f"node lifecycle mode coexist: the controller manager marks this policy's "
                f"silent nodes after {c}, as the policy asks; the operator sets their "
                "heartbeat")


def parse_duration(text: str) -> float:
    """Seconds from `50`, `50s`, `1m30s` or `1.5m` (Go's duration units h, m, s, ms),
    so the controller manager's flag value can be copied as it is."""
    value = text.strip()
    try:
        return float(value)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ValueError(f"not a duration: {text!r} (e.g. 50s, 1m30s, or seconds)")
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


def parse_owned(value: str | None) -> frozenset[tuple[str, str]]:
    """(key, effect) pairs from OWNED_ANNOTATION; anything unreadable is ignored."""
    out = set()
    for item in (value or "").split(","):
        key, sep, effect = item.strip().rpartition(":")
        if sep and key and effect:
            out.add((key, effect))
    return frozenset(out)


def encode_owned(owned: Iterable[tuple[str, str]]) -> str | None:
    """The annotation value; None (the annotation removed) when nothing is owned."""
    return ",".join(f"{k}:{e}" for k, e in sorted(owned)) or None


def _secs(value: float) -> str:
    return f"{value:g}s"
