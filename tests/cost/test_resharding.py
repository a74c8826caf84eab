"""Resharding plans: the step for each transition kind, Alpa's Table 2, and a simulation
of every plan on per-device arrays that checks it yields exactly the target layout."""

import dataclasses
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphpar.cost.cluster import get_cluster
from graphpar.cost.communication import (
    StepKind,
    resharding_cost,
    resharding_cost_matrix,
)
from graphpar.errors import ShardingError
from graphpar.ir.layout import Layout, all_layouts
from graphpar.ir.mesh import Mesh

L = Layout.parse
F32 = 4


def kinds(cost):
    return [(s.kind.value, s.axes[0]) for s in cost.steps]


# ---------------------------------------------------------------- 1-D mesh, one step each

MESH1 = Mesh((4,))  # abstract: seconds == bytes sent
SHAPE = (8, 8)  # 256 bytes in f32


@pytest.mark.parametrize("src, dst, kind, buffer, sent, gather_dim, scatter_dim", [
    ("{S(0)}", "{R}", "all_gather", 256, 192, 0, None),
    ("{P}", "{R}", "all_reduce", 256, 384, None, None),
    ("{P}", "{S(1)}", "reduce_scatter", 256, 192, None, 1),
    ("{S(0)}", "{S(1)}", "all_to_all", 64, 48, 0, 1),
    ("{R}", "{S(0)}", "local_slice", 0, 0, None, 0),
    ("{R}", "{P}", "local_zero", 0, 0, None, None),
    ("{S(1)}", "{P}", "local_pad", 0, 0, 1, None),
])
def test_each_transition_on_a_1d_mesh(src, dst, kind, buffer, sent, gather_dim, scatter_dim):
    cost = resharding_cost(SHAPE, F32, L(src), L(dst), MESH1)
    assert len(cost.steps) == 1
    (step,) = cost.steps
    assert (step.kind.value, step.axes, step.group_size) == (kind, (0,), 4)
    assert (step.nbytes, step.bytes_sent) == (buffer, sent)
    assert (step.gather_dim, step.scatter_dim) == (gather_dim, scatter_dim)
    assert (step.src, step.dst) == (L(src), L(dst))
    assert cost.seconds == sent and cost.bytes == sent


def test_reduce_ops_of_partial():
    cost = resharding_cost(SHAPE, F32, L("{P(max)}"), L("{R}"), MESH1)
    assert kinds(cost) == [("all_reduce", 0)] and cost.steps[0].reduce_op == "max"
    # reduce-scatter(max), then each device pads its chunk with zeros: a partial sum, and
    # half the bytes of all-reduce(max) + local_zero
    cost = resharding_cost(SHAPE, F32, L("{P(max)}"), L("{P}"), MESH1)
    assert kinds(cost) == [("reduce_scatter", 0), ("local_pad", 0)]
    cost = resharding_cost(SHAPE, F32, L("{P(avg)}"), L("{S(0)}"), MESH1)
    assert kinds(cost) == [("reduce_scatter", 0)] and cost.steps[0].reduce_op == "avg"


# ---------------------------------------------------------------- Alpa Table 2, 2-D mesh

MESH2 = Mesh((2, 4))  # (n0, n1)
M = 8 * 8 * F32


@pytest.mark.parametrize("src, dst, expected", [
    ("RR", "S0S1", []),  # free: local slices
    ("S0R", "RR", [("all_gather", 0, M)]),
    ("S0S1", "S0R", [("all_gather", 1, M / 2)]),
    ("S0R", "RS0", [("all_to_all", 0, M / 2)]),
    ("S0S1", "S01R", [("all_to_all", 1, M / 8)]),
])
def test_alpa_table_2(src, dst, expected):
    cost = resharding_cost(SHAPE, F32, Layout.from_alpa(src, 2), Layout.from_alpa(dst, 2), MESH2)
    assert [(s.kind.value, s.axes[0], s.nbytes) for s in cost.collectives] == expected


def test_nested_shards_gather_minor_axis_first():
    cost = resharding_cost(SHAPE, F32, L("{S(0),S(0)}"), L("{R,R}"), MESH2)
    assert [(k, a, s.nbytes) for (k, a), s in zip(kinds(cost), cost.steps)] == \
        [("all_gather", 1, M / 2), ("all_gather", 0, M)]


