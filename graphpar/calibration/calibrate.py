"""`graphpar calibrate`'s work: measure this machine, fit the cost model's formulas, and make
the cluster the compiler takes (`docs/calibration.md`).

    cal = calibrate(ranks=2)            # measures (about a minute on 2 cores)
    print(report(cal))                  # the fits and their residuals
    cal.cluster                         # a Cluster; cal.cluster.to_dict() is the cluster file

Compute: every op class at fp32 (full shape list), fp16 and bf16 (the three smallest shapes of
each class: half precision on a CPU runs far slower) in this process, fitted to the roofline
(`graphpar.calibration.fit.fit_roofline`), each class's overhead the per-call time of a tiny call of
it through the interpreter (`measure_overheads`). Collectives: `ranks` worker
processes, fitted per kind to the alpha-beta formulas of `graphpar.cost.communication`, and
once over every kind together for the cluster's intra-node link (what collectives without a
measured kind, and mesh axes, use). In step (`graphpar.calibration.in_step`, CPU ranks): a few
calibration programs run on the ranks with every node timed, priced by the cluster fitted so
far; each op class's and collective kind's measured / predicted ratio divides its rates, and
the time between priced nodes is added to every class's per-call overhead
(`with_in_step`; `in_step=False` keeps the loop fit alone).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from graphpar.calibration.fit import (
    AlphaBetaFit,
    InStepFit,
    RooflineFit,
    fit_alpha_beta,
    fit_in_step,
    fit_roofline,
)
from graphpar.calibration.in_step import PROGRAMS, QUICK_PROGRAMS, ProgramProfile, profile_programs
from graphpar.calibration.measure import (
    MEASURED_COLLECTIVES,
    CollectiveSample,
    ComputeSample,
    collective_sizes,
    compute_cases,
    measure_collectives,
    measure_compute,
    measure_overheads,
)
from graphpar.cost.cluster import PRESETS, Cluster
from graphpar.errors import UsageError
from graphpar.ir.cluster import COLLECTIVE_KINDS, COMPUTE_CLASSES, normalize_dtype
from graphpar.runtime.workers import worker_threads
from graphpar.units import format_bandwidth, format_bytes, format_flops, format_seconds

__all__ = ["Calibration", "calibrate", "report", "timings", "with_in_step"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Calibration:
    """What one calibration measured and fitted, and the cluster made of it."""

    cluster: Cluster
    ranks: int
    compute_samples: list[ComputeSample]
    compute_fits: dict[tuple[str, str], RooflineFit]  # (dtype, class) -> fit
    collective_samples: list[CollectiveSample]
    collective_fits: dict[str, AlphaBetaFit]
    link: AlphaBetaFit  # every kind together: the intra-node link
    notes: list[str] = field(default_factory=list)  # which numbers are not their own fit's
    seconds: float = 0.0  # measured, wall clock
    compute_seconds: float = 0.0  # of which timing ops (wall clock)
    load_average: float = 0.0  # this machine's 1-minute load when it started
    # (dtype, class) -> seconds per node of a tiny call through the interpreter: the class's
    # overhead
    overheads: dict[tuple[str, str], float] = field(default_factory=dict)
    # in step: the calibration programs, their fit, and the cluster before it was applied
    profiles: list[ProgramProfile] = field(default_factory=list)
    in_step: InStepFit | None = None
    loop_cluster: Cluster | None = None
    in_step_seconds: float = 0.0  # measured, wall clock


def cpu_model() -> str:
    """This machine's CPU model name ("AMD EPYC 7B13"), or the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cluster_file_for(ranks: int, default: str | Path) -> str:
    """The calibration a mesh of `ranks` processes is priced on: `default`'s sibling
    `<stem>.<ranks>ranks.json` where `graphpar calibrate --ranks <ranks>` wrote one (that many
    processes sharing this machine's cores is another machine than `default`'s ranks), else
    `default`."""
    default = Path(default)
    own = default.with_name(f"{default.stem}.{ranks}ranks.json")
    return str(own if own.exists() else default)


