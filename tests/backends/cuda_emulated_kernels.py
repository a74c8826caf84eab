"""The generated kernels' own CUDA C, built for the host with tests/backends' CUDA emulation
header (one fiber per CUDA thread), called from the CPU executor in place of its torch
interpretation of each kernel call."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from graphpar.backends.cuda.codegen import kernel_arguments, launch_shape, module_source
from graphpar.backends.cuda.cpu_executor import CpuListingExecutor
from graphpar.errors import BackendError
from graphpar.ir.cuda_listing import Call, Listing

HERE = Path(__file__).resolve().parent

# What the generated kernels use beyond the emulation header's CUDA subset.
SHIM = r"""
#define GP_HOST_EMULATION 1
#include "cuda_host_emulation.h"
#include <utility>
using std::exp; using std::log; using std::sqrt;
template <typename T> T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline __half __float2half(float x) { return __float2half_rn(x); }
inline __nv_bfloat16 __float2bfloat16(float x) { return __float2bfloat16_rn(x); }
inline float __bfloat162float(__nv_bfloat16 h) {
  unsigned u = static_cast<unsigned>(h.bits) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
template <typename... P, size_t... I>
void gp_apply(void (*f)(P...), void** a, std::index_sequence<I...>) {
  f(static_cast<P>(a[I])...);
}
template <typename... P>
const char* gp_launch(void (*f)(P...), void** args, unsigned blocks, unsigned threads) {
  static void (*kernel)(P...);
  static void** kernel_args;
  kernel = f;
  kernel_args = args;
  gridDim.x = blocks;
  blockDim.x = threads;
  for (unsigned b = 0; b < blocks; ++b) {
    blockIdx.x = b;
    const char* error = emu::run_block(static_cast<int>(threads), [](void*) {
      gp_apply(kernel, kernel_args, std::index_sequence_for<P...>{});
    }, nullptr);
    if (error) return error;
  }
  return nullptr;
}
"""


def build(listing: Listing, directory: Path) -> ctypes.CDLL:
    """The listing's kernels and one `launch_<name>(args, blocks, threads)` each, as a shared
    library built by g++."""
    names = listing.kernels()
    launchers = "\n".join(
        f'extern "C" const char* launch_{n}(void** a, unsigned b, unsigned t) '
        f"{{ return gp_launch({n}, a, b, t); }}" for n in names)
    source = directory / "kernels_host.cpp"
    source.write_text(SHIM + module_source(listing) + "\n" + launchers + "\n")
    library = directory / "kernels_host.so"
    result = subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w",
                             f"-I{HERE}", "-o", str(library), str(source)],
                            capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"g++ failed:\n{result.stderr[:4000]}")
    lib = ctypes.CDLL(str(library))
    for n in names:
        getattr(lib, f"launch_{n}").restype = ctypes.c_char_p
    return lib


class EmulatedKernelExecutor(CpuListingExecutor):
    """The CPU executor with every `kernel.*` call run by its own CUDA C on the host."""

    def __init__(self, listing: Listing, library: ctypes.CDLL, **kw) -> None:
        super().__init__(listing, **kw)
        self.library = library
        self.launched = 0

    def execute(self, index: int, call: Call) -> None:
        if not call.kind.startswith("kernel."):
            return super().execute(index, call)
        pointers = [self.regions[call[k].region].data_ptr() + call[k].offset
                    for k in kernel_arguments(call)]
        args = (ctypes.c_void_p * len(pointers))(*pointers)
        blocks, threads = launch_shape(call)
        error = getattr(self.library, f"launch_{call['name']}")(args, blocks, threads)
        if error:
            raise BackendError(f"kernel {call['name']}: {error.decode()}")
        self.launched += 1
