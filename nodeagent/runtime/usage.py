"""Simulated usage: what a fake container (or a virtual node's own daemons) would use,
as a level over time, written as a quantity or a simple expression of time:

    250m                     a constant (CPU in cores; memory in bytes: 64Mi)
    ramp(100m, 900m, 2m)     from the first value to the second over the duration,
                             then the second
    sine(500m, 300m, 1m)     mean, amplitude, period: mean + amplitude * sin(2 pi t / period)

t is seconds since the container started (the node's base: since the agent started).
CPU is reported as the kubelet reports it, cumulative core-seconds (the integral of the
level since t = 0, so a scraper's rate is the level's mean between its samples); memory
as the level now.
"""

from __future__ import annotations

import dataclasses
import math
import re

from nodeagent.api.quantity import QuantityError, parse_quantity
from nodeagent.config import ConfigError, parse_duration

_CALL = re.compile(r"(ramp|sine)\((.*)\)")


class UsageError(ValueError):
    """An expression that cannot be read; the message names where it came from."""


@dataclasses.dataclass(frozen=True)
class Usage:
    """`start` + the change to `end` over `ramp` seconds, plus a sine of `amplitude`
    and `period`; a constant has neither."""
    start: float
    end: float | None = None
    ramp: float = 0.0
    amplitude: float = 0.0
    period: float = 0.0

    def at(self, t: float) -> float:
        """The level t seconds after the start."""
        t = max(0.0, t)
        level = self.start
        if self.end is not None:
            level = self.end if t >= self.ramp else \
                self.start + (self.end - self.start) * t / self.ramp
        if self.period:
            level += self.amplitude * math.sin(2 * math.pi * t / self.period)
        return level

    def integral(self, t: float) -> float:
        """The level summed over the first t seconds (core-seconds for CPU)."""
        t = max(0.0, t)
        if self.end is None:
            total = self.start * t
        else:
            within = min(t, self.ramp)
            slope = (self.end - self.start) / self.ramp
            total = self.start * within + slope * within * within / 2
            total += self.end * max(0.0, t - self.ramp)
        if self.period:
            w = 2 * math.pi / self.period
            total += self.amplitude * (1 - math.cos(w * t)) / w
        return total


NONE = Usage(0.0)


def parse_usage(text: str, where: str) -> Usage:
    """Usage from `text` (see the module's docstring); UsageError names `where`."""
    text = text.strip()
    m = _CALL.fullmatch(text)
    if m is None:
        return Usage(_level(text, where))
    name, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
    if len(args) != 3:
        raise UsageError(f"{where}: {name}() takes 3 values, got {text!r} "
                         f"(e.g. {'ramp(100m, 900m, 2m)' if name == 'ramp' else 'sine(500m, 300m, 1m)'})")
    first, second = _level(args[0], where), _level(args[1], where)
    try:
        seconds = parse_duration(args[2], where)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if seconds <= 0:
        raise UsageError(f"{where}: the duration of {text!r} must be more than 0")
    if name == "ramp":
        return Usage(first, end=second, ramp=seconds)
    if second > first:
        raise UsageError(f"{where}: in {text!r} the amplitude exceeds the mean "
                         "(usage would fall below 0)")
    return Usage(first, amplitude=second, period=seconds)


def _level(text: str, where: str) -> float:
    try:
        return parse_quantity(text, where)
    except QuantityError as e:
        raise UsageError(f"{e} (a quantity, ramp(from, to, duration) or "
                         "sine(mean, amplitude, period))") from None
