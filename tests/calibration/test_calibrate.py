"""`graphpar calibrate`: the cluster it makes from measurements, the file it writes, its
warnings and errors. The measurements are synthetic here (made by the cost model's formulas
from known numbers), except in the one real run on two ranks."""

import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch

import graphpar.calibration.calibrate as calibration
from graphpar.calibration.fit import roofline_seconds
from graphpar.calibration.in_step import ProgramProfile
from graphpar.calibration.measure import (
    CACHE_BYTES,
    MEASURED_COLLECTIVES,
    SKINNY_WEIGHT_BYTES,
    CollectiveSample,
    ComputeSample,
    compute_cases,
    measure_overheads,
    overhead_cases,
    rotations,
)
from graphpar.calibration.plan_runs import NodeRow
from graphpar.cli import main
from graphpar.cost.cluster import ClusterFallbackWarning, get_cluster, load_cluster
from graphpar.cost.communication import collective_time
from graphpar.ir.cluster import COMPUTE_CLASSES
from graphpar.ir.registry import get_op

RATE, BANDWIDTH, OVERHEAD = 60e9, 15e9, 4e-6  # every class, every dtype (synthetic)
LATENCY = {"all_reduce": 100e-6, "all_gather": 80e-6, "reduce_scatter": 90e-6,
           "all_to_all": 120e-6, "send_recv": 50e-6}
LINK = 2e9


def fake_compute(cases, device="cpu", *, budget_s=0.0, progress=None):
    samples = []
    for case in cases:
        op, attrs = get_op(case.op), dict(case.attrs)
        results = op.infer(list(case.operands), attrs)
        flops = op.flops(list(case.operands), results, attrs)
        nbytes = op.bytes_accessed(list(case.operands), results)
        samples.append(ComputeSample(case, flops, nbytes,
                                     roofline_seconds(flops, nbytes, RATE, BANDWIDTH, OVERHEAD)))
        if progress:
            progress(str(case))
    return samples


def fake_collectives(ranks, sizes, *, device="cpu", quick=False, progress=None, **_):
    return [CollectiveSample(kind, n, m, collective_time(kind, m, n, LINK, LATENCY[kind]))
            for kind in MEASURED_COLLECTIVES for n in sorted({2, ranks}) for m in sizes]


def fake_overheads(dtype=torch.float32, device="cpu"):
    return {c: OVERHEAD for c in COMPUTE_CLASSES}


# in a step: gemm 1.5x, elementwise 3x, all_reduce 2x, all_gather 4x their loop-fitted time,
# 10 us of dispatch per priced node
IN_STEP = {"gemm": 1.5, "elementwise": 3.0, "all_reduce": 2.0, "all_gather": 4.0}
DISPATCH = 10e-6


def fake_profiles(cluster, ranks, *, quick=False, progress=None):
    def row(kind, predicted):
        collective = kind.startswith("all_")
        return NodeRow(kind, kind, collective, ranks if collective else 1, 0, predicted,
                       predicted * IN_STEP.get(kind, 0.0))
    rows = [row("gemm", 2e-3), row("elementwise", 1e-4), row("all_reduce", 1e-3),
            row("all_gather", 5e-4), row("free", 0.0)]
    step = sum(r.measured for r in rows) + DISPATCH * 4
    if progress:
        progress("in-step train/megatron")
    return [ProgramProfile("train", "megatron", rows, step,
                           {"all_reduce": 1e-4, "all_gather": 1e-4})]


@pytest.fixture
def synthetic(monkeypatch):
    monkeypatch.setattr(calibration, "measure_compute", fake_compute)
    monkeypatch.setattr(calibration, "measure_collectives", fake_collectives)
    monkeypatch.setattr(calibration, "measure_overheads", fake_overheads)
    monkeypatch.setattr(calibration, "profile_programs", fake_profiles)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quick", [False, True])
def test_the_cases_cover_every_class_the_cost_model_prices(dtype, quick):
    """The classes are the cost model's own (cost.compute.op_class), each with at least three
    shapes for its three-coefficient fit."""
    classes = [c.op_class for c in compute_cases(dtype, quick=quick)]
    assert set(classes) == set(COMPUTE_CLASSES)
    assert min(classes.count(c) for c in COMPUTE_CLASSES) >= 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quick", [False, True])
