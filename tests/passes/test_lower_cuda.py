"""lower-cuda: the calls a device program becomes, their parameters, and the memory plan."""

from __future__ import annotations

import random

import pytest

from graphpar.errors import OutOfMemoryError, UnsupportedOpError
from graphpar.ir.parser import parse
from graphpar.passes import PassContext, run_pipeline
from graphpar.passes.lower_cuda import CudaListings, lower_to_listing
from graphpar.passes.lower_cuda.memory_plan import (
    Interval,
    aligned,
    check_no_overlap,
    live_bytes_bound,
    place,
)


def _lower(text: str, **kw):
    return lower_to_listing(parse(text), **kw)


LINEAR_RELU = """
graph @main(%w: f32[4,8] param, %b: f32[4] param, %x: f32[3,8] input) {
  %0 = linear(%x, %w, %b) : f32[3,4]
  %1 = relu(%0) : f32[3,4]
  %2 = mul(%1, 2.0) : f32[3,4]
  return %2 output
}
"""


def test_linear_is_one_gemm_and_its_bias_and_activation_one_kernel_in_place():
    listing = _lower(LINEAR_RELU)
    assert str(listing) == """\
listing @main rank=0 mesh=[1] arena=256 state=768 lower_bound=256
  input w state+0 dtype=f32 shape=[4,8] strides=[8,1] role=param
  input b state+256 dtype=f32 shape=[4] strides=[1] role=param
  input x state+512 dtype=f32 shape=[3,8] strides=[8,1] role=input
  buffer b0 arena+0 bytes=48 live=0..2
  call cublas.gemmEx transa=T transb=N m=4 n=3 k=8 alpha=1.0 A=state+0 Atype=f32 lda=8 \
B=state+512 Btype=f32 ldb=8 beta=0.0 C=arena+0 Ctype=f32 ldc=4 \
computeType=CUBLAS_COMPUTE_32F  # node 0 (linear)
  call kernel.pointwise name=pw_c2fef82fb9 shape=[3,4] n=12 out=arena+0 out_dtype=f32 \
out_strides=[4,1] in0=arena+0 in0_dtype=f32 in0_strides=[4,1] in1=state+256 in1_dtype=f32 \
in1_strides=[0,1] expr=mul(relu(add(x0,x1)),const(2.0))  # outputs
  output 0 arena+0 dtype=f32 shape=[3,4] strides=[4,1] role=output
"""


def test_transposes_fold_into_gemm_operands_and_views_make_no_call():
    listing = _lower("""
graph @main(%a: f32[8,5] input, %b: f32[6,8] input) {
  %0 = permute(%a) {dims=[1, 0]} : f32[5,8]
  %1 = permute(%b) {dims=[1, 0]} : f32[8,6]
  %2 = matmul(%0, %1) : f32[5,6]
  %3 = reshape(%2) {shape=[30]} : f32[30]
  return %3 output
}
""")
    (gemm,) = listing.calls
    # C[5,6] = a^T b^T: cuBLAS computes C^T = b a (both stored transposed: T, T)
    assert gemm.kind == "cublas.gemmEx"
    assert (gemm["transa"], gemm["transb"], gemm["m"], gemm["n"], gemm["k"]) == ("T", "T", 6, 5, 8)
    assert (gemm["lda"], gemm["ldb"], gemm["ldc"]) == (8, 5, 6)
    assert listing.outputs[0].shape == (30,) and listing.outputs[0].addr == gemm["C"]


def test_batched_matmul_is_strided_batched_and_a_shared_operand_folds_the_batch():
    listing = _lower("""
graph @main(%a: f32[2,3,4] input, %b: f32[2,4,5] input, %w: f32[4,7] param) {
  %0 = matmul(%a, %b) : f32[2,3,5]
  %1 = matmul(%a, %w) : f32[2,3,7]
  return %0 output, %1 output
}
""")
    batched, folded = listing.calls
    assert batched.kind == "cublas.gemmStridedBatchedEx"
    assert {k: batched[k] for k in ("m", "n", "k", "lda", "strideA", "ldb", "strideB", "ldc",
                                     "strideC", "batchCount")} == dict(
        m=5, n=3, k=4, lda=5, strideA=20, ldb=4, strideB=12, ldc=5, strideC=15, batchCount=2)
    assert folded.kind == "cublas.gemmEx" and (folded["m"], folded["n"]) == (7, 6)


