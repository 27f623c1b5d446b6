"""Resource quantities and eviction thresholds in the forms the kubelet accepts."""

from __future__ import annotations

import dataclasses
import re

_SUFFIX = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|Ki|[MGTPE]i?|)$")


class QuantityError(ValueError):
    pass


def parse_quantity(text: str | int | float, what: str = "quantity") -> float:
    """'100Mi' -> 104857600, '250m' -> 0.25, 4 -> 4."""
    if isinstance(text, bool):
        raise QuantityError(f"{what}: expected a quantity, got {text!r}")
    if isinstance(text, (int, float)):
        return float(text)
    m = _QUANTITY.match(str(text).strip())
    if not m:
        raise QuantityError(f"{what}: {text!r} is not a quantity (e.g. 100Mi, 2, 500m)")
    number, suffix = float(m.group(1)), m.group(2)
    return number / 1000 if suffix == "m" else number * _SUFFIX[suffix]


def format_bytes(n: int) -> str:
    """Whole bytes as the API server would canonicalise them: largest exact binary unit."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        if n and n % _SUFFIX[suffix] == 0:
            return f"{n // _SUFFIX[suffix]}{suffix}"
    return str(n)


def format_cpu(cores: float) -> str:
    milli = round(cores * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


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
