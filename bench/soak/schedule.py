"""The soak's faults: when each one starts, what it is and how long it holds, as a pure
function of the seed and the duration, so a run is reproduced from its seed.

Faults on one target (a lane: the API server, etcd, containerd, ...) follow each other;
faults on different targets overlap freely. Each lane first places each of its kinds
once, in an order the seed picks, then kinds of its own at random until the chaos
window is over: a run long enough to hold every lane's first faults injects every kind.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# kind -> (lane, shortest hold, longest hold) in seconds; the hold is how long the
# fault lasts (an outage, a pause, a cut, a slow spell, the time before a killed
# process is started again); 0: the fault is one act (a compaction)
KINDS: dict[str, tuple[str, float, float]] = {
    "apiserver-kill": ("apiserver", 2, 20),
    "apiserver-stop": ("apiserver", 2, 15),
    "etcd-restart": ("etcd", 1, 10),
    "etcd-compact": ("etcd", 0, 0),
    "containerd-restart": ("containerd", 1, 15),
    "agent-kill": ("agent", 1, 25),
    "virtual-agent-kill": ("virtual-agent", 1, 25),
    "operator-leader-kill": ("operator", 5, 30),
    "network-cut": ("network", 3, 30),
    "slow-disk": ("disk", 10, 60),
}
LANES = tuple(dict.fromkeys(lane for lane, _, _ in KINDS.values()))
# seconds per filesystem operation while the disk is slow
SLOW_DISK_DELAY = (0.02, 0.3)


@dataclass(frozen=True)
class Fault:
    at: float  # seconds from the start of the chaos
    kind: str
    hold: float
    delay: float = 0.0  # slow-disk only: seconds per operation

    @property
    def lane(self) -> str:
        return KINDS[self.kind][0]

    @property
    def end(self) -> float:
        return self.at + self.hold

    def describe(self) -> str:
        extra = f", {self.delay * 1000:.0f} ms per operation" if self.kind == "slow-disk" else ""
        return f"{self.kind} at {self.at:.1f}s for {self.hold:.1f}s{extra}"


def schedule(seed: int, duration: float, *, mean_gap: float = 90.0,
             min_gap: float = 5.0, without: frozenset[str] = frozenset()) -> list[Fault]:
    """Every fault of a chaos window of `duration` seconds, by start time.

    In each lane a fault starts `min_gap` plus an exponential wait (mean `mean_gap`)
    after the previous one ended; the first one of a lane starts within the first
    tenth of the window, so short runs overlap their lanes too. A fault that would not
    end within the window is not injected. `without`: kinds left out (a run that
    measures leaks spares the processes it samples)."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    unknown = sorted(set(without) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown fault kind(s) {', '.join(unknown)}; the kinds are "
                         f"{', '.join(KINDS)}")
    rng = random.Random(f"nodepulse-soak:{seed}:{duration:g}")
    out: list[Fault] = []
    for lane in LANES:
        kinds = [k for k, (ln, _, _) in KINDS.items() if ln == lane and k not in without]
        if not kinds:
            continue
        first = kinds[:]
        rng.shuffle(first)
        t = rng.uniform(0, duration / 10)
        while True:
            kind = first.pop(0) if first else rng.choice(kinds)
            _, low, high = KINDS[kind]
            hold = round(rng.uniform(low, high), 1)
            delay = round(rng.uniform(*SLOW_DISK_DELAY), 3) if kind == "slow-disk" else 0.0
            if t + hold > duration:
                break
            out.append(Fault(round(t, 1), kind, hold, delay))
            t += hold + min_gap + rng.expovariate(1 / mean_gap)
    out.sort(key=lambda f: (f.at, f.kind))
    return out


def kinds_of(faults: list[Fault]) -> set[str]:
    return {f.kind for f in faults}
