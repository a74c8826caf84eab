"""The op registry as a whole: every op declares what passes need, and its sharding rule fits it."""

import pytest
import torch

import graphpar.passes.autoshard  # noqa: F401  (attaches the sharding rules to the ops)
from graphpar.capture.aten_table import TABLE
from graphpar.ir import load_ops
from graphpar.ir.graph import Graph, Value
from graphpar.ir.registry import OpKind, Trait, all_ops, get_op
from graphpar.ir.types import TensorType
from graphpar.passes.autoshard.factors import FactorSpec, register_sharding_rules


def t(*shape, dtype=torch.float32):
    return TensorType(tuple(shape), dtype)


X = t(4, 8)
B = t(4, 8, dtype=torch.bool)
XI = t(4, 8, dtype=torch.int64)
IMG = t(2, 3, 8, 8)
Q = t(2, 2, 4, 8)
CACHE = t(4, 2, 2, 8)
C3 = t(3)


def ex(*operands, **attrs):
    return operands, attrs


# One small valid use of each op that has a sharding rule. Elementwise ops not listed here take
# one or two f32[4, 8] operands.
EXAMPLES = {
    "where": ex(B, X, X),
    "clamp": ex(X, min=0.0),
    "convert": ex(X, dtype="f16"),
    "threshold_backward": ex(X, X, threshold=0.0),
    "bitwise_not": ex(XI),
    "bitwise_and": ex(XI, XI),
    "bitwise_or": ex(XI, XI),
    "bitwise_xor": ex(XI, XI),
    "clone": ex(X),
    "softmax": ex(X, dim=1),
    "log_softmax": ex(X, dim=1),
    "softmax_backward": ex(X, X, dim=1),
    "log_softmax_backward": ex(X, X, dim=1),
    "cumsum": ex(X, dim=1),
    "tril": ex(X),
    "triu": ex(X),
    "flip": ex(X, dims=(0,)),
    "pad": ex(X, pad=(1, 1)),
    "repeat": ex(X, repeats=(2, 1)),
    "slice": ex(X, dim=1, start=0, end=4),
    "slice_scatter": ex(X, t(4, 4), dim=1, start=0, end=4),
    "select": ex(X, dim=0, index=1),
    "select_scatter": ex(X, t(8), dim=0, index=1),
    "cat": ex(X, X, dim=0),
    "permute": ex(X, dims=(1, 0)),
    "expand": ex(t(1, 8), shape=(4, 8)),
    "reshape": ex(X, shape=(2, 2, 8)),
    "sum": ex(X, dims=(1,)),
    "mean": ex(X, dims=(1,), keepdim=True),
    "amax": ex(X, dims=(0,)),
    "amin": ex(X, dims=None),
    "any": ex(B, dims=(1,)),
    "all": ex(B, dims=(1,)),
    "prod": ex(X, dim=1),
    "var": ex(X, dims=(1,)),
    "argmax": ex(X, dim=1),
    "argmin": ex(X, dim=0, keepdim=True),
    "topk": ex(X, k=2, dim=1),
    "sort": ex(X, dim=1),
    "matmul": ex(t(2, 4, 8), t(8, 3)),
    "linear": ex(X, t(3, 8), C3),
    "attention": ex(Q, Q, Q, causal=True),
    "attention_with_lse": ex(Q, Q, Q),
    "attention_backward": ex(Q, Q, Q, Q, Q, t(2, 2, 4)),
    "reshape_and_cache": ex(CACHE, CACHE, t(3, 2, 8), t(3, 2, 8), t(3, dtype=torch.int64)),
    "paged_attention": ex(t(2, 4, 8), CACHE, CACHE, t(2, 2, dtype=torch.int32),
                          t(2, dtype=torch.int32), scale=0.5),
    "layer_norm": ex(t(2, 4, 8), t(8), t(8), shape=(8,)),
    "layer_norm_with_stats": ex(t(2, 4, 8), t(8), t(8), shape=(8,)),
    "layer_norm_backward": ex(t(2, 4, 8), t(2, 4, 8), t(2, 4, 1), t(2, 4, 1), t(8), t(8),
                              shape=(8,)),
    "rms_norm": ex(t(2, 4, 8), t(8), shape=(8,)),
    "embedding": ex(t(10, 8), t(2, 3, dtype=torch.int64)),
    "embedding_backward": ex(t(2, 3, 8), t(2, 3, dtype=torch.int64), num_weights=10),
    "convolution": ex(IMG, t(4, 3, 3, 3), t(4), stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                       groups=1),
    "convolution_backward": ex(t(2, 4, 6, 6), IMG, t(4, 3, 3, 3), stride=(1, 1), padding=(0, 0),
                                dilation=(1, 1), groups=1),
    "batch_norm": ex(t(2, 3, 4, 4), C3, C3, C3, C3),
    "batch_norm_train": ex(t(2, 3, 4, 4), C3, C3, C3, C3),
    "batch_norm_backward": ex(t(2, 3, 4, 4), t(2, 3, 4, 4), C3, C3, C3, C3, C3),
    "max_pool2d": ex(IMG, kernel=(2, 2), stride=(2, 2), padding=(0, 0), dilation=(1, 1)),
    "max_pool2d_backward": ex(t(2, 3, 4, 4), IMG, t(2, 3, 4, 4, dtype=torch.int64),
                              kernel=(2, 2), stride=(2, 2), padding=(0, 0), dilation=(1, 1)),
    "nll_loss": ex(t(4, 10), t(4, dtype=torch.int64), None, reduction=2),
    "nll_loss_backward": ex(t(), t(4, 10), t(4, dtype=torch.int64), t(), reduction=1),
    "full": ex(shape=(4, 8), value=0.0, dtype="f32"),
    "index_add": ex(X, t(3, dtype=torch.int64), t(3, 8), dim=0),
    "grouped_mm": ex(X, t(3, 8, 5), t(3, dtype=torch.int32), t(3, dtype=torch.int32)),
}


