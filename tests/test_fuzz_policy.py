"""Fuzzing the policy parsers (nodeagent/api/policy.py), the heartbeat annotation and
the operator's effective-policy resolution with hypothesis.

What must hold for any input: either a result that keeps every rule, or a PolicyError
whose message names where the problem is; never another exception. Examples that once
broke a parser are kept below as plain tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nodeoperator.resolve import resolve
from nodeoperator.selector import describe
from nodeoperator.state import parse_policy

from nodeagent.api.policy import (
    HEARTBEAT_ANNOTATION,
    Failure,
    Heartbeat,
    PolicyError,
    PolicySpec,
    decode_heartbeat_annotation,
    encode_heartbeat_annotation,
    parse_heartbeat,
    parse_spec,
)

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- strategies
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                    st.text(max_size=8))
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
# Numbers around every bound the rules have, and values of the wrong type.
near_bounds = st.one_of(
    st.sampled_from([-1, 0, 1, 2, 4, 5, 9, 10, 40, 50, 299, 300, 999, 1000, 1001, 3599, 3600,
                     3601, 86399, 86400, 86401, 2**31, -2**31 - 1]),
    st.integers(min_value=-10, max_value=100_000),
    st.floats(min_value=-2, max_value=100_000),
    st.sampled_from([0.0, 0.55, 1.0, 1.0000001, 40.0, 40.5, math.nan, math.inf, -math.inf]),
    scalars)


def section(cls: type) -> st.SearchStrategy[Any]:
    """A heartbeat or failure section: mostly its own fields, sometimes junk."""
    names = [f.name for f in dataclasses.fields(cls)]
    values = st.one_of(near_bounds, st.booleans()) if cls is Failure else near_bounds
    fields = st.dictionaries(st.one_of(st.sampled_from(names), st.text(max_size=5)), values,
                             max_size=len(names) + 1)
    return st.one_of(fields, fields, fields, json_values)


LABEL_KEYS = ["pool", "zone", "tier"]
LABEL_VALUES = ["a", "b", "c"]
labels = st.dictionaries(st.sampled_from(LABEL_KEYS), st.sampled_from(LABEL_VALUES), max_size=3)
expression = st.fixed_dictionaries(
    {"key": st.sampled_from(LABEL_KEYS),
     "operator": st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist", "Bogus"])},
    optional={"values": st.one_of(st.lists(st.sampled_from(LABEL_VALUES), max_size=3),
                                  json_values)})
selectors = st.one_of(
    st.fixed_dictionaries({}, optional={"matchLabels": st.one_of(labels, json_values),
                                        "matchExpressions": st.one_of(
                                            st.lists(expression, max_size=3), json_values)}),
    json_values)
specs = st.one_of(
    st.fixed_dictionaries({}, optional={
        "nodeSelector": selectors,
        "priority": st.one_of(st.integers(min_value=-2, max_value=3), scalars),
        "heartbeat": section(Heartbeat),
        "failure": section(Failure),
        "unknownField": scalars}),
    json_values)


# ---- invariants of an accepted policy (the CRD's rules, stated independently)
def assert_valid_heartbeat(hb: Heartbeat) -> None:
    for f in dataclasses.fields(Heartbeat):
        value = getattr(hb, f.name)
        assert type(value) is int, (f.name, value)
    assert 5 <= hb.leaseDurationSeconds <= 3600
    assert 1 <= hb.renewIntervalSeconds < hb.leaseDurationSeconds
    assert 1 <= hb.statusUpdateFrequencySeconds <= 3600
    assert hb.statusUpdateFrequencySeconds <= hb.statusReportFrequencySeconds <= 86400
    assert 0 <= hb.maxImagesInStatus <= 1000


def assert_valid_spec(spec: PolicySpec) -> None:
    assert_valid_heartbeat(spec.heartbeat)
    f = spec.failure
    assert type(f.gracePeriodSeconds) is int
    assert spec.heartbeat.leaseDurationSeconds <= f.gracePeriodSeconds <= 86400
    assert type(f.taintUnreachable) is bool
    assert 0 <= f.noExecuteTaintsPerMinute <= 10000
    assert 0 <= f.maxUnreachableFraction <= 1
    assert type(spec.priority) is int
    assert isinstance(spec.nodeSelector, Mapping)


# ---- parsers
@FUZZ
@given(specs)
def test_parse_spec_accepts_only_valid_specs_and_names_the_field(raw: Any) -> None:
    try:
        spec = parse_spec(raw)
    except PolicyError as e:
        assert str(e).startswith("spec"), e
        assert len(str(e)) < 400  # the bad value is quoted, cut short
        return
    assert_valid_spec(spec)
    # an accepted spec, written back in its API form, parses to the same thing
    again = {"nodeSelector": dict(spec.nodeSelector), "priority": spec.priority,
             "heartbeat": dataclasses.asdict(spec.heartbeat),
             "failure": dataclasses.asdict(spec.failure)}
    assert parse_spec(again) == spec


@FUZZ
@given(section(Heartbeat))
def test_parse_heartbeat(raw: Any) -> None:
    try:
        hb = parse_heartbeat(raw)
    except PolicyError as e:
        assert str(e).startswith("heartbeat"), e
        return
    assert_valid_heartbeat(hb)
    if isinstance(raw, Mapping) and "renewIntervalSeconds" not in raw:
        assert hb.renewIntervalSeconds == max(1, hb.leaseDurationSeconds // 4)


annotation_fields: dict[str, st.SearchStrategy[Any]] = {
    "policy": st.one_of(st.text(max_size=10), scalars), "extra": scalars,
    **{f.name: near_bounds for f in dataclasses.fields(Heartbeat)}}
annotation_values = st.one_of(
    st.text(max_size=40),
    json_values.map(json.dumps),
    st.fixed_dictionaries({}, optional=annotation_fields).map(json.dumps))


@FUZZ
@given(annotation_values)
def test_decode_heartbeat_annotation(value: str) -> None:
    try:
        name, hb = decode_heartbeat_annotation(value)
    except PolicyError as e:
        assert str(e).startswith(f"annotation {HEARTBEAT_ANNOTATION}"), e
        return
    assert isinstance(name, str)
    assert_valid_heartbeat(hb)
    # what the operator would write for it decodes to the same, byte for byte
    encoded = encode_heartbeat_annotation(name, hb)
    assert decode_heartbeat_annotation(encoded) == (name, hb)
    assert encode_heartbeat_annotation(*decode_heartbeat_annotation(encoded)) == encoded


@FUZZ
@given(st.builds(Heartbeat, *[st.integers(min_value=0, max_value=100_000)] * 5),
       st.one_of(st.none(), st.text(max_size=20)))
def test_annotation_round_trip(hb: Heartbeat, name: str | None) -> None:
    value = encode_heartbeat_annotation(name, hb)
    try:
        hb.validate()
    except PolicyError:
        with pytest.raises(PolicyError):
            decode_heartbeat_annotation(value)
        return
    assert decode_heartbeat_annotation(value) == (name or "", hb)


# ---- the operator: one effective policy per node
def matches(sel: Mapping[str, Any], node_labels: Mapping[str, str]) -> bool:
    """Label selector semantics, written out again for the check."""
    ok = all(node_labels.get(k) == v for k, v in (sel.get("matchLabels") or {}).items())
    for e in sel.get("matchExpressions") or []:
        has, values = e["key"] in node_labels, set(e.get("values") or [])
        ok = ok and {"In": has and node_labels.get(e["key"]) in values,
                     "NotIn": not (has and node_labels.get(e["key"]) in values),
                     "Exists": has, "DoesNotExist": not has}[e["operator"]]
    return ok


good_expression = st.one_of(
    st.fixed_dictionaries({"key": st.sampled_from(LABEL_KEYS),
                           "operator": st.sampled_from(["In", "NotIn"]),
                           "values": st.lists(st.sampled_from(LABEL_VALUES), min_size=1,
                                              max_size=3)}),
    st.fixed_dictionaries({"key": st.sampled_from(LABEL_KEYS),
                           "operator": st.sampled_from(["Exists", "DoesNotExist"])}))
# Mostly valid policies with few priorities, so that ties are common.
valid_specs = st.fixed_dictionaries(
    {"priority": st.integers(min_value=0, max_value=2)},
    optional={"nodeSelector": st.fixed_dictionaries({}, optional={
        "matchLabels": labels, "matchExpressions": st.lists(good_expression, max_size=2)})})
policy_sets = st.lists(st.tuples(st.sampled_from("abcdefgh"),
                                 st.one_of(valid_specs, valid_specs, valid_specs, specs)),
                       max_size=7, unique_by=lambda t: t[0])
node_sets = st.dictionaries(st.sampled_from([f"n{i}" for i in range(8)]), labels, max_size=8)


@FUZZ
@given(policy_sets, node_sets, st.randoms(use_true_random=False))
def test_resolve_is_deterministic_and_follows_priority(
        raw: list[tuple[str, Any]], nodes: dict[str, dict[str, str]], rnd: random.Random) -> None:
    policies = [parse_policy({"metadata": {"name": f"p-{n}", "resourceVersion": "1",
                                           "generation": 1}, "spec": s}) for n, s in raw]
    for p in policies:
        assert (p.spec is None) == (p.error is not None)
        if p.error is not None:
            assert p.error.startswith("spec"), p.error  # names the field, not a TypeError
        else:
            assert p.spec is not None and isinstance(describe(p.spec.nodeSelector), str)
    result = resolve(policies, nodes)
    assert set(result.effective) == set(nodes)
    valid = [p for p in policies if p.spec is not None]
    conflicted: dict[str, tuple[str, ...]] = {}
    for node, node_labels in nodes.items():
        matching = [p for p in valid if p.spec and matches(p.spec.nodeSelector, node_labels)]
        if not matching:
            assert result.effective[node] is None
            continue
        top = max(p.spec.priority for p in matching if p.spec)
        tied = sorted(p.name for p in matching if p.spec and p.spec.priority == top)
        assert result.effective[node] == tied[0]  # highest priority, then first name
        if len(tied) > 1:
            conflicted[node] = tuple(tied)
    # every tie is reported, once, with all the policies involved; nothing else is
    reported = {n: key for key, c in result.conflicts.items() for n in c.nodes}
    assert reported == conflicted
    for key, c in result.conflicts.items():
        assert c.policies == key and list(c.nodes) == sorted(c.nodes)
        for name in key:
            assert c in result.conflicts_of(name)
    # the order policies and nodes arrive in changes nothing
    shuffled = list(policies)
    rnd.shuffle(shuffled)
    node_items = list(nodes.items())
    rnd.shuffle(node_items)
    again = resolve(shuffled, dict(node_items))
    assert again.effective == result.effective
    assert {k: sorted(c.nodes) for k, c in again.conflicts.items()} == \
        {k: c.nodes for k, c in result.conflicts.items()}


# ---- examples the fuzzing found (each raised something other than PolicyError)
@pytest.mark.parametrize(("spec", "field"), [
    ({"heartbeat": "ab"}, "spec.heartbeat must be an object"),  # was ValueError
    ({"heartbeat": [1]}, "spec.heartbeat must be an object"),  # was TypeError
    ({"failure": "xy"}, "spec.failure must be an object"),  # was ValueError
    ("ab", "spec must be an object"),  # was ValueError
    ([["heartbeat", {}]], "spec must be an object"),  # a list of pairs was taken as a dict
    ({"heartbeat": {1: 2}}, "spec.heartbeat: unknown field(s) 1"),  # was TypeError
    ({1: 2, "x": 3}, "spec: unknown field(s) 1, x"),  # was TypeError (sorting int and str)
    # accepted, though the CRD types them integer / boolean:
    ({"heartbeat": {"leaseDurationSeconds": 40.5}},
     "spec.heartbeat.leaseDurationSeconds must be a whole number"),
    ({"failure": {"gracePeriodSeconds": 60.5}},
     "spec.failure.gracePeriodSeconds must be a whole number"),
    ({"failure": {"taintUnreachable": "no"}},
     "spec.failure.taintUnreachable must be true or false"),
])
def test_found_by_fuzzing_spec(spec: Any, field: str) -> None:
    with pytest.raises(PolicyError) as e:
        parse_spec(spec)
    assert str(e.value).startswith(field), e.value


def test_a_whole_float_is_a_whole_number() -> None:
    spec = parse_spec({"heartbeat": {"leaseDurationSeconds": 60.0},
                       "failure": {"gracePeriodSeconds": 60.0}})
    assert spec.heartbeat == Heartbeat(leaseDurationSeconds=60, renewIntervalSeconds=15)
    assert type(spec.heartbeat.leaseDurationSeconds) is int


@pytest.mark.parametrize(("value", "message"), [
    ("[" * 100_000, "nested too deeply"),  # was RecursionError
    ('{"leaseDurationSeconds": 40.5}', "leaseDurationSeconds must be a whole number"),
    (None, "must be a string"),  # was TypeError
])
def test_found_by_fuzzing_annotation(value: Any, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        decode_heartbeat_annotation(value)


def test_a_huge_bad_value_is_quoted_short() -> None:
    with pytest.raises(PolicyError) as e:
        parse_spec({"heartbeat": {"leaseDurationSeconds": "x" * 100_000}})
    assert len(str(e.value)) < 200
    nested: Any = 1
    for _ in range(5000):
        nested = [nested]
    with pytest.raises(PolicyError, match="priority"):
        parse_spec({"priority": nested})
