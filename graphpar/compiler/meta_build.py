"""A model file's build() run on the meta device: shapes and dtypes, no weights, no data.

Planning reads only shapes, so `graphpar compile` (without --run-cpu), `explain`, `viz` and
placement run the user's plain `build()` under `on_meta()`: every tensor it makes is a meta
tensor, also one it asks for on the CPU (`torch.randn(8, 16, device="cpu")`) or a GPU, and
moving a meta tensor (`.to("cpu")`, `.cuda()`) keeps it on meta. This is what
`torch.device("meta")` does for tensors made without a device, extended to the ones made
with one, as torch's fake mode would; torchtitan builds its models the same way. A build that
needs data (`.item()`, a branch on a value) fails there, and the loader falls back to a real
build after a memory check (`graphpar.compiler.model_file`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors


def _is_device(value) -> bool:
    if isinstance(value, torch.device):
        return True
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError:
            return False
        return True
    return False


class _OnMeta(TorchFunctionMode):
    """Constructors make meta tensors whatever device they name; a meta tensor's moves stay
    on meta. Counts the bytes the constructors' tensors would have taken (`made`)."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _device_constructors():
            kwargs["device"] = "meta"
            made = func(*args, **kwargs)
            if isinstance(made, torch.Tensor):
                self.made += made.numel() * made.element_size()
            return made
        if func in (torch.Tensor.cpu, torch.Tensor.cuda) and args[0].is_meta:
            return args[0]
        if func is torch.Tensor.to and args[0].is_meta:
            args = tuple("meta" if i and _is_device(a) else a for i, a in enumerate(args))
            if "device" in kwargs:
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[_OnMeta]:
    """Inside the block every tensor made is a meta tensor; the yielded object's `made` is
    the bytes they would have taken (a lower bound of a real build's when the block fails
    part way)."""
    mode = _OnMeta()
    with mode:
        yield mode
