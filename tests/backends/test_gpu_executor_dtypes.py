"""The GPU executor's dtype and NCCL choices, checked on the CPU without CuPy: bf16 moves as
its bits, cuBLAS and NCCL get their own bf16 type, and an average NCCL lacks is a sum divided
by the group size (after the group's end when it is grouped)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphpar.backends.cuda import gpu_executor
from graphpar.backends.cuda.gpu_executor import (
    GpuListingExecutor,
    array_dtype,
    cuda_data_type,
    divide_in_place,
    from_storage,
    host_array,
    nccl_datatype,
    nccl_reduce_op,
)
from graphpar.errors import BackendError
from graphpar.ir.cuda_listing import Addr, Call, Listing, TensorRef
from graphpar.ir.types import DTYPES_BY_NAME

# cupy.cuda.nccl as CuPy 13 has it (values from nccl.h), and as an older CuPy / NCCL has it
NCCL = dict(NCCL_SUM=0, NCCL_PROD=1, NCCL_MAX=2, NCCL_MIN=3, NCCL_AVG=4, NCCL_INT8=0,
            NCCL_UINT8=1, NCCL_INT32=2, NCCL_INT64=4, NCCL_FLOAT16=6, NCCL_FLOAT32=7,
            NCCL_FLOAT64=8, NCCL_BFLOAT16=9)
OLD = {k: v for k, v in NCCL.items() if k not in ("NCCL_AVG", "NCCL_BFLOAT16")}


def nccl_module(constants=NCCL, version=22000, **more):
    return SimpleNamespace(**constants, get_version=lambda: version, **more)


def some(name: str, n: int = 64) -> torch.Tensor:
    """Values of IR dtype `name`, with infinities and a NaN where it has them."""
    dtype = DTYPES_BY_NAME[name]
    g = torch.Generator().manual_seed(len(name))
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-100 if dtype != torch.uint8 else 0, 100, (n,), generator=g,
                             dtype=dtype)
    x = (torch.randn(n, generator=g) * 50).to(dtype)
    if dtype.is_floating_point:
        x[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e-30]).to(dtype)
    return x


def test_the_module_imports_without_cupy_and_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(BackendError, match=r"pip install 'graphpar\[cuda\]'"):
        gpu_executor._cupy()
    assert "graphpar[cuda]" in gpu_executor.__doc__ and "graphpar[gpu]" not in gpu_executor.__doc__


@pytest.mark.parametrize("name", sorted(DTYPES_BY_NAME))
def test_every_ir_dtype_has_an_array_dtype_of_its_size_and_round_trips_bit_exactly(name):
    x = some(name)
    assert array_dtype(name).itemsize == x.element_size()
    host = host_array(x)  # as the executor copies an input to the device
    assert host.dtype == array_dtype(name)
    back = from_storage(torch.from_numpy(host.copy()), name)  # and an output back
    assert back.dtype == x.dtype
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))


def test_bf16_is_its_bit_pattern_and_a_strided_view_reads_as_bf16():
    x = torch.tensor([1.0, -2.5, 3.0e38, float("nan")], dtype=torch.bfloat16)
    assert host_array(x).tolist() == x.view(torch.int16).tolist()
    strided = torch.from_numpy(np.arange(8, dtype=np.int16))[::2]  # what DLPack gives
    assert torch.equal(from_storage(strided, "bf16"), strided.view(torch.bfloat16))
    with pytest.raises(BackendError, match="no array type for dtype 'u16'"):
        array_dtype("u16")


def test_cublas_gets_bf16_from_the_cuda_headers_where_cupy_does_not_name_it():
    runtime = SimpleNamespace(CUDA_R_32F=0, CUDA_R_64F=1, CUDA_R_16F=2)  # CuPy's: no 16BF
    assert [cuda_data_type(runtime, n) for n in ("f32", "f64", "f16", "bf16")] == [0, 1, 2, 14]
    assert cuda_data_type(SimpleNamespace(CUDA_R_16BF=14), "bf16") == 14
    with pytest.raises(BackendError, match="cuBLAS GEMMs take f32, f64, f16, bf16, not i64"):
        cuda_data_type(runtime, "i64")


def test_nccl_types_and_what_moves_as_bytes():
    new, old = nccl_module(), nccl_module(OLD)
    assert nccl_datatype(new, "bf16", "sum") == (9, 1)
    assert nccl_datatype(new, "f16") == (6, 1) and nccl_datatype(new, "bool", "max") == (1, 1)
    # no NCCL type: moved as bytes (all-gather, send, receive) ...
    assert nccl_datatype(old, "bf16") == (1, 2)
    assert nccl_datatype(new, "i16") == (1, 2) and nccl_datatype(new, "c64") == (1, 8)
    # ... summed componentwise, or refused with what to do
    assert nccl_datatype(new, "c64", "avg") == (7, 2)
    with pytest.raises(BackendError, match="no NCCL_BFLOAT16: install a newer CuPy"):
        nccl_datatype(old, "bf16", "sum")
    with pytest.raises(BackendError, match="cannot max-reduce c64"):
        nccl_datatype(new, "c64", "max")


def test_an_average_without_ncclavg_is_a_sum_to_divide():
    assert nccl_reduce_op(nccl_module(), "avg") == (4, False)
    assert nccl_reduce_op(nccl_module(OLD), "avg") == (0, True)  # CuPy names no NCCL_AVG
    assert nccl_reduce_op(nccl_module(version=20907), "avg") == (0, True)  # NCCL before 2.10
    assert nccl_reduce_op(nccl_module(NCCL | {"NCCL_AVG": None}), "avg") == (0, True)
    assert nccl_reduce_op(nccl_module(OLD), "max") == (2, False)
    with pytest.raises(BackendError, match="not 'prod'"):
        nccl_reduce_op(nccl_module(), "prod")


@pytest.mark.parametrize("name", ["bf16", "f16", "f32", "f64", "c64"])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_dividing_in_place_equals_torch(name, n):
    x = some(name)
    host = host_array(x).copy()
    divide_in_place(np, host, n, name)
    got = from_storage(torch.from_numpy(host), name)
    want = (x.float() / n).to(x.dtype) if name in ("bf16", "f16") else x / n
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def test_dividing_an_integer_tensor_is_refused():
    with pytest.raises(BackendError, match="only floating-point"):
        divide_in_place(np, np.zeros(4, np.int32), 2, "i32")


# --------------------------------------------------------------- the executor over NumPy

class NumpyAsCupy:
    """The few CuPy functions the executor uses, on host arrays."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def asnumpy(a):
        return np.asarray(a)


