"""`graphpar.place(...)`: a SPEC to placements per policy, their simulated SLO attainment,
sweeps for the plots, and the files `placement.json` and `placement.html`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from graphpar.errors import PlacementError
from graphpar.placement.configs import (
    LayerProfile,
    example_weight_bytes,
    profile_example,
    profile_file,
    weight_bytes,
)
from graphpar.placement.place import Placement, Problem
from graphpar.placement.place import place as place_problem
from graphpar.placement.spec import PlaceSpec, parse_spec, read_spec
from graphpar.placement.workload import (
    Workload,
    fit_windows,
    gamma_workload,
    load_trace,
    maf_like,
    resample,
)


@dataclass
class PlaceReport:
    """Per policy its placement; the problem it solved; sweeps: {axis: {"x": [...],
    policy: [attainment, ...]}} for the plots."""

    spec: PlaceSpec
    problem: Problem
    placements: dict[str, Placement]
    sweeps: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"devices": self.problem.devices,
                "memory_per_device_bytes": self.problem.memory,
                "models": {m: {"latency_s_est": p.latency, "weight_bytes": p.weights,
                               "slo_s": self.problem.slo[m], "pricing": p.pricing}
                           for m, p in self.problem.profiles.items()},
                "requests": len(self.problem.workload),
                "policies": {k: v.to_json() for k, v in self.placements.items()},
                "sweeps": self.sweeps}

    def text(self) -> str:
        lines = [f"{self.problem.devices} devices, {self.problem.memory / 1e9:.1f} GB each "
                 f"for weights; {len(self.problem.workload)} requests over "
                 f"{self.problem.workload.duration:.0f} s (simulated)"]
        for m, p in self.problem.profiles.items():
            lines.append(f"  model {m}: {p.latency * 1e3:.3g} ms on one device (est.), "
                         f"{p.weights / 1e9:.2f} GB, SLO {self.problem.slo[m] * 1e3:.3g} ms")
            if p.pricing != "ilp":  # the Megatron-style fallback: say why
                lines.append(f"    its parallel configurations are an {p.pricing}")
        for name, plc in self.placements.items():
            lines.append(f"{name}: SLO attainment {plc.attainment * 100:.2f} % "
                         f"(search {plc.search_seconds:.2f} s CPU)")
            for g in plc.groups:
                if g.models:
                    lines.append(f"  devices {g.devices[0]}-{g.devices[-1]}: {g.stages} "
                                 f"stage(s) x {g.intra} intra-op: {', '.join(g.models)}")
            idle = sum(len(g.devices) for g in plc.groups if not g.models)
            if idle:
                lines.append(f"  {idle} device(s) idle: the models above already meet the "
                             f"SLO as well as any addition would")
            if plc.windows:
                lines.append(f"  (re-placed in {len(plc.windows)} windows; first shown)")
            per = ", ".join(f"{m} {a * 100:.1f} %" for m, a in plc.per_model.items())
            lines.append(f"  per model: {per}")
        return "\n".join(lines)


def _profiles(spec: PlaceSpec) -> dict[str, LayerProfile]:
    from graphpar.cost.cluster import get_cluster
    from graphpar.errors import GraphparError, PlacementSpecError
    from graphpar.placement.place import group_sizes

    memory = spec.memory_per_device or float(get_cluster(spec.preset).device_memory)
    most = max(group_sizes(spec.devices))
    out = {}
    for i, m in enumerate(spec.models):
        def fits(weights: float, i=i, m=m) -> None:  # before the model is captured and priced
            if weights / most > memory:
                raise PlacementError(
                    f"models[{i}] ({m.name}): {weights / 1e9:.2f} GB of weights "
                    f"({spec.dtype}) fit no device group: the largest, {most} device(s) of "
                    f"{memory / 1e9:.2f} GB, holds {most * memory / 1e9:.2f} GB; give more "
                    "cluster.devices or cluster.memory_per_device")
        try:
            if m.example is not None:
                fits(example_weight_bytes(m.example, spec.dtype))
                out[m.name] = profile_example(m.example, spec.dtype, spec.preset)
            else:
                out[m.name] = profile_file(m.path, spec.dtype, spec.preset, check=lambda mod:
                                           fits(weight_bytes(mod, spec.dtype)))
        except PlacementError:
            raise
        except GraphparError as exc:
            what = f"example {m.example!r}" if m.example else f"path {m.path}"
            raise PlacementSpecError(f"models[{i}] ({m.name}, {what}): {exc}") from None
    return out


def _workload(spec: PlaceSpec, names: list[str], **over: Any) -> Workload:
    if spec.trace is not None:
        return load_trace(spec.trace, names)
    s = dataclasses.replace(spec, **over)
    if s.arrival in ("maf1", "maf2"):
        fitted = fit_windows(maf_like(s.arrival, names, s.total_rate, s.duration, s.window,
                                      s.seed), s.window)
        # the sweeps scale the fitted trace's rate and CV, as the paper does
        return resample(fitted, names, s.total_rate / spec.total_rate, s.cv / spec.cv, s.seed)
    return gamma_workload(names, s.total_rate, s.cv, s.duration, s.power_law, s.seed)


def problem_of(spec: PlaceSpec, profiles: Mapping[str, LayerProfile] | None = None,
               **over: Any) -> Problem:
    """The placement problem of `spec` (fields overridden by `over`, for sweeps)."""
    from graphpar.cost.cluster import get_cluster

    s = dataclasses.replace(spec, **over)
    profiles = dict(profiles or _profiles(s))
    names = list(profiles)
    memory = s.memory_per_device or float(get_cluster(s.preset).device_memory)
    slo = {m: (s.slo_seconds if s.slo_seconds is not None else s.slo_scale * p.latency)
           for m, p in profiles.items()}
    workload = _workload(s, names)
    if s.trace is not None:  # a generated workload's were checked with the SPEC
        _check_trace_span(s, workload)
    return Problem(profiles, s.devices, memory, workload, slo, s.preset, s.warmup,
                   s.max_batch, s.batch_growth)


def _check_trace_span(spec: PlaceSpec, workload: Workload) -> None:
    """The warm-up and the clockwork++ windows of a trace, once its span is known."""
    from graphpar.errors import PlacementSpecError
    from graphpar.placement.spec import MAX_WINDOWS

    if spec.warmup >= workload.duration:
        raise PlacementSpecError(
            f"workload.warmup: {spec.warmup:g} s is not shorter than the trace "
            f"{spec.trace} ({workload.duration:g} s): no request would be counted; give a "
            "shorter warmup")
    windows = int(np.ceil(workload.duration / spec.window))
    if "clockwork++" in spec.policies and windows > MAX_WINDOWS:
        raise PlacementSpecError(
            f"workload.window: {spec.window:g} s cuts the trace's {workload.duration:g} s "
            f"into {windows:,} windows, more than {MAX_WINDOWS:,} (each re-placed); give a "
            "longer window")


def _sweeps(spec: PlaceSpec, profiles, policies) -> dict[str, dict[str, list[float]]]:
    """Attainment against rate, CV, SLO scale and devices, each varied around the SPEC's."""
    n = spec.plot_points
    axes: dict[str, list] = {}
    if spec.trace is None:
        axes["total_rate"] = list(np.round(spec.total_rate * np.linspace(0.5, 2.0, n), 3))
        axes["cv"] = list(np.round(np.linspace(1.0, max(2 * spec.cv, 4.0), n), 3))
    if spec.slo_seconds is None:
        axes["slo_scale"] = list(np.round(np.linspace(1.0, 2 * spec.slo_scale, n), 3))
    axes["devices"] = sorted({max(1, round(spec.devices * f)) for f in
                              np.linspace(0.25, 1.0, n)})
    out = {}
    for axis, xs in axes.items():
        out[axis] = {"x": [float(x) for x in xs]}
        for policy in policies:
            ys = []
            for x in xs:
                over = {axis: int(x) if axis == "devices" else float(x)}
                try:
                    ys.append(place_problem(problem_of(spec, profiles, **over), policy,
                                            window=spec.window).attainment)
                except PlacementError:  # an infeasible point (too few devices): none served
                    ys.append(0.0)
            out[axis][policy] = ys
    return out


