import pytest

from nodeagent.api.policy import (
    Heartbeat,
    PolicyError,
    decode_heartbeat_annotation,
    encode_heartbeat_annotation,
    parse_heartbeat,
    parse_spec,
)


def test_defaults_follow_kep_589() -> None:
    spec = parse_spec({})
    assert spec.heartbeat == Heartbeat(40, 10, 10, 300, 50)
    assert spec.failure.gracePeriodSeconds == 50
    assert spec.priority == 0


def test_renew_interval_defaults_to_a_quarter_of_the_duration() -> None:
    assert parse_heartbeat({"leaseDurationSeconds": 60}).renewIntervalSeconds == 15


@pytest.mark.parametrize(("spec", "field"), [
    ({"heartbeat": {"leaseDurationSeconds": 20, "renewIntervalSeconds": 20}},
     "spec.heartbeat.renewIntervalSeconds"),
    ({"heartbeat": {"statusUpdateFrequencySeconds": 30, "statusReportFrequencySeconds": 20}},
     "spec.heartbeat.statusReportFrequencySeconds"),
    ({"heartbeat": {"leaseDurationSeconds": 60}, "failure": {"gracePeriodSeconds": 50}},
     "spec.failure.gracePeriodSeconds"),
    ({"heartbeat": {"maxImagesInStatus": -1}}, "spec.heartbeat.maxImagesInStatus"),
    ({"heartbeat": {"leaseDurationSeconds": "40"}}, "spec.heartbeat.leaseDurationSeconds"),
    ({"failure": {"maxUnreachableFraction": 1.5}}, "spec.failure.maxUnreachableFraction"),
    ({"heartbeat": {"leaseSeconds": 40}}, "spec.heartbeat"),
    ({"priority": "high"}, "spec.priority"),
])
def test_a_broken_rule_names_the_field(spec: dict, field: str) -> None:
    with pytest.raises(PolicyError, match=field.replace(".", r"\.")):
        parse_spec(spec)


def test_annotation_round_trip_is_byte_stable() -> None:
    hb = Heartbeat(leaseDurationSeconds=20, renewIntervalSeconds=2)
    value = encode_heartbeat_annotation("edge", hb)
    assert value == encode_heartbeat_annotation("edge", Heartbeat(20, 2))
    assert decode_heartbeat_annotation(value) == ("edge", hb)


@pytest.mark.parametrize("value", ["not json", "[1]", '{"policy": 3}',
                                   '{"leaseDurationSeconds": 10, "renewIntervalSeconds": 10}'])
def test_bad_annotation_is_refused(value: str) -> None:
    with pytest.raises(PolicyError, match="nodepulse.dev/heartbeat"):
        decode_heartbeat_annotation(value)
