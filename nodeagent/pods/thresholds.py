"""Eviction thresholds as the kubelet takes them (--eviction-hard, --eviction-soft,
--eviction-soft-grace-period, --eviction-minimum-reclaim), and what each signal stands
for: the resource it measures and the node condition it raises.

A threshold is `signal<amount`, the amount a quantity (`100Mi`) or a percentage of the
signal's capacity (`10%`). As the kubelet: `0%` and `100%` are ignored, an absolute
amount must be more than zero, a soft threshold needs a grace period for its signal.
A hard threshold is one whose grace period is zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nodeagent.api.quantity import QuantityError, format_bytes, parse_quantity

MEMORY, NODEFS, NODEFS_INODES = "memory.available", "nodefs.available", "nodefs.inodesFree"
IMAGEFS, IMAGEFS_INODES, PIDS = "imagefs.available", "imagefs.inodesFree", "pid.available"
SIGNALS = (MEMORY, NODEFS, NODEFS_INODES, IMAGEFS, IMAGEFS_INODES, PIDS)

# signal -> the resource it measures (what an eviction reclaims), as the kubelet names it
RESOURCE = {MEMORY: "memory", NODEFS: "ephemeral-storage", NODEFS_INODES: "inodes",
            IMAGEFS: "ephemeral-storage", IMAGEFS_INODES: "inodes", PIDS: "pids"}
# signal -> the node condition a threshold met raises
CONDITION = {MEMORY: "MemoryPressure", NODEFS: "DiskPressure", NODEFS_INODES: "DiskPressure",
             IMAGEFS: "DiskPressure", IMAGEFS_INODES: "DiskPressure", PIDS: "PIDPressure"}
COUNTED = (NODEFS_INODES, IMAGEFS_INODES, PIDS)  # amounts in items, not bytes

# the kubelet's --eviction-hard on Linux
DEFAULT_HARD = ("memory.available<100Mi,nodefs.available<10%,nodefs.inodesFree<5%,"
                "imagefs.available<15%,imagefs.inodesFree<5%")


class ThresholdError(QuantityError):
    """A threshold setting is wrong; the message names the setting and the signal."""


@dataclasses.dataclass(frozen=True)
class Amount:
    """An absolute amount (bytes, inodes, pids) or a percentage of a capacity."""
    value: float | None = None
    percent: float | None = None

    def of(self, capacity: float) -> float:
        if self.percent is not None:
            return capacity * self.percent / 100
        return float(self.value or 0)

    def text(self, signal: str) -> str:
        if self.percent is not None:
            return f"{self.percent:g}%"
        value = int(self.value or 0)
        return str(value) if signal in COUNTED else format_bytes(value)


@dataclasses.dataclass(frozen=True)
class Threshold:
    signal: str
    amount: Amount
    grace_period: float = 0.0          # seconds it must hold before pods are evicted
    min_reclaim: Amount | None = None  # reclaimed beyond the threshold once it is met

    @property
    def hard(self) -> bool:
        return self.grace_period == 0

    def limit(self, capacity: float) -> float:
        return self.amount.of(capacity)

    def text(self) -> str:
        return f"{self.signal}<{self.amount.text(self.signal)}"


def _pairs(spec: Any, what: str, sep: str, example: str) -> list[tuple[str, str]]:
    """'a<1,b<2' (the flag's form, `sep` between) or {'a': '1'} (the config file's)."""
    if isinstance(spec, Mapping):
        pairs = [(str(k), str(v)) for k, v in spec.items()]
    elif isinstance(spec, str):
        pairs = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if sep not in part:
                raise ThresholdError(f"{what}: {part!r} must look like {example}")
            k, v = part.split(sep, 1)
            pairs.append((k.strip(), v.strip()))
    else:
        raise ThresholdError(f"{what}: expected a string or a mapping, got {spec!r}")
    for signal, _ in pairs:
        if signal not in SIGNALS:
            raise ThresholdError(f"{what}: unknown signal {signal!r} (known: "
                                 f"{', '.join(SIGNALS)})")
    return pairs


def _percent(value: str, where: str) -> float:
    try:
        pct = float(value[:-1])
    except ValueError:
        raise ThresholdError(f"{where}: {value!r} is not a percentage") from None
    if not 0 <= pct <= 100:
        raise ThresholdError(f"{where}: a percentage must be 0-100%, got {value}")
    return pct


def parse_thresholds(spec: Any, what: str = "--eviction-hard") -> dict[str, Amount]:
    """'memory.available<100Mi,nodefs.available<10%' (flag form) or
    {'memory.available': '100Mi'} (config-file form): signal -> amount."""
    out: dict[str, Amount] = {}
    for signal, value in _pairs(spec, what, "<", "signal<amount, e.g. memory.available<100Mi"):
        where = f"{what}: {signal}"
        if value.endswith("%"):
            if value in ("0%", "100%"):
                continue  # the kubelet ignores both
            out[signal] = Amount(percent=_percent(value, where))
            continue
        amount = parse_quantity(value, where)
        if amount <= 0:
            raise ThresholdError(f"{where}: an eviction threshold must be more than zero, "
                                 f"got {value!r}")
        out[signal] = Amount(value=amount)
    return out


def parse_minimum_reclaims(spec: Any, what: str = "--eviction-minimum-reclaim"
                           ) -> dict[str, Amount]:
    """'imagefs.available=2Gi,memory.available=5%' or a mapping: signal -> amount."""
    out: dict[str, Amount] = {}
    for signal, value in _pairs(spec, what, "=", "signal=amount, e.g. "
                                                 "imagefs.available=2Gi"):
        where = f"{what}: {signal}"
        if value.endswith("%"):
            pct = _percent(value, where)
            if pct <= 0:
                raise ThresholdError(f"{where}: a minimum reclaim percentage must be more "
                                     f"than zero, got {value}")
            out[signal] = Amount(percent=pct)
        else:
            out[signal] = Amount(value=parse_quantity(value, where))
    return out


def parse_grace_periods(spec: Any, parse_duration: Any,
                        what: str = "--eviction-soft-grace-period") -> dict[str, float]:
    """'memory.available=1m30s' or a mapping: signal -> seconds (`parse_duration(value,
    where)` reads one duration)."""
    return {signal: float(parse_duration(value, f"{what}: {signal}"))
            for signal, value in _pairs(spec, what, "=", "signal=duration, e.g. "
                                                         "memory.available=1m30s")}


def combine(hard: Mapping[str, Amount], soft: Mapping[str, Amount] | None = None,
            grace: Mapping[str, float] | None = None,
            reclaim: Mapping[str, Amount] | None = None,
            grace_flag: str = "--eviction-soft-grace-period") -> tuple[Threshold, ...]:
    """The thresholds the eviction manager enforces: the hard ones, then the soft ones
    with their grace periods, each with its signal's minimum reclaim."""
    grace, reclaim = grace or {}, reclaim or {}
    out = [Threshold(s, a, 0.0, reclaim.get(s)) for s, a in hard.items()]
    for s, a in (soft or {}).items():
        if s not in grace:
            raise ThresholdError(f"{grace_flag}: grace period must be specified for the "
                                 f"soft eviction threshold {s}")
        # a soft threshold with no grace would be a hard one: the kubelet's too
        out.append(Threshold(s, a, grace[s], reclaim.get(s)))
    return tuple(out)
