"""Named cluster presets and cluster files (JSON/YAML), read into `graphpar.ir.cluster.Cluster`.

A `Cluster` is the physical machine the compiler plans for. A `graphpar.ir.mesh.Mesh`
is a logical view of some of its devices; `Mesh.from_cluster` derives each mesh
axis' bandwidth and latency from the cluster's links.

Devices are numbered node-major: device `i` sits on node `i // devices_per_node`.

    get_cluster("dgx-a100")                  # a preset
    get_cluster("configs/my-cluster.json")   # a file (JSON; YAML when PyYAML is installed)
    dataclasses.replace(get_cluster("dgx-a100"), num_nodes=4)

The preset numbers and where they come from are in `docs/meshes-and-layouts.md`
and in each preset's `source`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from graphpar.errors import ClusterSpecError
from graphpar.ir.cluster import (
    CLUSTER_DTYPES,
    COLLECTIVE_KINDS,
    COMPUTE_CLASSES,
    Cluster,
    ComputeRate,
    normalize_dtype,
)
from graphpar.ir.mesh import Mesh, parse_mesh_shape
from graphpar.units import parse_bandwidth, parse_bytes, parse_flops, parse_seconds

__all__ = [
    "PRESETS",
    "Cluster",
    "ClusterFallbackWarning",
    "datasheet_compute",
    "cluster_from_dict",
    "get_cluster",
    "load_cluster",
    "mesh_for",
    "normalize_dtype",
]

_GiB = 2**30
_NCCL_LATENCY_NOTE = (
    "Latencies are per-step alphas estimated from typical nccl-tests small-message times "
    "(not spec-sheet values); measure them for precise small-message costs.")



class ClusterFallbackWarning(UserWarning):
    """A cluster file without some op classes' achieved rates: which ones, and what they use."""


# What a device achieves of its datasheet, per op class (the presets' `compute` tables):
# (fraction of the dtype's peak FLOP/s, or of the fp32 vector peak where tensor cores do not
# help; fraction of the memory bandwidth).
_EFFICIENCY = {
    # cuBLAS reaches 70-80% of the dense peak on large GEMMs (NVIDIA's cuBLAS and MLPerf
    # figures), and streams operands at about the rate STREAM-like kernels do.
    "gemm": ("peak", 0.75, 0.8),
    # M <= 16 rows (decode): weight-bound; cuBLAS's GEMV-like kernels reach a fraction of peak.
    "gemm_skinny": ("peak", 0.25, 0.8),
    # Elementwise kernels: CUDA cores, about 80% of HBM bandwidth (STREAM triad on A100/H100).
    "elementwise": ("vector", 0.5, 0.8),
    # Reductions (softmax, norms) make two passes over rows and synchronize a block.
    "normalization": ("vector", 0.5, 0.7),
    # FlashAttention-2 reaches 50-70% of the tensor-core peak on A100 (Dao, 2023).
    "attention": ("peak", 0.5, 0.8),
    # Gathers read rows at scattered addresses: about half the streaming bandwidth.
    "gather": ("vector", 0.5, 0.5),
}
_COMPUTE_NOTE = (
    "Achieved rates (compute): gemm 0.75 of the dense peak, gemm_skinny 0.25, attention 0.5; "
    "elementwise, normalization and gather 0.5 of the fp32 vector rate; memory traffic at 0.8 "
    "of HBM bandwidth (normalization 0.7, gather 0.5); a per-call overhead of a kernel launch. "
    "Datasheet-derived estimates, not measurements: `graphpar calibrate` measures them.")


def datasheet_compute(peak_fp32: float, peak_fp16: float, peak_bf16: float,
                      memory_bandwidth: float, overhead: float) -> dict:
    """A compute table {dtype: {class: {flops, bandwidth, overhead}}} derived from a device's
    datasheet: its peak FLOP/s per dtype, memory bandwidth (bytes/s) and launch overhead (s)."""
    peaks = {"fp32": peak_fp32, "fp16": peak_fp16, "bf16": peak_bf16}
    return {dtype: {name: {"flops": (peak if which == "peak" else peak_fp32) * flops_share,
                           "bandwidth": memory_bandwidth * bandwidth_share,
                           "overhead": overhead}
                    for name, (which, flops_share, bandwidth_share) in _EFFICIENCY.items()}
            for dtype, peak in peaks.items()}


