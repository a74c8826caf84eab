"""Device meshes: shapes, device groups, and per-axis links when mapped onto a cluster."""

import dataclasses

import pytest

from graphpar.cost.cluster import get_cluster
from graphpar.errors import ShardingError
from graphpar.ir.mesh import Cluster, Mesh, parse_mesh_shape

DGX2 = dataclasses.replace(get_cluster("dgx-a100"), num_nodes=2)


@pytest.mark.parametrize("text, shape", [
    ("8", (8,)), ("2x4", (2, 4)), ("2X4", (2, 4)), ("2x2x2", (2, 2, 2)), (" 4 x 4 ", (4, 4)),
    ("1x2x2x2", (1, 2, 2, 2)), (4, (4,)), ((2, 8), (2, 8)),
])
def test_parse_mesh_shape(text, shape):
    assert parse_mesh_shape(text) == shape


@pytest.mark.parametrize("text", ["", "2y4", "2x", "x4", "0x4", "-2", "2.5"])
def test_parse_mesh_shape_rejects(text):
    with pytest.raises(ShardingError, match="mesh"):
        parse_mesh_shape(text)


def test_abstract_mesh_defaults():
    mesh = Mesh((2, 4))
    assert mesh.ndim == 2 and mesh.size == 8 and str(mesh) == "2x4"
    assert mesh.device_ids == tuple(range(8))
    assert mesh.bandwidth == (1.0, 1.0) and mesh.latency == (0.0, 0.0)
    assert Mesh.from_string("2x4") == mesh
    assert hash(mesh) == hash(Mesh((2, 4)))


def test_scalar_and_per_axis_links():
    mesh = Mesh((2, 4), bandwidth=10.0, latency=(1e-6, 2e-6), axis_names=("dp", "tp"))
    assert mesh.bandwidth == (10.0, 10.0)
    assert mesh.axis("tp") == 1 and mesh.axis(-1) == 1
    assert mesh.axes(["dp", "tp"]) == (0, 1)
    assert mesh.group_size(("dp", "tp")) == 8
    assert mesh.group_latency((0, 1)) == 2e-6


def test_group_bandwidth_is_the_slowest_axis():
    mesh = Mesh((2, 8), bandwidth=(25e9, 300e9))
    assert mesh.group_bandwidth(0) == 25e9
    assert mesh.group_bandwidth(1) == 300e9
    assert mesh.group_bandwidth((0, 1)) == 25e9


@pytest.mark.parametrize("kwargs, message", [
    (dict(shape=(2, 4), device_ids=(0, 1, 2)), "8 devices"),
    (dict(shape=(2,), device_ids=(1, 1)), "distinct"),
    (dict(shape=(2, 4), bandwidth=(1.0,)), "2 axes"),
    (dict(shape=(2, 4), bandwidth=0.0), "positive"),
    (dict(shape=(2, 4), latency=-1.0), ">= 0"),
    (dict(shape=(2, 4), axis_names=("a", "a")), "distinct axis names"),
    (dict(shape=()), "positive integers"),
])
def test_invalid_meshes(kwargs, message):
    with pytest.raises(ShardingError, match=message):
        Mesh(**kwargs)


def test_unknown_axis():
    with pytest.raises(ShardingError, match="no axis named 'pp'"):
        Mesh((2, 4), axis_names=("dp", "tp")).axis("pp")
    with pytest.raises(ShardingError, match="no axis 2"):
        Mesh((2, 4)).axis(2)


def test_coordinates_and_groups():
    mesh = Mesh((2, 4))
    assert mesh.coordinate(6) == (1, 2)
    assert mesh.device_at((1, 2)) == 6
    assert mesh.groups(1) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert mesh.groups(0) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert mesh.groups((0, 1)) == (tuple(range(8)),)
    assert mesh.groups((1, 0)) == ((0, 4, 1, 5, 2, 6, 3, 7),)
    assert mesh.group_of(5, 0) == (1, 5)
    mesh3 = Mesh((2, 2, 2), device_ids=tuple(range(10, 18)))
    assert mesh3.groups((0, 2)) == ((10, 11, 14, 15), (12, 13, 16, 17))
    assert mesh3.coordinate(13) == (0, 1, 1)
    with pytest.raises(ShardingError, match="not in mesh"):
        mesh3.coordinate(0)


def test_2x8_on_two_nodes_of_8():
    mesh = Mesh.from_string("2x8", DGX2)
    assert isinstance(DGX2, Cluster)
    # axis 1 stays inside a node (NVLink); axis 0 crosses nodes: 8 groups of 2 share the
    # node's 8 NICs (200 GB/s) -> 25 GB/s each.
    assert mesh.bandwidth == (25e9, 300e9)
    assert mesh.latency == (DGX2.inter_node_latency, DGX2.intra_node_latency)


@pytest.mark.parametrize("shape, bandwidth", [
    ("1x16", (300e9, 200e9)),  # axis 1: one group of 16 gets all of each node's 200 GB/s
    ("16", (200e9,)),
    ("4x4", (50e9, 300e9)),  # 4 groups leave each node
    ("8x2", (100e9, 300e9)),  # axis 0: 2 groups of 8 per node
    ("2x2x4", (25e9, 300e9, 300e9)),
    ("8", (300e9,)),  # one node: all intra
])
def test_mesh_views_of_two_dgx(shape, bandwidth):
    assert Mesh.from_cluster(DGX2, shape).bandwidth == bandwidth


def test_cross_node_share_is_capped_by_the_intra_node_link():
    cluster = dataclasses.replace(get_cluster("dgx-h100"), num_nodes=2, inter_node_bandwidth=1e12)
    assert Mesh.from_cluster(cluster, "16").bandwidth == (cluster.intra_node_bandwidth,)


def test_alpa_testbed_p3():
    p3 = dataclasses.replace(get_cluster("p3.16xlarge"), num_nodes=8)
    mesh = Mesh.from_string("8x8", p3)
    assert mesh.bandwidth == (3.125e9 / 8, 150e9)
    assert mesh.describe().splitlines()[0] == "mesh 8x8 (64 devices)"


def test_submesh_on_explicit_devices():
    # a 1x8 stage mesh on the second node, and a 2x4 mesh split over both nodes
    assert Mesh.from_cluster(DGX2, (1, 8), devices=range(8, 16)).bandwidth == (300e9, 300e9)
    mesh = Mesh.from_cluster(DGX2, (2, 4), devices=[0, 1, 2, 3, 8, 9, 10, 11])
    assert mesh.bandwidth == (50e9, 300e9)
    assert mesh.device_ids == (0, 1, 2, 3, 8, 9, 10, 11)


def test_mesh_larger_than_cluster():
    with pytest.raises(ShardingError, match="needs 32 devices.*has 16"):
        Mesh.from_string("4x8", DGX2)
    with pytest.raises(ShardingError, match="needs 8 devices"):
        Mesh.from_cluster(DGX2, (2, 4), devices=[0, 1])


def test_from_string_with_preset_name_and_axis_names():
    mesh = Mesh.from_string("2x4", get_cluster("dgx-a100"), axis_names=("dp", "tp"))
    assert mesh.bandwidth == (300e9, 300e9) and mesh.axis_names == ("dp", "tp")
    assert "axis 0 (dp): 2 devices, 300.0 GB/s" in mesh.describe()