def test_skinny_matmuls_are_timed_on_weights_no_cache_holds(dtype, quick):
    """A decode step streams its weights from memory: every gemm_skinny case's weight is
    larger than the cache, and its calls take turns over copies of it."""
    skinny = [c for c in compute_cases(dtype, quick=quick) if c.op_class == "gemm_skinny"]
    assert len(skinny) >= 3
    for case in skinny:
        assert case.operands[0].shape[0] <= 16
        assert case.operands[1].nbytes in SKINNY_WEIGHT_BYTES
        assert case.operands[1].nbytes >= CACHE_BYTES, case
        assert rotations(case) >= 2
    # M = 1 on weights of different sizes: the bytes term is not the per-call overhead
    assert len({c.operands[1].nbytes for c in skinny if c.operands[0].shape[0] == 1}) >= 2
    small = [c for c in compute_cases(dtype, quick=quick) if c.op_class == "elementwise"]
    assert [rotations(c) for c in small] == [1] * len(small)


def test_the_overhead_is_a_tiny_call_of_each_class_through_the_interpreter():
    assert sorted(c.op_class for c in overhead_cases()) == sorted(COMPUTE_CLASSES)
    assert all(t.numel <= 17 for c in overhead_cases() for t in c.operands)
    measured = measure_overheads(torch.float32, nodes=4, repeats=3)
    assert set(measured) == set(COMPUTE_CLASSES)
    assert all(0 < s < 0.1 for s in measured.values())


def test_the_overhead_is_the_measured_per_call_time(monkeypatch):
    """Times whose per-call part the shapes cannot show (here: none in them) fit 0 s per call;
    the per-call time measured on tiny calls is the class's overhead, and the file says so."""
    tiny_call = 25e-6
    monkeypatch.setattr(calibration, "measure_compute", lambda cases, device="cpu", **kw: [
        dataclasses.replace(s, seconds=s.seconds - OVERHEAD) for s in fake_compute(cases)])
    monkeypatch.setattr(calibration, "measure_collectives", fake_collectives)
    monkeypatch.setattr(calibration, "measure_overheads",
                        lambda dtype=torch.float32, device="cpu": {"gemm": tiny_call})
    cal = calibration.calibrate(2, quick=True, in_step=False)
    assert cal.cluster.compute_rate("fp32", "gemm").overhead == tiny_call
    assert cal.cluster.compute_rate("fp32", "gemm_skinny").overhead == pytest.approx(0, abs=1e-9)
    assert {"dtype": "fp32", "class": "gemm", "seconds": tiny_call} in \
        calibration.timings(cal)["overheads_s"]


def test_the_cluster_carries_the_fitted_numbers(synthetic):
    cal = calibration.calibrate(4, quick=True, in_step=False)
    cluster = cal.cluster
    for dtype in ("fp32", "fp16", "bf16"):
        for op_class in COMPUTE_CLASSES:
            rate = cluster.compute_rate(dtype, op_class)
            assert rate.bandwidth == pytest.approx(BANDWIDTH, rel=1e-6), (dtype, op_class)
            assert rate.overhead == pytest.approx(OVERHEAD, rel=1e-6), (dtype, op_class)
            if op_class in ("gemm", "gemm_skinny", "attention"):
                assert rate.flops == pytest.approx(RATE, rel=1e-6), (dtype, op_class)
        assert cluster.peak_flops(dtype) == pytest.approx(RATE, rel=1e-6)
    for kind, latency in LATENCY.items():
        rate = cluster.collective_rate(kind)
        assert (rate.latency, rate.bandwidth) == (pytest.approx(latency),
                                                  pytest.approx(LINK))
    # every kind's alpha differs, so one link fits them only roughly; its bandwidth is exact
    assert cluster.intra_node_bandwidth == pytest.approx(LINK, rel=0.05)
    assert cluster.name == "cpu-measured" and "graphpar calibrate --ranks 4" in cluster.source
    # classes no shape bound by arithmetic say what they took instead
    assert any("elementwise: no shape was bound by arithmetic; flops is the gemm's" in n
               for n in cal.notes)