_DGX_A100 = Cluster(
    name="dgx-a100",
    device="A100-SXM4-40GB",
    num_nodes=1,
    devices_per_node=8,
    intra_node_bandwidth=300e9,
    intra_node_latency=1e-6,
    inter_node_bandwidth=200e9,
    inter_node_latency=5e-6,
    device_memory=40 * _GiB,
    peak_flops_fp32=19.5e12,
    peak_flops_fp16=312e12,
    peak_flops_bf16=312e12,
    compute=datasheet_compute(19.5e12, 312e12, 312e12, 1555e9, 5e-6),
    source=(
        "NVIDIA A100 datasheet: HBM2 1,555 GB/s; NVLink 600 GB/s bidirectional (12 links x "
        "25 GB/s per "
        "direction = 300 GB/s per direction, all-to-all through NVSwitch), FP32 19.5 "
        "TFLOPS, FP16/BF16 tensor core 312 TFLOPS dense, 40 GB HBM2 (40 GiB). DGX A100 "
        "datasheet: 8 single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute = 8 x "
        "25 GB/s = 200 GB/s per node. " + _COMPUTE_NOTE + " " + _NCCL_LATENCY_NOTE),
)

# The machine `graphpar train` and the CPU benches run on, measured: `graphpar calibrate --ranks
# 2` (tools/bench/gloo_cluster.json, idle), rounded to two digits. The `cpu` preset's
# placeholders price a gloo collective at 20 us; on loopback one costs about 0.4-1 ms, so
# plans chosen on `cpu` communicate far more than pays on CPU ranks.
_CPU_GLOO = Cluster(
    name="cpu-gloo",
    device="cpu-process",
    num_nodes=1,
    devices_per_node=8,
    intra_node_bandwidth=2.0e9,
    intra_node_latency=420e-6,
    inter_node_bandwidth=1.25e9,
    inter_node_latency=420e-6,
    device_memory=4 * _GiB,
    peak_flops_fp32=81e9,
    peak_flops_fp16=1.3e9,
    peak_flops_bf16=1.3e9,
    compute={
        "fp32": {"gemm": {"flops": 81e9, "bandwidth": 5.6e9, "overhead": 21e-6},
                 "gemm_skinny": {"flops": 15e9, "bandwidth": 11e9, "overhead": 24e-6},
                 "elementwise": {"flops": 3.2e9, "bandwidth": 16e9, "overhead": 27e-6},
                 "normalization": {"flops": 8.5e9, "bandwidth": 24e9, "overhead": 29e-6},
                 "attention": {"flops": 17e9, "bandwidth": 9.6e9, "overhead": 33e-6},
                 "gather": {"flops": 22e9, "bandwidth": 9.5e9, "overhead": 36e-6}},
        "fp16": {"gemm": {"flops": 1.3e9, "bandwidth": 28e9, "overhead": 22e-6},
                 "gemm_skinny": {"flops": 0.14e9, "bandwidth": 15e9, "overhead": 24e-6},
                 "elementwise": {"flops": 2.1e9, "bandwidth": 8.9e9, "overhead": 27e-6},
                 "normalization": {"flops": 7.1e9, "bandwidth": 13e9, "overhead": 30e-6},
                 "attention": {"flops": 5.0e9, "bandwidth": 0.62e9, "overhead": 38e-6},
                 "gather": {"flops": 0.35e9, "bandwidth": 9.7e9, "overhead": 36e-6}},
        "bf16": {"gemm": {"flops": 1.2e9, "bandwidth": 20e9, "overhead": 22e-6},
                 "gemm_skinny": {"flops": 0.14e9, "bandwidth": 11e9, "overhead": 24e-6},
                 "elementwise": {"flops": 1.9e9, "bandwidth": 6.5e9, "overhead": 27e-6},
                 "normalization": {"flops": 5.7e9, "bandwidth": 10e9, "overhead": 30e-6},
                 "attention": {"flops": 12e9, "bandwidth": 0.96e9, "overhead": 34e-6},
                 "gather": {"flops": 0.34e9, "bandwidth": 11e9, "overhead": 36e-6}}},
    collectives={"all_reduce": {"latency": 0.96e-3, "bandwidth": 1.6e9},
                 "all_gather": {"latency": 0.84e-3, "bandwidth": 0.47e9},
                 "reduce_scatter": {"latency": 1.6e-3, "bandwidth": 0.24e9},
                 "all_to_all": {"latency": 0.84e-3, "bandwidth": 0.23e9},
                 "send_recv": {"latency": 0.28e-3, "bandwidth": 2.9e9}},
    seconds_per_result_byte=1.0e-10,
    source=(
        "Measured on the project's 2-core AMD EPYC VM: `graphpar calibrate --ranks 2` "
        "(tools/bench/gloo_cluster.json: one gloo process per device on loopback, one thread "
        "each; compute: ops per class fitted to the roofline, collectives to alpha-beta per kind, "
        "rates divided by the in-step factors), rounded to two digits. Inter-node as the "
        "intra-node link, at most 10 GbE. Measure your own machine with `graphpar calibrate` "
        "for its numbers."),
)

