"""The soak's judgements, as plain functions of what was recorded: which faults were
under way when, whether a stale Lease or a taint is excused by them, and the slope of
a resource over time. No I/O here, so the rules are unit-tested
(tests/test_bench_soak.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# what keeps an agent from renewing its Leases: faults on its side (the agent killed,
# the network to the API server cut) and the API server's outages
AGENT_SIDE = {"cri": ("agent-kill", "network-cut"),
              "virtual": ("virtual-agent-kill", "network-cut")}
API_SIDE = ("apiserver-kill", "apiserver-stop", "etcd-restart")
# faults that leave a node's pods alone (they target the other node's agent, or only
# the operator)
NOT_ON = {"cri": ("virtual-agent-kill", "operator-leader-kill"),
          "virtual": ("agent-kill", "containerd-restart", "slow-disk", "operator-leader-kill")}


@dataclass
class Injected:
    """A fault as it was carried out: wall-clock start and end (the end includes the
    wait for the restored process to answer)."""
    kind: str
    start: float
    end: float
    note: str = ""

    def describe(self, t0: float) -> str:
        note = f" ({self.note})" if self.note else ""
        return f"{self.kind} {self.start - t0:.0f}s-{self.end - t0:.0f}s{note}"


@dataclass
class Timeline:
    """Every fault injected so far; `open` ones have not ended yet (their end is the
    time they were last looked at)."""
    t0: float
    faults: list[Injected] = field(default_factory=list)

    def intervals(self, kinds: Iterable[str], extend: float = 0.0) -> list[tuple[float, float]]:
        ks = set(kinds)
        return [(f.start, f.end + extend) for f in self.faults if f.kind in ks]

    def quiet(self, pool: str, t: float, span: float) -> bool:
        """No fault that touches the pool's pods was under way in [t - span, t]."""
        skip = NOT_ON[pool]
        return not any(f.kind not in skip and f.start <= t and f.end >= t - span
                       for f in self.faults)

    def last_before(self, t: float, n: int = 3, pool: str | None = None) -> list[str]:
        """The last `n` faults begun by `t`; with a pool, only those that touch it."""
        skip = NOT_ON[pool] if pool else ()
        before = [f for f in self.faults if f.start <= t and f.kind not in skip]
        return [f.describe(self.t0) for f in before[-n:]]

    def during(self, kind: str, t: float, slack: float = 2.0) -> bool:
        """A fault of `kind` was under way at `t` (within `slack` seconds: the API's
        times have whole seconds)."""
        return any(f.kind == kind and f.start - slack <= t <= f.end + slack
                   for f in self.faults)

    def ended(self) -> float:
        return max((f.end for f in self.faults), default=self.t0)


def uncovered(window: tuple[float, float], intervals: Sequence[tuple[float, float]]) -> float:
    """Seconds of `window` that none of `intervals` covers."""
    lo, hi = window
    if hi <= lo:
        return 0.0
    spans = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    free, at = 0.0, lo
    for a, b in spans:
        if a > at:
            free += a - at
        at = max(at, b)
    return free + max(0.0, hi - at)


def stale_periods(renewals: Sequence[float], duration: float, until: float
                  ) -> list[tuple[float, float]]:
    """(last renewal, next renewal or `until`) for each stretch longer than `duration`
    without a renewal, from the renewTimes seen (sorted, distinct)."""
    out: list[tuple[float, float]] = []
    times = sorted(set(renewals))
    if not times:
        return out
    for a, b in zip(times, [*times[1:], until], strict=True):
        if b - a > duration:
            out.append((a, b))
    return out


def excused(silent: tuple[float, float], faults: Sequence[tuple[float, float]],
            allowed: float) -> bool:
    """A silence is excused when the faults (each already extended by the time an agent
    needs to come back after it) leave less than `allowed` seconds of it uncovered:
    given that long without a fault, a working agent would have renewed."""
    return uncovered(silent, faults) < allowed


@dataclass(frozen=True)
class Sample:
    t: float  # seconds
    value: float


def slope_per_hour(samples: Sequence[Sample]) -> float | None:
    """Least-squares slope of the samples, per hour; None below three samples."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mt = sum(s.t for s in samples) / n
    mv = sum(s.value for s in samples) / n
    var = sum((s.t - mt) ** 2 for s in samples)
    if var == 0:
        return None
    cov = sum((s.t - mt) * (s.value - mv) for s in samples)
    return cov / var * 3600.0