def test_attention_is_gemm_softmax_gemm():
    listing = _lower("""
graph @main(%q: f32[1,2,4,8] input, %k: f32[1,2,4,8] input, %v: f32[1,2,4,8] input) {
  %0 = attention(%q, %k, %v) {causal=true, scale=0.5} : f32[1,2,4,8]
  return %0 output
}
""")
    kinds = [c.kind for c in listing.calls]
    assert kinds == ["cublas.gemmStridedBatchedEx", "kernel.softmax",
                     "cublas.gemmStridedBatchedEx"]
    scores, softmax, _ = listing.calls
    assert scores["alpha"] == 0.5 and scores["transa"] == "T"  # K^T read in place
    assert (softmax["rows"], softmax["cols"], softmax["causal"], softmax["sq"]) == (8, 4, True, 4)


def test_an_op_without_lowering_names_the_op_and_node():
    with pytest.raises(UnsupportedOpError, match=r"node 0 \(argmax\).*op 'argmax' has no CUDA"):
        _lower("""
graph @main(%x: f32[4,8] input) {
  %0 = argmax(%x) {dim=1} : i64[4]
  return %0 output
}
""")


def test_a_plan_over_the_memory_limit_says_by_how_much_and_what_is_live():
    with pytest.raises(OutOfMemoryError, match=r"needs 256 bytes of arena, 156 bytes more than "
                                                r"the device's 100; at call 0 these are live: b0"):
        _lower(LINEAR_RELU, memory_limit=100)


def test_lower_cuda_is_a_pass_with_its_listings_as_a_result():
    ctx = PassContext()
    graph = parse(LINEAR_RELU)
    from graphpar.passes import PassManager, parse_pipeline

    PassManager(parse_pipeline("lower-cuda")).run(graph, ctx)
    (listing,) = ctx.result(CudaListings)["main"]
    assert [c.kind for c in listing.calls] == ["cublas.gemmEx", "kernel.pointwise"]
    with pytest.raises(OutOfMemoryError, match="206 bytes more than the device's 50"):
        run_pipeline(parse(LINEAR_RELU), "lower-cuda{memory_limit=50}")


# ------------------------------------------------------------------------- the memory plan

def _random_intervals(rng: random.Random, n: int, sizes) -> list[Interval]:
    out = []
    for i in range(n):
        first = rng.randrange(20)
        out.append(Interval(f"b{i}", rng.choice(sizes), first, first + rng.randrange(6)))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_best_fit_never_overlaps_and_meets_the_bound_for_equal_sizes(seed):
    rng = random.Random(seed)
    mixed = _random_intervals(rng, 30, [100, 256, 700, 2048])
    arena = place(mixed)
    check_no_overlap(mixed)
    assert arena >= live_bytes_bound(mixed, 30)
    # equal sizes: an interval graph's clique number of slots suffices, and best fit finds it
    equal = _random_intervals(rng, 30, [512])
    assert place(equal) == live_bytes_bound(equal, 30)


def test_the_bound_and_the_plan_on_a_small_case_by_hand():
    # a [0,1], b [1,2], c [2,3]: a and c can share; b overlaps both
    bufs = [Interval("a", 1000, 0, 1), Interval("b", 300, 1, 2), Interval("c", 900, 2, 3)]
    assert live_bytes_bound(bufs, 4) == aligned(1000) + aligned(300)
    assert place(bufs) == aligned(1000) + aligned(300)
    assert bufs[0].offset == bufs[2].offset


def test_an_output_is_never_overwritten_by_another_output_computed_from_it():
    # %0 is an output; %1 = %0 * 2 is computed at the end, when %0 is "dead" to the walk
    listing = _lower("""
graph @main(%a: f32[8,8] input, %b: f32[8,8] input) {
  %0 = matmul(%a, %b) : f32[8,8]
  %1 = mul(%0, 2.0) : f32[8,8]
  return %0 output, %1 output
}
""")
    gemm, scale = listing.calls
    assert scale["in0"] == gemm["C"] and scale["out"] != gemm["C"]
    assert listing.outputs[0].addr != listing.outputs[1].addr