_PRESET_LIST = [
    _DGX_A100,
    dataclasses.replace(  # the same machine with 80 GB parts
        _DGX_A100,
        name="dgx-a100-80gb",
        device="A100-SXM4-80GB",
        device_memory=80 * _GiB,
        compute=datasheet_compute(19.5e12, 312e12, 312e12, 2039e9, 5e-6),
        source="As dgx-a100 (DGX A100 640GB): A100 80GB HBM2e (80 GiB), 2,039 GB/s. "
               + _COMPUTE_NOTE + " " + _NCCL_LATENCY_NOTE,
    ),
    Cluster(
        name="dgx-h100",
        device="H100-SXM5-80GB",
        num_nodes=1,
        devices_per_node=8,
        intra_node_bandwidth=450e9,
        intra_node_latency=1e-6,
        inter_node_bandwidth=400e9,
        inter_node_latency=5e-6,
        device_memory=80 * _GiB,
        peak_flops_fp32=67e12,
        peak_flops_fp16=989.4e12,
        peak_flops_bf16=989.4e12,
        compute=datasheet_compute(67e12, 989.4e12, 989.4e12, 3.35e12, 5e-6),
        source=(
            "NVIDIA H100 datasheet (SXM): HBM3 3.35 TB/s; NVLink 900 GB/s bidirectional (450 "
            "GB/s per direction, NVSwitch), FP32 67 TFLOPS, FP16/BF16 tensor core 1979 TFLOPS with "
            "sparsity = 989.4 dense, 80 GB HBM3 (80 GiB). DGX H100 datasheet: 8 x ConnectX-7 "
            "400 Gb/s NDR InfiniBand = 8 x 50 GB/s = 400 GB/s per node. " + _COMPUTE_NOTE + " "
            + _NCCL_LATENCY_NOTE),
    ),
    Cluster(
        name="p3.16xlarge",
        device="V100-SXM2-16GB",
        num_nodes=1,
        devices_per_node=8,
        intra_node_bandwidth=150e9,
        intra_node_latency=2e-6,
        inter_node_bandwidth=3.125e9,
        inter_node_latency=30e-6,
        device_memory=16 * _GiB,
        peak_flops_fp32=15.7e12,
        peak_flops_fp16=125e12,
        peak_flops_bf16=15.7e12,
        compute=datasheet_compute(15.7e12, 125e12, 15.7e12, 900e9, 5e-6),
        source=(
            "Alpa's testbed (OSDI'22 section 8: 8 x p3.16xlarge, NVLink inside a node, 25 Gbps "
            "between nodes). AWS EC2 P3 page: 8 x V100 SXM2 16 GB, 25 Gbps network per instance "
            "= 3.125 GB/s per node (TCP, no EFA: hence the larger latency). NVIDIA V100 "
            "datasheet: NVLink 300 GB/s bidirectional (6 links x 25 GB/s per direction = 150 "
            "GB/s; a hybrid cube-mesh, not a switch, so some pairs get less), FP32 15.7 TFLOPS, "
            "FP16 tensor core 125 TFLOPS, HBM2 900 GB/s. V100 has no bf16 hardware: bf16 is "
            "given the fp32 rate as an upper bound. " + _COMPUTE_NOTE + " " + _NCCL_LATENCY_NOTE),
    ),
    Cluster(
        name="cpu",
        device="cpu-process",
        num_nodes=1,
        devices_per_node=8,
        intra_node_bandwidth=5e9,
        intra_node_latency=20e-6,
        inter_node_bandwidth=1.25e9,
        inter_node_latency=50e-6,
        device_memory=4 * _GiB,
        peak_flops_fp32=100e9,
        peak_flops_fp16=50e9,
        peak_flops_bf16=50e9,
        compute=datasheet_compute(100e9, 50e9, 50e9, 10e9, 10e-6),
        source=(
            "Placeholders for the CPU reference runs (one process per 'device', gloo over "
            "loopback; inter-node as 10 GbE; 10 GB/s of memory bandwidth and 10 us per op, "
            "as eager torch on one core). Order-of-magnitude only: use them to test plans, "
            "not to predict times. " + _COMPUTE_NOTE),
    ),
    _CPU_GLOO,
]

