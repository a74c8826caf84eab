"""tools/bench/paged_attention.py: --cpu times the reference; without a GPU it writes nothing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "bench" / "paged_attention.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("paged_attention_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_mode_writes_json(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = bench.main(
        [
            "--cpu", "--batch", "1,2", "--context", "32,48", "--num-heads", "4",
            "--num-kv-heads", "2", "--head-size", "64", "--dtype", "float32", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    assert "paged us" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["benchmark"] == "paged_attention_decode"
    points = [(r["batch"], r["context"]) for r in data["rows"]]
    assert points == [(1, 32), (1, 48), (2, 32), (2, 48)]
    row = data["rows"][0]
    # K and V for 32 tokens x 2 kv heads x 64 fp32, q and out, a 2-block table, one length
    assert row["bytes"] == 2 * 32 * 2 * 64 * 4 + 2 * 4 * 64 * 4 + 2 * 4 + 4
    assert row["paged_us"] > 0 and row["sdpa_us"] > 0


def test_peak_table_is_not_shadowed(bench):
    """First match wins: a specific name (PCIe, 40 GB) must come before its shorter fragment,
    or every H100 PCIe would be rated at the SXM's bandwidth."""
    for fragment, gbps in bench.PEAK_GBPS:
        assert bench.peak_gbps(f"NVIDIA {fragment}") == gbps, fragment
    # names as torch.cuda.get_device_name gives them
    assert bench.peak_gbps("NVIDIA H100 PCIe") < bench.peak_gbps("NVIDIA H100 80GB HBM3")
    assert bench.peak_gbps("NVIDIA A100-SXM4-40GB") < bench.peak_gbps("NVIDIA A100-SXM4-80GB")
    assert bench.peak_gbps("Some Future GPU") is None


def test_share_of_peak_is_bandwidth_over_peak(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = bench.main(
        [
            "--cpu", "--batch", "1", "--context", "32", "--num-heads", "2", "--num-kv-heads", "1",
            "--head-size", "64", "--dtype", "float32", "--peak-gbps", "50", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["paged_pct_peak"] == pytest.approx(100 * row["paged_gbps"] / 50)
    assert row["paged_gbps"] == pytest.approx(row["bytes"] / (row["paged_us"] * 1e-6) / 1e9)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_gpu_says_so_and_writes_nothing(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--out", str(out)]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not out.exists()
