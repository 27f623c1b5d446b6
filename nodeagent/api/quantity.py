"""Resource quantities as the API server reads them ("100Mi", "250m", "1.5", "2e3").

The one parser for every quantity nodepulse reads: container resources, eviction
thresholds, reserved resources, host overrides. Its rules are resource.Quantity's:

- an optional sign, then digits with an optional fraction (".5", "5.", "5.25");
- then one suffix: binary (Ki Mi Gi Ti Pi Ei, powers of 1024), decimal (n u m "" k M G
  T P E, powers of 1000: "E" is 10^18, "Ei" is 2^60), or an exponent ("e3", "E-2");
- at most three decimal places: more precise values are rounded up (0.1m is 1m), and
  at most 2^63-1: larger ones are capped;
- a JSON number is a quantity as well; true and false are not.

Resource amounts cannot be negative (the API server's validation refuses them), so a
negative quantity is refused too unless `negative=True`.
"""

from __future__ import annotations

import decimal
import re

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15,
            "E": 18}
_QUANTITY = re.compile(r"([+-]?)(\d+\.?\d*|\.\d+)([A-Za-z]*|[eE][+-]?\d+)")
_MILLI = decimal.Decimal("0.001")
_MAX = decimal.Decimal(2**63 - 1)
_CONTEXT = decimal.Context(prec=40)


class QuantityError(ValueError):
    """Not a quantity; the message names where it came from."""


def parse_quantity(value: object, where: str = "quantity", *, negative: bool = False) -> float:
    """'100Mi' -> 104857600, '250m' -> 0.25, 4 -> 4.0; QuantityError names `where`."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise QuantityError(f"{where}: expected a quantity such as 100Mi, 2 or 500m, "
                            f"got {value!r}")
    m = _QUANTITY.fullmatch(str(value))
    if m is None or not _known(m.group(3)):
        raise QuantityError(f"{where}: {value!r} is not a quantity (e.g. 100Mi, 2, 500m)")
    sign, number, suffix = m.groups()
    amount = decimal.Decimal(number)
    if suffix in _BINARY:
        amount *= _BINARY[suffix]
    else:
        exponent = _DECIMAL[suffix] if suffix in _DECIMAL else int(suffix[1:])
        amount = amount.scaleb(max(-30, min(30, exponent)), _CONTEXT)  # beyond: 0 or capped
    amount = min(amount, _MAX).quantize(_MILLI, rounding=decimal.ROUND_UP, context=_CONTEXT)
    if sign == "-" and amount:
        if not negative:
            raise QuantityError(f"{where}: must not be negative, got {value!r}")
        amount = -amount
    return float(amount)


def _known(suffix: str) -> bool:
    return (suffix in _BINARY or suffix in _DECIMAL
            or (len(suffix) > 1 and suffix[0] in "eE"))


def format_bytes(n: int) -> str:
    """Whole bytes as the API server would canonicalise them: largest exact binary unit."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        if n and n % _BINARY[suffix] == 0:
            return f"{n // _BINARY[suffix]}{suffix}"
    return str(n)


def format_cpu(cores: float) -> str:
    milli = round(cores * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"