PRESETS: Mapping[str, Cluster] = MappingProxyType({c.name: c for c in _PRESET_LIST})
"""The named clusters, one node each; `dataclasses.replace(c, num_nodes=n)` scales them out."""

_REQUIRED = ("num_nodes", "devices_per_node", "device_memory", "intra_node_bandwidth",
             "intra_node_latency", "inter_node_bandwidth", "inter_node_latency", "peak_flops")
_OPTIONAL = ("name", "base", "device", "source", "compute", "collectives",
             "seconds_per_result_byte")
_EXPECTED = {
    "name": "a string",
    "base": f"a preset name ({', '.join(PRESETS)})",
    "device": "a string",
    "source": "a string",
    "seconds_per_result_byte": "a number >= 0 (seconds per byte of a node's results)",
    "num_nodes": "a positive integer",
    "devices_per_node": "a positive integer",
    "device_memory": 'a size like "80GiB", "40GB" or a number of bytes',
    "intra_node_bandwidth": 'a bandwidth like "300GB/s", "25Gbps" or a number of bytes/s',
    "inter_node_bandwidth": 'a bandwidth per node like "200GB/s", "25Gbps" or a number of bytes/s',
    "intra_node_latency": 'a duration like "1us" or a number of seconds',
    "inter_node_latency": 'a duration like "5us" or a number of seconds',
    "peak_flops": 'an object like {"fp32": "19.5T", "fp16": "312T", "bf16": "312T"} (FLOP/s)',
    "compute": 'an object like {"fp32": {"gemm": {"flops": "15T", "bandwidth": "1.2TB/s", '
               '"overhead": "5us"}, ...}} (dtypes fp32, fp16, bf16; classes '
               + ", ".join(COMPUTE_CLASSES) + ")",
    "collectives": 'an object like {"all_reduce": {"latency": "30us", "bandwidth": "1.5GB/s"}, '
                   '...} (kinds ' + ", ".join(COLLECTIVE_KINDS) + ")",
}
_PARSERS = {
    "device_memory": parse_bytes,
    "intra_node_bandwidth": parse_bandwidth,
    "inter_node_bandwidth": parse_bandwidth,
    "intra_node_latency": parse_seconds,
    "inter_node_latency": parse_seconds,
}


def _fail(where: str, field: str, got: object, why: str = "") -> ClusterSpecError:
    if why.startswith("expected"):  # a units parser's message: keep only its extra note
        note = re.search(r"\(([^()]*)\)$", why)
        why = note.group(1) if note else ""
    detail = f" ({why})" if why else ""
    return ClusterSpecError(
        f"{where}: field {field!r}: expected {_EXPECTED[field]}, got {got!r}{detail}")


