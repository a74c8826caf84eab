"""The roofline: an op's time is max(FLOPs / achieved rate, bytes / bandwidth) + overhead, by the
op class declared with the op; measured collectives replace the links inside a node."""

import dataclasses
import math

import pytest
import torch

from graphpar.cost.cluster import get_cluster, mesh_for
from graphpar.cost.communication import all_reduce_cost, measured_rates, resharding_cost
from graphpar.cost.compute import Roofline, bytes_moved, node_seconds, op_class, op_seconds
from graphpar.ir.graph import Graph
from graphpar.ir.layout import Layout
from graphpar.ir.registry import all_ops, get_op
from graphpar.ir.types import TensorType

A100 = get_cluster("dgx-a100")
BF16 = Roofline.of(A100, "bf16")


def t(*shape, dtype=torch.bfloat16):
    return TensorType(shape, dtype)


def test_a_skinny_matmul_is_priced_by_its_weight_read_and_a_big_one_by_its_flops():
    # decode: 8 rows through a 4096 x 4096 weight (32 MiB in bf16)
    x, w, y = t(8, 4096), t(4096, 4096), t(8, 4096)
    assert op_class("linear", [x, w, None]) == "gemm_skinny"
    rate = BF16.rate("gemm_skinny")
    flops, moved = 2 * 8 * 4096 * 4096, (8 * 4096 + 4096 * 4096 + 8 * 4096) * 2
    assert bytes_moved("linear", [x, w, None], [y]) == moved
    assert BF16.bound("gemm_skinny", flops, moved) == "memory"
    assert op_seconds("linear", [x, w, None], [y], {}, BF16) == pytest.approx(
        moved / rate.bandwidth + rate.overhead, rel=1e-12)
    # prefill: 8192 rows through the same weight
    x, y = t(8192, 4096), t(8192, 4096)
    assert op_class("linear", [x, w, None]) == "gemm"
    rate = BF16.rate("gemm")
    flops = 2 * 8192 * 4096 * 4096
    assert BF16.bound("gemm", flops, bytes_moved("linear", [x, w, None], [y])) == "compute"
    assert op_seconds("linear", [x, w, None], [y], {}, BF16) == pytest.approx(
        flops / rate.flops + rate.overhead, rel=1e-12)


def test_the_rows_of_a_matmul_are_all_leading_dims_against_a_weight():
    assert op_class("matmul", [t(2, 4, 64), t(64, 64)]) == "gemm_skinny"  # 8 rows
    assert op_class("matmul", [t(4, 8, 64), t(64, 64)]) == "gemm"  # 32 rows
    assert op_class("matmul", [t(32, 8, 64), t(32, 64, 8)]) == "gemm_skinny"  # batched, 8 rows


def test_the_flop_only_roofline_is_flops_over_peak():
    peak = A100.peak_flops("fp32")
    x, w, y = t(8, 4096, dtype=torch.float32), t(4096, 4096, dtype=torch.float32), \
        t(8, 4096, dtype=torch.float32)
    assert op_seconds("linear", [x, w, None], [y], {}, peak) == 2 * 8 * 4096 * 4096 / peak
    assert Roofline.coerce(peak) == Roofline.flops_only(peak)
    assert dataclasses.replace(A100, compute=()).compute_rate("fp32", "gemm") == \
        (peak, math.inf, 0.0)


def test_every_op_has_a_cost_class_and_shape_ops_are_free():
    classes = {name: op.cost_class for name, op in all_ops().items()}
    assert classes["linear"] == "gemm" and classes["convolution"] == "gemm"
    assert classes["layer_norm"] == "normalization" and classes["softmax"] == "normalization"
    assert classes["sum"] == "normalization" and classes["add"] == "elementwise"
    assert classes["attention"] == "attention" and classes["paged_attention"] == "attention"
    assert classes["embedding"] == "gather" and classes["reshape_and_cache"] == "gather"
    assert classes["reshape"] == classes["all_reduce"] == classes["full"] == "free"
    g = Graph("g")
    x = g.add_input("x", t(64, 64))
    r = g.create("reshape", [x], {"shape": (4096,)})
    assert node_seconds(r, BF16) == 0.0
    n = g.create("relu", [x])
    rate = BF16.rate("elementwise")
    assert node_seconds(n, BF16) == pytest.approx(2 * 64 * 64 * 2 / rate.bandwidth
                                                  + rate.overhead, rel=1e-12)


