"""The convolution, pooling, batch-norm and routing lowerings (convolution as im2col + GEMM, col2im,
max pooling, batch norm, top-k, cumsum, scatter, softmax over any dim and its backward, nll_loss
with class weights, attention with a mask tensor): their
listings on the CPU equal the reference interpreter, the index kernels' CUDA C builds with nvcc
-Werror, and (slow) runs on the host through the emulation header."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from graphpar.backends.cuda.codegen import module_source
from graphpar.backends.cuda.cpu_executor import CpuListingExecutor
from graphpar.backends.interpreter import Interpreter
from graphpar.errors import UnsupportedOpError
from graphpar.ir.cuda_listing import parse_listing, print_listing
from graphpar.ir.parser import parse
from graphpar.passes.lower_cuda import lower_to_listing

NVCC = shutil.which("nvcc")

# Windows with stride, padding and dilation (the overlapping taps col2im must sum), batch
# norm in its three forms, and the routing ops along a dim that is not the last.
GRAPH = """
graph @windows(%x: f32[2,3,9,9] input, %w: f32[4,3,3,3] param, %cb: f32[4] param,
               %g: f32[2,4,4,4] input, %bw: f32[4] param, %bb: f32[4] param,
               %rm: f32[4] buffer, %rv: f32[4] buffer, %s: f32[3,5,6] input,
               %idx: i64[3,5,2] input, %src: f32[3,5,2] input, %lp: f32[6,5] input,
               %tg: i64[6] input, %cw: f32[5] param) {
  %0 = convolution(%x, %w, %cb) {stride=[2, 2], padding=[1, 1], dilation=[2, 2], groups=1}
      : f32[2,4,4,4]
  %1, %2, %3 = convolution_backward(%g, %x, %w) {stride=[2, 2], padding=[1, 1], dilation=[2, 2],
      groups=1, bias=true, mask=[true, true, true]} : f32[2,3,9,9], f32[4,3,3,3], f32[4]
  %4, %5 = max_pool2d(%x) {kernel=[3, 3], stride=[2, 2], padding=[1, 1], dilation=[1, 1],
      ceil_mode=false} : f32[2,3,5,5], i64[2,3,5,5]
  %6 = max_pool2d_backward(%4, %x, %5) {kernel=[3, 3], stride=[2, 2], padding=[1, 1],
      dilation=[1, 1], ceil_mode=false} : f32[2,3,9,9]
  %7 = batch_norm(%0, %bw, %bb, %rm, %rv) {momentum=0.1, eps=1e-05} : f32[2,4,4,4]
  %8, %9, %10, %11, %12 = batch_norm_train(%0, %bw, %bb, %rm, %rv) {momentum=0.1, eps=1e-05}
      : f32[2,4,4,4], f32[4], f32[4], f32[4], f32[4]
  %13, %14, %15 = batch_norm_backward(%g, %0, %bw, %rm, %rv, %9, %10) {eps=1e-05,
      mask=[true, true, true]} : f32[2,4,4,4], f32[4], f32[4]
  %16, %17 = topk(%s) {k=3, dim=1, largest=false, sorted=true} : f32[3,3,6], i64[3,3,6]
  %18 = cumsum(%s) {dim=1} : f32[3,5,6]
  %19 = scatter(%s, %idx, %src) {dim=2} : f32[3,5,6]
  %20 = scatter_add(%s, %idx, %src) {dim=2} : f32[3,5,6]
  %21 = softmax(%s) {dim=1} : f32[3,5,6]
  %22 = softmax_backward(%s, %21) {dim=1} : f32[3,5,6]
  %23 = log_softmax(%lp) {dim=1} : f32[6,5]
  %24, %25 = nll_loss(%23, %tg, %cw) {reduction=1, ignore_index=2} : f32[], f32[]
  %26 = nll_loss_backward(%24, %23, %tg, %25, %cw) {reduction=1, ignore_index=2} : f32[6,5]
  return %0 output, %1 output, %2 output, %3 output, %4 output, %5 output, %6 output,
         %7 output, %8 output, %9 output, %10 output, %11 output, %12 output, %13 output,
         %14 output, %15 output, %16 output, %17 output, %18 output, %19 output, %20 output,
         %21 output, %22 output, %24 output, %25 output, %26 output
}
"""


@pytest.fixture(scope="module")
def graph():
    return parse(GRAPH)


def _inputs(graph) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {v.name: torch.randn(v.type.shape, generator=gen) for v in graph.inputs
           if v.type.dtype != torch.int64}
    out["rv"] = out["rv"].abs() + 0.5
    out["cw"] = out["cw"].abs() + 0.1  # class weights
    out["tg"] = torch.tensor([0, 2, 4, 1, 2, 3])  # two rows ignored (ignore_index=2)
    # distinct positions per row, so scatter's result does not depend on write order
    out["idx"] = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(15)]).view(
        3, 5, 2)
    return out


def test_windows_norms_and_routing_on_the_cpu_equal_the_interpreter(graph):
    listing = lower_to_listing(graph)
    kinds = listing.calls_by_kind()
    for kind in ("kernel.im2col", "kernel.col2im", "kernel.max_pool2d",
                 "kernel.max_pool2d_backward", "kernel.topk", "kernel.cumsum", "kernel.scatter"):
        assert kind in kinds, kind
    listing = parse_listing(print_listing(listing))
    inputs = _inputs(graph)
    expected = Interpreter(graph).run(inputs)
    executor = CpuListingExecutor(listing, poison=True)
    got = executor.run(inputs)
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"out {i}: {m}")
    assert executor.peak_arena_bytes == listing.arena_bytes


def test_a_1x1_convolution_reads_the_image_in_place():
    listing = lower_to_listing(parse("""
