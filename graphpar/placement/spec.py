"""The `graphpar place` SPEC (YAML or JSON): read, validated field by field, into a
`PlaceSpec`. Every error names the field (`workload.cv`, `models[2].example`) and what to
write instead."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphpar.datafile import read_data_file, shown
from graphpar.errors import PlacementSpecError
from graphpar.placement.place import POLICIES


@dataclass(frozen=True)
class ModelEntry:
    name: str
    example: str | None = None  # a bundled model, "gpt:1.3B"
    path: str | None = None  # a model file defining build()


@dataclass(frozen=True)
class PlaceSpec:
    """A validated SPEC. Sizes in bytes, times in seconds, rates in requests per second."""

    models: tuple[ModelEntry, ...]
    devices: int
    preset: str = "dgx-a100"
    memory_per_device: float | None = None  # None: the preset's device memory
    dtype: str = "fp16"
    arrival: str = "gamma"
    total_rate: float = 10.0
    cv: float = 1.0
    duration: float = 600.0
    power_law: float = 0.0
    seed: int = 0
    warmup: float = 10.0
    trace: str | None = None
    slo_scale: float | None = 5.0
    slo_seconds: float | None = None
    policies: tuple[str, ...] = ("alpaserve", "selective-replication")
    window: float = 60.0  # clockwork++ re-placement window
    max_batch: int = 1
    batch_growth: float = 0.5
    plots: bool = True
    plot_points: int = 4
    base: Path = field(default_factory=Path.cwd)  # relative paths are relative to the SPEC


# Every number a SPEC takes: (smallest, largest) allowed, finite. The largest keep the
# simulator and the search within minutes and the memory of a workstation; the field's path
# and these bounds are in every message.
BOUNDS = {
    "cluster.devices": (1, 1024),
    "cluster.memory_per_device": (1, 2**50),
    "workload.total_rate": (1e-6, 1e6),
    "workload.cv": (0.01, 100.0),
    "workload.duration": (1e-3, 1e7),
    "workload.seed": (0, 2**32 - 1),
    "workload.split.power_law": (0.0, 10.0),
    "workload.warmup": (0.0, 1e7),
    "workload.window": (1e-3, 1e7),
    "slo.scale": (1e-3, 1e6),
    "slo.seconds": (1e-9, 1e6),
    "batching.max_batch": (1, 1024),
    "batching.growth": (0.0, 100.0),
    "plots.points": (1, 16),
}
MAX_REQUESTS = 2_000_000  # requests one simulation replays (the search runs thousands)
MAX_REQUEST_MODELS = 20_000_000  # requests x models: the search tries each model per group
MAX_WINDOWS = 2_000  # windows of maf1/maf2 and clockwork++ (each fitted or re-placed)
BYTES_PER_REQUEST = 100  # arrival, model, finish, latency and masks, with the search's copies


def _fail(where: str, message: str) -> PlacementSpecError:
    return PlacementSpecError(f"{where}: {message}")


def _table(data: Any, where: str, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise _fail(where, f"expected a mapping with fields {', '.join(sorted(allowed))}, "
                           f"got {shown(data)}")
    unknown = sorted(set(map(str, data)) - allowed)
    if unknown:
        raise _fail(f"{where}.{' '.join(unknown[0].split())[:40]}", f"unknown field; use one of "
                                                        f"{', '.join(sorted(allowed))}")
    return data


def _number(data: Mapping, key: str, where: str, default=None, *, positive=True,
            integer=False):
    """`data[key]`, a finite number within `BOUNDS` (by the field's path without the file)
    and, when `positive`, above 0; `default` when absent (None: the field is required)."""
    if key not in data:
        if default is None:
            raise _fail(f"{where}.{key}", "missing")
        return default
    value = data[key]
    path = f".{where}.{key}"
    low, high = next((b for f, b in BOUNDS.items() if path.endswith(f".{f}")), (None, None))
    kind = int if integer else (int, float)
    want = "a positive whole number" if integer else (
        "a positive number" if positive else "a number >= 0")
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or (
            value <= 0 if positive else value < 0):
        raise _fail(f"{where}.{key}", f"expected {want}, got {shown(value)}")
    if high is not None and not low <= value <= high:
        raise _fail(f"{where}.{key}", f"{value:g} is out of range: give {want} from {low:g} "
                                      f"to {high:g}")
    return value


def _text(data: Mapping, key: str, where: str, default: str | None = None) -> str:
    """`data[key]`, a non-empty string on one line; `default` when absent (None: required)."""
    if key not in data and default is not None:
        return default
    value = data.get(key)
    if key not in data:
        raise _fail(f"{where}.{key}", "missing")
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        raise _fail(f"{where}.{key}", f"expected a name or text on one line, got "
                                      f"{shown(value)}")
    return value


def read_spec(path: str | Path, plots: bool | None = None) -> PlaceSpec:
    """Read and validate a SPEC file (.json, or .yaml/.yml with pyyaml); `plots` False: the
    sweeps are not run (`--no-plots`), so their requests are not counted."""
    path = Path(path)
    if path.is_dir():
        raise PlacementSpecError(f"{path}: is a directory, not a SPEC file")
    if not path.is_file():
        raise PlacementSpecError(f"{path}: no such SPEC file")
    data = read_data_file(path, PlacementSpecError, "SPEC file")
    try:
        return parse_spec(data, base=path.parent, plots=plots)
    except PlacementSpecError as exc:  # "spec.workload.cv: ..." as "FILE: workload.cv: ..."
        message = str(exc)
        for prefix in ("spec.", "spec: "):
            message = message.removeprefix(prefix)
        raise PlacementSpecError(f"{path}: {message}") from None


def parse_spec(data: Any, base: str | Path = ".", where: str = "spec",
               plots: bool | None = None) -> PlaceSpec:
    """Validate a SPEC given as plain data (what the YAML/JSON file holds); `plots` given
    overrides the SPEC's."""
    top = _table(data, where, {"cluster", "models", "workload", "slo", "policies", "plots",
                               "batching"})
    cluster = _table(top.get("cluster"), f"{where}.cluster",
                     {"preset", "devices", "memory_per_device", "dtype"})
    devices = _number(cluster, "devices", f"{where}.cluster", integer=True)
    preset = _text(cluster, "preset", f"{where}.cluster", "dgx-a100")
    from graphpar.cost.cluster import get_cluster
    from graphpar.errors import GraphparError
    from graphpar.units import parse_bytes

    try:
        get_cluster(preset)
    except GraphparError as exc:
        raise _fail(f"{where}.cluster.preset", str(exc)) from None
    memory = None
    if "memory_per_device" in cluster:
        given = cluster["memory_per_device"]
        try:
            if isinstance(given, bool) or not isinstance(given, (str, int, float)):
                raise ValueError(f"expected a size like \"40GB\", got {shown(given)}")
            memory = float(parse_bytes(given))
        except (ValueError, OverflowError) as exc:
            raise _fail(f"{where}.cluster.memory_per_device", shown(str(exc), 160)) from None
        memory = float(_number({"memory_per_device": memory}, "memory_per_device",
                               f"{where}.cluster"))
    dtype = _text(cluster, "dtype", f"{where}.cluster", "fp16")
    if dtype not in ("fp16", "bf16", "fp32"):
        raise _fail(f"{where}.cluster.dtype", f"{shown(dtype)}: use fp16, bf16 or fp32")

    models = top.get("models")
    if not isinstance(models, list) or not models:
        raise _fail(f"{where}.models", "expected a list of {name, example} or {name, path}")
    entries, names = [], set()
    for i, m in enumerate(models):
        at = f"{where}.models[{i}]"
        m = _table(m, at, {"name", "example", "path"})
        if "name" not in m:
            raise _fail(f"{at}.name", "missing: give each model a name")
        name = _text(m, "name", at)
        if name in names:
            raise _fail(f"{at}.name", f"{name!r} is given twice")
        names.add(name)
        if ("example" in m) == ("path" in m):
            raise _fail(at, "give exactly one of example (a bundled model, e.g. gpt:1.3B) "
                            "or path (a model file defining build())")
        if "example" in m:
            entries.append(ModelEntry(name, example=_text(m, "example", at)))
        else:
            file = Path(base) / _text(m, "path", at)
            if not file.is_file():
                raise _fail(f"{at}.path", f"{file}: no such model file")
            entries.append(ModelEntry(name, path=str(file)))

    wl = _table(top.get("workload"), f"{where}.workload",
                {"arrival", "total_rate", "cv", "duration", "split", "seed", "warmup",
                 "trace", "window"})
    extra: dict[str, Any] = {}
    at = f"{where}.workload"
    if "trace" in wl:
        trace = Path(base) / _text(wl, "trace", at)
        if not trace.is_file():
            raise _fail(f"{at}.trace", f"{trace}: no such file (a CSV with columns "
                                       f"model,arrival_s)")
        extra["trace"] = str(trace)
    else:
        arrival = _text(wl, "arrival", at, "gamma")
        if arrival not in ("gamma", "poisson", "maf1", "maf2"):
            raise _fail(f"{at}.arrival", f"{shown(arrival)}: use gamma, poisson, maf1 (steady, "
                                         f"dense) or maf2 (bursty, skewed)")
        extra.update(arrival=arrival, total_rate=float(_number(wl, "total_rate", at)),
                     cv=1.0 if arrival == "poisson" else float(_number(wl, "cv", at, 1.0)),
                     duration=float(_number(wl, "duration", at, 600.0)),
                     seed=int(_number(wl, "seed", at, 0, positive=False, integer=True)))
        split = wl.get("split", "uniform")
        if split == "uniform":
            extra["power_law"] = 0.0
        else:
            split = _table(split, f"{at}.split", {"power_law"})
            extra["power_law"] = float(_number(split, "power_law", f"{at}.split",
                                               positive=False))
    extra["warmup"] = float(_number(wl, "warmup", at, 10.0, positive=False))
    extra["window"] = float(_number(wl, "window", at, 60.0))

    slo = _table(top.get("slo", {"scale": 5}), f"{where}.slo", {"scale", "seconds"})
    if len(slo) != 1:
        raise _fail(f"{where}.slo", "give one of scale (× single-device latency) or seconds")
    scale = float(_number(slo, "scale", f"{where}.slo")) if "scale" in slo else None
    seconds = float(_number(slo, "seconds", f"{where}.slo")) if "seconds" in slo else None

    policies = top.get("policies", ["alpaserve", "selective-replication"])
    if isinstance(policies, str):
        policies = [policies]
    if not isinstance(policies, list) or not policies:
        raise _fail(f"{where}.policies", f"expected a list of {', '.join(POLICIES)}")
    for i, p in enumerate(policies):
        if not isinstance(p, str) or p not in POLICIES:
            raise _fail(f"{where}.policies[{i}]", f"unknown policy {shown(p)}: use one of "
                                                  f"{', '.join(POLICIES)}")
    batching = _table(top.get("batching", {}), f"{where}.batching",
                      {"max_batch", "growth"})
    extra["max_batch"] = int(_number(batching, "max_batch", f"{where}.batching", 1,
                                     integer=True))
    extra["batch_growth"] = float(_number(batching, "growth", f"{where}.batching", 0.5,
                                          positive=False))
    given_plots = plots
    plots = top.get("plots", True)
    points = 4
    if isinstance(plots, Mapping):
        points = int(_number(_table(plots, f"{where}.plots", {"points"}), "points",
                             f"{where}.plots", integer=True))
        plots = True
    elif not isinstance(plots, bool):
        raise _fail(f"{where}.plots", f"expected true, false or {{points: N}}, got {shown(plots)}")
    if given_plots is not None:
        plots = given_plots
    spec = PlaceSpec(tuple(entries), devices, preset, memory, dtype, slo_scale=scale,
                     slo_seconds=seconds, policies=tuple(policies), plots=plots,
                     plot_points=points, base=Path(base), **extra)
    check_budget(spec, where)
    return spec


def check_budget(spec: PlaceSpec, where: str = "spec") -> None:
    """Refuse, before any work, a SPEC whose workload the simulator cannot hold or replay in
    minutes: the requests it would generate (estimated: total_rate x duration, twice the rate
    in the plots' sweeps) against `MAX_REQUESTS`, times the models against
    `MAX_REQUEST_MODELS`, their memory against what this machine has free, and the windows
    of maf1/maf2 and clockwork++ against `MAX_WINDOWS`. A trace's requests are counted as it
    is read (`workload.load_trace`)."""
    at = f"{where}.workload"
    if spec.trace is None and spec.warmup >= spec.duration:
        raise _fail(f"{at}.warmup", f"{spec.warmup:g} s is not shorter than the duration "
                                    f"({spec.duration:g} s): no request would be counted; give "
                                    "a shorter warmup")
    windowed = spec.arrival in ("maf1", "maf2") or "clockwork++" in spec.policies
    if spec.trace is None and windowed:
        windows = math.ceil(spec.duration / spec.window)
        if windows > MAX_WINDOWS:
            raise _fail(f"{at}.window", f"{spec.window:g} s cuts the {spec.duration:g} s into "
                                        f"{windows:,} windows, more than {MAX_WINDOWS:,} (each "
                                        "is fitted or re-placed); give a longer window")
    if spec.trace is not None:
        return
    sweep = 2.0 if spec.plots else 1.0
    requests = spec.total_rate * sweep * spec.duration
    how = "total_rate x duration" + (", x2 for the plots' rate sweep" if spec.plots else "")
    fix = ("lower workload.total_rate or workload.duration"
           + (", or set plots: false" if spec.plots else ""))
    if requests > MAX_REQUESTS:
        raise _fail(at, f"about {requests:,.0f} requests (estimated: {how}), more than the "
                        f"{MAX_REQUESTS:,} the simulator replays per placement; {fix}")
    models = len(spec.models)
    if requests * models > MAX_REQUEST_MODELS:
        raise _fail(at, f"about {requests:,.0f} requests (estimated: {how}) x {models} models, "
                        f"more than {MAX_REQUEST_MODELS:,} the search can try; {fix}")
    from graphpar.cost.cluster import host_memory_available

    free = host_memory_available()
    need = requests * BYTES_PER_REQUEST
    if free is not None and need > free:
        raise _fail(at, f"about {requests:,.0f} requests need about {need / 2**30:.1f} GiB "
                        f"(estimated), more than the {free / 2**30:.1f} GiB free here; {fix}")
