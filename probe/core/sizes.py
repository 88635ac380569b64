"""Sizes and counts as text, read and printed one way on every floor: the working-memory budget
(:mod:`headprobe.probe.core.memory`, ``--memory-budget``) and the cost tables and ``--kv-limit`` of
``headprobe budget`` (:mod:`headprobe.probe.layout.cost`).

Units: bytes. Binary prefixes KiB MiB GiB TiB are powers of 1024, decimal kB MB GB TB powers of
1000 (IEC 80000-13); unit letters are read in any case. Torch-free.

Integers are read and printed exactly, in integer arithmetic (``1e23`` is ``10**23``, and ``5**23
TiB`` prints as 11920928955078125 TiB, not a float's 11920928955078124).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction

from headprobe.probe.core.errors import HeadprobeError

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40

_BINARY = (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB))
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": TIB,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def refuse_negative(text: object, what: str) -> None:
    """Refuse a size or count written with a minus sign (``-1GiB``, ``-5e3``) as what it is: one
    line, ``"--kv-limit must be positive, got -1GiB"``, rather than "not a size".

    Raises:
        HeadprobeError: ``text`` is a quantity (:data:`_QUANTITY`) after a leading minus sign.
    """
    t = str(text).strip()
    if t.startswith("-") and _QUANTITY.match(t[1:]):
        raise HeadprobeError(f"{what} must be positive, got {t}")


def parse_bytes(text: str | int, what: str = "size", bare_at_least: int = 1) -> int:
    """A size in bytes: an int as given, or text like ``4GiB``, ``512 MiB``, ``1.5GB``, ``2e9``, ``1000``.

    A bare number is bytes. ``bare_at_least`` refuses a bare number below it as a forgotten unit:
    ``budget --kv-limit`` passes 1024, since ``--kv-limit 2`` (meant as 2 GiB) would otherwise
    answer "nothing fits" as if it were a real limit; the memory budget keeps 1, because a
    budget too small for the work is refused anyway in one line naming the sizes, and a budget of
    ``1000`` bytes is a legal statement. Fractions of a byte are dropped; the result must be at
    least 1 byte (``0.1B`` is no size).

    Args:
        what: the name of the value in the error (``"memory budget"``, ``"--kv-limit"``).

    Raises:
        HeadprobeError: not a size, below 1 byte, or a bare number below ``bare_at_least`` (one line).
    """
    if isinstance(text, int):
        value, unit = text, "b"
    else:
        refuse_negative(text, what)
        m = _QUANTITY.match(str(text))
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _BYTE_UNITS:
            raise HeadprobeError(
                f"{what} {text!r} is not a size: write bytes or a number with a unit "
                f"(KB MB GB TB, KiB MiB GiB TiB), e.g. 4GiB"
            )
        value = _whole(m.group(1), _BYTE_UNITS[unit], text, what)
    if value < 1:
        raise HeadprobeError(f"{what} must be at least 1 byte, got {text!r}")
    if unit == "" and value < bare_at_least:
        t = str(text).strip()
        raise HeadprobeError(f"{text!r} would be {value} bytes; give a unit, e.g. {t}GiB or {t}MiB")
    return value


def parse_count(text: str, what: str = "--params") -> int:
    """``"135M"``, ``"8B"``, ``"7e9"``, ``"1.5k"`` -> a count (decimal suffixes k, M, B/G, T).

    Raises:
        HeadprobeError: the text is not a positive count.
    """
    refuse_negative(text, what)
    m = _QUANTITY.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _COUNT_UNITS or float(m.group(1)) <= 0:
        raise HeadprobeError(f"cannot read {text!r} as a parameter count; write e.g. 135M, 8B or 7e9")
    return _whole(m.group(1), _COUNT_UNITS[unit], text, "parameter count")


def _whole(number: str, unit: int, text: object, what: str) -> int:
    """``number`` (a decimal numeral, maybe with an exponent) times ``unit``, exactly, fractions dropped.

    Raises:
        HeadprobeError: the value overflows a float (``1e400GiB``): the cost formulas take floats of it.
    """
    if not math.isfinite(float(number) * unit):
        raise HeadprobeError(f"{what} {text!r} is too large to be a number")
    return int(Fraction(Decimal(number)) * unit)


def exact(x: int | float | Fraction) -> Fraction:
    """``x`` as an exact fraction: an int or fraction as is, a float by its binary value, or past
    2**53 (where a float's last integer digits are rounding noise) by its shortest decimal (repr)."""
    if isinstance(x, float) and abs(x) >= 2**53 and math.isfinite(x):
        return Fraction(Decimal(repr(x)))
    return Fraction(x)


def fixed(x: int | float | Fraction, places: int) -> str:
    """``x`` with ``places`` decimals, rounded exactly (half to even), without a float's noise:
    ``fixed(5**23, 0)`` is ``"11920928955078125"``; like ``f"{x:.{places}f}"`` otherwise."""
    q = round(exact(x) * 10**places)
    digits = str(abs(q)).rjust(places + 1, "0")
    whole, frac = digits[: len(digits) - places], digits[len(digits) - places :]
    return ("-" if q < 0 else "") + whole + (f".{frac}" if places else "")


def format_whole(x: int | float) -> str:
    """``x`` rounded to an integer with thousands separators (``4,096``), exact past 2**53
    (:func:`exact`: ``2e23`` prints as 200,000,000,000,000,000,000,000)."""
    return f"{int(fixed(x, 0)):,}"


def format_bytes(n: int | float) -> str:
    """``n`` bytes with a binary prefix: ``512 KiB``, ``16 GiB``, ``1.5 KiB``, ``8.58 GiB``, ``12 B``.

    At most two decimals, trailing zeros dropped: the digits shown are the digits known, and the
    text reads back through :func:`parse_bytes` to within half of its last digit. The unit is
    the largest that ``n`` reaches, or the next one where the rounded value would print as 1024
    (``2**40 - 1`` bytes is ``1 TiB``, not ``1024 GiB``). Exact (:func:`fixed`) at any size.
    """
    units = [("B", 1), *reversed(_BINARY)]
    x = exact(n)
    i = max(i for i, (_, size) in enumerate(units) if i == 0 or abs(x) >= size)
    if i + 1 < len(units) and round(abs(x) / units[i][1], 2) >= 1024:  # e.g. 1023.999 GiB
        i += 1
    unit, v = units[i][0], x / units[i][1]
    if v.denominator == 1:
        return f"{v.numerator} {unit}"
    return fixed(v, 2).rstrip("0").rstrip(".") + f" {unit}"