def example_node(name: str):
    """A graph holding one node of op `name`, built from its example."""
    if name in EXAMPLES:
        candidates = [EXAMPLES[name]]
    elif get_op(name).kind is OpKind.ELEMENTWISE:
        candidates = [ex(X), ex(X, X)]
    else:
        raise AssertionError(f"op {name!r} has a sharding rule but no example in EXAMPLES: add "
                             "one, so its rule is checked against its types")
    errors = []
    for operands, attrs in candidates:
        graph = Graph(f"example_{name}")
        inputs = [None if ty is None else graph.add_input(f"x{i}", ty)
                  for i, ty in enumerate(operands)]
        try:
            return graph.create(name, inputs, attrs)
        except TypeError as exc:
            errors.append(str(exc))
    raise AssertionError(f"the example of {name!r} does not type-check: {errors}")


def test_every_op_has_a_sharding_rule_or_is_replicate_only():
    for name, op in all_ops().items():
        has_rule = op.sharding_rule is not None
        replicate_only = op.has(Trait.REPLICATE_ONLY)
        assert has_rule != replicate_only, (
            f"{name}: {'both a sharding rule and' if has_rule else 'neither a sharding rule nor'}"
            " the replicate-only trait")


def _check_ranks(name: str, node, spec: FactorSpec) -> None:
    factors = range(len(spec.sizes))
    for i, v in enumerate(node.inputs):
        dims = spec.operands[i] if i < len(spec.operands) else None
        if isinstance(v, Value) and dims is not None:
            assert len(dims) == v.type.rank, (
                f"{name}: operand {i} is {v.type} but the rule gives it factors {dims}")
            assert all(f is None or f in factors for f in dims), (name, i, dims)
    assert len(spec.results) == len(node.outputs) == len(spec.reductions), (
        f"{name}: {len(node.outputs)} results, rule has {len(spec.results)} "
        f"(reductions {len(spec.reductions)})")
    for r, (out, dims) in enumerate(zip(node.outputs, spec.results)):
        assert len(dims) == out.type.rank, (
            f"{name}: result {r} is {out.type} but the rule gives it factors {dims}")
        assert all(f is None or f in factors for f in dims), (name, r, dims)
        assert set(spec.reductions[r]) <= set(factors), (name, r, spec.reductions[r])
    assert spec.blocked <= set(factors), (name, spec.blocked)


@pytest.mark.parametrize("name", sorted(n for n, op in all_ops().items()
                                        if op.sharding_rule is not None))
def test_sharding_rule_factor_ranks_agree_with_the_op_types(name):
    node = example_node(name)
    spec = get_op(name).sharding_rule(node)
    if spec is not None:
        _check_ranks(name, node, spec)


def test_prod_reduces_its_one_dim():
    spec = get_op("prod").sharding_rule(example_node("prod"))
    assert spec.results == [(0,)] and spec.blocked == {1}  # a rank-1 result; dim 1 whole


def test_a_rule_for_an_unknown_op_or_a_second_rule_is_refused():
    with pytest.raises(Exception, match="unknown op 'no_such_op'"):
        get_op("no_such_op").attach_sharding_rule(lambda node: None)
    with pytest.raises(ValueError, match="already has a sharding rule"):
        get_op("matmul").attach_sharding_rule(lambda node: None)
    with pytest.raises(ValueError, match="replicate-only"):
        get_op("gather").attach_sharding_rule(lambda node: None)


def test_loading_twice_registers_nothing_twice():
    before = all_ops()
    load_ops()
    register_sharding_rules()
    assert all_ops() == before
    assert get_op("matmul").sharding_rule.__name__ == "_matmul"


def test_traits_replace_the_passes_private_op_lists():
    def having(trait):
        return {n for n, op in all_ops().items() if op.has(trait)}

    assert having(Trait.SHAPE_ATTR) == {"reshape", "expand", "full"}
    assert having(Trait.KEEPS_UNIFORM) == {"reshape", "expand", "permute", "slice", "select",
                                           "flip", "repeat", "clone", "cat"}
    assert having(Trait.WRITES_OPERAND) == {"reshape_and_cache"}
    assert {"layer_norm", "softmax", "nll_loss", "batch_norm_backward"} <= having(
        Trait.FOLLOWS_OPERAND)
    assert not {"matmul", "linear", "attention", "convolution", "embedding", "reshard",
                "paged_attention"} & having(Trait.FOLLOWS_OPERAND)


def test_communicating_ops_declare_their_comm_kind():
    kinds = {n: op.comm_kind for n, op in all_ops().items() if op.comm_kind is not None}
    assert kinds == {"all_reduce": "all_reduce", "all_gather": "all_gather",
                     "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all",
                     "send": "send_recv", "recv": "send_recv", "send_tiles": "send_recv",
                     "recv_tile": "send_recv", "local_slice": "local_slice",
                     "local_zero": "local_zero", "local_pad": "local_pad"}


def test_aten_names_give_the_capture_table_its_one_to_one_entries():
    aten = torch.ops.aten
    for name, op in all_ops().items():
        if op.aten is not None:
            packet = getattr(aten, op.aten)
            overloads = ["Tensor", "Scalar"] if "Tensor" in packet.overloads() else ["default"]
            for overload in overloads:
                assert getattr(packet, overload) in TABLE, (name, overload)
    assert get_op("neg").aten == "neg" and get_op("maximum").aten == "maximum"
    assert get_op("add").aten is None  # alpha: lowered by hand