graph @main(%x: f32[2,8,5,5] input, %w: f32[16,8,1,1] param) {
  %0 = convolution(%x, %w, none) {stride=[1, 1], padding=[0, 0], dilation=[1, 1], groups=1}
      : f32[2,16,5,5]
  return %0 output
}
"""))
    (gemm,) = listing.calls  # W [16, 8] shared (stride 0) times each image [8, 25]
    assert gemm.kind == "cublas.gemmStridedBatchedEx"
    assert {k: gemm[k] for k in ("m", "n", "k", "strideA", "strideB", "batchCount")} == dict(
        m=25, n=16, k=8, strideA=200, strideB=0, batchCount=2)


@pytest.mark.parametrize("conv", [
    "convolution(%x, %w, none) {stride=[1], padding=[0], dilation=[1], groups=1} : f32[2,4,3]",
    "convolution(%x, %w, none) {stride=[1], padding=[0], dilation=[1], groups=1, "
    "transposed=true, output_padding=[0]} : f32[2,4,7]",
])
def test_a_1d_or_transposed_convolution_is_refused_by_name(conv):
    """The listings hold 2-D, ungrouped, non-transposed convolutions; the IR has more."""
    graph = parse(f"""
graph @main(%x: f32[2,4,5] input, %w: f32[4,4,3] param) {{
  %0 = {conv}
  return %0 output
}}
""")
    with pytest.raises(UnsupportedOpError, match="other than 2-D and non-transposed"):
        lower_to_listing(graph)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_index_kernels_build_with_nvcc_werror_for_sm80_and_sm90(graph, tmp_path):
    calls = [c for c in lower_to_listing(graph).calls]
    source = tmp_path / "kernels.cu"
    source.write_text(module_source(calls))
    cmd = [NVCC, "--fatbin", "-std=c++17", "-O3", "-Werror", "all-warnings",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "-o", str(tmp_path / "kernels.fatbin"), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "warning" not in (result.stdout + result.stderr).lower()


@pytest.mark.slow  # g++ and one fiber per CUDA thread
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_index_kernels_run_on_the_host_and_equal_the_interpreter(graph, tmp_path):
    from cuda_emulated_kernels import EmulatedKernelExecutor, build

    listing = lower_to_listing(graph)
    inputs = _inputs(graph)
    executor = EmulatedKernelExecutor(listing, build(listing, tmp_path), poison=True)
    got = executor.run(inputs)
    for i, (g, e) in enumerate(zip(got, Interpreter(graph).run(inputs))):
        # float kernels sum in another order than torch: a few ulps
        torch.testing.assert_close(g, e, atol=2e-5, rtol=2e-5, msg=lambda m, i=i: f"out {i}: {m}")


def test_attention_with_a_mask_tensor_equals_the_interpreter():
    """A boolean mask keeps scores where it holds; a float mask is added to them (in place,
    between the scores GEMM and the softmax kernel); the backward recomputes the same P."""
    graph = parse("""
