"""CUDA listings on a GPU through CuPy (cuBLAS, NVRTC kernels) equal the CPU executor's run of
the same listing. Skipped without CuPy or a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from graphpar.backends.cuda.cpu_executor import CpuListingExecutor  # noqa: E402
from graphpar.backends.cuda.gpu_executor import GpuListingExecutor  # noqa: E402
from graphpar.compiler.driver import ModelSpec, compile_model  # noqa: E402
from graphpar.models import get_model  # noqa: E402
from graphpar.passes.lower_cuda import CudaListings  # noqa: E402


@pytest.mark.parametrize("name, mode", [("mlp", "infer"), ("gpt", "infer"), ("llama", "infer"),
                                        ("mlp", "train"), ("moe", "train"),
                                        ("wide_resnet", "train")])
def test_gpu_run_of_a_listing_equals_its_cpu_run(name, mode):
    ex = get_model(name, "tiny", train=mode == "train")
    spec = ModelSpec(name, ex.module, ex.inputs, ex.loss_fn, ex.targets)
    result = compile_model(spec, mode, "cleanup,lower-cuda")
    (listing,) = result.context.result(CudaListings)[result.graph.name]
    named = result.captured.bind(*(ex.inputs + (ex.targets if mode == "train" else ())))
    expected = CpuListingExecutor(listing).run(named)
    got = GpuListingExecutor(listing).run(named)
    for g, e in zip(got, expected):  # fp32 sums in another order: a few ulps of the values
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
