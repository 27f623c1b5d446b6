"""Label selectors and the effective-policy table: priorities, ties, label changes."""

from __future__ import annotations

from typing import Any

import pytest
from nodeoperator import selector
from nodeoperator.resolve import resolve
from nodeoperator.state import parse_policy

from nodeagent.api.policy import PolicyError


def policy(name: str, priority: int = 0, sel: dict[str, Any] | None = None,
           **spec: Any) -> Any:
    body = {"metadata": {"name": name, "resourceVersion": "1", "generation": 1},
            "spec": {"priority": priority, "nodeSelector": sel or {}, **spec}}
    return parse_policy(body)


@pytest.mark.parametrize(("sel", "labels", "want"), [
    ({}, {}, True),
    ({"matchLabels": {"pool": "edge"}}, {"pool": "edge", "x": "y"}, True),
    ({"matchLabels": {"pool": "edge"}}, {"pool": "core"}, False),
    ({"matchLabels": {"pool": "edge"}}, {}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]},
     {"zone": "b"}, True),
    ({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}, {}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}, {}, True),
    ({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]},
     {"zone": "a"}, False),
    ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"gpu": ""}, True),
    ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, {"gpu": "1"}, False),
    ({"matchLabels": {"pool": "edge"},
      "matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"pool": "edge"}, False),
])
def test_selector_matches(sel: dict[str, Any], labels: dict[str, str], want: bool) -> None:
    selector.validate(sel)
    assert selector.matches(sel, labels) is want


@pytest.mark.parametrize(("sel", "field"), [
    ({"matchExpressions": [{"key": "a", "operator": "Near"}]}, "matchExpressions[0].operator"),
    ({"matchExpressions": [{"key": "a", "operator": "In"}]}, "matchExpressions[0].values"),
    ({"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
     "matchExpressions[0].values"),
    ({"matchLabels": {"a": 1}}, "matchLabels"),
    ({"labels": {}}, "unknown field"),
])
def test_selector_errors_name_the_field(sel: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyError, match=field.replace("[", r"\[").replace("]", r"\]")):
        selector.validate(sel)


def test_describe() -> None:
    assert selector.describe({}) == "<all nodes>"
    assert selector.describe({"matchLabels": {"pool": "edge"}, "matchExpressions": [
        {"key": "zone", "operator": "In", "values": ["b", "a"]},
        {"key": "gpu", "operator": "DoesNotExist"}]}) == "pool=edge,zone in (a,b),!gpu"


def test_highest_priority_wins_and_unmatched_get_defaults() -> None:
    policies = [policy("all", 0), policy("edge", 10, {"matchLabels": {"pool": "edge"}}),
                policy("edge-gpu", 20, {"matchLabels": {"pool": "edge", "gpu": "1"}})]
    nodes = {"n1": {"pool": "edge"}, "n2": {"pool": "edge", "gpu": "1"}, "n3": {}}
    res = resolve(policies, nodes)
    assert res.effective == {"n1": "edge", "n2": "edge-gpu", "n3": "all"}
    assert res.conflicts == {}
    res = resolve(policies[1:], nodes)
    assert res.effective["n3"] is None


def test_equal_priority_tie_goes_to_first_name_and_is_a_conflict() -> None:
    policies = [policy("zeta", 5, {"matchLabels": {"pool": "a"}}),
                policy("alpha", 5, {"matchExpressions": [{"key": "pool", "operator": "Exists"}]}),
                policy("low", 1, {})]
    res = resolve(policies, {"n1": {"pool": "a"}, "n2": {"pool": "b"}, "n3": {"pool": "a"}})
    assert res.effective == {"n1": "alpha", "n2": "alpha", "n3": "alpha"}
    [conflict] = res.conflicts.values()
    assert conflict.policies == ("alpha", "zeta") and conflict.nodes == ["n1", "n3"]
    assert res.conflicts_of("zeta") == [conflict] and res.conflicts_of("low") == []


def test_label_change_moves_node() -> None:
    policies = [policy("edge", 1, {"matchLabels": {"pool": "edge"}})]
    assert resolve(policies, {"n": {"pool": "edge"}}).effective["n"] == "edge"
    assert resolve(policies, {"n": {"pool": "core"}}).effective["n"] is None


def test_invalid_policy_claims_nothing_and_says_why() -> None:
    bad = policy("bad", 100, {}, heartbeat={"leaseDurationSeconds": 10,
                                            "renewIntervalSeconds": 10})
    assert bad.spec is None and "renewIntervalSeconds" in (bad.error or "")
    bad_sel = policy("badsel", 100, {"matchExpressions": [{"key": "a", "operator": "Near"}]})
    assert bad_sel.spec is None and "operator" in (bad_sel.error or "")
    res = resolve([bad, bad_sel, policy("ok", 0)], {"n": {}})
    assert res.effective["n"] == "ok"