def test_nested_shards_slice_major_axis_first():
    cost = resharding_cost(SHAPE, F32, L("{R,R}"), L("{S(0),S(0)}"), MESH2)
    assert kinds(cost) == [("local_slice", 0), ("local_slice", 1)]
    assert cost.seconds == 0


def test_partial_on_two_axes():
    # the search finds the hierarchical all-reduce: reduce-scatter inside the 4-axis,
    # all-reduce the quarter across the 2-axis, all-gather back: 448 bytes, not 384 + 256
    cost = resharding_cost(SHAPE, F32, L("{P,P}"), L("{R,R}"), MESH2)
    assert kinds(cost) == [("reduce_scatter", 1), ("all_reduce", 0), ("all_gather", 1)]
    assert cost.bytes == 192 + 64 + 192
    cost = resharding_cost(SHAPE, F32, L("{P,P}"), L("{S(0),S(1)}"), MESH2)
    assert sorted(kinds(cost)) == [("reduce_scatter", 0), ("reduce_scatter", 1)]


def test_slow_axis_moves_less_data():
    # P on both axes -> S(0) on both: reduce-scatter on the slow inter-node axis last,
    # when the buffer is smallest.
    mesh = Mesh((2, 4), bandwidth=(1e9, 100e9))
    cost = resharding_cost((64, 64), F32, L("{P,P}"), L("{S(1),S(0)}"), mesh)
    assert kinds(cost) == [("reduce_scatter", 1), ("reduce_scatter", 0)]


def test_alpha_counts_steps():
    mesh = Mesh((8,), bandwidth=1e9, latency=1e-3)
    cost = resharding_cost((8, 8), F32, L("{S(0)}"), L("{R}"), mesh)
    assert cost.seconds == pytest.approx(7 * 1e-3 + 7 / 8 * 256 / 1e9)


def test_swap_goes_through_a_third_dim_when_cheaper():
    mesh = Mesh((2, 2), bandwidth=(1.0, 1.0))
    cost = resharding_cost((8, 8, 8), F32, L("{S(0),S(1)}"), L("{S(1),S(0)}"), mesh)
    assert [k for k, _ in kinds(cost)] == ["all_to_all"] * 3
    assert cost.seconds == 3 * 256
    # a 2-D tensor has no third dim: gather, move, slice
    cost = resharding_cost((8, 8), F32, L("{S(0),S(1)}"), L("{S(1),S(0)}"), mesh,
                           via_partial=False)
    assert [k for k, _ in kinds(cost)] == ["all_gather", "all_to_all", "local_slice"]
    assert cost.seconds == 128
    # or pad to a partial sum, move, reduce-scatter: the same bytes, one step fewer
    cost = resharding_cost((8, 8), F32, L("{S(0),S(1)}"), L("{S(1),S(0)}"), mesh)
    assert [k for k, _ in kinds(cost)] == ["local_pad", "all_to_all", "reduce_scatter"]
    assert cost.seconds == 128


DGX2X8 = Mesh.from_string("2x8", dataclasses.replace(get_cluster("dgx-a100"), num_nodes=2))


def test_hierarchical_all_gather_on_two_nodes():
    # a matrix: shard the other dim on the fast axis, so 1/8 crosses the slow one
    cost = resharding_cost((1024, 1024), 2, L("{S(0),R}"), L("{R,R}"), DGX2X8)
    assert kinds(cost) == [("local_slice", 1), ("all_gather", 0), ("all_gather", 1)]
    assert cost.steps[1].nbytes == 1024 * 1024 * 2 / 8
    # a vector has no other dim: pad to a partial sum and all-reduce 1/8 across nodes
    direct = resharding_cost((2**26,), 2, L("{S(0),R}"), L("{R,R}"), DGX2X8, via_partial=False)
    assert kinds(direct) == [("all_gather", 0)]
    cost = resharding_cost((2**26,), 2, L("{S(0),R}"), L("{R,R}"), DGX2X8)
    assert kinds(cost) == [("local_pad", 0), ("local_slice", 1), ("all_reduce", 0),
                           ("all_gather", 1)]
    assert direct.seconds / cost.seconds == pytest.approx(2.49, abs=0.01)
    assert cost.bytes > direct.bytes  # faster, but more bytes in all


