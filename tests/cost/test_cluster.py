"""Cluster presets and cluster files (JSON, YAML), with their error messages."""

import dataclasses
import json

import pytest

from graphpar.cost.cluster import (
    PRESETS,
    Cluster,
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
