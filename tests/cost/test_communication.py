"""Alpha-beta collective costs against hand-computed numbers."""

import dataclasses

import pytest

from graphpar.cost.cluster import get_cluster
from graphpar.cost.communication import (
    Cost,
    StepKind,
    all_gather_cost,
    all_reduce_cost,
    all_to_all_cost,
    broadcast_cost,
    collective_bytes,
    collective_cost,
    collective_time,
    reduce_scatter_cost,
    send_recv_cost,
)
from graphpar.ir.mesh import Mesh

# 2 DGX A100 as a 2x8 mesh: axis 0 25 GB/s, 5 us; axis 1 300 GB/s, 1 us.
MESH = Mesh.from_string("2x8", dataclasses.replace(get_cluster("dgx-a100"), num_nodes=2))
GB = 1e9


def test_mesh_under_test():
    assert MESH.bandwidth == (25e9, 300e9) and MESH.latency == (5e-6, 1e-6)


def test_all_reduce():
    step = all_reduce_cost(GB, MESH, 1)
    # 2(n-1)a + 2(n-1)/n M/B with n = 8
    assert step.seconds == pytest.approx(14e-6 + 1.75 * GB / 300e9)
    assert step.seconds == pytest.approx(0.005847333, rel=1e-6)
    assert step.bytes_sent == pytest.approx(1.75e9)
    assert (step.kind, step.axes, step.group_size, step.nbytes) == \
        (StepKind.ALL_REDUCE, (1,), 8, GB)


def test_all_gather_and_reduce_scatter():
    for fn in (all_gather_cost, reduce_scatter_cost):
        step = fn(GB, MESH, 0)  # n = 2, across nodes
        assert step.seconds == pytest.approx(5e-6 + 0.5 * GB / 25e9)
        assert step.seconds == pytest.approx(0.020005)
        assert step.bytes_sent == pytest.approx(0.5e9)


def test_all_to_all():
    step = all_to_all_cost(800e6, MESH, 1)
    assert step.seconds == pytest.approx(7e-6 + 7 / 8 * 800e6 / 300e9)
    assert step.bytes_sent == pytest.approx(700e6)


def test_broadcast_and_send_recv():
    assert broadcast_cost(GB, MESH, 1).seconds == pytest.approx(7e-6 + GB / 300e9)
    assert broadcast_cost(GB, MESH, 1).bytes_sent == GB
    assert send_recv_cost(GB, MESH, 0).seconds == pytest.approx(5e-6 + GB / 25e9)
    assert send_recv_cost(GB, MESH, 0).bytes_sent == GB


def test_several_axes_run_as_one_ring_at_the_slowest_axis():
    step = all_reduce_cost(GB, MESH, (0, 1))
    assert step.group_size == 16 and step.axes == (0, 1)
    assert step.seconds == pytest.approx(2 * 15 * 5e-6 + 2 * 15 / 16 * GB / 25e9)
    assert step.seconds == pytest.approx(0.07515)


def test_axes_by_name():
    mesh = Mesh((2, 8), bandwidth=(25e9, 300e9), axis_names=("dp", "tp"))
    assert all_reduce_cost(GB, mesh, "tp").seconds == pytest.approx(1.75 * GB / 300e9)


def test_single_device_groups_are_free():
    mesh = Mesh((1, 8), bandwidth=1e9, latency=1e-5)
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        step = collective_cost(kind, GB, mesh, 0)
        assert step.seconds == 0 and step.bytes_sent == 0
    assert collective_time("send_recv", 1e3, 1, 1e9, 1e-5) == pytest.approx(1e-5 + 1e-6)


def test_formulas_table():
    # per-rank bytes sent, n = 4, M = 400
    assert collective_bytes("all_reduce", 400, 4) == 600
    assert collective_bytes("all_gather", 400, 4) == 300
    assert collective_bytes("reduce_scatter", 400, 4) == 300
    assert collective_bytes("all_to_all", 400, 4) == 300
    assert collective_bytes("broadcast", 400, 4) == 400
    assert collective_bytes("send_recv", 400, 4) == 400
    assert collective_bytes("local_slice", 400, 4) == 0
    # time = steps * alpha + bytes / beta
    assert collective_time("all_reduce", 400, 4, 100.0, 1.0) == pytest.approx(6 + 6)
    assert collective_time("all_gather", 400, 4, 100.0, 1.0) == pytest.approx(3 + 3)
    assert collective_time("broadcast", 400, 4, 100.0, 1.0) == pytest.approx(3 + 4)