def test_copies_are_priced_by_their_bytes_and_views_are_free():
    """Appending a token to a KV cache with `cat` reads and writes the whole cache; a view of
    it moves nothing."""
    rate = BF16.rate("elementwise")
    g = Graph("g")
    cache, new = g.add_input("cache", t(1, 8, 1023, 64)), g.add_input("new", t(1, 8, 1, 64))
    cat = g.create("cat", [cache, new], {"dim": 2})
    moved = (8 * 1023 * 64 + 8 * 64 + 8 * 1024 * 64) * 2
    assert node_seconds(cat, BF16) == pytest.approx(moved / rate.bandwidth + rate.overhead,
                                                    rel=1e-12)
    pad = g.create("pad", [new], {"pad": (0, 0, 0, 1)})
    assert node_seconds(pad, BF16) == pytest.approx(
        (8 * 64 + 8 * 2 * 64) * 2 / rate.bandwidth + rate.overhead, rel=1e-12)
    for name in ("clone", "cat", "pad", "slice_scatter", "repeat", "local_slice", "local_pad"):
        assert get_op(name).cost_class == "elementwise", name
    views = [g.create("reshape", [cache], {"shape": (8, 1023, 64)}),
             g.create("permute", [cache], {"dims": (0, 2, 1, 3)}),
             g.create("slice", [cache], {"dim": 2, "start": 0, "end": 8}),
             g.create("select", [cache], {"dim": 0, "index": 0}),
             g.create("expand", [new], {"shape": (2, 8, 1, 64)})]
    assert [node_seconds(v, BF16) for v in views] == [0.0] * len(views)


def test_a_gather_reads_the_rows_it_picks_not_the_table():
    table, ids, out = t(50_000, 768), t(4, 16, dtype=torch.int64), t(4, 16, 768)
    assert bytes_moved("embedding", [table, ids], [out]) == 4 * 16 * 8 + 2 * out.nbytes


def test_paged_attention_reads_the_blocks_its_tables_reach_not_the_pool():
    q, out = t(4, 8, 64), t(4, 8, 64)
    cache = t(1024, 16, 8, 64)  # 1024 blocks of 16 tokens
    tables, lens = t(4, 2, dtype=torch.int32), t(4, dtype=torch.int32)
    block = 16 * 8 * 64 * 2
    assert bytes_moved("paged_attention", [q, cache, cache, tables, lens], [out],
                       {"scale": 0.125, "mode": "decode"}) == \
        q.nbytes + out.nbytes + 4 * 2 * 2 * block


def test_measured_collectives_replace_the_links_inside_a_node_only():
    measured = dataclasses.replace(
        A100, collectives=(("all_reduce", 0.5e-6, 400e9), ("all_gather", 8e-6, 120e9)))
    mesh = mesh_for("2x8", measured)  # axis 0 crosses the two nodes, axis 1 stays inside
    assert {(a, k) for a, k, _, _ in measured_rates(mesh)} == {(1, "all_reduce"),
                                                               (1, "all_gather")}
    inside = all_reduce_cost(1e9, mesh, 1)
    assert inside.seconds == pytest.approx(2 * 7 * 0.5e-6 + 2 * 7 / 8 * 1e9 / 400e9)
    plain = mesh_for("2x8", dataclasses.replace(A100, num_nodes=2))
    assert all_reduce_cost(1e9, mesh, 0).seconds == all_reduce_cost(1e9, plain, 0).seconds
    # kinds it did not measure keep the links
    assert resharding_cost((8, 1024), 4, Layout.parse("{R,S(1)}"), Layout.parse("{R,S(0)}"),
                           mesh).seconds == \
        resharding_cost((8, 1024), 4, Layout.parse("{R,S(1)}"), Layout.parse("{R,S(0)}"),
                        plain).seconds
    # resharding uses them: a partial sum reduced along axis 1 by the (faster) measured one
    src, dst = Layout.parse("{R,P}"), Layout.parse("{R,R}")
    assert resharding_cost((1024, 1024), 4, src, dst, mesh).seconds == pytest.approx(
        all_reduce_cost(4 * 1024 * 1024, mesh, 1).seconds)


def test_transcendental_ops_count_their_flops_per_element_in_their_declaration():
    """GELU's erf is about ten adds' work per element: declared once with the op, counted by
    the FLOP rule, priced by the one elementwise rate."""
    x, y = t(1024, dtype=torch.float32), t(1024, dtype=torch.float32)
    assert get_op("add").flops([x, x], [y], {}) == 1024
    for name in ("gelu", "exp", "tanh", "erf", "silu", "gelu_backward"):
        assert get_op(name).flops_per_element == 10, name
    assert get_op("gelu").flops([x], [y], {}) == 10 * 1024
    assert get_op("relu").flops([x], [y], {}) == 1024
    slow = dataclasses.replace(A100, compute=(("fp32", "elementwise", 1e9, 1e12, 0.0),))
    roof = Roofline.of(slow, "fp32")
    assert op_seconds("gelu", [x], [y], {}, roof) == pytest.approx(
        10 * op_seconds("relu", [x], [y], {}, roof))