def calibrate(ranks: int, *, base: str = "cpu", quick: bool = False, device: str = "cpu",
              in_step: bool = True, progress: Callable[[str], None] | None = None
              ) -> Calibration:
    """Measure this machine as a cluster of `ranks`-rank groups (see the module docstring)."""
    if ranks < 2:
        raise UsageError(f"calibrating collectives needs at least 2 ranks, got {ranks}")
    if base not in PRESETS:
        raise UsageError(f"unknown base preset {base!r}; presets: {', '.join(PRESETS)}")
    start, load = time.perf_counter(), os.getloadavg()[0]
    cases = [c for dtype in DTYPES
             for c in compute_cases(dtype, quick=quick or dtype != torch.float32)]
    compute = measure_compute(cases, device, budget_s=0.04 if quick else 0.1,
                              progress=progress)
    overheads = {}
    for dtype in DTYPES:
        for op_class, seconds in measure_overheads(dtype, device).items():
            overheads[normalize_dtype(dtype), op_class] = seconds
        if progress:
            progress(f"per-call overhead {normalize_dtype(dtype)}")
    compute_seconds = time.perf_counter() - start
    collectives = measure_collectives(ranks, collective_sizes(quick), device=device,
                                      quick=quick, progress=progress)
    cal = fit(compute, collectives, ranks, PRESETS[base], device, overheads)
    if in_step and device == "cpu":
        step_start = time.perf_counter()
        cal.profiles = profile_programs(cal.cluster, ranks, quick=quick, progress=progress)
        cal.in_step = fit_in_step([(p.samples(), p.step_seconds, p.result_bytes)
                                   for p in cal.profiles])
        cal.loop_cluster = cal.cluster
        cal.cluster, notes = with_in_step(cal.cluster, cal.in_step)
        cal.notes += notes
        cal.in_step_seconds = time.perf_counter() - step_start
    elif in_step:
        cal.notes.append("in step: not measured on GPUs yet (the calibration programs run on "
                         "gloo CPU ranks); the rates are the loop fit's")
    cal.seconds, cal.load_average = time.perf_counter() - start, load
    cal.compute_seconds = compute_seconds
    return cal


def planned_measurements(quick: bool = False, in_step: bool = True) -> int:
    """How many measurements `calibrate` makes (the progress bar's length)."""
    cases = sum(len(compute_cases(d, quick=quick or d != torch.float32)) for d in DTYPES)
    programs = len(QUICK_PROGRAMS if quick else PROGRAMS) if in_step else 0
    return (cases + len(DTYPES) + len(MEASURED_COLLECTIVES) * len(collective_sizes(quick))
            + programs)


def with_in_step(cluster: Cluster, in_step: InStepFit) -> tuple[Cluster, list[str]]:
    """`cluster` with the in-step fit folded in: every class's FLOP/s and bytes/s divided by
    its factor, its overhead multiplied by it and the dispatch time per node added, the
    dispatch per result byte as the cluster's `seconds_per_result_byte`; every collective
    kind's latency multiplied by its latency factor and bandwidth divided by its bandwidth
    factor, and the link's by the medians of them. A class or kind the programs did not run
    takes the median of the others' (said in the notes)."""
    notes = []
    factors = in_step.factors

    def default(names: Sequence[str]) -> float:
        seen = [factors[n] for n in names if n in factors]
        return float(np.median(seen)) if seen else 1.0

    compute_default = default(COMPUTE_CLASSES)
    comm_default = default(COLLECTIVE_KINDS)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for dtype, classes in cluster.compute_table().items():
        for op_class, rate in classes.items():
            f = factors.get(op_class, compute_default)
            table.setdefault(dtype, {})[op_class] = {
                "flops": rate["flops"] / f, "bandwidth": rate["bandwidth"] / f,
                "overhead": rate["overhead"] * f + in_step.dispatch}
    missing = [c for c in COMPUTE_CLASSES if c not in factors]
    if missing:
        notes.append(f"in step: no {', '.join(missing)} op ran in the calibration programs; "
                     f"scaled by the other classes' median factor {compute_default:.2f}")
    seen = list(in_step.collectives.values())
    default_pair = ((float(np.median([a for a, _ in seen])), float(np.median([b for _, b in seen])))
                    if seen else (comm_default, comm_default))
    collectives = {}
    for kind, rate in cluster.to_dict().get("collectives", {}).items():
        a, b = in_step.collectives.get(kind, default_pair)
        collectives[kind] = {"latency": rate["latency"] * a, "bandwidth": rate["bandwidth"] / b}
    missing = [k for k in collectives if k not in in_step.collectives]
    if missing:
        notes.append(f"in step: no {', '.join(missing)} ran in the calibration programs; "
                     f"latency x{default_pair[0]:.2f}, bandwidth /{default_pair[1]:.2f} (the "
                     "other kinds' medians)")
    link_latency, link_bandwidth = (cluster.intra_node_latency * default_pair[0],
                                    cluster.intra_node_bandwidth / default_pair[1])
    fp32 = table.get("fp32", {}).get("gemm", {})
    return dataclasses.replace(
        cluster, compute=table, collectives=collectives,
        seconds_per_result_byte=in_step.dispatch_per_byte,
        intra_node_latency=link_latency, intra_node_bandwidth=link_bandwidth,
        inter_node_latency=max(cluster.inter_node_latency, link_latency),
        inter_node_bandwidth=min(cluster.inter_node_bandwidth, link_bandwidth),
        peak_flops_fp32=fp32.get("flops", cluster.peak_flops_fp32),
        source=cluster.source + (" Rates divided by the in-step factors of the calibration "
                                 "programs (docs/calibration.md).")), notes


