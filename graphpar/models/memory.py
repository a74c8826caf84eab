"""Real weights for a model: a memory check before allocating them, the user's error after."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch.overrides import TorchFunctionMode

from graphpar.errors import OutOfMemoryError
from graphpar.units import format_bytes

T = TypeVar("T")

HOW_TO_AVOID = ("compiling needs no weights: leave out --run-cpu (and generate/run/step, which "
                "need them), or run a smaller preset (e.g. --example gpt:tiny --run-cpu 2); a "
                "sharding plan's per-device memory is bounded with --memory-limit")

_ALLOCATOR_FAILURES = ("can't allocate memory", "DefaultCPUAllocator", "not enough memory",
                       "out of memory")


def available_bytes() -> int | None:
    """Memory this process may still allocate, or None where unknown: the machine's
    MemAvailable, or less where a memory cgroup's limit (a container's) leaves less, since
    the kernel kills a process that passes its cgroup's limit whatever the machine has."""
    machine = _mem_available()
    cgroup = _cgroup_room()
    if machine is None or cgroup is None:
        return cgroup if machine is None else machine
    return min(machine, cgroup)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# (limit, usage) files of this process's memory cgroup: v2, then v1.
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                  "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _cgroup_room() -> int | None:
    """Bytes left under the memory cgroup's limit, or None where there is no limit."""
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 2**62:
            return None  # no limit (v1 writes a number near 2**63)
        return max(0, int(limit) - usage)
    return None


def out_of_memory(what: str, needed: int | None, available: int | None,
                  how_to_avoid: str = HOW_TO_AVOID) -> OutOfMemoryError:
    """The user's error for `what` not fitting: how many bytes, and how to avoid it."""
    need = f"{format_bytes(needed)} needed" if needed else "did not fit in memory"
    have = f", {format_bytes(available)} available" if available is not None else ""
    return OutOfMemoryError(f"{what}: {need}{have}; {how_to_avoid}")


def check_fits(what: str, needed: int) -> None:
    """Refuse, before allocating, `needed` bytes for `what` that the machine does not have."""
    available = available_bytes()
    if available is not None and needed > available:
        raise out_of_memory(what, needed, available)


@contextmanager
def allocating(what: str, needed: int | None = None, how_to_avoid: str = HOW_TO_AVOID
               ) -> Iterator[None]:
    """An allocator failure inside the block (torch's RuntimeError, Python's MemoryError)
    becomes the user's OutOfMemoryError naming `what`."""
    try:
        yield
    except MemoryError:
        raise out_of_memory(what, needed, available_bytes(), how_to_avoid) from None
    except RuntimeError as exc:
        if not any(s in str(exc) for s in _ALLOCATOR_FAILURES):
            raise
        raise out_of_memory(what, needed, available_bytes(), how_to_avoid) from None


# Allocations below this size are not checked: reading the free memory costs more than they do.
CHECKED_ALLOCATION = 1 << 24


class _CheckedAllocations(TorchFunctionMode):
    """Each tensor constructor asking for CHECKED_ALLOCATION bytes or more on the CPU is first
    made on the meta device to learn its size, then refused when that is more than the memory
    left: the user's error, where the kernel would otherwise kill the process a little later
    (Linux hands out memory on the first touch, so torch.empty of too much succeeds)."""

    def __init__(self, what: str, how_to_avoid: str) -> None:
        super().__init__()
        self.what, self.how_to_avoid, self.made = what, how_to_avoid, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _constructors() or not _on_cpu(kwargs.get("device")):
            return func(*args, **kwargs)
        shape = func(*args, **{**kwargs, "device": "meta"})
        size = shape.numel() * shape.element_size() if isinstance(shape, torch.Tensor) else 0
        if size >= CHECKED_ALLOCATION:
            available = available_bytes()
            if available is not None and size > available:
                raise out_of_memory(f"{self.what} (one tensor {list(shape.shape)} "
                                    f"{str(shape.dtype).removeprefix('torch.')}, after "
                                    f"{format_bytes(self.made)} made)", size, available,
                                    self.how_to_avoid)
        self.made += size
        return func(*args, **kwargs)


def _constructors() -> set:
    from torch.utils._device import _device_constructors  # the set torch.device(...) redirects

    return _device_constructors()


def _on_cpu(device) -> bool:
    """Whether a constructor's `device=` makes a CPU tensor (None: the default, the CPU)."""
    if device is None:
        return torch.get_default_device().type == "cpu"
    return torch.device(device).type == "cpu"


@contextmanager
def checked_allocations(what: str, how_to_avoid: str = HOW_TO_AVOID) -> Iterator[None]:
    """Inside the block, a tensor constructor that would take more CPU memory than is left
    raises the user's OutOfMemoryError (naming `what` and the tensor) before it allocates,
    and an allocator failure becomes one (`allocating`)."""
    with allocating(what, how_to_avoid=how_to_avoid), _CheckedAllocations(what, how_to_avoid):
        yield


def materialize(what: str, needed: int, make: Callable[[], T]) -> T:
    """`make()`, after checking that `needed` bytes fit, its allocator failures the user's."""
    check_fits(what, needed)
    with allocating(what, needed):
        return make()


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each tied tensor once."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def initialize_on_cpu(module: torch.nn.Module) -> torch.nn.Module:
    """A module built on the meta device, given real CPU weights in place the way it
    initializes itself: every submodule's `reset_parameters()`, then the root's
    `init_weights()` (torchtitan's models, HF's PreTrainedModel) when it has one. Tied
    weights stay tied."""
    aliases = _aliases(module)
    module.to_empty(device="cpu")
    for name, first in aliases:  # to_empty gives each name of a shared tensor its own copy
        owner, _, attr = name.rpartition(".")
        first_owner, _, first_attr = first.rpartition(".")
        setattr(module.get_submodule(owner), attr,
                getattr(module.get_submodule(first_owner), first_attr))
    with torch.no_grad():
        for sub in module.modules():
            if callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()
        if callable(getattr(module, "init_weights", None)):
            module.init_weights()
    return module


def _aliases(module: torch.nn.Module) -> list[tuple[str, str]]:
    """(name, first name) for each name of a parameter or buffer that is not its first."""
    first: dict[int, str] = {}
    aliases = []
    for name, tensor in (*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)):
        if id(tensor) in first:
            aliases.append((name, first[id(tensor)]))
        else:
            first[id(tensor)] = name
    return aliases
