"""nvcc builds paged_attention.cu for Ampere (sm_80) and Hopper (sm_90) without a warning.

Needs nvcc, not a GPU. Each architecture is compiled once (about 8 s each on 2 cores).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest

from graphpar.backends.cuda.paged_attention import SOURCE_PATH, kernel_names

NVCC = shutil.which("nvcc")
requires_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


@pytest.fixture(scope="module", params=["sm_80", "sm_90"])
def build(request, tmp_path_factory):
    arch = request.param
    cubin = tmp_path_factory.mktemp(arch) / "paged_attention.cubin"
    cmd = [
        NVCC, "--cubin", f"-arch={arch}", "-std=c++17", "-O3", "-Werror", "all-warnings",
        "-o", str(cubin), str(SOURCE_PATH),
    ]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    print(f"nvcc {arch}: {seconds:.1f} s")
    return arch, result, cubin, seconds


@requires_nvcc
def test_compiles_without_warnings(build):
    arch, result, _, _ = build
    assert result.returncode == 0, f"nvcc -arch={arch} failed:\n{result.stderr}"
    assert "warning" not in (result.stdout + result.stderr).lower()


@requires_nvcc
def test_every_entry_point_is_exported_by_name(build):
    """CuPy finds kernels by their unmangled names, so each must be in the cubin as is."""
    _, result, cubin, _ = build
    assert result.returncode == 0
    data = cubin.read_bytes()
    missing = [name for name in kernel_names() if name.encode() + b"\0" not in data]
    assert not missing, f"not in the cubin: {missing}"


def test_source_includes_only_headers_nvrtc_has():
    """CuPy compiles with NVRTC, which has no host C/C++ headers: only CUDA's fp16/bf16 ones."""
    includes = re.findall(r"^\s*#\s*include\s*[<\"]([^>\"]+)", SOURCE_PATH.read_text(), re.M)
    assert set(includes) <= {"cuda_fp16.h", "cuda_bf16.h"}, includes
