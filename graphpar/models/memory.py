"""Real weights for a model: a memory check before allocating them, the user's error after."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from graphpar.errors import OutOfMemoryError
from graphpar.units import format_bytes

T = TypeVar("T")

HOW_TO_AVOID = ("compiling needs no weights: leave out --run-cpu (and generate/run/step, which "
                "need them), or run a smaller preset (e.g. --example gpt:tiny --run-cpu 2); a "
                "sharding plan's per-device memory is bounded with --memory-limit")

_ALLOCATOR_FAILURES = ("can't allocate memory", "DefaultCPUAllocator", "not enough memory",
                       "out of memory")


def available_bytes() -> int | None:
    """Memory this process may still allocate (MemAvailable), or None where unknown."""
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
