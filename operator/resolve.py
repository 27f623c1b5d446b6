"""Which NodeStatusPolicy governs each Node: the highest priority among the valid
policies whose selector matches, ties broken by name (lowest first); none -> defaults."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from nodeoperator import selector
from nodeoperator.state import PolicyInfo


@dataclasses.dataclass
class Conflict:
    """Policies of equal, top priority that all match some nodes."""

    policies: tuple[str, ...]  # sorted; the first one wins
    nodes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Resolution:
    effective: dict[str, str | None]  # node -> policy name, None for the defaults
    conflicts: dict[tuple[str, ...], Conflict]

    def conflicts_of(self, policy: str) -> list[Conflict]:
        return [c for key, c in sorted(self.conflicts.items()) if policy in key]


def resolve(policies: Iterable[PolicyInfo], nodes: Mapping[str, Mapping[str, str]]) -> Resolution:
    """`nodes` maps node name to its labels."""
    ranked = sorted((p for p in policies if p.spec is not None),
                    key=lambda p: (-p.spec.priority if p.spec else 0, p.name))
    effective: dict[str, str | None] = {}
    conflicts: dict[tuple[str, ...], Conflict] = {}
    # Nodes of one pool share their labels: match each distinct label set once.
    memo: dict[frozenset[tuple[str, str]], tuple[str, ...]] = {}
    for node, labels in nodes.items():
        key = frozenset(labels.items())
        top = memo.get(key)
        if top is None:
            top = _top(ranked, labels)
            memo[key] = top
        effective[node] = top[0] if top else None
        if len(top) > 1:
            conflicts.setdefault(top, Conflict(top)).nodes.append(node)
    for c in conflicts.values():
        c.nodes.sort()
    return Resolution(effective, conflicts)


def _top(ranked: list[PolicyInfo], labels: Mapping[str, str]) -> tuple[str, ...]:
    """Names of the matching policies that share the highest priority, in name order."""
    best: int | None = None
    names: list[str] = []
    for p in ranked:
        assert p.spec is not None
        if best is not None and p.spec.priority < best:
            break
        if selector.matches(p.spec.nodeSelector, labels):
            best = p.spec.priority
            names.append(p.name)
    return tuple(names)
