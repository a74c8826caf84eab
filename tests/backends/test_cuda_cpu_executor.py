"""CUDA listings run call for call on the CPU compute what the reference interpreter computes,
write exactly the arena the plan reserved, and show plan or parameter bugs instead of hiding
them (freed buffers are poisoned with NaN bytes)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from graphpar.backends.cuda.cpu_executor import CpuListingExecutor
from graphpar.backends.interpreter import Interpreter
from graphpar.compiler.driver import ModelSpec, compile_model
from graphpar.errors import BackendError
from graphpar.ir.cuda_listing import Call, parse_listing, print_listing
from graphpar.models import get_model
from graphpar.passes.lower_cuda import CudaListings


@functools.cache
def _compiled(name: str, mode: str):
    ex = get_model(name, "tiny", train=mode == "train")
    spec = ModelSpec(name, ex.module, ex.inputs, ex.loss_fn, ex.targets)
    result = compile_model(spec, mode, "cleanup,lower-cuda", keep_grads=mode == "train")
    (listing,) = result.context.result(CudaListings)[result.graph.name]
    args = ex.inputs + (ex.targets if mode == "train" else ())
    named = result.captured.bind(*args)
    expected = Interpreter(result.graph).run(named)
    return listing, named, expected


CASES = [("mlp", "infer"), ("gpt", "infer"), ("mlp", "train"),
         pytest.param("gpt", "train", marks=pytest.mark.slow),
         pytest.param("llama", "infer", marks=pytest.mark.slow),
         pytest.param("bert", "infer", marks=pytest.mark.slow),
         pytest.param("llama", "train", marks=pytest.mark.slow),  # grouped-query backward
         pytest.param("bert", "train", marks=pytest.mark.slow),
         ("wide_resnet", "train"),  # convolutions, pooling, batch norm and their backwards
         pytest.param("wide_resnet", "infer", marks=pytest.mark.slow),
         pytest.param("moe", "infer", marks=pytest.mark.slow),  # top-k, cumsum
         pytest.param("moe", "train", marks=pytest.mark.slow)]  # scatter, softmax_backward


@pytest.mark.parametrize("name, mode", CASES)
def test_listing_on_the_cpu_equals_the_reference_interpreter(name, mode):
    listing, named, expected = _compiled(name, mode)
    listing = parse_listing(print_listing(listing))  # what a worker reads
    executor = CpuListingExecutor(listing, poison=True)
    got = executor.run(named)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"out {i}: {m}")
    assert executor.peak_arena_bytes == listing.arena_bytes  # measured = planned


def _replace(listing, index: int, **params):
    call = listing.calls[index]
    new = Call(call.kind, tuple((k, params.get(k, v)) for k, v in call.params), call.note)
    return dataclasses.replace(listing, calls=listing.calls[:index] + [new]
                               + listing.calls[index + 1:])


def test_a_wrong_leading_dimension_is_caught():
    listing, named, expected = _compiled("mlp", "infer")
    gemm = next(i for i, c in enumerate(listing.calls) if c.kind == "cublas.gemmEx")
    k = listing.calls[gemm]["lda"]
    with pytest.raises(BackendError, match="lda=31 < 32"):
        CpuListingExecutor(_replace(listing, gemm, lda=k - 1)).run(named)
    # one too many: reads the wrong elements (or past the state region)
    try:
        out = CpuListingExecutor(_replace(listing, gemm, lda=k + 1)).run(named)
    except BackendError:
        return
    assert not torch.allclose(out[0], expected[0])


def test_a_buffer_freed_too_early_is_poisoned():
    listing, named, _ = _compiled("mlp", "infer")
    first = listing.buffers[0]
    early = dataclasses.replace(first, last=first.first)  # "dead" right after it is written
    broken = dataclasses.replace(listing, buffers=[early] + listing.buffers[1:])
    out = CpuListingExecutor(broken, poison=True).run(named)
    assert torch.isnan(out[0]).any()
    assert not torch.isnan(CpuListingExecutor(listing, poison=True).run(named)[0]).any()