def fit(compute: Sequence[ComputeSample], collectives: Sequence[CollectiveSample], ranks: int,
        base: Cluster, device: str = "cpu",
        overheads: Mapping[tuple[str, str], float] | None = None) -> Calibration:
    """The fits of these measurements and the cluster made of them (`base` gives the rest).
    `overheads`: (dtype, class) -> the per-call time measured on tiny calls, that class's
    overhead (the rates are fitted to the rest of each time); a class without one fits it."""
    overheads = dict(overheads or {})
    notes: list[str] = []
    compute_fits = {}
    for dtype in DTYPES:
        name = normalize_dtype(dtype)
        for op_class in COMPUTE_CLASSES:
            samples = [(s.flops, s.nbytes, s.seconds) for s in compute
                       if s.case.op_class == op_class and s.case.dtype == dtype]
            if len(samples) >= 2:
                compute_fits[name, op_class] = fit_roofline(
                    samples, overhead=overheads.get((name, op_class)))
    collective_fits = {kind: fit_alpha_beta(rows) for kind in MEASURED_COLLECTIVES
                       if len(rows := [(s.kind, s.ranks, s.nbytes, s.seconds)
                                       for s in collectives if s.kind == kind]) >= 2}
    link = fit_alpha_beta([(s.kind, s.ranks, s.nbytes, s.seconds) for s in collectives])
    if link.bandwidth is None:
        raise UsageError("the collectives' times do not grow with their size: no bandwidth to "
                         "fit (is another job flooding this machine?); run calibrate again")

    table: dict[str, dict[str, dict[str, float]]] = {}
    peaks = {}
    for (dtype, op_class), f in compute_fits.items():
        flops, bandwidth = f.flops, f.bandwidth
        if flops is None:  # no shape bound by arithmetic: the gemm's rate bounds nothing
            gemm = compute_fits.get((dtype, "gemm"))
            if gemm and gemm.flops:
                flops, used = gemm.flops, "the gemm's"
            else:
                flops, used = base.peak_flops(dtype), f"preset {base.name!r}'s peak"
            notes.append(f"{dtype} {op_class}: no shape was bound by arithmetic; flops is "
                         f"{used}")
        if bandwidth is None:  # no shape bound by memory: the streaming (elementwise) rate
            streaming = compute_fits.get((dtype, "elementwise"))
            if streaming and streaming.bandwidth:
                bandwidth, used = streaming.bandwidth, "the elementwise class's"
            else:
                bandwidth = base.compute_rate(dtype, op_class).bandwidth
                used = f"preset {base.name!r}'s"
            notes.append(f"{dtype} {op_class}: no shape was bound by memory; bandwidth is "
                         f"{used}")
        table.setdefault(dtype, {})[op_class] = {"flops": flops, "bandwidth": bandwidth,
                                                 "overhead": f.overhead}
        if op_class == "gemm":
            peaks[dtype] = flops
    collective_table = {}
    for kind, f in collective_fits.items():
        bandwidth = f.bandwidth
        if bandwidth is None:
            bandwidth = link.bandwidth
            notes.append(f"{kind}: its times do not grow with size; bandwidth is the link's")
        collective_table[kind] = {"latency": f.latency, "bandwidth": bandwidth}

    host = platform.node() or "this host"
    name = "cuda" if device.startswith("cuda") else "cpu"
    what = (torch.cuda.get_device_name() if name == "cuda"
            else f"{cpu_model()}, {os.cpu_count()} CPUs, {worker_threads()} thread(s) per rank")
    cluster = dataclasses.replace(
        base, name=f"{base.name}-measured",
        device=base.device if name == "cpu" else what,
        intra_node_latency=link.latency, intra_node_bandwidth=link.bandwidth,
        inter_node_latency=max(base.inter_node_latency, link.latency),
        inter_node_bandwidth=min(base.inter_node_bandwidth, link.bandwidth),
        peak_flops_fp32=peaks.get("fp32", base.peak_flops_fp32),
        peak_flops_fp16=peaks.get("fp16", base.peak_flops_fp16),
        peak_flops_bf16=peaks.get("bf16", base.peak_flops_bf16),
        compute=table, collectives=collective_table,
        source=(f"Measured by `graphpar calibrate --ranks {ranks}` on {host} ({what}): ops per "
                f"class fitted to the roofline, {'NCCL' if name == 'cuda' else 'gloo'} "
                f"collectives on {ranks} processes fitted to alpha-beta per kind, the "
                "intra-node link fitted to every kind at once, peak FLOP/s the gemm's. "
                f"Inter-node: preset {base.name!r}'s, never better than intra-node."))
    return Calibration(cluster, ranks, list(compute), compute_fits, list(collectives),
                       collective_fits, link, notes, overheads=overheads)