def test_bandwidth_terms_match_alpa():
    # Alpa: beta * (n-1)/n * bytes for all-gather and reduce-scatter, beta * 2(n-1)/n for
    # all-reduce (alpha and tie-breakers aside).
    for n in (2, 4, 8):
        assert collective_time("all_gather", 1e6, n, 1.0, 0.0) == pytest.approx((n - 1) / n * 1e6)
        assert collective_time("all_reduce", 1e6, n, 1.0, 0.0) == \
            pytest.approx(2 * (n - 1) / n * 1e6)


def test_step_prints_like_an_ir_line():
    text = str(all_reduce_cost(12.6e6, MESH, 1))
    assert text.startswith("all_reduce{mesh_axis=1}")
    assert "12.6 MB buffer" in text and "est" in text


def test_cost_adds():
    a = Cost(1.0, 10.0, (all_reduce_cost(1.0, MESH, 1),))
    b = Cost(2.0, 5.0, (all_gather_cost(1.0, MESH, 0),))
    total = a + b
    assert (total.seconds, total.bytes, len(total.steps)) == (3.0, 15.0, 2)
    assert not total.is_free and len(total.collectives) == 2


def test_cross_mesh_transfer_with_local_all_gather():
    from graphpar.cost.communication import cross_mesh_cost
    from graphpar.ir.mesh import Mesh

    M, B, a = 8e6, 1e9, 1e-5
    fast = Mesh((2, 2), bandwidth=1e11, latency=1e-6)
    naive = cross_mesh_cost(M, fast, B, a, local_all_gather=False)
    assert naive.seconds == pytest.approx(a + 4 * M / B)
    assert (naive.bytes_across, naive.bytes_inside) == (4 * M, 0.0)
    local = cross_mesh_cost(M, fast, B, a)
    # each tile crosses once, then one ring all-gather over the 4 destination devices
    assert local.seconds == pytest.approx(a + M / B + 3 * 1e-6 + 3 / 4 * M / 1e11)
    assert (local.bytes_across, local.bytes_inside) == (M, 4 * 3 / 4 * M)
    assert local.seconds < naive.seconds
    one = Mesh((1,))
    assert cross_mesh_cost(M, one, B, a) == cross_mesh_cost(M, one, B, a, False)


def test_a_bucketed_all_reduce_pays_its_share_of_one_latency():
    """On the measured CPU cluster (an all-reduce's alpha about 1 ms per ring step): a
    gradient all-reduced in a 1 MiB bucket pays its bytes' share of the bucket's latency and
    its whole bandwidth term; a tensor of a bucket's size or more pays everything; any
    other resharding (here a reduce-scatter) costs what resharding_cost says."""
    from graphpar.cost.communication import bucketed_resharding_seconds, resharding_cost
    from graphpar.ir.layout import Layout

    mesh = Mesh.from_string("2", get_cluster("cpu-gloo"))
    partial, whole, rows = Layout.parse("{P}"), Layout.parse("{R}"), Layout.parse("{S(0)}")
    alpha, bandwidth = 2 * 0.96e-3, 1.6e9  # 2(n-1) ring steps, the measured all_reduce fit
    small = (256, 256)  # 256 KiB in fp32: a quarter of the bucket
    alone = resharding_cost(small, 4, partial, whole, mesh).seconds
    assert alone == pytest.approx(alpha + 2 ** 18 / bandwidth)
    assert bucketed_resharding_seconds(small, 4, partial, whole, mesh, 1 << 20) == \
        pytest.approx(alpha / 4 + 2 ** 18 / bandwidth)
    big = (1024, 1024)
    assert bucketed_resharding_seconds(big, 4, partial, whole, mesh, 1 << 20) == \
        resharding_cost(big, 4, partial, whole, mesh).seconds
    assert bucketed_resharding_seconds(small, 4, partial, rows, mesh, 1 << 20) == \
        resharding_cost(small, 4, partial, rows, mesh).seconds
