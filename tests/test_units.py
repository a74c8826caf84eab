"""Parsing and printing sizes, bandwidths, durations and FLOP rates."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphpar.units import (
    format_bandwidth,
    format_bytes,
    format_flops,
    format_seconds,
    parse_bandwidth,
    parse_bytes,
    parse_flops,
    parse_seconds,
)


@pytest.mark.parametrize("text, expected", [
    ("40GB", 40_000_000_000),
    ("80GiB", 80 * 2**30),
    ("512 MiB", 512 * 2**20),
    ("1.5kB", 1500),
    ("16 GiB", 16 * 2**30),
    ("80Gi", 80 * 2**30),
    ("100 B", 100),
    ("7 bytes", 7),
    ("1024", 1024),
    (1024, 1024),
    (2.0e9, 2_000_000_000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["40Gb", "fast", "", "-1GB", "1e400", True, None, "GB", "40 XB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="expected"):
        parse_bytes(text)


def test_parse_bytes_says_bits_are_not_bytes():
    with pytest.raises(ValueError, match="bits"):
        parse_bytes("40Gb")


@pytest.mark.parametrize("text, expected", [
    ("300GB/s", 300e9),
    ("300 GBps", 300e9),
    ("25Gbps", 25e9 / 8),
    ("200 Gb/s", 25e9),
    ("100Gbit/s", 12.5e9),
    ("1 GiB/s", 2.0**30),
    (3.125e9, 3.125e9),
    ("5e9", 5e9),
])
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["300GB", "fast", "25 Gbps/s"])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(text)


@pytest.mark.parametrize("text, expected", [
    ("5us", 5e-6), ("5 µs", 5e-6), ("1.5ms", 1.5e-3), ("100ns", 1e-7), ("2s", 2.0), (3e-6, 3e-6),
])
def test_parse_seconds(text, expected):
    assert parse_seconds(text) == pytest.approx(expected)


def test_parse_seconds_rejects_unknown_units():
    with pytest.raises(ValueError, match="duration"):
        parse_seconds("5 minutes")


@pytest.mark.parametrize("text, expected", [
    ("312T", 312e12), ("312 TFLOPS", 312e12), ("19.5 TFLOP/s", 19.5e12), (1e11, 1e11),
    ("989.4e12", 989.4e12),
])
def test_parse_flops(text, expected):
    assert parse_flops(text) == pytest.approx(expected)


def test_format():
    assert format_bytes(12_600_000) == "12.6 MB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(2**30, binary=True) == "1.0 GiB"
    assert format_bandwidth(300e9) == "300.0 GB/s"
    assert format_seconds(0.00021) == "0.21 ms"
    assert format_seconds(5e-6) == "5.00 us"
    assert format_seconds(3.2) == "3.20 s"
    assert format_seconds(0) == "0 s"
    assert format_flops(312e12) == "312.0 TFLOP/s"


@given(st.integers(min_value=0, max_value=2**60))
def test_format_bytes_parses_back_approximately(n):
    back = parse_bytes(format_bytes(n, digits=3).replace(" ", ""))
    assert back == pytest.approx(n, rel=1e-3, abs=1)
    back = parse_bytes(format_bytes(n, binary=True, digits=3))
    assert back == pytest.approx(n, rel=1e-3, abs=1)
