"""Label selectors (matchLabels and matchExpressions), as a NodeStatusPolicy's
spec.nodeSelector states them, matched against a Node's labels."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nodeagent.api.policy import PolicyError

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def validate(selector: Mapping[str, Any], where: str = "spec.nodeSelector") -> None:
    """Raise PolicyError naming the field when the selector cannot be evaluated."""
    if not isinstance(selector, Mapping):
        raise PolicyError(f"{where} must be an object")
    unknown = sorted(set(selector) - {"matchLabels", "matchExpressions"})
    if unknown:
        raise PolicyError(f"{where}: unknown field(s) {', '.join(unknown)}")
    labels = selector.get("matchLabels") or {}
    if not isinstance(labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise PolicyError(f"{where}.matchLabels must map label keys to string values")
    exprs = selector.get("matchExpressions") or []
    if not isinstance(exprs, list):
        raise PolicyError(f"{where}.matchExpressions must be a list")
    for i, expr in enumerate(exprs):
        at = f"{where}.matchExpressions[{i}]"
        if not isinstance(expr, Mapping) or not isinstance(expr.get("key"), str):
            raise PolicyError(f"{at}.key must be a string")
        op = expr.get("operator")
        if op not in OPERATORS:
            raise PolicyError(f"{at}.operator must be one of {', '.join(OPERATORS)}, got {op!r}")
        values = expr.get("values") or []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise PolicyError(f"{at}.values must be a list of strings")
        if op in ("In", "NotIn") and not values:
            raise PolicyError(f"{at}.values must not be empty for operator {op}")
        if op in ("Exists", "DoesNotExist") and values:
            raise PolicyError(f"{at}.values must be empty for operator {op}")


def matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """True when every requirement holds; an empty selector matches every node."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def describe(selector: Mapping[str, Any]) -> str:
    """kubectl-style text for the Selector printer column, e.g. `pool=edge,zone in (a,b)`."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        key, op = expr["key"], expr["operator"]
        values = ",".join(sorted(expr.get("values") or []))
        parts.append({"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})",
                      "Exists": key, "DoesNotExist": f"!{key}"}[op])
    return ",".join(parts) or "<all nodes>"