def _residuals(residuals: Sequence[float]) -> str:
    r = np.abs(np.asarray(residuals))
    return f"worst {100 * r.max():5.1f}%  median {100 * float(np.median(r)):5.1f}%"


def report(cal: Calibration) -> str:
    """The fits as tables a person reads: achieved rates per class, alpha-beta per kind, and
    each fit's relative error over its samples (|model - measured| / measured)."""
    lines = ["compute (ops timed alone, fitted to max(FLOPs / F, bytes / B) + overhead; the "
             "overhead is a tiny call's; the file's rates are these scaled in step, below):",
             f"  {'dtype':5} {'class':13} {'F FLOP/s':>11} {'B bytes/s':>11} {'overhead':>9}"
             "  residual over shapes"]
    loop = cal.loop_cluster or cal.cluster  # the fits' own numbers, before the in-step factors
    for dtype, classes in loop.compute_table().items():
        for op_class, rate in classes.items():
            f = cal.compute_fits[dtype, op_class]
            flags = ("" if f.flops else " (F: not bound)") + ("" if f.bandwidth else
                                                              " (B: not bound)")
            lines.append(f"  {dtype:5} {op_class:13} {format_flops(rate['flops']):>11} "
                         f"{format_bandwidth(rate['bandwidth']):>11} "
                         f"{format_seconds(rate['overhead']):>9}  "
                         f"{_residuals(f.residuals)}{flags}")
    lines += ["", f"collectives over {cal.ranks} ranks (measured, fitted to steps(n) * latency "
                  "+ factor(n) * bytes / bandwidth):",
              f"  {'kind':15} {'latency':>9} {'bandwidth':>11}  residual over sizes"]
    for kind, rate in loop.to_dict().get("collectives", {}).items():
        lines.append(f"  {kind:15} {format_seconds(rate['latency']):>9} "
                     f"{format_bandwidth(rate['bandwidth']):>11}  "
                     f"{_residuals(cal.collective_fits[kind].residuals)}")
    lines.append(f"  {'link (all)':15} {format_seconds(cal.link.latency):>9} "
                 f"{format_bandwidth(cal.link.bandwidth or 0):>11}  "
                 f"{_residuals(cal.link.residuals)}")
    lines += ["", "collective times per size (measured; model in brackets), microseconds:",
              "  " + f"{'bytes':>10}" + "".join(f" {k:>20}" for k in cal.collective_fits)]
    by_kind = {k: [s for s in cal.collective_samples if s.kind == k]
               for k in cal.collective_fits}
    for n in sorted({s.ranks for s in cal.collective_samples}):
        lines.append(f"  n = {n}")
        for nbytes in sorted({s.nbytes for s in cal.collective_samples if s.ranks == n}):
            cells = []
            for kind, samples in by_kind.items():
                f = cal.collective_fits[kind]
                hit = [(s, r) for s, r in zip(samples, f.residuals)
                       if s.ranks == n and s.nbytes == nbytes]
                if hit:
                    sample, residual = hit[0]
                    measured = 1e6 * sample.seconds
                    cells.append(f"{measured:9.0f} [{measured * (1 + residual):8.0f}]")
                else:
                    cells.append("-")
            lines.append(f"  {format_bytes(nbytes, binary=True):>10}" + "".join(
                f" {c:>20}" for c in cells))
    if cal.in_step is not None:
        lines += ["", in_step_report(cal)]
    if cal.notes:
        lines += ["", "notes:"] + [f"  {n}" for n in cal.notes]
    return "\n".join(lines)