graph @masked(%q: f32[1,2,4,8] input, %k: f32[1,2,5,8] input, %v: f32[1,2,5,8] input,
              %keep: bool[4,5] input, %bias: f32[1,1,4,5] input, %do: f32[1,2,4,8] input) {
  %0 = attention(%q, %k, %v, %keep) {scale=0.5} : f32[1,2,4,8]
  %1, %2 = attention_with_lse(%q, %k, %v, %bias) {scale=0.5} : f32[1,2,4,8], f32[1,2,4]
  %3, %4, %5 = attention_backward(%do, %q, %k, %v, %1, %2, %bias) {scale=0.5}
      : f32[1,2,4,8], f32[1,2,5,8], f32[1,2,5,8]
  return %0 output, %1 output, %2 output, %3 output, %4 output, %5 output
}
""")
    gen = torch.Generator().manual_seed(2)
    inputs = {v.name: torch.randn(v.type.shape, generator=gen) for v in graph.inputs}
    keep = torch.rand(4, 5, generator=gen) > 0.3
    keep[:, 0] = True  # no row fully masked (its softmax would be NaN in both)
    inputs["keep"] = keep
    listing = lower_to_listing(graph)
    executor = CpuListingExecutor(listing, poison=True)
    got = executor.run(inputs)
    for i, (g, e) in enumerate(zip(got, Interpreter(graph).run(inputs))):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"out {i}: {m}")
    assert executor.peak_arena_bytes == listing.arena_bytes


def test_batch_norm_of_a_channel_slice_keeps_its_dense_copy_until_its_last_step():
    """A channel slice (as a sharded plan's local_slice gives) is not contiguous: the lowering
    copies it dense, and later steps of the same node (the variance, the output, dx) read that
    copy, so no step of the node may write over it in place."""
    graph = parse("""
graph @main(%x: f32[2,8,3,3] input, %gx: f32[2,8,3,3] input, %bw: f32[4] param,
            %bb: f32[4] param, %rm: f32[4] buffer, %rv: f32[4] buffer) {
  %0 = slice(%x) {dim=1, start=4, end=8} : f32[2,4,3,3]
  %1, %2, %3, %4, %5 = batch_norm_train(%0, %bw, %bb, %rm, %rv) {momentum=0.1, eps=1e-05}
      : f32[2,4,3,3], f32[4], f32[4], f32[4], f32[4]
  %6 = slice(%gx) {dim=1, start=0, end=4} : f32[2,4,3,3]
  %7, %8, %9 = batch_norm_backward(%6, %0, %bw, %rm, %rv, %2, %3) {eps=1e-05,
      mask=[true, true, true]} : f32[2,4,3,3], f32[4], f32[4]
  return %1 output, %2 output, %3 output, %4 output, %5 output, %7 output, %8 output, %9 output
}
""")
    gen = torch.Generator().manual_seed(0)
    inputs = {v.name: torch.randn(v.type.shape, generator=gen) for v in graph.inputs}
    inputs["rv"] = inputs["rv"].abs() + 0.5
    expected = Interpreter(graph).run(inputs)
    listing = parse_listing(print_listing(lower_to_listing(graph)))
    got = CpuListingExecutor(listing, poison=True).run(inputs)
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"out {i}: {m}")
