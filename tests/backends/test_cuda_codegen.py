"""The generated kernels' CUDA C: nvcc builds a model's kernels for sm_80 and sm_90 without a
warning, every kernel is exported by name, and the sources need only NVRTC's headers.

The nvcc test needs nvcc, not a GPU: one nvcc run builds both architectures (about 2.5 s of
CPU)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from graphpar.backends.cuda.codegen import kernel_arguments, kernel_source, module_source
from graphpar.backends.cuda.cpu_executor import CpuListingExecutor
from graphpar.backends.interpreter import Interpreter
from graphpar.ir.cuda_listing import Call
from graphpar.ir.parser import parse
from graphpar.passes.lower_cuda import lower_to_listing

NVCC = shutil.which("nvcc")


# Every kind of generated kernel, and fused expressions over many elementwise ops and dtypes.
KERNELS = """
graph @kernels(%x: f32[4,16] input, %w: f32[16] param, %b: f32[16] param,
               %e: f32[32,16] param, %i: i64[4] input, %t: i64[4] input) {
  %0 = embedding(%e, %i) : f32[4,16]
  %1 = layer_norm(%0, %w, %b) {shape=[16], eps=1e-05} : f32[4,16]
  %2 = rms_norm(%x, %w) {shape=[16], eps=1e-06} : f32[4,16]
  %3 = softmax(%1) {dim=-1} : f32[4,16]
  %4 = log_softmax(%2) {dim=1} : f32[4,16]
  %5 = gelu(%3) {approximate="tanh"} : f32[4,16]
  %6 = gelu_backward(%5, %2) {approximate="none"} : f32[4,16]
  %7 = gt(%6, 0.0) : bool[4,16]
  %8 = clamp(%4) {min=-2.0} : f32[4,16]
  %9 = where(%7, %8, %x) : f32[4,16]
  %10 = maximum(%9, %1) : f32[4,16]
  %11 = sum(%10) {dims=[0]} : f32[16]
  %12 = amax(%6) {dims=[1]} : f32[4]
  %13 = mean(%5) {dims=[0, 1]} : f32[]
  %14 = div(%10, 3.0) {rounding_mode="floor"} : f32[4,16]
  %15 = silu_backward(%14, %x) : f32[4,16]
  %16 = tanh_backward(%15, %3) : f32[4,16]
  %17 = convert(%16) {dtype="f64"} : f64[4,16]
  %18 = exp(%17) : f64[4,16]
  %19, %20 = nll_loss(%4, %t, none) {reduction=1, ignore_index=3} : f32[], f32[]
  %21 = nll_loss_backward(%13, %4, %t, %20, none) {reduction=1, ignore_index=3} : f32[4,16]
  %22 = arange() {start=1, end=7, step=2, dtype="i64"} : i64[3]
  %23 = embedding_backward(%x, %i) {num_weights=32, padding_idx=5} : f32[32,16]
  %24, %25, %26 = layer_norm_with_stats(%x, %w, %b) {shape=[16], eps=1e-05}
      : f32[4,16], f32[4,1], f32[4,1]
  return %11 output, %12 output, %13 output, %18 output, %19 output, %21 output, %22 output,
         %23 output, %24 output, %25 output, %26 output
}
"""


@pytest.fixture(scope="module")
def graph():
    return parse(KERNELS)


@pytest.fixture(scope="module")
def calls(graph) -> list[Call]:
    return lower_to_listing(graph).calls


def test_every_kernel_kind_on_the_cpu_equals_the_interpreter(graph):
    listing = lower_to_listing(graph)
    assert listing.calls_by_kind() == {
        "cuda.memsetAsync": 1, "kernel.arange": 1, "kernel.embedding": 1,
        "kernel.embedding_backward": 1, "kernel.layer_norm": 2, "kernel.log_softmax": 1,
        "kernel.nll_loss": 1, "kernel.nll_loss_backward": 1, "kernel.pointwise": 4,
        "kernel.reduce": 3, "kernel.rms_norm": 1, "kernel.softmax": 1}
    gen = torch.Generator().manual_seed(0)
    inputs = {v.name: torch.randint(0, 16, v.type.shape, generator=gen)
              if v.type.dtype == torch.int64 else torch.randn(v.type.shape, generator=gen)
              for v in graph.inputs}
    expected = Interpreter(graph).run(inputs)
    got = CpuListingExecutor(listing, poison=True).run(inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_generated_kernels_build_with_nvcc_werror_for_sm80_and_sm90(calls, tmp_path):
    source = tmp_path / "kernels.cu"
    source.write_text(module_source(calls))
    fatbin = tmp_path / "kernels.fatbin"
    cmd = [NVCC, "--fatbin", "-std=c++17", "-O3", "-Werror", "all-warnings",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "-o", str(fatbin), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "warning" not in (result.stdout + result.stderr).lower()
    names = {c["name"] for c in calls if c.kind.startswith("kernel.")}
    data = fatbin.read_bytes()
    assert all(name.encode() + b"\0" in data for name in names)


def test_sources_include_only_headers_nvrtc_has(calls):
    includes = re.findall(r"^\s*#\s*include\s*[<\"]([^>\"]+)", module_source(calls), re.M)
    assert set(includes) <= {"cuda_fp16.h", "cuda_bf16.h"}


def test_a_fused_kernel_indexes_each_operand_by_its_own_strides():
    listing = lower_to_listing(parse("""
graph @main(%x: f32[4,16] input, %b: f32[16] param) {
  %0 = add(%x, %b) : f32[4,16]
  return %0 output
}
"""))
    (call,) = listing.calls
    assert call["in0_strides"] == (16, 1) and call["in1_strides"] == (0, 1)
    source = kernel_source(call)
    # dim 1 advances every operand; dim 0 advances the output and x but not the bias
    assert "{ const long long c = r % 16LL; r /= 16LL; o += c * 1LL; o0 += c * 1LL; " \
           "o1 += c * 1LL; }" in source
    assert "{ const long long c = r; o += c * 16LL; o0 += c * 16LL; }" in source
    assert "i < 64LL" in source and "const float t0 = (float)(v0 + v1);" in source
    assert kernel_arguments(call) == ["out", "in0", "in1"]


@pytest.mark.slow  # g++ and 256 fibers per block: about 25 s on a loaded 2-core machine
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_generated_kernels_run_on_the_host_and_equal_the_interpreter(graph, tmp_path):
    """Their own CUDA C, built for the host with the emulation header (one fiber per thread,
    real block barriers), in place of the CPU executor's torch interpretation."""
    from cuda_emulated_kernels import EmulatedKernelExecutor, build

    listing = lower_to_listing(graph)
    gen = torch.Generator().manual_seed(1)
    inputs = {v.name: torch.randint(0, 16, v.type.shape, generator=gen)
              if v.type.dtype == torch.int64 else torch.randn(v.type.shape, generator=gen)
              for v in graph.inputs}
    executor = EmulatedKernelExecutor(listing, build(listing, tmp_path), poison=True)
    got = executor.run(inputs)
    assert executor.launched == len(listing.calls) - 1  # all but a memset are kernels
    for g, e in zip(got, Interpreter(graph).run(inputs)):
        # float kernels sum in another order than torch: a few ulps of each row's values
        torch.testing.assert_close(g, e, atol=2e-5, rtol=2e-5)
