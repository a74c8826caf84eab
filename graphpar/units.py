"""Quantities as people write them: "80GiB", "300GB/s", "25Gbps", "5us", "312 TFLOPS".

Each `parse_*` takes a number (already in the base unit: bytes, bytes/s, seconds,
FLOP/s) or a string with a unit, and returns the number in the base unit. Each
raises `ValueError` with a message saying what was expected; callers that know
where the text came from (a cluster file, a flag) wrap it in their own error.

Decimal prefixes (k, M, G, T, P) are powers of 1000, binary ones (Ki, Mi, Gi,
Ti, Pi) powers of 1024. In sizes and bandwidths an upper-case `B` is a byte
and a lower-case `b` (or `bit`) a bit, as in networking: "25Gbps" is 25e9
bits/s = 3.125e9 bytes/s, "300GB/s" is 300e9 bytes/s.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "format_bandwidth",
    "format_bytes",
    "format_flops",
    "format_seconds",
    "parse_bandwidth",
    "parse_bytes",
    "parse_flops",
    "parse_seconds",
]

_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40, "pi": 2.0**50}

_NUMBER = r"(?P<num>[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
_PREFIX = r"(?P<prefix>[kKmMgGtTpP]i?)?"


def _scale(prefix: str | None) -> float:
    prefix = (prefix or "").lower()
    return _BINARY[prefix] if prefix.endswith("i") else _DECIMAL[prefix]


def _number(value: object, what: str, example: str) -> float | None:
    """`value` as a float if it is a plain number (int, float, numeric string), else None."""
    if isinstance(value, bool):
        raise ValueError(f"expected {what} like {example}, got {value!r}")
    if isinstance(value, (int, float)):
        result = float(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*" + _NUMBER + r"\s*", value):
        result = float(value)
    else:
        return None
    if not math.isfinite(result) or result < 0:
        raise ValueError(f"expected {what} like {example}, got {value!r} (must be finite, >= 0)")
    return result


def _match(pattern: str, value: object, what: str, example: str) -> re.Match[str]:
    if not isinstance(value, str):
        raise ValueError(f"expected {what} like {example}, got {value!r}")
    m = re.fullmatch(r"\s*" + _NUMBER + r"\s*" + pattern + r"\s*", value)
    if m is None:
        raise ValueError(f"expected {what} like {example}, got {value!r}")
    if float(m.group("num")) < 0:
        raise ValueError(f"expected {what} like {example}, got {value!r} (must be >= 0)")
    return m


def parse_bytes(value: int | float | str) -> int:
    """A size in bytes: 1024, "40GB" (40e9), "80GiB" (80 * 2**30), "512 MiB", "1.5kB".

    Lower-case "b" (bits) is rejected: memory is counted in bytes.
    """
    example = '"40GB", "80GiB" or a number of bytes'
    plain = _number(value, "a size", example)
    if plain is not None:
        return round(plain)
    m = _match(_PREFIX + r"(?P<unit>B|b|bytes?|bits?)?", value, "a size", example)
    unit = m.group("unit") or ""
    if unit in ("b", "bit", "bits"):
        raise ValueError(f"expected a size in bytes like {example}, got {value!r} "
                         "(lower-case 'b' means bits; write 'B' for bytes)")
    if not unit and not m.group("prefix"):
        raise ValueError(f"expected a size like {example}, got {value!r}")
    return round(float(m.group("num")) * _scale(m.group("prefix")))


def parse_bandwidth(value: int | float | str) -> float:
    """A bandwidth in bytes/s: 300e9, "300GB/s", "300 GBps", "25Gbps", "200 Gb/s", "100Gbit/s"."""
    example = '"300GB/s", "25Gbps" or a number of bytes/s'
    plain = _number(value, "a bandwidth", example)
    if plain is not None:
        return plain
    m = _match(_PREFIX + r"(?P<unit>B|b|bit|byte)(?:/s|ps)", value, "a bandwidth", example)
    per_unit = 1.0 if m.group("unit") in ("B", "byte") else 1.0 / 8
    return float(m.group("num")) * _scale(m.group("prefix")) * per_unit


_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}


def parse_seconds(value: int | float | str) -> float:
    """A duration in seconds: 5e-6, "5us", "5 µs", "1.5ms", "100ns", "2s"."""
    example = '"5us", "1.5ms" or a number of seconds'
    plain = _number(value, "a duration", example)
    if plain is not None:
        return plain
    m = _match(r"(?P<unit>s|ms|us|µs|μs|ns)", value, "a duration", example)
    return float(m.group("num")) * _TIME_UNITS[m.group("unit")]


def parse_flops(value: int | float | str) -> float:
    """A compute rate in FLOP/s: 312e12, "312T", "312 TFLOPS", "19.5 TFLOP/s"."""
    example = '"312 TFLOPS", "19.5T" or a number of FLOP/s'
    plain = _number(value, "a FLOP rate", example)
    if plain is not None:
        return plain
    m = _match(r"(?P<prefix>[kKmMgGtTpP])?(?:FLOPS|FLOP/s|flops|flop/s)?", value,
               "a FLOP rate", example)
    return float(m.group("num")) * _scale(m.group("prefix"))


def _format(value: float, unit: str, steps: tuple[tuple[str, float], ...], digits: int) -> str:
    for prefix, scale in steps:
        if abs(value) >= scale:
            scaled = value / scale
            return f"{scaled:.{digits}f} {prefix}{unit}"
    return f"{value:g} {unit}"


def format_bytes(n: float, binary: bool = False, digits: int = 1) -> str:
    """12_600_000 -> "12.6 MB"; with binary=True, 2**30 -> "1.0 GiB". Below 1 kB: "512 B"."""
    if abs(n) < (1024 if binary else 1000):
        return f"{round(n)} B"
    if binary:
        steps = (("Pi", 2.0**50), ("Ti", 2.0**40), ("Gi", 2.0**30), ("Mi", 2.0**20),
                 ("Ki", 2.0**10))
    else:
        steps = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))
    return _format(n, "B", steps, digits)


def format_bandwidth(bytes_per_second: float, digits: int = 1) -> str:
    """300e9 -> "300.0 GB/s"."""
    steps = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))
    return _format(bytes_per_second, "B/s", steps, digits)


def format_seconds(seconds: float, digits: int = 2) -> str:
    """0.00021 -> "0.21 ms", 5e-6 -> "5.00 us", 3.2 -> "3.20 s": the largest unit showing >= 0.1."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if abs(seconds) >= 0.1 * scale:
            return f"{seconds / scale:.{digits}f} {unit}"
    return "0 s" if seconds == 0 else f"{seconds:.3g} s"


def format_flops(flops_per_second: float, digits: int = 1) -> str:
    """312e12 -> "312.0 TFLOP/s"."""
    steps = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))
    return _format(flops_per_second, "FLOP/s", steps, digits)