def test_results_are_cached_and_ignore_device_ids():
    a = resharding_cost(SHAPE, F32, L("{S(0),R}"), L("{R,S(1)}"), MESH2)
    b = resharding_cost(SHAPE, F32, L("{S(0),R}"), L("{R,S(1)}"),
                        Mesh((2, 4), device_ids=range(8, 16), axis_names=("x", "y")))
    assert a is b


def test_layouts_must_fit():
    with pytest.raises(ShardingError, match="not divisible"):
        resharding_cost((6, 8), F32, L("{S(0),R}"), L("{R,S(0)}"), MESH2)
    with pytest.raises(ShardingError, match="placement"):
        resharding_cost(SHAPE, F32, L("{S(0)}"), L("{R}"), MESH2)


def test_cost_matrix():
    layouts = [L("{R,R}"), L("{S(0),R}"), L("{P,R}")]
    matrix = resharding_cost_matrix(SHAPE, F32, layouts, layouts, MESH2)
    assert [matrix[i][i] for i in range(3)] == [0, 0, 0]
    assert matrix[0][1] == 0 and matrix[1][0] == M / 2 and matrix[2][0] == M


def test_tensors_of_one_class_reshard_alike():
    """Only the bytes and which shardings divide each dim matter (each dim's gcd with the
    mesh size): (8, 12) and (24, 4) on 2x2 share their searches and every cost."""
    a, b = (8, 12), (24, 4)
    layouts = all_layouts(a, MESH2, include_partial=True)
    assert layouts == all_layouts(b, MESH2, include_partial=True)
    for src in layouts:
        for dst in layouts:
            x, y = (resharding_cost(shape, F32, src, dst, MESH2) for shape in (a, b))
            assert (x.seconds, x.bytes, [str(s) for s in x.steps]) == \
                (y.seconds, y.bytes, [str(s) for s in y.steps])


def test_a_full_cost_matrix_on_a_3d_mesh_is_one_search_per_source():
    """Every layout pair of a 3-D tensor on 2x2x2 (15,625 pairs): 47 s of CPU with a
    search per pair, 0.5 s with one per source (measured)."""
    mesh = Mesh((2, 2, 2), bandwidth=(1e11, 1e10, 1e9), latency=(1e-6, 5e-6, 1e-5))
    layouts = all_layouts((8, 16, 32), mesh, include_partial=True)
    assert len(layouts) == 125
    start = time.process_time()
    matrix = resharding_cost_matrix((8, 16, 32), F32, layouts, layouts, mesh)
    seconds = time.process_time() - start
    assert np.all(np.diag(matrix) == 0) and np.all(np.array(matrix) >= 0)
    assert matrix[3][7] == resharding_cost((8, 16, 32), F32, layouts[3], layouts[7],
                                           mesh).seconds
    assert seconds < 6.0, f"{seconds:.1f} s of CPU for 125 sources"


def test_cost_prints_its_steps():
    text = str(resharding_cost(SHAPE, F32, L("{S(0),S(0)}"), L("{R,R}"), MESH2))
    assert text.splitlines()[0].endswith("2 collective(s)")
    assert "all_gather{mesh_axis=1, gather_dim=0} {S(0),S(0)} -> {S(0),R}" in text


# ---------------------------------------------------------------- properties

MESHES = [
    Mesh((4,)),
    Mesh((2, 2), bandwidth=(1.0, 3.0), latency=(1.0, 0.0)),
    Mesh((2, 4), bandwidth=(1.0, 10.0), latency=0.5),
    Mesh((2, 2, 2), bandwidth=(1.0, 2.0, 4.0)),
]
SHAPES = [(8, 8), (4, 8, 2), (16,)]
CASES = [(mesh, shape, all_layouts(shape, mesh, include_partial=True))
         for mesh in MESHES for shape in SHAPES]


