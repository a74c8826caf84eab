"""Layouts: placements per mesh axis, local shapes and slices, and both text forms."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphpar.errors import ShardingError
from graphpar.ir.layout import (
    Layout,
    Partial,
    Placement,
    Replicate,
    Shard,
    all_layouts,
    parse_placement,
)
from graphpar.ir.mesh import Mesh

L = Layout.parse


def placements(max_dim: int = 4) -> st.SearchStrategy[Placement]:
    return st.one_of(
        st.builds(Shard, st.integers(0, max_dim - 1)),
        st.just(Replicate()),
        st.builds(Partial, st.sampled_from(["sum", "avg", "max", "min"])),
    )


def layouts(max_axes: int = 4, max_dim: int = 4) -> st.SearchStrategy[Layout]:
    return st.lists(placements(max_dim), min_size=1, max_size=max_axes).map(
        lambda ps: Layout(tuple(ps)))


def test_placements_are_frozen_hashable_values():
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1)
    assert Replicate() == Replicate() and Partial() == Partial("sum") != Partial("max")
    assert Replicate() != Partial() and Shard(0) != Replicate()
    assert len({Shard(0), Shard(0), Replicate(), Partial(), Partial("max")}) == 4
    with pytest.raises(AttributeError):
        Shard(0).dim = 1  # type: ignore[misc]
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert Partial().is_partial() and Replicate().is_replicate()


@pytest.mark.parametrize("bad", [lambda: Shard(-1), lambda: Partial("prod"),
                                 lambda: Layout(()), lambda: Layout(("R",))])
def test_invalid_placements(bad):
    with pytest.raises(ValueError):
        bad()


def test_text_forms():
    layout = Layout((Shard(0), Replicate()))
    assert str(layout) == "{S(0),R}"
    assert str(Layout((Partial(), Shard(1)))) == "{P,S(1)}"
    assert str(Layout((Replicate(), Partial("max")))) == "{R,P(max)}"
    assert L("{ S(0) , R }") == layout
    assert L("{P(sum),S(1)}") == Layout((Partial(), Shard(1)))
    assert repr(layout) == "Layout.parse('{S(0),R}')"
    assert parse_placement("S(12)") == Shard(12)


@pytest.mark.parametrize("text, message", [
    ("S(0),R", "braces"),
    ("{S(0),X}", "entry 1"),
    ("{S0,R}", "entry 0"),
    ("{}", "entry 0"),
    ("{P(prod)}", "reduce_op"),
    ("{S(-1)}", "entry 0"),
])
def test_parse_errors(text, message):
    with pytest.raises(ValueError, match=message):
        L(text)


@given(layouts(max_dim=12))
def test_ir_text_round_trips(layout):
    text = str(layout)
    assert L(text) == layout
    assert str(L(text)) == text


def test_structure_queries():
    layout = L("{S(0),P,S(0),R,S(2)}")
    assert layout.mesh_ndim == 5
    assert layout.shard_axes(0) == (0, 2) and layout.shard_axes(1) == ()
    assert layout.dim_map() == {0: (0, 2), 2: (4,)}
    assert layout.sharded_dims == (0, 2)
    assert layout.partial_axes == (1,) and layout.replicated_axes == (3,)
    assert layout.sharded_axes == (0, 2, 4)
    assert layout.axis_dim(4) == 2 and layout.axis_dim(1) is None
    assert layout.is_partial and layout.is_sharded and not layout.is_replicated
    assert Layout.replicated(3).is_replicated and str(Layout.replicated(2)) == "{R,R}"
    assert layout.with_placement(1, Replicate()) == L("{S(0),R,S(0),R,S(2)}")
    assert list(layout)[4] == Shard(2) and layout[1] == Partial() and len(layout) == 5


def test_local_shape():
    mesh = Mesh((2, 4))
    assert L("{S(0),S(1)}").local_shape((8, 16), mesh) == (4, 4)
    assert L("{S(0),S(0)}").local_shape((8, 16), mesh) == (1, 16)
    assert L("{R,S(1)}").local_shape((8, 16), mesh) == (8, 4)
    assert L("{P,S(1)}").local_shape((8, 16), mesh) == (8, 4)
    assert L("{R,R}").local_shape((8, 16), mesh) == (8, 16)
    assert L("{S(1),R}").local_bytes((8, 16), 4, mesh) == 8 * 8 * 4
    assert L("{S(0),S(0)}").num_shards(0, mesh) == 8


def test_indivisible_dim_says_what_and_how():
    mesh = Mesh((2, 4))
    with pytest.raises(ShardingError) as info:
        L("{R,S(1)}").local_shape((8, 10), mesh)
    message = str(info.value)
    for part in ("dim 1", "size 10", "mesh axis 1", "4 chunks", "not divisible by 4",
                 "shard another dim"):
        assert part in message
    with pytest.raises(ShardingError, match=r"mesh axes 0, 1 .*2x4 = 8 chunks"):
        L("{S(0),S(0)}").local_shape((4, 16), mesh)
    assert not L("{S(0),S(0)}").fits((4, 16), mesh)
    assert L("{S(0),S(0)}").fits((16, 16), mesh)


def test_shape_and_mesh_mismatches():
    with pytest.raises(ShardingError, match="tensor dim 2 .* 2 dim"):
        L("{S(2),R}").local_shape((8, 8), Mesh((2, 2)))
    with pytest.raises(ShardingError, match="2 placement.*3 axes"):
        L("{S(0),R}").local_shape((8, 8), Mesh((2, 2, 2)))


# Alpa Table 1: the 9 specs of an (N, M) tensor on the 2x2 mesh [[0,1],[2,3]].
# Each entry: spec -> {device: (rows, cols)} as (start, stop) pairs for N = M = 8.
TABLE_1 = {
    "RR": {0: ((0, 8), (0, 8)), 3: ((0, 8), (0, 8))},
    "S0S1": {0: ((0, 4), (0, 4)), 1: ((0, 4), (4, 8)), 2: ((4, 8), (0, 4)), 3: ((4, 8), (4, 8))},
    "S1S0": {0: ((0, 4), (0, 4)), 1: ((4, 8), (0, 4)), 2: ((0, 4), (4, 8)), 3: ((4, 8), (4, 8))},
    "S0R": {0: ((0, 4), (0, 8)), 1: ((0, 4), (0, 8)), 2: ((4, 8), (0, 8)), 3: ((4, 8), (0, 8))},
    "S1R": {0: ((0, 4), (0, 8)), 1: ((4, 8), (0, 8)), 2: ((0, 4), (0, 8)), 3: ((4, 8), (0, 8))},
    "RS0": {0: ((0, 8), (0, 4)), 1: ((0, 8), (0, 4)), 2: ((0, 8), (4, 8)), 3: ((0, 8), (4, 8))},
    "RS1": {0: ((0, 8), (0, 4)), 1: ((0, 8), (4, 8)), 2: ((0, 8), (0, 4)), 3: ((0, 8), (4, 8))},
    "S01R": {0: ((0, 2), (0, 8)), 1: ((2, 4), (0, 8)), 2: ((4, 6), (0, 8)), 3: ((6, 8), (0, 8))},
    "RS01": {0: ((0, 8), (0, 2)), 1: ((0, 8), (2, 4)), 2: ((0, 8), (4, 6)), 3: ((0, 8), (6, 8))},
}


@pytest.mark.parametrize("spec", sorted(TABLE_1))
def test_alpa_table_1_device_slices(spec):
    mesh = Mesh((2, 2))
    layout = Layout.from_alpa(spec, 2)
    assert layout.alpa(2) == spec
    for device, expected in TABLE_1[spec].items():
        got = layout.local_slices((8, 8), mesh, device)
        assert tuple((s.start, s.stop) for s in got) == expected


def test_alpa_table_1_is_all_layouts_without_partial():
    assert sorted(layout.alpa(2) for layout in all_layouts((8, 8), Mesh((2, 2)))) == \
        sorted(TABLE_1)


def test_alpa_notation():
    assert L("{S(0),R}").alpa(2) == "S0R"
    assert L("{R,S(1)}").alpa(2) == "RS1"
    assert L("{S(0),S(0)}").alpa(3) == "S01RR"
    assert L("{P,S(1)}").alpa(2) == "RS1|P0"
    assert L("{P,P}").alpa(2) == "RR|P01"
    assert L("{P(max),P}").alpa(2) == "RR|P0(max)|P1"
    assert Layout.from_alpa("RS1|P0", 2) == L("{P,S(1)}")
    assert Layout.from_alpa("S0R", 3) == L("{S(0),R,R}")
    assert Layout.from_alpa("RR|P1(max)", 2) == L("{R,P(max)}")


@pytest.mark.parametrize("text, message", [
    ("S10R", "ascending"),
    ("S0S0", "twice"),
    ("S0R|P0", "twice"),
    ("S2R", "mesh axis 2"),
    ("SR", "not Alpa notation"),
    ("RR|P0(prod)", "reduce op"),
])
def test_alpa_notation_errors(text, message):
    with pytest.raises(ValueError, match=message):
        Layout.from_alpa(text, 2)


@given(layouts(max_axes=4, max_dim=4), st.integers(0, 3))
def test_alpa_notation_round_trips(layout, extra_dims):
    tensor_ndim = max([p.dim + 1 for p in layout if isinstance(p, Shard)], default=0) + extra_dims
    text = layout.alpa(tensor_ndim)
    back = Layout.from_alpa(text, layout.mesh_ndim)
    assert back == layout
    assert back.alpa(tensor_ndim) == text


def test_alpa_notation_needs_the_tensor_dims():
    with pytest.raises(ShardingError, match="shards tensor dim 1"):
        L("{S(1)}").alpa(1)


@settings(deadline=None)  # the first call imports torch.distributed.tensor
@given(layouts(max_axes=3, max_dim=3))
def test_torch_placements_round_trip(layout):
    assert Layout.from_torch(layout.to_torch()) == layout


def test_torch_placements_print_alike():
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS

    assert L("{S(0),R}").to_torch() == (TS(0), TR())
    assert str(TS(0)) == str(Shard(0))


def test_all_layouts_filters_by_divisibility():
    mesh = Mesh((2, 4))
    assert len(all_layouts((8, 8), mesh)) == 9
    # dim 1 of size 2 cannot take the 4-way axis
    layouts_ = all_layouts((8, 2), mesh)
    assert L("{R,S(1)}") not in layouts_ and L("{S(1),R}") in layouts_
    assert len(all_layouts((8, 8), mesh, include_partial=True)) == 16
    assert all_layouts((8, 8), mesh)[0] == Layout.replicated(2)
