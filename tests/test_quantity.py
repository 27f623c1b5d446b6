"""The one quantity parser, with the API server's rules (resource.Quantity)."""

from __future__ import annotations

import pytest

from nodeagent.api.quantity import QuantityError, format_bytes, format_cpu, parse_quantity


@pytest.mark.parametrize("text, value", [
    ("100Mi", 100 * 2**20), ("1.5Gi", 1.5 * 2**30), ("1Ki", 1024), ("2Ei", 2 * 2**60),
    ("250m", 0.25), ("1", 1), ("1.5", 1.5), (".5", 0.5), ("5.", 5), ("+3k", 3000),
    ("2M", 2e6), ("1G", 1e9), ("1T", 1e12), ("1P", 1e15), ("1E", 1e18),  # E is exa, not Ei
    ("2e3", 2000), ("5E-3", 0.005), ("1e+2", 100),
    ("0.1m", 0.001), ("1n", 0.001), ("1u", 0.001), ("1.0001", 1.001),  # rounded up to 1m
    ("1e30", 2**63 - 1),  # capped
    (4, 4), (0.25, 0.25), ("0", 0), ("-0", 0),
])
def test_parses_what_the_api_server_accepts(text: object, value: float) -> None:
    assert parse_quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("text, words", [
    (True, "expected a quantity"), (None, "expected a quantity"), ([1], "expected a quantity"),
    ("", "not a quantity"), ("lots", "not a quantity"), ("1KiB", "not a quantity"),
    ("1e", "not a quantity"), ("1.5.3", "not a quantity"), (".", "not a quantity"),
    (" 2", "not a quantity"), ("1 Mi", "not a quantity"), ("1k2", "not a quantity"),
    ("-1", "must not be negative"), ("-100Mi", "must not be negative"),
])
def test_refuses_the_rest_naming_where(text: object, words: str) -> None:
    with pytest.raises(QuantityError, match=f"limits.memory: .*{words}"):
        parse_quantity(text, "limits.memory")
    assert issubclass(QuantityError, ValueError)  # what a pod spec's refusal catches


def test_negative_only_when_asked() -> None:
    assert parse_quantity("-1.5", negative=True) == -1.5


def test_formats_as_the_api_server_writes_them() -> None:
    assert format_bytes(2 * 2**30) == "2Gi" and format_bytes(1536) == "1536"
    assert format_bytes(3 * 2**20) == "3Mi" and format_bytes(1000) == "1000"
    assert format_cpu(2) == "2" and format_cpu(0.25) == "250m"