@st.composite
def plans(draw):
    mesh, shape, layouts = draw(st.sampled_from(CASES))
    return mesh, shape, draw(st.sampled_from(layouts)), draw(st.sampled_from(layouts))


@given(plans())
def test_resharding_to_itself_is_free(case):
    mesh, shape, src, _ = case
    cost = resharding_cost(shape, F32, src, src, mesh)
    assert cost.seconds == 0 and cost.bytes == 0 and cost.steps == ()


@given(plans(), st.data())
def test_triangle_inequality(case, data):
    mesh, shape, a, c = case
    b = data.draw(st.sampled_from(next(ls for m, s, ls in CASES if m == mesh and s == shape)))
    direct = resharding_cost(shape, F32, a, c, mesh).seconds
    via = resharding_cost(shape, F32, a, b, mesh).seconds + \
        resharding_cost(shape, F32, b, c, mesh).seconds
    assert direct <= via + 1e-9


def _initial(mesh, layout, x, rng):
    """Per-device arrays of `x` laid out as `layout`, with random partial sums."""
    values = {d: x[layout.local_slices(x.shape, mesh, d)].copy() for d in mesh.device_ids}
    if layout.partial_axes:
        for group in mesh.groups(layout.partial_axes):
            weights = rng.integers(-3, 4, size=len(group))
            weights[0] = 1 - weights[1:].sum()
            for device, w in zip(group, weights):
                values[device] = values[device] * w
    return values


def _apply(step, mesh, values):
    """Run one step on per-device numpy arrays, as lower-spmd would."""
    kind, n = step.kind, step.group_size
    g, s = step.gather_dim, step.scatter_dim
    for group in mesh.groups(step.axes):
        xs = [values[d] for d in group]
        for k, device in enumerate(group):
            if kind is StepKind.ALL_GATHER:
                out = np.concatenate(xs, axis=g)
            elif kind is StepKind.ALL_REDUCE:
                out = sum(xs)
            elif kind is StepKind.REDUCE_SCATTER:
                out = np.split(sum(xs), n, axis=s)[k]
            elif kind is StepKind.ALL_TO_ALL:
                out = np.concatenate([np.split(x, n, axis=s)[k] for x in xs], axis=g)
            elif kind is StepKind.LOCAL_SLICE:
                out = np.split(xs[k], n, axis=s)[k]
            elif kind is StepKind.LOCAL_ZERO:
                out = xs[k] if k == 0 else np.zeros_like(xs[k])
            elif kind is StepKind.LOCAL_PAD:
                parts = [np.zeros_like(xs[k])] * n
                parts[k] = xs[k]
                out = np.concatenate(parts, axis=g)
            else:
                raise AssertionError(kind)
            values[device] = out


def _assert_holds(mesh, layout, x, values):
    for d in mesh.device_ids:
        assert values[d].shape == layout.local_shape(x.shape, mesh)
    if not layout.partial_axes:
        for d in mesh.device_ids:
            np.testing.assert_array_equal(values[d], x[layout.local_slices(x.shape, mesh, d)])
        return
    for group in mesh.groups(layout.partial_axes):
        expected = x[layout.local_slices(x.shape, mesh, group[0])]
        np.testing.assert_array_equal(sum(values[d] for d in group), expected)


@settings(max_examples=300, deadline=None)
@given(plans(), st.integers(0, 2**32 - 1), st.booleans())
def test_every_plan_computes_the_target_layout(case, seed, via_partial):
    mesh, shape, src, dst = case
    rng = np.random.default_rng(seed)
    x = rng.integers(-100, 100, size=shape)
    values = _initial(mesh, src, x, rng)
    cost = resharding_cost(shape, F32, src, dst, mesh, via_partial=via_partial)
    layout = src
    for step in cost.steps:
        assert step.src == layout
        _apply(step, mesh, values)
        layout = step.dst
        local_shape = layout.local_shape(shape, mesh)
        assert all(values[d].shape == local_shape for d in mesh.device_ids)
    assert layout == dst
    _assert_holds(mesh, dst, x, values)
    assert cost.seconds == pytest.approx(sum(s.seconds for s in cost.steps))
    assert cost.bytes == pytest.approx(sum(s.bytes_sent for s in cost.steps))
