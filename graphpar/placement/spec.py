"""The `graphpar place` SPEC (YAML or JSON): read, validated field by field, into a
`PlaceSpec`. Every error names the field (`workload.cv`, `models[2].example`) and what to
write instead."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphpar.datafile import read_data_file
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


def _fail(where: str, message: str) -> PlacementSpecError:
    return PlacementSpecError(f"{where}: {message}")


def _table(data: Any, where: str, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise _fail(where, f"expected a mapping with fields {', '.join(sorted(allowed))}, "
                           f"got {data!r}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise _fail(f"{where}.{unknown[0]}", f"unknown field; use one of "
                                             f"{', '.join(sorted(allowed))}")
    return data


def _number(data: Mapping, key: str, where: str, default=None, *, positive=True,
            integer=False):
    if key not in data:
        if default is None:
            raise _fail(f"{where}.{key}", "missing")
        return default
    value = data[key]
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or (
            value <= 0 if positive else value < 0):
        want = "a positive whole number" if integer else (
            "a positive number" if positive else "a number >= 0")
        raise _fail(f"{where}.{key}", f"expected {want}, got {value!r}")
    return value


def read_spec(path: str | Path) -> PlaceSpec:
    """Read and validate a SPEC file (.json, or .yaml/.yml with pyyaml)."""
    path = Path(path)
    if not path.is_file():
        raise PlacementSpecError(f"{path}: no such SPEC file")
    data = read_data_file(path, PlacementSpecError, "SPEC file")
    return parse_spec(data, base=path.parent, where=str(path))


def parse_spec(data: Any, base: str | Path = ".", where: str = "spec") -> PlaceSpec:
    """Validate a SPEC given as plain data (what the YAML/JSON file holds)."""
    top = _table(data, where, {"cluster", "models", "workload", "slo", "policies", "plots",
                               "batching"})
    cluster = _table(top.get("cluster"), f"{where}.cluster",
                     {"preset", "devices", "memory_per_device", "dtype"})
    devices = _number(cluster, "devices", f"{where}.cluster", integer=True)
    preset = str(cluster.get("preset", "dgx-a100"))
    from graphpar.cost.cluster import get_cluster
    from graphpar.errors import GraphparError
    from graphpar.units import parse_bytes

    try:
        get_cluster(preset)
    except GraphparError as exc:
        raise _fail(f"{where}.cluster.preset", str(exc)) from None
    memory = None
    if "memory_per_device" in cluster:
        try:
            memory = float(parse_bytes(cluster["memory_per_device"]))
        except ValueError as exc:
            raise _fail(f"{where}.cluster.memory_per_device", str(exc)) from None
        if memory <= 0:
            raise _fail(f"{where}.cluster.memory_per_device", "must be more than 0 bytes")
    dtype = str(cluster.get("dtype", "fp16"))
    if dtype not in ("fp16", "bf16", "fp32"):
        raise _fail(f"{where}.cluster.dtype", f"{dtype!r}: use fp16, bf16 or fp32")

    models = top.get("models")
    if not isinstance(models, list) or not models:
        raise _fail(f"{where}.models", "expected a list of {name, example} or {name, path}")
    entries, names = [], set()
    for i, m in enumerate(models):
        at = f"{where}.models[{i}]"
        m = _table(m, at, {"name", "example", "path"})
        name = m.get("name")
        if not isinstance(name, str) or not name:
            raise _fail(f"{at}.name", "missing: give each model a name")
        if name in names:
            raise _fail(f"{at}.name", f"{name!r} is given twice")
        names.add(name)
        if ("example" in m) == ("path" in m):
            raise _fail(at, "give exactly one of example (a bundled model, e.g. gpt:1.3B) "
                            "or path (a model file defining build())")
        if "example" in m:
            entries.append(ModelEntry(name, example=str(m["example"])))
        else:
            file = Path(base) / str(m["path"])
            if not file.is_file():
                raise _fail(f"{at}.path", f"{file}: no such model file")
            entries.append(ModelEntry(name, path=str(file)))

    wl = _table(top.get("workload"), f"{where}.workload",
                {"arrival", "total_rate", "cv", "duration", "split", "seed", "warmup",
                 "trace", "window"})
    extra: dict[str, Any] = {}
    at = f"{where}.workload"
    if "trace" in wl:
        trace = Path(base) / str(wl["trace"])
        if not trace.is_file():
            raise _fail(f"{at}.trace", f"{trace}: no such file (a CSV with columns "
                                       f"model,arrival_s)")
        extra["trace"] = str(trace)
    else:
        arrival = wl.get("arrival", "gamma")
        if arrival not in ("gamma", "poisson", "maf1", "maf2"):
            raise _fail(f"{at}.arrival", f"{arrival!r}: use gamma, poisson, maf1 (steady, "
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
        if p not in POLICIES:
            raise _fail(f"{where}.policies[{i}]", f"unknown policy {p!r}: use one of "
                                                  f"{', '.join(POLICIES)}")
    batching = _table(top.get("batching", {}), f"{where}.batching",
                      {"max_batch", "growth"})
    extra["max_batch"] = int(_number(batching, "max_batch", f"{where}.batching", 1,
                                     integer=True))
    extra["batch_growth"] = float(_number(batching, "growth", f"{where}.batching", 0.5,
                                          positive=False))
    plots = top.get("plots", True)
    points = 4
    if isinstance(plots, Mapping):
        points = int(_number(_table(plots, f"{where}.plots", {"points"}), "points",
                             f"{where}.plots", integer=True))
        plots = True
    elif not isinstance(plots, bool):
        raise _fail(f"{where}.plots", f"expected true, false or {{points: N}}, got {plots!r}")
    return PlaceSpec(tuple(entries), devices, preset, memory, dtype, slo_scale=scale,
                     slo_seconds=seconds, policies=tuple(policies), plots=plots,
                     plot_points=points, base=Path(base), **extra)