def test_the_in_step_factors_divide_the_rates(synthetic):
    """Each class's rates are divided by its in-step factor and its overhead multiplied, with
    the dispatch added; a class or kind the programs did not run takes the median factor and
    the notes say so; the loop-fitted cluster is kept beside."""
    cal = calibration.calibrate(2, quick=True)
    loop, cluster = cal.loop_cluster, cal.cluster
    assert cal.in_step.factors == pytest.approx(IN_STEP)
    assert cal.in_step.dispatch == pytest.approx(DISPATCH)
    median_class = float(np.median([1.5, 3.0]))
    for dtype in ("fp32", "bf16"):
        for op_class in COMPUTE_CLASSES:
            f = IN_STEP.get(op_class, median_class)
            before, after = loop.compute_rate(dtype, op_class), cluster.compute_rate(dtype,
                                                                                     op_class)
            assert after.flops == pytest.approx(before.flops / f)
            assert after.bandwidth == pytest.approx(before.bandwidth / f)
            assert after.overhead == pytest.approx(before.overhead * f + DISPATCH)
    for kind in LATENCY:
        f = IN_STEP.get(kind, 3.0)  # the median of all_reduce's 2 and all_gather's 4
        before, after = loop.collective_rate(kind), cluster.collective_rate(kind)
        assert (after.latency, after.bandwidth) == (pytest.approx(before.latency * f),
                                                    pytest.approx(before.bandwidth / f))
    assert cluster.intra_node_bandwidth == pytest.approx(loop.intra_node_bandwidth / 3.0)
    assert any("no gemm_skinny, normalization, attention, gather op ran" in n
               for n in cal.notes)
    assert any("no all_to_all, reduce_scatter, send_recv ran" in n for n in cal.notes)
    # one node of a kind cannot split latency from bandwidth: both take its factor
    assert cal.in_step.collectives == {"all_gather": (4.0, 4.0), "all_reduce": (2.0, 2.0)}
    text = calibration.report(cal)
    assert "in step (1 calibration programs on 2 ranks" in text
    assert "train/megatron" in text
    assert calibration.timings(cal)["in_step"]["factors"] == pytest.approx(IN_STEP)


def test_calibrate_writes_a_cluster_file_the_compiler_takes(synthetic, tmp_path, capsys):
    out = tmp_path / "cluster.json"
    code, stdout, _ = run(capsys, "calibrate", "--ranks", 2, "--out", out, "--quick")
    assert code == 0
    assert "residual over sizes" in stdout and "all_reduce" in stdout
    assert f"wrote {out}" in stdout
    timings = json.loads((tmp_path / "cluster.timings.json").read_text())
    assert timings["ranks"] == 2 and timings["collectives"][0]["seconds"] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ClusterFallbackWarning)  # every class is in the file
        cluster = load_cluster(out)
    assert cluster.collective_rate("all_gather").latency == pytest.approx(80e-6 * 4)
    code, stdout, _ = run(capsys, "compile", "--example", "mlp:tiny", "--mesh", 2,
                          "--cluster", out, "--out", tmp_path / "c", "--time-limit", 10)
    assert code == 0 and "mesh 2 on cpu-measured" in stdout
    assert get_cluster(str(out)) == cluster