class HostStream:
    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class SameOnEveryRank:
    """A communicator of `n` ranks that all hold this rank's values: a sum is n times them."""

    def __init__(self, executor, n: int, name: str):
        self.executor, self.n, self.name, self.calls = executor, n, name, []

    def size(self):
        return self.n

    def allReduce(self, send, recv, count, datatype, op, stream):
        self.calls.append(("allReduce", count, datatype, op))
        view = lambda a: self.executor._view(a, self.name, (count,), (1,))  # noqa: E731
        x = from_storage(torch.from_numpy(view(send).copy()), self.name)
        reduced = x * self.n if op == NCCL["NCCL_SUM"] else x  # avg, max, min of equal values
        view(recv)[...] = host_array(reduced)


def host_executor(listing: Listing, nccl, name: str = "f32", n: int = 4):
    """A GpuListingExecutor whose device memory is host memory and whose CuPy is NumPy."""
    ex = GpuListingExecutor.__new__(GpuListingExecutor)
    ex.cupy, ex.listing, ex.stream = NumpyAsCupy(), listing, HostStream()
    ex.regions = {"arena": np.zeros(1024, np.uint8), "state": np.zeros(1024, np.uint8)}
    ex.ptr = lambda addr: addr  # the host communicator reads addresses through `_view`
    ex._nccl_module, ex._grouped, ex._after_group = nccl, False, []
    ex.comms = {"axes0": SameOnEveryRank(ex, n, name)}
    return ex


def test_a_bf16_listing_moves_its_inputs_and_outputs_as_bits():
    ref = dict(dtype="bf16", shape=(2, 3), strides=(3, 1))
    listing = Listing("copy", inputs=[TensorRef("x", Addr("state", 256), **ref)],
                      outputs=[TensorRef("x", Addr("state", 256), role="output", **ref)])
    x = some("bf16", 6).reshape(2, 3)
    (out,) = host_executor(listing, nccl_module()).run({"x": x})
    assert out.dtype == torch.bfloat16 and torch.equal(out.view(torch.int16),
                                                       x.view(torch.int16))


def all_reduce(name: str, count: int = 8) -> Call:
    return Call("nccl.allReduce", (("sendbuff", Addr("arena", 0)),
                                   ("recvbuff", Addr("arena", 256)), ("count", count),
                                   ("datatype", name), ("op", "avg"), ("comm", "axes0")))


