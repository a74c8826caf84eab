"""C building blocks shared by the generated kernels' sources: storage types, loads and stores
of half types through float, literals, and the grid-stride loop every elementwise-style kernel
uses."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["BLOCK", "STORAGE", "compute_type", "grid_stride", "literal", "load", "store"]

BLOCK = 256  # threads per block of every generated kernel

STORAGE = {"f32": "float", "f64": "double", "f16": "__half", "bf16": "__nv_bfloat16",
           "i64": "long long", "i32": "int", "i16": "short", "i8": "signed char",
           "u8": "unsigned char", "bool": "bool"}

def compute_type(dtype: str) -> str:
    """The C type arithmetic runs in: half types compute in float."""
    return "float" if dtype in ("f16", "bf16") else STORAGE[dtype]


def load(dtype: str, expr: str) -> str:
    if dtype == "f16":
        return f"__half2float({expr})"
    if dtype == "bf16":
        return f"__bfloat162float({expr})"
    return expr


def store(dtype: str, expr: str) -> str:
    if dtype == "f16":
        return f"__float2half({expr})"
    if dtype == "bf16":
        return f"__float2bfloat16({expr})"
    return f"({STORAGE[dtype]})({expr})"


def literal(value: Any, ctype: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and ctype not in ("float", "double"):
        return f"({ctype})({value}LL)"
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        bits = {"float": ("__int_as_float", {1: "0x7f800000", -1: "0xff800000", 0: "0x7fc00000"}),
                "double": ("__longlong_as_double", {1: "0x7ff0000000000000LL",
                                                    -1: "0xfff0000000000000LL",
                                                    0: "0x7ff8000000000000LL"})}
        fn, table = bits.get(ctype, bits["float"])
        sign = 0 if math.isnan(v) else (1 if v > 0 else -1)
        return f"({ctype}){fn}({table[sign]})"
    text = repr(v)
    return f"{text}f" if ctype == "float" else f"({ctype}){text}"


def grid_stride(name: str, params: list[str], n: int, body: list[str]) -> str:
    inner = "\n".join("    " + line for line in body)
    return (f'extern "C" __global__ void {name}({", ".join(params)}) {{\n'
            f"  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < {n}LL;\n"
            f"       i += (long long)gridDim.x * blockDim.x) {{\n{inner}\n  }}\n}}\n")


