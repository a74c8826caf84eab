"""Cluster presets and cluster files (JSON, YAML), with their error messages."""

import dataclasses
import json
import math

import pytest

from graphpar.cost.cluster import (
    PRESETS,
    Cluster,
    ClusterFallbackWarning,
    cluster_from_dict,
    get_cluster,
    load_cluster,
    normalize_dtype,
)
from graphpar.errors import ClusterSpecError, UsageError

GiB = 2**30


def test_presets_exist_with_documented_numbers():
    assert {"dgx-a100", "dgx-a100-80gb", "dgx-h100", "p3.16xlarge", "cpu"} <= set(PRESETS)
    a100 = get_cluster("dgx-a100")
    assert (a100.devices_per_node, a100.intra_node_bandwidth, a100.inter_node_bandwidth) == \
        (8, 300e9, 200e9)
    assert a100.device_memory == 40 * GiB
    assert a100.peak_flops("fp16") == 312e12 and a100.peak_flops("bf16") == 312e12
    assert a100.peak_flops("float32") == 19.5e12
    p3 = get_cluster("p3.16xlarge")
    assert p3.inter_node_bandwidth == 25e9 / 8  # Alpa's testbed: 25 Gbps between nodes
    assert p3.device_memory == 16 * GiB and p3.device == "V100-SXM2-16GB"
    h100 = get_cluster("dgx-h100")
    assert h100.intra_node_bandwidth == 450e9 and h100.inter_node_bandwidth == 400e9
    for cluster in PRESETS.values():
        assert cluster.source, f"preset {cluster.name} must say where its numbers come from"
        assert cluster.num_nodes == 1
        assert cluster.describe().startswith(f"cluster {cluster.name}:")


def test_peak_flops_accepts_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert get_cluster("dgx-a100").peak_flops(torch.bfloat16) == 312e12
    assert normalize_dtype(torch.float16) == "fp16"
    with pytest.raises(ValueError, match="fp32, fp16 and bf16"):
        get_cluster("dgx-a100").peak_flops(torch.int8)


def test_scale_out_with_replace():
    two = dataclasses.replace(get_cluster("dgx-a100"), num_nodes=2)
    assert two.num_devices == 16
    assert two.node_of(7) == 0 and two.node_of(8) == 1
    with pytest.raises(ValueError, match="not in cluster"):
        two.node_of(16)


def test_unknown_preset_lists_presets():
    with pytest.raises(ClusterSpecError) as info:
        get_cluster("dgx-z9000")
    message = str(info.value)
    assert "dgx-z9000" in message and "dgx-a100" in message and "p3.16xlarge" in message
    assert isinstance(info.value, UsageError)


def test_get_cluster_passes_a_cluster_through():
    c = get_cluster("cpu")
    assert get_cluster(c) is c