def test_more_ranks_than_cores_warns(synthetic, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    code, _, err = run(capsys, "calibrate", "--ranks", 4, "--out", tmp_path / "c.json",
                       "--quick")
    assert code == 0
    assert ("graphpar: warning: 4 ranks x 1 thread(s) on 2 CPU cores: the ranks contend for "
            "cores, which will distort the fit") in err
    code, _, err = run(capsys, "calibrate", "--ranks", 2, "--out", tmp_path / "c.json",
                       "--quick")
    assert code == 0 and "warning" not in err


@pytest.mark.parametrize("argv, says", [
    (["--ranks", "1"], "--ranks 1: collectives need at least 2 ranks"),
    (["--base", "dgx-z"], "--base 'dgx-z': not a preset"),
])
def test_bad_options(synthetic, tmp_path, capsys, argv, says):
    code, _, err = run(capsys, "calibrate", "--out", tmp_path / "c.json", *argv)
    assert code == 2 and says in err and not (tmp_path / "c.json").exists()


def test_an_interrupted_calibration_leaves_the_old_file_whole(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cluster.json"
    out.write_text("{}\n")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(calibration, "measure_compute", fake_compute)
    monkeypatch.setattr(calibration, "measure_collectives", interrupted)
    code, _, err = run(capsys, "calibrate", "--out", out, "--quick")
    assert code == 130 and "interrupted" in err
    assert out.read_text() == "{}\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "cluster.json"]


@pytest.mark.slow
def test_a_real_calibration_on_two_ranks(monkeypatch, tmp_path, capsys):
    """Real measurements, few of them (about 30 s on a loaded 2-core machine): the shapes and
    sizes are what was asked, every number the fit gives is a positive time or rate, and the
    GPT example compiles on the cluster file."""
    from graphpar.runtime import calibrate as measure

    monkeypatch.setattr(measure, "compute_cases",
                        lambda dtype=torch.float32, quick=False: [
                            c for c in compute_cases(dtype, quick=True)
                            if c.op_class in ("gemm", "elementwise")][:4])
    # sizes far enough apart that bytes, not gloo's wake-up jitter (up to ~1 ms on 2 cores
    # for any small message), set the larger one's time: the fit needs a time that grows
    sizes = [256, 4 << 20]
    monkeypatch.setattr(measure, "collective_sizes", lambda quick=False: sizes)
    monkeypatch.setattr(calibration, "compute_cases", measure.compute_cases)
    monkeypatch.setattr(calibration, "collective_sizes", measure.collective_sizes)
    seen = []
    cal = calibration.calibrate(2, quick=True, progress=seen.append)
    assert len(seen) == calibration.planned_measurements(quick=True)
    assert {(s.kind, s.ranks, s.nbytes) for s in cal.collective_samples} == {
        (k, 2, m) for k in MEASURED_COLLECTIVES for m in sizes}
    assert all(s.seconds > 0 for s in cal.collective_samples + cal.compute_samples)
    gemm = [s for s in cal.compute_samples if s.case.op_class == "gemm"]
    m, k = gemm[0].case.operands[0].shape
    assert gemm[0].flops == 2 * m * k * gemm[0].case.operands[1].shape[1]
    assert cal.cluster.intra_node_bandwidth > 0 and cal.cluster.intra_node_latency >= 0
    # the calibration programs ran: every node was timed, their factors divide the rates
    assert [p.name for p in cal.profiles] == ["train/megatron", "train-small/data",
                                              "decode/megatron"]
    assert all(r.measured > 0 for p in cal.profiles for r in p.rows)
    # the small program's results are a fraction of the large one's bytes (36x narrower)
    assert cal.profiles[1].result_bytes < cal.profiles[0].result_bytes / 4
    assert cal.cluster.seconds_per_result_byte == cal.in_step.dispatch_per_byte >= 0
    assert cal.in_step.factors["gemm"] > 0 and cal.cluster.compute_rate(
        "fp32", "gemm").flops == pytest.approx(cal.loop_cluster.compute_rate("fp32", "gemm").flops
                                               / cal.in_step.factors["gemm"])
    out = tmp_path / "cluster.json"
    out.write_text(json.dumps(cal.cluster.to_dict()))
    code, stdout, _ = run(capsys, "compile", "--example", "gpt:tiny", "--mesh", 2,
                          "--cluster", out, "--out", tmp_path / "c", "--time-limit", 10)
    assert code == 0 and "mesh 2 on cpu-measured" in stdout


def test_the_progress_bar_draws_on_a_terminal_only(capsys, monkeypatch):
    from graphpar.cli.common import ProgressBar

    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    bar = ProgressBar(4, "calibrating", width=8)
    bar.advance("matmul")
    bar.advance("add")
    bar.close()
    err = capsys.readouterr().err
    assert "\rcalibrating [##------] 1/4" in err and "matmul" in err
    assert "\rcalibrating [####----] 2/4" in err and err.endswith("\n")
    quiet = ProgressBar(4, "calibrating", enabled=False)
    quiet.advance("matmul")
    quiet.close()
    assert capsys.readouterr().err == "" and quiet.done == 1
