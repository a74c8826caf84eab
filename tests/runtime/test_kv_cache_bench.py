"""The KV memory benchmark's core on a small trace: paged waste < 4%, Orca(Max) batches 7."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
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


SEEDS = range(5)


def test_trace_matches_paper_means_for_any_seed(kv_memory):
    """The means are fitted, not drawn: for every seed they are the paper's to within one
    length unit over the trace (the bisection stops where one request's rounding flips). The
    spread is drawn: log-lengths have the dataset's sigma to within sampling error."""
    n = 200
    mean_in, mean_out, sigma = kv_memory.DATASETS["sharegpt"]
    log_lengths = []
    for seed in SEEDS:
        t = kv_memory.make_trace("sharegpt", n, seed=seed)
        assert abs(t.prompt.mean() - mean_in) <= 1 / n, seed
        assert abs(t.output.mean() - mean_out) <= 1 / n, seed
        assert (t.prompt + t.output).max() <= 2048 and t.prompt.min() >= 1 and t.output.min() >= 1
        log_lengths += [np.log(x) - np.log(x).mean() for x in (t.prompt, t.output)]
    # the sample std of m normal draws is off by sigma/sqrt(2m) (one standard error); allow
    # four (clipping at 1 and rounding take a little more off the low tail)
    pooled = np.concatenate(log_lengths)
    standard_error = sigma / np.sqrt(2 * len(pooled))
    assert abs(pooled.std() - sigma) < 4 * standard_error, pooled.std()


@pytest.mark.parametrize("seed", [0, 1])
def test_paged_waste_under_4_percent_and_orca_max_batches_7(kv_memory, seed):
    trace = kv_memory.make_trace("sharegpt", 200, seed=seed)
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