def _write(tmp_path, data, name="my-cluster.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


FULL = {
    "name": "lab",
    "device": "A100-SXM4-80GB",
    "num_nodes": 2,
    "devices_per_node": 8,
    "device_memory": "80GiB",
    "intra_node_bandwidth": "300GB/s",
    "intra_node_latency": "1us",
    "inter_node_bandwidth": "200 GB/s",
    "inter_node_latency": 5e-6,
    "peak_flops": {"fp32": "19.5T", "fp16": "312 TFLOPS", "bf16": 312e12},
}


def test_load_json(tmp_path):
    with pytest.warns(ClusterFallbackWarning, match="no compute table"):
        c = load_cluster(_write(tmp_path, FULL))
    assert c == Cluster(
        name="lab", device="A100-SXM4-80GB", num_nodes=2, devices_per_node=8,
        intra_node_bandwidth=300e9, intra_node_latency=1e-6,
        inter_node_bandwidth=200e9, inter_node_latency=5e-6, device_memory=80 * GiB,
        peak_flops_fp32=19.5e12, peak_flops_fp16=312e12, peak_flops_bf16=312e12,
        source=str(tmp_path / "my-cluster.json"))
    assert get_cluster(str(tmp_path / "my-cluster.json")) == c


def test_load_json_with_base_preset(tmp_path):
    c = load_cluster(_write(tmp_path, {"base": "dgx-a100", "num_nodes": 4}))
    assert c.num_nodes == 4 and c.name == "my-cluster"
    assert c.intra_node_bandwidth == PRESETS["dgx-a100"].intra_node_bandwidth
    assert "dgx-a100" in c.source
    c = load_cluster(_write(tmp_path, {"base": "dgx-a100", "peak_flops": {"fp16": "100T"}}))
    assert c.peak_flops("fp16") == 100e12 and c.peak_flops("fp32") == 19.5e12


def test_to_dict_round_trips():
    for cluster in PRESETS.values():
        assert cluster_from_dict(cluster.to_dict()) == cluster


def test_load_yaml(tmp_path):
    pytest.importorskip("yaml")
    text = "base: p3.16xlarge\nnum_nodes: 8\ninter_node_bandwidth: 25Gbps\n"
    c = load_cluster(_write(tmp_path, text, "alpa.yaml"))
    assert c.num_devices == 64 and c.inter_node_bandwidth == 3.125e9


def test_yaml_without_pyyaml_says_so(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_yaml(name, *args, **kwargs):
        if name == "yaml":
            raise ImportError("no yaml")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_yaml)
    with pytest.raises(ClusterSpecError, match="PyYAML.*JSON"):
        load_cluster(_write(tmp_path, "num_nodes: 1\n", "c.yml"))


@pytest.mark.parametrize("change, field, expected", [
    ({"device_memory": "lots"}, "device_memory", "80GiB"),
    ({"device_memory": "80Gb"}, "device_memory", "bits"),
    ({"intra_node_bandwidth": "300GB"}, "intra_node_bandwidth", "300GB/s"),
    ({"intra_node_bandwidth": 0}, "intra_node_bandwidth", "> 0"),
    ({"inter_node_latency": "soon"}, "inter_node_latency", "5us"),
    ({"num_nodes": 0}, "num_nodes", "positive integer"),
    ({"num_nodes": "2"}, "num_nodes", "positive integer"),
    ({"devices_per_node": 2.5}, "devices_per_node", "positive integer"),
    ({"peak_flops": 312e12}, "peak_flops", "fp32"),
    ({"peak_flops": {"fp32": "19.5T"}}, "peak_flops", "missing fp16, bf16"),
    ({"peak_flops": {"fp32": 1, "fp16": 1, "bf16": 1, "int8": 1}}, "peak_flops", "int8"),
    ({"peak_flops": {"fp32": "x", "fp16": 1, "bf16": 1}}, "peak_flops", "FLOP"),
    ({"name": 3}, "name", "a string"),
    ({"compute": {"fp64": {}}}, "compute", "fp32, fp16 or bf16"),
    ({"compute": {"fp32": {"matmul": {}}}}, "compute", "gemm_skinny"),
    ({"compute": {"fp32": {"gemm": {"flops": 1e12}}}}, "compute", "flops, bandwidth, overhead"),
    ({"compute": {"fp32": {"gemm": {"flops": "1T", "bandwidth": "1TB", "overhead": 0}}}},
     "compute", "fp32.gemm.bandwidth"),
    ({"compute": {"fp32": {"gemm": {"flops": 0, "bandwidth": 1, "overhead": 0}}}},
     "compute", "> 0"),
    ({"collectives": {"allreduce": {"latency": 0, "bandwidth": 1}}}, "collectives",
     "all_reduce"),
    ({"collectives": {"all_reduce": {"latency": "1 s", "bandwidth": -1}}}, "collectives",
     "all_reduce.bandwidth"),
])
def test_malformed_field_names_file_field_and_expectation(tmp_path, change, field, expected):
    path = _write(tmp_path, {**FULL, **change})
    with pytest.raises(ClusterSpecError) as info:
        load_cluster(path)
    message = str(info.value)
    assert str(path) in message
    assert f"'{field}'" in message
    assert expected in message


def test_missing_fields_are_listed_with_a_hint(tmp_path):
    data = {k: v for k, v in FULL.items() if k not in ("num_nodes", "peak_flops")}
    with pytest.raises(ClusterSpecError) as info:
        load_cluster(_write(tmp_path, data))
    message = str(info.value)
    assert "'num_nodes'" in message and "'peak_flops'" in message and "base" in message


def test_unknown_field_is_a_typo(tmp_path):
    with pytest.raises(ClusterSpecError, match="unknown field.*'num_node'.*expected fields"):
        load_cluster(_write(tmp_path, {**FULL, "num_node": 2}))


def test_unknown_base(tmp_path):
    with pytest.raises(ClusterSpecError, match="'base'.*preset name.*dgx-a100"):
        load_cluster(_write(tmp_path, {"base": "dgx-b300"}))


def test_not_json_and_not_an_object(tmp_path):
    with pytest.raises(ClusterSpecError, match=r"my-cluster.json: not valid JSON.*line 1"):
        load_cluster(_write(tmp_path, "{num_nodes: 2"))
    with pytest.raises(ClusterSpecError, match="expected an object"):
        load_cluster(_write(tmp_path, "[1, 2]"))


def test_missing_file(tmp_path):
    with pytest.raises(ClusterSpecError, match="cannot read"):
        get_cluster(str(tmp_path / "nope.json"))


def test_cluster_validates_directly():
    with pytest.raises(ClusterSpecError, match="'intra_node_latency'"):
        dataclasses.replace(get_cluster("cpu"), intra_node_latency=-1.0)


CALIBRATED = {
    "fp32": {
        "gemm": {"flops": "90G", "bandwidth": "8GB/s", "overhead": "20us"},
        "gemm_skinny": {"flops": 3e10, "bandwidth": 8e9, "overhead": 2e-5},
        "elementwise": {"flops": 1e9, "bandwidth": 5e9, "overhead": 1e-5},
        "normalization": {"flops": 1e9, "bandwidth": 4e9, "overhead": 1e-5},
        "attention": {"flops": 5e10, "bandwidth": 5e9, "overhead": 3e-5},
        "gather": {"flops": 1e9, "bandwidth": 2e9, "overhead": 1e-5},
    },
}



def test_compute_and_collectives_round_trip_through_file_and_ir(tmp_path):
    import torch

    from graphpar.cost.cluster import mesh_for
    from graphpar.ir.graph import Graph
    from graphpar.ir.parser import parse
    from graphpar.ir.printer import print_graph
    from graphpar.ir.types import TensorType

    data = {**FULL, "compute": {**CALIBRATED, "fp16": CALIBRATED["fp32"],
                                "bf16": CALIBRATED["fp32"]},
            "collectives": {"all_reduce": {"latency": "30us", "bandwidth": "1.5GB/s"},
                            "send_recv": {"latency": 1e-5, "bandwidth": 2e9}}}
    c = load_cluster(_write(tmp_path, data))
    assert c.compute_rate("float32", "gemm") == pytest.approx((90e9, 8e9, 2e-5))
    assert c.collective_rate("all_reduce") == pytest.approx((3e-5, 1.5e9))
    assert c.collective_rate("all_gather") is None  # falls back to the links
    assert c.missing_compute() == []
    assert cluster_from_dict(c.to_dict()) == c
    assert json.loads(json.dumps(c.to_dict()))["compute"]["fp32"]["gemm"]["flops"] == 90e9
    g = Graph("g", mesh=mesh_for("2", c))
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    g.add_output(g.create("relu", [x]).output, "output")
    text = print_graph(g)
    assert 'compute=[["bf16", "attention", 50000000000.0, 5000000000.0, 3e-05]' in text
    assert parse(text).mesh.cluster == c


def test_partial_compute_falls_back_and_warns_once_naming_the_classes(tmp_path):
    path = _write(tmp_path, {"base": "dgx-a100", "compute": CALIBRATED})
    with pytest.warns(ClusterFallbackWarning) as caught:
        c = load_cluster(path)
        load_cluster(path)  # once per file and message, not per load
    assert len(caught) == 1
    assert str(caught[0].message) == (
        f"{path}: compute table lacks fp16 (all classes); bf16 (all classes); they use the "
        "values of preset 'dgx-a100' (measure them with `graphpar calibrate`)")
    assert c.compute_rate("fp32", "gemm").flops == 90e9
    assert c.compute_rate("bf16", "gemm") == PRESETS["dgx-a100"].compute_rate("bf16", "gemm")

    some = {"fp32": {"gemm": CALIBRATED["fp32"]["gemm"]}}
    path = _write(tmp_path, {**FULL, "compute": some}, "no-base.json")
    with pytest.warns(ClusterFallbackWarning, match=(
            "compute table lacks fp32 gemm_skinny, elementwise, normalization, attention, "
            "gather; fp16 .all classes.; bf16 .all classes.; they use the peak FLOP/s")):
        c = load_cluster(path)
    assert c.compute_rate("fp32", "elementwise") == (19.5e9 * 1000, math.inf, 0.0)


def test_a_base_without_a_compute_table_takes_the_presets_silently(tmp_path, recwarn):
    c = load_cluster(_write(tmp_path, {"base": "dgx-h100", "num_nodes": 2}))
    assert c.compute == PRESETS["dgx-h100"].compute
    assert not [w for w in recwarn if w.category is ClusterFallbackWarning]


def test_every_preset_has_a_full_compute_table():
    for cluster in PRESETS.values():
        assert cluster.missing_compute() == [], cluster.name
        gemm = cluster.compute_rate("bf16", "gemm")
        assert gemm.flops < cluster.peak_flops("bf16") and gemm.overhead > 0
        assert "compute" in cluster.source.lower() or "Achieved" in cluster.source
