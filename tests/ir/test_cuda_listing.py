"""CUDA listings print and parse back to equal listings; kernel expressions round-trip."""

from __future__ import annotations

import pytest

from graphpar.errors import IRParseError
from graphpar.ir.cuda_listing import (
    Addr,
    Apply,
    BufferSlot,
    Call,
    Const,
    Leaf,
    Listing,
    TensorRef,
    format_expr,
    parse_expr,
    parse_listing,
    print_listing,
)


def _listing() -> Listing:
    listing = Listing("step", rank=3, mesh=(2, 2), arena_bytes=1024, state_bytes=512,
                      lower_bound_bytes=768)
    listing.inputs = [TensorRef("w", Addr("state", 0), "f32", (4, 8), (8, 1), "param")]
    listing.buffers = [BufferSlot("b0", Addr("arena", 256), 96, -1, 2)]
    listing.calls = [
        Call("cublas.gemmStridedBatchedEx", (("transa", "T"), ("m", 4), ("alpha", 0.125),
                                             ("A", Addr("state", 0)), ("strideA", 0),
                                             ("beta", 0.0)), "node 0 (matmul)"),
        Call("kernel.pointwise", (("name", "pw_0"), ("shape", (3, 4)), ("in0_strides", (0, 1)),
                                  ("expr", "where(x0,const(-inf),gelu(x1,approximate=tanh))"),
                                  ("w", None), ("causal", True))),
        Call("nccl.groupStart", ()),
    ]
    listing.outputs = [TensorRef("0", Addr("arena", 256), "f32", (), (), "update:w")]
    return listing


def test_listing_round_trips():
    listing = _listing()
    text = print_listing(listing)
    assert parse_listing(text) == listing
    assert print_listing(parse_listing(text)) == text
    assert text.splitlines()[0] == ("listing @step rank=3 mesh=[2,2] arena=1024 state=512 "
                                    "lower_bound=768")
    assert "  call cublas.gemmStridedBatchedEx transa=T m=4 alpha=0.125 A=state+0 strideA=0 " \
           "beta=0.0  # node 0 (matmul)" in text
    assert "  buffer b0 arena+256 bytes=96 live=-1..2" in text


def test_expressions_round_trip():
    e = Apply("mul", (Apply("relu", (Apply("add", (Leaf(0), Leaf(1))),)), Const(2.0)))
    assert format_expr(e) == "mul(relu(add(x0,x1)),const(2.0))"
    for text in ["mul(relu(add(x0,x1)),const(2.0))", "clamp(x0,min=None,max=-1e-05)",
                 "convert(const(0),dtype=f32)", "x3", "where(x0,const(-inf),x1)"]:
        assert format_expr(parse_expr(text)) == text
    assert parse_expr("clamp(x0,min=None,max=6.0)").attrs == (("min", None), ("max", 6.0))


@pytest.mark.parametrize("text", ["", "  call gemm m=1", "listing @a rank=0\n  frob x"])
def test_malformed_listings_are_parse_errors(text):
    with pytest.raises(IRParseError):
        parse_listing(text)