def cluster_from_dict(data: Mapping[str, Any], where: str = "<cluster>") -> Cluster:
    """A `Cluster` from the cluster-file format; `where` (a file name) starts every error message.

    Fields: see `docs/meshes-and-layouts.md`. With `"base": "<preset>"` every other field
    is optional and overrides the preset's; without it all of `num_nodes`,
    `devices_per_node`, `device_memory`, `intra_node_bandwidth`, `intra_node_latency`,
    `inter_node_bandwidth`, `inter_node_latency` and `peak_flops` are required.
    """
    if not isinstance(data, Mapping):
        raise ClusterSpecError(f"{where}: expected an object (a mapping of fields), "
                               f"got {type(data).__name__}")
    unknown = sorted(set(map(str, data)) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise ClusterSpecError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"expected fields: {', '.join(_OPTIONAL + _REQUIRED)}")
    fields: dict[str, Any] = {}
    if "base" in data:
        base = data["base"]
        if not isinstance(base, str) or base not in PRESETS:
            raise _fail(where, "base", base, "unknown preset")
        fields = dataclasses.asdict(PRESETS[base])
        fields["source"] = f"{where}, based on preset {base!r}"
    else:
        missing = [f for f in _REQUIRED if f not in data]
        if missing:
            raise ClusterSpecError(
                f"{where}: missing field(s) {', '.join(map(repr, missing))}; "
                f"for example: {', '.join(f'{f}: {_EXPECTED[f]}' for f in missing)}. "
                "Or start from a preset with \"base\" (one of "
                f"{', '.join(PRESETS)}) and give only the fields that differ.")
        fields["source"] = where
    fields["name"] = Path(where).stem if where != "<cluster>" else "custom"

    for key in ("name", "device", "source"):
        if key in data:
            if not isinstance(data[key], str):
                raise _fail(where, key, data[key])
            fields[key] = data[key]
    for key in ("num_nodes", "devices_per_node"):
        if key in data:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _fail(where, key, value)
            fields[key] = value
    for key, parse in _PARSERS.items():
        if key in data:
            try:
                value = parse(data[key])
            except ValueError as e:
                raise _fail(where, key, data[key], str(e)) from None
            if value <= 0 and "latency" not in key:
                raise _fail(where, key, data[key], "must be > 0")
            fields[key] = value
    if "peak_flops" in data:
        flops = data["peak_flops"]
        if not isinstance(flops, Mapping):
            raise _fail(where, "peak_flops", flops)
        given: dict[str, float] = {}
        for dtype, rate in flops.items():
            try:
                name = normalize_dtype(dtype)
            except ValueError:
                raise _fail(where, "peak_flops", flops,
                            f"unknown dtype {dtype!r}; give fp32, fp16 and bf16") from None
            try:
                given[name] = parse_flops(rate)
            except ValueError as e:
                raise _fail(where, "peak_flops", flops, f"{dtype}: {e}") from None
            if given[name] <= 0:
                raise _fail(where, "peak_flops", flops, f"{dtype}: must be > 0")
        missing_dtypes = [d for d in ("fp32", "fp16", "bf16")
                          if d not in given and "base" not in data]
        if missing_dtypes:
            raise _fail(where, "peak_flops", flops, f"missing {', '.join(missing_dtypes)}")
        for name, rate in given.items():
            fields["peak_flops_" + name] = rate
    if "collectives" in data:
        fields["collectives"] = _collective_rows(data["collectives"], where)
    if "seconds_per_result_byte" in data:
        value = data["seconds_per_result_byte"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise _fail(where, "seconds_per_result_byte", value)
        fields["seconds_per_result_byte"] = float(value)
    if "compute" in data or "base" not in data:
        given = _compute_rows(data.get("compute", {}), where)
        fields["compute"] = _with_fallbacks(given, fields.get("compute", ()), where,
                                            data.get("base"))
    try:
        return Cluster(**fields)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"{where}: {e}") from None


_RATE_PARSERS = {"flops": parse_flops, "bandwidth": parse_bandwidth, "overhead": parse_seconds,
                 "latency": parse_seconds}


def _parse_rate(where: str, field: str, path: str, rate: object, names: tuple[str, ...]
                ) -> list[float]:
    if not isinstance(rate, Mapping) or set(rate) != set(names):
        raise _fail(where, field, rate, f"{path}: give exactly {', '.join(names)}")
    values = []
    for name in names:
        try:
            value = _RATE_PARSERS[name](rate[name])
        except ValueError as e:
            raise _fail(where, field, rate[name], f"{path}.{name}: {e}") from None
        if not (value >= 0 if name in ("overhead", "latency") else value > 0):
            raise _fail(where, field, rate[name], f"{path}.{name}: must be > 0")
        values.append(value)
    return values


def _compute_rows(table: object, where: str) -> list[tuple]:
    if not isinstance(table, Mapping):
        raise _fail(where, "compute", table)
    rows = []
    for dtype, classes in table.items():
        try:
            name = normalize_dtype(dtype)
        except ValueError:
            raise _fail(where, "compute", dtype, "unknown dtype; give fp32, fp16 or bf16") \
                from None
        if not isinstance(classes, Mapping):
            raise _fail(where, "compute", classes, f"{dtype}: expected an object of op classes")
        for op_class, rate in classes.items():
            if op_class not in COMPUTE_CLASSES:
                raise _fail(where, "compute", op_class,
                            f"{dtype}: unknown op class; the classes are "
                            f"{', '.join(COMPUTE_CLASSES)}")
            rows.append((name, op_class, *_parse_rate(where, "compute", f"{dtype}.{op_class}",
                                                      rate, ComputeRate._fields)))
    return rows


