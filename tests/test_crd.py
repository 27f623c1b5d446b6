"""The CRD (charts/nodepulse/crds/) agrees with nodeagent.api.policy: the same defaults,
the same rules with messages naming the field, and what `kubectl` shows."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent.api.policy import (
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    Failure,
    Heartbeat,
    PolicyError,
    parse_spec,
)

CRD_DIR = Path(__file__).resolve().parent.parent / "charts" / "nodepulse" / "crds"

# Bad specs, the field each one breaks (as both the CRD and parse_spec name it).
BAD_SPECS: list[tuple[dict[str, Any], str]] = [
    ({"heartbeat": {"leaseDurationSeconds": 20, "renewIntervalSeconds": 20}},
     "spec.heartbeat.renewIntervalSeconds"),
    ({"heartbeat": {"leaseDurationSeconds": 60}}, "spec.failure.gracePeriodSeconds"),
    ({"heartbeat": {"statusUpdateFrequencySeconds": 30, "statusReportFrequencySeconds": 20}},
     "spec.heartbeat.statusReportFrequencySeconds"),
    ({"heartbeat": {"leaseDurationSeconds": 2}}, "spec.heartbeat.leaseDurationSeconds"),
    ({"heartbeat": {"maxImagesInStatus": 5000}}, "spec.heartbeat.maxImagesInStatus"),
    ({"failure": {"gracePeriodSeconds": 100000}}, "spec.failure.gracePeriodSeconds"),
    ({"failure": {"maxUnreachableFraction": 1.5}}, "spec.failure.maxUnreachableFraction"),
    ({"failure": {"noExecuteTaintsPerMinute": -1}}, "spec.failure.noExecuteTaintsPerMinute"),
]


def load_crd() -> dict[str, Any]:
    files = sorted(CRD_DIR.glob("*.yaml"))
    crds = [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]
    [crd] = [c for c in crds if c["spec"]["names"]["plural"] == PLURAL]
    return crd


def schema() -> dict[str, Any]:
    [version] = load_crd()["spec"]["versions"]
    return dict(version["schema"]["openAPIV3Schema"])


def spec_props() -> dict[str, Any]:
    return dict(schema()["properties"]["spec"]["properties"])


def all_rules(node: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(node, dict):
        out.extend(node.get("x-kubernetes-validations", []))
        for v in node.values():
            out.extend(all_rules(v))
    elif isinstance(node, list):
        for v in node:
            out.extend(all_rules(v))
    return out


def test_identity() -> None:
    crd = load_crd()
    assert crd["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    assert crd["spec"]["group"] == GROUP and crd["spec"]["scope"] == "Cluster"
    assert crd["spec"]["names"]["kind"] == KIND
    assert crd["spec"]["names"]["shortNames"] == ["nsp"]
    [version] = crd["spec"]["versions"]
    assert version["name"] == VERSION and version["storage"] and version["served"]
    assert version["subresources"] == {"status": {}}
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    assert cols == ["Selector", "Priority", "Nodes", "Ready", "Unreachable", "Effective", "Age"]


@pytest.mark.parametrize(("section", "cls"), [("heartbeat", Heartbeat), ("failure", Failure)])
def test_defaults_agree_with_policy_py(section: str, cls: type) -> None:
    props = spec_props()[section]
    assert props["default"] == {}  # so the inner defaults apply when it is left out
    model = {f.name: f.default for f in dataclasses.fields(cls)}
    assert set(props["properties"]) == set(model)
    for name, value in model.items():
        if name == "renewIntervalSeconds":
            # Computed from the duration (a quarter), so the schema must leave it unset:
            # a fixed default would break the rule for short leases.
            assert "default" not in props["properties"][name]
            assert parse_spec({"heartbeat": {"leaseDurationSeconds": 20}}
                              ).heartbeat.renewIntervalSeconds == 5
            continue
        assert props["properties"][name]["default"] == value, name
    assert spec_props()["priority"]["default"] == parse_spec({}).priority


def test_schema_defaults_make_a_valid_policy() -> None:
    defaulted = {k: {n: p["default"] for n, p in v["properties"].items() if "default" in p}
                 for k, v in spec_props().items() if k in ("heartbeat", "failure")}
    spec = parse_spec(defaulted)
    assert spec.heartbeat == Heartbeat() and spec.failure == Failure()


def test_every_field_is_described() -> None:
    def walk(node: dict[str, Any], path: str) -> None:
        for name, prop in (node.get("properties") or {}).items():
            if name == "metadata":
                continue
            assert prop.get("description"), f"{path}.{name} has no description"
            walk(prop, f"{path}.{name}")
            if "items" in prop:
                walk(prop["items"], f"{path}.{name}[]")
    root = schema()
    assert root.get("description")
    walk(root, "")


def test_rule_messages_name_their_field() -> None:
    rules = all_rules(schema())
    assert len(rules) >= 12
    for r in rules:
        assert r["message"].startswith("spec."), r


@pytest.mark.parametrize(("bad", "field"), BAD_SPECS)
def test_policy_py_and_crd_refuse_the_same_specs(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyError, match=field.replace(".", r"\.")):
        parse_spec(bad)
    messages = [r["message"] for r in all_rules(schema())]
    assert any(m.startswith(field) for m in messages), field


def test_ranges_agree_with_policy_py() -> None:
    """Each CEL range rule's bounds are the ones policy.py enforces: a value just
    outside is refused by parse_spec, one at the bound accepted."""
    import re
    fields = {"heartbeat": Heartbeat, "failure": Failure}
    checked = 0
    for section, cls in fields.items():
        for name, prop in spec_props()[section]["properties"].items():
            for rule in prop.get("x-kubernetes-validations", []):
                m = re.fullmatch(r"self >= ([\d.]+) && self <= ([\d.]+)", rule["rule"])
                assert m, rule
                low, high = float(m[1]), float(m[2])
                base = dataclasses.asdict(cls())
                for value, ok in ((low, True), (high, True), (low - 1, False),
                                  (high + 1, False)):
                    v: float = int(value) if prop["type"] == "integer" else value
                    data = {**base, name: v}
                    spec: dict[str, Any] = {section: data}
                    # Keep the cross-field rules out of the way of the range under test.
                    if section == "heartbeat":
                        data.update(leaseDurationSeconds=data["leaseDurationSeconds"]
                                    if name != "leaseDurationSeconds" else v,
                                    renewIntervalSeconds=min(data["renewIntervalSeconds"], 1)
                                    if name != "renewIntervalSeconds" else v)
                        if name == "renewIntervalSeconds":
                            data["leaseDurationSeconds"] = 3600
                        if name == "statusUpdateFrequencySeconds":
                            data["statusReportFrequencySeconds"] = 86400
                        if name == "statusReportFrequencySeconds":
                            data["statusUpdateFrequencySeconds"] = 1
                        spec["failure"] = {"gracePeriodSeconds": 86400}
                    if section == "failure" and name == "gracePeriodSeconds":
                        spec["heartbeat"] = {"leaseDurationSeconds": 5}
                    if ok and section == "heartbeat" and name == "renewIntervalSeconds" \
                            and v >= 3600:
                        continue  # 3600 is in range but not less than the duration
                    if ok and section == "failure" and name == "gracePeriodSeconds" and v < 5:
                        continue  # in range, but below the shortest lease duration
                    try:
                        parse_spec(spec)
                        accepted = True
                    except PolicyError as e:
                        accepted = False
                        assert f"spec.{section}.{name}" in str(e)
                    assert accepted is ok, (section, name, v)
                    checked += 1
    assert checked >= 30
