"""Eviction thresholds in the forms the kubelet accepts (quantities: nodeagent.api.quantity)."""

from __future__ import annotations

import dataclasses

from nodeagent.api.quantity import QuantityError, format_bytes, parse_quantity

# Signals the agent measures, and what their percentages are taken of.
SIGNALS = ("memory.available", "nodefs.available", "nodefs.inodesFree",
           "imagefs.available", "pid.available")


@dataclasses.dataclass(frozen=True)
class Threshold:
    signal: str
    value: float | None = None  # absolute (bytes, inodes, pids)
    percent: float | None = None  # of the signal's capacity

    def limit(self, capacity: float) -> float:
        if self.percent is not None:
            return capacity * self.percent / 100
        return float(self.value or 0)

    def text(self) -> str:
        if self.percent is not None:
            return f"{self.signal}<{self.percent:g}%"
        value = int(self.value or 0)
        counted = self.signal in ("nodefs.inodesFree", "pid.available")
        return f"{self.signal}<{value if counted else format_bytes(value)}"


def parse_thresholds(spec: str | dict[str, str], what: str = "evictionHard") -> tuple[Threshold, ...]:
    """'memory.available<100Mi,nodefs.available<10%' (flag form) or
    {'memory.available': '100Mi'} (config-file form)."""
    pairs: list[tuple[str, str]] = []
    if isinstance(spec, dict):
        pairs = [(str(k), str(v)) for k, v in spec.items()]
    elif isinstance(spec, str):
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if "<" not in part:
                raise QuantityError(f"{what}: {part!r} must look like signal<value, "
                                    "e.g. memory.available<100Mi")
            k, v = part.split("<", 1)
            pairs.append((k.strip(), v.strip()))
    else:
        raise QuantityError(f"{what}: expected a string or a mapping, got {spec!r}")
    out = []
    for signal, value in pairs:
        if signal not in SIGNALS:
            raise QuantityError(f"{what}: unknown signal {signal!r} (known: {', '.join(SIGNALS)})")
        if value.endswith("%"):
            try:
                pct = float(value[:-1])
            except ValueError:
                raise QuantityError(f"{what}: {signal}: {value!r} is not a percentage") from None
            if not 0 <= pct <= 100:
                raise QuantityError(f"{what}: {signal}: percentage must be 0-100, got {value}")
            out.append(Threshold(signal, percent=pct))
        else:
            out.append(Threshold(signal, value=parse_quantity(value, f"{what}: {signal}")))
    return tuple(out)