@pytest.mark.parametrize("name", ["bf16", "f32", "c64"])
def test_an_average_without_ncclavg_is_the_sum_divided_by_the_group_size(name):
    ex = host_executor(Listing("avg"), nccl_module(OLD | {"NCCL_BFLOAT16": 9}), name)
    x = some(name, 8)
    ex._view(Addr("arena", 0), name, (8,), (1,))[...] = host_array(x)
    ex.execute(all_reduce(name))
    per = 2 if name == "c64" else 1  # c64: float32 pairs
    assert ex.comms["axes0"].calls == [("allReduce", 8 * per, nccl_datatype(
        ex.nccl, name, "avg")[0], NCCL["NCCL_SUM"])]
    got = from_storage(torch.from_numpy(ex._view(Addr("arena", 256), name, (8,), (1,)).copy()),
                       name)
    want = (x * 4).float().div(4).to(x.dtype) if name == "bf16" else x * 4 / 4
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def test_a_grouped_average_is_divided_after_the_group_ends():
    ex = host_executor(Listing("avg"), nccl_module(OLD, groupStart=lambda: None,
                                                   groupEnd=lambda: None))
    ex._view(Addr("arena", 0), "f32", (8,), (1,))[...] = np.arange(8, dtype=np.float32)
    result = lambda: ex._view(Addr("arena", 256), "f32", (8,), (1,)).tolist()  # noqa: E731
    ex.execute(Call("nccl.groupStart", (("comm", "axes0"),)))
    ex.execute(all_reduce("f32"))
    assert result() == [4.0 * i for i in range(8)]  # the sum: the group has not run yet
    ex.execute(Call("nccl.groupEnd", (("comm", "axes0"),)))
    assert result() == [float(i) for i in range(8)]


def test_ncclavg_where_nccl_has_it():
    ex = host_executor(Listing("avg"), nccl_module())
    ex.execute(all_reduce("f32"))
    assert ex.comms["axes0"].calls == [("allReduce", 8, NCCL["NCCL_FLOAT32"], NCCL["NCCL_AVG"])]


# --------------------------------------------------------------- on a GPU (skipped without)

def _gpu() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None and torch.cuda.is_available()


needs_gpu = pytest.mark.skipif(not _gpu(), reason="needs CuPy and a CUDA GPU")

BF16_LINEAR = """
graph @main(%w: bf16[4,8] param, %b: bf16[4] param, %x: bf16[3,8] input) {
  %0 = linear(%x, %w, %b) : bf16[3,4]
  %1 = relu(%0) : bf16[3,4]
  %2 = mul(%1, 2.0) : bf16[3,4]
  return %2 output
}
"""


@pytest.mark.gpu
@needs_gpu
def test_a_bf16_listing_on_the_gpu_equals_its_cpu_run():
    from graphpar.backends.cuda.cpu_executor import CpuListingExecutor
    from graphpar.ir.parser import parse
    from graphpar.passes.lower_cuda import lower_to_listing

    listing = lower_to_listing(parse(BF16_LINEAR))
    g = torch.Generator().manual_seed(0)
    inputs = {"w": torch.randn(4, 8, generator=g).bfloat16(),
              "b": torch.randn(4, generator=g).bfloat16(),
              "x": torch.randn(3, 8, generator=g).bfloat16()}
    (want,) = CpuListingExecutor(listing).run(inputs)
    (got,) = GpuListingExecutor(listing).run(inputs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)  # bf16 tolerances: fp32 sums in another order


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["bf16", "f32"])
def test_an_average_on_the_gpu_without_ncclavg_is_the_sum_divided(name):
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    listing = Listing("avg", state_bytes=512,
                      inputs=[TensorRef("x", Addr("state", 0), name, (8,), (1,))],
                      calls=[Call("nccl.allReduce", (("sendbuff", Addr("state", 0)),
                                                     ("recvbuff", Addr("state", 256)),
                                                     ("count", 8), ("datatype", name),
                                                     ("op", "avg"), ("comm", "axes0")))],
                      outputs=[TensorRef("y", Addr("state", 256), name, (8,), (1,), "output")])
    ex = GpuListingExecutor(listing, {"axes0": comm})
    ex._nccl_module = SimpleNamespace(**{k: getattr(nccl, k) for k in OLD},
                                      NCCL_BFLOAT16=9)  # as an older CuPy: no NCCL_AVG
    x = some(name, 8)
    (got,) = ex.run({"x": x})
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(x))  # one rank: x / 1