def place(spec: PlaceSpec | Mapping | str | Path, out: str | Path | None = None,
          echo: bool = False) -> PlaceReport:
    """Run every policy of `spec` (a SPEC file, its data, or a PlaceSpec); with `out`, write
    OUT/placement.json and OUT/placement.html."""
    if isinstance(spec, (str, Path)):
        spec = read_spec(spec)
    elif isinstance(spec, Mapping):
        spec = parse_spec(spec)
    if spec.trace is not None:  # a bad trace is found before any model is captured
        load_trace(spec.trace, [m.name for m in spec.models])
    profiles = _profiles(spec)
    problem = problem_of(spec, profiles)
    placements = {p: place_problem(problem, p, window=spec.window) for p in spec.policies}
    report = PlaceReport(spec, problem, placements)
    if echo:
        print(report.text(), flush=True)
    if spec.plots:
        report.sweeps = _sweeps(spec, profiles, spec.policies)
    if out is not None:
        from graphpar.placement.report import html

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        data = report.to_json()
        _write_whole(out / "placement.json", json.dumps(data, indent=1) + "\n")
        _write_whole(out / "placement.html", html(data))
    return report


def _write_whole(path: Path, text: str) -> None:
    """`text` written beside `path` and renamed over it: the file is whole or absent."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