def in_step_report(cal: Calibration) -> str:
    """The in-step factors (nodes, loop-fitted prediction, measured, ratio per class and kind)
    and each calibration program's step, estimated before and after against measured."""
    fit = cal.in_step
    assert fit is not None
    lines = [f"in step ({len(cal.profiles)} calibration programs on {cal.ranks} ranks, every "
             "node timed; measured / loop-fitted estimate):",
             f"  {'class or kind':15} {'nodes':>6} {'estimated':>10} {'measured':>10} "
             f"{'factor':>7}"]
    for kind, (nodes, predicted, measured) in sorted(fit.totals.items(),
                                                     key=lambda kv: -kv[1][2]):
        pair = fit.collectives.get(kind)
        split = f"  latency x{pair[0]:.2f}, bandwidth /{pair[1]:.2f}" if pair else ""
        lines.append(f"  {kind:15} {nodes:>6} {format_seconds(predicted):>10} "
                     f"{format_seconds(measured):>10} {fit.factors[kind]:>7.2f}{split}")
    lines.append(f"  dispatch: {format_seconds(fit.dispatch)} per priced node + "
                 f"{format_seconds(fit.dispatch_per_byte * 2**20)} per MiB of its results (the "
                 "time between nodes and in free ops; fresh memory allocated and freed)")
    lines.append(f"  {'program':18} {'estimated before':>16} {'after':>10} {'measured':>10}")
    for p, residual in zip(cal.profiles, fit.residuals):
        before = sum(r.predicted for r in p.rows)
        lines.append(f"  {p.name:18} {format_seconds(before):>16} "
                     f"{format_seconds(p.step_seconds * (1 + residual)):>10} "
                     f"{format_seconds(p.step_seconds):>10}")
    return "\n".join(lines)


def timings(cal: Calibration) -> dict:
    """Every measurement and fit, JSON-able (the `.timings.json` beside the cluster file)."""
    compute_rows = [{"class": s.case.op_class, "case": str(s.case),
                     "dtype": normalize_dtype(s.case.dtype), "flops": s.flops,
                     "bytes": s.nbytes, "seconds": s.seconds} for s in cal.compute_samples]
    for (dtype, op_class), f in cal.compute_fits.items():
        rows = [r for r in compute_rows if r["class"] == op_class and r["dtype"] == dtype]
        for r, residual in zip(rows, f.residuals):
            r["model_seconds"] = r["seconds"] * (1 + residual)
    collective_rows = [{"kind": s.kind, "ranks": s.ranks, "bytes": s.nbytes,
                        "seconds": s.seconds} for s in cal.collective_samples]
    for kind, f in cal.collective_fits.items():
        rows = [r for r in collective_rows if r["kind"] == kind]
        for r, residual in zip(rows, f.residuals):
            r["model_seconds"] = r["seconds"] * (1 + residual)
    return {
        "benchmark": "graphpar calibrate",
        "units": {"seconds": "s (measured medians)", "model_seconds": "s (the fit)",
                  "overheads_s": "s per interpreter node of a tiny call (measured)",
                  "bytes": "B", "flops": "FLOP"},
        "ranks": cal.ranks, "cpu": cpu_model(), "cpus": os.cpu_count(),
        "threads_per_rank": worker_threads(), "wall_seconds": cal.seconds,
        "compute_wall_seconds": cal.compute_seconds,
        "load_average_1min_at_start": cal.load_average, "notes": cal.notes,
        "link": {"latency_s": cal.link.latency, "bandwidth_bytes_per_s": cal.link.bandwidth},
        "compute": compute_rows, "collectives": collective_rows,
        "overheads_s": [{"dtype": d, "class": c, "seconds": v}
                              for (d, c), v in cal.overheads.items()],
        **({"in_step": {
            "factors": cal.in_step.factors, "dispatch_s": cal.in_step.dispatch,
            "dispatch_s_per_result_byte": cal.in_step.dispatch_per_byte,
            "collectives": {k: {"latency_factor": a, "bandwidth_factor": b}
                            for k, (a, b) in cal.in_step.collectives.items()},
            "wall_seconds": cal.in_step_seconds,
            "programs": [{"program": p.name, "step_seconds_measured": p.step_seconds,
                          "step_seconds_loop_estimate": sum(r.predicted for r in p.rows),
                          "result_bytes": p.result_bytes,
                          "residual_after": residual,
                          "nodes": [{"op": r.op, "kind": r.kind, "predicted_s": r.predicted,
                                     "measured_s": r.measured, "result_bytes": r.result_bytes}
                                    for r in p.rows]}
                         for p, residual in zip(cal.profiles, cal.in_step.residuals)],
            "loop_cluster": cal.loop_cluster.to_dict() if cal.loop_cluster else None,
        }} if cal.in_step is not None else {}),
    }
