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
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from graphpar.errors import ClusterSpecError
from graphpar.ir.cluster import Cluster, normalize_dtype
from graphpar.ir.mesh import Mesh, parse_mesh_shape
from graphpar.units import parse_bandwidth, parse_bytes, parse_flops, parse_seconds

__all__ = [
    "PRESETS",
    "Cluster",
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
    source=(
        "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional (12 links x 25 GB/s per "
        "direction = 300 GB/s per direction, all-to-all through NVSwitch), FP32 19.5 "
        "TFLOPS, FP16/BF16 tensor core 312 TFLOPS dense, 40 GB HBM2 (40 GiB). DGX A100 "
        "datasheet: 8 single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute = 8 x "
        "25 GB/s = 200 GB/s per node. " + _NCCL_LATENCY_NOTE),
)

_PRESET_LIST = [
    _DGX_A100,
    dataclasses.replace(  # the same machine with 80 GB parts
        _DGX_A100,
        name="dgx-a100-80gb",
        device="A100-SXM4-80GB",
        device_memory=80 * _GiB,
        source="As dgx-a100 (DGX A100 640GB): A100 80GB HBM2e (80 GiB). " + _NCCL_LATENCY_NOTE,
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
        source=(
            "NVIDIA H100 datasheet (SXM): NVLink 900 GB/s bidirectional (450 GB/s per "
            "direction, NVSwitch), FP32 67 TFLOPS, FP16/BF16 tensor core 1979 TFLOPS with "
            "sparsity = 989.4 dense, 80 GB HBM3 (80 GiB). DGX H100 datasheet: 8 x ConnectX-7 "
            "400 Gb/s NDR InfiniBand = 8 x 50 GB/s = 400 GB/s per node. " + _NCCL_LATENCY_NOTE),
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
        source=(
            "Alpa's testbed (OSDI'22 section 8: 8 x p3.16xlarge, NVLink inside a node, 25 Gbps "
            "between nodes). AWS EC2 P3 page: 8 x V100 SXM2 16 GB, 25 Gbps network per instance "
            "= 3.125 GB/s per node (TCP, no EFA: hence the larger latency). NVIDIA V100 "
            "datasheet: NVLink 300 GB/s bidirectional (6 links x 25 GB/s per direction = 150 "
            "GB/s; a hybrid cube-mesh, not a switch, so some pairs get less), FP32 15.7 TFLOPS, "
            "FP16 tensor core 125 TFLOPS. V100 has no bf16 hardware: bf16 is given the fp32 "
            "rate as an upper bound. " + _NCCL_LATENCY_NOTE),
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
        source=(
            "Placeholders for the CPU reference runs (one process per 'device', gloo over "
            "loopback; inter-node as 10 GbE). Order-of-magnitude only: use them to test plans, "
            "not to predict times."),
    ),
]

PRESETS: Mapping[str, Cluster] = MappingProxyType({c.name: c for c in _PRESET_LIST})
"""The named clusters, one node each; `dataclasses.replace(c, num_nodes=n)` scales them out."""

_REQUIRED = ("num_nodes", "devices_per_node", "device_memory", "intra_node_bandwidth",
             "intra_node_latency", "inter_node_bandwidth", "inter_node_latency", "peak_flops")
_OPTIONAL = ("name", "base", "device", "source")
_EXPECTED = {
    "name": "a string",
    "base": f"a preset name ({', '.join(PRESETS)})",
    "device": "a string",
    "source": "a string",
    "num_nodes": "a positive integer",
    "devices_per_node": "a positive integer",
    "device_memory": 'a size like "80GiB", "40GB" or a number of bytes',
    "intra_node_bandwidth": 'a bandwidth like "300GB/s", "25Gbps" or a number of bytes/s',
    "inter_node_bandwidth": 'a bandwidth per node like "200GB/s", "25Gbps" or a number of bytes/s',
    "intra_node_latency": 'a duration like "1us" or a number of seconds',
    "inter_node_latency": 'a duration like "5us" or a number of seconds',
    "peak_flops": 'an object like {"fp32": "19.5T", "fp16": "312T", "bf16": "312T"} (FLOP/s)',
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
    try:
        return Cluster(**fields)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"{where}: {e}") from None


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


def mesh_for(shape: str | Sequence[int], cluster: Cluster | str | Path = "dgx-a100",
             axis_names: Sequence[str] | None = None) -> Mesh:
    """A mesh of `shape` ("2x4") on `cluster` (a `Cluster`, preset name or file), adding nodes
    of the cluster's kind when the mesh needs more devices than the cluster has."""
    cluster = get_cluster(cluster)
    shape = parse_mesh_shape(shape)
    size = math.prod(shape)
    if size > cluster.num_devices:
        nodes = math.ceil(size / cluster.devices_per_node)
        cluster = dataclasses.replace(cluster, num_nodes=nodes)
    return Mesh.from_cluster(cluster, shape, axis_names=axis_names)
