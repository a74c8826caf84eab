"""The KV memory benchmark's core on a small trace: paged waste < 4%, Orca(Max) batches 7."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench" / "kv_memory.py"


@pytest.fixture(scope="module")
def kv_memory():
    spec = importlib.util.spec_from_file_location("kv_memory_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the body runs
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_pool_derivation(kv_memory):
    assert kv_memory.KV_BYTES_PER_TOKEN == 800 * 1024
    assert kv_memory.POOL_SLOTS == 15728
    assert kv_memory.POOL_SLOTS // kv_memory.MAX_LEN == 7


def test_trace_matches_paper_means(kv_memory):
    t = kv_memory.make_trace("sharegpt", 200, seed=0)
    assert t.prompt.mean() == pytest.approx(161.31, abs=0.05)
    assert t.output.mean() == pytest.approx(337.99, abs=0.05)
    assert (t.prompt + t.output).max() <= 2048 and t.prompt.min() >= 1 and t.output.min() >= 1


def test_paged_waste_under_4_percent_and_orca_max_batches_7(kv_memory):
    trace = kv_memory.make_trace("sharegpt", 200, seed=0)
    paged = kv_memory.simulate_paged(trace, block_size=16)
    assert paged.waste_pct < 4.0
    orca_max = kv_memory.simulate_contiguous(trace, "orca-max")
    assert orca_max.avg_batch == 7.0 and orca_max.max_batch == 7
    oracle = kv_memory.simulate_contiguous(trace, "orca-oracle")
    assert paged.avg_batch > oracle.avg_batch > orca_max.avg_batch
    assert kv_memory.simulate_paged(trace, block_size=8).waste_pct < paged.waste_pct


def test_reservations(kv_memory):
    assert kv_memory.reservation("orca-max", 10, 25) == 2048
    assert kv_memory.reservation("orca-pow2", 10, 25) == 10 + 32
    assert kv_memory.reservation("orca-pow2", 2000, 40) == 2048
    assert kv_memory.reservation("orca-oracle", 10, 25) == 35
