"""Tensor types of the IR: a shape of ints and a dtype, printed as `f32[8,1024,768]`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Short names used in the IR text, in both directions.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no graphpar IR name") from None


@dataclass(frozen=True)
class TensorType:
    """The static type of a value: a tuple of dimension sizes and a torch dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorType:
        return cls(tuple(tensor.shape), tensor.dtype)

    def meta(self) -> torch.Tensor:
        """An empty tensor of this type on the meta device, for shape inference."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}[{','.join(map(str, self.shape))}]"