def _collective_rows(table: object, where: str) -> list[tuple]:
    if not isinstance(table, Mapping):
        raise _fail(where, "collectives", table)
    rows = []
    for kind, rate in table.items():
        if kind not in COLLECTIVE_KINDS:
            raise _fail(where, "collectives", kind,
                        f"unknown collective; the kinds are {', '.join(COLLECTIVE_KINDS)}")
        rows.append((kind, *_parse_rate(where, "collectives", kind, rate,
                                        ("latency", "bandwidth"))))
    return rows


_WARNED: set[str] = set()  # fallback warnings already given in this process


def _with_fallbacks(given: list[tuple], base_rows: Sequence[tuple], where: str,
                    base: str | None) -> tuple:
    """The file's compute rows, completed from the base preset's; warns once, naming the
    classes that fell back (to the preset, or without one to the peak FLOP/s)."""
    have = {(r[0], r[1]) for r in given}
    rows = list(given) + [r for r in base_rows if (r[0], r[1]) not in have]
    missing: dict[str, list[str]] = {}
    for dtype in CLUSTER_DTYPES:
        lacking = [c for c in COMPUTE_CLASSES if (dtype, c) not in have]
        if lacking:
            missing[dtype] = lacking
    if missing:
        parts = [f"{d} (all classes)" if len(cs) == len(COMPUTE_CLASSES) else
                 f"{d} {', '.join(cs)}" for d, cs in missing.items()]
        use = (f"the values of preset {base!r}" if base else
               "the peak FLOP/s of peak_flops with no memory-bandwidth term and no overhead")
        message = (f"{where}: {'no compute table' if not given else 'compute table lacks'}"
                   f"{'' if not given else ' ' + '; '.join(parts)}; "
                   f"{'they' if given else 'every op class'} use{'' if given else 's'} {use} "
                   "(measure them with `graphpar calibrate`)")
        if message not in _WARNED:
            _WARNED.add(message)
            warnings.warn(message, ClusterFallbackWarning, stacklevel=3)
    return tuple(rows)


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster file: JSON (`.json`), or YAML (`.yaml`/`.yml`)."""
    from graphpar.datafile import read_data_file

    data = read_data_file(path, ClusterSpecError, "cluster file")
    return cluster_from_dict(data, where=str(path))


def get_cluster(name_or_path: str | Path | Cluster) -> Cluster:
    """A preset by name ("dgx-a100"), a cluster file by path, or a `Cluster` as is."""
    if isinstance(name_or_path, Cluster):
        return name_or_path
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(key)
    if path.suffix.lower() in (".json", ".yaml", ".yml") or path.exists():
        return load_cluster(path)
    raise ClusterSpecError(
        f"unknown cluster preset {key!r}; presets: {', '.join(PRESETS)}; "
        "or give the path of a cluster file (.json, or .yaml with PyYAML)")


def mesh_for(shape: str | Sequence[int] | Mesh, cluster: Cluster | str | Path = "dgx-a100",
             axis_names: Sequence[str] | None = None) -> Mesh:
    """A mesh of `shape` ("2x4") on `cluster` (a `Cluster`, preset name or file), adding nodes
    of the cluster's kind when the mesh needs more devices than the cluster has. A `Mesh`
    already laid on a cluster is returned as it is (its cluster is the one it was made for);
    an abstract one is laid on `cluster` by its shape."""
    if isinstance(shape, Mesh):
        if shape.cluster is not None:
            return shape
        shape, axis_names = shape.shape, axis_names or shape.axis_names
    cluster = get_cluster(cluster)
    shape = parse_mesh_shape(shape)
    size = math.prod(shape)
    if size > cluster.num_devices:
        nodes = math.ceil(size / cluster.devices_per_node)
        cluster = dataclasses.replace(cluster, num_nodes=nodes)
    return Mesh.from_cluster(cluster, shape, axis_names=axis_names)


def host_memory_available() -> float | None:
    """Bytes of memory this host has available now (Linux's MemAvailable), or None where it
    cannot be read: what a command checks its estimated needs against before it starts."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
